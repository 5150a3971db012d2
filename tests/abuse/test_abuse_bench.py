"""The flat JSON of ``dsec bench abuse`` (pure functions: no root, no sandboxes)."""

from __future__ import annotations

from dsec.bench.abuse_cases import CASES, MIN_RATIO_SAMPLES, Check, Outcome, outcomes_json


def _outcome(name: str, ok: bool, p50: float | None, n: int, skipped: str | None = None) -> Outcome:
    return Outcome(name, [Check("x", ok)], neighbour_p50_ms=p50, neighbour_execs=n, skipped=skipped)


def test_flat_json_counts_and_ratios() -> None:
    outs = [
        _outcome("a", True, 4.0, MIN_RATIO_SAMPLES),
        _outcome("b", False, 9.0, MIN_RATIO_SAMPLES + 5),
        _outcome("c", True, 50.0, 2),            # too few samples for the max
        _outcome("d", True, None, 0, skipped="no edge"),
    ]
    res = outcomes_json(outs, 2.0)
    assert res["cases_total"] == 3 and res["cases_contained"] == 2 and res["cases_skipped"] == 1
    assert res["case_a"] is True and res["case_b"] is False and res["case_d"] is None
    assert res["neighbour_ratio_a"] == 2.0 and res["neighbour_ratio_b"] == 4.5 and res["neighbour_ratio_c"] == 25.0
    assert res["neighbour_ratio_d"] is None
    assert res["neighbour_p50_ratio_max"] == 4.5 and res["neighbour_p50_ratio_max_case"] == "b"
    assert res["cases_not_contained"] == "b"
    assert all(isinstance(v, (bool, int, float, str)) or v is None for v in res.values()), "JSON must stay flat"


def test_an_outcome_without_checks_or_with_an_error_is_not_contained() -> None:
    assert not Outcome("empty").contained
    assert not Outcome("err", [Check("x", True)], error="boom").contained
    assert Outcome("ok", [Check("x", True)]).contained
    failed = Outcome("f", [Check("x", False, b"detail")])
    assert not failed.contained and failed.failures() == ["x: b'detail'"]


def test_cases_are_complete() -> None:
    """Every case the issue lists has a case here (names as in docs/SECURITY.md)."""
    names = {c.name for c in CASES}
    required = {"fork_bomb", "memory_hog", "disk_fill", "output_flood", "cpu_spin", "grep_everything", "port_scan",
                "sysctl_writes", "mount_games", "namespaces", "ptrace", "kernel_surfaces", "kernel_modules", "clock",
                "reboot", "raw_sockets", "proc_tricks", "device_nodes", "inode_exhaustion", "thread_exhaustion",
                "files_api_links", "edge_malformed", "edge_oversized_upload", "platform_secrets", "forged_edge_calls",
                "memfd_exec", "kill_everything", "huge_rlimits", "personality"}
    assert required <= names, required - names
    for c in CASES:
        assert c.attack and c.asserts and c.defence, c.name


def test_the_totals_cover_every_suite_run() -> None:
    """``dsec bench abuse`` reports the container, FnCall and gVisor suites side by side and one
    verdict over all of them (issue 22)."""
    from dsec.bench.abuse import SUITES, _totals

    assert SUITES == ("container", "fncall", "gvisor")
    res = {"cases_total": 3, "cases_contained": 3, "cases_not_contained": "",
           "fncall_cases_total": 40, "fncall_cases_contained": 39, "fncall_cases_not_contained": "fncall_x",
           "gvisor_cases_total": 18, "gvisor_cases_contained": 18, "gvisor_cases_not_contained": ""}
    _totals(res, list(SUITES))
    assert res["all_cases_total"] == 61 and res["all_cases_contained"] == 60
    assert res["all_contained"] is False and res["all_cases_not_contained"] == "fncall_x"
    ok = {"cases_total": 2, "cases_contained": 2, "gvisor_cases_total": 1, "gvisor_cases_contained": 1}
    _totals(ok, ["container", "gvisor"])
    assert ok["all_contained"] is True and ok["all_cases_total"] == 3
    none: dict[str, object] = {}
    _totals(none, ["fncall"])
    assert none["all_contained"] is False  # nothing ran is no verdict
