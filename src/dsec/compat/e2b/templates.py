"""E2B's template builds (``Template.build``: ``from_image``, ``run_cmd``, ``set_envs``...) as
DSec builds: a sandbox of the base image runs the steps, its disk changes become a snapshot
layer (``e2b-<name>:<tag>``, the caller's project's, in its storage quota), and the template
name then starts sandboxes of that layer.

The calls, as the released client makes them (``e2b/template_sync/build_api.py``):

1. ``POST /v3/templates`` ``{name, tags, cpuCount, memoryMB}`` -> 202 ``{templateID, buildID, ...}``;
2. ``GET /templates/{id}/files/{hash}`` for each ``COPY`` -> ``{present: false}`` with no upload
   URL (the client then uploads nothing; the build fails at that step: COPY is not served);
3. ``POST /v2/templates/{id}/builds/{build}`` with the steps -> 202, the build starts;
4. ``GET /templates/{id}/builds/{build}/status?logsOffset=`` until ``ready`` or ``error``
   (``reason: {message, step}``: the client raises ``BuildException(message)``).

The base (``fromImage``/``fromTemplate``) resolves, in order, through ``e2b.images`` (E2B's own
names, ``e2bdev/base`` -> ``base``), the front's templates, the templates built here, and the
layers the cluster can run (``GET /v1/images``). The front fetches nothing from outside
registries: another image is a build error that says how to bring it in (``dsec image import``).

Build records are this replica's memory (bounded); the templates are the project's snapshots,
so any replica finds them by name. Never blocks the event loop; every build's sandbox is
deleted when its build ends, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsec.compat.e2b.common import USER_SETUP
from dsec.compat.e2b.config import E2BConfig, E2BTemplate
from dsec.errors import DsecError

if TYPE_CHECKING:
    from dsec.compat.e2b.rest import E2BApi
    from dsec.sdk.client import AsyncClient, AsyncSandbox

log = logging.getLogger("dsec.compat.e2b")

SNAPSHOT_PREFIX = "e2b-"
DEFAULT_TAG = "default"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,119}$")
_TAG = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
BUILD_LABEL = ("dsec.compat", "e2b-build")
MAX_BUILDS = 256
"""Build records kept per replica (the oldest finished ones go first)."""
MAX_LOG_ENTRIES = 5000
MAX_STEPS = 256
BUILD_TIMEOUT_S = 1800.0
MAX_CONTEXT = 1 << 30
"""Bytes of one COPY step's uploaded tar at most."""
MAX_CONTEXTS = 64
"""Uploaded tars kept per replica (the oldest go first; a build whose tar went re-uploads it)."""
CONTEXT_URL_TTL_S = 3600.0
_HASH = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_COPY = r"""
set -e
scratch=$1 src=$2 dest=$3 owner=$4 mode=$5
cd "$scratch"
set -f; set -- $src; set +f          # the source as the shell sees it, then each glob
items=""
for pat in "$@"; do
  for f in $pat; do
    [ -e "$f" ] || [ -L "$f" ] || { echo "COPY: nothing matches $src" >&2; exit 3; }
    items="$items
$f"
  done
done
count=$(printf '%s
' "$items" | grep -c .)
copy_one() {  # $1: a path under scratch; $2: the target (a directory onto a directory merges)
  if [ -d "$1" ] && [ ! -L "$1" ] && [ -d "$2" ]; then cp -a "$1"/. "$2"/; else cp -a "$1" "$2"; fi
  [ -z "$owner" ] || chown -R -h "$owner:" "$2" 2>/dev/null || chown -R -h "$owner" "$2"
  [ -z "$mode" ] || chmod "$mode" "$2"
}
printf '%s
' "$items" | while IFS= read -r f; do
  [ -n "$f" ] || continue
  if [ "$count" -eq 1 ] && [ -d "$f" ] && [ ! -L "$f" ]; then
    mkdir -p "$dest"
    for e in "$f"/* "$f"/.[!.]* "$f"/..?*; do
      [ -e "$e" ] || [ -L "$e" ] || continue
      copy_one "$e" "$dest/${e##*/}"
    done
  else
    case "$dest" in */) mkdir -p "$dest";; esac
    [ "$count" -eq 1 ] || mkdir -p "$dest"
    if [ -d "$dest" ]; then copy_one "$f" "${dest%/}/${f##*/}"; else mkdir -p "$(dirname "$dest")"; copy_one "$f" "$dest"; fi
  fi
done
rm -rf "$scratch"
"""


