"""``dsec image``: build, list and remove layers in the local layer store.

The store lives at ``$DSEC_STATE_DIR/layers`` (default ``/var/lib/dsec/layers``)
unless ``--store DIR`` is given. Progress and warnings go to stderr, results to
stdout, so ``--json`` output can be piped.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dsec.errors import DsecError

if TYPE_CHECKING:
    from dsec.images.store import LocalLayerStore

DEFAULT_STATE_DIR = "/var/lib/dsec"
_STORE_KEY = "dsec.image.store_root"


def default_store_root() -> Path:
    """``$DSEC_STATE_DIR/layers``, or ``/var/lib/dsec/layers``."""
    return Path(os.environ.get("DSEC_STATE_DIR") or DEFAULT_STATE_DIR) / "layers"


def _store(ctx: click.Context) -> LocalLayerStore:
    from dsec.images.store import LocalLayerStore

    root = ctx.meta.get(_STORE_KEY) or default_store_root()
    return LocalLayerStore(Path(root))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _ago(t: float) -> str:
    d = max(0.0, time.time() - t)
    if d < 90:
        return f"{d:.0f}s ago"
    if d < 90 * 60:
        return f"{d / 60:.0f}m ago"
    if d < 36 * 3600:
        return f"{d / 3600:.0f}h ago"
    return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d")


@contextmanager
def _errors() -> Iterator[None]:
    """Turn DSec errors into a one-line message and exit status 1."""
    try:
        yield
    except DsecError as e:
        raise click.ClickException(e.message) from e


class _Stages:
    """When each build stage started and ended, for the one-line summary."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.spans: dict[str, list[float]] = {}

    def saw(self, stage: str) -> None:
        now = time.monotonic()
        span = self.spans.setdefault(stage, [now, now])
        span[1] = now

    def summary(self) -> str:
        parts = [f"{stage} {end - start:.1f} s" for stage, (start, end) in self.spans.items()
                 if end - start >= 0.05]  # fmt: skip
        return f"in {time.monotonic() - self.t0:.1f} s" + (f" ({', '.join(parts)})" if parts else "")


@contextmanager
def _progress_display(
    enabled: bool, stages: _Stages | None = None
) -> Iterator[Callable[[str, int, int | None], None]]:
    """A build progress callback rendered with rich on stderr (and warnings with it).

    The display is transient: it is erased when the build ends, so nothing of it is left
    to be redrawn around the digest printed next; the caller prints a one-line summary
    of the stages (``stages``) instead."""
    from rich.console import Console
    from rich.logging import RichHandler
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    handler = RichHandler(console=console, show_time=False, show_path=False)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("dsec.images")
    logger.addHandler(handler)
    old_level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description:<24}"),
        BarColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not enabled or not console.is_terminal,  # a log gets the summary line only
    )
    tasks: dict[str, Any] = {}
    last: list[str] = []

    def detail(stage: str, done: int, total: int | None) -> str:
        if stage in ("unpack", "push", "pull"):
            return _human(done) + (f" / {_human(total)}" if total else "")
        if stage.startswith("debootstrap"):
            return f"{done}" + (f"/{total} packages" if total else " packages")
        return ""

    def finish(stage: str) -> None:
        task = progress.tasks[tasks[stage]]
        done = int(task.completed)
        total = int(task.total) if task.total is not None else max(done, 1)
        progress.update(
            tasks[stage],
            completed=total,
            total=total,
            detail=detail(stage, done, None if stage.startswith("debootstrap") else total),
        )

    def report(stage: str, done: int, total: int | None) -> None:
        if stages is not None:
            stages.saw(stage)
        if stage not in tasks:
            if last:
                finish(last[-1])
            tasks[stage] = progress.add_task(stage, total=total, detail="")
            last.append(stage)
        progress.update(
            tasks[stage], completed=done, total=total, detail=detail(stage, done, total)
        )

    try:
        with progress:
            yield report
            if last:
                finish(last[-1])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@click.group("image")
