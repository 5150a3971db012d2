"""CLI commands that talk to a running DSec (``dsec up`` or a cluster).

``exec``, ``run``, ``create``, ``cp``, ``ls`` and ``rm`` go through the lean client
(cli/lean.py: blocking sockets, no pydantic, httpx or asyncio), the others through the
SDK; either way a failure is one line on stderr (cli/main.py).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from dsec.cli.clients import client, lean
from dsec.cli.policy import PolicyArgs, policy_options
from dsec.cli.term import age, console, out, say, table

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?$", re.I)


def parse_size(text: str, flag: str | None = None) -> int:
    """'512M', '2G', '1.5GiB', '1048576' -> bytes (powers of 1024)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (try 512M, 2G)", param_hint=flag)
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def parse_kv(items: tuple[str, ...], what: str) -> dict[str, str]:
    outd: dict[str, str] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{what} {item!r} must be KEY=VALUE")
        outd[k] = v
    return outd


def _typed(cpu: float | None, memory: str | None, disk: str | None, pids: int | None, output_cap: str | None,
           disk_medium: str | None, image: str, workspace: str | None, backend: str | None = None) -> dict[str, str]:
    """What the person typed for each flag, to name it in an error."""
    given = {"--cpu": None if cpu is None else f"{cpu:g}", "--memory": memory, "--disk": disk,
             "--pids": None if pids is None else str(pids), "--output-cap": output_cap, "--disk-medium": disk_medium,
             "IMAGE": image, "--workspace": workspace, "--backend": backend}
    return {k: v for k, v in given.items() if v is not None}


def _spec(image: str, workspace: str | None, toolkit: tuple[str, ...], cpu: float | None, memory: str | None,
          disk: str | None, env: tuple[str, ...], pids: int | None = None, output_cap: str | None = None,
          disk_medium: str | None = None, *, policy: PolicyArgs | None = None,
          validate: bool = True, backend: str | None = None) -> dict[str, Any]:
    """The spec the flags ask for, as the API's JSON. ``validate``: checked here with the spec
    models (needed anyway with policy flags); else the server checks it (``dsec run``: the lean
    path). Either way a bad value is one usage line naming the flag."""
    from dsec.cli.execute import pydantic_flag_errors, spec_dict

    spec = spec_dict(image, workspace=workspace, toolkits=toolkit, cpu=cpu,
                     memory=parse_size(memory, "--memory") if memory else None,
                     disk=parse_size(disk, "--disk") if disk else None, pids=pids, disk_medium=disk_medium,
                     output_cap=parse_size(output_cap, "--output-cap") if output_cap else None,
                     env=parse_kv(env, "--env"), backend=backend)
    if not validate and (policy is None or policy.empty):
        return spec
    from pydantic import ValidationError

    from dsec.spec import SandboxSpec

    try:
        model = SandboxSpec.model_validate(spec)
    except ValidationError as exc:
        raise pydantic_flag_errors(
            exc, _typed(cpu, memory, disk, pids, output_cap, disk_medium, image, workspace, backend)) from None
    if policy is not None:
        model = policy.apply(model)
    dumped: dict[str, Any] = model.model_dump(mode="json")
    return dumped


def sandbox_options(f: Any) -> Any:
    for opt in reversed([
        click.option("--workspace", default=None, help="Workspace layer (NAME[:TAG])."),
        click.option("--toolkit", multiple=True, help="Toolkit layer; repeat for several."),
        click.option("--cpu", type=float, default=None, help="CPU cores (quota)."),
        click.option("--memory", default=None, help="Memory limit, e.g. 512M, 2G."),
        click.option("--disk", default=None, help="Writable-layer quota, e.g. 1G."),
        click.option("--disk-medium", type=click.Choice(["disk", "memory"]), default=None,
                     help="Where written files live: the node's disk (default) or RAM (tmpfs, charged to --memory)."),
        click.option("--pids", type=int, default=None, help="Most processes and threads at once (default 512)."),
        click.option("--output-cap", default=None, metavar="SIZE",
                     help="Head and tail of each output stream a result keeps, e.g. 1M (default 256K). "
                          "`dsec run` then prints only that much too (default: everything)."),
        click.option("--ttl", type=float, default=3600.0, show_default=True, help="Maximum lifetime, seconds."),
        click.option("--env", "-e", multiple=True, help="KEY=VALUE for every command; repeat."),
        click.option("--label", "-l", multiple=True, help="KEY=VALUE label; repeat."),
        click.option("--task", default=None, help="Task (training job) this sandbox belongs to."),
        click.option("--backend", default=None, metavar="KIND",
                     help="Execution backend: container (default), gvisor... (docs/BACKENDS.md)."),
    ]):
        f = opt(f)
    return f


