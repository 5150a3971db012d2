"""IAM quota arithmetic (pure) and its store transactions on an embedded SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.control import iam
from dsec.control.db import Store
from dsec.control.errors import Conflict, NotFound
from dsec.control.iam import (
    Amount,
    Principal,
    check_child_covers_itself,
    check_fits,
    check_task_fits,
    cpu_to_m,
)
from dsec.errors import AuthError, Forbidden, QuotaExceeded
from dsec.spec import Resources
from dsec.spec.api import Quota, TaskQuota

GiB = 1024**3


def test_cpu_is_exact_in_millicores() -> None:
    assert cpu_to_m(0.1) * 3 == cpu_to_m(0.3) == 300  # 0.1 + 0.2 != 0.3 in floats; here it is
    assert cpu_to_m(0.0001) == 1  # a positive request never rounds to nothing
    assert cpu_to_m(0) == 0
    assert Amount.of_resources(Resources(cpu=0.5, memory=GiB), 4) == Amount(4, 2000, 4 * GiB)
    assert Amount.of_quota(Quota(sandboxes=2, cpu=1.5, memory=3)).to_quota() == Quota(sandboxes=2, cpu=1.5, memory=3)


def test_amount_vector_ops() -> None:
    a, b = Amount(1, 2, 3), Amount(10, 20, 30)
    assert a + b == Amount(11, 22, 33) and b - a == Amount(9, 18, 27) and a * 3 == Amount(3, 6, 9)
    assert (b - a).exceeds(a) == ["sandboxes", "cpu", "memory"]
    assert Amount(1, 30, 3).exceeds(Amount(5, 20, 5)) == ["cpu"]


def test_check_fits_counts_own_use_and_children_carve() -> None:
    q = Amount(10, 10_000, 10 * GiB)
    check_fits(project="p", quota=q, used=Amount(4, 4000, 4 * GiB), reserved=Amount(5, 5000, 5 * GiB),
               want=Amount(1, 1000, GiB))  # exactly full: fine
    with pytest.raises(QuotaExceeded) as ei:
        check_fits(project="p", quota=q, used=Amount(4, 4000, 4 * GiB), reserved=Amount(5, 5000, 5 * GiB),
                   want=Amount(1, 1500, GiB))
    e = ei.value
    assert e.code == "quota_exceeded" and e.project == "p" and e.resource == "cpu"
    assert e.limit == 10.0 and e.used == 4.0 and e.reserved == 5.0 and e.requested == 1.5 and e.available == 1.0
    assert e.to_wire()["dimensions"] == ["cpu"]


def test_task_ceiling_is_per_dimension() -> None:
    check_task_fits(task="t", project="p", quota=TaskQuota(), used=Amount(10**6, 0, 0), want=Amount(1, 1, 1))
    with pytest.raises(QuotaExceeded) as ei:
        check_task_fits(task="t", project="p", quota=TaskQuota(sandboxes=2), used=Amount(2, 0, 0),
                        want=Amount(1, 1000, GiB))
    assert ei.value.task == "t" and ei.value.resource == "sandboxes" and ei.value.available == 0


def test_shrinking_below_use_or_carve_is_refused() -> None:
    check_child_covers_itself(project="p", new=Amount(5, 5000, 5), used=Amount(2, 2000, 2), reserved=Amount(3, 3000, 3))
    with pytest.raises(QuotaExceeded) as ei:
        check_child_covers_itself(project="p", new=Amount(4, 5000, 5), used=Amount(2, 2000, 2),
                                  reserved=Amount(3, 3000, 3))
    assert ei.value.resource == "sandboxes"


# ------------------------------------------------------------ store-backed ----


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'c.db'}", threads=2)
    s.migrate()
    return s


def _root(store: Store, quota: Quota) -> tuple[Principal, str]:
    _, tok = store.run_sync(lambda s: iam.bootstrap(s, root="root", quota=quota, token_secret=None), write=True)
    assert tok is not None and tok.startswith("dsk_")
    who = store.run_sync(lambda s: iam.principal_for_token(s, tok), write=False)
    return who, tok


def _q(n: int) -> Quota:
    return Quota(sandboxes=n, cpu=n, memory=n * GiB)


def test_nested_carving_to_any_depth(store: Store) -> None:
    root, _ = _root(store, _q(100))
    w = lambda fn: store.run_sync(fn, write=True)  # noqa: E731
    w(lambda s: iam.create_project(s, root, "a", None, _q(60)))
    w(lambda s: iam.create_project(s, root, "b", None, _q(40)))
    with pytest.raises(QuotaExceeded) as ei:  # root is fully carved: nothing left for c
        w(lambda s: iam.create_project(s, root, "c", None, _q(1)))
    assert ei.value.project == "root" and ei.value.reserved == 100
    w(lambda s: iam.create_project(s, root, "a1", "a", _q(30)))
    w(lambda s: iam.create_project(s, root, "a11", "a1", _q(30)))
    w(lambda s: iam.create_project(s, root, "a111", "a11", _q(10)))
    with pytest.raises(QuotaExceeded):  # a has 60: 30 to a1, so 31 more does not fit
        w(lambda s: iam.create_project(s, root, "a2", "a", _q(31)))
    infos = {p.name: p for p in store.run_sync(lambda s: iam.list_projects(s, root), write=False)}
    assert infos["a"].reserved.sandboxes == 30 and infos["a1"].reserved.sandboxes == 30
    assert infos["a11"].parent == "a1" and infos["a111"].parent == "a11"
    # a project cannot grow past what its parent has left, nor shrink below its children
    with pytest.raises(QuotaExceeded):
        w(lambda s: iam.update_project(s, root, "a1", _q(61)))
    with pytest.raises(QuotaExceeded):
        w(lambda s: iam.update_project(s, root, "a11", _q(9)))
    w(lambda s: iam.update_project(s, root, "a1", _q(60)))
    assert store.run_sync(lambda s: iam.project_info(s, iam.visible_project(s, root, "a")), write=False).reserved.sandboxes == 60
    # deleting a leaf gives its quota back to the parent
    w(lambda s: iam.delete_project(s, root, "a111"))
    assert store.run_sync(lambda s: iam.project_info(s, iam.visible_project(s, root, "a11")), write=False).reserved.sandboxes == 0
    with pytest.raises(Conflict):
        w(lambda s: iam.delete_project(s, root, "a1"))  # it has a child


def test_tokens_see_their_subtree_only(store: Store) -> None:
    root, _ = _root(store, _q(100))
    w = lambda fn: store.run_sync(fn, write=True)  # noqa: E731
    r = lambda fn: store.run_sync(fn, write=False)  # noqa: E731
    w(lambda s: iam.create_project(s, root, "team", None, _q(50)))
    w(lambda s: iam.create_project(s, root, "other", None, _q(10)))
    tok = w(lambda s: iam.create_token(s, root, "team", "ci"))
    assert tok.token and tok.token.startswith("dsk_") and len(tok.token) > 40
    team = r(lambda s: iam.principal_for_token(s, tok.token))
    assert team.project == "team" and not team.is_root
    w(lambda s: iam.create_project(s, team, "sub", None, _q(5)))  # parent defaults to the caller
    assert [p.name for p in r(lambda s: iam.list_projects(s, team))] == ["team", "sub"]
    with pytest.raises(NotFound):
        r(lambda s: iam.visible_project(s, team, "other"))
    with pytest.raises(NotFound):
        w(lambda s: iam.create_project(s, team, "x", "root", _q(1)))
    with pytest.raises(Forbidden):
        w(lambda s: iam.update_project(s, team, "team", _q(500)))  # no raising your own quota
    # only the hash is stored; revocation is immediate and idempotent
    from dsec.control.db import ApiToken

    stored = r(lambda s: s.get(ApiToken, tok.id))
    assert stored is not None and tok.token not in stored.hash and len(stored.hash) == 64
    w(lambda s: iam.revoke_token(s, team, tok.id))
    w(lambda s: iam.revoke_token(s, team, tok.id))
    with pytest.raises(AuthError):
        r(lambda s: iam.principal_for_token(s, tok.token))
    with pytest.raises(AuthError):
        r(lambda s: iam.principal_for_token(s, "dsk_nope"))


def test_bootstrap_is_idempotent_and_keeps_a_configured_token(store: Store) -> None:
    secret = "dsk_" + "x" * 43
    for _ in range(2):
        _, made = store.run_sync(
            lambda s: iam.bootstrap(s, root="root", quota=_q(5), token_secret=secret), write=True
        )
        assert made is None
    who = store.run_sync(lambda s: iam.principal_for_token(s, secret), write=False)
    assert who.is_root and who.project == "root"


def test_tasks_are_created_on_first_use_and_listed(store: Store) -> None:
    root, _ = _root(store, _q(100))
    w = lambda fn: store.run_sync(fn, write=True)  # noqa: E731
    info = w(lambda s: iam.create_task(s, root, "job-1", TaskQuota(sandboxes=3)))
    assert info.quota.sandboxes == 3 and info.quota.cpu is None
    again = w(lambda s: iam.create_task(s, root, "job-1", TaskQuota(sandboxes=4)))  # PUT-like
    assert again.quota.sandboxes == 4
    w(lambda s: iam.get_or_create_task(s, root.project_id, "job-2", lock=True))
    assert [t.name for t in store.run_sync(lambda s: iam.list_tasks(s, root), write=False)] == ["job-1", "job-2"]
