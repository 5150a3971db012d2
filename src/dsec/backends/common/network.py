"""Per-sandbox network: a veth into the sandbox's own namespace, nftables inside it.

Shape (docs/SECURITY.md, "Network"):

- A sandbox without a policy has a loopback-only namespace (the spawner's pool).
- A sandbox with a policy gets ``eth0`` (one /32 address from ``subnet``; default
  route through a link-local gateway whose neighbour entry is static), the host
  end ``dsec-<slot>`` with a /32 route back, and an nftables table ``inet dsec``
  *inside its own namespace* that drops by default. That namespace belongs to the
  host's user namespace, so root inside the sandbox cannot touch the rules.
- The policy is an allow-set of (address range . protocol . port range); changing
  it is one nftables transaction (atomic) followed by SOCK_DESTROY of established
  TCP connections the new policy forbids.
- Some destinations are refused whatever the policy says (the ``never`` set inside
  and the ``inet dsec_host_<tag>`` table on the host): other sandboxes, the host itself
  (which is where the edge and, in the all-in-one set-up, the control plane
  listen), link-local/metadata addresses, multicast, and configured ``blocked``
  ranges.
- Namespaces with veth, address and baseline rules are made ahead of time by a
  background thread (HOST-FACTS.md: veth creation alone costs milliseconds), so a
  create with a policy pays one set update (~0.3 ms) on the hot path.

Every host object is named ``dsec-…`` (links) or ``dsec_…`` (nftables tables):
a reconciler finds them by name. Namespaces are held by fds only: a crashed edge
leaves none behind, and a namespace's veth goes with it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import ipaddress
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.backends.common import claims, netfilter
from dsec.backends.common.claims import AUTO
from dsec.backends.common.netconfig import ALWAYS_BLOCKED, NetworkConfig, Permission
from dsec.backends.common.netmaker import NetMaker
from dsec.backends.common.netns import (
    FORWARD_CHAIN,
    GATEWAY,
    Element,
    SlotTaken,
    _host_ipv4_addrs,
    _resolve_v4,
    forward_gotos,
    generation_cmd,
    wire_netns,
)
from dsec.errors import HostError, InvalidSpec
from dsec.spec import NetworkPolicy

log = logging.getLogger("dsec.network")

LINK_PREFIX = "dsec-"
"""Every sandbox link on the host starts with it; a runtime's own add a 4-hex tag of its name."""
REFILL_DELAY_S = 0.25
"""How long the pool waits after a take before making namespaces (recycled ones come back first)."""
GC_AFTER = 32
"""Policy generations kept in a sandbox's table before the older ones are removed."""
# ----- rules -----

_GEN_NAME = re.compile(r"^[aio]([0-9]+)$")


def _expand(cidrs: Iterable[str], ports: Sequence[str], protocol: str) -> list[Element]:
    protos = ("tcp", "udp") if protocol == "any" else (protocol,)
    out: list[Element] = []
    for cidr in cidrs:
        for proto in protos:
            for p in ports or ("1-65535",):
                lo, _, hi = p.partition("-")
                out.append(Element(cidr, proto, f"{lo}-{hi}" if hi and hi != lo else lo))
    return out


@dataclass(slots=True)
class Lease:
    """One prepared namespace: an fd, its slot/address and host link."""

    fd: int
    slot: int
    ip: str
    ifname: str

    def info(self) -> dict[str, Any]:
        return {"slot": self.slot, "ip": self.ip, "ifname": self.ifname}


@dataclass(slots=True)
class _Resolved:
    addrs: tuple[str, ...]
    at: float


