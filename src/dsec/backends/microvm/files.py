"""A microVM's files, through its guest agent: the ``Files`` contract over the agent's file ops.

Synchronous, like every backend's files object (the edge calls it in a worker thread); each
call runs on the backend's VM loop. Paths are confined to the sandbox's root by the agent
(``openat2`` with ``RESOLVE_IN_ROOT`` inside the guest), so ``..`` and symlinks never leave it;
the host never opens a guest file itself. Tars (``download``/``upload``) are made and read
here from the same primitives: no tool is needed in the image.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from dsec.backends.base import FileInfo
from dsec.errors import FileAccessError, InvalidSpec

if TYPE_CHECKING:
    from dsec.backends.microvm.agent import AgentClient
    from dsec.backends.microvm.backend import MicroVMBackend

T = TypeVar("T")
MAX_READ = 256 * 1024 * 1024
CALL_TIMEOUT_S = 120.0


def _abs(path: str) -> str:
    """A path inside the sandbox, as every backend's files take it: relative to its root when
    not absolute (``..`` is resolved by the agent inside the root, never above it)."""
    return path if path.startswith("/") else "/" + path


class VmFiles:
    def __init__(self, backend: MicroVMBackend, sandbox_id: str) -> None:
        self._backend = backend
        self.sandbox_id = sandbox_id

    def _run(self, make: Any) -> Any:
        async def go() -> Any:
            vm = await self._backend._vm(self.sandbox_id)
            agent: AgentClient = vm._agent()
            return await make(agent)

        return self._call(go())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._backend.loop.call_sync(coro, CALL_TIMEOUT_S)

    def read(self, path: str, *, max_bytes: int = MAX_READ) -> bytes:
        data: bytes = self._run(lambda a: a.read(_abs(path), max_bytes))
        return data

    def stat(self, path: str) -> FileInfo:
        info: FileInfo = self._run(lambda a: a.stat(_abs(path)))
        return info

    def exists(self, path: str) -> bool:
        found: bool = self._run(lambda a: a.exists(_abs(path)))
        return found

    def list(self, path: str = "/") -> list[FileInfo]:
        out: list[FileInfo] = self._run(lambda a: a.list(_abs(path)))
        return out

    def write(self, path: str, data: bytes, *, mode: int = 0o644, user: int = 0, make_parents: bool = False) -> None:
        path = _abs(path)
        async def go(a: AgentClient) -> None:
            if make_parents:
                parent = posixpath.dirname(posixpath.normpath(path))
                if parent not in ("", "/"):
                    await a.mkdir(parent, parents=True, uid=user, gid=user)
            await a.write(path, data, mode=mode, uid=user, gid=user)

        self._run(go)

    def append(self, path: str, data: bytes, *, user: int = 0) -> None:
        self._run(lambda a: a.write(_abs(path), data, uid=user, gid=user, append=True))

    def mkdir(self, path: str, *, parents: bool = False, mode: int = 0o755, user: int = 0) -> None:
        self._run(lambda a: a.mkdir(_abs(path), parents=parents, mode=mode, uid=user, gid=user))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._run(lambda a: a.remove(_abs(path), recursive=recursive))

    def rename(self, src: str, dst: str) -> None:
        self._run(lambda a: a.rename(_abs(src), _abs(dst)))

    # ----- tars -----

    def download(self, path: str = "/", *, max_bytes: int = MAX_READ) -> bytes:
        buf = io.BytesIO()
        self.download_to(path, buf, max_bytes=max_bytes)
        return buf.getvalue()

    def download_to(self, path: str, out: BinaryIO, *, max_bytes: int | None = None) -> None:
        """A tar of ``path`` (recursively; symlinks kept as symlinks), streamed to ``out``."""
        path = _abs(path)

        async def go(a: AgentClient) -> None:
            top = await a.stat(path)
            total = 0
            with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                stack = [(path, ".")] if top.type == "dir" else []
                if top.type != "dir":
                    stack = []
                    entries = [(path, posixpath.basename(path.rstrip("/")) or ".", top)]
                else:
                    entries = []
                while stack:
                    d, arc = stack.pop()
                    for e in sorted(await a.list(d), key=lambda x: x.name):
                        entries.append((posixpath.join(d, e.name), posixpath.normpath(posixpath.join(arc, e.name)), e))
                        if e.type == "dir":
                            stack.append((posixpath.join(d, e.name), posixpath.join(arc, e.name)))
                for src, arc, e in entries:
                    info = tarfile.TarInfo(arc)
                    info.mode, info.uid, info.gid, info.mtime = e.mode & 0o7777, e.uid, e.gid, int(e.mtime)
                    if e.type == "dir":
                        info.type = tarfile.DIRTYPE
                        tar.addfile(info)
                    elif e.type == "symlink":
                        info.type, info.linkname = tarfile.SYMTYPE, e.target or ""
                        tar.addfile(info)
                    elif e.type == "file":
                        total += e.size
                        if max_bytes is not None and total > max_bytes:
                            raise FileAccessError(f"download {path!r}: files add up to more than {max_bytes} bytes "
                                                  f"(at {arc!r}); stream it with download_to()",
                                                  sandbox_id=self.sandbox_id, path=path)
                        data = await a.read(src, max_bytes or MAX_READ)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))

        self._run(go)

    def upload(self, path: str, tar_data: bytes | BinaryIO, *, user: int = 0, max_bytes: int = 1 << 32) -> int:
        """Extract a tar into directory ``path`` (created if missing); the entries written.
        Members are checked before anything is written: absolute names, ``..``, device
        nodes and hard links are refused."""
        path = _abs(path)
        fobj = io.BytesIO(tar_data) if isinstance(tar_data, bytes | bytearray) else tar_data
        try:
            tar = tarfile.open(fileobj=fobj, mode="r:*")  # noqa: SIM115 - closed below
            members = tar.getmembers()
        except tarfile.TarError as exc:
            raise InvalidSpec(f"upload: not a tar archive ({exc})", field="tar") from None
        with tar:
            for m in members:
                norm = posixpath.normpath(m.name)
                if m.name.startswith("/") or norm == ".." or norm.startswith("../"):
                    raise FileAccessError(f"upload: member {m.name!r} escapes the target directory",
                                          sandbox_id=self.sandbox_id, path=m.name)
                if not (m.isreg() or m.isdir() or m.issym()):
                    raise FileAccessError(f"upload: member {m.name!r} is a device, hard link or special file",
                                          sandbox_id=self.sandbox_id, path=m.name)
            if sum(m.size for m in members if m.isreg()) > max_bytes:
                raise FileAccessError(f"upload: members add up to more than {max_bytes} bytes",
                                      sandbox_id=self.sandbox_id, path=path)
            blobs = {m.name: (tar.extractfile(m).read() if m.isreg() else b"") for m in members}  # type: ignore[union-attr]

        async def go(a: AgentClient) -> int:
            await a.mkdir(path, parents=True, uid=user, gid=user)
            for m in members:
                dst = posixpath.join(path, posixpath.normpath(m.name))
                if m.isdir():
                    await a.mkdir(dst, parents=True, mode=m.mode & 0o7777 or 0o755, uid=user, gid=user)
                elif m.isreg():
                    parent = posixpath.dirname(dst)
                    if parent != path:
                        await a.mkdir(parent, parents=True, uid=user, gid=user)
                    await a.write(dst, blobs[m.name], mode=m.mode & 0o7777 or 0o644, uid=user, gid=user)
                # symlinks: not yet (the agent has no symlink op)
            return len(members)

        count: int = self._run(go)
        return count