@click.option(
    "--store",
    "store_root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Layer store directory [default: $DSEC_STATE_DIR/layers or /var/lib/dsec/layers].",
)
@click.pass_context
def image_group(ctx: click.Context, store_root: Path | None) -> None:
    """Build, list and remove image layers (EROFS, content-addressed)."""
    if store_root is not None:
        ctx.meta[_STORE_KEY] = store_root


_KINDS = ("base", "workspace", "toolkit")


@image_group.command("build")
@click.option(
    "--from-dir",
    "from_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Build from a directory tree.",
)
@click.option(
    "--from-tar",
    "from_tar",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Build from a root filesystem tar (plain/gzip/bzip2/xz).",
)
@click.option(
    "--from-oci",
    "from_oci",
    type=click.Path(exists=True, path_type=Path),
    help="Flatten an OCI layout (dir or tar) or a `docker save` tarball.",
)
@click.option(
    "--debootstrap",
    "suite",
    metavar="SUITE",
    help="Build a Debian base with debootstrap (e.g. bookworm).",
)
@click.option("--busybox", is_flag=True, help="Build the minimal busybox-static rootfs.")
@click.option(
    "--toolchains",
    metavar="A,B",
    help="Build language toolchains: tc-base:SUITE (debootstrap) and a toolkit layer "
    "tc-NAME:SUITE per toolchain (python, pytest, c, cpp, go, java, nodejs, typescript, rust, "
    "bash, jupyter, php, csharp, ruby, perl, lua, r, scala, kotlin, d, racket, jest, junit, verilog, "
    "or all); existing current ones are kept. docs/COMPAT.md.",
)
@click.option("--suite", "suite_tc", default="bookworm", show_default=True,
              help="With --toolchains: Debian suite (the tag).")
@click.option("--rebuild", is_flag=True, help="With --toolchains: build again even what exists.")
@click.option("--profile", "tc_profile", type=click.Choice(["sandboxfusion"]), default=None,
              help="With --toolchains: also the library layers of this profile (sandboxfusion: the packages "
                   "of SandboxFusion's image: numpy, pandas... for python, lodash for node, testify for go).")
