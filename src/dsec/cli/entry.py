"""The ``dsec`` console script.

``dsec exec ID -- CMD...`` with no options — what an agent harness runs once per step —
skips click (~20 ms of imports) and goes straight to the lean client (cli/lean.py); any
other command line, and a piped stdin to stream, go through the click CLI
(cli/main.py), which behaves the same for this form. Errors are the same one line.
"""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if len(argv) >= 4 and argv[0] == "exec" and not argv[1].startswith("-") and argv[2] == "--":
        from dsec.cli.term import stdin_source

        source = stdin_source()
        if source != "pipe":
            sys.exit(_exec(argv[1], argv[3:], source))
    from dsec.cli.main import main as cli

    cli()


def _exec(sandbox_id: str, cmd: list[str], source: str) -> int:
    from dsec.cli.execute import stream_exec
    from dsec.cli.lean import lean_client
    from dsec.cli.term import say
    from dsec.errors import DsecError

    data = sys.stdin.buffer.read() if source == "file" else None
    try:
        with lean_client() as c:
            return stream_exec(c.connect(sandbox_id), cmd, timeout=600.0, stdin=data)
    except KeyboardInterrupt:
        return 130
    except DsecError as exc:
        say(f"error: {exc}")
        return 1


if __name__ == "__main__":
    main()
