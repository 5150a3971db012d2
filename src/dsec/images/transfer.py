"""Moving DSec layers between a node's layer store and an OCI registry: push and pull.

Owns: writing a stored layer into a registry in the DSec layer format
(:mod:`dsec.images.registry`: the EROFS file as the one blob, a config with
kind, name:tag, lineage and the chunk table, a manifest under a tag), and the
reverse: fetching such a layer, verifying every chunk and the whole digest
while it streams to disk, and adding it to the store.

Lineage travels with a layer. Every layer pushed is also tagged
``sha256-<layer hex>`` (:func:`~dsec.images.registry.layer_alias_tag`), and a
push pushes the layer's parents first (those in the local store), so a pull
finds each parent in the same repository by its digest and fetches it first
(a snapshot cannot be used without its lineage; other kinds record it only).

Never writes a byte to the store that was not verified: a pulled file is
added (renamed into place) only after its digest matched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dsec.errors import ImageError, LayerNotFound

from .errors import DigestMismatch, RegistryNotFound, UnsupportedManifest
from .layer import Layer, LayerKind, check_name, check_tag
from .lazyprofile import DEFAULT_TIMEOUT_S, ProfileRun
from .registry import (
    DSEC_LAYER_CONFIG,
    DSEC_LAYER_DATA,
    DSEC_LAYER_EROFS,
    DSEC_LAYER_META,
    OCI_MANIFEST,
    BlobTable,
    Descriptor,
    DsecLayerConfig,
    LazyForm,
    Manifest,
    RegistryClient,
    RegistryRef,
    dsec_layer_manifest,
    layer_alias_tag,
)
from .store import LayerStore

log = logging.getLogger("dsec.images")

Progress = Callable[[str, int, int | None], None]
"""``progress(stage, done, total)``, as for builds; stages ``push`` and ``pull`` (bytes)."""
_MAX_LINEAGE = 64


def _noop(stage: str, done: int, total: int | None) -> None:
    pass


@dataclass(frozen=True)
class Pushed:
    """What a push stored: the manifest's digest, and whether the blob had to be sent."""

    ref: str
    """``host/repo:tag`` the layer is now under."""
    manifest_digest: str
    layer: Layer
    uploaded: bool
    """False when the registry had the EROFS blob already (only metadata was sent)."""
    parents: list[str] = field(default_factory=list)
    """Digests of parent layers pushed with it (each under its ``sha256-<hex>`` tag)."""
    lazy: LazyForm | None = None
    """The layer's lazy form as pushed (None: pushed without one)."""
    profile: ProfileRun | None = None
    """The prefetch profile recorded by this push (None: none asked for, reused, or not possible)."""


def push_layer(
    store: LayerStore,
    ref: str,
    client: RegistryClient,
    dest: RegistryRef,
    *,
    progress: Progress | None = None,
    lazy_form: bool = True,
    profile: str | None = None,
    profile_timeout_s: float = DEFAULT_TIMEOUT_S,
    profile_under: Sequence[str] = (),
) -> Pushed:
    """Push the layer ``ref`` (``NAME[:TAG]`` or digest) of ``store`` to ``dest``.

    The registry tag is ``dest.tag`` if given, else the layer's own tag. Parents that
    are in the store are pushed first; parents that are not are named in a warning.
    ``lazy_form`` also pushes the layer's lazy form (:mod:`.lazyform`; reused when the
    registry has it already), which edges need to load the layer lazily; without
    CAP_SYS_ADMIN it is left out with a warning.

    ``profile``: a start-up command (``/bin/sh -c``) to record the layer's prefetch
    profile with (:mod:`.lazyprofile`): the data chunks it reads are fetched ahead by
    every edge that attaches the layer. Recorded for this layer only, with its local
    parents below it, then the layers ``profile_under`` (refs in the store, top first:
    the base a workspace or toolkit layer runs on, which is not its parent); a profile
    that cannot be recorded is left out with a warning.
    """
    layer = store.resolve(ref)
    report = progress or _noop
    pushed_parents: list[str] = []
    lineage = _lineage(store, layer)
    for parent in lineage:
        _push_one(store, store.get(parent), client, dest.repo, tags=[layer_alias_tag(parent)],
                  report=_noop, lazy_form=lazy_form)  # fmt: skip
        pushed_parents.append(parent)
    tag = dest.tag or layer.tag
    prof = None
    if profile is not None and lazy_form:
        below = _parent_files(store, layer, lineage)
        if below is not None:
            below += [store.open_local(store.resolve(r).digest) for r in profile_under]
        prof = _ProfileAsk(profile, profile_timeout_s, below)
    digest, uploaded, lazy, run = _push_one(store, layer, client, dest.repo, tags=[tag, layer_alias_tag(layer.digest)],
                                            report=report, lazy_form=lazy_form, profile=prof)  # fmt: skip
    host = dest.base_url.split("://", 1)[1]
    return Pushed(f"{host}/{dest.repo}:{tag}", digest, layer, uploaded, pushed_parents, lazy, run)


