"""The ``dsec`` command. Sub-commands import their heavy parts lazily.

Importing this module costs click and the standard library only: ``dsec exec``, ``run``,
``cp``, ``ls`` and ``rm`` then talk to the service through the lean client
(cli/lean.py), and pydantic, httpx, rich and asyncio are imported by the commands that
need them (tests/unit/test_cli_lean.py checks it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from dsec.cli.term import console, say, table
from dsec.errors import DsecError


def _unreachable(exc: BaseException) -> str | None:
    """One line for a failure to reach the service through httpx (the SDK's commands)."""
    if not type(exc).__module__.startswith(("httpx", "httpcore")):
        return None
    import os

    from dsec.cli.paths import DEFAULT_URL

    url = os.environ.get("DSEC_URL") or DEFAULT_URL
    reason: str = str(exc)
    cause: BaseException | None = exc
    while cause is not None:  # the OSError underneath says it plainly ("connection refused")
        if isinstance(cause, OSError) and cause.strerror:
            reason = cause.strerror.lower()
            break
        cause = cause.__cause__ or cause.__context__
    return f"cannot reach the DSec control plane at {url} (DSEC_URL): {reason}; is `dsec up` running?"


class _Group(click.Group):
    """Every failure a person can cause is one line on stderr, never a traceback: a DsecError
    (exit 1), bad usage (exit 2, naming the command's --help), a service that cannot be
    reached (exit 1), Ctrl-C (exit 130)."""

    LAZY = {"image": "dsec.cli.image:image_group", "edge": "dsec.cli.edge:edge_group", "env": "dsec.cli.env:env_group",
            "task": "dsec.cli.task:task_group"}
    """Command groups whose module is imported only when they are used (or listed)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.LAZY and name not in self.commands:
            import importlib

            module, _, attr = self.LAZY[name].partition(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "dsec"
            say(f"error: {exc.format_message()} (see `{where} --help`)")
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            say(f"error: {exc.format_message()}")
            sys.exit(exc.exit_code)
        except (click.Abort, KeyboardInterrupt):
            sys.exit(130)
        except DsecError as exc:
            say(f"error: {exc}")
            sys.exit(1)
        except Exception as exc:
            line = _unreachable(exc)
            if line is None:
                raise
            say(f"error: {line}")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Group)
@click.version_option(package_name="dsec")
def main() -> None:
    """DSec: sandboxes for agentic RL training."""


from dsec.cli.service import register as _register_service  # noqa: E402

_register_service(main)

from dsec.cli.policy import register as _register_policy  # noqa: E402

_register_policy(main)


@main.group()
def bench() -> None:
    """Benchmarks: figures beside named baselines, measured in the same run."""


def _print_table(title: str, results: dict[str, Any]) -> None:
    from rich.console import Console

    t = table("metric", title=title)
    t.add_column("value", justify="right")
    for k, v in results.items():
        t.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(t)


def _report(title: str, results: dict[str, Any], json_path: Path | None, *, suite: str | None = None,
            series: dict[str, Any] | None = None, html_out: Path | None = None) -> None:
    """Every bench ends alike: the table, then the flat JSON when asked for; a suite with charts
    (``suite``) also writes its series beside the JSON and the HTML report (``html_out``, or
    beside the JSON: dsec.bench.report)."""
    _print_table(title, results)
    if json_path:
        json_path.write_text(json.dumps(results, indent=2, sort_keys=True))
        console.print(f"wrote {json_path}")
    if suite is None:
        return
    from dsec.bench import report

    if json_path and series:
        report.save_series(report.series_path(json_path), suite, series)
        console.print(f"wrote {report.series_path(json_path)}")
    out = html_out or (report.html_path(json_path) if json_path else None)
    if out is not None:
        _write_html(out, title, suite, results, series or {})


def _write_html(out: Path, title: str, suite: str, results: dict[str, Any], series: dict[str, Any]) -> None:
    """The HTML report; never fails the bench (its results are written already): one line instead."""
    from dsec.bench import report

    try:
        report.write_report(out, title, report.suite_figures(suite, results, series), results)
    except report.ReportUnavailable as exc:
        say(f"note: {exc}")
        return
    except Exception as exc:
        say(f"warning: no HTML report: {type(exc).__name__}: {exc}")
        return
    console.print(f"wrote {out}")


def _html_option(f: Any) -> Any:
    return click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path),
                        help="Write the HTML report with charts here (default: beside --json, its name "
                             "ending .html; needs matplotlib: the `bench` extra).")(f)


@bench.command("runtime")
@click.option("--quick", is_flag=True, help="Fewer samples; N=200 and 50 written sandboxes instead of 10,000 and 1,000.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
@click.option("-n", "--keep", "n_keep", type=click.IntRange(10, 20000), default=None,
              help="Sandboxes each runtime (DSec, crun, bwrap) creates and keeps, as many in flight for each (default "
                   "10,000, or the most MemAvailable holds; 200 with --quick).")
@click.option("--order", default=None, metavar="RT,RT,RT",
              help="Order of the runtimes, e.g. crun,dsec,bwrap (default: rotates from run to run).")
@click.option("--written-n", type=click.IntRange(1, 20000), default=None,
              help="Sandboxes per writable-layer medium that each write 50 MiB (default 1,000; 50 with --quick). "
                   "The memory medium runs at most what MemAvailable holds, the disk medium what the disk holds.")
@click.option("--debian/--no-debian", default=None,
              help="Also measure on a Debian rootfs (default: on, except with --quick). Built once with debootstrap.")
@click.option("--gvisor/--no-gvisor", default=None,
              help="Also measure the gVisor backend beside the container backend (default: when runsc is installed).")
@_html_option
def bench_runtime(quick: bool, json_path: Path | None, n_keep: int | None, order: str | None,
                  written_n: int | None, debian: bool | None, gvisor: bool | None, html_out: Path | None) -> None:
    """Create latency, create-and-keep at the same N, idle memory, kernel state, exec, teardown: DSec vs crun vs bwrap."""
    from dsec.bench.runtime import parse_order, run

    try:
        runtimes = parse_order(order) if order is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--order") from None
    series: dict[str, Any] = {}
    results = run(quick=quick, n_keep=n_keep, order=runtimes, written_n=written_n, debian=debian, gvisor=gvisor,
                  say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False), series=series)
    _report("dsec bench runtime", results, json_path, suite="runtime", series=series, html_out=html_out)


@bench.command("service")
@click.option("--quick", is_flag=True, help="Fewer samples; 200 sandboxes instead of 1,000.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
def bench_service(quick: bool, json_path: Path | None) -> None:
    """SDK against the all-in-one (1 and 3 edges) beside direct runtime calls."""
    from dsec.bench.service import run

    results = run(quick=quick, say=lambda m: console.print(f"[dim]{m}[/dim]"))
    _report("dsec bench service", results, json_path)


@bench.command("snapshot")
@click.option("--quick", is_flag=True,
              help="Fewer samples; 1 GB pack and 1,000-sandbox group figures scaled from 256 MB and 200.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
def bench_snapshot(quick: bool, json_path: Path | None) -> None:
    """pack_diff by diff size, start from a snapshot vs base, fork(32), pause/resume, group pause, idle density."""
    from dsec.bench.snapshot import run

    results = run(quick=quick, say=lambda m: console.print(f"[dim]{m}[/dim]"))
    _report("dsec bench snapshot", results, json_path)


@bench.command("cli")
@click.option("--quick", is_flag=True, help="Fewer runs: 10 execs and 5 runs instead of 40 and 20.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
def bench_cli(quick: bool, json_path: Path | None) -> None:
    """Wall time of `dsec exec ID -- /bin/true` and `dsec run busybox -- /bin/true` as processes,
    against an all-in-one the bench starts, beside `podman run --rm` (when installed)."""
    from dsec.bench.cli import run

    results = run(quick=quick, say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False))
    _report("dsec bench cli", results, json_path)


@bench.command("fncall")
@click.option("--quick", is_flag=True, help="Fewer calls: 100 in a row and 300 at once instead of 300 and 2,000.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
def bench_fncall(quick: bool, json_path: Path | None) -> None:
    """Function calls on warm numpy workers: latency through the SDK, calls/s on this machine,
    vs a sandbox per call (create + exec + destroy, same run), isolation cases."""
    from dsec.bench.fncall import run

    results = run(quick=quick, say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False))
    _report("dsec bench fncall", results, json_path)


@bench.command("images")
@click.option("--quick", is_flag=True, help="The python image only (no ~1 GB toolchain image), fewer warm samples.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
@_html_option
def bench_images(quick: bool, json_path: Path | None, html_out: Path | None) -> None:
    """Registry layers on a shaped link: bytes read lazily, first exec lazy vs full pull, a burst
    of 32, warm exec vs a local layer, chunk fetch latency, FUSE read rate, a corrupt chunk."""
    from dsec.bench.images import run

    series: dict[str, Any] = {}
    results = run(quick=quick, say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False), series=series)
    _report("dsec bench images", results, json_path, suite="images", series=series, html_out=html_out)


@bench.command("compat")
@click.option("--quick", is_flag=True, help="Fewer calls: 20 python, 10 C++ and 128 at once instead of 100, 40 and 640.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
@click.option("--phase", "phases", multiple=True, type=click.Choice(["sandboxfusion", "sf_languages", "sf_verl", "swerex"]),
              help="Run only this phase (repeatable; default: all).")
def bench_compat(quick: bool, json_path: Path | None, phases: tuple[str, ...]) -> None:
    """Other services' clients, unchanged, against DSec: SandboxFusion's API through its released client
    (python and C++ latency, calls/s at 64 in flight, vs a local subprocess in the same run); each of its
    languages DSec serves beside a local run, the toolkit layers' sizes (sf_languages); SWE-ReX."""
    from dsec.bench.compat import run

    results = run(quick=quick, phases=list(phases) or None,
                  say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False))
    _report("dsec bench compat", results, json_path)


