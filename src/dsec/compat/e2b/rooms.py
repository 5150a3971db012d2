"""What the E2B front holds per sandbox: a handle for the data path, the processes it
started (E2B's pids, output fan-out) and the sandbox's E2B settings.

A :class:`Room` is made from an envd access token alone (keys.py): the sandbox id names its
edge (``<edge>-...``), the cluster key mints a data-path token for it, so any replica can
serve any sandbox's envd plane without reading the store. Processes are this replica's:
``commands.list``/``connect`` see the processes started through it (docs/COMPAT.md).

A process is one attached command on its edge (``AsyncSandbox.attach``/``pty``: streamed
stdin, output as produced, signals, resize); the front owns that connection, so the process
outlives the client's stream (E2B's background commands) and ends with its command, a kill,
or the sandbox. Never blocks the event loop; every task it starts is cancelled by ``aclose``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec.compat.e2b import keys
from dsec.errors import AuthError, DsecError, InvalidSpec, SandboxNotFound
from dsec.http import auth

if TYPE_CHECKING:
    from dsec.sdk.client import AsyncClient, AsyncSandbox
    from dsec.sdk.terminal import AsyncTerminal

log = logging.getLogger("dsec.compat.e2b")

DATA_TOKEN_TTL_S = 3600.0
ENVS_PATH = "/etc/dsec-e2b/envs.json"
"""The sandbox's ``envVars`` from its create, for every process (written by the create's setup)."""
USER_UID = 1000
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
            "E2B_SANDBOX": "true"}
HISTORY_EVENTS = 0
"""Connect streams what comes after it (as envd does): no replay."""


@dataclass(frozen=True, slots=True)
class User:
    name: str
    uid: int
    gid: int
    home: str


ROOT = User("root", 0, 0, "/root")


@dataclass(slots=True)
class Event:
    """One process event for its subscribers."""

    kind: str  # "stdout" | "stderr" | "pty" | "end"
    data: bytes = b""
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = None


@dataclass
class Proc:
    pid: int
    tag: str | None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    tty: bool
    term: AsyncTerminal
    subscribers: set[asyncio.Queue[Event]] = field(default_factory=set)
    ended: Event | None = None
    pump: asyncio.Task[None] | None = None
    killer: asyncio.TimerHandle | None = None

    def subscribe(self) -> asyncio.Queue[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        if self.ended is not None:
            q.put_nowait(self.ended)
        else:
            self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[Event]) -> None:
        self.subscribers.discard(q)

    def publish(self, ev: Event) -> None:
        for q in self.subscribers:
            q.put_nowait(ev)
        if ev.kind == "end":
            self.ended = ev
            self.subscribers.clear()


class Room:
    """One sandbox as the front serves it."""

    def __init__(self, sandbox_id: str, project: str, envd_token: str, handle: AsyncSandbox) -> None:
        self.id = sandbox_id
        self.project = project
        self.envd_token = envd_token
        self.handle = handle
        self.procs: dict[int, Proc] = {}
        self.envs: dict[str, str] | None = None
        self.users: dict[str, User] = {"root": ROOT, "user": User("user", USER_UID, USER_UID, "/home/user")}
        self.extras: dict[str, Any] = {}
        """Other surfaces' state (code-interpreter contexts, watchers), closed with the room."""
        self.closers: list[Callable[[], Awaitable[None]]] = []
        self.used = time.monotonic()

    async def sandbox_envs(self) -> dict[str, str]:
        if self.envs is None:
            try:
                self.envs = dict(json.loads(await self.handle.files.read(ENVS_PATH)))
            except (DsecError, ValueError, TypeError):
                self.envs = {}
        return self.envs

    async def user(self, name: str | None, default: str) -> User:
        """``root``, ``user`` (uid 1000, home /home/user) or a user of the sandbox's /etc/passwd."""
        name = name or default
        got = self.users.get(name)
        if got is not None:
            return got
        try:
            passwd = (await self.handle.files.read("/etc/passwd")).decode(errors="replace")
        except DsecError:
            passwd = ""
        for line in passwd.splitlines():
            parts = line.split(":")
            if len(parts) >= 6 and parts[0] == name and parts[2].isdigit() and parts[3].isdigit():
                user = User(name, int(parts[2]), int(parts[3]), parts[5] or "/")
                self.users[name] = user
                return user
        raise InvalidSpec(f"user {name!r} does not exist in sandbox {self.id} (its /etc/passwd)", field="user")

    async def env_for(self, user: User, extra: dict[str, str]) -> dict[str, str]:
        return {**BASE_ENV, "HOME": user.home, "USER": user.name, "LOGNAME": user.name, "E2B_SANDBOX_ID": self.id,
                **(await self.sandbox_envs()), **extra}

    def add_proc(self, proc: Proc) -> None:
        self.procs[proc.pid] = proc

    def find(self, pid: int | None, tag: str | None) -> Proc | None:
        if pid is not None:
            return self.procs.get(pid)
        for p in self.procs.values():
            if tag is not None and p.tag == tag:
                return p
        return None

    async def aclose(self) -> None:
        for proc in list(self.procs.values()):
            if proc.pump is not None:
                proc.pump.cancel()
            if proc.killer is not None:
                proc.killer.cancel()
            with contextlib.suppress(Exception):
                await proc.term.close()
        self.procs.clear()
        for close in self.closers:
            with contextlib.suppress(Exception):
                await close()
        self.closers.clear()