@dataclass(frozen=True)
class _ProfileAsk:
    command: str
    timeout_s: float
    parents: list[Path] | None
    """The ancestors' local EROFS files, nearest first (None: one is not in the store)."""


def _parent_files(store: LayerStore, layer: Layer, lineage: list[str]) -> list[Path] | None:
    """What a profile run mounts below the layer: its ancestors' files, nearest first
    (None when one of them is not in the store: ``lineage`` lists only those that are)."""
    todo, seen = list(layer.parents), set()
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            try:
                todo.extend(store.get(d).parents)
            except LayerNotFound:
                return None
    try:
        return [store.open_local(d) for d in reversed(lineage)]
    except ImageError as exc:
        log.warning("%s: a parent layer's file is not readable here (%s)", layer.ref, exc)
        return None


def _lineage(store: LayerStore, layer: Layer) -> list[str]:
    """The layer's ancestors that are in the store, oldest first (each once)."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(digest: str, depth: int) -> None:
        if depth > _MAX_LINEAGE:
            raise ImageError(f"the lineage of {layer.ref} is deeper than {_MAX_LINEAGE} layers",
                             digest=layer.digest)  # fmt: skip
        try:
            parent = store.get(digest)
        except LayerNotFound:
            log.warning("%s: parent layer %s is not in the local store, so it is not pushed; "
                        "a pull of %s will not find it", layer.ref, digest, layer.ref)  # fmt: skip
            return
        for p in parent.parents:
            if p not in seen:
                seen.add(p)
                visit(p, depth + 1)
        order.append(digest)

    for p in layer.parents:
        if p not in seen:
            seen.add(p)
            visit(p, 1)
    return order


def _push_one(
    store: LayerStore, layer: Layer, client: RegistryClient, repo: str, *, tags: list[str], report: Progress,
    lazy_form: bool = True, profile: _ProfileAsk | None = None,
) -> tuple[str, bool, LazyForm | None, ProfileRun | None]:
    path = store.open_local(layer.digest)
    report("push", 0, layer.size)
    config = DsecLayerConfig.of_file(path, kind=layer.kind, name=layer.name, tag=layer.tag,
                                     parents=layer.parents)  # fmt: skip
    if config.digest != layer.digest or config.size != layer.size:
        raise ImageError(
            f"the local file of {layer.ref} ({path}) no longer hashes to {layer.digest}: it is damaged; "
            f"remove the layer (`dsec image rm {layer.digest}`) and build or pull it again",
            digest=layer.digest,
        )  # fmt: skip
    blob, uploaded = client.push_blob_file(
        repo, path, digest=layer.digest, media_type=DSEC_LAYER_EROFS,
        on_progress=lambda done, total: report("push", done, total),
    )  # fmt: skip
    lazy = _push_lazy_form(store, layer, path, client, repo) if lazy_form else None
    run = None
    if lazy is not None and profile is not None:
        lazy, run = _with_profile(store, layer, lazy, client, repo, profile)
    if lazy is not None:
        config = config.model_copy(update={"lazy": lazy})
    cfg = client.push_blob(repo, config.to_json(), media_type=DSEC_LAYER_CONFIG)
    extra = None if lazy is None else (Descriptor(DSEC_LAYER_META, lazy.meta.digest, lazy.meta.blob_size),
                                       Descriptor(DSEC_LAYER_DATA, lazy.data.digest, lazy.data.blob_size))  # fmt: skip
    raw = dsec_layer_manifest(cfg, Descriptor(DSEC_LAYER_EROFS, blob.digest, blob.size), title=layer.ref,
                              lazy=extra)  # fmt: skip
    digest = ""
    for tag in tags:
        digest = client.put_manifest(repo, tag, raw, OCI_MANIFEST)
    return digest, uploaded, lazy, run


def _with_profile(store: LayerStore, layer: Layer, form: LazyForm, client: RegistryClient, repo: str,
                  ask: _ProfileAsk) -> tuple[LazyForm, ProfileRun | None]:  # fmt: skip
    """``form`` with the prefetch profile of ``ask.command`` (kept when it was recorded
    with that command before); unchanged, with a warning, when it cannot be recorded."""
    from .lazyprofile import ProfileUnavailable, as_runs, record_profile

    if form.profile == ask.command:
        return form, None
    if ask.parents is None:
        log.warning("%s: pushed without a prefetch profile: a parent layer is not in the local store, so the "
                    "start-up cannot be run over the whole image", layer.ref)  # fmt: skip
        return form, None
    with store.scratch("lazyprofile") as work:
        try:
            run = record_profile(client, repo, form, ask.parents, ask.command, work, timeout_s=ask.timeout_s)
        except ProfileUnavailable as exc:
            log.warning("%s: pushed without a prefetch profile: %s", layer.ref, exc)
            return form, None
    if run.returncode != 0:
        log.warning("%s: the profile command %r exited %d; what it read until then is the profile. Its output "
                    "ends: %s", layer.ref, ask.command, run.returncode, run.output_tail[-500:].strip())  # fmt: skip
    return form.model_copy(update={"prefetch": as_runs(run.chunks), "profile": ask.command}), run


def _push_lazy_form(store: LayerStore, layer: Layer, path: Path, client: RegistryClient, repo: str) -> LazyForm | None:
    """The layer's lazy form in ``repo``: the one pushed before (found by the layer's alias
    tag, its blobs still there) or a new one built and uploaded now; None when it cannot
    be built here (a warning says why) or the layer has no file data."""
    from .lazyform import LazyFormUnavailable, build_lazy_form

    try:
        _, old = read_dsec_layer(client, repo, layer_alias_tag(layer.digest))
        if old.digest == layer.digest and old.lazy is not None and all(
                client.blob_size(repo, t.digest) == t.blob_size for t in (old.lazy.meta, old.lazy.data)):
            return old.lazy
    except (RegistryNotFound, UnsupportedManifest):
        pass
    with store.scratch("lazyform") as work:
        try:
            meta, data = build_lazy_form(path, work)
        except LazyFormUnavailable as exc:
            log.warning("%s: pushed without a lazy form (edges will fetch metadata chunk by chunk): %s",
                        layer.ref, exc)  # fmt: skip
            return None
        if data.stat().st_size == 0:
            return None
        # each 64 KiB chunk compressed on its own: an edge fetches, checks and inflates any one alone
        meta_z, data_z = work / "meta.zst", work / "data.zst"
        form = LazyForm(meta=BlobTable.encode_file(meta, meta_z), data=BlobTable.encode_file(data, data_z),
                        extents=_packed_extents(meta, layer))  # fmt: skip
        client.push_blob_file(repo, meta_z, digest=form.meta.digest, media_type=DSEC_LAYER_META)
        client.push_blob_file(repo, data_z, digest=form.data.digest, media_type=DSEC_LAYER_DATA)
    return form


def _packed_extents(meta: Path, layer: Layer) -> str:
    """The data device's file extents, worked out here once so that no edge has to."""
    from .lazy.erofs_meta import ErofsFormatError
    from .lazy.extents import pack, walk_extents

    try:
        return pack(walk_extents(meta.read_bytes()).data_extents or [])
    except ErofsFormatError as exc:
        log.warning("%s: the lazy form's file extents could not be worked out (%s); edges will work them out", layer.ref, exc)
        return ""


