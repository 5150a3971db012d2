"""``dsec bench images``: layers from a registry on another "host", loaded lazily vs pulled.

The registry (Debian's docker-registry) runs in its own network namespace behind a
veth shaped with ``tc tbf`` (1 Gbit/s each way); this kernel has no ``netem``, so the
1 ms one-way delay is a userspace delay line on the host side
(:mod:`dsec.bench.netshape`). Two images, built once with debootstrap and cached:
Debian bookworm minbase + python3, and (full mode) the same + build-essential, clang,
llvm-dev and golang (~1 GB of files). Each is pushed with its lazy form. Every phase
starts a container runtime with an empty layer store and an empty chunk cache whose
store looks names up in the registry (:class:`dsec.images.remote.RegistryLayers`),
exactly as an edge with ``registry:`` configured does.

Keys (``_python`` / ``_big`` name the image where both are measured):

- ``lazy_bytes_read_frac_python``: bytes the loader fetched ÷ the layer's size (its
  lz4hc EROFS file, what ``dsec image pull`` downloads) for create + ``python3 -c
  pass``; ``lazy_bytes_python``, ``python_layer_bytes``, ``python_lazy_form_bytes``
  (metadata image + data device, uncompressed) beside it.
- ``lazy_first_exec_ms`` vs ``full_pull_first_exec_ms`` (and ``_ratio``): create +
  first exec (``cc --version && python3 -c pass``) from the uncached big image
  (python in ``--quick``: ``first_exec_image`` says which), lazily vs after a full
  ``pull_layer`` through the same link. Each image is pushed with a prefetch profile of
  the start-up its sandboxes run (``PROFILE``, as ``dsec image push --profile`` does);
  ``lazy_first_exec_noprofile_ms`` (and its ratio) is the same image pushed without one
  (tag ``noprof``), in its own phase. ``<image>_prefetch_bytes``, ``<image>_profile_s``:
  the profile's size and the time the push took to record it.
- ``burst32_registry_bytes_ratio``: 32 sandboxes created at once from the uncached
  python image, each running ``python3 -c pass``: bytes over the link ÷ the bytes
  one sandbox needed (the first phase, same link counter).
- ``warm_exec_ratio``: ``python3 -c pass`` p50 in a sandbox on the lazily loaded,
  fully cached layer ÷ in one on the same layer as a local file, alternating.
- ``chunk_fetch_p50_ms``, ``fuse_read_mib_s`` (a cold read of the image's largest
  file in a sandbox), ``corrupt_chunk_refused`` (1: one chunk of the data device is
  damaged in the registry's storage; reads of it fail with EIO and are counted, no
  bad byte reaches the sandbox).

Series (``run(series=...)``, the HTML report's charts: :func:`figures`): the link's
received bytes over time, sampled every 50 ms from the veth's counter (nothing asked of
the loader), for the first exec from the uncached python image, and from the first-exec
image lazily with and without its prefetch profile (then the cold read) and by full pull;
the chunk fetch latency histogram of the lazy first-exec phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dsec.bench.report import Figure, Series, SeriesData

Say = Callable[[str], None]
PY_PACKAGES = ("python3",)
BIG_PACKAGES = ("python3", "build-essential", "clang", "llvm-dev", "golang-go")
RATE = "1gbit"
DELAY_MS = 1.0
FIRST_EXEC_BIG = "cc --version > /dev/null && python3 -c pass"
FIRST_EXEC_PY = "python3 -c pass"
PROFILE = {"python": FIRST_EXEC_PY, "big": FIRST_EXEC_BIG}
"""The start-up each image is pushed with (``dsec image push --profile``): what its sandboxes run first."""


def _quiet(_m: str) -> None:
    return None


class _Phase:
    """A container runtime whose empty store loads registry layers lazily (or pulls them)."""

    def __init__(self, work: Path, run: Path, tag: str, registry_url: str, *, lazy: bool = True) -> None:
        from dsec.images.lazy import LazyLayers
        from dsec.images.remote import RegistryLayers
        from dsec.images.store import LocalLayerStore

        self.tag = tag
        self.state = work / f"state-{tag}"
        self.store = LocalLayerStore(self.state / "layers")
        self.lazy = LazyLayers(run / f"lazy-{tag}", self.state / "chunks", read_deadline_s=60.0) if lazy else None
        self.layers = RegistryLayers(self.store, registry_url, lazy=self.lazy, timeout_s=120.0)
        self.run = run
        self.rt: Any = None

    async def __aenter__(self) -> _Phase:
        from dsec.backends.container.runtime import ContainerRuntime

        await asyncio.to_thread(self.layers.start)
        self.rt = ContainerRuntime(name=f"bimg-{self.tag}", state_dir=self.state, run_dir=self.run,
                                   layer_store=self.store)  # fmt: skip
        await self.rt.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.rt is not None:
                await self.rt.close(destroy_all=True)
        finally:
            await asyncio.to_thread(self.layers.close, stop_loader=True)

    def fetched(self) -> int:
        return int(self.layers.stats().get("loader", {}).get("bytes_fetched", 0)) if self.lazy else 0

    async def sandbox(self, ref: str) -> str:
        from dsec.spec import ImageRef, Resources, SandboxSpec

        spec = SandboxSpec(image=ImageRef(base=ref), resources=Resources(
            cpu=1.0, memory=1 << 30, disk=512 << 20, disk_medium="memory", pids=512))  # fmt: skip
        sb = await self.rt.create(spec)
        return str(sb.id)

    async def sh(self, sid: str, cmd: str, *, check: bool = True) -> Any:
        res = await self.rt.exec(sid, ["/bin/sh", "-c", cmd], timeout=600)
        if check and res.exit_code != 0:
            raise RuntimeError(f"{cmd!r} exited {res.exit_code}: {res.stderr[-500:]!r}")
        return res


@contextlib.asynccontextmanager
async def _link_bytes(host: Any, series: SeriesData | None, name: str,
                      period_s: float = 0.05) -> AsyncIterator[list[list[float]]]:
    """Samples ``[seconds, bytes received over the link]`` from entry every ``period_s`` into
    ``series["link_bytes"][name]`` (the veth's counter: the loader is not asked)."""
    samples: list[list[float]] = []
    rx0 = host.rx_bytes()
    t0 = time.perf_counter()

    async def loop() -> None:
        while True:
            with contextlib.suppress(OSError, ValueError):
                samples.append([round(time.perf_counter() - t0, 3), host.rx_bytes() - rx0])
            await asyncio.sleep(period_s)

    task = asyncio.create_task(loop())
    try:
        yield samples
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(OSError, ValueError):
            samples.append([round(time.perf_counter() - t0, 3), host.rx_bytes() - rx0])
        if series is not None:
            series.setdefault("link_bytes", {})[name] = samples


def _image(store: Any, cache: Path, name: str, packages: tuple[str, ...], say: Say) -> Any:
    from dsec.bench.fncall import python_layer

    ref = python_layer(store, cache, name=name, tag="bench", packages=packages, say=say)
    return store.resolve(ref)


@contextlib.contextmanager
def _registry(work: Path, say: Say) -> Iterator[tuple[Any, Any, Any]]:
    from dsec.bench.netshape import DelayLine, shaped_host
    from dsec.images.registry_server import RegistryServer

    tag = f"bi{os.getpid() % 100000}"
    with shaped_host(tag, rate=RATE, subnet=os.getpid() % 200 + 20) as host:
        reg = RegistryServer(work / "registry", host=host.remote_ip, port=5000, netns=host.netns).start()
        try:
            with DelayLine((host.remote_ip, 5000), DELAY_MS) as line:
                say(f"registry in netns {host.netns} at {reg.url}, reached through a {DELAY_MS:g} ms delay line at "
                    f"{line.url}, link {RATE} each way (tbf; this kernel has no netem)")
                yield host, reg, line
        finally:
            reg.stop()


def run(*, quick: bool = False, state_dir: Path | None = None, say: Say = print,
        series: SeriesData | None = None) -> dict[str, Any]:
    """The suite; ``series``, when given, receives its per-sample data (module docstring)."""
    return asyncio.run(_run(quick=quick, state_dir=state_dir, say=say, series=series))


async def _run(*, quick: bool, state_dir: Path | None, say: Say, series: SeriesData | None = None) -> dict[str, Any]:
    from dsec.images.registry import RegistryClient, RegistryRef
    from dsec.images.store import LocalLayerStore
    from dsec.images.transfer import push_layer, read_dsec_layer

    base = Path(state_dir or os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"))
    cache = base / "cache"
    out: dict[str, Any] = {"quick": quick, "link_rate": RATE, "link_delay_ms": DELAY_MS}
    run_dir = Path(tempfile.mkdtemp(prefix="bimg-", dir=_run_root()))
    with tempfile.TemporaryDirectory(prefix="dsec-bench-images-", dir=base / "bench" if (base / "bench").is_dir()
                                     else None) as tmp, _registry(Path(tmp), say) as (host, reg, line):
        work = Path(tmp)
        src = LocalLayerStore(work / "src")
        py = await asyncio.to_thread(_image, src, cache, "bimg-py", PY_PACKAGES, say)
        big = None if quick else await asyncio.to_thread(_image, src, cache, "bimg-big", BIG_PACKAGES, say)
        with RegistryClient(reg.url) as client:
            for layer in (py, big):
                if layer is None:
                    continue
                key = "python" if layer is py else "big"
                t0 = time.perf_counter()
                # without a profile first (tag noprof: the comparison), then with one (tag bench, what
                # `dsec image push --profile` makes; the blobs are there already)
                await asyncio.to_thread(push_layer, src, layer.digest, client,
                                        RegistryRef(reg.url, layer.name, tag="noprof"))  # fmt: skip
                push_s = time.perf_counter() - t0
                done = await asyncio.to_thread(push_layer, src, layer.digest, client,
                                               RegistryRef(reg.url, layer.name, tag="bench"),
                                               profile=PROFILE[key])  # fmt: skip
                _, cfg = await asyncio.to_thread(read_dsec_layer, client, layer.name, "bench")
                assert cfg.lazy is not None, "the push made no lazy form (run as root)"
                assert done.profile is not None and done.profile.returncode == 0, f"profile failed: {done.profile}"
                out[f"{key}_profile_s"] = done.profile.seconds
                out[f"{key}_prefetch_bytes"] = cfg.lazy.prefetch_bytes
                say(f"prefetch profile of {PROFILE[key]!r}: {len(done.profile.chunks)} data chunks, "
                    f"{cfg.lazy.prefetch_bytes / 2**20:.2f} MiB, recorded in {done.profile.seconds:.1f} s")
                out[f"{key}_layer_bytes"] = layer.size
                out[f"{key}_lazy_form_bytes"] = cfg.lazy.meta.blob_size + cfg.lazy.data.blob_size
                out[f"{key}_lazy_form_plain_bytes"] = cfg.lazy.meta.size + cfg.lazy.data.size
                out[f"{key}_meta_bytes"] = cfg.lazy.meta.blob_size
                say(f"pushed {layer.ref}: {layer.size / 2**20:.1f} MiB layer, lazy form {cfg.lazy.meta.blob_size / 2**20:.2f}"
                    f" MiB metadata + {cfg.lazy.data.blob_size / 2**20:.1f} MiB data ({cfg.lazy.data.size / 2**20:.1f} MiB "
                    f"before zstd), in {push_s:.1f} s")

        ref_py = f"{py.name}:bench"
        # 1. bytes for python3 -c pass, and its first exec
        async with _Phase(work, run_dir, "one", line.url) as ph:
            rx0 = host.rx_bytes()
            t0 = time.perf_counter()
            async with _link_bytes(host, series, "python: lazy first exec"):
                sid = await ph.sandbox(ref_py)
                await ph.sh(sid, FIRST_EXEC_PY)
            out["lazy_first_exec_ms_python"] = round((time.perf_counter() - t0) * 1000, 1)
            one_link = host.rx_bytes() - rx0
            out["lazy_bytes_python"] = ph.fetched()
            out["lazy_bytes_read_frac_python"] = round(ph.fetched() / py.size, 4)
            out["lazy_bytes_read_frac_python_of_lazy_form"] = round(ph.fetched() / out["python_lazy_form_bytes"], 4)
            out["link_bytes_one_python"] = one_link
            say(f"python3 -c pass from an uncached layer: {ph.fetched() / 2**20:.2f} MiB fetched of a "
                f"{py.size / 2**20:.1f} MiB layer ({out['lazy_bytes_read_frac_python']:.3f}); "
                f"{out['lazy_first_exec_ms_python']:.0f} ms create + first exec")

            # 2. warm exec: the same layer fully cached vs as a local file (another runtime), alternating
            await ph.sh(sid, "find / -xdev -type f -exec cat {} + > /dev/null 2>&1; true")
            async with _Phase(work, run_dir, "local", line.url, lazy=False) as loc:
                shutil.copyfile(src.blob_path(py.digest), work / "local.erofs")
                await asyncio.to_thread(loc.store.add_erofs, work / "local.erofs", name=py.name, tag="bench",
                                        kind="base", consume=True)  # fmt: skip
                lsid = await loc.sandbox(ref_py)
                await _warm(ph, sid, loc, lsid, out, 15 if quick else 40, say)

        # 3. burst of 32 from the uncached image: each chunk fetched once
        async with _Phase(work, run_dir, "burst", line.url) as ph:
            rx0 = host.rx_bytes()
            t0 = time.perf_counter()

            async def one() -> None:
                s = await ph.sandbox(ref_py)
                await ph.sh(s, FIRST_EXEC_PY)

            await asyncio.gather(*(one() for _ in range(32)))
            burst = host.rx_bytes() - rx0
            out["burst32_wall_s"] = round(time.perf_counter() - t0, 2)
            out["burst32_link_bytes"] = burst
            out["burst32_registry_bytes_ratio"] = round(burst / one_link, 3)
            say(f"32 at once: {burst / 2**20:.2f} MiB over the link vs {one_link / 2**20:.2f} MiB for one "
                f"({out['burst32_registry_bytes_ratio']}), {out['burst32_wall_s']} s")

        # 4. first exec from the uncached big image: lazily, then after a full pull
        first_ref, first_cmd, first_layer = (ref_py, FIRST_EXEC_PY, py) if big is None else \
            (f"{big.name}:bench", FIRST_EXEC_BIG, big)  # fmt: skip
        out["first_exec_image"] = "python" if big is None else "big"
        out["first_exec_image_bytes"] = first_layer.size
        first_name = out["first_exec_image"]
        async with _Phase(work, run_dir, "lazy1st", line.url) as ph:
            async with _link_bytes(host, series, f"{first_name}: lazy, with profile, then a cold read"):
                t0 = time.perf_counter()
                sid = await ph.sandbox(first_ref)
                await ph.sh(sid, first_cmd)
                out["lazy_first_exec_ms"] = round((time.perf_counter() - t0) * 1000, 1)
                out["lazy_first_exec_bytes"] = ph.fetched()
                # a cold read of the largest file
                res = await ph.sh(sid, "find / -xdev -type f -size +4M -printf '%s %p\\n' | sort -n | tail -1")
                size_s, _, path = res.stdout.decode().strip().partition(" ")
                t = time.perf_counter()
                await ph.sh(sid, f"cat '{path}' > /dev/null")
                dt = time.perf_counter() - t
            out["fuse_read_mib_s"] = round(int(size_s) / 2**20 / dt, 1)
            out["fuse_read_file_mib"] = round(int(size_s) / 2**20, 1)
            lat = ph.lazy.stats()["fetch_latency_ms"] if ph.lazy is not None else {}
            out["chunk_fetch_p50_ms"] = lat.get("p50")
            out["chunk_fetch_p99_ms"] = lat.get("p99")
            if series is not None and lat.get("buckets_le_ms"):
                series["chunk_fetch_buckets_le_ms"] = lat["buckets_le_ms"]
        async with _Phase(work, run_dir, "noprof1st", line.url) as ph:
            t0 = time.perf_counter()
            async with _link_bytes(host, series, f"{first_name}: lazy, no profile"):
                sid = await ph.sandbox(first_ref.replace(":bench", ":noprof"))
                await ph.sh(sid, first_cmd)
            out["lazy_first_exec_noprofile_ms"] = round((time.perf_counter() - t0) * 1000, 1)
            out["lazy_first_exec_noprofile_bytes"] = ph.fetched()
        async with _Phase(work, run_dir, "pull1st", line.url, lazy=False) as ph:
            t0 = time.perf_counter()
            async with _link_bytes(host, series, f"{first_name}: full pull"):
                sid = await ph.sandbox(first_ref)  # lookup pulls the whole layer first
                await ph.sh(sid, first_cmd)
            out["full_pull_first_exec_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        out["lazy_vs_full_pull_first_exec_ratio"] = round(out["lazy_first_exec_ms"] / out["full_pull_first_exec_ms"], 3)
        out["lazy_noprofile_vs_full_pull_first_exec_ratio"] = round(
            out["lazy_first_exec_noprofile_ms"] / out["full_pull_first_exec_ms"], 3)
        say(f"first exec from the uncached {out['first_exec_image']} image ({first_layer.size / 2**20:.0f} MiB): lazy "
            f"{out['lazy_first_exec_ms']:.0f} ms with its prefetch profile, "
            f"{out['lazy_first_exec_noprofile_ms']:.0f} ms without, vs full pull {out['full_pull_first_exec_ms']:.0f} ms")

        # 5. a damaged chunk in the registry is refused
        out["corrupt_chunk_refused"] = await _corrupt(work, run_dir, reg, line.url, py, ref_py, say)
    with contextlib.suppress(OSError):
        shutil.rmtree(run_dir)
    return out


async def _warm(ph: _Phase, sid: str, loc: _Phase, lsid: str, out: dict[str, Any], n: int, say: Say) -> None:
    lazy_ms: list[float] = []
    local_ms: list[float] = []
    for _ in range(3):
        await ph.sh(sid, FIRST_EXEC_PY)
        await loc.sh(lsid, FIRST_EXEC_PY)
    for _ in range(n):
        for p, s, acc in ((ph, sid, lazy_ms), (loc, lsid, local_ms)):
            t = time.perf_counter()
            await p.sh(s, FIRST_EXEC_PY)
            acc.append((time.perf_counter() - t) * 1000)
    out["warm_exec_p50_ms_lazy"] = round(statistics.median(lazy_ms), 2)
    out["warm_exec_p50_ms_local"] = round(statistics.median(local_ms), 2)
    out["warm_exec_ratio"] = round(out["warm_exec_p50_ms_lazy"] / out["warm_exec_p50_ms_local"], 3)
    say(f"warm python3 -c pass: lazy {out['warm_exec_p50_ms_lazy']} ms vs local {out['warm_exec_p50_ms_local']} ms "
        f"({out['warm_exec_ratio']})")


async def _corrupt(work: Path, run_dir: Path, reg: Any, url: str, py: Any, ref: str, say: Say) -> int:
    from dsec.images.registry import RegistryClient
    from dsec.images.transfer import read_dsec_layer

    with RegistryClient(reg.url) as client:
        _, cfg = read_dsec_layer(client, py.name, "bench")
    assert cfg.lazy is not None
    blob = reg.blob_file(cfg.lazy.data.digest)
    keep = blob.read_bytes()
    n = len(cfg.lazy.data.chunks)
    try:
        async with _Phase(work, run_dir, "corrupt", url) as ph:
            sid = await ph.sandbox(ref)
            # the tools of the check first (their chunks cached), then the damage
            await ph.sh(sid, "find /usr/share/doc -maxdepth 0 > /dev/null && cat /dev/null && true")
            data = bytearray(keep)
            victims = range(n // 3, n, 7)  # a spread of chunks nobody has read yet
            for i in victims:
                data[cfg.lazy.data.offsets[i] + 4 if cfg.lazy.data.encoding else i * cfg.lazy.data.chunk_size] ^= 0xFF
            blob.write_bytes(bytes(data))
            try:
                res = await ph.sh(sid, "find /usr -xdev -type f -exec cat {} + > /dev/null", check=False)
            except Exception as exc:  # the check's own tools hit a damaged chunk: refused all the same
                say(f"the check could not run: {exc}")
                res = None
            bad = int(ph.layers.stats()["loader"]["corrupt_chunks"])
            eio = res is not None and b"Input/output error" in res.stderr and res.exit_code != 0
            say(f"damaged {len(victims)} data chunks in the registry: {bad} refused, reads failed with EIO: {eio}")
            return int(bad >= 1 and eio)
    finally:
        blob.write_bytes(keep)


def _run_root() -> str:
    root = Path("/run/dsec")
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


__all__ = ["run"]


def figures(results: Mapping[str, Any], series: SeriesData) -> list[Figure]:
    """The report's charts (:mod:`dsec.bench.report`): bytes over the link against time for
    each first exec, the chunk fetch latency histogram, bytes read lazily vs the layer."""
    figs: list[Figure] = []
    link: Mapping[str, list[list[float]]] = series.get("link_bytes", {})
    if link:
        figs.append(Figure(
            title="Bytes over the link against time, from an uncached image", kind="line",
            xlabel="seconds since the create", ylabel="MiB received over the link",
            series=tuple(Series(name, [p[0] for p in pts], [p[1] / (1 << 20) for p in pts])
                         for name, pts in link.items() if pts),
            caption=f"Link {results.get('link_rate', '?')}, {results.get('link_delay_ms', '?')} ms one way; the veth's "
                    f"received bytes every 50 ms. First-exec image: {results.get('first_exec_image', '?')} "
                    f"({results.get('first_exec_image_bytes', 0) / (1 << 20):,.0f} MiB layer); the lazy phase then "
                    f"reads its largest file cold ({results.get('fuse_read_file_mib', '?')} MiB at "
                    f"{results.get('fuse_read_mib_s', '?')} MiB/s).", name="images-link-bytes"))
    buckets: Mapping[str, int] = series.get("chunk_fetch_buckets_le_ms", {})
    if buckets:
        cats = tuple(f"≤{k}" if k != "+Inf" else f">{list(buckets)[-2]}" for k in buckets)
        figs.append(Figure(
            title="Chunk fetch latency (lazy first exec and cold read)", kind="bar", categories=cats,
            xlabel="ms", ylabel="chunk fetches", series=(Series("fetches", y=tuple(buckets.values())),),
            caption=f"p50 {results.get('chunk_fetch_p50_ms')} ms, p99 {results.get('chunk_fetch_p99_ms')} ms.",
            name="images-chunk-fetch"))
    pairs = [(lbl, results.get(a), results.get(b)) for lbl, a, b in (
        ("first exec, with profile", "lazy_first_exec_ms", "full_pull_first_exec_ms"),
        ("first exec, no profile", "lazy_first_exec_noprofile_ms", "full_pull_first_exec_ms"))]
    if all(isinstance(a, (int, float)) and isinstance(b, (int, float)) for _, a, b in pairs):
        figs.append(Figure(
            title="First exec from an uncached image: lazy vs full pull", kind="bar",
            categories=tuple(lbl for lbl, _, _ in pairs), ylabel="ms",
            series=(Series("lazy", y=tuple(float(a or 0) for _, a, _ in pairs)),
                    Series("full pull", y=tuple(float(b or 0) for _, _, b in pairs))),
            name="images-first-exec"))
    return figs
