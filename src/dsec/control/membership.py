"""Which edges belong to the cluster: bootstrap tokens, join, get, remove (docs/CONTROL.md, "Edges").

- **Bootstrap tokens** (``dsb_`` + 32 random bytes) are minted by an operator
  (the root project's token), stored as SHA-256 like API tokens, expire
  (``ttl_s``) and allow ``uses`` joins (None: any number until they expire or
  are revoked). A join presents one and gets the cluster key, an edge id and
  the control-plane addresses: everything the edge needs, so no key is copied
  to a new host by hand.
- **Remove** (``DELETE /v1/edges/{id}``) is refused while the edge holds live
  sandboxes unless ``force``: then they are declared lost (quota returned, the
  SDK raises ``SandboxLost``) and the edge's epoch is raised, so if the node
  ever reports again it is fenced. A removed edge's reports are refused (403)
  until it joins again; its row stays (``removed``) so a late report cannot
  re-register it.

The ``*_txn`` functions run inside one store transaction; :func:`router` is the HTTP part.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated

import sqlalchemy as sa
from fastapi import APIRouter, Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from dsec.control import validate
from dsec.control.db import EdgeRow, EdgeToken, Project, Replica, SandboxRow
from dsec.control.edges import check_edge_id, edge_info, get_edge
from dsec.control.locking import add_new, lock_one
from dsec.errors import AuthError, Conflict, InvalidSpec, NotFound
from dsec.http.auth import hash_api_token
from dsec.spec import SandboxState
from dsec.spec.api import CreateEdgeToken, EdgeInfo, EdgeJoin, EdgeJoined, EdgeTokenInfo

if TYPE_CHECKING:
    from dsec.control.service import Control

log = logging.getLogger("dsec.control.membership")

BOOTSTRAP_PREFIX = "dsb_"
S = SandboxState


# ---------------------------------------------------------------- tokens ----


def _token_info(t: EdgeToken, secret: str | None = None) -> EdgeTokenInfo:
    return EdgeTokenInfo(id=t.id, name=t.name, created_at=t.created_at, expires_at=t.expires_at, uses=t.uses,
                         used=t.used, revoked_at=t.revoked_at, token=secret)


def create_token_txn(s: Session, body: CreateEdgeToken) -> EdgeTokenInfo:
    secret = BOOTSTRAP_PREFIX + secrets.token_urlsafe(32)
    now = time.time()
    t = EdgeToken(id=secrets.token_hex(8), hash=hash_api_token(secret), name=body.name, created_at=now,
                  expires_at=now + body.ttl_s, uses=body.uses, used=0)
    s.add(t)
    s.flush()
    log.info("edge bootstrap token %s made (%s uses, expires in %gs)", t.id, body.uses or "any", body.ttl_s)
    return _token_info(t, secret)


def list_tokens_txn(s: Session) -> list[EdgeTokenInfo]:
    return [_token_info(t) for t in s.execute(sa.select(EdgeToken).order_by(EdgeToken.created_at)).scalars()]


def revoke_token_txn(s: Session, token_id: str) -> None:
    t = s.get(EdgeToken, token_id, with_for_update=True)
    if t is None:
        raise NotFound(f"no edge bootstrap token {token_id!r}", token_id=token_id)
    if t.revoked_at is None:
        t.revoked_at = time.time()


def _use_token(s: Session, secret: str) -> EdgeToken:
    if not secret.startswith(BOOTSTRAP_PREFIX) or len(secret) > 256:
        raise AuthError("joining needs an edge bootstrap token (dsb_...: `dsec token create --edge-bootstrap`)")
    t = lock_one(s, sa.select(EdgeToken).where(EdgeToken.hash == hash_api_token(secret)),
                 lambda: AuthError("unknown edge bootstrap token"))
    now = time.time()
    if t.revoked_at is not None:
        raise AuthError(f"edge bootstrap token {t.id} was revoked", token_id=t.id)
    if now >= t.expires_at:
        raise AuthError(f"edge bootstrap token {t.id} expired", token_id=t.id)
    if t.uses is not None and t.used >= t.uses:
        raise AuthError(f"edge bootstrap token {t.id} was used up ({t.used} of {t.uses} joins)", token_id=t.id)
    t.used += 1
    return t


# ------------------------------------------------------------------ join ----


def join_txn(s: Session, secret: str, body: EdgeJoin, *, key: bytes, urls: list[str]) -> EdgeJoined:
    """Spend one use of the token and make the edge's row (``dead`` until its first report)."""
    if not body.url.startswith(("http://", "https://")):
        raise InvalidSpec(f"edge url {body.url!r} must be http(s)://host:port", field="url")
    tok = _use_token(s, secret)
    now = time.time()
    edge_id = body.edge_id
    if edge_id is not None:
        check_edge_id(edge_id)
        e = s.get(EdgeRow, edge_id, with_for_update=True)
        if e is not None and e.status != "removed":
            raise Conflict(f"edge id {edge_id!r} belongs to a registered edge ({e.status}): pick another, or "
                           f"remove it first (dsec edge rm {edge_id})", edge_id=edge_id)
        if e is not None:  # a removed id joins again: whatever the node held before is fenced
            e.status, e.url, e.health, e.last_seen, e.misses, e.draining = "dead", body.url.rstrip("/"), None, None, 0, False
            e.registered_at = now
            e.epoch = int(e.epoch or 0) + 1
            log.info("edge %s joins again (token %s); epoch %d", edge_id, tok.id, e.epoch)
            return EdgeJoined(edge_id=edge_id, cluster_key=key.hex(), control_plane_urls=urls, epoch=e.epoch)
    for _ in range(20):
        eid = edge_id or "n" + secrets.token_hex(3)
        row = EdgeRow(id=eid, url=body.url.rstrip("/"), registered_at=now, status="dead", misses=0, draining=False,
                      committed_sandboxes=0, committed_cpu_m=0, committed_memory=0, committed_disk=0, epoch=0)
        if add_new(s, row):
            log.info("edge %s joined (token %s) at %s", eid, tok.id, body.url)
            return EdgeJoined(edge_id=eid, cluster_key=key.hex(), control_plane_urls=urls, epoch=0)
        if edge_id is not None:
            raise Conflict(f"edge id {edge_id!r} was taken by a concurrent join", edge_id=edge_id)
    raise Conflict("could not find a free edge id: give one (--edge-id)")


