"""A throwaway PostgreSQL cluster for benches: ``initdb`` in a temporary directory as the
``postgres`` system user, listening only on a unix socket there, removed at the end.

Needs root, ``runuser`` and the Debian ``postgresql`` package (scripts/setup.sh installs
it); :func:`unavailable` says what is missing instead of failing half-way. The server
runs with the distribution's durability defaults (``fsync``, ``synchronous_commit`` on)
unless the caller asks otherwise: a throughput figure measured with ``fsync=off`` would
flatter the control plane. Never touches a PostgreSQL the host already runs.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def _bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(which).parent if which else None


def unavailable() -> str | None:
    """Why a throwaway cluster cannot be made here, or None."""
    if _bindir() is None:
        return "PostgreSQL binaries not installed (scripts/setup.sh installs the `postgresql` package)"
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        return "a throwaway PostgreSQL runs initdb as the postgres user: needs root and runuser"
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        return "no postgres system user (install the `postgresql` package)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class TempPostgres:
    base: Path
    port: int
    bindir: Path

    def url(self, db: str = "postgres") -> str:
        """A SQLAlchemy URL (psycopg 3) for database ``db``, over the unix socket."""
        return f"postgresql+psycopg://postgres@/{db}?host={self.base}&port={self.port}"

    def sql(self, statement: str) -> None:
        import psycopg

        with psycopg.connect(host=str(self.base), port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as c:
            c.execute(statement.encode())

    def create_database(self, name: str) -> str:
        self.sql(f"CREATE DATABASE {name}")
        return self.url(name)

    def restart(self) -> float:
        """``pg_ctl restart -m fast`` (every connection is cut: a fault the cluster lab injects);
        returns the seconds it took."""
        t0 = time.monotonic()
        # -l again: without it the new postmaster would write to pg_ctl's stdout, our pipe, and
        # reading that pipe to its end would last as long as the server does
        subprocess.run(["runuser", "-u", "postgres", "--", str(self.bindir / "pg_ctl"), "-D", str(self.base / "data"),
                        "-m", "fast", "-w", "-t", "30", "-l", str(self.base / "log"), "restart"],
                       check=True, capture_output=True)
        return time.monotonic() - t0

    def server_pids(self) -> list[int]:
        """The postmaster and every backend it forked (for CPU accounting)."""
        pidfile = self.base / "data" / "postmaster.pid"
        try:
            root = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return []
        out = [root]
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{root}/task"):
                with contextlib.suppress(OSError):
                    out += [int(p) for p in Path(f"/proc/{root}/task/{task}/children").read_text().split()]
        return out


@contextlib.contextmanager
def temp_postgres(*, durable: bool = True, max_connections: int = 200) -> Iterator[TempPostgres]:
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    import pwd

    bindir = _bindir()
    assert bindir is not None
    pw = pwd.getpwnam("postgres")
    base = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
    os.chown(base, pw.pw_uid, pw.pw_gid)
    port = _free_port()
    run = ["runuser", "-u", "postgres", "--"]
    started = False
    try:
        subprocess.run([*run, str(bindir / "initdb"), "-D", str(base / "data"), "--auth=trust", "-U", "postgres",
                        "-E", "UTF8", "--no-sync"], check=True, capture_output=True)
        opts = f"-k {base} -p {port} -c listen_addresses='' -c max_connections={max_connections}"
        if not durable:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        try:
            subprocess.run([*run, str(bindir / "pg_ctl"), "-D", str(base / "data"), "-o", opts, "-l",
                            str(base / "log"), "-w", "-t", "30", "start"], check=True, capture_output=True)
        except subprocess.CalledProcessError as exc:
            log = (base / "log").read_text() if (base / "log").exists() else ""
            raise RuntimeError(f"cannot start PostgreSQL: {exc.stderr.decode(errors='replace')} {log}") from None
        started = True
        yield TempPostgres(base=base, port=port, bindir=bindir)
    finally:
        if started:
            subprocess.run([*run, str(bindir / "pg_ctl"), "-D", str(base / "data"), "-m", "immediate", "-w", "stop"],
                           capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
