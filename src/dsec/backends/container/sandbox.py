"""One container sandbox: its live state and everything done to it once it runs.

The runtime (:mod:`runtime`, the node) creates, re-adopts and destroys sandboxes and
owns what they share: the spawner, cgroup parents, uid slots, layer mounts, uppers,
the network manager. A :class:`ContainerSandbox` does the rest for one sandbox:
exec, processes, terminals, files, limits, network policy, stages, pause and resume.
It reaches the node only through :class:`Node`, the narrow protocol below (the
runtime satisfies it), never through the runtime's private members. Everything here
is in memory: the record (``rec``) is what survives a restart.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import os
import re
import secrets
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.backends.base import (
    DiskRoom,
    EdgeMeta,
    NetworkFacts,
    SandboxRecord,
    Usage,
)
from dsec.backends.common import limits as limit_evidence
from dsec.backends.common.fsops import SandboxFiles
from dsec.backends.common.sessions import Session
from dsec.backends.common.uppers import UpperUsage
from dsec.backends.container import cgroups
from dsec.backends.container import pause as pausing
from dsec.backends.container import stages as staging
from dsec.backends.container.commands import SandboxCommands
from dsec.backends.container.node import Node
from dsec.backends.container.procs import is_paused, kill_tree
from dsec.backends.container.records import ContainerRecord
from dsec.errors import (
    DsecError,
    HostError,
    InvalidSpec,
    SandboxFailed,
    SandboxNotFound,
    SandboxStateError,
)
from dsec.spec import NetworkPolicy, SandboxSpec, SandboxState
from dsec.spec.results import LimitHit

if TYPE_CHECKING:
    from dsec.backends.common.sessions import ShellProcess


@dataclass(frozen=True, slots=True)
class PauseResult:
    """What :meth:`ContainerSandbox.pause` did."""

    sandbox_id: str
    freeze_s: float
    """Seconds until every process was frozen."""
    reclaim: pausing.ReclaimStats | None
    """Memory pushed out to swap (None: reclaim skipped, or the sandbox was resumed meanwhile)."""
    seconds: float
    """The whole pause."""


@dataclass(slots=True, eq=False)
class ContainerSandbox(SandboxCommands):
    rec: ContainerRecord
    node: Node
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by create, destroy, pause/resume and a snapshot's pack: one of them at a time."""
    sessions: dict[str, Session] = field(default_factory=dict)
    limits_seen: list[int] = field(default_factory=lambda: [0, 0])
    """OOM kills and pids-limit hits already turned into events (the counters are cumulative)."""
    disk_commit: float | None = None
    """The activity stamp at which a full-looking disk was last committed and looked at again."""
    wake_gen: int = 0
    """Bumped by every wake: a pause that started before a wake does not reclaim after it."""
    stage_gate: asyncio.Event | None = None
    """Set while a stage switch kills the old stage's processes: new starts wait for it."""
    spawning: int = 0
    """Starts sent to the spawner whose child may not be in the cgroup yet."""
    packing: bool = False
    thaw_after_pack: bool = False
    gone: bool = False
    """Destroyed (the node forgot it): a request that held it across an await sees so."""

    @property
    def id(self) -> str:
        return self.rec.id

    def record(self) -> ContainerRecord:
        """The record; SandboxNotFound once the sandbox is destroyed."""
        if self.gone:
            raise SandboxNotFound(f"no sandbox {self.id!r} on this node", sandbox_id=self.id)
        return self.rec

    def current(self) -> ContainerRecord | None:
        """The record, None once the sandbox is destroyed."""
        return None if self.gone else self.rec

    # -- sessions --

    def add_session(self, sess: Session) -> None:
        self.sessions[sess.id] = sess

    def drop_session(self, session_id: str) -> Session | None:
        return self.sessions.pop(session_id, None)

    def take_sessions(self) -> list[Session]:
        """Every open session, now forgotten here (the caller closes them)."""
        out = list(self.sessions.values())
        self.sessions.clear()
        return out

    async def open_session(self, *, env: Mapping[str, str] | None = None, cwd: str = "/",
                           user: int | str = 0) -> Session:
        """A persistent shell; closed with the sandbox at the latest."""
        self.running()
        sess = Session(self, self.id, f"sess-{secrets.token_hex(4)}")
        await sess.start(env=dict(env or {}), cwd=cwd, user=user)
        self.add_session(sess)
        return sess

    # -- what a session uses (dsec.backends.common.sessions.SessionHost) --

    def kill_command(self, shell: ShellProcess) -> None:
        """Kill what a session's shell runs now: its descendants (host pids), never the shell."""
        kill_tree(shell.pid, include_root=False)

    def touch(self) -> None:
        self.node.last_activity[self.id] = time.monotonic()

    # -- starts and stage switches --

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Around a start sent to the spawner (a stage switch waits for these)."""
        self.spawning += 1
        try:
            yield
        finally:
            self.spawning -= 1

    async def wait_for_stage_switch(self) -> None:
        gate = self.stage_gate
        if gate is not None:
            await gate.wait()

    async def begin_stage_switch(self) -> asyncio.Event:
        """One switch at a time: waits for another in progress, then holds the gate."""
        while (busy := self.stage_gate) is not None:
            await busy.wait()
        gate = self.stage_gate = asyncio.Event()
        return gate

    def end_stage_switch(self, gate: asyncio.Event) -> None:
        if self.stage_gate is gate:
            self.stage_gate = None
        gate.set()

    # -- snapshots and wakes --

    def begin_pack(self) -> None:
        """A snapshot froze the sandbox to copy its writable layer: wakes wait for the end."""
        self.packing = True
        self.thaw_after_pack = False

    def end_pack(self) -> bool:
        """The copy is done; True if a request asked to wake the sandbox meanwhile."""
        self.packing = False
        woken, self.thaw_after_pack = self.thaw_after_pack, False
        return woken

    def wake_requested(self) -> bool:
        """A request wants the sandbox running: True if a pack holds it (it thaws at the end)."""
        self.wake_gen += 1
        if self.packing:
            self.thaw_after_pack = True
            return True
        return False

    # -- what is done to a running sandbox --

    def running(self, *, resume: bool = True) -> ContainerRecord:
        """The record of a running sandbox; a paused one is resumed first (unless ``resume``
        is False: then it is an error like any other state)."""
        rec = self.record()
        if rec.state is SandboxState.PAUSED and resume:
            self.wake()
        if rec.state is not SandboxState.RUNNING:
            raise SandboxStateError(
                f"sandbox {self.id} is {rec.state.value}, not running"
                + (f" ({rec.reason})" if rec.reason else ""),
                sandbox_id=self.id,
                state=rec.state.value,
            )
        return rec

    def live_rec(self) -> ContainerRecord:
        """The record of a running or paused sandbox (a paused one stays paused)."""
        rec = self.record()
        if rec.state is SandboxState.PAUSED:
            return rec
        return self.running()

    def require_running(self) -> ContainerRecord:
        """The record of a running sandbox; SandboxNotFound / SandboxStateError otherwise."""
        return self.running()

    def upper_path(self) -> Path:
        """The writable layer as the host sees it (through the init's fd 3); a paused sandbox stays paused."""
        rec = self.live_rec()
        return Path(f"/proc/{rec.init_pid}/fd/3/upper")

    def root_path(self) -> Path:
        rec = self.running()
        return Path(f"/proc/{rec.init_pid}/root")

    def stats(self) -> dict[str, Any]:
        rec = self.live_rec()
        st = self.node.cgroups.stats(self.id)
        return {"id": rec.id, "state": rec.state.value, "init_pid": rec.init_pid, **dataclasses.asdict(st)}

    def usage(self) -> Usage:
        """Memory, pids, CPU seconds and writable-layer bytes now (blocking reads: call from a thread)."""
        st = self.stats()
        try:
            disk = self.disk_usage().used
        except (OSError, DsecError):
            disk = 0
        return Usage(memory_bytes=int(st.get("memory_bytes", 0)), pids=int(st.get("pids", 0)),
                     cpu_s=cgroups.cpu_seconds(self.node.cgroups.pids(self.id)), disk_bytes=disk)

    def disk_usage(self) -> UpperUsage:
        """Bytes the sandbox's writable layer holds and may hold, on either medium."""
        rec = self.live_rec()
        if rec.spec.resources.disk_medium == "disk":
            return self.node.uppers.usage(self.id)
        st = os.statvfs(f"/proc/{rec.init_pid}/fd/3")
        return UpperUsage(used=(st.f_blocks - st.f_bfree) * st.f_frsize, limit=st.f_blocks * st.f_frsize)

    def update(self, *, spec: SandboxSpec | None = None, edge: EdgeMeta | None = None) -> ContainerRecord:
        """Change what the record says (not the running sandbox): a warm-pool sandbox taken
        for a request gets that request's spec (same layers and resources) and edge part."""
        rec = self.running()
        if spec is not None:
            if spec.resources != rec.spec.resources or self.node.layers.stack_for(spec.image) != rec.layers:
                raise InvalidSpec(
                    f"sandbox {self.id} runs other layers or resources than the new spec", field="spec", sandbox_id=self.id
                )
            rec.spec = spec
        if edge is not None:
            rec.edge = edge
        self.node.records.save(rec)
        return rec

    def note_limits(self, rec: ContainerRecord, counters: limit_evidence.Counters | None = None) -> None:
        """Turn new OOM kills and pids-limit hits into events (counters are cumulative);
        ``counters`` when the caller has just read them."""
        now = counters if counters is not None else limit_evidence.counters(self.node.cgroups, rec.id)
        if now is None:
            return
        if self.gone:
            return  # destroyed meanwhile
        seen = self.limits_seen
        for i, (event, value) in enumerate((("oom", now.oom_kills), ("pids_limit", now.pids_hits))):
            if value > seen[i]:
                self.node.records.event(rec, event, count=value - seen[i])
                seen[i] = value

    def check_limits(self, rec: SandboxRecord) -> None:
        """Turn new OOM kills and pids-limit hits into events."""
        assert isinstance(rec, ContainerRecord)
        self.note_limits(rec)

    def limit_baseline(self) -> limit_evidence.Baseline | None:
        """What a command starts from, for :meth:`limit_hit`: the sandbox's OOM-kill and
        pids-limit counters now (two small reads) and whether its layer was last seen full.
        None once the sandbox is destroyed."""
        if self.gone:
            return None
        return limit_evidence.Baseline(limit_evidence.counters(self.node.cgroups, self.id), self.rec.disk_full)

    def limit_hit(
        self,
        before: limit_evidence.Baseline | None,
        *,
        exit_code: int | None,
        sig: int | None,
        timed_out: str | None = None,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        truncated: bool = False,
        output_cap: int = 0,
        output: tuple[bytes, ...] = (),
    ) -> LimitHit | None:
        """Which limit ended a command that just finished (``ExecResult.limit``), judged from
        the counters ``before`` it and now (see :mod:`limits`). A failed command's counters
        are read here and turned into events at once; a succeeded one's are left to
        :meth:`note_limits`, off the reply path. None once the sandbox is destroyed."""
        rec = self.current()
        if rec is None:
            return None
        after = disk = None
        if limit_evidence.failed(exit_code, sig) and timed_out is None:
            after = limit_evidence.counters(self.node.cgroups, rec.id)
            if after is not None:
                self.note_limits(rec, after)
            disk = self.disk_room(rec)
        return limit_evidence.judge(
            rec.spec.resources, exit_code=exit_code, sig=sig, timed_out=timed_out, timeout_s=timeout_s,
            idle_timeout_s=idle_timeout_s, truncated=truncated, output_cap=output_cap, before=before, after=after,
            disk=disk, output=output,
        )

    def disk_room(self, rec: SandboxRecord) -> DiskRoom | None:
        """Room left in the sandbox's writable layer under its quota (None: cannot tell);
        whether it is full is remembered in ``rec.disk_full``."""
        assert isinstance(rec, ContainerRecord)
        room = self._measure_disk(rec)
        if room is not None:
            rec.disk_full = room.full
        return room

    def _measure_disk(self, rec: ContainerRecord) -> DiskRoom | None:
        if rec.spec.resources.disk_medium == "disk":
            # statvfs of a subvolume shows the whole store: its qgroup holds the quota.
            try:
                use = self.node.uppers.usage(rec.id)
                seen = self.node.last_activity.get(rec.id, 0.0)
                box = self
                if use.free < limit_evidence.DISK_FULL_BYTES and not box.gone and box.disk_commit != seen:
                    # Looks full: the figures may predate an rm (qgroups update at commits).
                    # Commit (a few ms) and look again, once per burst of activity: a full
                    # sandbox left idle costs nothing more.
                    box.disk_commit = seen
                    self.node.uppers.commit()
                    use = self.node.uppers.usage(rec.id)
            except (OSError, ValueError, HostError):
                return None
            return DiskRoom(use.free, -1, use.free < limit_evidence.DISK_FULL_BYTES)
        return limit_evidence.disk_room(rec.init_pid)

    async def set_policy(self, policy: NetworkPolicy | None) -> ContainerRecord:
        """Replace a sandbox's network policy at once (one nftables transaction); TCP
        connections the new policy forbids are cut. ``None``: nothing beyond loopback.
        A loopback-only sandbox gets its veth on the first policy. Works while paused."""
        compiled = None if policy is None else await self.node.net.compile(policy)
        async with self.lock:
            rec = self.live_rec()
            if rec.net is None and policy is None:
                return rec
            pidfd = self.netns_fd()
            assert pidfd is not None
            try:
                if rec.net is None:
                    lease = await self.node.net.attach(self.id, pidfd)
                    os.close(lease.fd)
                    try:
                        cut = await self.node.net.apply(self.id, pidfd, lease.info(), policy, compiled=compiled)
                    except BaseException:
                        if self.id not in self.node.net.sandboxes:
                            self.node.net.release(lease)
                        raise
                    rec.net = lease.info()
                else:
                    cut = await self.node.net.apply(self.id, pidfd, rec.net, policy, compiled=compiled)
            finally:
                os.close(pidfd)
            dumped = None if policy is None else policy.model_dump(mode="json")
            rec.net = {**rec.net, "policy": dumped}
            self.node.records.save(rec)
            self.node.records.event(rec, "policy_changed", policy=dumped, connections_cut=cut)
            return rec

    def netns_fd(self, *, check: bool = True) -> int | None:
        """An fd of the sandbox's network namespace, taken from its verified init."""
        return open_netns(self.node, self.rec, check=check)

    async def collect_denied(self) -> int:
        """Read the refused-packet counter; record a ``net_denied`` event when it grew.
        Returns the increase (0: none, or no network, or gone)."""
        rec = self.rec
        st = self.node.net.sandboxes.get(self.id)
        if self.gone or st is None or rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            return 0
        pidfd = self.netns_fd(check=False)
        if pidfd is None:
            return 0
        try:
            total, dests = await self.node.net.denied(self.id, pidfd)
        except Exception:
            return 0
        finally:
            os.close(pidfd)
        st.denied_recent = dests[-16:]
        if total <= st.denied_seen:
            return 0
        grown, st.denied_seen = total - st.denied_seen, total
        self.node.records.event(rec, "net_denied", count=grown, total=total, destinations=dests[-16:])
        return grown

    def network_info(self) -> NetworkFacts | None:
        """Address, policy and refused-packet counts (as of the last :meth:`collect_denied`);
        None for a loopback-only sandbox."""
        rec = self.rec
        if rec.net is None:
            return None
        st = self.node.net.sandboxes.get(self.id)
        return {
            "ip": rec.net.get("ip"),
            "ifname": rec.net.get("ifname"),
            "gateway": self.node.net.gateway,
            "policy": rec.net.get("policy"),
            "denied_packets": st.denied_seen if st else 0,
            "denied_recent": list(st.denied_recent) if st else [],
        }

    def set_net_sysctls(self, values: Mapping[str, str]) -> None:
        """Write ``net.*`` sysctls of the running sandbox's own network namespace from the host
        (root inside cannot: /proc/sys is read-only there). Blocking: a thread of its own."""
        bad = [k for k in values if not re.fullmatch(r"net(\.[a-z0-9_]+)+", k)]
        if bad:
            raise InvalidSpec(f"not a net.* sysctl: {', '.join(bad)}", field="sysctls")
        rec = self.running()
        from dsec.backends.common import netfilter

        fd = os.open(f"/proc/{rec.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            netfilter.in_netns(fd, lambda: netfilter.write_sysctls(values.items()))
        finally:
            os.close(fd)

    def child_cgroups(self, controller: str, names: Sequence[str]) -> builtins.list[Path]:
        """Make child cgroups of ``controller`` below the running sandbox's own (charged to it,
        bounded by it, removed with it); their host paths. For a backend that divides a
        sandbox of its own (FnCall: a memory cgroup per call slot)."""
        self.running()
        return self.node.cgroups.make_children(self.id, controller, names)

    def current_stage(self) -> str | None:
        rec = self.rec
        return rec.stage or rec.spec.stage

    async def set_stage(self, name: str) -> ContainerRecord:
        """Switch the sandbox to stage ``name`` (declared in ``spec.stages``).

        Landlock cannot be changed on a running process, so every process of the
        sandbox but its init is killed first: commands in flight end with SIGKILL,
        sessions end (their next ``run`` raises SessionClosed). Then the stage's
        network policy is applied, the stage recorded (it survives a runtime
        restart) and a ``stage_changed`` event logged. New commands wait for the
        switch and start under the new stage's file rules."""
        rec = self.running()
        stage = rec.spec.stages.get(name)
        if stage is None:
            known = ", ".join(sorted(rec.spec.stages)) or "none declared"
            raise InvalidSpec(f"sandbox {self.id} has no stage {name!r} (declared: {known})",
                              field="stage", sandbox_id=self.id, stages=sorted(rec.spec.stages))
        if not stage.files.unrestricted and self.node.landlock_abi < 1:
            raise HostError("stage file rules need Landlock, which this kernel lacks (CONFIG_SECURITY_LANDLOCK, lsm=landlock)",
                            sandbox_id=self.id)
        box = self
        gate = await box.begin_stage_switch()  # one switch at a time
        t0 = time.perf_counter()
        try:
            rec = self.running()
            old = rec.stage or rec.spec.stage
            # Starts already sent to the spawner finish first (their child may not be in the cgroup yet).
            while box.spawning > 0:
                await asyncio.sleep(0.0005)
            killed = await self._kill_all_but_init(rec)
            for sess in box.take_sessions():
                sess.ended_reason = f"the sandbox switched to stage {name!r}; open a new session"
                with contextlib.suppress(Exception):
                    await sess.close()
            split: builtins.list[str] = []
            symlinked: builtins.list[str] = []
            if not stage.files.unrestricted:
                split, symlinked = await asyncio.to_thread(self._stage_fs_checks, rec, stage.files)
            await self.set_policy(stage.network)
            rec.stage = name
            self.node.records.save(rec)
            self.node.records.event(rec, "stage_changed", **{"from": old, "to": name}, killed=killed, links_split=split,
                        symlinked_rule_paths=symlinked, seconds=round(time.perf_counter() - t0, 6))
            self.node.last_activity[self.id] = time.monotonic()
            return rec
        finally:
            box.end_stage_switch(gate)

    @staticmethod
    def _stage_fs_checks(rec: ContainerRecord, files: Any) -> tuple[builtins.list[str], builtins.list[str]]:
        """(files under restricted paths split off their hard links, rule paths that are symlinks)."""
        root = f"/proc/{rec.init_pid}/root"
        split = staging.split_hard_links(root, f"/proc/{rec.init_pid}/fd/3/upper", files)
        named = (*staging.restricted_paths(files), *files.writable)
        return split, staging.symlinked_paths(root, named)

    async def _kill_all_but_init(self, rec: ContainerRecord) -> int:
        """SIGKILL every process of the sandbox except its init (frozen first, so none forks
        meanwhile); returns how many were killed, once they are gone."""
        if all(p == rec.init_pid for p in self.node.cgroups.pids(self.id)):
            return 0  # the init alone never forks, and no start is in flight: nothing can appear
        await pausing.freeze(self.node.cgroups, self.id)
        victims = [p for p in self.node.cgroups.pids(self.id) if p != rec.init_pid]
        try:
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            pausing.thaw(self.node.cgroups, self.id)
        deadline = time.monotonic() + 10
        delay = 0.0002
        while any(p != rec.init_pid for p in self.node.cgroups.pids(self.id)):
            if time.monotonic() > deadline:
                raise HostError(f"sandbox {self.id}: processes of the old stage did not die within 10 s", sandbox_id=self.id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)
        return len(victims)

    def files(self, *, platform: bool = False) -> SandboxFiles:
        """Confined host-side file access (see :mod:`fsops`). It obeys the current stage's
        file rules like the sandbox's processes do (agents' file tools usually come through
        here); ``platform=True`` is the platform's own access (fork identity, evaluation
        set-up), confined to the sandbox root but not to the stage."""
        rec = self.running()
        self.node.last_activity[self.id] = time.monotonic()
        stage = rec.stage or rec.spec.stage
        rules = rec.spec.stages[stage].files if stage is not None and stage in rec.spec.stages else None
        return SandboxFiles(f"/proc/{rec.init_pid}/root", rec.uid_base, self.id, rules=None if platform else rules)

    def wake(self) -> bool:
        """Resume a paused sandbox now (synchronous: a thaw costs ~0.1 ms). False if it was not paused.

        Exec, files and sessions call this, so a paused sandbox resumes on any request;
        its pages come back from swap as they are touched."""
        box = self
        if box.gone or box.rec.state is not SandboxState.PAUSED:
            return False
        if self.node.wake_gate is not None:
            self.node.wake_gate(self.id)  # raises to keep it paused (preempted)
        rec = box.rec
        # While a snapshot copies its upper it thaws when the copy is done; the request
        # goes on and waits for that inside the frozen cgroup.
        if not box.wake_requested():
            pausing.thaw(self.node.cgroups, self.id)
        self.node.records.move(rec, SandboxState.RUNNING, save=False)
        self.node.records.event(rec, "resumed")
        self.node.last_activity[self.id] = time.monotonic()
        return True

    async def pause(self, *, reclaim: bool = True) -> PauseResult:
        """Freeze every process of the sandbox, then push its memory out to swap.

        Pausing a paused sandbox raises SandboxStateError. Any exec, file or session
        call resumes it (:meth:`wake`); so does :meth:`resume`. The sandbox's disk
        (its writable layer is tmpfs, charged to its memory cgroup) goes to swap too.
        Commands running when it is paused are frozen with it; their timeouts keep
        counting. A sandbox holding less than ``pause.RECLAIM_MIN`` is only frozen."""
        t0 = time.perf_counter()
        freeze_s = await self.freeze()
        stats = await self.reclaim_paused() if reclaim else None
        elapsed = time.perf_counter() - t0
        rec = self.current()
        if rec is not None:
            self.node.records.event(rec, "paused", freeze_s=round(freeze_s, 6), seconds=round(elapsed, 6),
                        memory_before=stats.before if stats else None, memory_after=stats.after if stats else None)
        return PauseResult(self.id, freeze_s, stats, elapsed)

    async def freeze(self) -> float:
        """The first half of a pause: state paused, every process frozen. Returns seconds."""
        rec = self.record()
        if rec.state is SandboxState.PAUSED:
            raise SandboxStateError(f"sandbox {self.id} is already paused", sandbox_id=self.id, state="paused")
        self.running(resume=False)
        async with self.lock:
            rec = self.record()
            if rec.state is SandboxState.PAUSED:
                raise SandboxStateError(f"sandbox {self.id} is already paused", sandbox_id=self.id, state="paused")
            self.running(resume=False)
            self._open_init_check(rec)
            # Paused before frozen: a request arriving during the freeze sees "paused" and thaws.
            self.node.records.move(rec, SandboxState.PAUSED, save=False)
            try:
                return await pausing.freeze(self.node.cgroups, self.id)
            except BaseException:
                if is_paused(rec):
                    with contextlib.suppress(OSError):
                        pausing.thaw(self.node.cgroups, self.id)
                    self.node.records.move(rec, SandboxState.RUNNING, save=False)
                raise

    async def reclaim_paused(self) -> pausing.ReclaimStats | None:
        """The second half: push a paused sandbox's memory to swap (None if it was resumed meanwhile)."""
        box = self
        if box.gone or not is_paused(box.rec):
            return None
        rec, gen = box.rec, box.wake_gen
        async with box.lock:
            if not is_paused(rec) or box.wake_gen != gen or box.gone:
                return None
            return await asyncio.to_thread(pausing.reclaim, self.node.cgroups, self.id, self.node.reclaim_method)

    def _open_init_check(self, rec: ContainerRecord) -> None:
        fd = self.node.open_init(rec)  # raises SandboxFailed (and marks it failed) if the init is gone
        if fd is not None:
            os.close(fd)

    async def resume(self) -> ContainerRecord:
        """Thaw a paused sandbox. SandboxStateError if it is not paused."""
        rec = self.rec
        if rec.state is not SandboxState.PAUSED:
            raise SandboxStateError(
                f"sandbox {self.id} is {rec.state.value}, not paused", sandbox_id=self.id, state=rec.state.value
            )
        self.wake()
        return rec


def open_netns(node: Node, rec: ContainerRecord, *, check: bool = True) -> int | None:
    """An fd of the sandbox's network namespace, taken from its verified init."""
    pidfd = node.open_init(rec, check=check)
    if pidfd is None:
        return None
    fd = -1
    try:
        fd = os.open(f"/proc/{rec.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        signal.pidfd_send_signal(pidfd, 0)  # still that process: the fd is its namespace
        return fd
    except OSError:
        if fd >= 0:
            os.close(fd)
        if check:
            raise SandboxFailed(f"sandbox {rec.id}: its init is gone", sandbox_id=rec.id,
                                reason="init exited") from None
        return None
    finally:
        os.close(pidfd)


class RecordView(Mapping[str, "ContainerRecord"]):
    """``ContainerRuntime.sandboxes``: the records of the live sandboxes, read-only."""

    __slots__ = ("_boxes",)

    def __init__(self, boxes: dict[str, ContainerSandbox]) -> None:
        self._boxes = boxes

    def __getitem__(self, sandbox_id: str) -> ContainerRecord:
        return self._boxes[sandbox_id].rec

    def get(self, sandbox_id: str, default: ContainerRecord | None = None) -> ContainerRecord | None:  # type: ignore[override]
        box = self._boxes.get(sandbox_id)
        return default if box is None else box.rec

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._boxes

    def __iter__(self) -> Iterator[str]:
        return iter(self._boxes)

    def __len__(self) -> int:
        return len(self._boxes)

    def values(self) -> list[ContainerRecord]:  # type: ignore[override]
        return [b.rec for b in self._boxes.values()]


__all__ = ["ContainerSandbox", "Node", "PauseResult", "RecordView", "open_netns"]
