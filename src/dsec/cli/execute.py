"""``dsec run`` and ``dsec exec``: the spec from the flags, and a command's output streamed
to this terminal, byte for byte.

The spec is built as the JSON the API takes; the server validates it (pydantic is not
imported here), and its ``invalid_spec`` errors come back as one line naming the flag a
person typed (``--memory 1M: must be at least 16M``). Output is written as it arrives;
the stream is complete (the edge makes the command wait for a slow reader), so the only
notice about output is for ``--output-cap``, when bytes were left out, and it says how
many. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import click

from dsec.cli.term import human_size, say
from dsec.errors import InvalidSpec

FLAGS = {
    "image.base": "IMAGE", "image.workspace": "--workspace", "image.toolkits": "--toolkit", "image": "IMAGE",
    "resources.cpu": "--cpu", "resources.memory": "--memory", "resources.disk": "--disk",
    "resources.pids": "--pids", "resources.disk_medium": "--disk-medium", "output_cap": "--output-cap",
    "env": "--env", "labels": "--label", "task": "--task", "lifecycle.ttl_s": "--ttl",
    "network": "--allow", "stages": "--stages-file", "stage": "--stage", "backend": "--backend",
}
"""API field (below ``spec.``) -> the flag that sets it."""
SIZE_FLAGS = frozenset({"--memory", "--disk", "--output-cap"})
_BOUND = re.compile(r"^Input should be (greater than or equal to|greater than|less than or equal to|less than) "
                    r"(-?\d+(?:\.\d+)?)")
_WORDS = {"greater than or equal to": "at least", "greater than": "more than",
          "less than or equal to": "at most", "less than": "less than"}


def spec_dict(image: str, *, workspace: str | None = None, toolkits: tuple[str, ...] = (), cpu: float | None = None,
              memory: int | None = None, disk: int | None = None, pids: int | None = None,
              disk_medium: str | None = None, output_cap: int | None = None,
              env: Mapping[str, str] | None = None, backend: str | None = None) -> dict[str, Any]:
    """A ``SandboxSpec`` as the API takes it, with only what the flags gave (the rest: defaults)."""
    res: dict[str, Any] = {k: v for k, v in (("cpu", cpu), ("memory", memory), ("disk", disk), ("pids", pids),
                                              ("disk_medium", disk_medium)) if v is not None}
    img: dict[str, Any] = {"base": image}
    if workspace:
        img["workspace"] = workspace
    if toolkits:
        img["toolkits"] = list(toolkits)
    spec: dict[str, Any] = {"image": img, "resources": res, "env": dict(env or {})}
    if output_cap is not None:
        spec["output_cap"] = output_cap
    if backend is not None:
        spec["backend"] = backend
    return spec


def flag_message(field: str, message: str, typed: Mapping[str, str]) -> str:
    """One validation error as a person reads it: the flag, what they typed, the rule."""
    key = field.removeprefix("body.").removeprefix("spec.")
    flag = FLAGS.get(key) or FLAGS.get(key.rsplit(".", 1)[0]) or key
    msg = message.removeprefix("Value error, ")
    m = _BOUND.match(msg)
    if m:
        bound = float(m.group(2))
        shown = human_size(bound) if flag in SIZE_FLAGS else f"{bound:g}"
        msg = f"must be {_WORDS[m.group(1)]} {shown}"
    value = typed.get(flag)
    return f"{flag} {value}: {msg}" if value else f"{flag}: {msg}"


@contextlib.contextmanager
def flag_errors(typed: Mapping[str, str]) -> Iterator[None]:
    """A bad spec (``invalid_spec`` naming a ``spec.`` field) becomes a usage error naming the flags."""
    try:
        yield
    except InvalidSpec as exc:
        items = exc.fields.get("errors") or [{"field": exc.fields.get("field") or "", "message": exc.message}]
        fields = [str(e.get("field") or "") for e in items]
        if not any(f.startswith("spec.") or f in FLAGS for f in fields):
            raise
        import click  # only on this error path: `dsec exec`'s fast path (cli/entry.py) has no click

        raise click.UsageError("; ".join(flag_message(str(e.get("field") or ""), str(e.get("message") or ""), typed)
                                         for e in items)) from None


def pydantic_flag_errors(exc: Any, typed: Mapping[str, str]) -> click.UsageError:
    """The same line for a pydantic ValidationError of a spec built here."""
    import click

    return click.UsageError("; ".join(
        flag_message(".".join(str(x) for x in e.get("loc", ())), str(e.get("msg", "")), typed)
        for e in exc.errors()))


def stream_exec(sb: Any, cmd: list[str], *, timeout: float | None, pristine: tuple[str, ...] = (),
                output_cap: int | None = None, stdin: bytes | None = None) -> int:
    """Run ``cmd`` in ``sb`` (a lean sandbox), writing its output as it comes; its exit code
    (124 when a timeout killed it, 128+N for a signal, 130 on Ctrl-C, 141 when our stdout closed)."""
    argv: list[str] | str = cmd[0] if len(cmd) == 1 and " " in cmd[0] else cmd
    dropped = {"stdout": 0, "stderr": 0}
    outs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    result: dict[str, Any] | None = None
    sys.stdout.flush()
    try:
        for item in sb.exec_stream(argv, timeout=timeout, pristine=list(pristine), output_cap=output_cap, stdin=stdin):
            if isinstance(item, tuple):
                stream, data, lost = item
                dropped[stream] += lost
                f = outs[stream]
                f.write(data)
                f.flush()
            else:
                result = item
    except KeyboardInterrupt:
        return 130  # the stream is closed: the edge kills the command's process tree
    except BrokenPipeError:
        # whoever read our stdout stopped (`| head`): as a process killed by SIGPIPE
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    if any(dropped.values()) and output_cap is not None:
        left = ", ".join(f"{n} bytes of {s}" for s, n in dropped.items() if n)
        say(f"dsec: output over --output-cap {human_size(output_cap)}: printed the first and the last "
            f"{human_size(output_cap)} of each stream, left out {left} between them")
    if result is None:
        return 0
    limit = result.get("limit") or {}
    if limit and limit.get("kind") != "output_cap":  # the stream above was complete (or said what it left out)
        say(str(limit.get("message", "")))
    if result.get("timed_out"):
        return 124
    code = result.get("exit_code")
    return int(code) if code is not None else 128 + int(result.get("signal") or 0)