def say_limit(result: Any) -> bool:
    """Print the limit that ended a command (``ExecResult.limit``) on stderr, as one plain
    line (no wrapping, no markup); True if there was one."""
    hit = getattr(result, "limit", None)
    if hit is None:
        return False
    say(hit.message)
    return True


CP_HELP = """A path in a sandbox is ID:/absolute/path. SRC_PATH ending in /. copies a
directory's contents rather than the directory; DEST ending in / must be an existing
directory. Files and symlinks at DEST are replaced; a directory is never replaced by a
file, nor a file by a directory (refused before anything is written). A symlink given as
SRC is copied as a symlink. '-' as DEST writes a tar to stdout; '-' as SRC reads a tar
from stdin into the directory DEST."""


def register(main: click.Group) -> None:
    @main.command()
    @click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                  help="State directory (default $DSEC_STATE_DIR or /var/lib/dsec).")
    @click.option("--port", type=int, default=7070, show_default=True, help="Control-plane port.")
    @click.option("--edges", type=click.IntRange(1, 16), default=1, show_default=True, help="Edge agents to run.")
    @click.option("--host", default="127.0.0.1", show_default=True)
    @click.option("--detach", is_flag=True, help="Run in the background; log to <data-dir>/up.log.")
    @click.option("--edge-config", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
                  help="JSON or TOML of EdgeConfig fields for every edge (docs/EDGE.md).")
    @click.option("--control-config", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
                  help="JSON or TOML of ControlConfig fields, e.g. a [sandboxfusion] section (docs/COMPAT.md).")
    @click.option("--network-config", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
                  help="JSON or TOML of the edges' `network` section: named permissions, blocked ranges, subnet "
                       "(docs/EDGE.md, \"Network\"). Default: a network with an automatic subnet and no names.")
    @click.option("--node-name", default=None, metavar="NAME",
                  help="Names this instance's host resources (cgroups, mounts, network); default up-<hash of the "
                       "data directory>.")
    @click.option("--registry", "registry", is_flag=True,
                  help="Also run an OCI registry (docker-registry) on --host, data in <data-dir>/registry, "
                       "for `dsec image push/pull` (docs/IMAGES.md, \"Registry\").")
    @click.option("--registry-port", type=click.IntRange(0, 65535), default=0, show_default=True,
                  help="The registry's port (0: a free one, printed at start and kept in <data-dir>/registry/url).")
    def up(data_dir: Path | None, port: int, edges: int, host: str, detach: bool, edge_config: Path | None,
           control_config: Path | None, network_config: Path | None, node_name: str | None, registry: bool,
           registry_port: int) -> None:
        """All-in-one on this machine: control plane + edge(s) + SQLite. Ctrl-C stops it cleanly.

        Several can run side by side, each with its own --data-dir and --port."""

        from dsec.cli.up import (
            check_data_dir_free,
            check_node_name,
            check_port_free,
            data_dir_default,
            load_control_overrides,
            load_edge_overrides,
            load_network_config,
            run_foreground,
        )

        data = data_dir or data_dir_default()
        if node_name is not None:
            try:
                check_node_name(node_name)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--node-name") from None
        # Bad files fail before detaching.
        overrides = load_edge_overrides(edge_config) if edge_config else None
        control_overrides = load_control_overrides(control_config) if control_config else None
        if network_config is not None:
            if overrides is not None and "network" in overrides:
                raise click.BadParameter(f"{edge_config} has a `network` section too: give it in one place",
                                         param_hint="--network-config")
            overrides = {**(overrides or {}), "network": load_network_config(network_config)}
        if detach:
            check_data_dir_free(data)
            check_port_free(host, port)  # else the health check below could be answered by another server
            if registry:
                check_port_free(host, registry_port)
            _detach(data, port, edges, host, edge_config, network_config, node_name,
                    registry_args=["--registry", "--registry-port", str(registry_port)] if registry else [],
                    control_config=control_config)
            return
        from dsec.http import loop as dsec_loop

        dsec_loop.run(run_foreground(data, port=port, edges=edges, host=host, say=lambda m: console.print(m),
                                     edge_overrides=overrides, node_name=node_name, registry=registry,
                                     registry_port=registry_port, control_overrides=control_overrides))

    @main.command(context_settings={"ignore_unknown_options": True})
    @click.argument("image")
    @sandbox_options
    @policy_options
    @click.option("--timeout", type=float, default=600.0, show_default=True)
    @click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
    def run(image: str, workspace: str | None, toolkit: tuple[str, ...], cpu: float | None, memory: str | None,
            disk: str | None, disk_medium: str | None, pids: int | None, output_cap: str | None, ttl: float,
            env: tuple[str, ...], label: tuple[str, ...], task: str | None, backend: str | None, timeout: float,
            cmd: tuple[str, ...], policy: PolicyArgs) -> None:
        """Create a sandbox, run CMD, print its output, destroy it; exit with CMD's code.

        All of CMD's output is printed, as it comes (with --output-cap: the head and the tail,
        and one line on stderr saying how much was left out). When a limit ended CMD (memory,
        pids, timeout, disk), one line on stderr says which."""
        from dsec.cli.execute import flag_errors, stream_exec

        spec = _spec(image, workspace, toolkit, cpu, memory, disk, env, pids, output_cap, disk_medium,
                     policy=policy, validate=False, backend=backend)
        labels = parse_kv(label, "--label")
        with lean() as c:
            with flag_errors(_typed(cpu, memory, disk, pids, output_cap, disk_medium, image, workspace, backend)):
                sb = c.create(spec, labels=labels, task=task, ttl_s=ttl)
            try:
                code = stream_exec(sb, list(cmd), timeout=timeout, output_cap=spec.get("output_cap"))
            finally:
                sb.close()
        sys.exit(code)

    @main.command()
    @click.argument("image")
    @sandbox_options
    @click.option("--count", "-n", type=click.IntRange(1, 100000), default=1, show_default=True,
                  help="Create this many (with backpressure-aware retries and a progress bar).")
    @click.option("--concurrency", type=click.IntRange(1, 4096), default=64, show_default=True)
    @click.option("--json", "as_json", is_flag=True)
    @policy_options
    def create(image: str, workspace: str | None, toolkit: tuple[str, ...], cpu: float | None, memory: str | None,
               disk: str | None, disk_medium: str | None, pids: int | None, output_cap: str | None, ttl: float,
               env: tuple[str, ...], label: tuple[str, ...], task: str | None, backend: str | None, count: int,
               concurrency: int, as_json: bool, policy: PolicyArgs) -> None:
        """Create sandboxes and print their ids (one per line)."""
        from dsec.cli.execute import flag_errors

        labels = parse_kv(label, "--label")
        typed = _typed(cpu, memory, disk, pids, output_cap, disk_medium, image, workspace, backend)
        if count == 1:
            spec = _spec(image, workspace, toolkit, cpu, memory, disk, env, pids, output_cap, disk_medium,
                         policy=policy, validate=False, backend=backend)
            with lean() as c, flag_errors(typed):
                sb = c.create(spec, labels=labels, task=task, ttl_s=ttl)
            if as_json:
                print(json.dumps({k: v for k, v in sb.info.items() if k != "token"}, indent=2))
            else:
                print(sb.id)
            return
        from rich.progress import Progress

        from dsec.spec import SandboxSpec

        model = SandboxSpec.model_validate(_spec(image, workspace, toolkit, cpu, memory, disk, env, pids, output_cap,
                                                 disk_medium, policy=policy, backend=backend))
        with client() as c:
            ok: list[Any] = []
            failed: list[Any] = []
            with Progress(console=console.get(), transient=True) as bar:
                job = bar.add_task(f"creating {count} sandboxes", total=count)
                for o in c.create_many(model, count, concurrency=concurrency, labels=labels, task=task, ttl_s=ttl):
                    (ok if o.ok else failed).append(o)
                    bar.advance(job)
            if as_json:
                print(json.dumps({"ids": [o.sandbox.id for o in ok],
                                  "errors": [{"index": o.index, **o.error.to_wire()} for o in failed]}, indent=2))
            else:
                for o in ok:
                    print(o.sandbox.id)
            for o in failed[:10]:
                say(f"#{o.index}: {o.error}")
            if failed:
                say(f"{len(failed)} of {count} creates failed")
                sys.exit(1)

    @main.command("exec", context_settings={"ignore_unknown_options": True})
    @click.argument("sandbox_id")
    @click.option("--timeout", type=float, default=600.0, show_default=True)
    @click.option("--pristine", multiple=True, metavar="PATH",
                  help="Run against the image's own copy of PATH, whatever the sandbox did to it; repeat.")
    @click.option("--output-cap", default=None, metavar="SIZE",
                  help="Print only the first and the last SIZE of each stream (e.g. 1M), and one line on stderr "
                       "saying how much was left out. Default: everything.")
    @click.option("-i", "--interactive", is_flag=True,
                  help="Stream stdin to the command as it comes (automatic when stdin is a pipe or a file).")
    @click.option("-t", "--tty", "use_tty", is_flag=True,
                  help="Run the command on a terminal in the sandbox, keystrokes forwarded (python3, vim, top...).")
    @click.option("--no-stdin", is_flag=True, help="Do not forward a piped stdin (the command reads /dev/null).")
    @click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
    def exec_(sandbox_id: str, timeout: float, pristine: tuple[str, ...], output_cap: str | None,
              interactive: bool, use_tty: bool, no_stdin: bool, cmd: tuple[str, ...]) -> None:
        """Run CMD in a sandbox, streaming all of its output; exit with its code (a limit that
        ended it is named in one line on stderr).

        \b
        Stdin: a file (`< input.txt`) goes to the command; a pipe is streamed as it comes
        (`echo 'print(42)' | dsec exec ID -- python3 -`) when it has data at start (-i streams
        any stdin, e.g. a producer that starts later, or a terminal's lines); -t runs CMD on a
        terminal in the sandbox (`dsec exec -t ID -- python3`). When stdin is streamed (-i, -t,
        a pipe), --timeout, --pristine and --output-cap do not apply."""
        from dsec.cli.term import stdin_source

        source = "none" if no_stdin else stdin_source()
        if use_tty or interactive or source == "pipe":
            if pristine or output_cap:
                raise click.UsageError("--pristine and --output-cap do not combine with stdin forwarding "
                                       "(-i, -t, or a piped stdin: add --no-stdin)")
            if use_tty and not sys.stdin.isatty():
                raise click.UsageError("-t needs a terminal on stdin (drop -t to stream a pipe)")
            from dsec.cli.interactive import run_interactive

            sys.exit(run_interactive(sandbox_id, list(cmd), use_tty=use_tty))
        from dsec.cli.execute import flag_errors, stream_exec

        cap = parse_size(output_cap, "--output-cap") if output_cap else None
        data = sys.stdin.buffer.read() if source == "file" else None
        with lean() as c, flag_errors({"--output-cap": output_cap} if output_cap else {}):
            code = stream_exec(c.connect(sandbox_id), list(cmd), timeout=timeout, pristine=pristine, output_cap=cap,
                               stdin=data)
        sys.exit(code)

    @main.command()
    @click.argument("sandbox_id")
    @click.option("--name", default="shell", show_default=True,
                  help="The terminal to attach to, or to start: it outlives the connection (Ctrl-P Ctrl-Q "
                       "detaches; `dsec shell ID` attaches again and shows its recent screen).")
    @click.option("--new", "fresh", is_flag=True, help="A fresh terminal that ends when you leave.")
    @click.option("--user", default="0", show_default=True, help="uid or uid:gid inside the sandbox.")
    @click.option("--cwd", default="/", show_default=True)
    def shell(sandbox_id: str, name: str, fresh: bool, user: str, cwd: str) -> None:
        """An interactive shell on a terminal in the sandbox (bash when the image has it).

        \b
        Keys go to the sandbox as typed: Ctrl-C interrupts the remote command, Ctrl-D on an
        empty line ends the shell, `exit N` ends it with status N (dsec shell exits with it).
        Without a terminal on stdin, the lines of stdin are run by the shell."""
        from dsec.cli.interactive import run_interactive

        use_tty = sys.stdin.isatty()
        sys.exit(run_interactive(sandbox_id, None, use_tty=use_tty, name=None if fresh or not use_tty else name,
                                 cwd=cwd, user=user))

    @main.command(epilog=CP_HELP)
    @click.argument("src")
    @click.argument("dst")
    def cp(src: str, dst: str) -> None:
        """Copy files and directories between here and a sandbox, as `docker cp` does.

        \b
          dsec cp ./dir ID:/root/      /root/dir (a directory copied into an existing one)
          dsec cp ./dir ID:/root/new   /root/new, with dir's contents (new did not exist)
          dsec cp ./dir/. ID:/root/    dir's contents into /root
          dsec cp ./f ID:/root/        /root/f (a file onto a directory goes inside it)
          dsec cp ID:/etc/hosts ./h    a file out
          dsec cp ID:/root/dir -       a tar of /root/dir (entries dir/...) to stdout
          dsec cp - ID:/root/          a tar from stdin, extracted into /root"""
        from dsec.cli.cp import copy

        with lean() as c:
            copy(c, src, dst)

    @main.command("ls")
    @click.option("--json", "as_json", is_flag=True)
    @click.option("--label", "-l", multiple=True)
    @click.option("--task", default=None)
    @click.option("--state", default=None)
    def ls_(as_json: bool, label: tuple[str, ...], task: str | None, state: str | None) -> None:
        """List sandboxes."""
        with lean() as c:
            items = c.list(labels=parse_kv(label, "--label"), task=task, state=state)
        if as_json:
            print(json.dumps([{k: v for k, v in i.items() if k != "token"} for i in items], indent=2))
            return
        now = time.time()
        rows = [("ID", "STATE", "EDGE", "TASK", "LABELS", "AGE")]
        rows += [(i["id"], str(i["state"]), str(i.get("edge_id", "")), i.get("task") or "",
                  ",".join(f"{k}={v}" for k, v in (i.get("labels") or {}).items()),
                  age(now - float(i.get("created_at", now)))) for i in items]
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())

    @main.command("rm")
    @click.argument("ids", nargs=-1)
    @click.option("--task", default=None, help="Every sandbox of this task.")
    @click.option("--label", "-l", multiple=True, help="Every sandbox with these labels.")
    @click.option("--all", "all_", is_flag=True, help="Every sandbox the token can see.")
    def rm(ids: tuple[str, ...], task: str | None, label: tuple[str, ...], all_: bool) -> None:
        """Destroy sandboxes.

        Each ID is removed on its own, as `docker rm` does: one that does not exist (or
        that the call could not remove) is said on stderr and the others are still
        removed; the exit status is then 1. One that had ended already is said, not counted."""
        from dsec.errors import DsecError, SandboxNotFound

        failed = 0
        with lean() as c:
            n = 0
            for sid in ids:
                try:
                    ended = c.remove(sid)
                except SandboxNotFound:
                    say(f"error: no such sandbox: {sid}")
                    failed += 1
                    continue
                except DsecError as exc:
                    say(f"error: {sid}: {exc}")
                    failed += 1
                    continue
                if ended is not None:
                    say(f"{sid}: had ended already ({ended})")
                else:
                    n += 1
            if task or label:
                n += c.delete_where(labels=parse_kv(label, "--label"), task=task)
            if all_:
                for info in c.list():
                    if info.get("state") != "stopped":
                        c.delete(info["id"])
                        n += 1
        say(f"removed {n}")
        if failed:
            sys.exit(1)

    class _SnapshotGroup(click.Group):
        """``dsec snapshot ID ...`` takes a snapshot; ``dsec snapshot ls|rm`` manage them."""

        def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
            if args and args[0] not in self.commands and not args[0].startswith("-"):
                args = ["take", *args]
            return super().parse_args(ctx, args)

    @main.group(cls=_SnapshotGroup)
    def snapshot() -> None:
        """Snapshots: `dsec snapshot ID [--name N]` takes one; `ls` lists them; `rm REF` removes one."""

    @snapshot.command("take")
    @click.argument("sandbox_id")
    @click.option("--name", default=None, help="Layer name (default snap-<id>).")
    @click.option("--tag", default=None, help="Default: latest with --name, else a timestamp.")
    @click.option("--exclude", "-x", multiple=True, help="/abs/path (globs ok) or a bare name (*.pyc) to leave out.")
    @click.option("--json", "as_json", is_flag=True)
    def snapshot_take(sandbox_id: str, name: str | None, tag: str | None, exclude: tuple[str, ...], as_json: bool) -> None:
        """Pack a sandbox's disk changes into a snapshot layer (start sandboxes from its ref)."""
        with client() as c:
            info = c.connect(sandbox_id).snapshot(name=name, tag=tag, exclude=list(exclude))
        if as_json:
            print(info.model_dump_json(indent=2))
            return
        console.print(f"{info.ref}  {info.size / 1048576:.1f} MiB  over {len(info.parents)} layers"
                      f"  (frozen {1000 * (info.frozen_s or 0):.0f} ms, {info.seconds or 0:.2f} s)")
        print(info.ref)

    @snapshot.command("ls")
    @click.option("--json", "as_json", is_flag=True)
    def snapshot_ls(as_json: bool) -> None:
        """Snapshots of your project and its sub-projects."""
        with client() as c:
            items = c.snapshots()
        if as_json:
            print(json.dumps([i.model_dump(mode="json") for i in items], indent=2))
            return
        t = table("ref", "digest", "project", "edge", "size", "from sandbox", "age")
        now = time.time()
        for i in items:
            t.add_row(i.ref, i.digest[:19], str(getattr(i, "project", "")), str(getattr(i, "edge_id", "")),
                      f"{i.size / 1048576:.1f} MiB", i.sandbox_id or "", f"{now - i.created_at:.0f}s")
        out.print(t)

    @snapshot.command("rm")
    @click.argument("refs", nargs=-1, required=True)
    def snapshot_rm(refs: tuple[str, ...]) -> None:
        """Remove snapshots (by ref or digest); refused while a sandbox or another snapshot uses one."""
        with client() as c:
            for ref in refs:
                c.delete_snapshot(ref)
                console.print(f"removed {ref}")

    @main.command()
    @click.argument("sandbox_id")
    @click.option("-n", "count", type=click.IntRange(1, 1000), default=1, show_default=True)
    @click.option("--exclude", "-x", multiple=True, help="Paths left out of the children's disks.")
    @click.option("--json", "as_json", is_flag=True)
    def fork(sandbox_id: str, count: int, exclude: tuple[str, ...], as_json: bool) -> None:
        """N new sandboxes whose disks equal this one's now (works on a paused one)."""
        with client() as c:
            kids = c.connect(sandbox_id).fork(count, exclude=list(exclude))
        if as_json:
            print(json.dumps([k.info.model_dump(mode="json", exclude={"token"}) for k in kids], indent=2))
            return
        for k in kids:
            print(k.id)

    def _group(op: str, ids: tuple[str, ...], task: str | None, label: tuple[str, ...], as_json: bool) -> None:
        labels = parse_kv(label, "--label")
        if not ids and not task and not labels:
            raise click.UsageError(f"say what to {op}: sandbox ids, --task T or --label k=v")
        with client() as c:
            fn = c.pause_where if op == "pause" else c.resume_where
            res = fn(ids=list(ids)) if ids else fn(labels=labels or None, task=task)
        if as_json:
            print(res.model_dump_json(indent=2))
        else:
            verb = "paused" if op == "pause" else "resumed"
            console.print(f"{verb} {len(res.done)}, already {verb} {len(res.skipped)}, failed {len(res.errors)}"
                          f" in {res.seconds:.2f} s")
            for sid, e in sorted(res.errors.items()):
                console.print(f"  {sid}: {e.get('message', e)}")
        if res.errors:
            sys.exit(1)

    @main.command()
    @click.argument("ids", nargs=-1)
    @click.option("--task", default=None, help="Every sandbox of this task.")
    @click.option("--label", "-l", multiple=True, help="Every sandbox with these labels.")
    @click.option("--json", "as_json", is_flag=True)
    def pause(ids: tuple[str, ...], task: str | None, label: tuple[str, ...], as_json: bool) -> None:
        """Freeze sandboxes and push their memory to compressed swap (any request resumes one)."""
        _group("pause", ids, task, label, as_json)

    @main.command()
    @click.argument("ids", nargs=-1)
    @click.option("--task", default=None, help="Every sandbox of this task.")
    @click.option("--label", "-l", multiple=True, help="Every sandbox with these labels.")
    @click.option("--json", "as_json", is_flag=True)
    def resume(ids: tuple[str, ...], task: str | None, label: tuple[str, ...], as_json: bool) -> None:
        """Thaw paused sandboxes."""
        _group("resume", ids, task, label, as_json)

    @main.command()
    @click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between refreshes.")
    @click.option("--once", is_flag=True, help="Print the tables once (CPU over one interval) and exit.")
    @click.option("--rows", "-n", type=click.IntRange(1, 1000), default=30, show_default=True,
                  help="Sandboxes shown, the newest first.")
    def top(interval: float, once: bool, rows: int) -> None:
        """Live view of each edge's admission budget and each sandbox's use; q quits."""
        from dsec.cli.top import run_top

        with client() as c:
            run_top(c, interval=interval, once=once, rows=rows)

    @main.group()
    def token() -> None:
        """API tokens."""

    @token.command("create")
    @click.option("--project", default=None)
    @click.option("--name", default="")
    def token_create(project: str | None, name: str) -> None:
        with client() as c:
            info = c.create_token(project=project, name=name)
        console.print(f"token {info.id} for project {info.project} (shown once):")
        print(info.token)

    @token.command("revoke")
    @click.argument("token_id")
    def token_revoke(token_id: str) -> None:
        with client() as c:
            c.revoke_token(token_id)
        console.print(f"revoked {token_id}")

    @main.group()
    def project() -> None:
        """Projects (nested, with quotas carved out of the parent's)."""

    @project.command("create")
    @click.argument("name")
    @click.option("--parent", default=None)
    @click.option("--quota", required=True,
                  help="sandboxes=N,cpu=C,memory=SIZE[,storage=SIZE]  e.g. sandboxes=100,cpu=50,memory=64G,storage=20G")
    def project_create(name: str, parent: str | None, quota: str) -> None:
        q: dict[str, float] = {}
        for part in quota.split(","):
            k, _, v = part.partition("=")
            k = k.strip()
            if k in ("memory", "storage"):
                q[k] = parse_size(v)
            elif k in ("sandboxes", "cpu"):
                q[k] = float(v) if k == "cpu" else int(v)
            else:
                raise click.BadParameter(f"unknown quota key {k!r}: use sandboxes, cpu, memory, storage")
        with client() as c:
            info = c.create_project(name, quota=q, parent=parent)
        out.print_json(info.model_dump_json())


