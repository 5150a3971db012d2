"""Interactive terminals and streamed stdin: :meth:`AsyncSandbox.pty` / :meth:`AsyncSandbox.attach`.

One WebSocket to the sandbox's edge (``/v1/sandboxes/{id}/attach``, protocol in
:class:`dsec.spec.api.AttachOpen`): keystrokes and stdin go up as they are typed,
output comes down as it is produced, the exit status comes last.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from dsec.errors import DsecError, SandboxFailed, error_from_wire
from dsec.sdk.outcomes import OutputChunk, wire_body
from dsec.spec.api import AttachOpen

if TYPE_CHECKING:
    from dsec.sdk.client import AsyncSandbox


@dataclass(frozen=True, slots=True)
class TerminalExit:
    """How a terminal's (or attached command's) process ended."""

    exit_code: int | None
    signal: int | None
    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0


class AsyncTerminal:
    """A command attached over one connection: on a pty (``tty``) or with streamed stdin.

    Iterate :meth:`output` for what it prints (a terminal's output all comes as
    ``stdout``); :attr:`exit` is set once it ended. Leaving a *named* terminal
    (:meth:`detach`, :meth:`close`, or a dropped connection) keeps it running for the
    next :meth:`AsyncSandbox.pty` with the same name; an unnamed one is killed."""

    def __init__(self, sandbox: AsyncSandbox, ws: ClientConnection, attached: Mapping[str, Any]) -> None:
        self.sandbox = sandbox
        self._ws = ws
        self.name: str | None = attached.get("name")
        self.pid: int = int(attached.get("pid", 0))
        self.new: bool = bool(attached.get("new", True))
        """False when this attached to a named terminal that was already running."""
        self.tty: bool = bool(attached.get("tty", True))
        self.exit: TerminalExit | None = None

    async def __aenter__(self) -> AsyncTerminal:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(self, data: bytes | str) -> None:
        """Type (on a terminal) or write to stdin."""
        await self._ws.send(data.encode() if isinstance(data, str) else bytes(data))

    async def resize(self, rows: int, cols: int) -> None:
        await self._control({"resize": {"rows": rows, "cols": cols}})

    async def eof(self) -> None:
        """End of input: stdin closes (on a terminal: ^D)."""
        await self._control({"eof": True})

    async def signal(self, name: str) -> None:
        """Send a signal (INT, TERM, KILL, HUP, QUIT, TSTP, CONT, WINCH) to the terminal's
        foreground job, or to the attached command's process group."""
        await self._control({"signal": name})

    async def detach(self) -> None:
        """Leave; a named terminal keeps running."""
        if self.exit is None:
            await self._control({"detach": True})
        await self.close()

    async def close(self) -> None:
        await self._ws.close()

    async def _control(self, msg: dict[str, Any]) -> None:
        with contextlib.suppress(ConnectionClosed):  # it ended meanwhile: the output says how
            await self._ws.send(json.dumps(msg))

    async def output(self) -> AsyncIterator[OutputChunk]:
        """Output as produced, until the command ends (then :attr:`exit` is set) or the
        connection closes."""

        try:
            async for msg in self._ws:
                if isinstance(msg, bytes):
                    if msg:
                        yield OutputChunk("stdout" if msg[0] == 1 else "stderr", msg[1:], 0)
                    continue
                ctl = json.loads(msg)
                if "exit" in ctl:
                    e = ctl["exit"]
                    self.exit = TerminalExit(e.get("exit_code"), e.get("signal"), float(e.get("cpu_user_s", 0.0)),
                                             float(e.get("cpu_system_s", 0.0)))
                elif "error" in ctl:
                    raise error_from_wire(ctl)
        except ConnectionClosed:
            return

    async def wait(self) -> TerminalExit:
        """Read (and discard) output until the command ends."""
        async for _ in self.output():
            pass
        if self.exit is None:
            raise SandboxFailed(f"the connection to sandbox {self.sandbox.id} closed before the command ended",
                                sandbox_id=self.sandbox.id, reason="disconnected")
        return self.exit


async def open_terminal(sandbox: AsyncSandbox, req: AttachOpen, *, retry_auth: bool = True) -> AsyncTerminal:
    url = sandbox.info.edge_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    ws = await connect(f"{url}/v1/sandboxes/{sandbox.id}/attach", max_size=None, open_timeout=10.0,
                       additional_headers={"authorization": f"Bearer {sandbox.info.token}"}, compression=None)
    try:
        await ws.send(req.model_dump_json())
        first = json.loads(await ws.recv())
    except BaseException:
        await ws.close()
        raise
    if "error" in first:
        await ws.close()
        err = error_from_wire(first)
        if retry_auth and err.code == "auth_error":
            await sandbox._client._refresh(sandbox)  # expired data-path token
            return await open_terminal(sandbox, req, retry_auth=False)
        raise err
    if "attached" not in first:
        await ws.close()
        raise DsecError(f"unexpected first message from the edge: {str(first)[:200]}")
    return AsyncTerminal(sandbox, ws, first["attached"])


def attach_request(cmd: Sequence[str] | str | None, *, tty: bool, rows: int, cols: int, name: str | None,
                   env: Mapping[str, str] | None, cwd: str, user: int | str) -> AttachOpen:
    return wire_body(AttachOpen, cmd=cmd if cmd is None or isinstance(cmd, str) else list(cmd), tty=tty, rows=rows,
                 cols=cols, name=name, env=dict(env or {}), cwd=cwd, user=user)
