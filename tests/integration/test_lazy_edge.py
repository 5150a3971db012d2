"""An edge whose store is empty runs sandboxes from layers in a registry, loaded lazily.

Real pieces: Debian's ``docker-registry`` on loopback, the node's FUSE process
(``dsec.images.lazy``), EROFS mounted from its files, a real edge over HTTP. The
layers are built here, pushed with ``push_layer`` to repositories named after
them, and the edge's store starts with nothing: every name is looked up in the
registry on first use, every byte comes through the lazy loader.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import RT_PREFIX, running_edge, wait_until
from dsec.edge.config import EdgeConfig, RegistryConfig
from dsec.edge.testing import EdgeThread
from dsec.errors import HostError
from dsec.images import LocalLayerStore, build_busybox, build_from_dir, sysmount
from dsec.images.registry import RegistryClient, RegistryRef
from dsec.images.registry_server import RegistryServer
from dsec.images.transfer import push_layer

pytestmark = pytest.mark.root

KEY = secrets.token_bytes(32)
MiB = 1 << 20


def b64(text: str) -> bytes:
    return base64.b64decode(text)


@pytest.fixture(scope="module")
def registry(dsec_base: Path) -> Iterator[RegistryServer]:
    try:
        r = RegistryServer(dsec_base / f"registry-lazy-edge-{time.monotonic_ns()}").start()
    except HostError as exc:
        pytest.skip(str(exc))
    yield r
    r.stop()


@pytest.fixture(scope="module")
def pushed(dsec_base: Path, registry: RegistryServer) -> dict[str, Any]:
    """busybox:test and a workspace layer lzws:v1 (a small tree and 6 MiB of random bytes),
    built in a store of their own and pushed as ``<registry>/<name>:<tag>``."""
    src = dsec_base / "lazy-edge-src"
    store = LocalLayerStore(src / "layers")
    tree = src / "tree"
    rnd = random.Random(7)
    (tree / "work" / "docs").mkdir(parents=True, exist_ok=True)
    for i in range(40):
        (tree / "work" / "docs" / f"n{i:02d}.txt").write_text(f"note {i}\n" * (i + 1))
    big = rnd.randbytes(6 * MiB + 4321)
    (tree / "work" / "big.bin").write_bytes(big)
    try:
        bb = build_busybox(store, name="busybox", tag="test")
        ws = build_from_dir(store, tree, name="lzws", tag="v1", kind="workspace")
    except HostError as exc:
        pytest.skip(f"cannot build the layers: {exc}")
    with RegistryClient(registry.url) as client:
        push_layer(store, bb.digest, client, RegistryRef(registry.url, "busybox", tag="test"))
        push_layer(store, ws.digest, client, RegistryRef(registry.url, "lzws", tag="v1"))
    store.close()
    return {"busybox": bb.digest, "ws": ws.digest, "big_sha": hashlib.sha256(big).hexdigest(),
            "ws_size": ws.size}


def lazy_config(dsec_base: Path, suffix: str, edge_id: str, registry_url: str, **kw: Any) -> EdgeConfig:
    name = f"{RT_PREFIX}-{suffix}"
    reg = RegistryConfig(url=registry_url, read_deadline_s=3.0, fetch_attempts=2, timeout_s=5.0)
    return EdgeConfig(edge_id=edge_id, cluster_key=KEY, port=0, state_dir=dsec_base / f"state-{name}",
                      run_dir=dsec_base / "run", runtime_name=name, destroy_on_shutdown=True,
                      registry=reg, host_check_interval_s=0.3, **kw)


SPEC: dict[str, Any] = {"image": {"base": "busybox:test", "workspace": "lzws:v1"},
                        "resources": {"cpu": 0.5, "memory": 256 << 20, "disk": 64 << 20}}


def create(api: httpx.Client, spec: dict[str, Any] = SPEC) -> httpx.Response:
    return api.post("/v1/sandboxes", json={"spec": spec})


def sh(edge: EdgeThread, sid: str, cmd: str) -> dict[str, Any]:
    with edge.client() as c:
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": 60})
    assert r.status_code == 200, r.text
    return dict(r.json())


def lazy_mounts(edge: EdgeThread) -> list[sysmount.MountEntry]:
    reg = edge.service.backends.registry
    assert reg is not None and reg.lazy is not None
    mp = str(reg.lazy.mountpoint)
    return [m for m in sysmount.mountinfo() if m.mount_point == mp or m.source.startswith(mp + "/")]


def test_a_sandbox_runs_from_registry_layers_it_never_downloaded(
        dsec_base: Path, registry: RegistryServer, pushed: dict[str, Any]) -> None:
    cfg = lazy_config(dsec_base, "lzedge", "lz", registry.url)
    with running_edge(cfg) as edge, edge.client() as api:
        store = edge.service.backends.store
        assert store.list() == []  # nothing local: every byte comes from the registry
        assert api.get("/v1/health").json()["registry"] == registry.url  # placement may send it any image
        r = create(api)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        # the store now knows both layers as remote ones: index rows, no files
        layers = {layer.ref: layer for layer in store.list()}
        assert layers["busybox:test"].digest == pushed["busybox"]
        assert layers["lzws:v1"].digest == pushed["ws"]
        assert layers["lzws:v1"].source == f"{registry.url}/lzws"
        assert not store.blob_path(pushed["ws"]).exists()
        # EROFS is mounted from the FUSE process's files
        kinds = {m.fstype for m in lazy_mounts(edge)}
        assert "erofs" in kinds and any(k.startswith("fuse") for k in kinds), kinds
        reg = edge.service.backends.registry
        before = reg.stats()["loader"]["bytes_fetched"]
        assert before < pushed["ws_size"]  # metadata and busybox, not the 6 MiB file

        # the sandbox sees the layer's exact content
        res = sh(edge, sid, "ls /work/docs | wc -l; sha256sum /work/big.bin; cat /work/docs/n02.txt")
        out = b64(res["stdout_b64"]).decode()
        assert res["exit_code"] == 0, res
        assert out.split("\n")[0].strip() == "40"
        assert pushed["big_sha"] in out and "note 2\nnote 2\nnote 2\n" in out
        after = reg.stats()["loader"]["bytes_fetched"]
        # the big file's chunks came on first read (some held metadata and came at attach)
        assert after - before >= 3 * MiB and after >= 6 * MiB

        # metadata came whole at attach (the lazy form's metadata image): a walk of the tree
        # and a stat of every file fetch nothing
        res = sh(edge, sid, "ls -lR /work > /dev/null && find /work -type f -exec stat -c %s {} + | wc -l")
        assert res["exit_code"] == 0 and b64(res["stdout_b64"]).decode().strip() == "41", res
        assert reg.stats()["loader"]["bytes_fetched"] == after

        # a second sandbox reads the same file from the cache, fetching nothing
        r2 = create(api)
        assert r2.status_code == 201, r2.text
        res = sh(edge, r2.json()["id"], "sha256sum /work/big.bin")
        assert pushed["big_sha"] in b64(res["stdout_b64"]).decode()
        assert reg.stats()["loader"]["bytes_fetched"] == after

        # a name neither here nor in the registry: 404 naming both places
        bad = create(api, {**SPEC, "image": {"base": "busybox:test", "workspace": "nosuch:v9"}})
        assert bad.status_code == 404, bad.text
        err = bad.json()["error"]
        assert err["code"] == "layer_not_found" and "registry" in err["message"], err
        for s in (sid, r2.json()["id"]):
            assert api.delete(f"/v1/sandboxes/{s}").status_code in (200, 204)
    # the edge stopped: no FUSE mount, no EROFS mount from it, no loader process left
    mp = str(cfg.run_dir / f"lazy-{cfg.runtime}")
    assert not [m for m in sysmount.mountinfo() if m.mount_point == mp or m.source.startswith(mp + "/")]
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_loader(int(p), mp)]
    assert not Path(mp).exists()  # nor its mountpoint directory


def _is_loader(pid: int, mountpoint: str) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"dsec.images.lazy.serve" in cmd and mountpoint.encode() in cmd


def test_a_registry_that_goes_down_gives_eio_on_uncached_reads_and_a_typed_refusal(
        dsec_base: Path, pushed: dict[str, Any]) -> None:
    # a registry of its own, stopped mid-run
    try:
        reg = RegistryServer(dsec_base / f"registry-lazy-down-{time.monotonic_ns()}").start()
    except HostError as exc:
        pytest.skip(str(exc))
    src = LocalLayerStore(dsec_base / "lazy-edge-src" / "layers")
    try:
        with RegistryClient(reg.url) as client:
            push_layer(src, pushed["busybox"], client, RegistryRef(reg.url, "busybox", tag="test"))
            push_layer(src, pushed["ws"], client, RegistryRef(reg.url, "lzws", tag="v1"))
    finally:
        src.close()
    cfg = lazy_config(dsec_base, "lzdown", "ld", reg.url)
    try:
        with running_edge(cfg) as edge, edge.client() as api:
            r = create(api, {**SPEC, "image": {"base": "busybox:test", "workspace": "lzws:v1"}})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            sh(edge, sid, "ls /work/docs | wc -l; cat /work/docs/n01.txt > /dev/null; echo rc=$?")  # busybox cached
            reg.stop()
            # cached chunks still serve; an uncached read fails with EIO, bounded by the deadline
            t0 = time.monotonic()
            res = sh(edge, sid, "ls /work/docs | wc -l; cat /work/big.bin > /dev/null; echo rc=$?")
            out, err = b64(res["stdout_b64"]).decode(), b64(res["stderr_b64"]).decode()
            assert out.split()[0] == "40" and "rc=1" in out and "Input/output error" in err, (out, err)
            assert time.monotonic() - t0 < 30
            # a create needing a layer the edge has never seen: 503 layer_unavailable
            r = create(api, {**SPEC, "image": {"base": "other:1"}})
            assert r.status_code == 503, r.text
            err_body = r.json()["error"]
            assert err_body["code"] == "layer_unavailable" and reg.url in err_body["message"], err_body
            # the edge says so in its health and its metrics
            assert wait_until(lambda: any("registry" in p for p in api.get("/v1/health").json()["problems"]), 5)
            assert wait_until(lambda: "dsec_edge_registry_up 0.0" in api.get("/metrics").text, 5)
            assert [s["id"] for s in api.get("/v1/sandboxes").json()] == [sid]
            api.delete(f"/v1/sandboxes/{sid}")
    finally:
        reg.stop()


def test_a_killed_loader_is_restarted_and_new_sandboxes_work(
        dsec_base: Path, registry: RegistryServer, pushed: dict[str, Any]) -> None:
    cfg = lazy_config(dsec_base, "lzkill", "lk", registry.url)
    with running_edge(cfg) as edge, edge.client() as api:
        r = create(api)
        assert r.status_code == 201, r.text
        first = r.json()["id"]
        reg = edge.service.backends.registry
        old_pid = reg.lazy.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        # the self-check notices, restarts the loader and mounts the layers again
        assert wait_until(lambda: reg.lazy.pid not in (None, old_pid) and reg.restarts >= 1, 15)
        assert wait_until(lambda: any("restarted the lazy layer process" in x
                                      for x in api.get("/v1/health").json()["repairs"]), 5)
        # the sandbox that read from the dead files is destroyed cleanly; new ones work
        assert api.delete(f"/v1/sandboxes/{first}").status_code in (200, 204)
        assert wait_until(lambda: create(api).status_code == 201 or False, 20)
        sids = [s["id"] for s in api.get("/v1/sandboxes").json()]
        res = sh(edge, sids[0], "sha256sum /work/big.bin")
        assert pushed["big_sha"] in b64(res["stdout_b64"]).decode()
        for s in sids:
            api.delete(f"/v1/sandboxes/{s}")


def test_a_damaged_chunk_is_refused_with_eio_an_audit_line_and_a_metric(
        dsec_base: Path, registry: RegistryServer, pushed: dict[str, Any]) -> None:
    from dsec.images.transfer import read_dsec_layer

    with RegistryClient(registry.url) as client:
        _, cfg = read_dsec_layer(client, "lzws", "v1")
    assert cfg.lazy is not None
    blob = registry.blob_file(cfg.lazy.data.digest)
    good = blob.read_bytes()
    bad = bytearray(good)
    bad[cfg.lazy.data.offsets[len(cfg.lazy.data.chunks) // 2] + 10] ^= 0xFF
    blob.write_bytes(bytes(bad))
    cfg_edge = lazy_config(dsec_base, "lzbad", "lb", registry.url)
    try:
        with running_edge(cfg_edge) as edge, edge.client() as api:
            r = create(api)
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            res = sh(edge, sid, "cat /work/big.bin > /dev/null; echo rc=$?")
            out, err = b64(res["stdout_b64"]).decode(), b64(res["stderr_b64"]).decode()
            assert "rc=1" in out and "Input/output error" in err, (out, err)  # EIO: no bad byte reached the sandbox
            assert wait_until(lambda: any("refused" in p for p in api.get("/v1/health").json()["problems"]), 5)
            metrics = api.get("/metrics").text
            line = next(x for x in metrics.splitlines() if x.startswith("dsec_edge_lazy_corrupt_chunks_total"))
            assert float(line.split()[-1]) >= 1, line
            assert "dsec_edge_registry_up 1.0" in metrics
            api.delete(f"/v1/sandboxes/{sid}")
    finally:
        blob.write_bytes(good)


def test_the_control_plane_places_a_registry_image_no_edge_holds_yet(
        dsec_base: Path, registry: RegistryServer, pushed: dict[str, Any], tmp_path: Path) -> None:
    """Through the control plane: a name no edge holds is not refused when an edge can fetch
    it; that edge looks it up in its registry and runs the sandbox."""
    import asyncio

    from dsec.control import ControlConfig, serve_control

    async def scenario() -> None:
        ctl = await serve_control(ControlConfig(data_dir=tmp_path / "control", cluster_key=KEY, port=0,
                                                watcher=False, auth_cache_s=0.0))
        cfg = lazy_config(dsec_base, "lzctl", "lc", registry.url, control_plane_url=ctl.url,
                          heartbeat_interval_s=0.2)
        edge = await asyncio.to_thread(lambda: EdgeThread(cfg).start())
        try:
            async with httpx.AsyncClient(base_url=ctl.url, timeout=60,
                                         headers={"authorization": f"Bearer {ctl.admin_token}"}) as c:
                for _ in range(100):
                    edges = (await c.get("/v1/edges")).json()
                    if edges and edges[0]["health"]:
                        break
                    await asyncio.sleep(0.05)
                assert edges[0]["health"]["registry"] == registry.url and edges[0]["health"]["layers"] == []
                # the control plane lists what the edges' registry holds, held by an edge or not
                images = {i["ref"]: i for i in (await c.get("/v1/images")).json()}
                assert images["lzws:v1"] == {"ref": "lzws:v1", "edges": [], "registry": f"{registry.url}/lzws"}
                assert images["busybox:test"]["registry"] == f"{registry.url}/busybox"
                r = await c.post("/v1/sandboxes", json={"spec": SPEC})
                assert r.status_code == 201, r.text
                sb = r.json()
                async with httpx.AsyncClient(base_url=sb["edge_url"], timeout=60,
                                             headers={"authorization": f"Bearer {sb['token']}"}) as data:
                    res = (await data.post(f"/v1/sandboxes/{sb['id']}/exec",
                                           json={"cmd": "sha256sum /work/big.bin"})).json()
                assert pushed["big_sha"] in b64(res["stdout_b64"]).decode()
                # a name the registry does not have either: the edge's 404 comes back through
                bad = await c.post("/v1/sandboxes", json={"spec": {**SPEC, "image": {"base": "nosuch:1"}}})
                assert bad.status_code == 404 and bad.json()["error"]["code"] == "layer_not_found", bad.text
                assert (await c.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204
        finally:
            await asyncio.to_thread(edge.stop)
            await ctl.stop()

    asyncio.run(scenario())


def test_a_token_registry_s_expiring_tokens_are_refreshed_for_attached_layers(
        dsec_base: Path, pushed: dict[str, Any], tmp_path: Path) -> None:
    """Bearer-token auth: the edge logs in with its password file, and layers it has
    attached get fresh Authorization headers as tokens expire (no anonymous access)."""
    from dsec.images.registry import Credentials
    from dsec.images.registry_server import TokenServer

    pw = tmp_path / "registry-password"
    pw.write_text("edge-pw\n")
    with TokenServer(users={"edge": "edge-pw"}, anonymous_pull=False, ttl_s=7) as tokens, \
            RegistryServer(token=tokens) as reg:
        src = LocalLayerStore(dsec_base / "lazy-edge-src" / "layers")
        try:
            with RegistryClient(reg.url, credentials=Credentials("edge", "edge-pw")) as client:
                push_layer(src, pushed["busybox"], client, RegistryRef(reg.url, "busybox", tag="test"))
                push_layer(src, pushed["ws"], client, RegistryRef(reg.url, "lzws", tag="v1"))
        finally:
            src.close()
        base = lazy_config(dsec_base, "lztok", "lt", reg.url)
        assert base.registry is not None
        cfg = base.model_copy(update={"registry": base.registry.model_copy(update={
            "username": "edge", "password_file": pw, "refresh_interval_s": 0.5})})
        with running_edge(cfg) as edge, edge.client() as api:
            r = create(api)
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            layers = edge.service.backends.registry
            first = {d: a.parts[0].headers["Authorization"] for d, a in layers._attached.items()}
            assert first and all(h.startswith("Bearer ") for h in first.values())
            issued = tokens.requests
            # the client renews a token 5 s before it expires; the edge re-attaches with it
            assert wait_until(lambda: all(a.parts[0].headers["Authorization"] != first[d]
                                          for d, a in layers._attached.items()), 15)
            assert tokens.requests > issued
            res = sh(edge, sid, "sha256sum /work/big.bin")  # uncached chunks, fetched with the new token
            assert pushed["big_sha"] in b64(res["stdout_b64"]).decode()
            api.delete(f"/v1/sandboxes/{sid}")


def test_an_edge_restart_keeps_the_loader_for_the_sandboxes_it_keeps(
        dsec_base: Path, registry: RegistryServer, pushed: dict[str, Any]) -> None:
    cfg = lazy_config(dsec_base, "lzrst", "lr", registry.url)
    first = EdgeThread(cfg).start()
    try:
        with first.client() as api:
            r = create(api)
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
        pid = first.service.backends.registry.lazy.pid
    finally:
        first.stop(destroy_all=False)  # an edge restart: its sandboxes stay, so does the loader
    assert pid is not None and Path(f"/proc/{pid}").exists()
    with running_edge(cfg) as edge, edge.client() as api:
        assert edge.service.backends.registry.lazy.pid == pid  # adopted, not restarted
        assert [s["id"] for s in api.get("/v1/sandboxes").json()] == [sid]
        res = sh(edge, sid, "sha256sum /work/big.bin")  # chunks never read before the restart
        assert pushed["big_sha"] in b64(res["stdout_b64"]).decode()
    assert not Path(f"/proc/{pid}").exists() or b"lazy.serve" not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_prefetch_profile_recorded_at_push_is_fetched_ahead_when_an_edge_attaches(
        dsec_base: Path, registry: RegistryServer, pushed: dict[str, Any]) -> None:
    """``push_layer(profile=...)`` runs the start-up over the lazy form (loaded from the registry)
    and keeps the data chunks it read; an edge attaching the layer fetches exactly those at once,
    so the start-up then reads without a fetch, and nothing else was fetched ahead."""
    src = dsec_base / "lazy-prof-src"
    store = LocalLayerStore(src / "layers")
    tree = src / "tree"
    rnd = random.Random(11)
    (tree / "work").mkdir(parents=True, exist_ok=True)
    hot, cold = rnd.randbytes(2 * MiB + 99), rnd.randbytes(4 * MiB + 7)
    (tree / "work" / "hot.bin").write_bytes(hot)
    (tree / "work" / "cold.bin").write_bytes(cold)
    try:
        build_busybox(store, name="busybox", tag="test")
        ws = build_from_dir(store, tree, name="lzprof", tag="v1", kind="workspace")
    except HostError as exc:
        pytest.skip(f"cannot build the layers: {exc}")
    with RegistryClient(registry.url) as client:
        done = push_layer(store, ws.digest, client, RegistryRef(registry.url, "lzprof", tag="v1"),
                          profile="cat /work/hot.bin > /dev/null", profile_under=["busybox:test"])
        # the same push again keeps the profile without running it
        again = push_layer(store, ws.digest, client, RegistryRef(registry.url, "lzprof", tag="v1"),
                           profile="cat /work/hot.bin > /dev/null", profile_under=["busybox:test"])
    store.close()
    assert done.profile is not None and done.profile.returncode == 0, done.profile
    lazy = done.lazy
    assert lazy is not None and lazy.profile == "cat /work/hot.bin > /dev/null"
    # random bytes do not compress: the hot file's 2 MiB are in the profile, the cold 4 MiB are not
    assert 2 * MiB <= lazy.prefetch_bytes < 4 * MiB, lazy.prefetch_bytes
    assert again.profile is None and again.lazy is not None and again.lazy.prefetch == lazy.prefetch
    # the profile run left nothing on the host: no mount of its loader, no process
    assert not [m for m in sysmount.mountinfo() if "lazyprofile" in m.mount_point]
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmd_has(int(p), b"dsec.images.lazyprofile")]

    cfg = lazy_config(dsec_base, "lzprof", "lzp", registry.url)
    with running_edge(cfg) as edge, edge.client() as api:
        r = create(api, {**SPEC, "image": {"base": "busybox:test", "workspace": "lzprof:v1"}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        reg = edge.service.backends.registry
        assert reg is not None and reg.lazy is not None
        loader = reg.lazy
        data_hex = lazy.data.digest.removeprefix("sha256:")
        assert wait_until(lambda: loader.stats()["layers"][data_hex]["prefetch_s"] > 0, timeout=30)
        st = loader.stats()["layers"][data_hex]
        assert st["prefetch_chunks"] == sum(c for _, c in lazy.prefetch)
        fetched = st["bytes_fetched"]
        res = sh(edge, sid, "sha256sum /work/hot.bin")
        assert hashlib.sha256(hot).hexdigest() in b64(res["stdout_b64"]).decode(), res
        # every byte of the start-up was there already
        assert loader.stats()["layers"][data_hex]["bytes_fetched"] == fetched
        res = sh(edge, sid, "sha256sum /work/cold.bin")
        assert hashlib.sha256(cold).hexdigest() in b64(res["stdout_b64"]).decode(), res
        assert loader.stats()["layers"][data_hex]["bytes_fetched"] - fetched >= 3 * MiB
        assert api.delete(f"/v1/sandboxes/{sid}").status_code in (200, 204)


def test_a_profile_that_cannot_be_recorded_leaves_the_push_whole_and_nothing_behind(
        dsec_base: Path, registry: RegistryServer) -> None:
    src = dsec_base / "lazy-prof-bad"
    store = LocalLayerStore(src / "layers")
    (src / "tree" / "w").mkdir(parents=True, exist_ok=True)
    (src / "tree" / "w" / "f").write_bytes(b"x" * 100_000)
    try:
        bb = build_busybox(store, name="busybox", tag="test")
        ws = build_from_dir(store, src / "tree", name="lzbad", tag="v1", kind="workspace")
    except HostError as exc:
        pytest.skip(f"cannot build the layers: {exc}")
    with RegistryClient(registry.url) as client:
        # a command that outlives its timeout is killed with everything it started
        t0 = time.monotonic()
        slow = push_layer(store, bb.digest, client, RegistryRef(registry.url, "lzbad-bb", tag="v1"),
                          profile="sleep 60 & sleep 60", profile_timeout_s=2)
        assert time.monotonic() - t0 < 30
        assert slow.profile is None and slow.lazy is not None and slow.lazy.profile == "" and not slow.lazy.prefetch
        # a workspace layer alone has no /bin/sh to run the command: pushed without a profile
        alone = push_layer(store, ws.digest, client, RegistryRef(registry.url, "lzbad", tag="v1"), profile="true")
        assert alone.profile is None and alone.lazy is not None and alone.lazy.profile == ""
        # a failing command still yields what it read, with its exit status
        failed = push_layer(store, ws.digest, client, RegistryRef(registry.url, "lzbad", tag="v2"),
                            profile="cat /w/f > /dev/null; exit 7", profile_under=["busybox:test"])
        assert failed.profile is not None and failed.profile.returncode == 7
        assert failed.lazy is not None and failed.lazy.prefetch
    store.close()
    assert not [m for m in sysmount.mountinfo() if "lazyprofile" in m.mount_point]
    assert not [p for p in os.listdir("/proc") if p.isdigit() and (
        _cmd_has(int(p), b"dsec.images.lazyprofile") or _cmd_has(int(p), b"sleep\x0060"))]


def _cmd_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
