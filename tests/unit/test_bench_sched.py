"""``dsec bench sched`` at a 40th of the cell (4 edges, the same day shape, its jobs asking 30 %
more so the peak hour saturates it): the simulation runs the control plane's scheduling code
and its checks hold. The full day at full scale is the bench's business."""

from __future__ import annotations

from dsec.bench.sched import run


def test_the_busiest_hour_at_a_fortieth_of_the_cell() -> None:
    got = run(quick=True, scale=1 / 40, load=1.3, say=lambda _: None)
    assert got["sim_edges"] == 4 and got["sim_window_h"] == 1.0
    assert got["sim_creates"] > 5_000
    # the eval run at 15:00 (800 sandboxes at 125/s here) preempts elastic work on a full cell
    assert got["sim_preemptions_pause"] > 0 and got["sim_preemptions_destroy"] > 0 and got["sim_resumes"] > 0
    assert got["sim_burst_creates_frac"] > 0
    assert got["sim_overcommit_violations"] == 0
    assert got["sim_min_guarantee_violations"] == 0
    assert got["sim_edge_refusals"] == 0  # the control plane's books and the edges' admission agree
    assert 0.5 < got["sim_utilisation_mean"] <= 1.0
