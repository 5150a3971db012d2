"""Building layers: from a directory, a tar, an OCI/docker image, or debootstrap.

Every builder works in a private scratch directory of the store
(:meth:`LayerStore.scratch`), which is deleted however the build ends, turns
the tree into an EROFS image with reproducible settings (same tree -> same
digest) and hands the image to :meth:`LayerStore.add_erofs`. Before mkfs,
Python bytecode that matches its sources gets their normalised mtime in its
header (pyc.py), so sandboxes use it instead of recompiling. Progress is
reported through ``progress(stage, done, total)``; ``total`` is None while
unknown. Stages: ``unpack`` (bytes), ``debootstrap: <phase>`` (packages),
``slim``, ``copy``, ``bytecode``, ``mkfs``, ``store``.

Never modifies a source the caller owns: ``build_from_dir`` works on a copy
when its bytecode needs the rewrite.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from dsec.errors import DsecError, InvalidSpec

from .busybox import build_busybox_rootfs
from .debootstrap import Mirror, find_mirror, run_debootstrap, scrub_build_host, slim_rootfs
from .debootstrap import check_args as _check_debootstrap_args
from .erofs import make_erofs
from .errors import LayerBuildError
from .layer import Layer, LayerKind, check_kind, check_name, check_tag
from .oci import ImageSource, VerifyingReader, find_layers
from .pyc import normalize_pycs
from .store import LayerStore
from .unpack import UnpackStats, unpack_tar

log = logging.getLogger("dsec.images")

Progress = Callable[[str, int, int | None], None]
"""``progress(stage, done, total)``: called often; must be cheap and must not raise."""

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _noop(stage: str, done: int, total: int | None) -> None:
    pass


def _prepare(
    store: LayerStore, name: str, tag: str, kind: LayerKind | str, parents: Iterable[str]
) -> tuple[LayerKind, tuple[str, ...]]:
    """Validate the cheap arguments before any slow work; resolve parent refs to digests."""
    check_name(name)
    check_tag(tag)
    k = check_kind(kind)
    return k, tuple(store.resolve(p).digest for p in parents)


def _to_layer(
    store: LayerStore,
    tree: Path,
    scratch: Path,
    *,
    name: str,
    tag: str,
    kind: LayerKind,
    parents: tuple[str, ...],
    progress: Progress,
    writable: bool = True,
) -> Layer:
    """mkfs ``tree`` and store it; ``writable`` says the tree is the build's own, so its
    bytecode may be fixed in place."""
    if writable:
        progress("bytecode", 0, None)
        stats = normalize_pycs(tree)
        progress("bytecode", 1, 1)
        log.info("python bytecode under %s: %s", tree, stats)
    image = scratch / "layer.erofs"
    progress("mkfs", 0, None)
    make_erofs(tree, image)
    progress("mkfs", 1, 1)
    progress("store", 0, 1)
    layer = store.add_erofs(image, name=name, tag=tag, kind=kind, parents=parents, consume=True)
    progress("store", 1, 1)
    return layer


def _dir_tree(src: Path, scratch: Path, progress: Progress) -> tuple[Path, bool]:
    """The tree to build a ``--from-dir`` layer from, and whether it is the build's own.

    ``src`` itself when none of its bytecode needs the rewrite (no copy, the usual
    case for trees without Python); otherwise a ``cp -a`` copy in the scratch
    directory (reflinked where the filesystem can), so the caller's directory is
    never modified. Unprivileged, a tree with files of other owners is built as
    it is: a copy could not keep their owners.
    """
    unprivileged = os.geteuid() != 0
    plan = normalize_pycs(src, dry_run=True, check_owners=unprivileged)
    if not plan.rewritten:
        return src, False
    if plan.foreign_owner:
        log.warning(
            "%s: %d .pyc file(s) will look stale in sandboxes (Python recompiles them): "
            "fixing them needs a copy of the tree, which keeps other users' files only as root",
            src, plan.rewritten,
        )  # fmt: skip
        return src, False
    cp = shutil.which("cp")
    if cp is None:  # pragma: no cover - coreutils is always there
        raise LayerBuildError("cp not found (install coreutils)", stage="copy")
    copy = scratch / "rootfs"
    progress("copy", 0, None)
    proc = subprocess.run(
        [cp, "-a", "--reflink=auto", "--", str(src), str(copy)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise LayerBuildError(
            f"copying {src} to the build directory failed: {detail[0]}", stage="copy"
        )
    progress("copy", 1, 1)
    return copy, True


def _new_root(scratch: Path) -> Path:
    root = scratch / "rootfs"
    root.mkdir()
    os.chmod(root, 0o755)
    return root


def build_from_dir(
    store: LayerStore,
    src: Path,
    *,
    name: str,
    tag: str,
    kind: LayerKind | str = LayerKind.BASE,
    parents: Iterable[str] = (),
    progress: Progress | None = None,
) -> Layer:
    """Make a layer of the tree under ``src`` (owners and modes kept, mtimes zeroed,
    bytecode made to match; ``src`` itself is never modified)."""
    src = Path(src)
    k, parent_digests = _prepare(store, name, tag, kind, parents)
    if not src.is_dir():
        raise InvalidSpec(f"{src} is not a directory; --from-dir needs a directory", field="src")
    report = progress or _noop
    with store.scratch("build") as scratch:
        tree, own = _dir_tree(src, scratch, report)
        return _to_layer(
            store, tree, scratch, name=name, tag=tag, kind=k, parents=parent_digests,
            progress=report, writable=own,
        )  # fmt: skip


def build_from_tar(
    store: LayerStore,
    archive: Path,
    *,
    name: str,
    tag: str,
    kind: LayerKind | str = LayerKind.BASE,
    parents: Iterable[str] = (),
    progress: Progress | None = None,
) -> Layer:
    """Make a layer of a root filesystem tar (plain, gzip, bzip2 or xz)."""
    archive = Path(archive)
    k, parent_digests = _prepare(store, name, tag, kind, parents)
    if not archive.is_file():
        raise InvalidSpec(
            f"{archive} is not a file; --from-tar needs a tar archive", field="archive"
        )
    report = progress or _noop
    total = archive.stat().st_size
    with store.scratch("build") as scratch:
        root = _new_root(scratch)
        with open(archive, "rb") as raw:
            done = 0

            def on_read(n: int) -> None:
                nonlocal done
                done += n
                report("unpack", min(done, total), total)

            reader = VerifyingReader(raw, on_read=on_read)
            stats = unpack_tar(cast(IO[bytes], reader), root)
        _log_stats(archive, stats)
        return _to_layer(
            store, root, scratch, name=name, tag=tag, kind=k, parents=parent_digests,
            progress=report,
        )  # fmt: skip


def build_from_oci(
    store: LayerStore,
    source: Path,
    *,
    name: str,
    tag: str,
    kind: LayerKind | str = LayerKind.BASE,
    parents: Iterable[str] = (),
    ref: str | None = None,
    progress: Progress | None = None,
) -> Layer:
    """Flatten a container image into one layer.

    ``source`` is an OCI image layout directory, an OCI archive (tar of a
    layout) or a ``docker save`` tarball — detected automatically. Its layers
    are applied in order, honouring ``.wh.`` whiteouts and ``.wh..wh..opq``
    opaque directories. ``ref`` picks an image when the file holds several
    (matched against ref-name annotations or RepoTags).
    """
    source = Path(source)
    with ImageSource(source) as src:
        image = find_layers(src, ref=ref)
        streams = [
            LayerStream(
                open=functools.partial(src.open, blob.path),
                media_type=blob.media_type,
                digest=blob.digest,
                size=blob.size,
                where=f"{source}: layer {i + 1}/{len(image.layers)} ({blob.digest or blob.path})",
            )
            for i, blob in enumerate(image.layers)
        ]
        return build_from_layers(
            store, streams, name=name, tag=tag, kind=kind, parents=parents, progress=progress,
            source=str(source),
        )  # fmt: skip


@dataclass(frozen=True)
class LayerStream:
    """One layer of a container image, to be applied over the ones before it.

    ``open()`` gives its bytes as they are stored: a tar, plain or compressed with
    gzip, bzip2, xz or zstd (told by ``media_type`` or by the bytes themselves).
    ``digest`` (``sha256:...``), when known, is checked against those bytes after
    the layer is applied; ``where`` names it in errors."""

    open: Callable[[], contextlib.AbstractContextManager[IO[bytes]]]
    media_type: str
    digest: str | None
    size: int | None
    where: str


def build_from_layers(
    store: LayerStore,
    layers: Sequence[LayerStream],
    *,
    name: str,
    tag: str,
    kind: LayerKind | str = LayerKind.BASE,
    parents: Iterable[str] = (),
    progress: Progress | None = None,
    source: str = "image",
) -> Layer:
    """Apply container image layers in order (whiteouts and opaque directories
    honoured) into one tree, streaming each, and make a layer of the result."""
    k, parent_digests = _prepare(store, name, tag, kind, parents)
    report = progress or _noop
    if not layers:
        raise LayerBuildError(f"{source}: the image has no layers", stage="oci")
    with store.scratch("build") as scratch:
        sizes = [layer.size for layer in layers]
        total = sum(s for s in sizes if s is not None) if None not in sizes else None
        root = _new_root(scratch)
        done = 0

        def on_read(n: int) -> None:
            nonlocal done
            done += n
            report("unpack", done if total is None else min(done, total), total)

        stats = UnpackStats()
        for layer in layers:
            stats.merge(_apply_stream(layer, root, on_read))
        _log_stats(source, stats)
        return _to_layer(
            store, root, scratch, name=name, tag=tag, kind=k, parents=parent_digests,
            progress=report,
        )  # fmt: skip


class _Peeked:
    """A reader whose first bytes were read ahead (to sniff the compression)."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self.head = head
        self.rest = rest

    def read(self, n: int = -1) -> bytes:
        if self.head:
            if n < 0:
                out, self.head = self.head + self.rest.read(), b""
                return out
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.rest.read(n)


