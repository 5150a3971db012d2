"""Host-side file access to a sandbox's root, confined by the kernel.

Every path is resolved with ``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS |
RESOLVE_NO_XDEV)`` against the sandbox's root (``/proc/<init>/root``): ``..``
and absolute symlinks stay inside the sandbox, /proc magic links are refused
and no mount point is crossed, so a symlink race cannot reach a host file.
Final components are then handled with ``*at`` calls relative to the resolved
parent directory, never by a path string the sandbox could change under us.
Files written here are owned by the sandbox's user (mapped host uid), never
by host root.

Covers the sandbox's root filesystem only: /proc, /dev and /sys are separate
mounts and are refused.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import posixpath
import stat as stat_mod
import tarfile
from collections.abc import Iterator
from typing import BinaryIO

from dsec.backends.base import FileInfo
from dsec.errors import FileAccessError, InvalidSpec
from dsec.spec import FileRules

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
MAX_READ = 256 * 1024 * 1024


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    # RESOLVE_IN_ROOT answers EAGAIN when a rename or mount anywhere raced a ".."
    # lookup: the kernel asks for a retry (openat2(2)).
    for _ in range(1000):
        fd = _libc.syscall(_SYS_OPENAT2, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EINTR, errno.EAGAIN):
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, "path resolution kept racing with renames; try again", path)


def _kind(mode: int) -> str:
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    return "other"


def _norm(path: str) -> str:
    """Lexically normalise to a path relative to the sandbox root ("" is the root)."""
    if not isinstance(path, str) or "\0" in path:
        raise InvalidSpec(f"bad path {path!r}", field="path")
    rel = posixpath.normpath("/" + path).lstrip("/")
    return "" if rel == "." else rel


_REASONS = {
    errno.EXDEV: "it crosses into /proc, /dev or /sys, which the files API does not serve",
    errno.ELOOP: "a symlink loop, or a /proc magic link (refused)",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a component is not a directory",
    errno.EISDIR: "it is a directory",
    errno.ENOSPC: "the sandbox's disk quota is full",
    errno.EDQUOT: "the sandbox's disk quota is full",
    errno.EEXIST: "it already exists",
    errno.ENOTEMPTY: "the directory is not empty (use recursive=True)",
    errno.EFBIG: "the file is too big",
}


def file_error(err: int, strerror: str, path: str, op: str, sandbox_id: str) -> FileAccessError:
    """The files API's error for ``op`` on ``path`` failing with ``err`` (also the microVM
    agent's, dsec/backends/microvm/agent.py): the same message shape from every backend."""
    reason = _REASONS.get(err, strerror or "failed")
    return FileAccessError(f"{op} {path!r} in sandbox {sandbox_id}: {reason}",
                           sandbox_id=sandbox_id, path=path, errno=err or None)


