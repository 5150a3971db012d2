"""Where an EROFS image keeps its metadata: the superblock and a walk of its tree.

``mkfs.erofs`` (erofs-utils 1.5, as :mod:`dsec.images.erofs` runs it) writes
``meta_blkaddr = 0``: inodes are addressed from the start of the file and sit
between the data blocks of the files written before them, so there is no
contiguous "metadata region" to fetch. Instead :func:`walk_metadata` reads the
tree the way the kernel would for ``ls -R``/``stat`` — superblock, root inode,
directory blocks, child inodes, level by level — and returns every byte range
it touched. A lazy loader fetches the chunks covering those ranges up front,
and a later ``ls -R`` of the mounted image then needs no other chunk.

Pure parsing over a caller-given async ``read(offset, length)``: no I/O of its
own, never mounts. Only the formats mkfs.erofs writes are understood (flat,
inline, compressed files, compact and extended inodes); an unknown layout of a
*file* is skipped (its data is data), an unknown layout of a *directory* stops
the walk there (a directory whose blocks are missed is fetched on first use).
"""

from __future__ import annotations

import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

EROFS_MAGIC = 0xE0F5E1E2
SUPER_OFFSET = 1024
SUPER_SIZE = 128
ISLOT_BITS = 5  # an inode slot is 32 bytes; nid * 32 is its offset from meta_blkaddr

# i_format: bit 0 = extended inode, bits 1..3 = data layout
LAYOUT_FLAT_PLAIN = 0
LAYOUT_COMPRESSED_FULL = 1
LAYOUT_FLAT_INLINE = 2
LAYOUT_COMPRESSED_COMPACT = 3
LAYOUT_CHUNK_BASED = 4

DIRENT_SIZE = 12
MAX_INODES = 10_000_000
"""A walk stops past this many inodes: a crafted image cannot make it run forever."""

Reader = Callable[[int, int], Awaitable[bytes]]
"""``read(offset, length)``: bytes of the image (short only at its end)."""
Prefetch = Callable[[list[tuple[int, int]]], Awaitable[None]]
"""Told every range a level of the walk is about to read, so it can fetch them at once."""


class ErofsFormatError(ValueError):
    """The bytes are not an EROFS image this module understands."""


@dataclass(frozen=True)
class Superblock:
    blkszbits: int
    root_nid: int
    inos: int
    blocks: int
    meta_blkaddr: int
    xattr_blkaddr: int
    feature_incompat: int

    @property
    def block_size(self) -> int:
        return 1 << self.blkszbits

    def inode_offset(self, nid: int) -> int:
        return self.meta_blkaddr * self.block_size + (nid << ISLOT_BITS)


def parse_superblock(raw: bytes) -> Superblock:
    """Parse the 128-byte on-disk superblock (the bytes at offset 1024)."""
    if len(raw) < SUPER_SIZE:
        raise ErofsFormatError("short superblock")
    (magic, _cksum, _compat, blkszbits, _ext, root_nid, inos, _bt, _btn, blocks, meta, xattr) = (
        struct.unpack_from("<IIIBBHQQIIII", raw, 0)
    )
    if magic != EROFS_MAGIC:
        raise ErofsFormatError(f"bad EROFS magic {magic:#x}")
    if not 9 <= blkszbits <= 16:
        raise ErofsFormatError(f"unsupported block size 2^{blkszbits}")
    (incompat,) = struct.unpack_from("<I", raw, 80)
    return Superblock(blkszbits, root_nid, inos, blocks, meta, xattr, incompat)


@dataclass(frozen=True)
class Inode:
    nid: int
    offset: int
    mode: int
    size: int
    layout: int
    raw_blkaddr: int
    header_size: int
    """Inode plus its inline xattrs: inline data starts right after."""