def _zstd_reader(raw: Any, where: str) -> IO[bytes]:
    try:
        import zstandard
    except ImportError:
        raise LayerBuildError(
            f"{where} is zstd-compressed and the zstandard module is missing: "
            "pip install 'dsec[server]' (or zstandard)", stage="oci",
        ) from None  # fmt: skip
    return cast(IO[bytes], zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))


def _apply_stream(layer: LayerStream, root: Path, on_read: Callable[[int], None]) -> UnpackStats:
    where = layer.where
    with layer.open() as raw:
        reader = VerifyingReader(raw, on_read=on_read)
        head = reader.read(4)
        body: Any = _Peeked(head, cast(IO[bytes], reader))
        if "zstd" in layer.media_type or head == _ZSTD_MAGIC:
            body = _zstd_reader(body, where)
        try:
            stats = unpack_tar(cast(IO[bytes], body), root, whiteouts=True)
        except DsecError as e:
            # Same error class, with the layer named: "which layer of which image".
            fields = {k: v for k, v in e.fields.items() if k != "stage"}
            raise type(e)(f"{where}: {e.message}", stage="oci", **fields) from e
        except Exception as e:
            # zstd and gzip decoders raise their own errors on damaged data.
            raise LayerBuildError(f"{where}: cannot decompress the layer ({e})", stage="oci") from e
        reader.drain()
    if layer.digest is not None and layer.digest.startswith("sha256:"):
        got = "sha256:" + reader.hexdigest()
        if got != layer.digest:
            raise LayerBuildError(
                f"{where} is corrupt: its content hashes to {got}, not {layer.digest}",
                stage="oci",
            )
    return stats


