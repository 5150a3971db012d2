"""Host-wide claims (:mod:`dsec.backends.common.claims`) with real flock on real files:
names, network tags and subnets two instances must never share, and how a holder's death
frees them. No root needed (the claims live in a temporary directory)."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.backends.common import claims
from dsec.errors import HostError


def test_a_runtime_name_is_held_once_and_freed_with_its_holder(tmp_path: Path) -> None:
    first = claims.claim_runtime(tmp_path, "up-1a2b3c4d-e1")
    try:
        with pytest.raises(HostError) as err:
            claims.claim_runtime(tmp_path, "up-1a2b3c4d-e1")
        msg = str(err.value)
        assert "runtime name 'up-1a2b3c4d-e1' is in use by another process" in msg
        assert f"pid {os.getpid()}" in msg and "--node-name" in msg and "\n" not in msg
        other = claims.claim_runtime(tmp_path, "up-99999999-e1")  # another name: fine
        for c in other:
            c.release()
    finally:
        for c in first:
            c.release()
    again = claims.claim_runtime(tmp_path, "up-1a2b3c4d-e1")
    for c in again:
        c.release()
    assert list(tmp_path.iterdir()) == []  # released claims leave no file behind


def test_a_locker_that_lost_a_race_with_a_release_takes_the_new_file(tmp_path: Path) -> None:
    """A's release unlinks the file it holds; B, which opened that file just before, must not
    keep a lock on the unlinked one while C locks a new file at the path."""
    import fcntl

    a = claims.try_claim(tmp_path / "runtime-x", "a")
    assert a is not None
    stale = os.open(tmp_path / "runtime-x", os.O_RDWR)  # B opened it...
    a.release()  # ...A unlinks and lets go...
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ...B's lock now succeeds on the dead file
    c = claims.try_claim(tmp_path / "runtime-x", "c")
    assert c is not None and c.intact()  # C holds the path's file; B's is not it
    assert os.fstat(stale).st_nlink == 0
    os.close(stale)
    c.release()


def test_two_names_with_one_network_tag_are_refused(tmp_path: Path) -> None:
    """The tag in link and table names has 16 bits: two names may share it, and then the
    second runtime is refused instead of replacing the first one's host tables."""
    seen: dict[str, str] = {}
    pair = None
    for i in range(100000):
        name = f"n{i}"
        tag = claims.net_tag(name)
        if tag in seen:
            pair = (seen[tag], name)
            break
        seen[tag] = name
    assert pair is not None
    held = claims.claim_runtime(tmp_path, pair[0])
    try:
        with pytest.raises(HostError, match=f"network tag {claims.net_tag(pair[0])} of '{pair[1]}' is in use"):
            claims.claim_runtime(tmp_path, pair[1])
        assert not (tmp_path / f"runtime-{pair[1]}").exists()  # the refused one let its name go
    finally:
        for c in held:
            c.release()