# -- pull -----------------------------------------------------------------------------------


def read_dsec_layer(client: RegistryClient, repo: str, reference: str) -> tuple[Manifest, DsecLayerConfig]:
    """The manifest and config of the DSec layer at ``repo:reference``, both checked.

    :class:`UnsupportedManifest` when it is not a DSec layer (a container image, say:
    that is ``dsec image import``'s job) or its parts disagree."""
    m = client.get_manifest(repo, reference)
    if not m.is_dsec_layer:
        raise UnsupportedManifest(
            f"{m.where} is not a DSec layer ({'an image index' if m.is_index else m.media_type}"
            f"{', artifactType ' + m.artifact_type if m.artifact_type else ''}); for a container "
            "image use `dsec image import`", media_type=m.media_type,
        )  # fmt: skip
    cfg_desc = m.config
    layers = m.layers
    if cfg_desc.media_type != DSEC_LAYER_CONFIG:
        raise UnsupportedManifest(f"{m.where}: config media type {cfg_desc.media_type!r}, expected "
                                  f"{DSEC_LAYER_CONFIG}", media_type=cfg_desc.media_type)  # fmt: skip
    kinds = [d.media_type for d in layers]
    if kinds not in ([DSEC_LAYER_EROFS], [DSEC_LAYER_EROFS, DSEC_LAYER_META, DSEC_LAYER_DATA]):
        raise UnsupportedManifest(f"{m.where}: a DSec layer has one {DSEC_LAYER_EROFS} blob, then optionally its "
                                  f"lazy form's {DSEC_LAYER_META} and {DSEC_LAYER_DATA} (found: "
                                  f"{', '.join(kinds) or 'none'})", media_type=m.media_type)  # fmt: skip
    cfg = DsecLayerConfig.parse(client.get_blob(repo, cfg_desc.digest), where=m.where)
    if cfg.digest != layers[0].digest or cfg.size != layers[0].size:
        raise UnsupportedManifest(
            f"{m.where}: the config describes {cfg.digest} ({cfg.size} bytes) but the manifest's blob is "
            f"{layers[0].digest} ({layers[0].size} bytes); push the layer again", media_type=m.media_type,
        )  # fmt: skip
    lazy = cfg.lazy
    if (lazy is None) != (len(layers) == 1) or (lazy is not None and (
            (lazy.meta.digest, lazy.meta.blob_size) != (layers[1].digest, layers[1].size)
            or (lazy.data.digest, lazy.data.blob_size) != (layers[2].digest, layers[2].size))):
        raise UnsupportedManifest(f"{m.where}: the config's lazy form and the manifest's blobs disagree; push the "
                                  "layer again", media_type=m.media_type)  # fmt: skip
    return m, cfg