@bench.command("e2b")
@click.option("--quick", is_flag=True, help="10 sequential calls of each kind and 64 creates at once instead of 40 "
                                            "and 256.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
def bench_e2b(quick: bool, json_path: Path | None) -> None:
    """E2B's released clients against DSec's E2B front, beside DSec's SDK in the same run: create, commands.run,
    run_code, a 1 MiB files.write, 256 AsyncSandboxes at once (docs/COMPAT.md, "E2B")."""
    from dsec.bench.e2b import run

    results = run(quick=quick, say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False))
    _report("dsec bench e2b", results, json_path)


@bench.command("vm")
@click.option("--quick", is_flag=True, help="3 cold boots, 8 creates, 20 idle clones (a smoke test); full: 10, 20, 300.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
@_html_option
def bench_vm(quick: bool, json_path: Path | None, html_out: Path | None) -> None:
    """The microVM backend beside the container backend in one run: cold boot, create from a template to the
    first exec, fan-out of 10, exec, idle memory and CPU per clone, pause; with the accelerator (vm_accel),
    QEMU, guest kernel and RAM (docs/MICROVM.md)."""
    from dsec.bench.vm import run

    series: dict[str, Any] = {}
    results = run(quick=quick, say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False), series=series)
    _report("dsec bench vm", results, json_path, suite="vm", series=series, html_out=html_out)


