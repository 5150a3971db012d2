"""``dsec task``: a training job's task — create, show, set its scheduling, its sandboxes, its events.

Over the control plane's task API (``POST/GET /v1/tasks``, ``GET /v1/sandboxes?task=``,
``GET /v1/sched/events?task=``; docs/CONTROL.md, "Scheduling") through the SDK. A task's
``max`` is its quota (best effort), ``min`` the capacity guaranteed to it, ``priority``
(background, training, evaluation or 0..1000) decides who is preempted for whom, and
``preemption`` what may happen to its sandboxes then (pause, destroy, never).

``POST /v1/tasks`` always sets the quota it is given, so ``dsec task set`` reads the task
first and sends its current max unless ``--max`` is given: what is not named stays.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import click

from dsec.cli.clients import client
from dsec.cli.service import parse_size
from dsec.cli.term import age, human_size, say

KEYS = ("sandboxes", "cpu", "memory")


def parse_amounts(text: str, flag: str) -> dict[str, float]:
    """``sandboxes=N,cpu=C,memory=SIZE`` (any of them) -> {key: number}."""
    got: dict[str, float] = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        k = k.strip()
        if not sep or k not in KEYS or not v.strip():
            raise click.BadParameter(f"{part!r}: give sandboxes=N, cpu=C, memory=SIZE (e.g. sandboxes=64,cpu=32,"
                                     "memory=64G)", param_hint=flag)
        try:
            got[k] = parse_size(v, flag) if k == "memory" else (float(v) if k == "cpu" else int(v))
        except ValueError:
            raise click.BadParameter(f"{part!r}: {k} must be a number", param_hint=flag) from None
    return got


def _amounts(q: Any) -> str:
    """A quota (TaskQuota / Quota or None) as a person reads it; unset dimensions left out."""
    if q is None:
        return "-"
    parts = []
    for k in KEYS:
        v = getattr(q, k, None)
        if v is None:
            continue
        parts.append(f"{k}={human_size(v) if k == 'memory' else f'{v:g}'}")
    return ",".join(parts) or "-"


def _priority(p: int) -> str:
    """A priority by its name when it has one (``training``), else the number."""
    from dsec.spec.control import PRIORITY_VALUES

    return next((n for n, v in PRIORITY_VALUES.items() if v == p), str(p))


def _options(fn: Any) -> Any:
    for opt in reversed((
        click.option("--max", "max_", default=None, metavar="AMOUNTS",
                     help="The task's quota (its max, best effort): sandboxes=N,cpu=C,memory=SIZE."),
        click.option("--min", "min_", default=None, metavar="AMOUNTS",
                     help="Guaranteed capacity, held back for it: sandboxes=N,cpu=C,memory=SIZE (all three; "
                          "sandboxes=0,cpu=0,memory=0: none). Set by an ancestor project's token."),
        click.option("--priority", default=None, metavar="P",
                     help="background, training (default), evaluation, or 0..1000."),
        click.option("--preemption", type=click.Choice(["pause", "destroy", "never"]), default=None,
                     help="What may happen to its sandboxes when a more urgent create needs room."),
        click.option("--burst/--no-burst", default=None, help="Its creates may go to the burst pool."),
        click.option("--project", default=None, help="The task's project (default: the token's)."),
        click.option("--json", "as_json", is_flag=True),
    )):
        fn = opt(fn)
    return fn


def _body(max_: str | None, min_: str | None, priority: str | None, preemption: str | None,
          burst: bool | None, project: str | None) -> dict[str, Any]:
    prio: int | str | None = priority
    if priority is not None and priority.isdigit():
        prio = int(priority)
    elif priority is not None and priority not in ("background", "training", "evaluation"):
        raise click.BadParameter(f"{priority!r}: background, training, evaluation or 0..1000", param_hint="--priority")
    mn = None
    if min_ is not None:
        mn = parse_amounts(min_, "--min")
        missing = [k for k in KEYS if k not in mn]
        if missing:
            raise click.BadParameter(f"give all of sandboxes, cpu and memory (missing {', '.join(missing)}); "
                                     "0 for none", param_hint="--min")
    return {"quota": parse_amounts(max_, "--max") if max_ is not None else None, "min": mn, "priority": prio,
            "preemption": preemption, "burst": burst, "project": project}


def _quota_of(q: Any) -> dict[str, float]:
    return {k: v for k in KEYS if (v := getattr(q, k, None)) is not None}


def _show(t: Any, as_json: bool) -> None:
    if as_json:
        print(t.model_dump_json(indent=2))
        return
    rows = [
        ("task", f"{t.name} (project {t.project})"),
        ("priority", f"{_priority(t.priority)} ({t.priority})" if _priority(t.priority) != str(t.priority)
         else str(t.priority)),
        ("preemption", t.preemption),
        ("burst", "yes" if t.burst else "no"),
        ("max", _amounts(t.quota)),
        ("min", _amounts(t.min)),
        ("used", _amounts(t.used)),
        ("active", _amounts(t.active)),
    ]
    if t.stages:
        rows.append(("stages", ", ".join(t.stages) + (f" (now {t.stage})" if t.stage else "")))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")


@click.group("task")
def task_group() -> None:
    """Tasks: a training job's sandboxes with their quota, priority and guaranteed minimum."""