class BuildFailed(Exception):
    """A build step failed; ``step`` is E2B's name for it ("base", "1", "2"... or "finalize")."""

    def __init__(self, message: str, step: str) -> None:
        super().__init__(message)
        self.message = message
        self.step = step


def split_name(text: str) -> tuple[str, str]:
    """E2B's ``name`` or ``name:tag`` -> (name, tag); a name that does not fit is 400."""
    from dsec.compat.e2b.common import E2BError

    name, _, tag = text.partition(":")
    tag = tag or DEFAULT_TAG
    if not _NAME.match(name):
        raise E2BError(400, f"template name {name!r}: lowercase letters, digits, '.', '_' and '-', at most 120 "
                            "(DSec keeps a template as the snapshot layer e2b-<name>)")
    if not _TAG.match(tag):
        raise E2BError(400, f"template tag {tag!r}: letters, digits, '.', '_' and '-', at most 64")
    return name, tag


def snapshot_ref(name: str, tag: str) -> str:
    return f"{SNAPSHOT_PREFIX}{name}:{tag}"


@dataclass(slots=True)
class Built:
    """A template built here: the snapshot it runs and the size the build gave it (its ENV,
    start and ready commands are in the snapshot itself, :data:`TEMPLATE_PATH`)."""

    template: E2BTemplate


TEMPLATE_PATH = "/etc/dsec-e2b/template.json"
"""In a built template's layer: ``{envs, startCmd, readyCmd, user, workdir}`` of its build, read
by each sandbox's setup (so any replica, and a restarted one, runs the template as built)."""


async def read_template_file(sb: AsyncSandbox) -> dict[str, Any]:
    """The template's record in a sandbox made from it ({} when there is none or it is unreadable)."""
    import json

    try:
        got = json.loads(await sb.files.read(TEMPLATE_PATH))
    except (DsecError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _uid(user: str) -> int | str:
    return 0 if user == "root" else 1000 if user == "user" else user


async def start_template(sb: AsyncSandbox, meta: dict[str, Any], envs: dict[str, str], ready_timeout_s: float) -> None:
    """A template's start command, left running (as E2B's templates start with it running), then its
    ready command until it passes (``e2b.ready_timeout_s``): the sandbox's first envd call waits."""
    user = str(meta.get("user") or "user")
    cwd = str(meta.get("workdir") or "/home/user")
    home = "/root" if user == "root" else "/home/user" if user == "user" else "/"
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": home, "USER": user,
           "LANG": "C.UTF-8", **envs}
    start = str(meta.get("startCmd") or "")
    if start:
        res = await sb.exec(["/bin/sh", "-c", 'setsid nohup /bin/sh -c "$1" >/tmp/.e2b-start.log 2>&1 </dev/null &',
                             "start", start], env=env, cwd=cwd, user=_uid(user), timeout=60)
        if res.exit_code != 0:
            raise DsecError(f"sandbox {sb.id}: the template's start command did not start: {res.stderr_text[:300]}")
    ready = str(meta.get("readyCmd") or "")
    if ready:
        loop = asyncio.get_running_loop()
        end = loop.time() + ready_timeout_s
        while True:
            res = await sb.exec(["/bin/sh", "-c", ready], env=env, cwd=cwd, user=_uid(user), timeout=ready_timeout_s)
            if res.exit_code == 0:
                return
            if loop.time() > end:
                raise DsecError(f"sandbox {sb.id}: the template's ready command did not pass within "
                                f"{ready_timeout_s:g} s: {(res.stderr_text or res.stdout_text).strip()[-300:]}")
            await asyncio.sleep(0.2)