@click.option(
    "--apt-option",
    "apt_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="With --toolchains: an apt-get -o option, e.g. Acquire::http::Proxy=http://proxy:3128 (repeatable).",
)
@click.option(
    "--ref",
    "oci_ref",
    metavar="NAME",
    help="With --from-oci: which image, if the file holds several.",
)
@click.option(
    "--packages",
    default="",
    metavar="A,B",
    help="With --debootstrap: extra packages, comma-separated.",
)
@click.option(
    "--variant",
    default="minbase",
    show_default=True,
    help="With --debootstrap: debootstrap variant.",
)
@click.option(
    "--mirror",
    metavar="URL",
    help="With --debootstrap: Debian mirror [default: the one in apt's sources].",
)
@click.option("--name", help="Layer name (lowercase a-z 0-9 . _ -); required except with --toolchains.")
@click.option("--tag", default="latest", show_default=True, help="Layer tag.")
@click.option("--kind", type=click.Choice(_KINDS), default="base", show_default=True)
@click.option(
    "--parent",
    "parents",
    multiple=True,
    metavar="REF",
    help="Layer this one builds on (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the layer as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@click.pass_context
def build_cmd(
    ctx: click.Context,
    from_dir: Path | None,
    from_tar: Path | None,
    from_oci: Path | None,
    suite: str | None,
    busybox: bool,
    toolchains: str | None,
    suite_tc: str,
    rebuild: bool,
    tc_profile: str | None,
    apt_options: tuple[str, ...],
    oci_ref: str | None,
    packages: str,
    variant: str,
    mirror: str | None,
    name: str | None,
    tag: str,
    kind: str,
    parents: tuple[str, ...],
    as_json: bool,
    quiet: bool,
) -> None:
    """Build a layer and print its digest.

    Exactly one source: --from-dir DIR, --from-tar FILE, --from-oci PATH,
    --debootstrap SUITE, --busybox, or --toolchains A,B (several layers: one
    line per layer). Building the same content again gives the same digest.
    """
    from dsec.images import build as b

    if toolchains is not None:
        if any(v is not None for v in (from_dir, from_tar, from_oci, suite, oci_ref, name)) or busybox or packages \
                or parents or kind != "base" or tag != "latest" or variant != "minbase":
            raise click.UsageError("--toolchains takes no other source, --name, --tag, --kind, --parent, "
                                   "--packages or --variant (the names are tc-base:SUITE and tc-NAME:SUITE)")
        _build_toolchains(ctx, toolchains, suite_tc, mirror, rebuild, apt_options, as_json, quiet, tc_profile)
        return
    if suite_tc != "bookworm" or rebuild or apt_options or tc_profile:
        raise click.UsageError("--suite, --rebuild, --profile and --apt-option only apply to --toolchains")
    if name is None:
        raise click.UsageError("--name is required")

    chosen = [
        opt
        for opt, val in (
            ("--from-dir", from_dir),
            ("--from-tar", from_tar),
            ("--from-oci", from_oci),
            ("--debootstrap", suite),
            ("--busybox", busybox or None),
        )
        if val is not None
    ]
    if len(chosen) != 1:
        raise click.UsageError(
            "give exactly one source: --from-dir, --from-tar, --from-oci, --debootstrap, --busybox or --toolchains"
            + (f" (got {', '.join(chosen)})" if chosen else "")
        )
    if oci_ref is not None and from_oci is None:
        raise click.UsageError("--ref only applies to --from-oci")
    if suite is None and (packages or mirror or variant != "minbase"):
        raise click.UsageError("--packages, --variant and --mirror only apply to --debootstrap")
    stages = _Stages()
    with _errors():
        store = _store(ctx)
        with _progress_display(enabled=not quiet, stages=stages) as progress:
            common: dict[str, Any] = {
                "name": name,
                "tag": tag,
                "kind": kind,
                "progress": progress,
            }
            if from_dir is not None:
                layer = b.build_from_dir(store, from_dir, parents=parents, **common)
            elif from_tar is not None:
                layer = b.build_from_tar(store, from_tar, parents=parents, **common)
            elif from_oci is not None:
                layer = b.build_from_oci(store, from_oci, parents=parents, ref=oci_ref, **common)
            elif suite is not None:
                layer = b.build_debootstrap(
                    store,
                    suite=suite,
                    variant=variant,
                    packages=[p for p in packages.split(",") if p.strip()],
                    mirror=mirror,
                    parents=parents,
                    **common,
                )
            else:
                if parents:
                    raise click.UsageError("--busybox layers have no parents")
                layer = b.build_busybox(store, **common)
    if not quiet:
        click.echo(
            f"built {layer.ref} ({layer.kind.value}, {_human(layer.size)}) {stages.summary()}",
            err=True,
        )
    if as_json:
        click.echo(layer.model_dump_json())
    else:
        click.echo(layer.digest)


def _build_toolchains(ctx: click.Context, spec: str, suite: str, mirror: str | None, rebuild: bool,
                      apt_options: tuple[str, ...], as_json: bool, quiet: bool, profile: str | None = None) -> None:
    """``build --toolchains``: one line per layer on stderr (built or kept), its digest on stdout."""
    from dsec.images.toolchains import build_toolchains

    stages = _Stages()
    with _errors():
        store = _store(ctx)
        with _progress_display(enabled=not quiet, stages=stages) as progress:
            done = build_toolchains(store, spec.split(","), suite=suite, mirror=mirror, rebuild=rebuild,
                                    apt_options=apt_options, progress=progress, profile=profile)
    for item in done:
        if item.layer is None:
            if not quiet:
                click.echo(f"{item.toolchain}: runs on the base alone (no toolkit layer)", err=True)
            continue
        if not quiet:
            what = "built" if item.built else "kept"
            click.echo(f"{what} {item.layer.ref} ({item.layer.kind.value}, {_human(item.layer.size)})", err=True)
        click.echo(item.layer.model_dump_json() if as_json else item.layer.digest)
    if not quiet:
        click.echo(f"toolchains {', '.join(i.toolchain for i in done[1:])} ready {stages.summary()}", err=True)


@image_group.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print layers as a JSON array.")
@click.pass_context
def ls_cmd(ctx: click.Context, as_json: bool) -> None:
    """List layers (one row per name:tag)."""
    with _errors():
        layers = _store(ctx).list()
    if as_json:
        click.echo(json.dumps([lay.model_dump(mode="json") for lay in layers]))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    remote = any(lay.source for lay in layers)
    for col in ("NAME:TAG", "DIGEST", "KIND", "SIZE", "CREATED", *(("SOURCE",) if remote else ())):
        table.add_column(col, justify="right" if col == "SIZE" else "left")
    for lay in layers:
        table.add_row(
            lay.ref, lay.digest[:19], lay.kind.value, _human(lay.size), _ago(lay.created_at),
            *((lay.source or "local",) if remote else ()),
        )
    Console().print(table)


@image_group.command("inspect")
@click.argument("ref")
@click.pass_context
def inspect_cmd(ctx: click.Context, ref: str) -> None:
    """Print one layer as JSON, with who pins it."""
    with _errors():
        store = _store(ctx)
        layer = store.resolve(ref)
        holders = sorted(store.holders(layer.digest))
    click.echo(json.dumps({**layer.model_dump(mode="json"), "holders": holders}, indent=2))


@image_group.command("rm")
@click.argument("refs", nargs=-1, required=True, metavar="REF...")
@click.pass_context
def rm_cmd(ctx: click.Context, refs: tuple[str, ...]) -> None:
    """Remove layers (NAME[:TAG] removes that tag; sha256:HEX removes the layer).

    A layer's file is deleted with its last name (a running edge unmounts it
    within a second). Layers in use by a sandbox are refused; a runtime keeps
    a layer pinned for a second after its last sandbox ends, and rm waits for
    that.
    """
    with _errors():
        store = _store(ctx)
        for ref in refs:
            _remove(store, ref)
            click.echo(f"removed {ref}")


def _remove(store: LocalLayerStore, ref: str) -> None:
    """``store.remove(ref)``, waiting a moment for pins to go: a runtime whose last sandbox
    on the layer just ended holds its pin for IDLE_PIN_GRACE_S more."""
    from dsec.errors import LayerInUse
    from dsec.images.mounts import IDLE_PIN_GRACE_S

    deadline = time.monotonic() + IDLE_PIN_GRACE_S + 2.0
    while True:
        try:
            store.remove(ref)
            return
        except LayerInUse as e:
            digest = e.fields.get("digest")
            # Not pinned (a snapshot lies on top of it): waiting cannot help.
            if not isinstance(digest, str) or not store.holders(digest):
                raise
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.05)


