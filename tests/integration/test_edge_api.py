"""The edge agent's HTTP API against a real runtime and a real uvicorn on 127.0.0.1.

One edge per module (runtime ``<prefix>-eapi``); every test destroys what it
made, and the module checks that the edge leaves nothing on the host.
"""

from __future__ import annotations

import base64
import io
import json
import secrets
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import edge_config, running_edge, wait_until
from dsec.edge.testing import EdgeThread
from dsec.http.auth import mint

pytestmark = pytest.mark.root

KEY = secrets.token_bytes(32)
SPEC: dict[str, Any] = {"image": {"base": "busybox:test"}, "resources": {"cpu": 0.5, "memory": 256 << 20, "disk": 64 << 20}}


@pytest.fixture(scope="module")
def edge(dsec_base: Path) -> Iterator[EdgeThread]:
    with running_edge(edge_config(dsec_base, "eapi", "ea", KEY, watchdog_interval_s=0.2)) as e:
        yield e


@pytest.fixture(scope="module")
def api(edge: EdgeThread) -> Iterator[httpx.Client]:
    with edge.client() as c:
        yield c


def create(api: httpx.Client, **extra: Any) -> dict[str, Any]:
    r = api.post("/v1/sandboxes", json={"spec": SPEC, **extra})
    assert r.status_code == 201, r.text
    return dict(r.json())


def b64(text: str) -> str:
    return base64.b64decode(text).decode()