class SandboxFiles:
    """File operations inside one sandbox. Blocking syscalls on local filesystems."""

    def __init__(self, root_dir: str, uid_base: int, sandbox_id: str, *, rules: FileRules | None = None) -> None:
        """``rules``: the file rules of the sandbox's current stage, applied to this API as
        Landlock applies them to processes (docs/SECURITY.md, "Stages and Landlock"):
        hidden paths cannot be read, listed, written or linked; read-only ones not changed.
        Paths are judged where they *resolve* to, so a symlink planted by the agent does
        not lead around a rule."""
        self._root_dir = root_dir
        self._uid_base = uid_base
        self.sandbox_id = sandbox_id
        self._rules = None if rules is None or rules.unrestricted else rules
        self._rule_list: list[tuple[str, str]] = []
        if self._rules is not None:
            r = self._rules
            self._rule_list = sorted(
                [(p, "hidden") for p in r.hidden] + [(p, "ro") for p in r.read_only] + [(p, "rw") for p in r.writable],
                key=lambda pr: -len(pr[0]))

    # -- stage rules --

    def _access(self, canon: str) -> str:
        """"rw", "ro" or "hidden" for a canonical sandbox path: the deepest rule wins."""
        assert self._rules is not None
        for rule, kind in self._rule_list:
            if canon == rule or rule == "/" or canon.startswith(rule + "/"):
                return kind
        return self._rules.default

    @staticmethod
    def _canon(fd: int, name: str | None = None) -> str:
        """Where an open fd is in the sandbox (the kernel resolved every symlink on the way)."""
        where = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        return posixpath.normpath(posixpath.join(where, name)) if name else where

    def _guard(self, fd: int, name: str | None, need: str, path: str, op: str, *, subtree: bool = False) -> None:
        """Refuse ``op`` when the current stage's rules forbid it (``need``: "read" or "write";
        ``subtree``: the op also touches everything below, e.g. a recursive remove)."""
        if self._rules is None:
            return
        canon = self._canon(fd, name)
        access = self._access(canon)
        bad = access == "hidden" if need == "read" else access != "rw"
        if not bad and subtree and need == "write":
            bad = any(kind != "rw" and rule.startswith(canon.rstrip("/") + "/") for rule, kind in self._rule_list)
        if bad:
            what = "hidden" if access == "hidden" else "read-only"
            raise FileAccessError(
                f"{op} {path!r} in sandbox {self.sandbox_id}: {canon} is {what} in the current stage",
                sandbox_id=self.sandbox_id, path=path, errno=errno.EACCES,
            )

    # -- plumbing --

    def _root(self) -> int:
        try:
            return os.open(self._root_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise FileAccessError(f"sandbox {self.sandbox_id} is not reachable: {exc.strerror}", sandbox_id=self.sandbox_id) from None

    def _fail(self, exc: OSError, path: str, op: str) -> FileAccessError:
        return file_error(exc.errno or 0, exc.strerror or "failed", path, op, self.sandbox_id)

    def _parent(self, root: int, rel: str, path: str) -> tuple[int, str]:
        if not rel:
            raise FileAccessError(f"{path!r} names the sandbox root itself", sandbox_id=self.sandbox_id, path=path)
        head, name = posixpath.split(rel)
        return openat2(root, head or ".", os.O_PATH | os.O_DIRECTORY), name

    def _owner(self, user: int) -> tuple[int, int]:
        return self._uid_base + user, self._uid_base + user

    # -- reading --

    def _open_regular(self, root: int, rel: str, path: str, flags: int, op: str) -> int:
        """Open a regular file without ever blocking: a FIFO made inside the sandbox
        must not hang the host (O_NONBLOCK on open, then the type is checked)."""
        fd = openat2(root, rel or ".", flags | os.O_NONBLOCK)
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            os.close(fd)
            raise FileAccessError(
                f"{op} {path!r} in sandbox {self.sandbox_id}: not a regular file ({_kind(st.st_mode)})",
                sandbox_id=self.sandbox_id, path=path,
            )
        os.set_blocking(fd, True)
        return fd

    def read(self, path: str, *, max_bytes: int = MAX_READ) -> bytes:
        rel = _norm(path)
        root = self._root()
        try:
            fd = self._open_regular(root, rel, path, os.O_RDONLY, "read")
        except OSError as exc:
            if isinstance(exc, FileAccessError):
                raise
            raise self._fail(exc, path, "read") from None
        finally:
            os.close(root)
        try:
            self._guard(fd, None, "read", path, "read")
        except FileAccessError:
            os.close(fd)
            raise
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise FileAccessError(
                    f"read {path!r}: {size} bytes is over the {max_bytes}-byte limit; use download()",
                    sandbox_id=self.sandbox_id, path=path,
                )
            chunks = []
            total = 0
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                total += len(b)
                if total > max_bytes:
                    raise FileAccessError(f"read {path!r}: grew past {max_bytes} bytes while read", sandbox_id=self.sandbox_id, path=path)
                chunks.append(b)
            return b"".join(chunks)
        except FileAccessError:
            raise
        except OSError as exc:
            raise self._fail(exc, path, "read") from None
        finally:
            os.close(fd)

    def _info(self, dirfd: int, name: str, shown: str) -> FileInfo:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        target = os.readlink(name, dir_fd=dirfd) if stat_mod.S_ISLNK(st.st_mode) else None
        return FileInfo(
            path=shown, name=posixpath.basename(shown) or "/", type=_kind(st.st_mode), size=st.st_size,
            mode=stat_mod.S_IMODE(st.st_mode), uid=st.st_uid - self._uid_base, gid=st.st_gid - self._uid_base,
            mtime=st.st_mtime, target=target,
        )

    def stat(self, path: str) -> FileInfo:
        rel = _norm(path)
        root = self._root()
        try:
            if not rel:
                return self._info(root, ".", "/")
            parent, name = self._parent(root, rel, path)
            try:
                self._guard(parent, name, "read", path, "stat")
                return self._info(parent, name, "/" + rel)
            finally:
                os.close(parent)
        except OSError as exc:
            raise self._fail(exc, path, "stat") from None
        finally:
            os.close(root)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except FileAccessError:
            return False

    def list(self, path: str = "/") -> list[FileInfo]:
        rel = _norm(path)
        root = self._root()
        try:
            d = openat2(root, rel or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                self._guard(d, None, "read", path, "list")
                names = sorted(os.listdir(d))
                return [self._info(d, n, "/" + posixpath.join(rel, n)) for n in names]
            finally:
                os.close(d)
        except OSError as exc:
            raise self._fail(exc, path, "list") from None
        finally:
            os.close(root)

    # -- writing --

    def write(self, path: str, data: bytes, *, mode: int = 0o644, user: int = 0, make_parents: bool = False) -> None:
        """Atomically replace ``path`` with ``data`` (temp file + rename in the same directory)."""
        rel = _norm(path)
        if make_parents and posixpath.dirname(rel):
            self.mkdir("/" + posixpath.dirname(rel), parents=True, user=user)
        root = self._root()
        try:
            parent, name = self._parent(root, rel, path)
        except OSError as exc:
            os.close(root)
            raise self._fail(exc, path, "write") from None
        os.close(root)
        try:
            self._guard(parent, name, "write", path, "write")
        except FileAccessError:
            os.close(parent)
            raise
        tmp = f".{name}.dsec-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
            try:
                os.fchown(fd, *self._owner(user))
                os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError as exc:
            with _suppress():
                os.unlink(tmp, dir_fd=parent)
            raise self._fail(exc, path, "write") from None
        finally:
            os.close(parent)

    def append(self, path: str, data: bytes, *, user: int = 0) -> None:
        rel = _norm(path)
        root = self._root()
        try:
            parent, name = self._parent(root, rel, path)
            try:
                self._guard(parent, name, "write", path, "append")
                fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                             0o644, dir_fd=parent)
            finally:
                os.close(parent)
            if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise FileAccessError(f"append {path!r}: not a regular file", sandbox_id=self.sandbox_id, path=path)
            os.set_blocking(fd, True)
            try:
                if os.fstat(fd).st_uid == 0:
                    os.fchown(fd, *self._owner(user))
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except FileAccessError:
            raise
        except OSError as exc:
            raise self._fail(exc, path, "append") from None
        finally:
            os.close(root)

    def mkdir(self, path: str, *, parents: bool = False, mode: int = 0o755, user: int = 0) -> None:
        rel = _norm(path)
        parts = rel.split("/") if rel else []
        if not parts:
            return
        root = self._root()
        try:
            todo = [("/".join(parts[: i + 1])) for i in range(len(parts))] if parents else [rel]
            for sub in todo:
                parent, name = self._parent(root, sub, path)
                try:
                    if not (parents and _is_dir_at(parent, name)):
                        self._guard(parent, name, "write", path, "mkdir")
                    os.mkdir(name, mode, dir_fd=parent)
                    os.chown(name, *self._owner(user), dir_fd=parent, follow_symlinks=False)
                except FileExistsError:
                    if not parents or not stat_mod.S_ISDIR(os.stat(name, dir_fd=parent).st_mode):
                        raise
                finally:
                    os.close(parent)
        except OSError as exc:
            raise self._fail(exc, path, "mkdir") from None
        finally:
            os.close(root)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        rel = _norm(path)
        root = self._root()
        try:
            parent, name = self._parent(root, rel, path)
            try:
                self._guard(parent, name, "write", path, "remove", subtree=recursive)
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if stat_mod.S_ISDIR(st.st_mode):
                    if recursive:
                        self._rmtree(parent, name)
                    else:
                        os.rmdir(name, dir_fd=parent)
                else:
                    os.unlink(name, dir_fd=parent)
            finally:
                os.close(parent)
        except OSError as exc:
            raise self._fail(exc, path, "remove") from None
        finally:
            os.close(root)

    def _rmtree(self, parent: int, name: str) -> None:
        d = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            for entry in os.listdir(d):
                st = os.stat(entry, dir_fd=d, follow_symlinks=False)
                if stat_mod.S_ISDIR(st.st_mode):
                    self._rmtree(d, entry)
                else:
                    os.unlink(entry, dir_fd=d)
        finally:
            os.close(d)
        os.rmdir(name, dir_fd=parent)

    def rename(self, src: str, dst: str) -> None:
        rs, rd = _norm(src), _norm(dst)
        root = self._root()
        try:
            ps, ns = self._parent(root, rs, src)
            try:
                pd, nd = self._parent(root, rd, dst)
                try:
                    self._guard(ps, ns, "write", src, "rename", subtree=True)
                    self._guard(pd, nd, "write", dst, "rename", subtree=True)
                    os.rename(ns, nd, src_dir_fd=ps, dst_dir_fd=pd)
                finally:
                    os.close(pd)
            finally:
                os.close(ps)
        except OSError as exc:
            raise self._fail(exc, f"{src} -> {dst}", "rename") from None
        finally:
            os.close(root)

    # -- directories as tar --

    def download(self, path: str = "/", *, max_bytes: int = MAX_READ) -> bytes:
        """A tar of ``path`` (recursively), symlinks kept as symlinks.

        Built in memory, so the files' sizes may add up to at most ``max_bytes``
        (a sandbox can make a 64 GiB sparse file in a 16 MiB quota): over that,
        FileAccessError before anything big is read; stream with :meth:`download_to`."""
        buf = io.BytesIO()
        self.download_to(path, buf, max_bytes=max_bytes)
        return buf.getvalue()

    def download_to(self, path: str, out: BinaryIO, *, max_bytes: int | None = None) -> None:
        """Stream a tar of ``path`` to ``out``; ``max_bytes`` caps the files' total size (None: no cap)."""
        rel = _norm(path)
        root = self._root()
        try:
            top = openat2(root, rel or ".", os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            os.close(root)
            raise self._fail(exc, path, "download") from None
        os.close(root)
        total = 0
        try:
            self._guard(top, None, "read", path, "download")
            with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
                    if self._rules is not None:  # hidden entries are left out of the archive
                        here = self._canon(dfd)
                        dirnames[:] = [n for n in dirnames if self._access(posixpath.join(here, n)) != "hidden"]
                        filenames = [n for n in filenames if self._access(posixpath.join(here, n)) != "hidden"]
                    dirnames.sort()
                    for name in sorted(dirnames + filenames):
                        arc = posixpath.normpath(posixpath.join(dirpath, name))
                        for info, fobj in self._tar_entry(dfd, name, arc):
                            total += info.size
                            if max_bytes is not None and total > max_bytes:
                                raise FileAccessError(
                                    f"download {path!r}: files add up to more than {max_bytes} bytes "
                                    f"(at {arc!r}); stream it with download_to()",
                                    sandbox_id=self.sandbox_id, path=path, errno=errno.EFBIG,
                                )
                            tar.addfile(info, fobj)
        except FileAccessError:
            raise
        except OSError as exc:
            raise self._fail(exc, path, "download") from None
        finally:
            os.close(top)

    def _tar_entry(self, dfd: int, name: str, arc: str) -> Iterator[tuple[tarfile.TarInfo, BinaryIO | None]]:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        info = tarfile.TarInfo(arc)
        info.mode = stat_mod.S_IMODE(st.st_mode)
        info.uid, info.gid = max(0, st.st_uid - self._uid_base), max(0, st.st_gid - self._uid_base)
        info.mtime = int(st.st_mtime)
        if stat_mod.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            yield info, None
        elif stat_mod.S_ISLNK(st.st_mode):
            info.type = tarfile.SYMTYPE
            info.linkname = os.readlink(name, dir_fd=dfd)
            yield info, None
        elif stat_mod.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                info.size = os.fstat(f.fileno()).st_size
                yield info, f

    def upload(self, path: str, tar_data: bytes | BinaryIO, *, user: int = 0, max_bytes: int = 1 << 32) -> int:
        """Extract a tar into directory ``path`` (created if missing). Returns the entries written.

        Members are checked before anything is written: absolute names, ``..``
        and device nodes are refused; links may only point inside the tree.
        """
        fobj = io.BytesIO(tar_data) if isinstance(tar_data, bytes | bytearray) else tar_data
        base = _norm(path)
        try:
            tar = tarfile.open(fileobj=fobj, mode="r:*")  # noqa: SIM115 - closed by the with below
        except tarfile.TarError as exc:
            raise InvalidSpec(f"upload: not a tar archive ({exc})", field="tar") from None
        count = 0
        total = 0
        with tar:
            try:
                members = tar.getmembers()
            except tarfile.TarError as exc:
                raise InvalidSpec(f"upload: corrupt tar archive ({exc})", field="tar") from None

            def escapes(name: str) -> bool:
                norm = posixpath.normpath(name)
                return name.startswith("/") or norm == ".." or norm.startswith("../")

            for m in members:
                if escapes(m.name):
                    raise FileAccessError(f"upload: member {m.name!r} escapes the target directory", sandbox_id=self.sandbox_id, path=m.name)
                if m.islnk() and escapes(m.linkname):
                    raise FileAccessError(f"upload: hard link {m.name!r} -> {m.linkname!r} points outside the archive", sandbox_id=self.sandbox_id, path=m.name)
                if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
                    raise FileAccessError(f"upload: member {m.name!r} is a device or special file", sandbox_id=self.sandbox_id, path=m.name)
                total += m.size
                if total > max_bytes:
                    raise FileAccessError(f"upload: archive expands past {max_bytes} bytes", sandbox_id=self.sandbox_id, path=path)
            # As tar and `docker cp` do: a file or symlink in the way is replaced (not written
            # through), a directory merged; a directory never replaces a non-directory nor the
            # reverse. Checked for every member before anything is written.
            there: dict[str, str | None] = {}
            for m in members:
                name = posixpath.normpath(m.name)
                dest = "/" + posixpath.join(base, name) if name != "." else "/" + base
                there[dest] = kind = self._kind_at(dest)
                if kind is None or (kind == "dir") == m.isdir():
                    continue
                what = "a directory with a non-directory" if kind == "dir" else "a non-directory with a directory"
                raise FileAccessError(f"upload: {m.name!r} would replace {what} ({dest})",
                                      sandbox_id=self.sandbox_id, path=dest, errno=errno.EEXIST)
            # Checked: only now is anything written.
            self.mkdir("/" + base, parents=True, user=user)
            for m in members:
                name = posixpath.normpath(m.name)
                if name == ".":
                    continue
                dest = "/" + posixpath.join(base, name)
                if not m.isdir() and there.get(dest) is not None:
                    self.remove(dest)
                if m.isdir():
                    self.mkdir(dest, parents=True, mode=m.mode & 0o7777 or 0o755, user=user)
                elif m.isreg():
                    src = tar.extractfile(m)
                    assert src is not None
                    self.write(dest, src.read(), mode=m.mode & 0o777, user=user, make_parents=True)
                elif m.issym():
                    self._symlink(m.linkname, dest, user)
                else:
                    self._hardlink("/" + posixpath.join(base, posixpath.normpath(m.linkname)), dest)
                count += 1
        return count

    def _kind_at(self, path: str) -> str | None:
        """What is at ``path`` (not following a final symlink): "dir", another kind, or None."""
        try:
            return self.stat(path).type
        except FileAccessError as exc:
            if exc.fields.get("errno") in (errno.ENOENT, errno.ENOTDIR):
                return None
            raise

    def _symlink(self, target: str, path: str, user: int) -> None:
        rel = _norm(path)
        root = self._root()
        try:
            parent, name = self._parent(root, rel, path)
            try:
                self._guard(parent, name, "write", path, "symlink")
                os.symlink(target, name, dir_fd=parent)
                os.chown(name, *self._owner(user), dir_fd=parent, follow_symlinks=False)
            finally:
                os.close(parent)
        except OSError as exc:
            raise self._fail(exc, path, "symlink") from None
        finally:
            os.close(root)

    def _hardlink(self, existing: str, path: str) -> None:
        rs, rd = _norm(existing), _norm(path)
        root = self._root()
        try:
            ps, ns = self._parent(root, rs, existing)
            pd, nd = self._parent(root, rd, path)
            try:
                # A link shares the inode: its source must be as writable as its new name.
                self._guard(ps, ns, "write", existing, "link")
                self._guard(pd, nd, "write", path, "link")
                os.link(ns, nd, src_dir_fd=ps, dst_dir_fd=pd, follow_symlinks=False)
            finally:
                os.close(ps)
                os.close(pd)
        except OSError as exc:
            raise self._fail(exc, path, "link") from None
        finally:
            os.close(root)


def _is_dir_at(dirfd: int, name: str) -> bool:
    try:
        return stat_mod.S_ISDIR(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True