# -- registries: push, pull, import ---------------------------------------------------------


def _registry_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--password-stdin", is_flag=True,
                     help="Read the registry password (or token) from stdin "
                          "[default: $DSEC_REGISTRY_PASSWORD].")(f)  # fmt: skip
    f = click.option("--username", "-u", default=None, envvar="DSEC_REGISTRY_USERNAME",
                     help="Registry user (basic auth and token servers) [env DSEC_REGISTRY_USERNAME].")(f)  # fmt: skip
    return f


def _client(base_url: str, username: str | None, password_stdin: bool) -> Any:
    import sys

    from dsec.images.registry import Credentials, RegistryClient

    password = os.environ.get("DSEC_REGISTRY_PASSWORD", "")
    if password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    if password and not username:
        raise click.UsageError("a registry password was given without --username")
    creds = Credentials(username, password) if username else None
    return RegistryClient(base_url, credentials=creds)


def _registry_ref(text: str, param: str, *, allow_tag: bool = True) -> Any:
    from dsec.errors import InvalidSpec
    from dsec.images.registry import parse_registry_ref

    try:
        return parse_registry_ref(text, allow_tag=allow_tag, default_tag=None)
    except InvalidSpec as e:
        raise click.BadParameter(e.message, param_hint=param) from None


def _name_tag(text: str | None) -> tuple[str | None, str | None]:
    if text is None:
        return None, None
    name, _, tag = text.partition(":")
    return name, tag or None


@image_group.command("push")
@click.argument("ref", metavar="NAME[:TAG]")
@click.option("--registry", "registry", required=True, metavar="[http[s]://]HOST[:PORT]/REPO[:TAG]",
              help="Where to push; the tag defaults to the layer's own.")  # fmt: skip