def err(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    return dict(body["error"])


def test_round_trip(edge: EdgeThread, api: httpx.Client) -> None:
    info = create(api, labels={"job": "rt"}, task="t1", project="p1")
    sid = info["id"]
    assert sid.startswith("ea-") and len(sid) == len("ea-") + 12
    assert info["state"] == "running" and info["edge_url"] == edge.url and info["from_pool"] is False
    assert info["labels"] == {"job": "rt"} and info["task"] == "t1" and info["project"] == "p1"
    assert info["expires_at"] == pytest.approx(info["created_at"] + 3600, abs=1)
    sb = httpx.Client(base_url=edge.url, headers={"authorization": f"Bearer {info['token']}"}, timeout=30)
    try:
        # get / list
        assert api.get(f"/v1/sandboxes/{sid}").json()["id"] == sid
        assert sb.get(f"/v1/sandboxes/{sid}").json()["token"] is None  # only admins get fresh tokens
        listed = api.get("/v1/sandboxes", params=[("label", "job=rt"), ("task", "t1")]).json()
        assert [x["id"] for x in listed] == [sid]
        assert api.get("/v1/sandboxes", params={"label": "job=other"}).json() == []

        # exec: argv and shell forms, stdin, env, cwd, exit code
        r = sb.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat; echo $FOO; pwd; echo oops >&2; exit 3",
                                                       "env": {"FOO": "bar"}, "cwd": "/tmp",
                                                       "stdin_b64": base64.b64encode(b"in\n").decode()})
        assert r.status_code == 200, r.text
        res = r.json()
        assert (res["exit_code"], b64(res["stdout_b64"]), b64(res["stderr_b64"])) == (3, "in\nbar\n/tmp\n", "oops\n")
        r = sb.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["/bin/echo", "a b"]})
        assert b64(r.json()["stdout_b64"]) == "a b\n"
        # a timeout is a result with timed_out (the SDK raises ExecTimeout with the partial output)
        r = sb.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo partial; sleep 5", "timeout": 0.5})
        assert r.status_code == 200 and r.json()["timed_out"] == "timeout"
        assert b64(r.json()["stdout_b64"]) == "partial\n"
        r = sb.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["/no/such/binary"]})
        assert r.status_code == 400 and err(r)["code"] == "exec_error"

        # streaming: chunks arrive as produced, the last line is the result
        t0 = time.monotonic()
        seen: list[tuple[float, dict[str, Any]]] = []
        with sb.stream("POST", f"/v1/sandboxes/{sid}/exec/stream",
                       json={"cmd": "echo one; sleep 0.6; echo two >&2; exit 4"}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("application/x-ndjson")
            for line in resp.iter_lines():
                if line.strip():
                    seen.append((time.monotonic() - t0, json.loads(line)))
        kinds = [c["kind"] for _, c in seen]
        assert kinds == ["stdout", "stderr", "result"], seen
        assert seen[0][0] < 0.5, "the first chunk must arrive before the command ends"
        assert b64(seen[0][1]["data_b64"]) == "one\n" and b64(seen[1][1]["data_b64"]) == "two\n"
        assert seen[-1][1]["result"]["exit_code"] == 4

        # sessions keep cwd and variables
        r = sb.post(f"/v1/sandboxes/{sid}/sessions")
        assert r.status_code == 200, r.text
        sess = r.json()["session_id"]
        sb.post(f"/v1/sandboxes/{sid}/sessions/{sess}/run", json={"command": "cd /etc; X=42"}).raise_for_status()
        out = sb.post(f"/v1/sandboxes/{sid}/sessions/{sess}/run", json={"command": "echo $PWD $X; false"}).json()
        assert (b64(out["stdout_b64"]), out["exit_code"]) == ("/etc 42\n", 1)
        assert sb.delete(f"/v1/sandboxes/{sid}/sessions/{sess}").status_code == 204
        r = sb.post(f"/v1/sandboxes/{sid}/sessions/{sess}/run", json={"command": "true"})
        assert r.status_code == 410 and err(r)["code"] == "session_closed"

        # files
        f = f"/v1/sandboxes/{sid}/files"
        assert sb.put(f, params={"path": "/work/a.txt", "mode": "600", "parents": 1}, content=b"hello").status_code == 204
        assert sb.post(f + "/append", params={"path": "/work/a.txt"}, content=b" world").status_code == 204
        assert sb.get(f, params={"path": "/work/a.txt"}).content == b"hello world"
        st = sb.get(f + "/stat", params={"path": "/work/a.txt"}).json()
        assert (st["type"], st["size"], st["mode"], st["uid"]) == ("file", 11, 0o600, 0)
        assert sb.post(f + "/mkdir", params={"path": "/work/d/e", "parents": 1}).status_code == 204
        assert sb.post(f + "/rename", params={"src": "/work/a.txt", "dst": "/work/d/b.txt"}).status_code == 204
        names = [e["name"] for e in sb.get(f + "/list", params={"path": "/work/d"}).json()]
        assert names == ["b.txt", "e"]
        tar = sb.get(f + "/tar", params={"path": "/work"}).content
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            assert "d/b.txt" in t.getnames()
        r = sb.put(f + "/tar", params={"path": "/copy"}, content=tar)
        assert r.status_code == 200 and r.json()["entries"] >= 3
        assert sb.get(f, params={"path": "/copy/d/b.txt"}).content == b"hello world"
        assert sb.delete(f, params={"path": "/copy", "recursive": 1}).status_code == 204
        r = sb.get(f, params={"path": "/copy/d/b.txt"})
        assert r.status_code == 400 and err(r)["code"] == "file_error"
        r = sb.get(f, params={"path": "/../../../etc/shadow"})  # confined to the sandbox's root
        assert r.status_code == 400 or b"root:" not in r.content

        # delete is idempotent; afterwards the sandbox says why it is gone
        assert sb.delete(f"/v1/sandboxes/{sid}").status_code == 204
        assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204
        gone = api.get(f"/v1/sandboxes/{sid}").json()
        assert (gone["state"], gone["reason"]) == ("stopped", "deleted")
        r = sb.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
        assert r.status_code == 404 and err(r)["reason"] == "deleted"
        assert api.get("/v1/sandboxes").json() == []
    finally:
        sb.close()
        api.delete(f"/v1/sandboxes/{sid}")


def test_stream_disconnect_kills_the_command(edge: EdgeThread, api: httpx.Client) -> None:
    sid = create(api)["id"]
    try:
        rt = edge.service.backends.get("container")
        with edge.client() as c, c.stream("POST", f"/v1/sandboxes/{sid}/exec/stream",
                                          json={"cmd": "echo started; sleep 60"}) as resp:
            lines = resp.iter_lines()  # keep the iterator: dropping it closes the connection
            first = next(lines)
            assert json.loads(first)["kind"] == "stdout"
            time.sleep(0.3)
            assert len(rt.cgroups.pids(sid)) >= 2  # init + the command, still running
        # the client went away: the command's process tree is killed, the sandbox lives
        assert wait_until(lambda: len(rt.cgroups.pids(sid)) == 1, timeout=5), rt.cgroups.pids(sid)
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo alive"})
        assert b64(r.json()["stdout_b64"]) == "alive\n"
        kinds = [e["event"] for e in api.get(f"/v1/sandboxes/{sid}/events").json()]
        assert "exec_cancelled" in kinds, kinds
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_exec_disconnect_kills_the_command(edge: EdgeThread, api: httpx.Client) -> None:
    sid = create(api)["id"]
    try:
        rt = edge.service.backends.get("container")
        with edge.client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 60"})
        assert wait_until(lambda: len(rt.cgroups.pids(sid)) == 1, timeout=5), rt.cgroups.pids(sid)
        assert 'dsec_edge_execs_total{kind="exec",outcome="cancelled"}' in api.get("/metrics").text
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_auth(edge: EdgeThread, api: httpx.Client) -> None:
    a, b = create(api)["id"], create(api)["id"]
    try:
        url = f"/v1/sandboxes/{a}/exec"
        body = {"cmd": "true"}
        with httpx.Client(base_url=edge.url) as anon:
            r = anon.post(url, json=body)
            assert r.status_code == 401 and err(r)["code"] == "auth_error"
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert anon.post(url, json=body, headers={"authorization": "Basic eDp5"}).status_code == 401
            assert anon.post(url, json=body, headers={"authorization": "Bearer garbage"}).status_code == 401
            forged, _ = mint(secrets.token_bytes(32), sandbox_id=a, project="")
            r = anon.post(url, json=body, headers={"authorization": f"Bearer {forged}"})
            assert r.status_code == 401 and "signature" in err(r)["message"]
            tampered = edge.sandbox_headers(b)["authorization"][:-3] + "AAA"
            assert anon.post(url, json=body, headers={"authorization": tampered}).status_code == 401
            expired, _ = mint(KEY, sandbox_id=a, project="", ttl_s=-5)
            r = anon.post(url, json=body, headers={"authorization": f"Bearer {expired}"})
            assert r.status_code == 401 and "expired" in err(r)["message"]
            # a valid token for another sandbox
            r = anon.post(url, json=body, headers=edge.sandbox_headers(b))
            assert r.status_code == 403 and err(r)["code"] == "forbidden"
            for method, path in (("DELETE", f"/v1/sandboxes/{a}"), ("GET", f"/v1/sandboxes/{a}/events"),
                                 ("GET", f"/v1/sandboxes/{a}/files?path=/etc/passwd")):
                assert anon.request(method, path, headers=edge.sandbox_headers(b)).status_code == 403
            # sandbox tokens cannot create, list or read health
            own = edge.sandbox_headers(a)
            assert anon.post("/v1/sandboxes", json={"spec": SPEC}, headers=own).status_code == 403
            assert anon.get("/v1/sandboxes", headers=own).status_code == 403
            assert anon.get("/v1/health", headers=own).status_code == 403
            assert anon.get("/v1/health").status_code == 401
            # nor snapshot or fork their own sandbox: those count against project quotas,
            # which only the control plane (an edge-admin caller) checks
            r = anon.post(f"/v1/sandboxes/{a}/fork", json={"n": 2}, headers=own)
            assert r.status_code == 403 and err(r)["code"] == "forbidden"
            assert anon.post(f"/v1/sandboxes/{a}/snapshot", json={}, headers=own).status_code == 403
            # its own token works; /metrics is open
            assert anon.post(url, json=body, headers=own).status_code == 200
            assert anon.get("/metrics").status_code == 200
        assert a in {x["id"] for x in api.get("/v1/sandboxes").json()}  # the 403s changed nothing
    finally:
        api.delete(f"/v1/sandboxes/{a}")
        api.delete(f"/v1/sandboxes/{b}")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"spec": {"image": {"base": "busybox:test"}, "resources": {"cpu": -1}}}, "spec.resources.cpu"),
        ({"spec": {"image": {"base": "busybox:test"}, "resources": {"memory": 1}}}, "spec.resources.memory"),
        ({"spec": {"image": {"base": "Bad Ref!"}}}, "spec.image.base"),
        ({"spec": {"image": {"base": "busybox:test"}, "colour": "red"}}, "spec.colour"),
        ({"spec": {"image": {"base": "busybox:test"}}, "labels": {"BAD KEY": "x"}}, "labels"),
        ({"spec": {"image": {"base": "busybox:test"}}, "lifecycle": {"ttl_s": 0}}, "lifecycle.ttl_s"),
        ({"spec": {"image": {"base": "busybox:test"}}, "id": "zz-123456789abc"}, "id"),
        ({"lifecycle": {}}, "spec"),
        ([1, 2], "body"),
    ],
)
def test_malformed_create_is_422_with_the_field(api: httpx.Client, body: Any, field: str) -> None:
    r = api.post("/v1/sandboxes", json=body)
    assert r.status_code == 422, r.text
    e = err(r)
    assert e["code"] == "invalid_spec" and e["field"] == field, e
    assert api.get("/v1/sandboxes").json() == []