def _log_stats(source: Path | str, stats: UnpackStats) -> None:
    if stats.skipped_devices:
        log.warning("%s: skipped %d device node(s)", source, stats.skipped_devices)
    log.info(
        "%s: %d members (%d files, %d dirs, %d symlinks, %d hardlinks, %d whiteouts, %d opaque)",
        source, stats.members, stats.files, stats.dirs, stats.symlinks, stats.hardlinks,
        stats.whiteouts, stats.opaque_dirs,
    )  # fmt: skip


def build_debootstrap(
    store: LayerStore,
    *,
    suite: str = "bookworm",
    variant: str = "minbase",
    packages: Iterable[str] = (),
    name: str,
    tag: str,
    kind: LayerKind | str = LayerKind.BASE,
    mirror: str | None = None,
    parents: Iterable[str] = (),
    progress: Progress | None = None,
) -> Layer:
    """Make a slim Debian base layer with debootstrap (needs root and a mirror).

    ``mirror`` defaults to the Debian mirror in apt's own sources. The tree
    is slimmed: downloaded .debs, apt lists, docs, man pages and non-C
    locales are removed; and it carries nothing of the build machine
    (:func:`~dsec.images.debootstrap.scrub_build_host`: hostname, resolv.conf,
    machine-id, logs...).
    """
    k, parent_digests = _prepare(store, name, tag, kind, parents)
    pkgs = _check_debootstrap_args(suite, variant, packages)
    if mirror is None:
        chosen = find_mirror(suite)
    else:
        if not mirror.startswith(("http://", "https://", "ftp://", "file:/")):
            raise InvalidSpec(
                f"bad mirror {mirror!r}: give a URL such as http://HOST/debian", field="mirror"
            )
        chosen = Mirror(uri=mirror.rstrip("/"))
    log.info("debootstrap %s (%s) from %s", suite, variant, chosen.uri)
    report = progress or _noop
    with store.scratch("build") as scratch:
        root = _new_root(scratch)
        run_debootstrap(
            root, suite=suite, variant=variant, packages=pkgs, mirror=chosen, progress=report
        )
        report("slim", 0, None)
        freed = slim_rootfs(root)
        scrubbed = scrub_build_host(root)
        report("slim", 1, 1)
        log.info("slimmed the tree by %d bytes; took out of it what came from the build host: %s",
                 freed, ", ".join(scrubbed) or "nothing")  # fmt: skip
        return _to_layer(
            store, root, scratch, name=name, tag=tag, kind=k, parents=parent_digests,
            progress=report,
        )  # fmt: skip


def build_busybox(
    store: LayerStore,
    *,
    name: str = "busybox",
    tag: str = "latest",
    kind: LayerKind | str = LayerKind.BASE,
    progress: Progress | None = None,
) -> Layer:
    """The fastest base layer: busybox-static and its applets (see busybox.py)."""
    k, _ = _prepare(store, name, tag, kind, ())
    with store.scratch("build") as scratch:
        root = build_busybox_rootfs(scratch / "rootfs")
        scrub_build_host(root)  # nothing today; the guarantee holds if the rootfs grows
        return _to_layer(
            store, root, scratch, name=name, tag=tag, kind=k, parents=(),
            progress=progress or _noop,
        )  # fmt: skip


__all__ = [
    "LayerStream",
    "Progress",
    "build_busybox",
    "build_busybox_rootfs",
    "build_debootstrap",
    "build_from_dir",
    "build_from_layers",
    "build_from_oci",
    "build_from_tar",
]