@bench.command("cluster")
@click.option("--quick", is_flag=True, help="3,000 creates per phase instead of 20,000.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
@click.option("--faults/--no-faults", default=True, show_default=True,
              help="Then the fault phase: real edges in network namespaces; an edge SIGKILLed, one cut off and "
                   "healed, a replica SIGKILLed mid-burst (edge_loss_detect_s, partition_fenced_ok, failover_*).")
@_html_option
def bench_cluster(quick: bool, json_path: Path | None, faults: bool, html_out: Path | None) -> None:
    """The create path at cluster rates: creates/s of one and two control-plane replicas on a
    throwaway PostgreSQL, per-sandbox creates and create leases, edges that are in-process
    stand-ins answering at once (not real edges: stated in the results); then what happens
    when edges and replicas fail (dsec/bench/cluster_faults.py)."""
    from dsec.bench import cluster

    if faults:
        from dsec.bench import cluster_faults

        cluster.EXTRA_PHASES.setdefault("faults", cluster_faults.run)
    series: dict[str, Any] = {}
    results = cluster.run(quick=quick, say=lambda m: console.print(f"[dim]{m}[/dim]"), series=series)
    _report("dsec bench cluster", results, json_path, suite="cluster", series=series, html_out=html_out)


@bench.command("report")
@click.argument("json_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--suite", type=click.Choice(["runtime", "images", "cluster", "vm"]), default=None,
              help="The suite that wrote the JSON (default: named by its series file beside it).")
@_html_option
@click.option("--png-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write each chart as its own PNG here (for docs).")
def bench_report(json_path: Path, suite: str | None, html_out: Path | None, png_dir: Path | None) -> None:
    """Draw a bench's charts again from its JSON and the series file beside it (dsec bench <suite> --json
    writes both): the HTML report, and each chart as a PNG with --png-dir."""
    from dsec.bench import report

    results = json.loads(json_path.read_text())
    series: dict[str, Any] = {}
    side = report.series_path(json_path)
    if side.exists():
        named, series = report.load_series(side)
        suite = suite or named
    if suite is None:
        raise click.UsageError(f"no series file {side} names the suite: give --suite")
    title = f"dsec bench {suite}"
    figs = report.suite_figures(suite, results, series)
    try:
        out = report.write_report(html_out or report.html_path(json_path), title, figs, results)
        console.print(f"wrote {out}")
        if png_dir is not None:
            for p in report.write_pngs(png_dir, figs, prefix="bench-"):
                console.print(f"wrote {p}")
    except report.ReportUnavailable as exc:
        raise click.ClickException(str(exc)) from None


@bench.command("sched")
@click.option("--quick", is_flag=True, help="The busiest hour (14:30-15:30, with a 32K evaluation burst) instead of the day.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
@click.option("--seed", type=int, default=1, show_default=True)
def bench_sched(quick: bool, json_path: Path | None, seed: int) -> None:
    """A day of a 160-edge x 190-core cell, simulated (discrete events) with the control plane's own
    scheduling code: placement, quota checks, preemption, elastic minimums, the burst pool and each
    edge's admission; ~380K concurrent sandboxes at the peak, evaluations bursting at 5,000 creates/s
    (dsec/bench/sched.py)."""
    from dsec.bench.sched import run

    results = run(quick=quick, seed=seed, say=lambda m: console.print(f"[dim]{m}[/dim]"))
    _report("dsec bench sched", results, json_path)


@bench.command("abuse")
@click.option("--quick", is_flag=True, help="Shorter floods and spins, 2 neighbours, fewer network/stage samples (< ~3 min).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the flat JSON here.")
@click.option("-k", "--neighbours", "k", type=click.IntRange(1, 64), default=None,
              help="Neighbour sandboxes running a steady exec workload (default 4; 2 with --quick).")
@click.option("--case", "only", multiple=True, help="Run only this case (repeatable).")
@click.option("--suite", "suites", multiple=True, type=click.Choice(["container", "fncall", "gvisor"]),
              help="Run only this red-team suite (repeatable; default all three).")
def bench_abuse(quick: bool, json_path: Path | None, k: int | None, only: tuple[str, ...],
                suites: tuple[str, ...]) -> None:
    """Abuse suites (container, FnCall, gVisor): each attack contained? neighbours' exec p50 during it vs
    quiet; network/stage figures."""
    from dsec.bench.abuse import run

    results = run(quick=quick, k_neighbours=k, only=list(only) or None, suites=list(suites) or None,
                  say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False))
    _report("dsec bench abuse", results, json_path)


@main.command()
@click.option("-n", "count", type=click.IntRange(1, 5000), default=None, help="Rollouts / sandboxes (default 64; 100 with --runtime-only).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="State directory (default $DSEC_STATE_DIR or /var/lib/dsec).")
@click.option("--runtime-only", is_flag=True, help="The node-runtime demo (busybox, no service, no network needed).")
def demo(count: int | None, state_dir: Path | None, runtime_only: bool) -> None:
    """The main job: agent rollouts through the SDK against the all-in-one (control plane + edge)."""
    import asyncio

    if runtime_only:
        asyncio.run(_demo(count or 100, state_dir))
        return
    from dsec.cli.up import data_dir_default
    from dsec.demo.rollouts import run_demo

    rollouts = asyncio.run(run_demo(state_dir or data_dir_default(), n=count or 64, say=lambda m: console.print(m)))
    failed = [r for r in rollouts if r.error]
    if failed:
        raise DsecError(f"{len(failed)} of {len(rollouts)} rollouts failed")


async def _demo(count: int, state_dir: Path | None) -> None:
    import asyncio

    from rich.console import Console
    from rich.table import Table

    from dsec.backends.container.runtime import ContainerRuntime
    from dsec.bench.stats import percentile
    from dsec.images.build import build_busybox
    from dsec.spec import ImageRef, Resources, SandboxSpec

    async with ContainerRuntime(name="demo", state_dir=state_dir) as rt:
        t0 = time.perf_counter()
        layer = await asyncio.to_thread(build_busybox, rt.store, name="demo-busybox", tag="latest")
        console.print(f"base layer {layer.name}:{layer.tag} {layer.digest[:19]}… "
                      f"({layer.size / 1e6:.1f} MB) built in {time.perf_counter() - t0:.2f}s")
        spec = SandboxSpec(image=ImageRef(base="demo-busybox:latest"),
                           resources=Resources(cpu=0.5, memory=128 << 20, pids=128, disk=32 << 20))
        create_ms: list[float] = []
        exec_ms: list[float] = []
        outputs: dict[str, str] = {}
        sem = asyncio.Semaphore(8)

        async def one(i: int) -> None:
            async with sem:
                t = time.perf_counter()
                sb = await rt.create(spec)
                create_ms.append((time.perf_counter() - t) * 1000)
                rt.files(sb.id).write("/tmp/task.txt", f"task {i}\n".encode())
                t = time.perf_counter()
                res = await rt.exec(sb.id, "echo $(hostname) uid=$(id -u) $(cat /tmp/task.txt) procs=$(ls /proc | grep -c '^[0-9]')")
                exec_ms.append((time.perf_counter() - t) * 1000)
                outputs[sb.id] = res.stdout_text.strip()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(count)))
        wall = time.perf_counter() - t0
        sample = list(outputs.items())[:3]
        t1 = time.perf_counter()
        await asyncio.gather(*(rt.destroy(i) for i in list(rt.sandboxes)))
        teardown = time.perf_counter() - t1
        ok = sum(1 for v in outputs.values() if "uid=0" in v and "procs=" in v)
        table = Table(title=f"dsec demo: {count} sandboxes")
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_row("sandboxes ok", f"{ok}/{count}")
        table.add_row("create p50 / p95 (ms)", f"{percentile(create_ms, 50):.1f} / {percentile(create_ms, 95):.1f}")
        table.add_row("exec p50 (ms)", f"{percentile(exec_ms, 50):.1f}")
        table.add_row("create+exec throughput (/s)", f"{count / wall:.0f}")
        table.add_row("teardown (s)", f"{teardown:.2f}")
        Console().print(table)
        for sid, out in sample:
            console.print(f"  {sid}: {out}")
        if ok != count:
            raise DsecError(f"only {ok} of {count} sandboxes answered correctly")


if __name__ == "__main__":
    main()
