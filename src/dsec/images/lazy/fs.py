"""The FUSE filesystem of the lazy layer service: one flat, read-only directory.

``<mountpoint>/<hex>.erofs`` is attached layer ``sha256:<hex>``, a regular file of
the layer's exact size, mode 0444, owned by root. Nothing else is in it. Reads go
to the :class:`~.engine.Engine`; a read it cannot serve is EIO. The kernel may
keep the file's pages across opens (``keep_cache``): layer content is immutable.

Owns no state of its own beyond open file handles; never writes.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

import pyfuse3

from .engine import Attached, Engine, ReadFailed

log = logging.getLogger("dsec.images.lazy")

ATTR_TIMEOUT_S = 3600.0
"""A layer's attributes never change while it is attached."""
ENTRY_TIMEOUT_S = 1.0
"""Names come and go with attach/detach; keep the kernel's memory of them short."""


class LazyFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self._handles: dict[int, Attached] = {}
        self._next_fh = 1

    def _root_attr(self) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = pyfuse3.ROOT_INODE
        a.st_mode = stat.S_IFDIR | 0o555
        a.st_nlink = 2
        a.st_uid = a.st_gid = 0
        t = int(self.engine.started * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        a.attr_timeout = ENTRY_TIMEOUT_S
        a.entry_timeout = ENTRY_TIMEOUT_S
        return a

    def _attr(self, al: Attached) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = al.ino
        a.st_mode = stat.S_IFREG | 0o444
        a.st_nlink = 1
        a.st_uid = a.st_gid = 0
        a.st_size = al.layer.size
        a.st_blksize = 4096
        a.st_blocks = -(-al.layer.size // 512)
        t = int(al.attached_at * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = t
        a.attr_timeout = ATTR_TIMEOUT_S
        a.entry_timeout = ENTRY_TIMEOUT_S
        return a

    async def getattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if inode == pyfuse3.ROOT_INODE:
            return self._root_attr()
        al = self.engine.by_ino.get(inode)
        if al is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(al)

    async def lookup(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        n = os.fsdecode(name)
        if not n.endswith(".erofs"):
            raise pyfuse3.FUSEError(errno.ENOENT)
        al = self.engine.layers.get(n.removesuffix(".erofs"))
        if al is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(al)

    async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return 0

    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = sorted(self.engine.layers.values(), key=lambda a: a.ino)
        for al in entries:
            if al.ino <= start_id:
                continue
            if not pyfuse3.readdir_reply(token, os.fsencode(al.layer.filename), self._attr(al), al.ino):
                return

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        return None

    async def open(self, inode: pyfuse3.InodeT, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        al = self.engine.open(inode)
        if al is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = al
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        al = self._handles.get(fh)
        if al is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        try:
            return await self.engine.read(al, off, size)
        except ReadFailed as exc:
            log.warning("EIO: %s [%d, +%d): %s", al.layer.digest, off, size, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        al = self._handles.pop(fh, None)
        if al is not None:
            self.engine.release(al)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = sum(-(-a.layer.size // 4096) for a in self.engine.layers.values())
        s.f_bfree = s.f_bavail = 0
        s.f_files = len(self.engine.layers) + 1
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s


__all__ = ["LazyFS"]
