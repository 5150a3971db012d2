"""Network policies, observed with real connections: a sandbox is loopback-only unless a policy
says otherwise; a named permission (defined by the edge's operator) opens exactly its
destinations and ports; ``set_policy`` switches at once, cuts connections the new policy forbids
and ``None`` takes the network away; the host, other sandboxes and metadata addresses stay
unreachable whatever the policy; refused attempts are counted; a stage's policy comes with the
stage; fork children start with the policy in force.

The "Internet" is a network namespace made here (a veth to the host, HTTP servers on 8080 and
9090, a held-open line on 7000: tests/conftest.py ``remote_host``). The backend gets named
permissions for it through :func:`configure`, the module hook of conftest's ``backend`` fixture."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dsec.backends.base import Capability
from dsec.errors import InvalidSpec
from dsec.spec import NetRule, NetworkPolicy, Stage

from .conftest import BackendHarness, Kind, wait_until

pytestmark = [pytest.mark.root, pytest.mark.timeout(120), pytest.mark.requires(Capability.NETWORK)]

_NET = 10 + secrets.randbelow(240)
HOST_SIDE_IP = f"10.199.{_NET}.1"
REMOTE_IP = f"10.199.{_NET}.2"
"""The remote namespace's /30 (outside 10.213-10.254, where sandbox subnets are picked)."""

PERMISSIONS = {
    "cf-web": {"cidrs": [f"{REMOTE_IP}/32"], "ports": ["8080"]},
    "cf-other": {"cidrs": [f"{REMOTE_IP}/32"], "ports": ["9090"]},
    "cf-hold": {"cidrs": [f"{REMOTE_IP}/32"], "ports": ["7000"]},
}


def configure(kind: Kind) -> Any:
    """The kind's config with named permissions for the remote host. A backend that declares
    ``network`` takes them in a ``network`` section of its config (``NetworkConfig``: subnet,
    permissions, pool...); one that does not is started as is (its cases skip)."""
    if not kind.declares(Capability.NETWORK):
        return kind.config
    fields = type(kind.config).model_fields
    assert "network" in fields, (f"backend {kind.name} declares network but its config has no 'network' "
                                 "section: teach tests/conformance/test_network.py::configure where its named "
                                 "permissions go")
    return kind.config.model_validate({**kind.config.model_dump(), "network": {
        "subnet": "auto", "pool_size": 1, "permissions": PERMISSIONS}})


@pytest.fixture(scope="module")
def remote(backend_kind: Kind) -> Iterator[str]:
    if not backend_kind.declares(Capability.NETWORK):
        pytest.skip(f"backend {backend_kind.name} does not declare network")
    from conftest import SESSION_TOKEN, remote_host  # tests/conftest.py

    with remote_host(f"dsec-cfnet-{SESSION_TOKEN}", f"dcfn{SESSION_TOKEN}", HOST_SIDE_IP, REMOTE_IP) as ip:
        yield ip


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP server on every host address, as the edge and the control plane listen."""
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(8)
    s.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                c, _ = s.accept()
            except OSError:
                continue
            c.sendall(b"HTTP/1.0 200 OK\r\n\r\nHOST-REACHED")
            c.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield int(s.getsockname()[1])
    finally:
        stop.set()
        t.join()
        s.close()


def _policy(*allow: str, rules: tuple[NetRule, ...] = ()) -> NetworkPolicy:
    return NetworkPolicy(allow=allow, rules=rules)


def _get(backend: BackendHarness, sid: str, host: str, port: int) -> str | None:
    """An HTTP GET from inside the sandbox (busybox nc): the answer's body, None if refused."""
    r = backend.sh(sid, f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port}", timeout=20)
    out = r.stdout.decode(errors="replace")
    if r.exit_code == 0 and " 200 " in out:
        return out.rsplit("\r\n\r\n", 1)[-1]
    return None


def _listen(backend: BackendHarness, sid: str, port: int, word: str) -> None:
    """A server in the sandbox answering ``word`` on ``port``, once it answers on loopback."""
    backend.ok(sid, f"(setsid sh -c 'while :; do nc -l -p {port} -e echo {word}; done' </dev/null >/dev/null 2>&1 &)")
    assert wait_until(lambda: word in backend.sh(sid, f"nc -w 3 127.0.0.1 {port} </dev/null").stdout.decode(),
                      timeout=10), f"nothing listens on {port} in {sid}"


def _with(backend: BackendHarness, policy: NetworkPolicy | None) -> Any:
    return backend.sandbox(spec=backend.spec().model_copy(update={"network": policy}))


def test_loopback_only_without_a_policy(backend: BackendHarness, remote: str) -> None:
    with _with(backend, None) as sb:
        assert backend.impl.network_info(sb.id) is None and sb.current_policy() is None
        assert _get(backend, sb.id, remote, 8080) is None
        _listen(backend, sb.id, 7777, "LOOP")  # loopback works


def test_a_named_permission_opens_exactly_its_destination(backend: BackendHarness, remote: str) -> None:
    with _with(backend, _policy("cf-web")) as sb:
        assert _get(backend, sb.id, remote, 8080) == "remote-8080"
        assert _get(backend, sb.id, remote, 9090) is None  # same host, another port
        info = backend.impl.network_info(sb.id)
        assert info is not None and info["ip"], info
        assert backend.impl.get(sb.id).current_policy() == _policy("cf-web")
        grown = backend.run(backend.impl.collect_denied())
        assert grown.get(sb.id, 0) >= 1, grown  # the refused attempt was counted
        assert backend.impl.network_info(sb.id)["denied_packets"] >= 1