def test_a_dead_holder_frees_its_claim(tmp_path: Path) -> None:
    code = ("import sys, time; from pathlib import Path; from dsec.backends.common import claims; "
            "claims.claim_runtime(Path(sys.argv[1]), 'crashy'); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(HostError, match=f"crashy pid {proc.pid}"):
            claims.claim_runtime(tmp_path, "crashy")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    for c in claims.claim_runtime(tmp_path, "crashy"):  # nothing to clean up after a crash
        c.release()


def test_auto_subnets_differ_between_instances_and_avoid_host_routes(tmp_path: Path) -> None:
    routes = [(ipaddress.IPv4Network("10.224.0.0/16"), "eth0"), (ipaddress.IPv4Network("10.225.4.0/24"), "wg0")]
    got = []
    held = []
    try:
        for owner in ("up-a-e1", "up-b-e1", "up-c-e1"):
            cidr, claim = claims.pick_subnet(tmp_path, owner, own_links="dsec-ffff", routes=routes)
            assert claim is not None
            held.append(claim)
            net = ipaddress.IPv4Network(cidr)
            assert net in claims.AUTO_CANDIDATES
            assert not any(net.overlaps(r) for r, _ in routes), cidr
            got.append(cidr)
        assert len(set(got)) == 3, got
        # The same owner starts from the same place, and takes back its subnet after a restart.
        held[0].release()
        again, claim = claims.pick_subnet(tmp_path, "up-a-e1", own_links="dsec-ffff", routes=routes)
        assert again == got[0] and claim is not None
        held[0] = claim
        # A survivor's address (a sandbox kept across a restart) wins over the start place.
        held[1].release()
        kept, claim = claims.pick_subnet(tmp_path, "up-z-e1", own_links="dsec-ffff", routes=routes,
                                         keep=[str(ipaddress.IPv4Network(got[1]).network_address + 7)])
        assert kept == got[1] and claim is not None
        held[1] = claim
        # Our own sandboxes' /32 routes (on our links) do not make our subnet look taken.
        mine = [(ipaddress.IPv4Network(f"{ipaddress.IPv4Network(got[2]).network_address + 9}/32"), "dsec-ffff00009")]
        held[2].release()
        own, claim = claims.pick_subnet(tmp_path, "up-c-e1", own_links="dsec-ffff", routes=routes + mine)
        assert own == got[2] and claim is not None
        held[2] = claim
    finally:
        for c in held:
            c.release()


def test_configured_subnets_share_and_an_auto_one_is_refused_to_them(tmp_path: Path) -> None:
    a = claims.claim_subnet(tmp_path, "10.213.0.0/20", "edge-e1")
    b = claims.claim_subnet(tmp_path, "10.213.0.0/20", "edge-e2")  # configured alike: shared
    auto, claim = claims.pick_subnet(tmp_path, "up-x-e1", own_links="dsec-0000", routes=[])
    try:
        assert claim is not None
        with pytest.raises(HostError, match=f"network.subnet {auto} is in use by another DSec instance"):
            claims.claim_subnet(tmp_path, auto, "edge-e3")
        inside = str(next(ipaddress.IPv4Network(auto).subnets(new_prefix=24)))
        with pytest.raises(HostError, match=f"overlaps {auto}, which another DSec instance"):
            claims.claim_subnet(tmp_path, inside, "edge-e4")
    finally:
        for c in (a, b, claim):
            c.release()
    assert list(tmp_path.iterdir()) == []  # the last sharer removed the shared claim's file too


def test_no_free_auto_subnet_is_one_line_saying_what_to_do(tmp_path: Path) -> None:
    everything = [(next(c.subnets(new_prefix=24)), "eth1") for c in claims.AUTO_CANDIDATES]  # a LAN in each
    with pytest.raises(HostError) as err:
        claims.pick_subnet(tmp_path, "up-x-e1", own_links="dsec-0000", routes=everything)
    assert "set network.subnet to a free range" in str(err.value) and "\n" not in str(err.value)
    # Only a broader route (a VPN's 10.0.0.0/8) covers them: taken, since nothing else is free.
    cidr, claim = claims.pick_subnet(tmp_path, "up-x-e1", own_links="dsec-0000",
                                     routes=[(ipaddress.IPv4Network("10.0.0.0/8"), "tun0")])
    assert claim is not None and ipaddress.IPv4Network(cidr) in claims.AUTO_CANDIDATES
    claim.release()


def test_host_routes_are_read_from_the_kernel_table(tmp_path: Path) -> None:
    table = tmp_path / "route"
    table.write_text(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        "eth0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
        "dsec-ab1200001\t010DD50A\t00000000\t0005\t0\t0\t0\tFFFFFFFF\t0\t0\t0\n")
    assert claims.host_routes(table) == [(ipaddress.IPv4Network("192.168.0.0/24"), "eth0"),
                                         (ipaddress.IPv4Network("10.213.13.1/32"), "dsec-ab1200001")]
    assert claims.host_routes(tmp_path / "absent") == []


def test_the_files_of_killed_holders_are_swept_by_the_next_runtime_and_held_ones_stay(tmp_path: Path) -> None:
    code = ("import sys, time; from pathlib import Path; from dsec.backends.common import claims; "
            "claims.claim_runtime(Path(sys.argv[1]), sys.argv[2]); print('held', flush=True); time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), name], stdout=subprocess.PIPE, text=True)
             for name in ("killed-a", "alive-b")]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "held"
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        # SIGKILL lets no holder unlink its files: they stay, unlocked
        assert (tmp_path / "runtime-killed-a").exists()
        got = claims.claim_runtime(tmp_path, "third-c")
        left = sorted(os.listdir(tmp_path))
        assert "runtime-killed-a" not in left and f"nettag-{claims.net_tag('killed-a')}" not in left
        assert "runtime-alive-b" in left and "runtime-third-c" in left  # held ones stay
        with pytest.raises(HostError, match="alive-b"):
            claims.claim_runtime(tmp_path, "alive-b")
        for c in got:
            c.release()
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