@_registry_options
@click.option("--no-lazy-form", "no_lazy_form", is_flag=True,
              help="Do not add the lazy form (metadata image + data device) edges load lazily.")
@click.option("--profile", "profile", default=None, metavar="CMD",
              help="Record a prefetch profile: run CMD (/bin/sh -c, no network) over the lazy form and keep "
                   "the chunks it reads; edges fetch them ahead when they attach the layer. Needs root.")
@click.option("--profile-under", "profile_under", multiple=True, metavar="NAME[:TAG]",
              help="A layer of the store to put below for the profile run (repeat, top first): the base a "
                   "workspace or toolkit layer runs on.")
@click.option("--profile-timeout", "profile_timeout", type=click.FloatRange(min=1), default=300.0,
              show_default=True, metavar="SECONDS", help="Kill the profile command after this long.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@click.pass_context
def push_cmd(ctx: click.Context, ref: str, registry: str, username: str | None, password_stdin: bool,
             no_lazy_form: bool, profile: str | None, profile_under: tuple[str, ...], profile_timeout: float,
             as_json: bool, quiet: bool) -> None:  # fmt: skip
    """Push a layer (and the parents the store has) to an OCI registry.

    The layer's EROFS file goes up once as a blob (skipped when the registry
    has it), with a config holding its kind, name:tag, lineage and chunk table,
    under a manifest tagged TAG and sha256-<layer hex>; and, unless --no-lazy-form,
    the layer's lazy form (a metadata-only EROFS image and its data device: needs
    root to build), which lets edges mount it without downloading it. An edge
    finds NAME:TAG in its registry at HOST/<namespace>/NAME. Prints the manifest digest.

    With --profile CMD the push also records which chunks of the lazy form a
    start-up reads (e.g. --profile 'python3 -c pass'): CMD runs chrooted in the
    image, lazily loaded from the registry as an edge loads it, in private
    namespaces without network; every edge then fetches those chunks at once when
    it attaches the layer, instead of one by one as the first exec faults them in.
    """
    from dsec.images.transfer import push_layer

    dest = _registry_ref(registry, "--registry")
    if dest.digest is not None:
        raise click.BadParameter("push to a tag (HOST/REPO[:TAG]), not a digest", param_hint="--registry")
    if profile is not None and no_lazy_form:
        raise click.BadParameter("a prefetch profile is part of the lazy form: drop --no-lazy-form",
                                 param_hint="--profile")  # fmt: skip
    if profile_under and profile is None:
        raise click.BadParameter("--profile-under is for a --profile run: add --profile CMD",
                                 param_hint="--profile-under")  # fmt: skip
    if profile is not None and not profile.strip():
        raise click.BadParameter("give the start-up command to record, e.g. --profile 'python3 -c pass'",
                                 param_hint="--profile")  # fmt: skip
    with _errors():
        store = _store(ctx)
        with _client(dest.base_url, username, password_stdin) as client, \
                _progress_display(enabled=not quiet) as progress:  # fmt: skip
            result = push_layer(store, ref, client, dest, progress=progress, lazy_form=not no_lazy_form,
                                profile=profile, profile_timeout_s=profile_timeout,
                                profile_under=profile_under)  # fmt: skip
    lazy = result.lazy
    if not quiet:
        sent = "uploaded" if result.uploaded else "already there, metadata only"
        click.echo(f"pushed {result.layer.ref} to {result.ref} ({_human(result.layer.size)}, {sent})", err=True)
        if result.profile is not None and lazy is not None:
            run = result.profile
            click.echo(f"prefetch profile of {run.command!r} (exit {run.returncode}, {run.seconds:.1f} s): "
                       f"{len(run.chunks)} of {len(lazy.data.chunks)} data chunks, {_human(lazy.prefetch_bytes)} "
                       "fetched ahead at attach", err=True)  # fmt: skip
        elif profile is not None and lazy is not None and lazy.profile == profile:
            click.echo(f"prefetch profile of {profile!r} kept from the earlier push "
                       f"({_human(lazy.prefetch_bytes)})", err=True)  # fmt: skip
    if as_json:
        click.echo(json.dumps({"ref": result.ref, "manifest_digest": result.manifest_digest,
                               "layer_digest": result.layer.digest, "uploaded": result.uploaded,
                               "parents": result.parents, "lazy_form": lazy is not None,
                               "profile": lazy.profile if lazy is not None else "",
                               "prefetch_chunks": sum(c for _, c in lazy.prefetch) if lazy is not None else 0,
                               "prefetch_bytes": lazy.prefetch_bytes if lazy is not None else 0}))  # fmt: skip
    else:
        click.echo(result.manifest_digest)


@image_group.command("pull")
@click.argument("ref", metavar="[http[s]://]HOST[:PORT]/REPO[:TAG|@sha256:HEX]")
@click.option("--name", "name_tag", default=None, metavar="NAME[:TAG]",
              help="Store it under this name [default: the name:tag it was pushed from].")  # fmt: skip
@_registry_options
@click.option("--json", "as_json", is_flag=True, help="Print the layer as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@click.pass_context
def pull_cmd(ctx: click.Context, ref: str, name_tag: str | None, username: str | None, password_stdin: bool,
             as_json: bool, quiet: bool) -> None:  # fmt: skip
    """Fetch a DSec layer from a registry into the local store (its parents first).

    Every chunk is checked against the layer's chunk table as it arrives, and
    the whole file against its digest; a mismatch keeps nothing. Prints the digest.
    """
    from dsec.images.transfer import pull_layer

    src = _registry_ref(ref, "REF")
    if src.tag is None and src.digest is None:
        src = type(src)(src.base_url, src.repo, "latest", None)
    name, tag = _name_tag(name_tag)
    with _errors():
        store = _store(ctx)
        with _client(src.base_url, username, password_stdin) as client, \
                _progress_display(enabled=not quiet) as progress:  # fmt: skip
            layer = pull_layer(store, client, src, name=name, tag=tag, progress=progress)
    if not quiet:
        click.echo(f"pulled {src} as {layer.ref} ({layer.kind.value}, {_human(layer.size)})", err=True)
    click.echo(layer.model_dump_json() if as_json else layer.digest)


@image_group.command("import")
@click.argument("ref", metavar="[http[s]://]HOST[:PORT]/REPO[:TAG|@sha256:HEX]")
@click.option("--name", "name_tag", default=None, metavar="NAME[:TAG]",
              help="Layer name [default: the repository's last component and the image's tag].")  # fmt: skip
@click.option("--kind", type=click.Choice(_KINDS), default="base", show_default=True)
@_registry_options
@click.option("--json", "as_json", is_flag=True, help="Print the layer as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
@click.pass_context
def import_cmd(ctx: click.Context, ref: str, name_tag: str | None, kind: str, username: str | None,
               password_stdin: bool, as_json: bool, quiet: bool) -> None:  # fmt: skip
    """Turn a container image in a registry into a DSec layer (no Docker engine).

    A multi-platform image resolves to linux/<this machine's architecture>; its
    layers (tar, gzip or zstd) stream from the registry and are applied in order
    with whiteouts into one tree, which becomes one EROFS layer. Prints the digest.
    """
    from dsec.images.oci_import import import_image

    src = _registry_ref(ref, "REF")
    if src.tag is None and src.digest is None:
        src = type(src)(src.base_url, src.repo, "latest", None)
    name, tag = _name_tag(name_tag)
    stages = _Stages()
    with _errors():
        store = _store(ctx)
        with _client(src.base_url, username, password_stdin) as client, \
                _progress_display(enabled=not quiet, stages=stages) as progress:  # fmt: skip
            layer = import_image(store, client, src, name=name, tag=tag, kind=kind, progress=progress)
    if not quiet:
        click.echo(f"imported {src} as {layer.ref} ({layer.kind.value}, {_human(layer.size)}) "
                   f"{stages.summary()}", err=True)  # fmt: skip
    click.echo(layer.model_dump_json() if as_json else layer.digest)


__all__ = ["default_store_root", "image_group"]