def test_bad_input_never_500(edge: EdgeThread, api: httpx.Client) -> None:
    r = api.post("/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and err(r)["code"] == "invalid_spec"
    r = api.post("/v1/sandboxes", json={"spec": {"image": {"base": "nosuchlayer:1"}}})
    assert r.status_code == 404 and err(r)["code"] == "layer_not_found"
    r = api.post("/v1/sandboxes/ea-000000000000/exec", json={"cmd": "true"})
    assert r.status_code == 404 and err(r)["code"] == "sandbox_not_found"
    assert api.get("/v1/nothing").status_code == 404
    sid = create(api)["id"]
    try:
        cases: list[tuple[str, str, dict[str, Any], str]] = [
            ("POST", "/exec", {"json": {}}, "cmd"),
            ("POST", "/exec", {"json": {"cmd": []}}, "cmd"),
            ("POST", "/exec", {"json": {"cmd": "true", "timeout": 0}}, "timeout"),
            ("POST", "/exec", {"json": {"cmd": "true", "stdin_b64": "!!"}}, "stdin_b64"),
            ("POST", "/exec", {"json": {"cmd": "true", "user": "nobody"}}, "user"),
            ("POST", "/exec", {"json": {"cmd": "true", "cwd": "relative"}}, "cwd"),
            ("POST", "/exec", {"json": {"cmd": "true", "env": {"A=B": "x"}}}, "env"),
            ("POST", "/exec/stream", {"json": {"cmd": 5}}, "cmd"),
            ("POST", "/sessions/x/run", {"json": {"command": "a\u0000b"}}, ""),
            ("PUT", "/files", {"params": {"path": "/x", "mode": "999"}, "content": b""}, "mode"),
            ("GET", "/files", {}, "path"),
            ("POST", "/files/rename", {"params": {"src": "/a"}}, "dst"),
            ("PUT", "/files/tar", {"params": {"path": "/t"}, "content": b"not a tar"}, "tar"),
        ]
        for method, path, kw, field in cases:
            r = api.request(method, f"/v1/sandboxes/{sid}{path}", **kw)
            assert 400 <= r.status_code < 500, (path, kw, r.status_code, r.text)
            if field:
                assert err(r).get("field") == field, (path, kw, r.text)
        assert len(edge.service.backends.get("container").sandboxes) == 1
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_events_metrics_health(edge: EdgeThread, api: httpx.Client) -> None:
    info = create(api, lifecycle={"ttl_s": 600}, **{"spec": {**SPEC, "resources": {
        "memory": 48 << 20, "disk": 128 << 20, "disk_medium": "memory"}}})
    sid = info["id"]
    try:
        api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "exit 7"})
        # fill the tmpfs upper (memory medium) past the memory limit: the kernel OOM-kills dd
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "dd if=/dev/zero of=/big bs=1M count=100", "timeout": 30})
        assert r.json()["signal"] == 9 or r.json()["exit_code"] != 0, r.json()
        events = api.get(f"/v1/sandboxes/{sid}/events").json()
        kinds = [e["event"] for e in events]
        assert kinds[0] == "state" and "created" in kinds and "oom" in kinds, kinds
        assert {"exit_code": 7} .items() <= next(e for e in events if e["event"] == "exec_ended").items()
        assert [e["t"] for e in events] == sorted(e["t"] for e in events)

        health = api.get("/v1/health").json()
        assert health["edge_id"] == "ea" and health["sandboxes"] == 1
        assert health["memory_committed"] == 48 << 20 and health["cpu_capacity"] > 0
        assert "busybox:test" in health["layers"] and health["host"]["memory_total"] > 0

        text = api.get("/metrics").text
        for series in (
            'dsec_edge_sandboxes{state="running"} 1.0',
            "dsec_edge_creates_total{",
            'dsec_edge_create_seconds_bucket{le="0.01",source="cold"}',
            'dsec_edge_execs_total{kind="exec",outcome="nonzero"}',
            "dsec_edge_exec_seconds_count",
            'dsec_edge_admission_refusals_total{reason="memory"}',
            'dsec_edge_limit_events_total{kind="oom"}',
            'dsec_edge_capacity{resource="cpu"}',
            'dsec_edge_committed{resource="memory"} 5.0331648e+07',
            "dsec_edge_host_cpu_utilization",
            'dsec_edge_host_memory_bytes{kind="available"}',
            'dsec_edge_host_disk_bytes{kind="free"}',
        ):
            assert series in text, series
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
    events = api.get(f"/v1/sandboxes/{sid}/events").json()
    assert events[-1]["event"] == "destroyed" and events[-1]["reason"] == "deleted"