def parse_inode(sb: Superblock, nid: int, raw: bytes) -> Inode:
    if len(raw) < 32:
        raise ErofsFormatError(f"inode {nid}: short read")
    i_format, xattr_icount, mode = struct.unpack_from("<HHH", raw, 0)
    extended = i_format & 1
    layout = (i_format >> 1) & 0x7
    if extended:
        if len(raw) < 64:
            raise ErofsFormatError(f"inode {nid}: short read")
        (size,) = struct.unpack_from("<Q", raw, 8)
        isize = 64
    else:
        (size,) = struct.unpack_from("<I", raw, 8)
        isize = 32
    (raw_blkaddr,) = struct.unpack_from("<I", raw, 16)
    xattr_size = 0 if xattr_icount == 0 else 12 + (xattr_icount - 1) * 4
    return Inode(nid, sb.inode_offset(nid), mode, size, layout, raw_blkaddr, isize + xattr_size)


def _flat_ranges(sb: Superblock, ino: Inode) -> list[tuple[int, int]]:
    """Byte ranges holding the content of a flat (uncompressed) inode, in order."""
    bs = sb.block_size
    if ino.layout == LAYOUT_FLAT_PLAIN:
        return [(ino.raw_blkaddr * bs, ino.size)] if ino.size else []
    if ino.layout == LAYOUT_FLAT_INLINE:
        tail = ino.size % bs
        full = ino.size - tail
        out = [(ino.raw_blkaddr * bs, full)] if full else []
        if tail:
            out.append((ino.offset + ino.header_size, tail))
        return out
    return []


def _dirents(block: bytes) -> list[tuple[int, bytes, int]]:
    """(nid, name, file_type) of one directory block's entries."""
    if len(block) < DIRENT_SIZE:
        return []
    (_, nameoff0, _) = struct.unpack_from("<QHB", block, 0)
    count = nameoff0 // DIRENT_SIZE
    if count == 0 or nameoff0 > len(block) or nameoff0 % DIRENT_SIZE:
        raise ErofsFormatError("corrupt directory block")
    out = []
    for i in range(count):
        nid, nameoff, ftype = struct.unpack_from("<QHB", block, i * DIRENT_SIZE)
        end = (
            struct.unpack_from("<H", block, (i + 1) * DIRENT_SIZE + 8)[0]
            if i + 1 < count
            else len(block)
        )
        name = block[nameoff:end].rstrip(b"\0")
        out.append((nid, name, ftype))
    return out


@dataclass
class MetadataMap:
    """What a walk found: the ranges it read, and a few counts for reports."""

    superblock: Superblock
    ranges: list[tuple[int, int]]
    inodes: int = 0
    directories: int = 0
    data_extents: list[tuple[int, int]] | None = None
    """With ``extents=True``: ``[start, end)`` byte ranges, in the image's extra data device,
    of each chunk-based file's runs of consecutive blocks, sorted by start (the lazy form's
    metadata image says where every file's data lies in its data device)."""


