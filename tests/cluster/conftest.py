"""The cluster suite's lab: edges as hosts in network namespaces on a bridge, control-plane
replicas as processes, PostgreSQL, a registry (``dsec.bench.netlab``; docs/CONTROL.md,
"Testing a cluster on one machine").

``lab(...)`` makes one per test, named after this session (``<session token>`` in the
bridge, veth and namespace names; runtimes ``<RT_PREFIX>-l<k>c<n>``, so the session's
leak check covers their cgroups, mounts and processes), and removes it all at the end
whatever a fault left behind. Long fault tests are ``slow``; ``bench cluster`` runs the
same scenarios (dsec/bench/cluster_faults.py).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import RT_PREFIX, SESSION_TOKEN, netns_names

_count = itertools.count()


@pytest.fixture
def lab(dsec_base: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``lab(replicas=1, postgres=False, edges=2, **timings)`` -> a started :class:`Lab`."""
    from dsec.bench import netlab
    from dsec.bench.postgres import unavailable as pg_unavailable

    problem = netlab.unavailable()
    if problem is not None:
        pytest.skip(problem)
    made: list[Any] = []

    def make(*, replicas: int = 1, postgres: bool = False, edges: int = 2, **timings: Any) -> Any:
        if postgres and pg_unavailable() is not None:
            pytest.skip(str(pg_unavailable()))
        k = next(_count)
        lab = netlab.Lab(tag=f"{SESSION_TOKEN[:4]}{k:02x}"[:6], base=tmp_path / f"lab{k}", run_dir=dsec_base / "run",
                         runtime_prefix=f"{RT_PREFIX}-l{k}", timings=netlab.LabTimings(**timings))
        made.append(lab)
        lab.start(replicas=replicas, postgres=postgres)
        for n in range(1, edges + 1):
            lab.add_edge(n)
        return lab

    try:
        yield make
    finally:
        problems: list[str] = []
        for lab in made:
            with contextlib.suppress(Exception):
                problems += lab.close()
        left = [n for n in netns_names() if any(n.startswith(f"dsec-lab-{lab.tag}-") for lab in made)]
        assert not left, f"network namespaces left: {left}"
        assert not problems, problems