@dataclass(slots=True)
class Build:
    template_id: str
    build_id: str
    name: str
    tag: str
    token: str
    cpu: float
    memory_mb: int
    status: str = "waiting"
    entries: list[dict[str, Any]] = field(default_factory=list)
    reason: dict[str, Any] | None = None
    task: asyncio.Task[None] | None = None
    started: float = field(default_factory=time.time)

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        if len(self.entries) >= MAX_LOG_ENTRIES:
            return
        from dsec.compat.e2b.common import rfc3339

        entry: dict[str, Any] = {"timestamp": rfc3339(time.time()), "level": level, "message": message}
        if step is not None:
            entry["step"] = step
        self.entries.append(entry)


class Templates:
    """The build calls and the templates they make, for one front."""

    def __init__(self, config: E2BConfig, api: E2BApi) -> None:
        self.config = config
        self.api = api
        self.builds: OrderedDict[str, Build] = OrderedDict()
        self.built: dict[tuple[str, str], Built] = {}
        """(token hash, ``name:tag``) -> what a build here made (sizes, envs); the snapshot outlives it."""
        self._contexts: OrderedDict[tuple[str, str], Path] = OrderedDict()
        """(token hash, files hash) -> a COPY step's uploaded tar, on this replica's disk (bounded)."""
        self._context_dir: Path | None = None

    # ------------------------------------------------------------ lookups ----

    async def find(self, client: AsyncClient, token: str, template_id: str, *, fresh: bool = False) -> Built | None:
        """A template built for this project (``name`` or ``name:tag``), else None. ``fresh``:
        ask the store even when this replica built it (its snapshot may have been deleted)."""
        try:
            name, tag = split_name(template_id)
        except Exception:
            return None
        key = (_hash(token), f"{name}:{tag}")
        got = self.built.get(key)
        if got is not None and not fresh:
            return got
        ref = snapshot_ref(name, tag)
        if not any(s.ref == ref for s in await client.snapshots()):
            self.built.pop(key, None)
            return None
        if got is not None:
            return got
        # built by another replica, or before a restart: its size is the default template's
        default = self.config.templates.get("base")
        got = Built(E2BTemplate(base=ref, cpu=default.cpu if default else 1.0,
                                memory_mb=default.memory_mb if default else 1024,
                                disk_mb=default.disk_mb if default else 2048))
        self.built[key] = got
        return got

    async def _base(self, client: AsyncClient, token: str, body: dict[str, Any]) -> tuple[E2BTemplate, dict[str, str]]:
        """The image a build starts from, or :class:`BuildFailed` at step ``base``."""
        from_template = body.get("fromTemplate")
        image = body.get("fromImage")
        if isinstance(from_template, str) and from_template:
            tpl = self.config.templates.get(from_template)
            if tpl is not None:
                return tpl, {}
            built = await self.find(client, token, from_template)
            if built is not None:
                return built.template, {}
            raise BuildFailed(f"template '{from_template}' not found", "base")
        if not isinstance(image, str) or not image:
            raise BuildFailed("the build names no base: fromImage or fromTemplate", "base")
        mapped = self.config.images.get(image) or self.config.images.get(image.split("@", 1)[0])
        if mapped is not None:
            tpl = self.config.templates.get(mapped)
            if tpl is not None:
                return tpl, {}
            image = mapped
        tpl = self.config.templates.get(image)
        if tpl is not None:
            return tpl, {}
        built = await self.find(client, token, image)
        if built is not None:
            return built.template, {}
        ref = image if ":" in image.rsplit("/", 1)[-1] else f"{image}:latest"
        # a registry path (swebench/sweb.eval...:latest, docker.io/library/python:3.12) is held under its
        # last component, the name `dsec image import` gives it by default
        short = ref.rsplit("/", 1)[-1]
        held = {str(i.get("ref")) for i in (await client._call("GET", "/v1/images")).json()}
        for name in dict.fromkeys((ref, short)):
            if name in held:
                default = self.config.templates.get("base")
                return E2BTemplate(base=name, disk_mb=default.disk_mb if default else 2048), {}
        raise BuildFailed(
            f"image '{image}' cannot be had: this DSec cluster holds no layer {short!r} (GET /v1/images) and its "
            "E2B front pulls from no registry; import it once (`dsec image import REGISTRY/REPO:TAG --name "
            f"{short}`, a registry the cluster reaches), build it (`dsec image build`), or map '{image}' to a "
            "template in e2b.images", "base")

    # ------------------------------------------------------------ routes ----

    async def request_build(self, request: Request) -> Response:
        from dsec.compat.e2b.common import E2BError, _json_body

        token = await self.api.token(request)
        body = await _json_body(request)
        raw = body.get("name") or body.get("alias")
        if not isinstance(raw, str) or not raw:
            raise E2BError(400, "the build request has no template name")
        name, tag = split_name(raw)
        tags = body.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) and _TAG.match(t) for t in tags):
            raise E2BError(400, "tags must be a list of tags (letters, digits, '.', '_', '-')")
        if tags:
            tag = tags[0]  # DSec keeps one tag per build: the first
        cpu = body.get("cpuCount", 2)
        mem = body.get("memoryMB", 1024)
        if not isinstance(cpu, int) or isinstance(cpu, bool) or not 1 <= cpu <= 256:
            raise E2BError(400, f"cpuCount {cpu!r}: an integer from 1 to 256")
        if not isinstance(mem, int) or isinstance(mem, bool) or not 128 <= mem <= 1 << 20:
            raise E2BError(400, f"memoryMB {mem!r}: an integer from 128")
        build = Build(template_id=name, build_id=str(uuid.uuid4()), name=name, tag=tag, token=token,
                      cpu=float(cpu), memory_mb=mem)
        self._keep(build)
        return JSONResponse({"templateID": name, "buildID": build.build_id, "public": False,
                             "names": [f"{name}:{tag}"], "tags": [tag], "aliases": [name]}, status_code=202)

    async def file_upload(self, request: Request) -> Response:
        """Whether a COPY step's files (by their hash) are here; if not, a signed URL to PUT them to."""
        from dsec.compat.e2b.common import E2BError

        token = await self.api.token(request)
        self._get(request)
        files_hash = request.path_params["files_hash"]
        if not _HASH.match(files_hash):
            raise E2BError(400, "files hash: 1-128 characters of a-z A-Z 0-9 . _ -")
        key = (_hash(token), files_hash)
        if key in self._contexts and self._contexts[key].is_file():
            return JSONResponse({"present": True}, status_code=201)
        exp = int(time.time() + CONTEXT_URL_TTL_S)
        sig = self._sign(key[0], request.path_params["template_id"], files_hash, exp)
        base = str(request.base_url).rstrip("/")
        url = f"{base}/templates/{request.path_params['template_id']}/files/{files_hash}?k={key[0]}&exp={exp}&sig={sig}"
        return JSONResponse({"present": False, "url": url}, status_code=201)

    async def put_files(self, request: Request) -> Response:
        """The client's PUT of a COPY step's tar to the URL :meth:`file_upload` signed (no API key)."""
        import hmac
        import tempfile

        from dsec.compat.e2b.common import E2BError

        q = request.query_params
        tid, files_hash = request.path_params["template_id"], request.path_params["files_hash"]
        try:
            exp = int(q.get("exp", "0"))
        except ValueError:
            exp = 0
        k = q.get("k", "")
        if exp < time.time() or not _HASH.match(files_hash) \
                or not hmac.compare_digest(q.get("sig", ""), self._sign(k, tid, files_hash, exp)):
            raise E2BError(403, "this upload URL is not one this server signed, or it expired")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_CONTEXT:
            raise E2BError(413, f"a COPY step's files are at most {MAX_CONTEXT} bytes")
        if self._context_dir is None:
            self._context_dir = Path(tempfile.mkdtemp(prefix="dsec-e2b-context-"))
        path = self._context_dir / f"{k[:32]}-{files_hash}.tar"
        size = 0
        with path.open("wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_CONTEXT:
                    f.close()
                    path.unlink(missing_ok=True)
                    raise E2BError(413, f"a COPY step's files are at most {MAX_CONTEXT} bytes")
                f.write(chunk)
        self._contexts[(k, files_hash)] = path
        self._contexts.move_to_end((k, files_hash))
        while len(self._contexts) > MAX_CONTEXTS:
            _, old = self._contexts.popitem(last=False)
            old.unlink(missing_ok=True)
        return Response(status_code=200)

    def _sign(self, token_hash: str, template_id: str, files_hash: str, exp: int) -> str:
        import hmac

        msg = f"e2b-context:{token_hash}:{template_id}:{files_hash}:{exp}".encode()
        return hmac.new(self.api._key, msg, hashlib.sha256).hexdigest()

    async def start_build(self, request: Request) -> Response:
        from dsec.compat.e2b.common import E2BError, _json_body

        token = await self.api.token(request)
        build = self._build(request, token)
        if build.status != "waiting":
            raise E2BError(409, f"build {build.build_id} was started already ({build.status})")
        body = await _json_body(request)
        steps = body.get("steps") or []
        if not isinstance(steps, list) or len(steps) > MAX_STEPS \
                or not all(isinstance(s, dict) and isinstance(s.get("type"), str)
                           and isinstance(s.get("args", []), list) for s in steps):
            raise E2BError(400, f"steps: a list of at most {MAX_STEPS} {{type, args}} objects")
        build.status = "building"
        build.task = asyncio.get_running_loop().create_task(self._run(build, body), name=f"e2b-build-{build.build_id}")
        return Response(status_code=202)

    async def status(self, request: Request) -> Response:
        from dsec.compat.e2b.common import E2BError

        token = await self.api.token(request)
        build = self._build(request, token)
        try:
            offset = max(0, int(request.query_params.get("logsOffset") or 0))
            limit = max(1, min(100, int(request.query_params.get("limit") or 100)))
        except ValueError:
            raise E2BError(400, "logsOffset and limit must be integers") from None
        entries = build.entries[offset:offset + limit]
        out: dict[str, Any] = {"templateID": build.template_id, "buildID": build.build_id, "status": build.status,
                               "logs": [e["message"] for e in entries], "logEntries": entries}
        if build.reason is not None:
            out["reason"] = build.reason
        return JSONResponse(out)

    async def alias(self, request: Request) -> Response:
        from dsec.compat.e2b.common import E2BError

        token = await self.api.token(request)
        name = request.path_params["alias"]
        if name in self.config.templates or await self.find(self.api.client(token), token, name, fresh=True) is not None:
            return JSONResponse({"templateID": name.split(":", 1)[0], "public": name in self.config.templates})
        raise E2BError(404, f"template '{name}' not found")

    # ------------------------------------------------------------ the build ----

    async def _run(self, build: Build, body: dict[str, Any]) -> None:
        client = self.api.client(build.token)
        sb: AsyncSandbox | None = None
        try:
            build.log(f"Building template {build.name}:{build.tag} on DSec (build {build.build_id})")
            base, envs = await self._base(client, build.token, body)
            sb = await self._sandbox(client, build, base)
            parent = await read_template_file(sb)  # a template built on another: its ENV carries on
            envs = {**parent.get("envs", {}), **envs}
            build.log(f"Base: {base.base}" + (f" + {', '.join(base.toolkits)}" if base.toolkits else ""), step="base")
            envs, user, workdir = await self._steps(sb, build, body.get("steps") or [], envs)
            meta: dict[str, Any] = {"envs": envs, "user": user, "workdir": workdir,
                                    "startCmd": str(body.get("startCmd") or parent.get("startCmd") or ""),
                                    "readyCmd": str(body.get("readyCmd") or parent.get("readyCmd") or "")}
            await sb.files.write(TEMPLATE_PATH, json.dumps(meta), mode=0o644, parents=True)
            if meta["startCmd"] or meta["readyCmd"]:  # as E2B checks them at build time
                build.log(f"Starting: {meta['startCmd'] or '-'}; waiting for: {meta['readyCmd'] or '-'}",
                          step="finalize")
                try:
                    await start_template(sb, meta, envs, self.config.ready_timeout_s)
                except DsecError as exc:
                    raise BuildFailed(exc.message, "finalize") from None
            build.log("Saving the template's layer", step="finalize")
            ref = snapshot_ref(build.name, build.tag)
            with contextlib.suppress(DsecError):  # a rebuild replaces it (409 while a sandbox runs the old one)
                if any(s.ref == ref for s in await client.snapshots()):
                    await client.delete_snapshot(ref)
            snap = await sb.snapshot(name=SNAPSHOT_PREFIX + build.name, tag=build.tag,
                                     exclude=["/tmp", "/var/tmp", "/var/cache/apt/archives", "__pycache__"])
            self.built[(_hash(build.token), f"{build.name}:{build.tag}")] = Built(
                E2BTemplate(base=snap.ref, cpu=build.cpu, memory_mb=build.memory_mb, disk_mb=base.disk_mb))
            build.log(f"Template {build.name}:{build.tag} is ready: layer {snap.ref} ({snap.size} bytes)",
                      step="finalize")
            build.status = "ready"
        except BuildFailed as exc:
            self._fail(build, exc.message, exc.step)
        except asyncio.CancelledError:
            self._fail(build, "the build was cancelled (the server stopped)", "finalize")
            raise
        except DsecError as exc:
            self._fail(build, f"{exc.code}: {exc.message}", "finalize")
        except Exception as exc:
            log.exception("E2B template build %s failed", build.build_id)
            self._fail(build, f"internal error: {type(exc).__name__}: {exc}", "finalize")
        finally:
            if sb is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(sb.close())

    async def _sandbox(self, client: AsyncClient, build: Build, base: E2BTemplate) -> AsyncSandbox:
        from dsec.spec import ImageRef, NetworkPolicy, Resources, SandboxSpec

        spec = SandboxSpec(image=ImageRef(base=base.base, toolkits=base.toolkits),
                           resources=Resources(cpu=build.cpu, memory=build.memory_mb << 20, disk=base.disk_mb << 20),
                           backend=self.config.backend,
                           network=NetworkPolicy(allow=self.config.build_network) if self.config.build_network else None)
        try:
            sb = await client.create(spec, labels={BUILD_LABEL[0]: BUILD_LABEL[1], "e2b/build": build.build_id},
                                     ttl_s=BUILD_TIMEOUT_S)
        except DsecError as exc:
            raise BuildFailed(f"base image {base.base}: {exc.message}", "base") from None
        res = await sb.exec(["/bin/sh", "-c", USER_SETUP], timeout=60)
        if res.exit_code != 0:
            await sb.close()
            raise BuildFailed(f"the base image has no usable /bin/sh or /etc/passwd: {res.stderr_text.strip()[:300]}",
                              "base")
        return sb

    async def _steps(self, sb: AsyncSandbox, build: Build, steps: list[dict[str, Any]],
                     envs: dict[str, str]) -> tuple[dict[str, str], str, str]:
        user, workdir = "user", "/home/user"
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        for i, step in enumerate(steps, start=1):
            kind, args = str(step["type"]).upper(), [str(a) for a in step.get("args") or []]
            n = str(i)
            build.log(f"[{n}/{len(steps)}] {kind} {' '.join(args)[:500]}", step=n)
            if kind == "ENV":
                if len(args) % 2:
                    raise BuildFailed("ENV takes key, value pairs", n)
                envs.update(dict(zip(args[::2], args[1::2], strict=True)))
            elif kind == "WORKDIR" and args:
                workdir = args[0] if args[0].startswith("/") else f"{workdir.rstrip('/')}/{args[0]}"
                await self._exec(sb, build, n, ["mkdir", "-p", workdir], "root", "/", envs, deadline)
                await self._exec(sb, build, n, ["chown", user, workdir], "root", "/", envs, deadline)
            elif kind == "USER" and args:
                await self._exec(sb, build, n, ["id", "-u", args[0]], "root", "/", envs, deadline, quiet=True)
                user = args[0]
            elif kind == "RUN" and args:
                await self._exec(sb, build, n, ["/bin/sh", "-c", args[0]], args[1] if len(args) > 1 and args[1] else user,
                                 workdir, envs, deadline)
            elif kind == "COPY" and len(args) >= 2:
                await self._copy(sb, build, n, step, args, user, workdir, deadline)
            else:
                raise BuildFailed(f"step type {kind!r} with {len(args)} argument(s) is not one this server runs "
                                  "(RUN, ENV, WORKDIR, USER)", n)
        return envs, user, workdir

    async def _copy(self, sb: AsyncSandbox, build: Build, n: str, step: dict[str, Any], args: list[str], user: str,
                    workdir: str, deadline: float) -> None:
        """COPY src dest [user] [mode]: the step's uploaded tar into a scratch directory of the sandbox,
        then copied as Docker's COPY does (a directory's contents into dest; files into dest when it
        is a directory or ends in /, else as dest), owned by the step's user (else the build's)."""
        files_hash = str(step.get("filesHash") or "")
        path = self._contexts.get((_hash(build.token), files_hash))
        if not files_hash or path is None or not path.is_file():
            raise BuildFailed(f"COPY {args[0]}: its files were not uploaded (files hash {files_hash or 'missing'})", n)
        scratch = f"/tmp/.e2b-copy-{files_hash[:24]}"
        await sb.files.upload(scratch, await asyncio.to_thread(path.read_bytes))
        src, dest = args[0], args[1]
        if not dest.startswith("/"):
            dest = f"{workdir.rstrip('/')}/{dest}"
        owner = (args[2] if len(args) > 2 and args[2] else user)
        mode = args[3] if len(args) > 3 and args[3] else ""
        await self._exec(sb, build, n, ["/bin/sh", "-c", _COPY, "copy", scratch, src, dest, owner, mode], "root", "/",
                         {}, deadline)

    async def _exec(self, sb: AsyncSandbox, build: Build, step: str, cmd: list[str], user: str, cwd: str,
                    envs: dict[str, str], deadline: float, *, quiet: bool = False) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BuildFailed(f"the build took longer than {BUILD_TIMEOUT_S:g} s", step)
        uid: int | str = 0 if user == "root" else 1000 if user == "user" else user
        home = "/root" if user == "root" else "/home/user" if user == "user" else "/"
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": home, "USER": user,
               "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive", **envs}
        res = await sb.exec(cmd, env=env, cwd=cwd, user=uid, timeout=left)
        if not quiet:
            for stream, level in ((res.stdout_text, "info"), (res.stderr_text, "info")):
                for line in stream.splitlines()[-200:]:
                    build.log(line, level, step)
        if res.exit_code != 0:
            tail = (res.stderr_text or res.stdout_text).strip()[-500:]
            why = res.limit.message if res.limit is not None else f"exit code {res.exit_code}"
            raise BuildFailed(f"step {step}: {' '.join(cmd)[:200]!r} failed ({why}): {tail}", step)

    # ------------------------------------------------------------ records ----

    def _fail(self, build: Build, message: str, step: str) -> None:
        build.status = "error"
        build.log(message, "error", step)
        build.reason = {"message": message, "step": step, "logEntries": build.entries[-1:]}

    def _keep(self, build: Build) -> None:
        self.builds[build.build_id] = build
        while len(self.builds) > MAX_BUILDS:
            old = next((b for b in self.builds.values() if b.status in ("ready", "error", "waiting")), None)
            if old is None:
                break
            self.builds.pop(old.build_id)

    def _get(self, request: Request) -> Build:
        from dsec.compat.e2b.common import E2BError

        tid = request.path_params["template_id"]
        for b in reversed(self.builds.values()):
            if b.template_id == tid:
                return b
        raise E2BError(404, f"template '{tid}' has no build on this server")

    def _build(self, request: Request, token: str) -> Build:
        from dsec.compat.e2b.common import E2BError

        build = self.builds.get(request.path_params["build_id"])
        if build is None or build.template_id != request.path_params["template_id"] \
                or _hash(build.token) != _hash(token):
            raise E2BError(404, f"build {request.path_params['build_id']} of template "
                                f"'{request.path_params['template_id']}' not found")
        return build

    async def aclose(self) -> None:
        tasks = [b.task for b in self.builds.values() if b.task is not None and not b.task.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if self._context_dir is not None:
            import shutil

            shutil.rmtree(self._context_dir, ignore_errors=True)
            self._context_dir = None
        self._contexts.clear()


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
