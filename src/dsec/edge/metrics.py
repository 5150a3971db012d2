"""Prometheus metrics of one edge, in a registry of its own (several edges can share a
process, e.g. `dsec up` or a 3-edge benchmark, without clashing series).

Counters and histograms are updated as things happen; gauges of state
(sandboxes by state, pools, committed resources, host use) are computed at
scrape time from the service, so they can never drift from the truth.

| series | labels | what |
|---|---|---|
| dsec_edge_sandboxes | state | sandboxes by state (warm-pool sandboxes not included) |
| dsec_edge_creates_total | result, source, reason | creates: ok/failed; cold/pool; failure code |
| dsec_edge_create_seconds | source | create latency: cold, pool (a claim), refill (background) |
| dsec_edge_destroys_total | reason | deleted, ttl_expired, idle_expired, failed, pool_evicted, ... |
| dsec_edge_execs_total | kind, outcome | exec, stream, session; ok, nonzero, timeout, error, cancelled |
| dsec_edge_exec_seconds | kind | exec round trip on the edge |
| dsec_edge_admission_refusals_total | reason | count, cpu, memory, disk |
| dsec_edge_expirations_total | reason | ttl, idle, failed |
| dsec_edge_limit_events_total | kind | limit hits: oom, pids_limit, disk_full, output_cap |
| dsec_edge_net_denied_total | | packets refused by sandboxes' network policies |
| dsec_edge_net_denied_sandboxes_total | | times a sandbox was seen with new refused packets (one per audit pass) |
| dsec_edge_policy_changes_total | result | set_policy calls: ok, failed |
| dsec_edge_stage_changes_total | result | set_stage calls: ok, failed |
| dsec_edge_policy_apply_seconds | kind | policy, stage: latency of a change on the edge |
| dsec_edge_pool_ready / _target / _creating / _low_watermark | pool | warm pools; watermark = lowest ready count in the last 60 s |
| dsec_edge_pool_claims_total | pool, result | hit, miss |
| dsec_edge_pool_refills_total | pool, result | ok, failed |
| dsec_edge_pool_evictions_total | pool | pooled sandboxes destroyed to make room |
| dsec_edge_committed / dsec_edge_pool_reserved / dsec_edge_capacity | resource | cpu (cores), memory, disk (bytes), sandboxes |
| dsec_edge_host_cpu_cores, _cpu_utilization, _load1 | | host cpu |
| dsec_edge_host_memory_bytes, dsec_edge_host_disk_bytes | kind | total, available / free |
| dsec_edge_sessions | | open shell sessions |
| dsec_edge_healthy | | 1, or 0 while host state is broken beyond the edge's own repair (health ``problems``) |
| dsec_edge_host_problems | kind | unrepaired host-state problems now: cgroup, layer_mount, skeleton, uppers, spawner, network, directory, claim |
| dsec_edge_host_repairs_total | kind | host state the edge found vanished and made again |
| dsec_edge_registry_up | | with a registry configured: 1 while the lazy loader answers and the registry has not failed in the last minute |
| dsec_edge_lazy_bytes_fetched_total, _chunks_fetched_total, _corrupt_chunks_total, _read_errors_total, _registry_errors_total | | the lazy loader's counters (as of the last self-check pass) |
| dsec_edge_lazy_cache_bytes | | bytes in the node's chunk cache |
| dsec_edge_registry_failures_total, dsec_edge_lazy_restarts_total | | registry lookups that failed; loader restarts |
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dsec.spec import SandboxState

if TYPE_CHECKING:
    from dsec.edge.admission import Admission
    from dsec.edge.backends import EdgeBackends
    from dsec.edge.host import HostSampler
    from dsec.edge.pools import PoolManager
    from dsec.edge.selfcheck import SelfCheck

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
LIMIT_KINDS = ("oom", "pids_limit", "disk_full", "output_cap")
HOST_KINDS = ("cgroup", "layer_mount", "skeleton", "uppers", "spawner", "network", "directory", "claim")
"""What :meth:`ContainerRuntime.heal` looks after (``HostFinding.kind``)."""
EXEC_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)


class MetricsSource(Protocol):
    """What the state metrics are read from at scrape time (the edge service satisfies it)."""

    backends: EdgeBackends
    pools: PoolManager
    admission: Admission
    host: HostSampler
    selfcheck: SelfCheck

    def session_count(self) -> int: ...


class EdgeMetrics:
    def __init__(self, state: MetricsSource) -> None:
        r = self.registry = CollectorRegistry()
        self.creates = Counter("dsec_edge_creates", "Sandbox creates", ["result", "source", "reason"], registry=r)
        self.create_seconds = Histogram(
            "dsec_edge_create_seconds", "Create latency on the edge", ["source"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.destroys = Counter("dsec_edge_destroys", "Sandboxes destroyed, by reason", ["reason"], registry=r)
        self.execs = Counter("dsec_edge_execs", "Commands run", ["kind", "outcome"], registry=r)
        self.exec_seconds = Histogram(
            "dsec_edge_exec_seconds", "Command latency on the edge", ["kind"], buckets=EXEC_BUCKETS, registry=r
        )
        self.admission_refusals = Counter(
            "dsec_edge_admission_refusals", "Creates refused by admission", ["reason"], registry=r
        )
        self.expirations = Counter("dsec_edge_expirations", "Sandboxes destroyed by the watchdog", ["reason"], registry=r)
        self.pauses = Counter("dsec_edge_pauses", "Sandboxes paused, by how (api, group, idle)", ["how"], registry=r)
        self.snapshots = Counter("dsec_edge_snapshots", "Snapshots packed (snapshot or fork)", ["kind"], registry=r)
        self.limit_events = Counter(
            "dsec_edge_limit_events", "Limit hits: OOM kills, pids-limit hits, full disks, capped output", ["kind"], registry=r
        )
        self.net_denied = Counter("dsec_edge_net_denied", "Packets refused by sandbox network policies", registry=r)
        self.net_denied_sandboxes = Counter(
            "dsec_edge_net_denied_sandboxes", "Audit passes that found a sandbox with new refused packets", registry=r
        )
        self.policy_changes = Counter("dsec_edge_policy_changes", "Network policy changes", ["result"], registry=r)
        self.stage_changes = Counter("dsec_edge_stage_changes", "Stage switches", ["result"], registry=r)
        self.policy_seconds = Histogram(
            "dsec_edge_policy_apply_seconds", "Policy change / stage switch latency on the edge", ["kind"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.pool_claims = Counter("dsec_edge_pool_claims", "Creates matching a warm pool", ["pool", "result"], registry=r)
        self.pool_refills = Counter("dsec_edge_pool_refills", "Background pool creates", ["pool", "result"], registry=r)
        self.pool_evictions = Counter(
            "dsec_edge_pool_evictions", "Pooled sandboxes destroyed to make room", ["pool"], registry=r
        )
        for reason in ("count", "cpu", "memory", "disk"):
            self.admission_refusals.labels(reason)
        for kind in LIMIT_KINDS:
            self.limit_events.labels(kind)
        for result in ("ok", "failed"):
            self.policy_changes.labels(result)
            self.stage_changes.labels(result)
        for source in ("cold", "pool"):
            self.create_seconds.labels(source)
            self.creates.labels("ok", source, "")
        r.register(_StateCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    def __init__(self, source: MetricsSource) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        svc = self.source
        states = GaugeMetricFamily("dsec_edge_sandboxes", "Sandboxes by state (warm pools excluded)", labels=["state"])
        per_backend = GaugeMetricFamily("dsec_edge_backend_sandboxes", "Sandboxes by backend (warm pools excluded)",
                                        labels=["backend"])
        counts = dict.fromkeys((s.value for s in SandboxState), 0)
        pooled = svc.pools.pooled_ids
        for backend in svc.backends.sandbox_backends():
            n = 0
            for rec in list(backend.sandboxes.values()):
                if rec.id not in pooled:
                    counts[rec.state.value] += 1
                    n += 1
            per_backend.add_metric([backend.capabilities.kind], n)
        for state, n in counts.items():
            states.add_metric([state], n)
        yield states
        yield per_backend

        ready = GaugeMetricFamily("dsec_edge_pool_ready", "Ready sandboxes in a warm pool", labels=["pool"])
        target = GaugeMetricFamily("dsec_edge_pool_target", "Configured warm pool size", labels=["pool"])
        creating = GaugeMetricFamily("dsec_edge_pool_creating", "Pool sandboxes being made", labels=["pool"])
        low = GaugeMetricFamily("dsec_edge_pool_low_watermark", "Lowest ready count in the last 60 s", labels=["pool"])
        for pool in svc.pools.pools:
            ready.add_metric([pool.name], len(pool.ready))
            target.add_metric([pool.name], pool.target)
            creating.add_metric([pool.name], pool.creating)
            low.add_metric([pool.name], pool.low_watermark())
        yield from (ready, target, creating, low)

        if svc.admission is not None:
            adm = svc.admission
            committed = GaugeMetricFamily("dsec_edge_committed", "Resources requested by live sandboxes", labels=["resource"])
            reserved = GaugeMetricFamily("dsec_edge_pool_reserved", "Resources held by warm pools", labels=["resource"])
            capacity = GaugeMetricFamily("dsec_edge_capacity", "Admission budgets", labels=["resource"])
            b = adm.budgets
            for name, used, pool_used, cap in (
                ("sandboxes", adm.real.sandboxes, adm.pooled.sandboxes, b.sandboxes),
                ("cpu", adm.real.cpu, adm.pooled.cpu, b.cpu),
                ("memory", adm.real.memory, adm.pooled.memory, b.memory),
                ("disk", adm.real.disk, adm.pooled.disk, b.disk),
            ):
                committed.add_metric([name], used)
                reserved.add_metric([name], pool_used)
                capacity.add_metric([name], cap)
            yield from (committed, reserved, capacity)

        host = svc.host.sample()
        yield GaugeMetricFamily("dsec_edge_host_cpu_cores", "Host cpu cores", value=host["cpu_cores"])
        yield GaugeMetricFamily("dsec_edge_host_cpu_utilization", "Busy share of all host cores (0..1)", value=host["cpu_util"])
        yield GaugeMetricFamily("dsec_edge_host_load1", "Host 1-minute load average", value=host["load1"])
        mem = GaugeMetricFamily("dsec_edge_host_memory_bytes", "Host memory", labels=["kind"])
        mem.add_metric(["total"], host["memory_total"])
        mem.add_metric(["available"], host["memory_available"])
        yield mem
        disk = GaugeMetricFamily("dsec_edge_host_disk_bytes", "Disk of the edge's state directory", labels=["kind"])
        disk.add_metric(["total"], host["disk_total"])
        disk.add_metric(["free"], host["disk_free"])
        yield disk
        yield GaugeMetricFamily("dsec_edge_sessions", "Open shell sessions", value=svc.session_count())

        problems = svc.selfcheck.problems()
        yield GaugeMetricFamily("dsec_edge_healthy", "1 unless host state is broken beyond repair (see health problems)",
                                value=0 if problems else 1)
        by_kind = GaugeMetricFamily("dsec_edge_host_problems", "Unrepaired host-state problems", labels=["kind"])
        repairs = CounterMetricFamily("dsec_edge_host_repairs", "Host state found vanished and made again",
                                      labels=["kind"])
        found = [f for be in svc.backends.by_kind.values() for f in be.host_problems]
        counted: dict[str, int] = {}
        for be in svc.backends.by_kind.values():
            for kind, n in be.repair_counts.items():
                counted[kind] = counted.get(kind, 0) + n
        for kind in HOST_KINDS:
            by_kind.add_metric([kind], sum(1 for f in found if f.kind == kind))
            repairs.add_metric([kind], counted.get(kind, 0))
        yield by_kind
        yield repairs
        yield from _registry_metrics(svc.backends)


def _registry_metrics(backends: EdgeBackends) -> Iterable[Metric]:
    """The registry layers' counters as of the last self-check pass (no call at scrape time)."""
    if backends.registry is None:
        return
    stats = backends.registry_stats
    up = 0 if stats.get("up") is False or backends.registry.recently_failed() else 1
    yield GaugeMetricFamily("dsec_edge_registry_up", "1 while the lazy loader answers and the registry has not failed "
                            "in the last minute", value=up)
    loader = stats.get("loader", {})
    for name, key, doc in (
        ("dsec_edge_lazy_bytes_fetched", "bytes_fetched", "Bytes of registry layers fetched by the lazy loader"),
        ("dsec_edge_lazy_chunks_fetched", "chunks_fetched", "Chunks fetched by the lazy loader"),
        ("dsec_edge_lazy_corrupt_chunks", "corrupt_chunks", "Chunks refused: their bytes did not match the table"),
        ("dsec_edge_lazy_read_errors", "read_errors", "Reads of lazily loaded layers that failed (EIO)"),
        ("dsec_edge_lazy_registry_errors", "registry_errors", "Failed fetch attempts against the registry"),
    ):
        yield CounterMetricFamily(name, doc, value=float(loader.get(key) or 0))
    cache = loader.get("cache", {})
    yield GaugeMetricFamily("dsec_edge_lazy_cache_bytes", "Bytes in the node's chunk cache",
                            value=float(cache.get("bytes") or 0))
    yield CounterMetricFamily("dsec_edge_registry_failures", "Registry lookups/auth that failed",
                              value=float(stats.get("registry_failures") or 0))
    yield CounterMetricFamily("dsec_edge_lazy_restarts", "Lazy loader processes restarted by the self-check",
                              value=float(stats.get("restarts") or 0))