def pull_layer(
    store: LayerStore,
    client: RegistryClient,
    src: RegistryRef,
    *,
    name: str | None = None,
    tag: str | None = None,
    progress: Progress | None = None,
) -> Layer:
    """Fetch the DSec layer ``src`` into ``store`` under ``name:tag`` (default: the name
    and tag it was pushed from), its parents first. Returns the stored layer."""
    if name is not None:
        check_name(name)
    if tag is not None:
        check_tag(tag)
    return _pull(store, client, src.repo, src.reference, name=name, tag=tag, report=progress or _noop,
                 seen=set(), depth=0)  # fmt: skip


def _pull(
    store: LayerStore,
    client: RegistryClient,
    repo: str,
    reference: str,
    *,
    name: str | None,
    tag: str | None,
    report: Progress,
    seen: set[str],
    depth: int,
) -> Layer:
    m, cfg = read_dsec_layer(client, repo, reference)
    if depth > _MAX_LINEAGE or cfg.digest in seen:
        raise UnsupportedManifest(f"{m.where}: the layer's lineage loops or is deeper than {_MAX_LINEAGE}",
                                  media_type=m.media_type)  # fmt: skip
    seen.add(cfg.digest)
    for parent in cfg.parents:
        if _have(store, parent):
            continue
        try:
            _pull(store, client, repo, layer_alias_tag(parent), name=None, tag=None, report=_noop,
                  seen=seen, depth=depth + 1)  # fmt: skip
        except RegistryNotFound:
            if cfg.kind == LayerKind.SNAPSHOT:
                raise RegistryNotFound(
                    f"{m.where} is a snapshot over {parent}, which is neither in the local store nor in "
                    f"{repo} (tag {layer_alias_tag(parent)}): push the snapshot again from a store that "
                    "holds its lineage", status=404, registry_code="MANIFEST_UNKNOWN", url=m.where,
                ) from None  # fmt: skip
            log.warning("%s: parent layer %s is not in %s; its lineage is recorded only", m.where, parent, repo)
    want_name, want_tag = name or cfg.name, tag or cfg.tag
    if depth > 0 and _names_other(store, want_name, want_tag, cfg.digest):
        # A parent pulled along must not re-point a local name the user did not ask to change.
        want_tag = layer_alias_tag(cfg.digest)[:19]
    if _have(store, cfg.digest):
        return _retag(store, cfg, want_name, want_tag)
    with store.scratch("pull") as scratch:
        path = scratch / "layer.erofs"
        _download(client, repo, cfg, path, report, where=m.where)
        return store.add_erofs(path, name=want_name, tag=want_tag, kind=cfg.kind, parents=cfg.parents,
                               consume=True)  # fmt: skip