@dataclass(slots=True)
class NetState:
    """What the manager knows of one networked sandbox (rebuilt from records after a restart)."""

    sandbox_id: str
    slot: int
    ip: str
    ifname: str
    policy: NetworkPolicy | None
    elements: list[Element] = field(default_factory=list)
    names: tuple[str, ...] = ()
    denied_seen: int = 0
    denied_recent: list[str] = field(default_factory=list)
    gen: int = 0
    stale_gens: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class NetworkManager:
    """Network namespaces with veth and nftables for the sandboxes of one runtime."""

    def __init__(self, config: NetworkConfig | None = None, *, runtime: str = "default",
                 resolver: Callable[[str], Sequence[str]] | None = None, claims_dir: Path | None = None) -> None:
        """``runtime`` names the owner: host objects carry a tag of it (links
        ``dsec-<tag><slot>``, tables ``dsec_host_<tag>``/``dsec_nat_<tag>``), so several
        runtimes (edges) on one host never touch each other's (the runtime claims its tag
        host-wide). Addresses and link names are claimed from the kernel itself (a taken
        name or /32 route means "next slot"), which makes them unique across runtimes
        sharing a subnet. The subnet is claimed in ``claims_dir`` when the network starts:
        an ``"auto"`` one exclusively, a configured one shared (:mod:`claims`)."""
        self.config = config or NetworkConfig()
        self.runtime = runtime
        self.tag = claims.net_tag(runtime)
        self.link_prefix = f"{LINK_PREFIX}{self.tag}"
        self.host_table = f"dsec_host_{self.tag}"
        self.nat_table = f"dsec_nat_{self.tag}"
        self.claims_dir = claims_dir
        self._subnet_claim: claims.Claim | None = None
        self._net: ipaddress.IPv4Network | None = (
            None if self.config.subnet == AUTO else ipaddress.IPv4Network(self.config.subnet))
        self._resolver = resolver or _resolve_v4
        self._resolved: dict[str, _Resolved] = {}
        self._used: set[int] = set()
        # Released slots wait at the back: a dying namespace's link and route may
        # linger a moment (namespace teardown is asynchronous in the kernel).
        self._free: collections.deque[int] = collections.deque()
        self._next_slot = 1
        self._pool: collections.deque[Lease] = collections.deque()
        self._slot_lock = threading.Lock()
        self.sandboxes: dict[str, NetState] = {}
        self._fill_task: asyncio.Task[None] | None = None
        self._resolve_task: asyncio.Task[None] | None = None
        self._fill_wakeup: asyncio.Event | None = None
        # Generation numbers only grow, across restarts too (the clock seeds them), so
        # a re-adopted sandbox's existing chains are never reused by mistake.
        self._gen_seq = int(time.time() * 1000)
        self._gc_tasks: set[asyncio.Task[None]] = set()
        self._host_ready = False
        self._host_addrs: tuple[str, ...] = ()
        self._policy_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dsec-netpolicy")
        self._make_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsec-netmake")
        self._maker: NetMaker | None = None
        self._taken: list[int] = []
        self.host_tables_made = False
        """This manager put its tables on the host (the runtime removes them on a full close)."""
        self._recycling = 0
        self.recycled = 0
        self.open_netns: Callable[[str], int | None] | None = None
        """Gives a sandbox's netns fd (the runtime sets it): re-resolution re-applies through it."""
        self.started = False
        self.made = 0
        self.pool_misses = 0

    # ----- set-up -----

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        """The sandbox subnet in force (an ``"auto"`` one is chosen when the network starts)."""
        if self._net is None:
            raise HostError("the sandbox subnet is chosen when the network starts (network.subnet = \"auto\")")
        return self._net

    def _claim_subnet(self) -> None:
        """Claim the subnet host-wide (picking it first when it is ``"auto"``). Idempotent."""
        if self._subnet_claim is not None and self._subnet_claim.held:
            return
        if self.config.subnet == AUTO:
            keep = [st.ip for st in self.sandboxes.values()]  # re-adopted sandboxes keep theirs
            cidr, claim = claims.pick_subnet(self.claims_dir, self.runtime, own_links=self.link_prefix, keep=keep)
            self._net = ipaddress.IPv4Network(cidr)
            self._subnet_claim = claim
        elif self.claims_dir is not None:
            self._subnet_claim = claims.claim_subnet(self.claims_dir, self.config.subnet, self.runtime)

    @property
    def never(self) -> tuple[str, ...]:
        """Ranges refused whatever the policy: see the module docstring."""
        return (*ALWAYS_BLOCKED, str(self.subnet), *self._host_addrs, *self.config.blocked)

    def _setup_host(self) -> None:
        """Forwarding, the host table and NAT. Idempotent; replaces our own tables only."""
        try:
            with open("/proc/sys/net/ipv4/ip_forward") as f:
                if f.read().strip() != "1":
                    netfilter.write_sysctls([("net.ipv4.ip_forward", "1")])
        except OSError as exc:
            raise HostError(f"cannot enable IPv4 forwarding for sandbox networks: {exc}") from None
        self._host_addrs = tuple(sorted(_host_ipv4_addrs()))
        blocked = ", ".join(self.never)
        rules = f"""
add table inet {self.host_table}
delete table inet {self.host_table}
table inet {self.host_table} {{
  comment "dsec: sandbox networks (docs/SECURITY.md)"
  set blocked4 {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {blocked} }} }}
  chain input {{
    type filter hook input priority -10; policy accept;
    iifname "{self.link_prefix}*" counter drop comment "sandbox to host"
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname "{self.link_prefix}*" oifname "{LINK_PREFIX}*" counter drop comment "sandbox to sandbox (any runtime)"
    iifname "{self.link_prefix}*" ip saddr != {self.subnet} counter drop comment "spoofed source"
    iifname "{self.link_prefix}*" ip daddr @blocked4 counter drop comment "never reachable"
    iifname "{self.link_prefix}*" meta nfproto ipv6 counter drop comment "no IPv6 for sandboxes"
  }}
}}
"""
        if self.config.egress_nat:
            rules += f"""
add table ip {self.nat_table}
delete table ip {self.nat_table}
table ip {self.nat_table} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {self.subnet} oifname != "{LINK_PREFIX}*" masquerade
  }}
}}
"""
        # Sets merge overlapping ranges only with auto-merge; never4 inside sandboxes too.
        netfilter.nft(rules)
        self._host_ready = True
        self.host_tables_made = True

    def check_host(self, *, repair: bool) -> tuple[list[str], list[str]]:
        """(problems left, repairs made) of this manager's host tables: someone may have
        flushed the ruleset. Re-making them is the same idempotent step as at start."""
        if not self._host_ready:
            return [], []
        tables = [("inet", self.host_table)] + ([("ip", self.nat_table)] if self.config.egress_nat else [])
        missing = []
        for family, table in tables:
            try:
                netfilter.nft(f"list table {family} {table}")
            except netfilter.NftError:
                missing.append(f"{family} {table}")
        if not missing:
            return [], []
        what = f"the sandbox network's nftables table{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
        if not repair:
            return [f"{what} vanished"], []
        try:
            self._setup_host()
        except (netfilter.NftError, HostError) as exc:
            return [f"{what} vanished and cannot be re-made: {exc}"], []
        return [], [f"re-made {what}"]

    async def start(self, *, prefill: bool = True) -> None:
        """Make the host ready and start filling the pool (a no-op when started)."""
        if self.started:
            return
        await asyncio.get_running_loop().run_in_executor(self._make_pool, self._claim_subnet)
        await asyncio.get_running_loop().run_in_executor(self._make_pool, self._setup_host)
        try:
            # Started from the loop's own thread: PR_SET_PDEATHSIG follows the creating
            # thread, and executor threads come and go with close().
            self._maker = NetMaker.start()
        except HostError as exc:
            log.warning("network helper process: %s; making namespaces in-process", exc)
            self._maker = None
        self.started = True
        self._fill_wakeup = asyncio.Event()
        if prefill and self.config.pool_size > 0:
            self._fill_task = asyncio.create_task(self._fill_loop(), name="dsec-netpool-fill")
        self._resolve_task = asyncio.create_task(self._resolve_loop(), name="dsec-net-resolve")

    async def close(self) -> None:
        if self._gc_tasks:
            await asyncio.gather(*self._gc_tasks, return_exceptions=True)
        for task in (self._fill_task, self._resolve_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._fill_task = self._resolve_task = None
        while self._pool:
            lease = self._pool.popleft()
            self._drop(lease)
        if self._maker is not None:
            self._maker.close()
            self._maker = None
        self._policy_pool.shutdown(wait=True)
        self._make_pool.shutdown(wait=True)
        # Fresh workers: a runtime closed with destroy_all=False may start again.
        self._policy_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dsec-netpolicy")
        self._make_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsec-netmake")
        self.started = False
        if self._subnet_claim is not None:
            self._subnet_claim.release()
            self._subnet_claim = None

    def remove_host_rules(self) -> None:
        """Delete the host tables (when the last networked runtime goes away)."""
        for cmd in (f"delete table inet {self.host_table}", f"delete table ip {self.nat_table}"):
            with contextlib.suppress(netfilter.NftError):
                netfilter.nft(cmd)
        self._host_ready = False

    # ----- slots and addresses -----

    def _slot_ip(self, slot: int) -> str:
        return str(self.subnet.network_address + slot)

    def _claim_slot(self) -> int:
        with self._slot_lock:
            while self._free:
                slot = self._free.popleft()
                if slot not in self._used:
                    self._used.add(slot)
                    return slot
            limit = self.subnet.num_addresses - 2
            while self._next_slot <= limit:
                slot = self._next_slot
                self._next_slot += 1
                if slot not in self._used:
                    self._used.add(slot)
                    return slot
        raise HostError(f"the sandbox subnet {self.subnet} is full: configure a larger network.subnet")

    def _release_slot(self, slot: int) -> None:
        with self._slot_lock:
            if slot in self._used:
                self._used.discard(slot)
                self._free.append(slot)

    def adopt(self, sandbox_id: str, info: dict[str, Any], policy: NetworkPolicy | None) -> None:
        """Take back a sandbox's slot after a restart (from its record)."""
        slot = int(info["slot"])
        with self._slot_lock:
            self._used.add(slot)
            self._next_slot = max(self._next_slot, slot + 1)
        st = NetState(sandbox_id, slot, str(info["ip"]), str(info["ifname"]), policy)
        if policy is not None:
            with contextlib.suppress(InvalidSpec, HostError):
                st.elements, st.names = self._elements(policy, resolve=False)
        self.sandboxes[sandbox_id] = st

    # ----- making namespaces -----

    def _make(self, into_fd: int | None = None) -> Lease:
        """A namespace with lo up, eth0 addressed and routed, baseline rules; or, with
        ``into_fd``, the same wiring added to an existing namespace. The work runs in the
        ``dsec-netmaker`` helper process (pyroute2 is CPU-heavy Python: in this process
        it would hold the GIL against the event loop); in-process if that helper is gone."""
        if not self._host_ready:
            self._setup_host()
        never = ", ".join(self.never)
        for _attempt in range(256):
            slot = self._claim_slot()
            ip, ifname = self._slot_ip(slot), f"{self.link_prefix}{slot:05x}"
            try:
                if self._maker is not None and self._maker.alive:
                    fd = self._maker.make(slot, ip, ifname, never, into_fd)
                else:
                    fd = wire_netns(ip, ifname, never, into_fd)
            except SlotTaken:
                # Another runtime holds this address, or our own dead namespace's link
                # is not gone yet: keep the slot marked used and try the next one.
                self._taken.append(slot)
                continue
            except BaseException:
                self._release_slot(slot)
                raise
            self.made += 1
            self._retry_taken()
            return Lease(fd, slot, ip, ifname)
        raise HostError(f"no free sandbox address in {self.subnet}: 256 slots in a row are taken on this host")

    def _retry_taken(self) -> None:
        """Slots found taken go back to the free list after a while (their holder may go)."""
        if len(self._taken) > 64:
            for slot in self._taken[:32]:
                self._release_slot(slot)
            del self._taken[:32]

    def _drop(self, lease: Lease) -> None:
        """Forget an unused lease: closing the fd destroys the namespace and its veth."""
        with contextlib.suppress(OSError):
            os.close(lease.fd)
        self._release_slot(lease.slot)

    async def _fill_loop(self) -> None:
        assert self._fill_wakeup is not None
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            # Wait a moment before making: a sandbox destroyed meanwhile gives its namespace
            # back (recycle), which costs nothing, while making one costs ~10 ms of CPU and
            # its eventual teardown the kernel's RCU barriers.
            await asyncio.sleep(REFILL_DELAY_S)
            while len(self._pool) + self._recycling < self.config.pool_size:
                try:
                    lease = await loop.run_in_executor(self._make_pool, self._make)
                except Exception as exc:  # keep trying, slower: creates still make their own
                    failures += 1
                    log.warning("network pool: %s", exc)
                    await asyncio.sleep(min(30.0, 0.5 * failures))
                    continue
                failures = 0
                self._pool.append(lease)
            self._fill_wakeup.clear()
            await self._fill_wakeup.wait()

    async def take(self) -> Lease:
        """A prepared namespace (from the pool when one is ready)."""
        if not self.started:
            await self.start()
        if self._fill_wakeup is not None:
            self._fill_wakeup.set()
        if self._pool:
            return self._pool.popleft()
        self.pool_misses += 1
        return await asyncio.get_running_loop().run_in_executor(self._make_pool, self._make)

    @property
    def pool_ready(self) -> int:
        """Prepared namespaces waiting in the pool now."""
        return len(self._pool)

    def release(self, lease: Lease) -> None:
        """Free the slot of a lease that never became a sandbox's (its fd is the caller's to close)."""
        self._release_slot(lease.slot)

    gateway = GATEWAY

    async def compile(self, policy: NetworkPolicy) -> list[Element]:
        """The allow-set of a policy (names resolved): InvalidSpec for unknown names."""
        elements, _ = await asyncio.get_running_loop().run_in_executor(
            self._policy_pool, lambda: self._elements(policy))
        return elements

    async def attach(self, sandbox_id: str, netns_fd: int) -> Lease:
        """Wire a running sandbox's loopback-only namespace (a later stage needs network)."""
        if not self.started:
            await self.start()
        lease = await asyncio.get_running_loop().run_in_executor(
            self._make_pool, lambda: self._make(into_fd=netns_fd))
        return lease

    # ----- policies -----

    def _elements(self, policy: NetworkPolicy, *, resolve: bool = True) -> tuple[list[Element], tuple[str, ...]]:
        out: list[Element] = []
        unknown = [n for n in policy.allow if n not in self.config.permissions]
        if unknown:
            known = ", ".join(sorted(self.config.permissions)) or "none are configured"
            raise InvalidSpec(
                f"unknown network permission(s) {', '.join(unknown)}: this edge defines {known} "
                "(edge configuration, network.permissions)", field="network.allow")
        for name in policy.allow:
            perm = self.config.permissions[name]
            addrs = list(perm.cidrs)
            for host in perm.hosts:
                addrs += [f"{a}/32" for a in self._lookup(host, resolve=resolve)]
            out += _expand(addrs, perm.ports, perm.protocol)
        for rule in policy.rules:
            if ipaddress.ip_network(rule.cidr).version != 4:
                raise InvalidSpec(f"rule {rule.cidr}: IPv6 destinations are not supported (sandboxes have "
                                  "IPv4 only)", field="network.rules")
            out += _expand([rule.cidr], rule.ports, rule.protocol)
        return out, policy.allow

    def _lookup(self, host: str, *, resolve: bool) -> tuple[str, ...]:
        hit = self._resolved.get(host)
        if hit is not None and (not resolve or time.monotonic() - hit.at < self.config.resolve_interval_s):
            return hit.addrs
        if not resolve:
            return ()
        try:
            addrs = tuple(sorted(set(self._resolver(host))))
        except OSError as exc:
            if hit is not None:
                return hit.addrs  # keep the last good answer
            raise HostError(f"cannot resolve {host!r} for a network permission: {exc}") from None
        self._resolved[host] = _Resolved(addrs, time.monotonic())
        return addrs

    def _apply_in(self, netns_fd: int, gen: int, elements: Sequence[Element], fresh: bool) -> int:
        """Switch to a new generation in one transaction, then cut TCP connections it no longer admits."""
        def inside() -> int:
            try:
                netfilter.nft(generation_cmd(gen, elements))
            except netfilter.NftError:
                # a table wired before the forward chain existed (a sandbox adopted from an
                # older edge): add it once, then switch
                netfilter.nft(FORWARD_CHAIN + generation_cmd(gen, elements))
            if fresh:
                return 0  # a namespace nobody has used yet has no connections
            return netfilter.destroy_sockets(lambda addr, port: any(e.admits(addr, port) for e in elements))
        return netfilter.in_netns(netns_fd, inside)

    def _gc_in(self, netns_fd: int, keep: int) -> None:
        """Remove every policy generation but ``keep`` (one transaction; costs an RCU grace period)."""
        import json

        def inside() -> None:
            listing = json.loads(netfilter.nft("list table inet dsec", json_out=True) or "{}")
            old: list[str] = []
            for item in listing.get("nftables", []):
                for kind in ("chain", "set"):
                    name = item.get(kind, {}).get("name", "")
                    m = _GEN_NAME.match(name)
                    if m and int(m.group(1)) != keep:
                        old.append(f"delete {kind} inet dsec {name}")
            if not old:
                return
            cmd = (f"flush chain inet dsec output\nflush chain inet dsec input\nflush chain inet dsec forward\n"
                   f"add rule inet dsec output goto o{keep}\nadd rule inet dsec input goto i{keep}\n"
                   f"{forward_gotos(keep, 'add')}")
            # chains before the sets their rules use
            cmd += "\n".join(sorted(old, key=lambda c: c.split()[1] == "set")) + "\n"
            netfilter.nft(cmd)
        netfilter.in_netns(netns_fd, inside)

    async def apply(self, sandbox_id: str, netns_fd: int, lease_info: dict[str, Any],
                    policy: NetworkPolicy | None, *, compiled: list[Element] | None = None,
                    fresh: bool = False) -> int:
        """Set ``policy`` (None: nothing beyond loopback) on a wired namespace. Returns
        the number of connections cut."""
        elements: list[Element] = []
        names: tuple[str, ...] = ()
        if policy is not None and compiled is not None:
            elements, names = compiled, policy.allow
        elif policy is not None:
            elements, names = await asyncio.get_running_loop().run_in_executor(
                self._policy_pool, lambda: self._elements(policy))
        st = self.sandboxes.get(sandbox_id)
        if st is None:
            st = NetState(sandbox_id, int(lease_info["slot"]), str(lease_info["ip"]),
                          str(lease_info["ifname"]), None)
        loop = asyncio.get_running_loop()
        async with st.lock:
            gen = self._next_gen()
            cut = await loop.run_in_executor(self._policy_pool, self._apply_in, netns_fd, gen, elements, fresh)
            self.sandboxes[sandbox_id] = st
            st.policy, st.elements, st.names, st.gen = policy, list(elements), names, gen
            st.stale_gens += 1
            if st.stale_gens >= GC_AFTER:
                # Older generations go in the background (the caller does not wait for the
                # RCU grace period a deletion costs); the fd is duplicated for that job.
                st.stale_gens = 0
                gc_fd = os.dup(netns_fd)
                task = asyncio.create_task(self._gc(st, gc_fd), name=f"dsec-net-gc-{sandbox_id}")
                self._gc_tasks.add(task)
                task.add_done_callback(self._gc_tasks.discard)
        return cut

    def _next_gen(self) -> int:
        with self._slot_lock:
            self._gen_seq += 1
            return self._gen_seq

    async def _gc(self, st: NetState, netns_fd: int) -> None:
        try:
            async with st.lock:
                await asyncio.get_running_loop().run_in_executor(self._policy_pool, self._gc_in, netns_fd, st.gen)
        except Exception as exc:  # the sandbox may be gone meanwhile
            log.debug("policy generations of %s: %s", st.sandbox_id, exc)
        finally:
            os.close(netns_fd)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone (its namespace dies with its last process)."""
        st = self.sandboxes.pop(sandbox_id, None)
        if st is not None:
            self._release_slot(st.slot)

    def recycle(self, sandbox_id: str, netns_fd: int) -> None:
        """A destroyed sandbox's namespace (no process left in it) goes back to the pool
        once reset to deny-all: its veth, address and routes are kept, which spares both
        making a new one (~10 ms) and the kernel's namespace teardown (RCU barriers that
        slow every create meanwhile). Safe because the sandbox never owned the namespace:
        root inside could not change its links, routes, sysctls or rules, and its sockets
        died with its processes. Takes ``netns_fd``; closes it when the pool is full."""
        st = self.sandboxes.pop(sandbox_id, None)
        if st is None or not self.started or len(self._pool) + self._recycling >= 2 * self.config.pool_size:
            os.close(netns_fd)
            if st is not None:
                self._release_slot(st.slot)
            return
        self._recycling += 1
        lease = Lease(netns_fd, st.slot, st.ip, st.ifname)
        task = asyncio.get_running_loop().create_task(self._reset(lease), name=f"dsec-net-recycle-{sandbox_id}")
        self._gc_tasks.add(task)
        task.add_done_callback(self._gc_tasks.discard)

    async def _reset(self, lease: Lease) -> None:
        try:
            gen = self._next_gen()
            await asyncio.get_running_loop().run_in_executor(
                self._policy_pool, self._reset_in, lease.fd, gen)
        except Exception as exc:
            log.debug("recycling %s: %s", lease.ifname, exc)
            self._drop(lease)
        else:
            self._pool.append(lease)
            self.recycled += 1
        finally:
            self._recycling -= 1

    def _reset_in(self, netns_fd: int, gen: int) -> None:
        """Deny-all generation in force, then every older generation removed (off any caller's path)."""
        def inside() -> None:
            netfilter.nft(generation_cmd(gen, []) + "reset counter inet dsec denied\nflush set inet dsec denied4\n")
        netfilter.in_netns(netns_fd, inside)
        self._gc_in(netns_fd, gen)

    # ----- audit -----

    def _read_denied(self, netns_fd: int) -> tuple[int, list[str]]:
        import json

        def inside() -> tuple[int, list[str]]:
            out = netfilter.nft("list counter inet dsec denied\nlist set inet dsec denied4", json_out=True)
            packets, dests = 0, []
            for line in out.splitlines():
                line = line.strip()
                if not line:
                    continue
                for item in json.loads(line).get("nftables", []):
                    if "counter" in item:
                        packets = int(item["counter"].get("packets", 0))
                    elif "set" in item:
                        for el in item["set"].get("elem", []) or []:
                            val = el.get("elem", {}).get("val", el) if isinstance(el, dict) else el
                            concat = val.get("concat") if isinstance(val, dict) else None
                            if concat and len(concat) == 3:
                                dests.append(f"{concat[0]}:{concat[2]}/{concat[1]}")
            return packets, dests
        return netfilter.in_netns(netns_fd, inside)

    async def denied(self, sandbox_id: str, netns_fd: int) -> tuple[int, list[str]]:
        """Total refused packets since creation, and recent refused destinations."""
        return await asyncio.get_running_loop().run_in_executor(self._policy_pool, self._read_denied, netns_fd)

    # ----- re-resolution -----

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.resolve_interval_s)
            with contextlib.suppress(Exception):
                await self.reresolve(self.open_netns)

    async def reresolve(self, open_netns: Callable[[str], int | None] | None = None) -> list[str]:
        """Resolve permission host names again; re-apply policies whose addresses changed.
        Returns the ids of sandboxes updated. ``open_netns`` gives a sandbox's netns fd."""
        loop = asyncio.get_running_loop()
        changed_hosts: set[str] = set()
        for host in {h for p in self.config.permissions.values() for h in p.hosts}:
            old = self._resolved.get(host)
            self._resolved.pop(host, None)
            try:
                new = await loop.run_in_executor(self._policy_pool, functools.partial(self._lookup, host, resolve=True))
            except HostError:
                if old is not None:
                    self._resolved[host] = old
                continue
            if old is None or old.addrs != new:
                changed_hosts.add(host)
        if not changed_hosts or open_netns is None:
            return []
        names = {n for n, p in self.config.permissions.items() if changed_hosts & set(p.hosts)}
        updated: list[str] = []
        for sid, st in list(self.sandboxes.items()):
            if st.policy is None or not names & set(st.names):
                continue
            fd = open_netns(sid)
            if fd is None:
                continue
            try:
                await self.apply(sid, fd, {"slot": st.slot, "ip": st.ip, "ifname": st.ifname}, st.policy)
                updated.append(sid)
            except Exception as exc:
                log.warning("re-applying the policy of %s: %s", sid, exc)
            finally:
                os.close(fd)
        return updated


__all__ = ["ALWAYS_BLOCKED", "Lease", "NetworkConfig", "NetworkManager", "Permission"]