def _detach(data: Path, port: int, edges: int, host: str, edge_config: Path | None = None,
            network_config: Path | None = None, node_name: str | None = None,
            registry_args: list[str] | None = None, control_config: Path | None = None) -> None:
    import subprocess

    import httpx

    from dsec.cli.up import READY_FILE

    data.mkdir(parents=True, exist_ok=True)
    ready = data / READY_FILE
    ready.unlink(missing_ok=True)
    log = open(data / "up.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec.cli.main", "up", "--data-dir", str(data), "--port", str(port),
         "--edges", str(edges), "--host", host, *(["--edge-config", str(edge_config.absolute())] if edge_config else []),
         *(["--network-config", str(network_config.absolute())] if network_config else []),
         *(["--control-config", str(control_config.absolute())] if control_config else []),
         *(["--node-name", node_name] if node_name else []), *(registry_args or [])],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    (data / "up.pid").write_text(f"{proc.pid}\n")
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"dsec up exited with {proc.returncode}; see {data / 'up.log'}")
        try:
            # Healthy and every edge registered (the control plane answers before its edges do).
            if (ready.is_file() and ready.read_text().strip() == str(proc.pid)
                    and httpx.get(url + "/healthz", timeout=1).status_code == 200):
                console.print(f"dsec up: running as pid {proc.pid} at {url} (log {data / 'up.log'}; stop: kill {proc.pid})")
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise click.ClickException(f"dsec up did not become healthy in 60 s; see {data / 'up.log'}")