def replica_urls_txn(s: Session, *, own: str | None, fresh_s: float) -> list[str]:
    """This replica's address first, then every other replica heard from lately."""
    since = time.time() - fresh_s
    urls = [own] if own else []
    for u in s.execute(sa.select(Replica.url).where(Replica.seen_at >= since).order_by(Replica.started_at)).scalars():
        if u and u not in urls:
            urls.append(u)
    return urls


# ---------------------------------------------------------------- remove ----


def declare_lost(s: Session, e: EdgeRow, reason: str, now: float) -> int:
    """Every live sandbox of ``e`` is lost (a reservation is dropped, a deletion in flight is
    done), its quota and the edge's room return, and the edge's epoch goes up: if the edge
    reports again, it destroys them before it gets new work. Returns how many were lost."""
    from dsec.control.ledger import LIVE, Ledger, forget, move

    ledger = Ledger()
    n = 0
    for row in s.execute(
        sa.select(SandboxRow).where(SandboxRow.edge_id == e.id, SandboxRow.state.in_(LIVE)).with_for_update()
    ).scalars():
        if row.id is None:
            forget(s, row, ledger)
        elif row.state == S.STOPPING.value:
            move(row, S.STOPPED, ledger, reason=f"deleted; {reason}")
        else:
            move(row, S.LOST, ledger, reason=reason)
            n += 1
    ledger.flush(s)
    e.epoch = int(e.epoch or 0) + 1
    e.lost_at = now
    return n


def remove_txn(s: Session, edge_id: str, *, force: bool) -> EdgeInfo:
    e = get_edge(s, edge_id, lock=True)
    if e.status == "removed":
        return edge_info(e)
    live = s.execute(
        sa.select(sa.func.count()).where(SandboxRow.edge_id == edge_id, SandboxRow.state.in_(
            (S.CREATING.value, S.RUNNING.value, S.PAUSED.value, S.FAILED.value)))
    ).scalar_one()
    if live and not force:
        raise Conflict(f"edge {edge_id} still holds {live} sandbox(es): drain it first (dsec edge drain {edge_id} "
                       "--wait), or remove it anyway with --force (they are reported lost)", edge_id=edge_id,
                       sandboxes=int(live))
    n = declare_lost(s, e, f"edge {edge_id} was removed from the cluster", time.time()) if live or force else 0
    e.status = "removed"
    e.draining = True
    log.warning("edge %s removed (%d sandboxes declared lost)", edge_id, n)
    return edge_info(e)