async def walk_metadata(read: Reader, prefetch: Prefetch | None = None, *, extents: bool = False) -> MetadataMap:
    """Walk the whole tree breadth-first and return every byte range it read.

    Ranges: the superblock, each inode (with its inline xattrs and inline
    tail), each directory's blocks, each symlink's target, and one block of the
    shared xattr area when there is one. ``prefetch`` (if given) is told each
    level's ranges before they are read, so a lazy reader can fetch them all
    concurrently instead of one round trip per inode. ``extents`` also reads every
    chunk-based file's chunk index into ``data_extents``."""
    sb = parse_superblock(await read(SUPER_OFFSET, SUPER_SIZE))
    bs = sb.block_size
    ranges: list[tuple[int, int]] = [(0, SUPER_OFFSET + SUPER_SIZE)]
    if sb.xattr_blkaddr:
        ranges.append((sb.xattr_blkaddr * bs, bs))
    result = MetadataMap(sb, ranges, data_extents=[] if extents else None)
    seen: set[int] = {sb.root_nid}
    level = [sb.root_nid]
    while level:
        if len(seen) > MAX_INODES:
            raise ErofsFormatError("more inodes than any layer may hold")
        # 64 bytes covers both inode versions; the inline part is read below.
        slots = [(sb.inode_offset(nid), 64) for nid in level]
        if prefetch is not None:
            await prefetch(slots)
        inodes = [parse_inode(sb, nid, await read(off, n)) for nid, (off, n) in zip(level, slots, strict=True)]
        content: list[tuple[Inode, list[tuple[int, int]]]] = []
        for ino in inodes:
            result.inodes += 1
            ranges.append((ino.offset, ino.header_size))
            fmt = stat.S_IFMT(ino.mode)
            if fmt in (stat.S_IFDIR, stat.S_IFLNK):
                content.append((ino, _flat_ranges(sb, ino)))
            elif ino.layout == LAYOUT_CHUNK_BASED and result.data_extents is not None and fmt == stat.S_IFREG:
                result.data_extents.extend(await _chunk_extents(sb, ino, read))
            elif ino.layout in (LAYOUT_COMPRESSED_FULL, LAYOUT_COMPRESSED_COMPACT):
                # the compression index follows the inode; reading the file needs it,
                # stat does not, and it shares the inode's block: take its map header
                ranges.append((ino.offset + ino.header_size, 8))
        if prefetch is not None:
            await prefetch([r for _, rs in content for r in rs])
        nxt: list[int] = []
        for ino, rs in content:
            ranges.extend(rs)
            if not stat.S_ISDIR(ino.mode):
                continue
            result.directories += 1
            for off, length in rs:
                # a directory's content is whole blocks, then maybe an inline tail
                pos = 0
                while pos < length:
                    n = min(bs, length - pos)
                    for nid, name, _ in _dirents(await read(off + pos, n)):
                        if name in (b".", b"..") or nid in seen:
                            continue
                        seen.add(nid)
                        nxt.append(nid)
                    pos += n
        level = nxt
    if result.data_extents is not None:
        result.data_extents.sort()
    return result


CHUNK_FORMAT_INDEXES = 0x20
CHUNK_FORMAT_BLKBITS_MASK = 0x1F
NULL_ADDR = 0xFFFFFFFF


async def _chunk_extents(sb: Superblock, ino: Inode, read: Reader) -> list[tuple[int, int]]:
    """Runs of consecutive blocks of a chunk-based file in its extra device (device 1,
    as ``mkfs.erofs --blobdev`` writes): ``[(start, end)]`` byte offsets there."""
    fmt = ino.raw_blkaddr & 0xFFFF
    if not fmt & CHUNK_FORMAT_INDEXES or ino.size == 0:
        return []
    chunk = sb.block_size << (fmt & CHUNK_FORMAT_BLKBITS_MASK)
    count = -(-ino.size // chunk)
    if count > 1 << 24:
        raise ErofsFormatError(f"inode {ino.nid}: {count} chunks")
    at = (ino.offset + ino.header_size + 7) // 8 * 8
    raw = await read(at, 8 * count)
    if len(raw) < 8 * count:
        raise ErofsFormatError(f"inode {ino.nid}: short chunk index")
    out: list[tuple[int, int]] = []
    left = ino.size
    for i in range(count):
        _advise, device, blkaddr = struct.unpack_from("<HHI", raw, 8 * i)
        n = min(chunk, left)
        left -= n
        if device != 1 or blkaddr == NULL_ADDR:
            continue
        start = blkaddr * sb.block_size
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], start + n)
        else:
            out.append((start, start + n))
    return out


def covering_chunks(ranges: list[tuple[int, int]], chunk_size: int, size: int) -> list[int]:
    """Sorted indexes of the chunks that hold any byte of ``ranges`` (clipped to ``size``)."""
    out: set[int] = set()
    for off, length in ranges:
        if length <= 0 or off >= size:
            continue
        end = min(off + length, size)
        out.update(range(off // chunk_size, (end - 1) // chunk_size + 1))
    return sorted(out)


__all__ = [
    "ErofsFormatError",
    "MetadataMap",
    "Superblock",
    "covering_chunks",
    "parse_superblock",
    "walk_metadata",
]
