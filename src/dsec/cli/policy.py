"""CLI for network policies, stages and the audit trail (docs/API.md, "Policies and stages").

``dsec create/run IMAGE --allow pkgs --allow-cidr 10.0.0.0/8:443/tcp --stages-file s.json --stage setup``
(the options come from :func:`policy_options`), ``dsec policy ID [--allow ...|--none]``,
``dsec stage ID NAME``, ``dsec events ID`` and ``dsec network ID``.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from dsec.cli.term import out, table

CIDR_HELP = "CIDR[:PORTS][/PROTO]: 10.0.0.0/8:443/tcp, 192.0.2.1:53/udp, 10.1.0.0/16:8000-8100, 198.51.100.0/24:*/any"


def parse_cidr_rule(text: str) -> Any:
    """``CIDR[:PORTS][/PROTO]`` -> NetRule. PORTS: ``443``, ``80,443``, ``8000-8100`` or ``*``;
    PROTO: tcp (default), udp or any. IPv6 goes in brackets: ``[2001:db8::/32]:443``."""
    from pydantic import ValidationError

    from dsec.spec import NetRule

    raw = text.strip()
    if raw.startswith("["):
        cidr, sep, rest = raw[1:].partition("]")
        if not sep:
            raise click.BadParameter(f"{text!r}: no closing ']' ({CIDR_HELP})")
        rest = rest[1:] if rest.startswith(":") else ("" if not rest else "!")
    else:
        cidr, _, rest = raw.partition(":")
    ports_text, _, proto = rest.partition("/")
    if rest == "!" or (proto and proto not in ("tcp", "udp", "any")):
        raise click.BadParameter(f"{text!r}: the protocol must be tcp, udp or any ({CIDR_HELP})")
    ports = () if ports_text in ("", "*") else tuple(p.strip() for p in ports_text.split(",") if p.strip())
    try:
        return NetRule(cidr=cidr, ports=ports, protocol=proto or "tcp")  # type: ignore[arg-type]
    except ValidationError as exc:
        msg = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        raise click.BadParameter(f"{text!r}: {msg} ({CIDR_HELP})") from None


def build_policy(allow: tuple[str, ...], allow_cidr: tuple[str, ...]) -> Any:
    """A NetworkPolicy from the flags, or None when none is given."""
    from pydantic import ValidationError

    from dsec.spec import NetworkPolicy

    if not allow and not allow_cidr:
        return None
    try:
        return NetworkPolicy(allow=allow, rules=tuple(parse_cidr_rule(c) for c in allow_cidr))
    except ValidationError as exc:
        raise click.BadParameter(str(exc.errors()[0]["msg"]).removeprefix("Value error, "), param_hint="--allow") from None


def load_stages(path: Path) -> dict[str, Any]:
    """A JSON object of stage name -> Stage (``{"network": ..., "files": ...}``), or one
    holding it under ``"stages"``."""
    from pydantic import TypeAdapter, ValidationError

    from dsec.spec import Stage

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint="--stages-file") from None
    if isinstance(data, dict) and isinstance(data.get("stages"), dict):
        data = data["stages"]
    try:
        return dict(TypeAdapter(dict[str, Stage]).validate_python(data))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise click.BadParameter(f"{path}: {where}: {first['msg']}", param_hint="--stages-file") from None


@dataclass(frozen=True)
class PolicyArgs:
    allow: tuple[str, ...] = ()
    allow_cidr: tuple[str, ...] = ()
    stage: str | None = None
    stages_file: Path | None = None

    @property
    def empty(self) -> bool:
        """No policy flag was given."""
        return not (self.allow or self.allow_cidr or self.stage or self.stages_file)

    def apply(self, spec: Any) -> Any:
        """``spec`` with the network policy and stages these flags ask for."""
        from pydantic import ValidationError

        policy = build_policy(self.allow, self.allow_cidr)
        stages = load_stages(self.stages_file) if self.stages_file else {}
        if self.stage is not None and policy is not None:
            raise click.UsageError("--allow/--allow-cidr set the policy of a sandbox without stages; with --stage "
                                   "the stage's own network applies (put it in the --stages-file)")
        if not (policy or stages or self.stage):
            return spec
        try:
            return spec.model_validate({**spec.model_dump(), "network": policy, "stages": stages, "stage": self.stage})
        except ValidationError as exc:
            raise click.BadParameter(exc.errors()[0]["msg"].removeprefix("Value error, "),
                                     param_hint="--stage") from None


def policy_options(f: Any) -> Any:
    """Adds --allow, --allow-cidr, --stage, --stages-file; the command gets ``policy: PolicyArgs``."""

    @functools.wraps(f)
    def wrapper(*args: Any, allow: tuple[str, ...], allow_cidr: tuple[str, ...], stage: str | None,
                stages_file: Path | None, **kwargs: Any) -> Any:
        return f(*args, policy=PolicyArgs(allow, allow_cidr, stage, stages_file), **kwargs)

    for opt in reversed([
        click.option("--allow", multiple=True, metavar="NAME",
                     help="Named network permission from the edge's config (e.g. pkgs, dns); repeat."),
        click.option("--allow-cidr", multiple=True, metavar="CIDR[:PORTS][/PROTO]", help=f"Raw allow rule; repeat. {CIDR_HELP}"),
        click.option("--stages-file", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
                     help='JSON {"NAME": {"network": {"allow": [...]}, "files": {"read_only": [...], ...}}, ...}'),
        click.option("--stage", default=None, help="The stage to start in (one of --stages-file)."),
    ]):
        wrapper = opt(wrapper)
    return wrapper


def _policy_line(sandbox_id: str, stage: str | None, pol: Any) -> str:
    net = "loopback only" if pol is None else (
        ", ".join([*pol.allow, *(f"{r.cidr}:{','.join(r.ports) or '*'}/{r.protocol}" for r in pol.rules)]) or "nothing")
    return f"{sandbox_id}: stage {stage or '-'}, network: {net}"


def register(main: click.Group) -> None:
    from dsec.cli.clients import client

    @main.command()
    @click.argument("sandbox_id")
    @click.option("--allow", multiple=True, metavar="NAME", help="Named permission; repeat.")
    @click.option("--allow-cidr", multiple=True, metavar="CIDR[:PORTS][/PROTO]", help=f"Raw rule; repeat. {CIDR_HELP}")
    @click.option("--none", "none_", is_flag=True, help="No network at all (loopback only).")
    @click.option("--json", "as_json", is_flag=True)
    def policy(sandbox_id: str, allow: tuple[str, ...], allow_cidr: tuple[str, ...], none_: bool, as_json: bool) -> None:
        """Replace a running sandbox's network policy (atomically; forbidden connections are cut).
        Without --allow/--allow-cidr/--none: show the policy in force."""
        new = build_policy(allow, allow_cidr)
        if none_ and new is not None:
            raise click.UsageError("--none and --allow/--allow-cidr exclude each other")
        with client() as c:
            sb = c.connect(sandbox_id)
            if new is not None or none_:
                info = sb.set_policy(new)
                sid, stage_now, pol = info.id, info.stage, info.network
            else:  # the edge is the truth for what is in force
                net = sb.network()
                sid, stage_now, pol = net.sandbox_id, net.stage, net.policy
        if as_json:
            print(json.dumps({"id": sid, "stage": stage_now,
                              "network": None if pol is None else pol.model_dump(mode="json")}))
        else:
            print(_policy_line(sid, stage_now, pol))

    @main.command()
    @click.argument("sandbox_id")
    @click.argument("name")
    @click.option("--json", "as_json", is_flag=True)
    def stage(sandbox_id: str, name: str, as_json: bool) -> None:
        """Switch a sandbox to one of its declared stages (file rules + network); processes
        started before the switch are killed."""
        with client() as c:
            info = c.connect(sandbox_id).set_stage(name)
        if as_json:
            print(info.model_dump_json(exclude={"token"}))
        else:
            print(_policy_line(info.id, info.stage, info.network))

    @main.command()
    @click.argument("sandbox_id")
    @click.option("--json", "as_json", is_flag=True)
    def network(sandbox_id: str, as_json: bool) -> None:
        """A sandbox's address, policy in force and refused connection attempts."""
        with client() as c:
            info = c.connect(sandbox_id).network()
        if as_json:
            print(info.model_dump_json())
            return
        print(f"{info.sandbox_id}: ip {info.ip or '- (loopback only)'}, stage {info.stage or '-'}, "
              f"denied packets {info.denied}")
        for d in info.recent_denied:
            print(f"  denied: {d}")

    @main.command()
    @click.argument("sandbox_id")
    @click.option("--json", "as_json", is_flag=True, help="The raw list (one JSON array).")
    @click.option("--kind", "-k", multiple=True, help="Only these events (oom, net_denied, stage_changed, ...); repeat.")
    def events(sandbox_id: str, as_json: bool, kind: tuple[str, ...]) -> None:
        """A sandbox's event log: execs, limit hits, denied network attempts, policy and stage changes."""
        with client() as c:
            items = list(c.connect(sandbox_id).events())
        if kind:
            items = [e for e in items if e.get("event") in kind]
        if as_json:
            print(json.dumps(items, indent=2))
            return
        t = table("time", "event", "origin", "details")
        for e in items:
            rest = {k: v for k, v in e.items() if k not in ("t", "event", "origin")}
            when = time.strftime("%H:%M:%S", time.localtime(float(e.get("t", 0)))) + f".{int(float(e.get('t', 0)) * 1000) % 1000:03d}"
            t.add_row(when, str(e.get("event")), str(e.get("origin", "")),
                      " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in rest.items() if v is not None))
        out.print(t)
        sys.stdout.flush()