def edge_sandboxes_txn(s: Session, edge_id: str) -> dict[str, int]:
    """Live sandboxes on an edge by state (what a drain waits for)."""
    get_edge(s, edge_id)
    rows = s.execute(
        sa.select(SandboxRow.state, sa.func.count()).where(
            SandboxRow.edge_id == edge_id, SandboxRow.state.in_(
                (S.CREATING.value, S.RUNNING.value, S.PAUSED.value, S.STOPPING.value, S.FAILED.value)))
        .group_by(SandboxRow.state)
    ).all()
    return {str(state): int(n) for state, n in rows}


def project_name(s: Session, project_id: int) -> str:
    p = s.get(Project, project_id)
    return p.name if p is not None else ""


# ------------------------------------------------------------------ HTTP ----

_bearer = HTTPBearer(auto_error=False, description="An edge bootstrap token (dsb_...)")


def router(operator: Callable[..., Awaitable[str]]) -> APIRouter:
    """``operator``: app.py's dependency admitting the root project's token or an edge-admin token."""
    r = APIRouter(tags=["edges"])
    op = Depends(operator)  # a default, not an annotation: annotations here are strings (PEP 563)

    def ctl(request: Request) -> Control:
        c: Control = request.app.state.ctl
        return c

    @r.post("/v1/edges/tokens", status_code=201)
    async def create_edge_token(request: Request, body: CreateEdgeToken, _: str = op) -> EdgeTokenInfo:
        """A bootstrap token for ``dsec edge join`` (the secret is in this answer only)."""
        validate.text(body.name, "name", max_len=128)  # a NUL would be PostgreSQL's 500, not our 422
        return await ctl(request).db.write(lambda s: create_token_txn(s, body))

    @r.get("/v1/edges/tokens")
    async def list_edge_tokens(request: Request, _: str = op) -> list[EdgeTokenInfo]:
        return await ctl(request).db.read(list_tokens_txn)

    @r.delete("/v1/edges/tokens/{token_id}", status_code=204)
    async def revoke_edge_token(request: Request, token_id: str, _: str = op) -> None:
        if len(token_id) > 32:
            raise NotFound(f"no edge bootstrap token {token_id[:40]!r}", token_id=token_id[:40])
        await ctl(request).db.write(lambda s: revoke_token_txn(s, token_id))

    @r.post("/v1/edges/join")
    async def join_edge(
        request: Request, body: EdgeJoin, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
    ) -> EdgeJoined:
        """A new edge presents a bootstrap token and gets its id, the cluster key and the
        control-plane addresses (``dsec edge join``). Over plain http the key crosses the
        network in clear: join over https, or on a trusted network."""
        if cred is None or not cred.credentials:
            raise AuthError("missing credentials: send 'Authorization: Bearer dsb_...' (an edge bootstrap token)")
        c = ctl(request)
        validate.text(body.url, "url", max_len=512)
        own = c.url
        urls = await c.db.read(lambda s: replica_urls_txn(s, own=own, fresh_s=c.config.replica_dead_after_s))
        joined = await c.db.write(lambda s: join_txn(s, cred.credentials, body, key=c.key, urls=urls))
        c.directory.put(joined.edge_id, body.url.rstrip("/"))
        return joined

    @r.get("/v1/edges/{edge_id}")
    async def get_edge_info(request: Request, edge_id: str, _: str = op) -> EdgeInfo:
        check_edge_id(edge_id)
        return await ctl(request).db.read(lambda s: edge_info(get_edge(s, edge_id)))

    @r.get("/v1/edges/{edge_id}/sandboxes")
    async def edge_sandbox_counts(request: Request, edge_id: str, _: str = op) -> dict[str, int]:
        """Live sandboxes on the edge by state (``dsec edge drain --wait`` polls this)."""
        check_edge_id(edge_id)
        return await ctl(request).db.read(lambda s: edge_sandboxes_txn(s, edge_id))

    @r.delete("/v1/edges/{edge_id}")
    async def remove_edge(
        request: Request, edge_id: str, _: str = op,
        force: Annotated[bool, Query(description="remove even with live sandboxes (reported lost)")] = False,
    ) -> EdgeInfo:
        """Take the edge out of the cluster (409 while it holds sandboxes, unless ``force``)."""
        check_edge_id(edge_id)
        info = await ctl(request).db.write(lambda s: remove_txn(s, edge_id, force=force))
        ctl(request).directory.forget(edge_id)
        return info

    return r
