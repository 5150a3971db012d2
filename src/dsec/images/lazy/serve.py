"""The node's lazy layer process: ``python -m dsec.images.lazy.serve --root MP --cache DIR ...``.

One per node, never per sandbox. Mounts the FUSE filesystem (:mod:`.fs`) at
``--root``, serves the control socket (:mod:`.control`), and keeps the attached
layers in a root-only state file so that a restarted process attaches them again
(their chunks are in the cache, so that works with the registry down). Writes
``ready <pid>`` on stdout once it serves requests.

SIGTERM/SIGINT: stop serving and unmount (a lazy unmount when an EROFS mount
still holds a layer file, whose reads then fail: the runtime unmounts those
first). A SIGKILLed process leaves a dead mount that
:func:`dsec.images.lazy.manager.reconcile` removes.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from dsec.errors import InvalidSpec

from .cache import ChunkCache
from .control_server import serve_control
from .engine import Engine, EngineConfig, ReadFailed
from .errors import ChunkCorrupt, LayerUnavailable, LazyError
from .fetch import HttpxRangeFetcher
from .fs import LazyFS
from .model import FSNAME, RemoteLayer

log = logging.getLogger("dsec.images.lazy")

STATE_VERSION = 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dsec.images.lazy.serve", description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, type=Path, help="mountpoint of the FUSE filesystem")
    p.add_argument("--cache", required=True, type=Path, help="chunk cache directory")
    p.add_argument("--socket", required=True, type=Path, help="control socket path")
    p.add_argument("--state", type=Path, help="state file (default: CACHE/lazy-state.json)")
    p.add_argument("--cache-limit", type=int, default=0, help="cache byte limit (0: none)")
    p.add_argument("--read-deadline", type=float, default=30.0)
    p.add_argument("--fetch-attempts", type=int, default=4)
    p.add_argument("--attempt-timeout", type=float, default=10.0)
    p.add_argument("--backoff", type=float, default=0.1)
    p.add_argument("--max-fetches", type=int, default=16, help="concurrent Range requests (pool size)")
    p.add_argument("--readahead", type=int, default=4, help="chunks fetched ahead of a streaming reader")
    p.add_argument("--max-tasks", type=int, default=64, help="FUSE requests served at once")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


class Service:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state_path: Path = args.state or args.cache / "lazy-state.json"
        self.cache = ChunkCache(args.cache, limit_bytes=args.cache_limit or None)
        self.fetcher = HttpxRangeFetcher(max_connections=args.max_fetches)
        self.engine = Engine(
            self.cache,
            self.fetcher,
            EngineConfig(
                read_deadline_s=args.read_deadline,
                fetch_attempts=args.fetch_attempts,
                attempt_timeout_s=args.attempt_timeout,
                backoff_s=args.backoff,
                max_concurrent_fetches=args.max_fetches,
                readahead_chunks=args.readahead,
            ),
            on_change=self.save_state,
        )
        self.fs = LazyFS(self.engine)

    # ------------------------------------------------------------------ state --

    def save_state(self) -> None:
        data = {"version": STATE_VERSION,
                "layers": [al.layer.model_dump(mode="json") for al in self.engine.layers.values()],
                "extents_of": {hx: al.extents_of for hx, al in self.engine.layers.items() if al.extents_of}}
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.rename(tmp, self.state_path)

    def load_state(self) -> list[RemoteLayer]:
        try:
            data = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("state file %s unreadable (%s); starting with no layers", self.state_path, exc)
            return []
        out = []
        for raw in data.get("layers", []):
            try:
                out.append(RemoteLayer.model_validate(raw))
            except ValueError as exc:
                log.warning("state file: dropping a layer entry: %s", exc)
        return out

    async def restore(self) -> None:
        try:
            extents_of = dict(json.loads(self.state_path.read_text()).get("extents_of") or {})
        except (OSError, ValueError):
            extents_of = {}
        # metadata images first: a data device works out its file extents from its own
        for layer in sorted(self.load_state(), key=lambda la: la.hex in extents_of):
            if layer.hex in extents_of:
                await self.engine.attach(layer, prefetch_metadata=False, extents_of=extents_of[layer.hex])
                continue
            try:
                await self.engine.attach(layer, prefetch_metadata=True)
            except LazyError as exc:
                # Keep it attached: its cached chunks still serve; the rest fail with EIO.
                log.warning("re-attach of %s without metadata prefetch: %s", layer.digest, exc)
                await self.engine.attach(layer, prefetch_metadata=False)
        log.info("restored %d layer(s) from %s", len(self.engine.layers), self.state_path)

    # --------------------------------------------------------------- control --

    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "layers": len(self.engine.layers),
                    "root": str(self.args.root)}
        if op == "attach":
            layer = RemoteLayer.model_validate(req["layer"])
            al = await self.engine.attach(layer, prefetch_metadata=bool(req.get("prefetch_metadata", True)),
                                          prefetch_all=bool(req.get("prefetch_all", False)),
                                          extents_of=str(req.get("extents_of") or ""))
            return {"ok": True, "path": str(self.args.root / layer.filename),
                    "layer": self.engine.stats()["layers"][al.layer.hex]}
        if op == "detach":
            hx = _hex(req["digest"])
            detached = self.engine.detach(hx)
            if detached:
                await self._forget_name(f"{hx}.erofs")
            return {"ok": True, "detached": detached}
        if op == "stats":
            return {"ok": True, "stats": {"pid": os.getpid(), **self.engine.stats()}}
        if op == "materialize":
            return {"ok": True, **await self.materialize(_hex(req["digest"]), Path(req["dest"]))}
        raise InvalidSpec(f"unknown control op {op!r}", field="op")

    async def _forget_name(self, name: str) -> None:
        """Make the kernel forget a name now (it would remember it for ENTRY_TIMEOUT_S).
        In a worker thread: the kernel may wait on a lookup this loop is serving."""

        def invalidate() -> None:
            try:
                pyfuse3.invalidate_entry(pyfuse3.ROOT_INODE, os.fsencode(name), 0)
            except OSError as exc:
                if exc.errno != errno.ENOENT:  # ENOENT: the kernel did not know the name
                    log.warning("cannot invalidate %s: %s", name, exc)

        with trio.move_on_after(5):
            await trio.to_thread.run_sync(invalidate, abandon_on_cancel=True)

    async def materialize(self, hx: str, dest: Path) -> dict[str, Any]:
        """Write the whole layer to ``dest`` (fetching what is not cached), checked against
        the layer's digest: the runtime can then mount the local file instead."""
        al = self.engine.layers.get(hx)
        if al is None:
            raise LazyError(f"layer sha256:{hx} is not attached", digest=f"sha256:{hx}")
        layer = al.layer
        before = al.counters.chunks_fetched
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as f:
                for i in range(len(layer.chunks)):
                    start, end = layer.chunk_range(i)
                    try:
                        with trio.fail_after(self.engine.config.read_deadline_s):
                            data = await self.engine._read_range(al, start, end - start)
                    except trio.TooSlowError:
                        raise LayerUnavailable(f"chunk {i} of {layer.digest} not fetched in time",
                                               digest=layer.digest, registry=layer.registry,
                                               status=0) from None
                    except ReadFailed as exc:
                        if isinstance(exc.__cause__, LazyError):
                            raise exc.__cause__ from None
                        raise
                    h.update(data)
                    f.write(data)
            await self.engine.wait_stored(al)
            if h.hexdigest() != hx:
                raise ChunkCorrupt(f"assembled layer does not hash to {layer.digest}", digest=layer.digest)
            os.rename(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return {"path": str(dest), "fetched_chunks": al.counters.chunks_fetched - before}


def _hex(digest: object) -> str:
    s = str(digest).removeprefix("sha256:")
    if len(s) != 64 or any(c not in "0123456789abcdef" for c in s):
        raise InvalidSpec(f"not a sha256 digest: {digest!r}", field="digest")
    return s


async def _amain(svc: Service) -> None:
    async with trio.open_nursery() as nursery:
        svc.engine.bind(nursery)
        nursery.start_soon(pyfuse3.main, 1, svc.args.max_tasks)
        await svc.restore()
        await nursery.start(serve_control, svc.args.socket, svc.handle)
        print(f"ready {os.getpid()}", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal %d: unmounting %s", signum, svc.args.root)
                break
        pyfuse3.terminate()
        nursery.cancel_scope.cancel()
    await svc.fetcher.aclose()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s dsec-lazy[%(process)d] %(message)s",
        stream=sys.stderr,
    )
    args.root.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(args.root):
        print(f"{args.root} is already a mount point (a dead one? run reconcile first)", file=sys.stderr)
        return 2
    svc = Service(args)
    removed = svc.cache.open()
    if removed:
        log.info("removed %d partial chunk file(s) from %s", removed, args.cache)
    opts = set(pyfuse3.default_options)
    opts |= {f"fsname={FSNAME}", f"subtype={FSNAME}", "allow_other", "ro"}
    pyfuse3.init(svc.fs, os.fspath(args.root), opts)
    try:
        trio.run(_amain, svc)
    finally:
        pyfuse3.close(unmount=True)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