@task_group.command("create")
@click.argument("name")
@_options
def create(name: str, max_: str | None, min_: str | None, priority: str | None, preemption: str | None,
           burst: bool | None, project: str | None, as_json: bool) -> None:
    """Make a task (or set every field given on one that exists)."""
    b = _body(max_, min_, priority, preemption, burst, project)
    with client() as c:
        t = c.create_task(name, quota=b["quota"] or {}, min=b["min"], priority=b["priority"],
                          preemption=b["preemption"], burst=b["burst"], project=b["project"])
    _show(t, as_json)


@task_group.command("set")
@click.argument("name")
@_options
def set_(name: str, max_: str | None, min_: str | None, priority: str | None, preemption: str | None,
         burst: bool | None, project: str | None, as_json: bool) -> None:
    """Change a task's max, min, priority, preemption or burst; what is not named stays."""
    b = _body(max_, min_, priority, preemption, burst, project)
    if all(b[k] is None for k in ("quota", "min", "priority", "preemption", "burst")):
        raise click.UsageError("nothing to set: give --max, --min, --priority, --preemption or --burst/--no-burst")
    with client() as c:
        now = c.task(name)  # NotFound (one line) for a task that does not exist
        quota = b["quota"] if b["quota"] is not None else _quota_of(now.quota)
        t = c.create_task(name, quota=quota, min=b["min"], priority=b["priority"], preemption=b["preemption"],
                          burst=b["burst"], project=b["project"] or now.project)
    _show(t, as_json)


@task_group.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def show(name: str, as_json: bool) -> None:
    """A task's scheduling, quota (max), minimum, what it uses and holds now, its stages."""
    with client() as c:
        t = c.task(name)
    _show(t, as_json)


@task_group.command("ls")
@click.option("--json", "as_json", is_flag=True)
def ls(as_json: bool) -> None:
    """The tasks of your project and the projects below it."""
    with client() as c:
        items = c.tasks()
    if as_json:
        print(json.dumps([t.model_dump(mode="json") for t in items], indent=2))
        return
    rows = [("TASK", "PROJECT", "PRIORITY", "PREEMPTION", "MAX", "MIN", "USED")]
    rows += [(t.name, t.project, _priority(t.priority), t.preemption, _amounts(t.quota), _amounts(t.min),
              _amounts(t.used)) for t in items]
    _table(rows)


@task_group.command("sandboxes")
@click.argument("name")
@click.option("--state", default=None, help="Only this state (default: every state but stopped).")
@click.option("--json", "as_json", is_flag=True)
def sandboxes(name: str, state: str | None, as_json: bool) -> None:
    """The task's sandboxes, with what the scheduler did to them (PREEMPTED)."""
    with client() as c:
        c.task(name)  # a task that does not exist is an error, not an empty list
        items = c.list(task=name, state=state)
    if as_json:
        print(json.dumps([i.model_dump(mode="json", exclude={"token"}) for i in items], indent=2))
        return
    now = time.time()
    rows = [("ID", "STATE", "EDGE", "PREEMPTED", "AGE")]
    for i in items:
        p = i.preemption
        pre = f"{p.action} by priority {p.by_priority}" if p is not None else ""
        rows.append((i.id, str(i.state.value), str(i.edge_id or ""), pre, age(now - float(i.created_at or now))))
    _table(rows)


@task_group.command("events")
@click.argument("name")
@click.option("--since", type=float, default=None, help="After this time (the last event's AT).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def events(name: str, since: float | None, limit: int, as_json: bool) -> None:
    """What the scheduler did to the task's sandboxes (preempted, resumed), oldest first."""
    with client() as c:
        c.task(name)
        items = c.sched_events(task=name, since=since, limit=limit)
    if as_json:
        print(json.dumps([e.model_dump(mode="json") for e in items], indent=2))
        return
    rows = [("AT", "EVENT", "SANDBOX", "ACTION", "BY PRIORITY", "REASON")]
    rows += [(f"{e.at:.3f}", e.kind, e.sandbox_id or "", e.action or "",
              "" if e.by_priority is None else _priority(e.by_priority), e.reason) for e in items]
    _table(rows)
    if not items:
        say(f"task {name}: no scheduling events")


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


__all__ = ["parse_amounts", "task_group"]
