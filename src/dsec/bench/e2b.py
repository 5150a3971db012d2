"""``dsec bench e2b``: E2B's released clients against DSec's E2B front, beside DSec's own SDK
in the same run, on one ``dsec up`` (its own data directory; the toolchain layers E2B's
templates use are built once and cached, as ``dsec bench compat`` does).

Keys (latencies in ms, p50 over sequential calls from one client):

- ``e2b_create_p50_ms``: ``AsyncSandbox.create()`` (template ``base``: tc-base + python; the
  front's in-sandbox setup, E2B's ``user`` and the envVars, runs beside the answer and the
  sandbox's first envd call waits for it), vs
  ``sdk_create_p50_ms``: ``AsyncClient.create`` of the same image and size;
  ``e2b_vs_sdk_create_ratio`` (target <= 1.5);
- ``plain_front_create_p50_ms`` / ``plain_control_create_p50_ms``: the same creates as ``POST
  /v2/sandboxes`` (the E2B front) and ``POST /v1/sandboxes`` (the control plane) from one plain
  httpx client, and ``front_vs_control_create_ratio``: what the front itself adds, the clients'
  own costs left out;
- ``e2b_client_create_cost_p50_ms`` / ``sdk_client_create_cost_p50_ms``: what each client spends
  per create of its own, against a server answering at once with a canned body (the E2B client
  builds seven httpx clients and its models per create): the part of the ratio no server removes;
- ``e2b_run_p50_ms``: ``commands.run("true")`` (E2B runs ``/bin/bash -l -c true``) vs
  ``sdk_exec_p50_ms``: ``exec(["/bin/bash", "-l", "-c", "true"])``; ``e2b_vs_sdk_run_ratio``;
- ``e2b_run_code_p50_ms``: code-interpreter ``run_code("1 + 1")`` in a warm context;
- ``e2b_files_write_1mib_ms``: ``files.write`` of 1 MiB (p50);
- ``e2b_creates_per_s_<N>``: N ``AsyncSandbox.create`` in flight at once from one client
  (256; 64 with ``--quick``), each then running one command, and ``e2b_errors``: every
  exception of the run (target 0). ``E2B_MAX_CONNECTIONS`` is raised to N + 64 for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from dsec.bench.compat_kit import Say, _quiet, all_in_one, toolchain_cache
from dsec.bench.stats import percentile

TOOLCHAINS = ("python", "jupyter")
BURST_TEMPLATE = "bench-small"
"""The burst's template (0.05 cores, 64 MiB of memory, 64 MiB of disk): 256 of E2B's default 1-core
sandboxes do not fit one 2-core edge, whose refusals (429, Retry-After) the client retries three
times, then raises; 256 disks of 256 MiB came near the disk budget of a shared machine (one 429
"short of disk" on 2026-12-07)."""
MiB = 1 << 20


async def _timed(n: int, call: Callable[[], Awaitable[Any]]) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _p50(values: list[float]) -> float:
    return round(percentile(values, 50), 2)


async def _measure(url: str, token: str, quick: bool, say: Say) -> dict[str, Any]:
    from e2b import AsyncSandbox
    from e2b_code_interpreter import AsyncSandbox as AsyncCodeSandbox  # type: ignore[import-untyped]

    import dsec
    from dsec.compat.e2b.config import E2BConfig
    from dsec.spec import ImageRef, Resources, SandboxSpec

    n = 10 if quick else 40
    burst = 64 if quick else 256
    res: dict[str, Any] = {"quick": quick, "n_sequential": n}
    errors = 0
    tpl = E2BConfig().templates["base"]
    spec = SandboxSpec(image=ImageRef(base=tpl.base, toolkits=tpl.toolkits),
                       resources=Resources(cpu=tpl.cpu, memory=tpl.memory_mb * MiB, disk=tpl.disk_mb * MiB))

    say(f"e2b: create x{n} (E2B client, then DSec's SDK; then both APIs with one plain HTTP client)")
    e2b_create: list[float] = []
    sdk_create: list[float] = []
    raw_front: list[float] = []
    raw_control: list[float] = []
    from dsec.compat.e2b.keys import api_key_of

    api_key = api_key_of(token)
    control_body = json.dumps({"spec": json.loads(spec.model_dump_json())})
    async with dsec.AsyncClient(url, token, lease_ahead=0) as client, httpx.AsyncClient(timeout=120) as plain:
        for _ in range(n):
            t0 = time.perf_counter()
            sb = await AsyncSandbox.create()
            e2b_create.append((time.perf_counter() - t0) * 1000)
            await sb.kill()
            t0 = time.perf_counter()
            d = await client.create(spec)
            sdk_create.append((time.perf_counter() - t0) * 1000)
            await d.close()
            # the same two creates through one plain client: what the servers take, whatever the client costs
            t0 = time.perf_counter()
            r = await plain.post(f"{url}/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-KEY": api_key})
            raw_front.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 201:
                errors += 1
            else:
                await client.delete(r.json()["sandboxID"])
            t0 = time.perf_counter()
            r = await plain.post(f"{url}/v1/sandboxes", content=control_body,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            raw_control.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 201:
                errors += 1
            else:
                await client.delete(r.json()["id"])
        res["e2b_create_p50_ms"] = _p50(e2b_create)
        res["sdk_create_p50_ms"] = _p50(sdk_create)
        res["e2b_vs_sdk_create_ratio"] = round(res["e2b_create_p50_ms"] / res["sdk_create_p50_ms"], 2)
        res["plain_front_create_p50_ms"] = _p50(raw_front)
        res["plain_control_create_p50_ms"] = _p50(raw_control)
        res["front_vs_control_create_ratio"] = round(res["plain_front_create_p50_ms"]
                                                     / res["plain_control_create_p50_ms"], 2)

        say(f"e2b: commands.run('true') x{n * 5} vs SDK exec")
        sb = await AsyncSandbox.create()
        d = await client.create(spec)
        try:
            await sb.commands.run("true")
            await d.exec(["/bin/bash", "-l", "-c", "true"])
            res["e2b_run_p50_ms"] = _p50(await _timed(n * 5, lambda: sb.commands.run("true")))
            res["sdk_exec_p50_ms"] = _p50(await _timed(n * 5, lambda: d.exec(["/bin/bash", "-l", "-c", "true"])))
            res["e2b_vs_sdk_run_ratio"] = round(res["e2b_run_p50_ms"] / res["sdk_exec_p50_ms"], 2)
            blob = os.urandom(MiB)
            say(f"e2b: files.write 1 MiB x{n}")
            res["e2b_files_write_1mib_ms"] = _p50(await _timed(n, lambda: sb.files.write("/home/user/blob", blob)))
            if bytes(await sb.files.read("/home/user/blob", format="bytes")) != blob:
                errors += 1
        finally:
            await sb.kill()
            await d.close()

    say(f"e2b: run_code('1 + 1') x{n * 2} (code-interpreter, warm context)")
    cs = await AsyncCodeSandbox.create()
    try:
        t0 = time.perf_counter()
        first = await cs.run_code("1 + 1")
        res["e2b_run_code_first_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        if first.text != "2":
            errors += 1

        async def cell() -> None:
            nonlocal errors
            if (await cs.run_code("1 + 1")).text != "2":
                errors += 1
        res["e2b_run_code_p50_ms"] = _p50(await _timed(n * 2, cell))
    finally:
        await cs.kill()

    say(f"e2b: {burst} AsyncSandbox.create in flight, each running one command")
    os.environ["E2B_MAX_CONNECTIONS"] = str(burst + 64)

    samples: list[str] = []

    async def one(i: int) -> bool:
        try:
            s = await AsyncSandbox.create(BURST_TEMPLATE, timeout=600)
        except Exception as exc:
            samples.append(f"create: {type(exc).__name__}: {str(exc)[:200]}")
            return False
        try:
            r = await s.commands.run(f"echo {i}")
            return r.stdout == f"{i}\n"
        except Exception as exc:
            samples.append(f"run: {type(exc).__name__}: {str(exc)[:200]}")
            return False
        finally:
            with contextlib.suppress(Exception):
                await s.kill()

    t0 = time.perf_counter()
    created = 0

    async def counted(i: int) -> bool:
        nonlocal created
        ok = await one(i)
        created += 1
        return ok

    outcomes = await asyncio.gather(*(counted(i) for i in range(burst)))
    wall = time.perf_counter() - t0
    bad = sum(1 for ok in outcomes if not ok)
    errors += bad
    res[f"e2b_creates_per_s_{burst}"] = round(burst / wall, 1)
    res[f"e2b_burst_{burst}_wall_s"] = round(wall, 2)
    res["e2b_errors"] = errors
    if samples:
        res["e2b_error_samples"] = sorted(set(samples))[:5]
    return res


def _client_costs(n: int, say: Say) -> dict[str, float]:
    """What each client spends per create of its own, against a server that answers at once
    with a canned body (uvicorn in a thread of this process): the part of the create ratio no
    server can remove."""
    import socket
    import threading

    import uvicorn

    import dsec
    from dsec.spec import ImageRef, Resources, SandboxSpec, SandboxState
    from dsec.spec.api import SandboxInfo

    now = time.time()
    spec = SandboxSpec(image=ImageRef(base="tc-base:bookworm", toolkits=("tc-python:bookworm",)))
    info = SandboxInfo(id="e1-0123456789ab", state=SandboxState.RUNNING, edge_id="e1", edge_url="http://127.0.0.1:9",
                       token="dsec1." + "x" * 300, token_expires_at=now + 3600, labels={"dsec.compat": "e2b"},
                       project="root", created_at=now, expires_at=now + 3600, image=spec.image,
                       resources=Resources(), backend="container").model_dump_json().encode()
    e2b_body = json.dumps({"templateID": "base", "sandboxID": "e1-0123456789ab", "clientID": "dsec",
                           "envdVersion": "0.6.4", "alias": "base", "envdAccessToken": "x" * 300,
                           "trafficAccessToken": "x" * 300}).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        body = e2b_body if scope["path"] == "/v2/sandboxes" else info
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, name="e2b-bench-stub", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL")}
    try:
        while not server.started:
            time.sleep(0.01)
        os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url})
        say(f"e2b: the clients' own cost per create, x{n} against a canned answer")

        async def measure() -> tuple[list[float], list[float]]:
            from e2b import AsyncSandbox

            a: list[float] = []
            b: list[float] = []
            async with dsec.AsyncClient(url, "dsk_bench-stub", lease_ahead=0) as client:
                for i in range(n + 10):
                    t0 = time.perf_counter()
                    await AsyncSandbox.create()
                    t1 = time.perf_counter()
                    await client.create(spec)
                    t2 = time.perf_counter()
                    if i >= 10:
                        a.append((t1 - t0) * 1000)
                        b.append((t2 - t1) * 1000)
            return a, b

        e2b_ms, sdk_ms = asyncio.run(measure())
    finally:
        server.should_exit = True
        thread.join(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"e2b_client_create_cost_p50_ms": _p50(e2b_ms), "sdk_client_create_cost_p50_ms": _p50(sdk_ms)}


def run(*, quick: bool = False, say: Say = _quiet) -> dict[str, Any]:
    from dsec.compat.e2b.config import E2BConfig
    from dsec.compat.e2b.keys import api_key_of
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import build_toolchains, copy_toolchains

    try:
        import e2b  # noqa: F401
        import e2b_code_interpreter  # noqa: F401
    except ImportError:
        raise RuntimeError("dsec bench e2b calls DSec with E2B's released clients: pip install 'dsec[compat]'") from None
    cache = LocalLayerStore(toolchain_cache())
    try:
        built = build_toolchains(cache, TOOLCHAINS, progress=None)
        if any(b.built for b in built):
            say(f"e2b: built the toolchains {', '.join(b.toolchain for b in built if b.built)} into {toolchain_cache()}")
        with tempfile.TemporaryDirectory(prefix="dsec-bench-e2b-") as tmp:
            work = Path(tmp)
            dst = LocalLayerStore(work / "layers")
            copy_toolchains(cache, dst, TOOLCHAINS)
            dst.close()
            cfg = work / "control.json"
            templates = {k: v.model_dump() for k, v in E2BConfig().templates.items()}
            templates[BURST_TEMPLATE] = {**templates["base"], "cpu": 0.05, "memory_mb": 64, "disk_mb": 64}
            cfg.write_text(json.dumps({"e2b": {"templates": templates}}))
            with all_in_one(work, say, label="e2b", extra=["--control-config", str(cfg)]) as (url, token, _pid):
                saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN",
                                                       "E2B_MAX_CONNECTIONS")}
                os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": api_key_of(token),
                                   "E2B_DOMAIN": "dsec.invalid"})
                try:
                    res = asyncio.run(_measure(url, token, quick, say))
                    res.update(_client_costs(50 if quick else 200, say))
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
    finally:
        cache.close()
    import importlib.metadata as md

    res["e2b_client_version"] = md.version("e2b")
    res["e2b_code_interpreter_version"] = md.version("e2b-code-interpreter")
    return res