class Rooms:
    """Rooms by sandbox id, made on the first request that proves its access token."""

    def __init__(self, key: bytes, edge_url: Callable[[str], Awaitable[str | None]], client: AsyncClient,
                 setups: dict[str, asyncio.Task[None]] | None = None) -> None:
        self._key = key
        self._setups = setups if setups is not None else {}
        self._edge_url = edge_url
        self._client = client
        """Carries every data-path call (its edge connection pools); it never calls the control plane."""
        self._rooms: dict[str, Room] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def known(self) -> list[Room]:
        return list(self._rooms.values())

    async def get(self, sandbox_id: str, access_token: str | None) -> Room:
        if not access_token:
            raise AuthError(f"no X-Access-Token for sandbox {sandbox_id} (the API's envdAccessToken)")
        claims = keys.verify_envd_token(self._key, access_token, sandbox_id)
        setup = self._setups.get(sandbox_id)
        if setup is not None:
            await asyncio.shield(setup)  # the create's setup: user and envVars before any process
        room = self._rooms.get(sandbox_id)
        if room is not None and room.envd_token == access_token:
            self._refresh(room)
            room.used = time.monotonic()
            return room
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            room = self._rooms.get(sandbox_id)
            if room is None:
                room = await self._make(sandbox_id, claims.project, access_token)
                self._rooms[sandbox_id] = room
        self._locks.pop(sandbox_id, None)
        return room

    async def _make(self, sandbox_id: str, project: str, access_token: str) -> Room:
        from dsec.control.edges import edge_of
        from dsec.sdk.client import AsyncSandbox
        from dsec.spec import SandboxState
        from dsec.spec.api import SandboxInfo

        edge = edge_of(sandbox_id)
        url = await self._edge_url(edge)
        if url is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} was not found (no edge {edge!r})", sandbox_id=sandbox_id)
        token, exp = auth.mint(self._key, sandbox_id=sandbox_id, project=project, ttl_s=DATA_TOKEN_TTL_S)
        info = SandboxInfo(id=sandbox_id, state=SandboxState.RUNNING, edge_id=edge, edge_url=url, token=token,
                           token_expires_at=exp, project=project, created_at=time.time())
        return Room(sandbox_id, project, access_token, AsyncSandbox(self._client, info))

    def _refresh(self, room: Room) -> None:
        info = room.handle.info
        if info.token_expires_at is not None and info.token_expires_at - time.time() < DATA_TOKEN_TTL_S / 4:
            token, exp = auth.mint(self._key, sandbox_id=room.id, project=room.project, ttl_s=DATA_TOKEN_TTL_S)
            room.handle.info = info.model_copy(update={"token": token, "token_expires_at": exp})

    async def forget(self, sandbox_id: str) -> None:
        room = self._rooms.pop(sandbox_id, None)
        if room is not None:
            await room.aclose()

    def by_signature(self, check: Callable[[Room], bool]) -> Room | None:
        """The known room whose token makes a signed file URL's signature (such URLs carry no id)."""
        for room in self._rooms.values():
            if check(room):
                return room
        return None

    async def aclose(self) -> None:
        for sid in list(self._rooms):
            await self.forget(sid)