def test_set_policy_switches_at_once_and_cuts_what_it_forbids(backend: BackendHarness, remote: str) -> None:
    with _with(backend, _policy("cf-web", "cf-hold")) as sb:
        # nc's stdin stays open (a FIFO a sleeper holds): only a cut connection ends it
        backend.ok(sb.id, "mkfifo /tmp/in")
        backend.ok(sb.id, f"setsid sh -c 'sleep 600 > /tmp/in & nc {remote} 7000 < /tmp/in > /tmp/held; "
                          "echo ended > /tmp/ended' </dev/null >/dev/null 2>&1 &")
        assert wait_until(lambda: "hello" in backend.ok(sb.id, "cat /tmp/held 2>/dev/null || true"), 10)
        time.sleep(1.0)
        assert "ended" not in backend.ok(sb.id, "cat /tmp/ended 2>/dev/null || true")  # held, until the cut
        rec = backend.run(backend.impl.set_policy(sb.id, _policy("cf-other")))
        assert rec.current_policy() == _policy("cf-other")
        # the held connection is cut (a new policy must not leave the old one's connections open)
        assert wait_until(lambda: "ended" in backend.ok(sb.id, "cat /tmp/ended 2>/dev/null || true"), 10)
        assert _get(backend, sb.id, remote, 9090) == "remote-9090"
        assert _get(backend, sb.id, remote, 8080) is None
        backend.run(backend.impl.set_policy(sb.id, None))
        assert _get(backend, sb.id, remote, 9090) is None
        assert backend.impl.get(sb.id).current_policy() is None


def test_a_loopback_sandbox_gets_a_network_later(backend: BackendHarness, remote: str) -> None:
    with _with(backend, None) as sb:
        assert _get(backend, sb.id, remote, 8080) is None
        backend.run(backend.impl.set_policy(sb.id, _policy("cf-web")))
        assert _get(backend, sb.id, remote, 8080) == "remote-8080"


def test_never_reachable_whatever_the_policy(backend: BackendHarness, remote: str, host_server: int) -> None:
    everything = (NetRule(cidr="0.0.0.0/0", protocol="any"),)
    with _with(backend, _policy(rules=everything)) as a, _with(backend, _policy(rules=everything)) as b:
        assert _get(backend, a.id, remote, 8080) == "remote-8080"  # the open Internet's stand-in: yes
        info = backend.impl.network_info(a.id)
        assert info is not None
        for addr in {HOST_SIDE_IP, str(info["gateway"])}:  # the host, by any of its addresses: never
            assert _get(backend, a.id, addr, host_server) is None, addr
        assert _get(backend, a.id, "169.254.169.254", 80) is None  # metadata: never
        # another sandbox: never
        _listen(backend, b.id, 5555, "SIBLING")
        sibling = backend.impl.network_info(b.id)
        assert sibling is not None
        r = backend.sh(a.id, f"nc -w 3 {sibling['ip']} 5555 </dev/null", timeout=20)
        assert b"SIBLING" not in r.stdout, r


def test_root_inside_cannot_widen_its_network(backend: BackendHarness, remote: str) -> None:
    with _with(backend, _policy("cf-web")) as sb:
        for cmd in ("nft flush ruleset", "ip route add 10.0.0.0/8 dev eth0", "ifconfig eth0 down",
                    "echo 1 > /proc/sys/net/ipv4/ip_forward"):
            backend.sh(sb.id, cmd)
        assert _get(backend, sb.id, remote, 8080) == "remote-8080"
        assert _get(backend, sb.id, remote, 9090) is None


def test_an_unknown_permission_is_invalid_and_changes_nothing(backend: BackendHarness, remote: str) -> None:
    before = {r.id for r in backend.impl.list()}
    with pytest.raises(InvalidSpec):
        backend.create(spec=backend.spec().model_copy(update={"network": _policy("no-such-permission")}))
    assert {r.id for r in backend.impl.list()} == before
    with _with(backend, _policy("cf-web")) as sb:
        with pytest.raises(InvalidSpec):
            backend.run(backend.impl.set_policy(sb.id, _policy("no-such-permission")))
        assert _get(backend, sb.id, remote, 8080) == "remote-8080"  # the old policy still holds


@pytest.mark.requires(Capability.STAGES)
def test_a_stages_policy_comes_with_the_stage(backend: BackendHarness, remote: str) -> None:
    spec = backend.spec().model_copy(update={"stage": "setup", "stages": {
        "setup": Stage(network=_policy("cf-web")), "rollout": Stage(), "other": Stage(network=_policy("cf-other"))}})
    with backend.sandbox(spec=spec) as sb:
        assert _get(backend, sb.id, remote, 8080) == "remote-8080"
        backend.run(backend.impl.set_stage(sb.id, "rollout"))  # no network in this stage
        assert _get(backend, sb.id, remote, 8080) is None
        backend.run(backend.impl.set_stage(sb.id, "other"))
        assert (_get(backend, sb.id, remote, 9090), _get(backend, sb.id, remote, 8080)) == ("remote-9090", None)


@pytest.mark.requires(Capability.FORK)
def test_fork_children_start_with_the_policy_in_force(backend: BackendHarness, remote: str) -> None:
    with _with(backend, None) as sb:
        backend.run(backend.impl.set_policy(sb.id, _policy("cf-other")))
        kids = backend.run(backend.impl.fork(sb.id, 1))
        for c in kids:
            backend.track(c.id)
        try:
            (kid,) = kids
            assert _get(backend, kid.id, remote, 9090) == "remote-9090"
            assert _get(backend, kid.id, remote, 8080) is None
            assert backend.impl.network_info(kid.id)["ip"] != backend.impl.network_info(sb.id)["ip"]
        finally:
            for c in kids:
                backend.run(backend.impl.destroy(c.id))
