"""The file extents of a lazy form's metadata image, worked out in a process of its own.

The parse (:func:`dsec.images.lazy.erofs_meta.walk_metadata` with ``extents=True``) is
pure Python: ~0.4 s for an image of 70,000 files. Run in a thread of the FUSE process it
would hold the GIL for most of that time, and every FUSE read waits for the GIL: a
sandbox starting from the layer meanwhile would crawl. In a child process it costs the
FUSE process nothing but the pipe.

``python -m dsec.images.lazy.extents`` reads the image on stdin and writes the extents
on stdout: a little-endian ``u64`` count, then that many starts, then as many ends.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any

from .erofs_meta import ErofsFormatError, walk_metadata


def walk_extents(image: bytes) -> Any:
    """:func:`walk_metadata` with extents over an image in memory, driven without an event loop
    (its reads never wait)."""

    async def read(off: int, n: int) -> bytes:
        return image[off : off + n]

    coro = walk_metadata(read, extents=True)
    try:
        while True:
            coro.send(None)
    except StopIteration as done:
        return done.value


def encode(extents: list[tuple[int, int]]) -> bytes:
    starts = array("Q", (a for a, _ in extents))
    ends = array("Q", (b for _, b in extents))
    if sys.byteorder != "little":
        starts.byteswap()
        ends.byteswap()
    return struct.pack("<Q", len(extents)) + starts.tobytes() + ends.tobytes()


def decode(data: bytes) -> tuple[list[int], list[int]]:
    """``(starts, ends)`` from :func:`encode`'s bytes; ValueError if they are not that."""
    if len(data) < 8:
        raise ValueError("no extent count")
    (n,) = struct.unpack_from("<Q", data)
    if len(data) != 8 + 16 * n:
        raise ValueError(f"{len(data)} bytes for {n} extents")
    starts, ends = array("Q"), array("Q")
    starts.frombytes(data[8 : 8 + 8 * n])
    ends.frombytes(data[8 + 8 * n :])
    if sys.byteorder != "little":
        starts.byteswap()
        ends.byteswap()
    return starts.tolist(), ends.tolist()


def pack(extents: list[tuple[int, int]]) -> str:
    """The extents as a lazy form carries them (``LazyForm.extents``): :func:`encode`'s bytes,
    zstd-compressed, base64."""
    import base64

    import zstandard

    return base64.b64encode(zstandard.ZstdCompressor(level=9).compress(encode(extents))).decode()


def unpack(text: str) -> tuple[list[int], list[int]]:
    """``(starts, ends)`` from :func:`pack`'s text; ValueError if it is not that."""
    import base64
    import binascii

    import zstandard

    try:
        raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(text, validate=True),
                                                      max_output_size=64 << 20)  # fmt: skip
    except (binascii.Error, zstandard.ZstdError) as exc:
        raise ValueError(f"not packed extents: {exc}") from exc
    return decode(raw)


def main() -> int:
    image = sys.stdin.buffer.read()
    try:
        found = walk_extents(image)
    except ErofsFormatError as exc:
        print(f"not a metadata image: {exc}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(encode(found.data_extents or []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
