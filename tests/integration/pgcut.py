"""Faults for the control plane's store: a commit that happens but is never answered, a
connection that drops in the middle of a transaction.

:class:`CommitCutter` sits between the control plane and a real PostgreSQL (unix socket in,
unix socket out) and forwards every byte. Armed, it watches the PostgreSQL wire protocol for
the first transaction that runs a statement containing a marker (``INSERT INTO sandboxes``:
a create's reservation), and

- ``arm()``: lets that transaction's ``COMMIT`` through, waits for PostgreSQL's
  ``CommandComplete`` of it — the commit is durable from here on — and then closes both
  sockets without passing the answer on. The client sees its connection drop during the
  commit: what a database restart or a network cut at the wrong moment looks like, but on
  purpose and every time;
- ``arm(at="statement")``: closes both sockets instead of passing that statement on (the
  transaction dies with its connection, nothing of it is committed).

It understands only what it needs of the protocol: the startup packet (untyped), then typed
messages (a tag byte, a 4-byte length); a statement is found in a simple ``Query`` or in a
``Parse`` (psycopg prepares a statement it runs often: the name a marked ``Parse`` gave it
marks the ``Bind`` that runs it later). Not for production, not for TCP or TLS.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from pathlib import Path


def _read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return bytes(out)


def _message(sock: socket.socket) -> tuple[bytes, bytes]:
    tag = _read_exact(sock, 1)
    (length,) = struct.unpack("!I", _read_exact(sock, 4))
    return tag, _read_exact(sock, length - 4)


class CommitCutter:
    """``CommitCutter(pg_socket_dir, port, listen_dir).start()``; ``url`` for SQLAlchemy;
    ``arm()`` before the transaction to cut."""

    def __init__(self, pg_dir: Path, port: int, listen_dir: Path, *,
                 marker: bytes = b"INSERT INTO sandboxes") -> None:
        self.pg_path = str(pg_dir / f".s.PGSQL.{port}")
        self.dir = listen_dir
        self.port = port
        self.marker = marker
        self.armed = False
        self.at = "commit"
        self.cut = threading.Event()
        """Set once a connection was cut after its commit."""
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []

    def url(self, db: str) -> str:
        return f"postgresql+psycopg://postgres@/{db}?host={self.dir}&port={self.port}"

    def arm(self, *, at: str = "commit", marker: bytes | None = None) -> None:
        """Cut the next transaction that runs the marker (once), at its commit's answer or at
        the marked statement."""
        assert at in ("commit", "statement"), at
        self.cut.clear()
        self.marker = marker or self.marker
        self.at = at
        self.armed = True

    def start(self) -> CommitCutter:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = str(self.dir / f".s.PGSQL.{self.port}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(64)
        threading.Thread(target=self._accept, daemon=True, name="pgcut-accept").start()
        return self

    def stop(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.connect(self.pg_path)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            _Conn(self, client, server).start()


class _Conn:
    def __init__(self, cutter: CommitCutter, client: socket.socket, server: socket.socket) -> None:
        self.cutter = cutter
        self.client = client
        self.server = server
        self.marked_statements: set[bytes] = set()
        self.tainted = False  # this transaction ran the marker
        self.cutting = False  # its COMMIT went through: cut at the answer

    def start(self) -> None:
        threading.Thread(target=self._up, daemon=True, name="pgcut-up").start()
        threading.Thread(target=self._down, daemon=True, name="pgcut-down").start()

    def _close(self) -> None:
        for s in (self.client, self.server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _up(self) -> None:
        try:
            (length,) = struct.unpack("!I", _read_exact(self.client, 4))  # the startup packet
            self.server.sendall(struct.pack("!I", length) + _read_exact(self.client, length - 4))
            while True:
                tag, body = _message(self.client)
                self._look(tag, body)
                if self.cutting and self.cutter.at == "statement":
                    self.cutter.cut.set()  # the statement never reaches PostgreSQL
                    self._close()
                    return
                self.server.sendall(tag + struct.pack("!I", len(body) + 4) + body)
        except (OSError, ConnectionError):
            self._close()

    def _look(self, tag: bytes, body: bytes) -> None:
        marker = self.cutter.marker
        if tag == b"P":  # Parse: statement name \0 query \0 ...
            name, _, rest = body.partition(b"\0")
            query = rest.partition(b"\0")[0]
            if marker in query:  # (the unnamed statement is marked until the next Parse)
                self.marked_statements.add(name)
                self._marked()
            else:
                self.marked_statements.discard(name)
        elif tag == b"B":  # Bind: portal \0 statement \0 ...
            statement = body.split(b"\0", 2)[1]
            if statement in self.marked_statements:
                self._marked()
        elif tag == b"Q":
            query = body.rstrip(b"\0").strip().upper()
            if marker in body:
                self._marked()
            elif self.tainted and query.startswith(b"COMMIT") and self.cutter.at == "commit":
                with self.cutter._lock:
                    if self.cutter.armed:  # the first one only
                        self.cutter.armed = False
                        self.cutting = True
            elif query.startswith((b"ROLLBACK", b"BEGIN")):
                self.tainted = False

    def _marked(self) -> None:
        self.tainted = True
        if self.cutter.at == "statement":
            with self.cutter._lock:
                if self.cutter.armed:
                    self.cutter.armed = False
                    self.cutting = True

    def _down(self) -> None:
        try:
            while True:
                tag, body = _message(self.server)
                if self.cutting and tag == b"C" and body.startswith(b"COMMIT"):
                    self.cutter.cut.set()  # committed in PostgreSQL; the client never hears it
                    self._close()
                    return
                self.client.sendall(tag + struct.pack("!I", len(body) + 4) + body)
        except (OSError, ConnectionError):
            self._close()