def _have(store: LayerStore, digest: str) -> bool:
    try:
        store.get(digest)
    except LayerNotFound:
        return False
    return True


def _names_other(store: LayerStore, name: str, tag: str, digest: str) -> bool:
    try:
        return store.resolve(f"{name}:{tag}").digest != digest
    except LayerNotFound:
        return False


def _retag(store: LayerStore, cfg: DsecLayerConfig, name: str, tag: str) -> Layer:
    """The layer is stored already: give it ``name:tag`` (a hard link of its file into
    the store's scratch, so nothing is copied; a copy where links do not work)."""
    try:
        current = store.resolve(f"{name}:{tag}")
        if current.digest == cfg.digest:
            return current
    except LayerNotFound:
        pass
    src = store.open_local(cfg.digest)
    with store.scratch("pull") as scratch:
        link = scratch / "layer.erofs"
        try:
            os.link(src, link)
            return store.add_erofs(link, name=name, tag=tag, kind=cfg.kind, parents=cfg.parents, consume=True)
        except OSError:
            return store.add_erofs(src, name=name, tag=tag, kind=cfg.kind, parents=cfg.parents)


def _download(client: RegistryClient, repo: str, cfg: DsecLayerConfig, path: Path, report: Progress,
              *, where: str) -> None:  # fmt: skip
    """Stream the layer blob to ``path``, each chunk checked against the table on arrival."""
    report("pull", 0, cfg.size)
    done = 0
    with client.open_blob(repo, cfg.digest, size=cfg.size) as blob, open(path, "wb") as out:
        for i in range(cfg.chunk_count):
            start, end = cfg.chunk_range(i)
            data = blob.read(end - start)
            if not cfg.verify_chunk(i, data):
                raise DigestMismatch(
                    f"{where}: chunk {i} (bytes {start}-{end - 1}) of {cfg.digest} does not match its "
                    f"digest {cfg.chunks[i]}"
                    + (f" (got {len(data)} of {end - start} bytes)" if len(data) != end - start else "")
                    + "; the registry's copy is damaged or was tampered with: nothing was kept, push the "
                    "layer again", expected=cfg.chunks[i], got="", chunk=i, status=0, url=where,
                )  # fmt: skip
            out.write(data)
            done += len(data)
            report("pull", done, cfg.size)
        blob.verify()
        out.flush()
        os.fsync(out.fileno())


__all__ = ["Pushed", "pull_layer", "push_layer", "read_dsec_layer"]
