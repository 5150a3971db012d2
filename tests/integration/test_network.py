"""Sandbox networks on the real kernel: veth, nftables inside the sandbox's namespace,
named permissions, atomic policy changes and what stays blocked whatever the policy.

A "remote host" is a network namespace with a veth to the host and HTTP/TCP
servers in it; the host routes between it and the sandboxes like a real router.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from conftest import RuntimeHarness, remote_host, wait_until

pytestmark = pytest.mark.root

REMOTE_NS = "dsec-test-remote"
REMOTE_IP = "10.214.0.2"
HOST_SIDE_IP = "10.214.0.1"
REMOTE_LINK = "dtr-remote0"  # not "dsec-*": that prefix means "a sandbox's link" to the host rules



@pytest.fixture(scope="module")
def remote() -> Iterator[str]:
    with remote_host(REMOTE_NS, REMOTE_LINK, HOST_SIDE_IP, REMOTE_IP) as ip:
        yield ip


@pytest.fixture(scope="module")
def nrt(make_runtime: Callable[[str], RuntimeHarness], remote: str) -> Iterator[RuntimeHarness]:
    from dsec.backends.common.network import NetworkConfig, Permission
    from dsec.backends.container.runtime import ContainerRuntime

    h = make_runtime("net").prepare()
    cfg = NetworkConfig(
        subnet="10.213.0.0/20",
        pool_size=2,
        permissions={
            "remote-web": Permission(cidrs=(f"{remote}/32",), ports=("8080",)),
            "remote-hold": Permission(cidrs=(f"{remote}/32",), ports=("7000",)),
            "byname": Permission(hosts=("remote.dsec.test",), ports=("9090",)),
            "loopy": Permission(hosts=("localhost",)),
        },
    )
    h.rt = ContainerRuntime(name=h.name, state_dir=h.state_dir, run_dir=h.run_dir, network=cfg)
    names = {"remote.dsec.test": [remote]}
    from dsec.backends.common.network import _resolve_v4

    # remote.dsec.test stands in for a DNS name (this machine has no DNS server to change)
    h.rt.net._resolver = lambda host: names[host] if host in names else _resolve_v4(host)
    h.names = names  # type: ignore[attr-defined]
    h.start()
    try:
        yield h
    finally:
        h.close()


def _spec(h: RuntimeHarness, **policy: Any) -> Any:
    from dsec.spec import NetworkPolicy

    return h.spec().model_copy(update={"network": NetworkPolicy(**policy)})


def _create(h: RuntimeHarness, **policy: Any) -> Any:
    return h.run(h.rt.create(_spec(h, **policy)))


def _fetch(h: RuntimeHarness, sid: str, url: str) -> tuple[int | None, str]:
    """GET ``url`` from inside (busybox nc: the seed's static wget needs NSS files it lacks)."""
    hostport = url.split("//", 1)[1].split("/", 1)[0]
    host, _, port = hostport.partition(":")
    r = h.sh(sid, f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port or 80}", timeout=20)
    out = r.stdout.decode() + r.stderr.decode()
    ok = r.exit_code == 0 and " 200 " in out
    return (0 if ok else 1), out


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP server on every host address (as the edge or control plane would listen)."""
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(8)
    port = s.getsockname()[1]
    stop = threading.Event()

    def accept() -> None:
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = s.accept()
                c.sendall(b"HTTP/1.0 200 OK\r\n\r\nHOST-REACHED")
                c.close()
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield port
    stop.set()
    t.join()
    s.close()


def test_default_is_loopback_only(nrt: RuntimeHarness, remote: str) -> None:
    with nrt.sandbox() as rec:
        assert rec.net is None
        links = nrt.ok(rec.id, "ls /sys/class/net 2>/dev/null; cat /proc/net/dev")
        assert "eth0" not in links
        code, _ = _fetch(nrt, rec.id, f"http://{remote}:8080/")
        assert code != 0


def test_named_permission_admits_only_its_port(nrt: RuntimeHarness, remote: str) -> None:
    rec = _create(nrt, allow=("remote-web",))
    try:
        assert rec.net and rec.net["ip"].startswith("10.213.")
        code, out = _fetch(nrt, rec.id, f"http://{remote}:8080/")
        assert code == 0 and "remote-8080" in out, out
        code, out = _fetch(nrt, rec.id, f"http://{remote}:9090/")
        assert code != 0 and "remote-9090" not in out
        # Refused at once (TCP reset), not after a timeout.
        t0 = time.monotonic()
        r = nrt.sh(rec.id, f"nc -w 5 {remote} 9090 </dev/null", timeout=20)
        assert r.exit_code != 0 and time.monotonic() - t0 < 4, r
    finally:
        nrt.destroy(rec.id)


def test_raw_rule_and_host_name_permission(nrt: RuntimeHarness, remote: str) -> None:
    from dsec.spec import NetRule

    rec = _create(nrt, allow=("byname",))
    try:
        code, out = _fetch(nrt, rec.id, f"http://{remote}:9090/")
        assert code == 0 and "remote-9090" in out, out
        assert _fetch(nrt, rec.id, f"http://{remote}:8080/")[0] != 0
        nrt.run(nrt.rt.set_policy(rec.id, _spec(nrt, rules=(NetRule(cidr=f"{remote}/32", ports=("8000-8100",)),)).network))
        assert _fetch(nrt, rec.id, f"http://{remote}:8080/")[0] == 0
        assert _fetch(nrt, rec.id, f"http://{remote}:9090/")[0] != 0
    finally:
        nrt.destroy(rec.id)


def test_never_reachable_whatever_the_policy(nrt: RuntimeHarness, remote: str, host_server: int) -> None:
    from dsec.spec import NetRule

    everything = (NetRule(cidr="0.0.0.0/0", protocol="any"),)
    a = _create(nrt, rules=everything, allow=("loopy",))
    b = _create(nrt, rules=everything)
    try:
        # the open internet stand-in is reachable with a wide-open policy
        assert _fetch(nrt, a.id, f"http://{remote}:8080/")[0] == 0
        # ... the host is not, by any of its addresses (edge/control plane listen there)
        for addr in (HOST_SIDE_IP, "127.0.0.1", nrt.rt.net.gateway):
            code, out = _fetch(nrt, a.id, f"http://{addr}:{host_server}/")
            assert code != 0 and "HOST-REACHED" not in out, addr
        # ... nor metadata / link-local
        assert _fetch(nrt, a.id, "http://169.254.169.254/")[0] != 0
        # ... nor another sandbox
        nrt.ok(b.id, "setsid nc -l -p 5555 -e echo SIBLING </dev/null >/dev/null 2>&1 &")
        time.sleep(0.2)
        r = nrt.sh(a.id, f"nc -w 3 {b.net['ip']} 5555 </dev/null", timeout=20)
        assert "SIBLING" not in r.stdout.decode()
    finally:
        nrt.destroy(a.id)
        nrt.destroy(b.id)


def test_root_inside_cannot_change_the_network(nrt: RuntimeHarness, remote: str) -> None:
    rec = _create(nrt, allow=("remote-web",))
    try:
        routes = nrt.ok(rec.id, "cat /proc/net/route")
        for cmd in ("ip link set eth0 down", "ip addr add 10.99.0.9/32 dev eth0", "ip route add 10.214.0.0/16 dev eth0",
                    "ifconfig eth0 down", "route del default", "echo 1 > /proc/sys/net/ipv4/ip_forward"):
            assert nrt.sh(rec.id, cmd).exit_code != 0, cmd
        assert nrt.ok(rec.id, "cat /proc/net/route") == routes
        assert _fetch(nrt, rec.id, f"http://{remote}:8080/")[0] == 0
        assert _fetch(nrt, rec.id, f"http://{remote}:9090/")[0] != 0
    finally:
        nrt.destroy(rec.id)


def test_set_policy_cuts_established_connections(nrt: RuntimeHarness, remote: str) -> None:
    rec = _create(nrt, allow=("remote-hold", "remote-web"))
    try:
        nrt.ok(rec.id, f"setsid sh -c 'nc {remote} 7000 > /tmp/held; echo done > /tmp/ended' </dev/null >/dev/null 2>&1 &")
        assert wait_until(lambda: "hello" in nrt.ok(rec.id, "cat /tmp/held 2>/dev/null || true"), 10)
        from dsec.spec import NetworkPolicy

        nrt.run(nrt.rt.set_policy(rec.id, NetworkPolicy(allow=("remote-web",))))
        assert wait_until(lambda: "done" in nrt.ok(rec.id, "cat /tmp/ended 2>/dev/null || true"), 10)
        ev = [e for e in nrt.rt.events(rec.id) if e["event"] == "policy_changed"]
        assert ev and ev[-1]["connections_cut"] >= 1
        assert _fetch(nrt, rec.id, f"http://{remote}:8080/")[0] == 0  # still allowed
    finally:
        nrt.destroy(rec.id)


def test_loopback_sandbox_gets_network_later_and_loses_it(nrt: RuntimeHarness, remote: str) -> None:
    from dsec.spec import NetworkPolicy

    with nrt.sandbox() as rec:
        assert _fetch(nrt, rec.id, f"http://{remote}:8080/")[0] != 0
        nrt.run(nrt.rt.set_policy(rec.id, NetworkPolicy(allow=("remote-web",))))
        assert _fetch(nrt, rec.id, f"http://{remote}:8080/")[0] == 0
        nrt.run(nrt.rt.set_policy(rec.id, None))
        assert _fetch(nrt, rec.id, f"http://{remote}:8080/")[0] != 0
        info = nrt.rt.network_info(rec.id)
        assert info is not None and info["policy"] is None


def test_unknown_permission_is_typed_and_leaves_nothing(nrt: RuntimeHarness) -> None:
    from dsec.errors import InvalidSpec

    before_links, before = _links(), set(nrt.rt.sandboxes)
    used = set(nrt.rt.net._used)
    with pytest.raises(InvalidSpec, match=r"unknown network permission.*nope.*remote-web"):
        _create(nrt, allow=("nope",))
    assert set(nrt.rt.sandboxes) == before
    assert nrt.rt.net._used == used
    assert {x for x in _links() - before_links if not x.startswith(nrt.rt.net.link_prefix)} == set()
    with nrt.sandbox() as rec, pytest.raises(InvalidSpec):
        from dsec.spec import NetworkPolicy

        nrt.run(nrt.rt.set_policy(rec.id, NetworkPolicy(allow=("nope",))))


def test_denied_attempts_are_counted_and_logged(nrt: RuntimeHarness, remote: str) -> None:
    rec = _create(nrt, allow=("remote-web",))
    try:
        nrt.run(nrt.rt.collect_denied())
        for port in (22, 9090, 7000):
            nrt.sh(rec.id, f"nc -w 1 {remote} {port} </dev/null", timeout=10)
        grown = nrt.run(nrt.rt.collect_denied())
        assert grown.get(rec.id, 0) >= 3
        ev = [e for e in nrt.rt.events(rec.id) if e["event"] == "net_denied"]
        assert ev and any(f"{remote}:9090" in d for d in ev[-1]["destinations"]), ev
        info = nrt.rt.network_info(rec.id)
        assert info is not None and info["denied_packets"] >= 3
        assert nrt.run(nrt.rt.collect_denied()).get(rec.id, 0) == 0  # nothing new
    finally:
        nrt.destroy(rec.id)


def test_reresolve_updates_running_sandboxes(nrt: RuntimeHarness, remote: str) -> None:
    rec = _create(nrt, allow=("byname",))
    try:
        assert _fetch(nrt, rec.id, f"http://{remote}:9090/")[0] == 0
        nrt.names["remote.dsec.test"] = ["10.214.0.99"]  # type: ignore[attr-defined]

        def netns(sid: str) -> int | None:
            return nrt.rt.netns_fd(sid)

        updated = nrt.run(nrt.rt.net.reresolve(netns))
        assert rec.id in updated
        assert _fetch(nrt, rec.id, f"http://{remote}:9090/")[0] != 0
    finally:
        nrt.names["remote.dsec.test"] = [remote]  # type: ignore[attr-defined]
        nrt.run(nrt.rt.net.reresolve())
        nrt.destroy(rec.id)


def test_policy_on_paused_sandbox_and_links_go_with_the_sandbox(nrt: RuntimeHarness, remote: str) -> None:
    from dsec.spec import NetworkPolicy

    rec = _create(nrt, allow=("remote-web",))
    link = rec.net["ifname"]
    try:
        assert link in _links()
        nrt.run(nrt.rt.pause(rec.id, reclaim=False))
        nrt.run(nrt.rt.set_policy(rec.id, NetworkPolicy(allow=("byname",))))
        assert nrt.rt.get(rec.id).state.value == "paused"
        assert _fetch(nrt, rec.id, f"http://{remote}:9090/")[0] == 0  # exec resumes it
    finally:
        nrt.destroy(rec.id)
    # its namespace is recycled into the pool (veth kept) or gone with it, nothing else
    def settled() -> bool:
        nrt.run(asyncio.sleep(0.05))  # the recycling reset runs on the runtime's loop
        return link not in _links() or link in {x.ifname for x in nrt.rt.net._pool}

    assert wait_until(settled, 10), f"the sandbox's veth outlived it outside the pool ({nrt.rt.net._pool})"


def test_network_survives_runtime_restart(nrt: RuntimeHarness, remote: str) -> None:
    from dsec.spec import NetworkPolicy

    rec = _create(nrt, allow=("remote-web",))
    try:
        nrt.run(nrt.rt.close(destroy_all=False))
        nrt.run(nrt.rt.start())
        again = nrt.rt.get(rec.id)
        assert again.net is not None and again.net["ip"] == rec.net["ip"]
        assert _fetch(nrt, rec.id, f"http://{remote}:8080/")[0] == 0
        nrt.run(nrt.rt.set_policy(rec.id, NetworkPolicy(allow=("byname",))))
        assert _fetch(nrt, rec.id, f"http://{remote}:8080/")[0] != 0
        other = _create(nrt, allow=("remote-web",))
        assert other.net["ip"] != rec.net["ip"]
        nrt.destroy(other.id)
    finally:
        nrt.destroy(rec.id)


def test_fork_children_get_the_parents_current_policy(nrt: RuntimeHarness, remote: str) -> None:
    from dsec.spec import NetworkPolicy

    rec = _create(nrt, allow=("remote-web",))
    kids: list[Any] = []
    try:
        nrt.run(nrt.rt.set_policy(rec.id, NetworkPolicy(allow=("byname",))))
        kids = nrt.run(nrt.rt.fork(rec.id, 2))
        ips = {k.net["ip"] for k in kids} | {rec.net["ip"]}
        assert len(ips) == 3  # each child has its own address
        for k in kids:
            assert _fetch(nrt, k.id, f"http://{remote}:9090/")[0] == 0
            assert _fetch(nrt, k.id, f"http://{remote}:8080/")[0] != 0
    finally:
        for k in kids:
            nrt.destroy(k.id)
        nrt.destroy(rec.id)


def test_two_runtimes_on_one_host_never_collide(nrt: RuntimeHarness, make_runtime: Callable[[str], RuntimeHarness],
                                                remote: str) -> None:
    from dsec.backends.common.network import NetworkConfig, Permission
    from dsec.backends.container.runtime import ContainerRuntime

    other = make_runtime("net2").prepare()
    other.rt = ContainerRuntime(name=other.name, state_dir=other.state_dir, run_dir=other.run_dir,
                                network=NetworkConfig(subnet="10.213.0.0/20", pool_size=1, permissions={
                                    "remote-web": Permission(cidrs=(f"{remote}/32",), ports=("8080",))}))
    other.start()
    mine = _create(nrt, allow=("remote-web",))
    theirs: Any = None
    try:
        theirs = _create(other, allow=("remote-web",))
        assert theirs.net["ip"] != mine.net["ip"]
        assert theirs.net["ifname"] != mine.net["ifname"]
        assert nrt.rt.net.host_table != other.rt.net.host_table
        for h, rec in ((nrt, mine), (other, theirs)):
            assert _fetch(h, rec.id, f"http://{remote}:8080/")[0] == 0
        # sandboxes of different runtimes cannot reach each other either
        other.ok(theirs.id, "setsid nc -l -p 5556 -e echo CROSS </dev/null >/dev/null 2>&1 &")
        time.sleep(0.2)
        r = nrt.sh(mine.id, f"nc -w 3 {theirs.net['ip']} 5556 </dev/null", timeout=20)
        assert "CROSS" not in r.stdout.decode()
    finally:
        if theirs is not None:
            other.destroy(theirs.id)
        other.close()
        nrt.destroy(mine.id)
    # closing the other runtime removed its host tables only
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert other.rt.net.host_table not in tables and nrt.rt.net.host_table in tables
    again = _create(nrt, allow=("remote-web",))
    try:
        assert _fetch(nrt, again.id, f"http://{remote}:8080/")[0] == 0
    finally:
        nrt.destroy(again.id)


def test_destroyed_sandbox_namespace_is_recycled_clean(nrt: RuntimeHarness, remote: str) -> None:
    net = nrt.rt.net
    a = _create(nrt, allow=("remote-web",))
    link = a.net["ifname"]
    nrt.sh(a.id, f"nc -w 1 {remote} 22 </dev/null", timeout=10)  # a denied attempt, counted
    nrt.run(nrt.rt.collect_denied())
    recycled = net.recycled
    while net._pool:  # make room: a full pool lets a destroyed namespace go instead
        net._drop(net._pool.popleft())
    nrt.destroy(a.id)
    for _ in range(100):  # the reset runs in the background on the runtime's loop
        if net.recycled > recycled:
            break
        nrt.run(asyncio.sleep(0.02))
    assert net.recycled > recycled
    # a later sandbox may get that very namespace: it must start from nothing
    seen: list[Any] = []
    try:
        for _ in range(4):
            b = _create(nrt, allow=("byname",))
            seen.append(b)
            if b.net["ifname"] == link:
                break
        b = next((x for x in seen if x.net["ifname"] == link), None)
        assert b is not None, "the recycled namespace was not reused"
        assert _fetch(nrt, b.id, f"http://{remote}:9090/")[0] == 0
        assert _fetch(nrt, b.id, f"http://{remote}:8080/")[0] != 0  # the old policy is gone
        nrt.run(nrt.rt.collect_denied())
        info = nrt.rt.network_info(b.id)
        assert info is not None and info["denied_packets"] == 1 and not any(":22/" in d for d in info["denied_recent"])
    finally:
        for x in seen:
            nrt.destroy(x.id)


def test_a_table_wired_before_the_forward_chain_still_switches_policies(nrt: RuntimeHarness, remote: str) -> None:
    """A sandbox adopted from an older edge has no ``forward`` chain in its table (it came with
    the microVM's network): its first policy switch adds the chain, once, and works."""
    from dsec.backends.common import netfilter
    from dsec.spec import NetworkPolicy

    rec = _create(nrt, allow=("remote-web",))
    try:
        fd = nrt.rt.netns_fd(rec.id)
        assert fd is not None
        try:
            netfilter.in_netns(fd, lambda: netfilter.nft("flush chain inet dsec forward\ndelete chain inet dsec forward"))
            assert "chain forward" not in netfilter.in_netns(fd, lambda: netfilter.nft("list table inet dsec"))
            nrt.run(nrt.rt.set_policy(rec.id, NetworkPolicy(allow=("remote-hold", "remote-web"))))
            assert "chain forward" in netfilter.in_netns(fd, lambda: netfilter.nft("list table inet dsec"))
        finally:
            os.close(fd)
        code, out = _fetch(nrt, rec.id, f"http://{remote}:8080/")
        assert code == 0 and "remote-8080" in out, out
    finally:
        nrt.destroy(rec.id)
