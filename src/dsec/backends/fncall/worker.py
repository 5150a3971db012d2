"""The FnCall worker program: runs inside a worker sandbox with the image's own python3.

Standalone on purpose: it imports only the standard library (never ``dsec``) and
runs on Python 3.8 or later, because it runs with whatever interpreter the image
ships. The host copies this file into the sandbox and starts it as root inside
the sandbox (``supervise``); it never runs on the host.

Three kinds of process, in the sandbox's namespaces, seccomp filter and cgroups:

``supervise`` (one, root in the sandbox)
    Talks to the host over its stdin/stdout in length-prefixed frames, holds
    every call's data, enforces wall-clock timeouts and output caps, and sweeps a
    call's uid clean after it. It never forks: nothing can inherit its memory.
``zygote`` (one, root in the sandbox, started by the supervisor with a fresh exec)
    Imports the preload modules once (numpy, sympy...) and then only forks. It
    never sees a call's source, arguments, results or output: what it receives
    is "fork slot S as uid U with these four pipe ends", so the memory every
    call starts from holds nothing of any other call.
a call process (one per call, forked from the zygote ahead of demand)
    Drops to the slot's own unprivileged uid, takes its limits, and waits for
    its request; runs it once, sends the result and exits. Never reused.

Why not namespaces per call: the sandbox's seccomp filter refuses ``unshare``,
``setns``, ``mount`` and namespace flags to ``clone``, and root inside the
sandbox has no CAP_SYS_ADMIN. Isolation between calls is therefore built from
what the filter leaves (docs/FNCALL.md, "Isolation"):

- memory, globals, environment: a fresh fork of the clean zygote per call;
- files: the calls' uids can write nowhere but their own scratch directory (the
  supervisor takes write permission for "other" off every directory and file of
  the root filesystem at start), made empty per call and removed after it;
- processes: every concurrent call has its own uid, so signals, ptrace,
  ``/proc/<pid>/mem`` and ``/proc/<pid>/environ`` of another call, of the zygote
  and of the supervisor are refused by the kernel; after a call every process
  of its uid is killed before the uid serves another call;
- SysV IPC and POSIX message queues (which outlive processes): refused to calls
  by an extra seccomp filter the zygote loads into itself after its imports, so
  every call inherits it (RLIMIT_MSGQUEUE 0 as well).

Host <-> supervisor frames: ``>I`` total length, ``>I`` header length, a JSON
header, then an opaque payload (the call's JSON request; the result's JSON).

Where a call's CPU goes (docs/FNCALL.md, "Where the CPU goes"): the kernel's fork
and exit of a numpy-sized address space and the pages a call writes (each one
copied), far more than Python. So the zygote and a call process are written to
touch few pages after a fork: the zygote forks with the C library's fork
(:class:`Forker`), builds what a call needs ahead (:class:`Kit`), reaps lazily
and backs what it can with 2 MiB pages (:func:`collapse_anon`); the supervisor
finds a call's uid empty from the zygote's children (:meth:`Supervisor.alone`).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import heapq
import json
import mmap
import os
import platform
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

PROTOCOL = 2
SCRATCH_ROOT = "/fncall"
"""Root-owned, mode 0711: calls can enter their own scratch directory but list nothing."""
U32 = struct.Struct(">I")
RESULT_HEAD = struct.Struct(">IBd")
"""A call's result: length of what follows the length, kind, seconds its code ran."""
MAX_FRAME = 1 << 30
LATE_EXIT_S = 0.5
"""A call answered early whose process has not exited this long after is killed."""
KILLER_OFFSET = 1024
"""Slot ``i`` runs calls as ``uid_base + i`` and kills them as ``uid_base + KILLER_OFFSET + i``."""
TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EAGAIN, errno.ENOMEM, errno.EMFILE,
                              errno.ENFILE})
"""A slot's new process that fails with one of these (a call filled the disk, ran the pids or
memory out) is forked again when the call is gone, never counted against the worker."""
MAX_START_FAILURES = 20
"""A slot whose new process fails this many times in a row for another reason gives up the worker."""
UID_SPAN = 2 * KILLER_OFFSET
"""Uids from ``uid_base`` that belong to calls and their kill helpers (none may own a file)."""
WATCH_S = 1.0
SPARE_PREFIX = "spare-"
SPARES_PER_SLOT = 4
"""Scratch directories made ahead per slot: what a slot can start with while a call holds the disk full."""
RETRY_CLEAN_S = 2.0
"""A scratch tree that could not be removed (moved under the cleaner) is tried again this much later."""
HELD_STEP = 4 << 20
"""A slot's memory limit is the call's ``memory`` plus what the slot holds, rounded down to this."""

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2

# Result kinds (one byte from the call process).
K_VALUE = 0x56  # "V": the JSON value follows
K_ERROR = 0x45  # "E": {exc_type, message, traceback}
K_OOM = 0x4D  # "M": MemoryError under the call's memory cap
K_TOO_LARGE = 0x4F  # "O": the JSON result is larger than the output cap
RESULT_KINDS = {K_VALUE: "value", K_ERROR: "error", K_OOM: "oom", K_TOO_LARGE: "output"}


def protocol_error(message: str) -> bytes:
    """An error payload for a call that broke the result protocol (it is the call's own failure)."""
    return json.dumps({"exc_type": "ProtocolError", "message": message, "traceback": ""}).encode()


def _now() -> float:
    return time.monotonic()


def _log(msg: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (f"dsec-fncall[{os.getpid()}]: {msg}\n").encode("utf-8", "replace"))


# ----------------------------------------------------------------- kernel ----

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def prctl(option: int, arg2: int = 0) -> None:
    Prctl(option, arg2)()


class Prctl:
    """One prctl(2) call with its arguments built ahead: the zygote builds them, so a call
    process only makes the call (making ctypes objects after a fork copies pages for nothing)."""

    def __init__(self, option: int, arg2: int = 0, arg3: Any = 0) -> None:
        self.option = option
        self._fn = _lib().prctl
        self._args = (ctypes.c_int(option), ctypes.c_ulong(arg2),
                      arg3 if isinstance(arg3, ctypes.c_void_p) else ctypes.c_ulong(arg3), ctypes.c_ulong(0),
                      ctypes.c_ulong(0))

    def __call__(self) -> None:
        if self._fn(*self._args) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"prctl({self.option}): {os.strerror(e)}")


# Syscalls a call may not make: each creates an object that outlives the call's processes
# and that another call could open by key or name. numbers per audit arch.
_IPC_SYSCALLS = {
    0xC000003E: (29, 64, 68, 240),  # x86_64: shmget, semget, msgget, mq_open
    0xC00000B7: (194, 190, 186, 180),  # aarch64: shmget, semget, msgget, mq_open
}
_MACHINE_ARCH = {"x86_64": 0xC000003E, "amd64": 0xC000003E, "aarch64": 0xC00000B7, "arm64": 0xC00000B7}


def ipc_filter() -> bytes:
    """A classic BPF seccomp program: EPERM for the IPC syscalls above, kill for a foreign
    arch (the sandbox's own filter already kills those), x32 numbers refused on x86_64."""
    arch = _MACHINE_ARCH.get(platform.machine().lower())
    if arch is None:
        raise OSError(errno.ENOSYS, f"no IPC filter for machine {platform.machine()!r}")
    nrs = _IPC_SYSCALLS[arch]
    ld_w_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny, kill = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x80000000
    n = len(nrs)
    ins: list[tuple[int, int, int, int]] = [
        (ld_w_abs, 0, 0, 4),  # arch
        (jeq, 0, n + 4, arch),  # -> kill
        (ld_w_abs, 0, 0, 0),  # nr
        (jge, n + 1, 0, 0x40000000),  # x32 ABI -> deny
    ]
    for i, nr in enumerate(nrs):
        ins.append((jeq, n - i, 0, nr))  # -> deny
    ins += [(ret, 0, 0, allow), (ret, 0, 0, deny), (ret, 0, 0, kill)]
    return b"".join(struct.pack("=HBBI", *x) for x in ins)


def load_filter(prog: bytes) -> None:
    """Load a seccomp program into this process (and so into every process it forks after)."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    Prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_void_p(ctypes.addressof(fprog)))()


class Forker:
    """fork(2) of the C library, without CPython's after-fork work in the child.

    ``os.fork`` runs every ``os.register_at_fork`` hook in the child; ``threading``'s alone
    (it rebuilds the module's locks and thread tables) writes ~150 pages of the template
    that a call then has to copy, ~0.4 ms a call. Those hooks exist for locks that another
    thread held at the fork; the zygote has one thread (checked after its preloads: with
    more, calls are forked with ``os.fork``), so there are none. The C library's own
    ``pthread_atfork`` handlers still run (this is its ``fork``), the interpreter lock stays
    held across the call (``PyDLL``), and the hooks the preloaded modules registered run in
    the child all the same (:meth:`child`), ``random``'s reseed among them."""

    def __init__(self) -> None:
        self.hooks: list[Callable[[], Any]] = []
        self._fn: Any = None
        self._real = os.register_at_fork

    def recording(self) -> contextlib.AbstractContextManager[None]:
        """Note the ``after_in_child`` hooks registered meanwhile (the preloads' imports)."""
        forker = self

        @contextlib.contextmanager
        def cm() -> Any:
            def register_at_fork(**kw: Any) -> None:
                forker._real(**kw)
                if kw.get("after_in_child") is not None:
                    forker.hooks.append(kw["after_in_child"])

            os.register_at_fork = register_at_fork
            try:
                yield
            finally:
                os.register_at_fork = forker._real

        return cm()

    def arm(self) -> bool:
        """Use the C library's fork from now on if this process has one thread."""
        try:
            if len(os.listdir("/proc/self/task")) != 1:
                return False
            fn = ctypes.PyDLL(None, use_errno=True).fork
            fn.restype, fn.argtypes = ctypes.c_int, ()
        except (OSError, AttributeError):
            return False
        self._fn = fn
        return True

    def fork(self) -> int:
        if self._fn is None:
            return os.fork()
        pid = int(self._fn())
        if pid < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return pid

    @property
    def armed(self) -> bool:
        return self._fn is not None

    def child(self) -> None:
        """In a child forked with the C library's fork: what ``os.fork`` would have run of the
        preloads' hooks (their errors ignored, as ``os.fork`` does)."""
        if self._fn is None:
            return
        for hook in self.hooks:
            try:  # noqa: SIM105 - not contextlib.suppress: its objects are pages copied in the call
                hook()
            except Exception:
                pass


class NumpySeed:
    """Reseed numpy's legacy global generator (``np.random.seed()`` and friends) per call.

    ``numpy.random.seed()`` goes through SeedSequence and numpy arrays: in a fresh fork that
    is ~0.6 ms and ~200 copied pages. The generator's state is 624 words and a position
    (MT19937's ``mt19937_state``, whose address numpy gives as ``ctypes.state_address``), so
    the zygote checks once that writing there is what ``get_state`` reads back, and a call
    process writes 2,496 bytes of ``os.urandom`` and position 624 (the same state
    ``seed(<array>)`` makes: a full-entropy key, regenerated on the next draw). If the check
    fails (another numpy, another generator), each call runs ``numpy.random.seed()``."""

    KEY = 624 * 4

    def __init__(self) -> None:
        self.npr: Any = sys.modules.get("numpy.random")
        self.view: memoryview | None = None
        if self.npr is None:
            return
        try:
            rs = self.npr.mtrand._rand
            if type(rs._bit_generator).__name__ != "MT19937":
                return
            if rs.get_state(legacy=True)[3]:
                self.npr.seed()  # a cached gaussian would be shared by every call: drop it
            saved = rs.get_state(legacy=True)
            view = memoryview((ctypes.c_ubyte * (self.KEY + 4)).from_address(
                int(rs._bit_generator.ctypes.state_address))).cast("B")
            probe = bytes(range(256)) * (self.KEY // 256) + bytes(range(self.KEY % 256))
            view[: self.KEY] = probe
            struct.pack_into("=i", view, self.KEY, 624)
            st = rs.get_state(legacy=True)
            ok = st[1].tobytes() == probe and st[2] == 624 and not st[3]
            rs.set_state(saved)
            if ok:
                self.view = view
        except Exception:
            self.view = None

    def reseed(self) -> None:
        if self.view is not None:
            self.view[: self.KEY] = os.urandom(self.KEY)
            self.view[3 if sys.byteorder == "little" else 0] |= 0x80  # key[0]'s top bit, as init_by_array
            struct.pack_into("=i", self.view, self.KEY, 624)
        elif self.npr is not None:
            self.npr.seed()


def send_msg(sock: socket.socket, text: str, fds: tuple[int, ...] = ()) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    deadline = _now() + 10.0
    while True:
        try:
            sock.sendmsg([text.encode()], anc)
            return
        except BlockingIOError:
            if _now() > deadline:
                raise OSError(errno.ETIMEDOUT, "control socket full") from None
            time.sleep(0.001)


def recv_msg(sock: socket.socket) -> tuple[str | None, list[int]]:
    """One control message (None at EOF) and the fds it carried."""
    msg, anc, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - (len(data) % a.itemsize)])
            fds.extend(a)
    if not msg:
        for fd in fds:
            os.close(fd)
        return None, []
    return msg.decode(), fds


def proc_uids(uids: set[int], skip: set[int]) -> dict[int, int]:
    """Processes with a live task whose uids (any of real, effective, saved, filesystem)
    meet ``uids``: pid -> uid. A zombie leader whose other threads still run counts (it is
    a zombie only in name: :func:`_dead`). ``skip``: pids whose uid the caller knows."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in skip:
            continue
        try:
            state, ids, threads = _status(_read(f"/proc/{pid}/status"))
        except OSError:
            continue
        hit = ids & uids
        if hit and not _dead(state, threads):
            out[pid] = min(hit)
    return out


def _status(data: bytes) -> tuple[bytes, set[int], int]:
    """A /proc/<pid>/status's state letter, uids (real, effective, saved, filesystem) and
    thread count (0 when it does not say)."""
    i = data.find(b"\nState:")
    j = data.find(b"\nUid:")
    if i < 0 or j < 0:
        return b"", set(), 0
    state = data[i + 7 : i + 16].split()[:1]
    k = data.find(b"\nThreads:")
    threads = int(data[k + 9 : data.find(b"\n", k + 9)]) if k >= 0 else 0
    return (state[0] if state else b""), {int(x) for x in data[j + 5 : data.find(b"\n", j + 5)].split()}, threads


def _dead(state: bytes, threads: int) -> bool:
    """Nothing of this process runs: a zombie (or dead) whose thread group is empty. A leader
    that ended with the raw ``exit`` system call (not ``exit_group``) is a zombie while its
    other threads run on as its uid: ``Threads:`` still counts them (it is 1 for a true zombie,
    whose leader alone waits to be reaped)."""
    return state in (b"Z", b"X") and threads <= 1


def _read(path: str) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ----------------------------------------------------------------- lockdown --


def lockdown(uid_lo: int, uid_hi: int) -> dict[str, int]:
    """Take write permission for "other" off every directory and file of the root
    filesystem (and /dev/shm), and give anything owned by the calls' uid range to root:
    afterwards a call's uid can write only where it is given a directory of its own."""
    root_dev = os.lstat("/").st_dev
    skip = {"/proc", "/sys", "/dev"}
    counts = {"entries": 0, "fixed": 0}
    failed: list[str] = []

    def fix(path: str, st: os.stat_result) -> None:
        counts["entries"] += 1
        if stat.S_ISLNK(st.st_mode):
            return
        try:
            if uid_lo <= st.st_uid < uid_hi or uid_lo <= st.st_gid < uid_hi:
                os.lchown(path, 0, 0)
                counts["fixed"] += 1
            if st.st_mode & stat.S_IWOTH:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~stat.S_IWOTH)
                counts["fixed"] += 1
        except OSError as e:
            failed.append(f"{path}: {e.strerror}")

    def walk(top: str, dev: int) -> None:
        stack = [top]
        while stack:
            d = stack.pop()
            try:
                it = list(os.scandir(d))
            except OSError:
                continue
            for e in it:
                if e.path in skip:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                is_dir = stat.S_ISDIR(st.st_mode)
                if is_dir and st.st_dev != dev:
                    continue  # a mount point: not the image's files (an overlay's files may
                    # report their layer's device; its directories report the overlay's)
                fix(e.path, st)
                if is_dir:
                    stack.append(e.path)

    fix("/", os.lstat("/"))
    walk("/", root_dev)
    for extra in ("/dev/shm", "/dev/mqueue"):
        try:
            st = os.lstat(extra)
        except OSError:
            continue
        fix(extra, st)
        if stat.S_ISDIR(st.st_mode):
            walk(extra, st.st_dev)
    if failed:  # fail closed: a place every call could write is a channel between calls
        raise OSError(errno.EPERM, "cannot take write permission for others off: " + "; ".join(failed[:10]))
    return counts


# ------------------------------------------------------------------ call ----


def _exc_name(t: type) -> str:
    mod = getattr(t, "__module__", "builtins")
    return t.__qualname__ if mod in ("builtins", "__main__", None) else f"{mod}.{t.__qualname__}"


def _jsonable(o: Any) -> Any:
    tolist = getattr(o, "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        return tolist()
    if isinstance(o, (set, frozenset)):
        return list(o)
    raise TypeError(f"the result is not JSON-serialisable: {type(o).__name__}")


def run_source(source: str, args: list[Any], kwargs: dict[str, Any], entry: str | None) -> Any:
    """The call contract: run ``source`` as a module named ``__fncall__``; if it defines a
    callable ``entry`` (default ``main``), the result is ``entry(*args, **kwargs)``
    (awaited if it is a coroutine); otherwise the value of its last top-level
    expression statement (None if it does not end with one)."""
    import ast
    import builtins
    import linecache

    linecache.cache["<fncall>"] = (len(source), None, source.splitlines(True), "<fncall>")
    tree = ast.parse(source, "<fncall>", "exec")
    ns: dict[str, Any] = {"__name__": "__fncall__", "__builtins__": builtins, "__file__": "<fncall>"}
    tail = None
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr):
        tree.body.pop()
        tail = ast.Expression(last.value)
    exec(compile(tree, "<fncall>", "exec"), ns)
    value = eval(compile(tail, "<fncall>", "eval"), ns) if tail is not None else None
    name = entry or "main"
    fn = ns.get(name)
    if callable(fn):
        value = fn(*args, **kwargs)
    elif entry is not None:
        raise NameError(f"the source defines no callable {entry!r} (the entry point asked for)")
    elif args or kwargs:
        raise TypeError("arguments were given but the source defines no main(); define main(*args, **kwargs)")
    if hasattr(value, "__await__") and hasattr(value, "send"):
        import asyncio

        value = asyncio.run(value)  # type: ignore[arg-type]
    return value


def _traceback(e: BaseException) -> str:
    import traceback

    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<fncall>":
        tb = tb.tb_next
    # A line over 2,000 characters (the exception's own line repeats its message, which travels
    # apart) keeps its head: the frames are what a traceback is read for.
    return "".join(x if len(x) <= 2000 else x[:1000] + "[...]\n"
                   for x in traceback.format_exception(type(e), e, tb))


class Kit:
    """What a call process needs from the zygote, made there once (a call process only uses
    it: every object made after the fork is pages copied for nothing)."""

    def __init__(self, limits: dict[str, int], forker: Forker, *, signals: bool) -> None:
        import importlib
        import resource

        self.zygote = os.getpid()
        self.forker = forker
        self.signals = signals  # the zygote set a SIGCHLD handler and a wake-up fd: undo them
        self.sigchld = (int(signal.SIGCHLD), int(signal.SIG_DFL))
        # signal.signal's enum conversions cost a call ~60 copied pages; _signal's is the same call
        self.signal: Callable[..., Any] = getattr(importlib.import_module("_signal"), "signal", signal.signal)
        self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        self.rlimits = [(resource.RLIMIT_NPROC, (int(limits["nproc"]),) * 2),
                        (resource.RLIMIT_FSIZE, (int(limits["fsize"]),) * 2),
                        (resource.RLIMIT_NOFILE, (int(limits["nofile"]),) * 2)]
        self.setrlimit = resource.setrlimit
        self.pdeathsig = Prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        self.undumpable = Prctl(PR_SET_DUMPABLE, 0)
        self.numpy = NumpySeed()
        # random reseeds itself in os.fork's hook; forked by the C library, a call runs the
        # hook only if a preload imported random (recorded), so otherwise it reseeds here.
        rnd: Any = sys.modules.get("random")
        seed = getattr(getattr(rnd, "_inst", None), "seed", None)
        self.random: Any = rnd if forker.armed and rnd is not None and seed not in forker.hooks else None
        self.tempfile: Any = sys.modules.get("tempfile")
        self.procs: list[int] = []  # per slot: its memory cgroup's cgroup.procs (zygote_main)


def call_child(uid: int, scratch: str, fds: list[int], kit: Kit, slot: int) -> None:
    """The call process: set up as the slot's uid, say ready, run one request, exit.

    The zygote already holds what every call shares and a fork inherits: no_new_privs, the
    IPC seccomp filter, RLIMIT_CORE and RLIMIT_MSGQUEUE 0 (zygote_main)."""
    req_r, res_w, out_w, err_w, go_w = fds
    try:
        if kit.procs:
            # Into the slot's memory cgroup first, while still root: what the call's processes
            # hold (pages, memfds, pipe buffers, page cache) is bounded by the call's `memory`.
            # The fd is closed below with every other: the call cannot move itself out.
            os.write(kit.procs[slot], b"0")
        kit.forker.child()
        if kit.signals:
            signal.set_wakeup_fd(-1)
            kit.signal(*kit.sigchld)  # the only disposition the zygote changed
        os.setsid()
        os.dup2(kit.devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        a, b, c = sorted((req_r, res_w, go_w))
        os.closerange(3, a)  # nothing of the zygote's stays open in a call (close_range(2))
        os.closerange(a + 1, b)
        os.closerange(b + 1, c)
        os.closerange(c + 1, 1 << 20)
        os.set_inheritable(req_r, False)
        os.set_inheritable(res_w, False)
        os.set_inheritable(go_w, False)
        if os.path.basename(scratch).startswith(SPARE_PREFIX):
            st = os.lstat(scratch)  # made ahead by the supervisor: root's, 0700, empty
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or stat.S_IMODE(st.st_mode) != 0o700:
                raise OSError(errno.EPERM, f"{scratch} is not a spare scratch directory")
        else:
            os.mkdir(scratch, 0o700)
        os.chown(scratch, uid, uid)
        adj = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:  # the cgroup's OOM killer takes a call before the zygote or supervisor
            os.write(adj, b"1000")
        finally:
            os.close(adj)
        for res, lim in kit.rlimits:
            kit.setrlimit(res, lim)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        kit.pdeathsig()  # after the uid change, which clears it
        if os.getppid() != kit.zygote:
            os._exit(3)
        kit.undumpable()
        os.chdir(scratch)
        os.umask(0o077)
        # The zygote was started with the calls' environment: only these differ per call.
        name = f"fncall{uid}"  # no passwd entry: getpass.getuser() and friends read these
        env = os.environ  # item by item: update() goes through the Mapping ABCs, ~40 pages more
        env["HOME"] = env["TMPDIR"] = env["PWD"] = scratch
        env["USER"] = env["LOGNAME"] = name
        if kit.tempfile is not None:
            kit.tempfile.tempdir = None  # a preload may have cached the zygote's
        sys.argv[:] = ["<fncall>"]
        if kit.random is not None:
            kit.random.seed()  # what os.fork's hook would have done (Kit)
        kit.numpy.reseed()  # the legacy global generator is not reseeded at fork by numpy
        warm()
        os.write(res_w, b"R")
    except BaseException as e:
        try:
            os.write(res_w, (f"F{getattr(e, 'errno', None) or 0} {type(e).__name__}: {e}").encode()[:4000])
        finally:
            os._exit(4)
    # Ready: block until the supervisor hands over one request.
    try:
        data = read_all(req_r)
        os.close(req_r)
        # "From here the call's code may run": a process killed before this byte (the OOM
        # killer took it as it waited, as the request came) never ran its call, which the
        # supervisor then runs on another slot (Supervisor.never_took).
        os.write(go_w, b"g")
        os.close(go_w)
    except BaseException:
        os._exit(5)
    frame = handle(data, limit=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:
            pass
    try:
        write_all(res_w, frame)
    finally:
        os._exit(0)


WARM_REQUEST = (b'{"memory":0,"cap":65536,"cpu":null}\n'
                b'{"source":"import json\\ndef main(a, b=1):\\n    return [a, b, {\\"k\\": str(a)}, json.dumps(a)]\\n",'
                b'"args":[1.5],"kwargs":{"b":"x"},"entry":null}')


def warm() -> None:
    """Run the call path once with fixed requests before the real one: a fresh fork shares
    every page with the zygote, and the first write to each (reference counts, allocator
    pools) copies it. Paid here, before the call process says it is ready, not by the call."""
    for req in (WARM_REQUEST,):
        handle(req, limit=False)
    with open("/proc/self/statm", "rb") as f:
        f.read()


def handle(data: bytes, *, limit: bool) -> bytes:
    """One request (a limits line, then the call's JSON) to its result frame."""
    try:
        line, _, body = data.partition(b"\n")
        lim = json.loads(line)
        req = json.loads(body)
        source, args, kwargs, entry = req["source"], req.get("args") or [], req.get("kwargs") or {}, req.get("entry")
        if not isinstance(source, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
            raise TypeError("bad request")
        cap = int(lim["cap"])
        # Address space given back on MemoryError, so the error can still be sent. Mapped,
        # never touched: a bytearray would be zero-filled, 256 page faults on every call.
        reserve = mmap.mmap(-1, 1 << 20)
        if limit:
            import resource

            if lim.get("cpu"):
                resource.setrlimit(resource.RLIMIT_CPU, (int(lim["cpu"]), int(lim["cpu"]) + 1))
            with open("/proc/self/statm", "rb") as f:
                vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (vm + int(lim["memory"]), vm + int(lim["memory"])))
    except BaseException as e:
        bad = json.dumps({"exc_type": "ProtocolError", "message": repr(e), "traceback": ""}).encode()
        return RESULT_HEAD.pack(9 + len(bad), K_ERROR, 0.0) + bad
    kind, payload = K_VALUE, b""
    t0 = time.perf_counter()
    try:
        value = run_source(source, args, kwargs, entry)
        ran = time.perf_counter() - t0
        payload = json.dumps(value, default=_jsonable, separators=(",", ":")).encode()
        if len(payload) > cap:
            kind, payload = K_TOO_LARGE, json.dumps({"size": len(payload)}).encode()
        elif payload.count(b"[") + payload.count(b"{") > MAX_DEPTH and json_depth(payload) > MAX_DEPTH:
            raise TypeError(f"the result is nested more than {MAX_DEPTH} levels deep: JSON readers "
                            "(the SDK's among them) cannot all read it back")
    except MemoryError:
        ran = time.perf_counter() - t0
        reserve.close()
        kind, payload = K_OOM, b"{}"
    except BaseException as e:
        ran = time.perf_counter() - t0
        try:
            message = str(e)
        except BaseException:
            message = f"<unprintable {type(e).__name__}>"
        try:
            tb = _traceback(e)
        except BaseException:
            tb = ""
        kind = K_ERROR
        payload = error_payload(_exc_name(type(e)), message, tb, cap)
    return RESULT_HEAD.pack(9 + len(payload), kind, ran) + payload


MAX_DEPTH = 256
"""Deepest nesting of lists and objects a result may have (a reader's stack must hold it)."""
_JSON_TOKENS = None


def json_depth(data: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in a JSON text (brackets inside strings skipped)."""
    global _JSON_TOKENS
    import re

    if _JSON_TOKENS is None:
        _JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
    depth = deepest = 0
    for m in _JSON_TOKENS.finditer(data):
        c = m.group()[:1]
        if c in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest


CUT = "[...]"


def error_payload(exc_type: str, message: str, tb: str, cap: int) -> bytes:
    """The JSON of an exception in at most ``cap`` bytes: the longer of the message (its head
    kept) and the traceback (its tail kept) is halved until it fits, marked where cut. An
    exception is never reported as output over the cap, whatever its message's size."""
    exc_type = exc_type[:100]  # <= 600 bytes of JSON: the cap is at least 1 KiB
    while True:
        payload = json.dumps({"exc_type": exc_type, "message": message, "traceback": tb}).encode()
        if len(payload) <= cap or len(message) + len(tb) <= 4 * len(CUT):
            return payload
        if len(message) >= len(tb):
            message = message[: len(message) // 2] + CUT
        else:
            tb = CUT + tb[-(len(tb) // 2) :]


# ----------------------------------------------------------------- zygote ----


def zygote_main(cfg: dict[str, Any]) -> None:
    ctl_fd = int(cfg["ctl_fd"])
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(cfg["supervisor"]):
        os._exit(1)
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # a call's orphans come here and are reaped
    ctl = socket.socket(fileno=ctl_fd)
    info: dict[str, Any] = {"python": sys.version.split()[0], "preloaded": {}, "pid": os.getpid()}
    t0 = time.perf_counter()
    import importlib

    forker = Forker()
    with forker.recording():  # the preloads' after-fork hooks, run in each call (Forker)
        for name in cfg["preload"]:
            t = time.perf_counter()
            try:
                mod = importlib.import_module(name)
            except BaseException as e:
                send_msg(ctl, "E" + json.dumps({"module": name, "error": f"{type(e).__name__}: {e}"}))
                os._exit(2)
            info["preloaded"][name] = {"s": round(time.perf_counter() - t, 4),
                                       "version": str(getattr(mod, "__version__", ""))}
    import ast  # noqa: F401 - the call path's own imports, done once here
    import linecache  # noqa: F401
    import resource
    import traceback  # noqa: F401

    info["preload_s"] = round(time.perf_counter() - t0, 4)
    # Exits: the supervisor sees a call process end through its pidfd, so the zygote reaps
    # its children lazily, whenever a message comes (no wake-up of its own per call: every
    # page it writes after a fork is a page copied), and reports only failures ("X pid
    # status") and what it is asked ("W pid"). Without pidfds it reports every exit at once.
    eager = bool(cfg.get("report_exits", True))
    wake_r = wake_w = -1
    if eager:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
    ctl.setblocking(False)
    try:
        # What every call gets and the zygote can hold itself (it forks, never execs, never
        # uses SysV IPC, message queues or core dumps): a fork inherits them, and neither a
        # filter nor no_new_privs can be undone. Loaded after the preloads, so their imports
        # were not filtered. Fail closed: no call runs without them.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        load_filter(ipc_filter())
        info["fork"] = "libc" if forker.arm() else "os.fork"
        kit = Kit(dict(cfg["limits"]), forker, signals=eager)
        kit.procs = [int(fd) for fd in cfg.get("cgroup_procs") or []]
    except OSError as e:
        send_msg(ctl, "E" + json.dumps({"module": "(seccomp, limits)", "error": str(e)}))
        os._exit(2)
    info["numpy_seed"] = "state" if kit.numpy.view is not None else ("seed()" if kit.numpy.npr else "-")
    import gc

    gc.collect()
    gc.freeze()  # calls' collections never walk (and so never copy) the template's objects
    t = time.perf_counter()
    info["huge_mib"] = collapse_anon() >> 20
    info["huge_s"] = round(time.perf_counter() - t, 4)
    send_msg(ctl, "R" + json.dumps(info))
    _serve(ctl, forker, kit, wake_r if eager else -1)


MADV_COLLAPSE = 25
HUGE = 2 << 20


def collapse_anon() -> int:
    """Back what can be of the template's writable memory with 2 MiB pages (MADV_COLLAPSE,
    Linux 6.1; best effort: a refusal changes nothing): each fork then copies one page-table
    entry for 2 MiB instead of 512, and each call's exit drops one. A call that writes into
    such a page splits only its own mapping of it and copies 4 KiB, as before. Only whole
    aligned 2 MiB ranges inside a mapping can be collapsed (6-10 MiB of the ~20 of a numpy
    template). Returns the bytes collapsed."""
    done = 0
    try:
        with open("/proc/self/maps") as fh:
            maps = fh.read().splitlines()
        madvise = _lib().madvise
    except (OSError, AttributeError):
        return 0
    for line in maps:
        f = line.split()
        if not f[1].startswith("rw") or (len(f) >= 6 and not f[5].startswith("[heap]")):
            continue  # private anonymous memory (and the brk heap) only
        lo, hi = (int(x, 16) for x in f[0].split("-"))
        lo, hi = (lo + HUGE - 1) & ~(HUGE - 1), hi & ~(HUGE - 1)
        if hi > lo and madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_COLLAPSE) == 0:
            done += hi - lo
    return done


def _serve(ctl: socket.socket, forker: Forker, kit: Kit, wake_r: int) -> None:
    """The zygote's loop: fork on "F", kill a uid on "K", report an exit on "W", reap on "Z".

    Every page it writes after a fork is a page the kernel copies (the new call process
    still shares them all): so it is one function over locals, and a fork's answer goes
    out with a plain write."""
    import select

    eager = wake_r >= 0
    poller = select.poll()
    ctl_fd = ctl.fileno()
    poller.register(ctl_fd, select.POLLIN)
    if eager:
        poller.register(wake_r, select.POLLIN)
    poll, recvmsg, fork, close = poller.poll, ctl.recvmsg, forker.fork, os.close
    space = socket.CMSG_SPACE(16 * 4)
    while True:
        for fd, _ev in poll():
            if fd == wake_r:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
                _reap(ctl, eager)
                continue
            try:
                data, anc, _flags, _addr = recvmsg(4096, space)
            except BlockingIOError:
                continue
            fds = _fds(anc)
            if not data:
                os._exit(0)  # the supervisor is gone
            reaped = _reap(ctl, eager)
            op = data[:1]
            if op == b"F":  # F slot uid scratch, with four fds
                _op, slot_b, uid_b, scratch = data.split(b" ", 3)
                try:
                    pid = fork()
                except OSError as e:  # EAGAIN (pids cgroup, RLIMIT_NPROC): the supervisor retries
                    for fd_ in fds:
                        close(fd_)
                    send_msg(ctl, f"P {slot_b.decode()} -{e.errno}")
                    continue
                if pid == 0:
                    call_child(int(uid_b), scratch.decode(), fds, kit, int(slot_b))  # closes every other fd first
                    os._exit(6)  # not reached
                for fd_ in fds:
                    close(fd_)
                try:  # a write on a SOCK_SEQPACKET socket is one message: no sendmsg's lists
                    os.write(ctl_fd, b"P " + slot_b + b" %d" % pid)
                except BlockingIOError:
                    send_msg(ctl, f"P {slot_b.decode()} {pid}")  # full: wait as send_msg does
            elif op == b"W":  # it has exited (its pidfd said so): reaped just now, before, or now
                pid = int(data[2:])
                status = reaped.get(pid)
                if status is None:
                    try:
                        status = os.waitpid(pid, 0)[1]
                    except ChildProcessError:
                        status = 0  # reaped before, and not reported then: it was 0
                send_msg(ctl, f"X {pid} {status}")
            elif op == b"K":  # K uid killer
                uid_b, _, killer_b = data[2:].partition(b" ")
                _kill_uid(ctl, int(uid_b), int(killer_b), eager)
            elif op == b"Z":  # reaped above
                send_msg(ctl, "z " + data[2:].decode())
            else:
                for fd_ in fds:
                    close(fd_)


def _fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - (len(data) % a.itemsize)])
            fds.extend(a)
    return fds


KILLER_WAIT_S = 2.0
"""How long the zygote waits for a kill helper before it kills the helper itself."""


def _kill_uid(ctl: socket.socket, uid: int, killer: int, eager: bool) -> None:
    """Kill every process of ``uid`` from a helper that takes the uid (kill(-1) is atomic
    against fork); answered with "k uid" once the helper is gone.

    The helper's real and saved uid are ``killer`` (a uid no call runs as), its effective
    uid is ``uid``: the kernel lets it signal every process whose real or saved uid is
    ``uid`` (its effective uid matches theirs) and nothing else, while a process of ``uid``
    cannot signal it (neither of the helper's real and saved uids is one of theirs). So a
    leftover that spins ``kill(-1, SIGSTOP)`` cannot stop the helper that kills it. The
    zygote never waits for it unbounded all the same."""
    try:
        pid = os.fork()
    except OSError:
        send_msg(ctl, f"k {uid}")  # the supervisor sees what is left and asks again
        return
    if pid == 0:
        try:
            ctl.detach()
            os.setgroups([])
            os.setresgid(killer, killer, killer)
            os.setresuid(killer, uid, killer)
            os.kill(-1, signal.SIGKILL)  # every process of this uid, at once
        except BaseException:
            pass
        os._exit(0)
    deadline = _now() + KILLER_WAIT_S
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            break
        if done:
            break
        if _now() > deadline:
            _log(f"the kill helper for uid {uid} did not end in {KILLER_WAIT_S} s: killed")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            break
        time.sleep(0.0005)
    _reap(ctl, eager)
    send_msg(ctl, f"k {uid}")


def _reap(ctl: socket.socket, every: bool) -> dict[int, int]:
    """Reap the children that have exited; report their status (with ``every``, or when not 0)."""
    reaped: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped[pid] = status
        if every or status:
            send_msg(ctl, f"X {pid} {status}")


# -------------------------------------------------------------- supervisor ---


class Call:
    __slots__ = (
        "cap",
        "done",
        "err",
        "exited",
        "id",
        "killed",
        "limits",
        "out",
        "payload",
        "requeue",
        "res",
        "status",
        "t0",
        "timer",
        "tries",
        "wire",
        "written",
    )

    def __init__(self, cid: Any, limits: dict[str, Any], payload: bytes) -> None:
        self.id = cid
        self.wire = b""
        self.requeue = False
        self.tries = 0
        self.t0 = _now()
        self.limits = limits
        self.payload = payload
        self.out = bytearray()
        self.err = bytearray()
        self.res = bytearray()
        self.exited = False
        self.status: int | None = None
        self.killed: str | None = None
        self.timer: list[Any] | None = None
        self.cap = int(limits["output_cap"])
        self.done = False
        self.written = 0

    def retry(self) -> None:
        """Back to the queue, as if it had not been sent (its process never took it)."""
        self.tries += 1
        self.requeue = self.exited = False
        self.written = 0
        self.status = None
        self.out.clear()
        self.err.clear()
        self.res.clear()


class Slot:
    __slots__ = (
        "call",
        "cg",
        "cg_limit",
        "err_r",
        "failing_since",
        "fails",
        "go_r",
        "index",
        "killer",
        "live",
        "out_r",
        "pid",
        "pidfd",
        "ready_buf",
        "reaped",
        "req_w",
        "res_r",
        "scratch",
        "state",
        "sweeps",
        "uid",
        "waited",
        "wreg",
    )

    def __init__(self, index: int, uid: int, killer: int) -> None:
        self.index = index
        self.uid = uid
        self.killer = killer  # the real uid of the helper that kills the slot's processes (_kill_uid)
        self.state = "idle"  # idle -> forking -> ready -> busy -> sweeping -> cleaning -> idle
        self.pid = 0
        self.live = False  # a process runs (or is unreaped) at pid: it has not been seen to exit
        self.waited = False  # its exit status was asked of the zygote ("W")
        self.wreg = False  # req_w is registered for writing (the request did not fit the pipe)
        self.pidfd = -1
        self.reaped = False  # the zygote was asked to reap what a sweep killed ("Z")
        self.req_w = self.res_r = self.out_r = self.err_r = self.go_r = -1
        self.scratch = ""
        self.call: Call | None = None
        self.ready_buf = b""
        self.sweeps = 0
        self.fails = 0  # its new process failed to start, in a row
        self.failing_since = 0.0
        self.cg: tuple[int, int, int, int] | None = None  # fds: cgroup.procs, memory limit, memory+swap limit, usage
        self.cg_limit = 0  # the memory limit last written


class Supervisor:
    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.out_registered = False
        self.timers: list[list[Any]] = []
        self.seq = 0
        self.slots: list[Slot] = []
        self.queue: deque[Call] = deque()
        self.by_pid: dict[int, Slot] = {}
        self.statuses: dict[int, int] = {}
        self.ctl: socket.socket | None = None
        self.zygote = 0
        self.cfg: dict[str, Any] = {}
        self.ready_sent = False
        self.closing = False
        self.cleanups: deque[tuple[Slot, str]] = deque()
        self.cleaned: deque[Slot] = deque()
        self.clean_cv = threading.Condition()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.pidfd_ok = hasattr(os, "pidfd_open")
        self.children_ok = False  # /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN)
        self.info: dict[str, Any] = {}
        self.started: dict[str, Any] = {}
        self.dying = False
        self.cleaner_thread = threading.Thread(target=self.cleaner, daemon=True, name="cleaner")
        self.cleaner_failed = ""
        self.retry: deque[tuple[float, str]] = deque()  # (when, scratch tree set aside)
        self.spares: deque[str] = deque()  # scratch directories made ahead (make_spares)
        self.spares_wanted = 0
        self.spares_due = 0.0  # when the cleaner may try to make spares again
        self.fdq: deque[int] = deque()  # fds that came with the host's frames, in order
        self.stdin_sock: socket.socket | None = None
        self.cg_fds: list[int] = []

    def watch(self) -> None:
        """Every WATCH_S: the worker's own machinery still works (its cleaner thread lives),
        or the worker is given up and the host starts another."""
        if not self.cleaner_thread.is_alive():
            self.fatal("the cleaner thread is gone")
        self.timer(WATCH_S, self.watch)

    # -- plumbing --

    def timer(self, delay: float, fn: Callable[[], None]) -> list[Any]:
        self.seq += 1
        t = [_now() + delay, self.seq, fn]
        heapq.heappush(self.timers, t)
        return t

    @staticmethod
    def cancel(t: list[Any] | None) -> None:
        if t is not None:
            t[2] = None

    def send(self, header: dict[str, Any], *payload: bytes | bytearray) -> None:
        """One frame; the payload's parts are appended as they are (no joined copy: a result
        can carry three times the output cap)."""
        h = json.dumps(header, separators=(",", ":")).encode()
        out = self.outbuf
        out += U32.pack(4 + len(h) + sum(len(x) for x in payload))
        out += U32.pack(len(h))
        out += h
        for part in payload:
            out += part
        self.flush()

    def flush(self) -> None:
        while self.outbuf:
            try:
                n = os.write(1, self.outbuf)
            except BlockingIOError:
                break
            except BrokenPipeError:
                self.fatal("the host closed the channel")
            del self.outbuf[:n]
        if self.outbuf and not self.out_registered:
            self.sel.register(1, selectors.EVENT_WRITE, lambda _ev: self.flush())
            self.out_registered = True
        elif not self.outbuf and self.out_registered:
            self.sel.unregister(1)
            self.out_registered = False

    def fatal(self, why: str) -> None:
        """Give up the worker: the host fails its calls and starts a new sandbox."""
        if not self.dying:
            self.dying = True
            _log("fatal: " + why)
            try:
                h = json.dumps({"op": "fatal", "error": why}).encode()
                os.set_blocking(1, True)
                write_all(1, bytes(self.outbuf) + U32.pack(4 + len(h)) + U32.pack(len(h)) + h)
            except BaseException:
                pass
        os._exit(70)

    # -- start --

    def run(self) -> None:
        if stat.S_ISSOCK(os.fstat(0).st_mode):
            self.stdin_sock = socket.socket(fileno=0)
        os.set_blocking(0, False)
        os.set_blocking(1, False)
        self.sel.register(0, selectors.EVENT_READ, self.on_stdin)
        self.sel.register(self.wake_r, selectors.EVENT_READ, self.on_cleaned)
        while True:
            delay = None
            while self.timers and self.timers[0][2] is None:
                heapq.heappop(self.timers)
            if self.timers:
                delay = max(0.0, self.timers[0][0] - _now())
            for key, ev in self.sel.select(delay):
                if self.sel.get_map().get(key.fd) is key:  # not closed (or reused) by an earlier callback
                    key.data(ev)
            now = _now()
            while self.timers and (self.timers[0][2] is None or self.timers[0][0] <= now):
                t = heapq.heappop(self.timers)
                if t[2] is not None:
                    fn, t[2] = t[2], None
                    fn()

    def hello(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        t = time.perf_counter()
        uid_lo = int(cfg["uid_base"])
        nslots = int(cfg["slots"])
        if not 0 < nslots <= KILLER_OFFSET:
            raise ValueError(f"{nslots} slots: 1..{KILLER_OFFSET}")
        counts = lockdown(uid_lo, uid_lo + UID_SPAN)
        os.makedirs(SCRATCH_ROOT, exist_ok=True)
        os.chown(SCRATCH_ROOT, 0, 0)
        os.chmod(SCRATCH_ROOT, 0o711)
        for name in os.listdir(SCRATCH_ROOT):  # a previous supervisor's leftovers
            _rmtree(os.path.join(SCRATCH_ROOT, name))
        lock_s = time.perf_counter() - t
        self.slots = [Slot(i, uid_lo + i, uid_lo + KILLER_OFFSET + i) for i in range(nslots)]
        self.spares_wanted = SPARES_PER_SLOT * nslots
        self.make_spares()
        procs = self.take_cgroups(cfg.get("cgroup"))
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        a.set_inheritable(False)
        b.set_inheritable(True)
        zcfg = {"ctl_fd": b.fileno(), "supervisor": os.getpid(), "preload": list(cfg.get("preload") or []),
                "env": dict(cfg["env"]), "limits": dict(cfg["limits"]), "report_exits": not self.pidfd_ok,
                "cgroup_procs": procs}
        self.children_ok = os.path.exists(f"/proc/self/task/{os.getpid()}/children")
        env = dict(cfg["env"])  # the calls' environment: they inherit the zygote's
        pid = os.fork()  # exec right away: the zygote starts from a fresh interpreter, not this one
        if pid == 0:
            try:
                os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
                os.dup2(2, 1)
                os.execve(sys.executable, [sys.executable, "-I", os.path.abspath(__file__), "zygote",
                                           json.dumps(zcfg)], env)
            finally:
                os._exit(127)
        b.close()
        for fd in procs:  # the zygote's call processes join their slot's cgroup; we never do
            os.close(fd)
        self.zygote = pid
        a.setblocking(False)
        self.ctl = a
        self.sel.register(a.fileno(), selectors.EVENT_READ, self.on_ctl)
        self.started = {"lockdown_s": round(lock_s, 4), "lockdown": counts}
        self.cleaner_thread.start()  # after the fork above
        self.timer(WATCH_S, self.watch)

    def take_cgroups(self, cg: dict[str, Any] | None) -> list[int]:
        """Give each slot its memory cgroup's files, from the fds the host sent before hello
        (``files`` of each slot in turn, opened by the host: a cgroup v1 file checks the
        opener's credentials, so no cgroupfs is mounted in the sandbox). Returns the slots'
        ``cgroup.procs`` fds, for the zygote to inherit. None: no cgroups (memory is then
        bounded by RLIMIT_AS alone)."""
        if not cg:
            return []
        files = [str(f) for f in cg["files"]]
        k = len(files)
        if "cgroup.procs" not in files or "memory.limit_in_bytes" not in files:
            raise ValueError(f"cgroup files {files}: cgroup.procs and memory.limit_in_bytes are needed")
        if len(self.cg_fds) != k * len(self.slots):
            raise ValueError(f"{len(self.cg_fds)} cgroup fds for {len(self.slots)} slots of {k} files")
        procs = []
        for s in self.slots:
            got = {name: self.cg_fds[s.index * k + j] for j, name in enumerate(files)}
            s.cg = (-1, got["memory.limit_in_bytes"], got.get("memory.memsw.limit_in_bytes", -1),
                    got.get("memory.usage_in_bytes", -1))
            s.cg_limit = int(cg["limit"])
            os.set_inheritable(got["cgroup.procs"], True)
            procs.append(got["cgroup.procs"])
        self.cg_fds = []
        return procs

    # -- host frames --

    def on_stdin(self, _ev: int) -> None:
        try:
            if self.stdin_sock is None:
                data = os.read(0, 1 << 20)
            else:  # a socket: fds may come with the bytes (the slots' cgroup files)
                data, anc, _flags, _addr = self.stdin_sock.recvmsg(1 << 20, socket.CMSG_SPACE(253 * 4))
                for fd in _fds(anc):
                    os.set_inheritable(fd, False)
                    self.fdq.append(fd)
        except BlockingIOError:
            return
        if not data:
            os._exit(0)  # the host is gone: the zygote and calls die with us (pdeathsig)
        self.inbuf += data
        while len(self.inbuf) >= 8:
            total = U32.unpack_from(self.inbuf, 0)[0]
            if total > MAX_FRAME:
                self.fatal(f"frame of {total} bytes")
            if len(self.inbuf) < 4 + total:
                break
            hlen = U32.unpack_from(self.inbuf, 4)[0]
            header = json.loads(bytes(self.inbuf[8 : 8 + hlen]))
            payload = bytes(self.inbuf[8 + hlen : 4 + total])
            del self.inbuf[: 4 + total]
            self.on_frame(header, payload)

    def on_frame(self, h: dict[str, Any], payload: bytes) -> None:
        op = h.get("op")
        if op == "fds":  # fds for the next frames (the slots' cgroup files): sent before hello
            n = int(h["n"])
            if n > len(self.fdq):
                self.fatal(f"a frame said {n} fds came with it; {len(self.fdq)} did")
            self.cg_fds.extend(self.fdq.popleft() for _ in range(n))
        elif op == "hello":
            try:
                self.hello(h)
            except Exception as e:
                self.fatal(f"cannot start: {type(e).__name__}: {e}")
        elif op == "call":
            call = Call(h["id"], h, payload)
            if h.get("timeout") is not None:
                call.timer = self.timer(float(h["timeout"]), lambda: self.expire(call))
            self.queue.append(call)
            self.dispatch()
        elif op == "cancel":  # nobody waits for it any more
            for s in self.slots:
                if s.call is not None and s.call.id == h.get("id") and s.state == "busy":
                    self.kill(s, "cancelled")
            for c in self.queue:
                if c.id == h.get("id"):
                    c.done = True
                    self.cancel(c.timer)
        elif op == "ping":
            self.send({"op": "pong", "id": h.get("id"), "slots": [s.state for s in self.slots]})
        else:
            self.fatal(f"unknown op {op!r}")

    # -- zygote --

    def on_ctl(self, _ev: int) -> None:
        assert self.ctl is not None
        while True:
            try:
                msg, fds = recv_msg(self.ctl)
            except BlockingIOError:
                return
            for fd in fds:
                os.close(fd)
            if msg is None:
                self.fatal("the zygote exited")
                return
            op, rest = msg[0], msg[1:].strip()
            if op == "R":
                info = json.loads(rest)
                info.update(self.started)
                self.info = info
                for s in self.slots:
                    self.prefork(s)
            elif op == "E":
                self.send({"op": "fatal", "error": "preload failed", "detail": json.loads(rest)})
                os._exit(71)
            elif op == "P":
                idx, pid = (int(x) for x in rest.split())
                if pid > 0:
                    self.forked(self.slots[idx], pid)
                else:
                    self.fork_failed(self.slots[idx], -pid)
            elif op == "X":
                pid, status = (int(x) for x in rest.split())
                slot = self.by_pid.get(pid)
                if slot is not None:
                    self.statuses.setdefault(pid, status)  # the first word is the true one (W's is 0)
                    self.exited(slot, pid)
                    self.maybe_finish(slot)
            elif op in ("k", "z"):
                uid = int(rest)
                for s in self.slots:
                    if s.uid == uid and s.state == "sweeping":
                        self.sweep(s)

    def prefork(self, s: Slot) -> None:
        assert self.ctl is not None
        req_r, s.req_w = os.pipe2(os.O_CLOEXEC)
        s.go_r, go_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)  # one byte in an empty pipe: never blocks
        s.res_r, res_w = os.pipe2(os.O_CLOEXEC)
        s.out_r, out_w = os.pipe2(os.O_CLOEXEC)
        s.err_r, err_w = os.pipe2(os.O_CLOEXEC)
        for fd in (s.req_w, s.res_r, s.out_r, s.err_r):  # our ends only: the call's stay blocking
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)  # a new pipe end has no other status flag
        s.scratch = f"{SCRATCH_ROOT}/{s.index}-{os.urandom(8).hex()}"  # made by the new process
        if s.fails and self.spares:
            # Its last process failed (a full disk refuses a new directory): one made ahead, by the
            # cleaner thread, which makes more when it next wakes (a spare per call would wake it
            # every call: ~0.1 ms of the supervisor's CPU, measured).
            s.scratch = self.spares.popleft()
        s.state = "forking"
        s.ready_buf = b""
        try:
            send_msg(self.ctl, f"F {s.index} {s.uid} {s.scratch}", (req_r, res_w, out_w, err_w, go_w))
        finally:
            for fd in (req_r, res_w, out_w, err_w, go_w):
                os.close(fd)
        self.sel.register(s.res_r, selectors.EVENT_READ, lambda ev, s=s: self.on_res(s))

    def forked(self, s: Slot, pid: int) -> None:
        s.pid = pid
        s.live = True
        s.waited = False
        self.by_pid[pid] = s
        if self.pidfd_ok:
            try:
                s.pidfd = os.pidfd_open(pid)  # type: ignore[attr-defined,unused-ignore]
                self.sel.register(s.pidfd, selectors.EVENT_READ, lambda ev, s=s, pid=pid: self.exited(s, pid))
            except OSError:
                s.pidfd = -1
                self.exited(s, pid)

    def fork_failed(self, s: Slot, err: int) -> None:
        _log(f"fork for slot {s.index} failed: {os.strerror(err)}; retrying")
        self.close_req(s)
        if s.go_r >= 0:
            os.close(s.go_r)
            s.go_r = -1
        for fd in (s.res_r, s.out_r, s.err_r):
            if fd >= 0:
                with contextlib.suppress(KeyError):
                    self.sel.unregister(fd)
                os.close(fd)
        s.res_r = s.out_r = s.err_r = -1
        s.state = "idle"
        self.timer(0.05, lambda: self.prefork(s) if s.state == "idle" else None)

    # -- calls --

    def dispatch(self) -> None:
        while self.queue:
            slot = next((s for s in self.slots if s.state == "ready"), None)
            if slot is None:
                return
            call = self.queue.popleft()
            if call.done:
                continue
            slot.state = "busy"
            slot.call = call
            if not self.set_memory(slot, int(call.limits["memory"])):
                call.killed = "memory"  # answered as out of memory once its process is gone
                self.kill(slot, "memory")
                continue
            lim = {"memory": int(call.limits["memory"]), "cap": call.cap,
                   "cpu": None if call.limits.get("timeout") is None else int(float(call.limits["timeout"])) + 2}
            call.wire = json.dumps(lim).encode() + b"\n" + call.payload
            self.sel.register(slot.out_r, selectors.EVENT_READ, lambda ev, s=slot: self.on_out(s, s.out_r))
            self.sel.register(slot.err_r, selectors.EVENT_READ, lambda ev, s=slot: self.on_out(s, s.err_r))
            self.feed(slot)

    def set_memory(self, s: Slot, memory: int) -> bool:
        """The slot's memory cgroup limit (and memory+swap) for its next call: the call's own
        ``memory`` on top of what the slot's cgroup holds already (its waiting process's pages,
        and what an earlier call of the slot left charged there: page cache, or a memfd it
        handed to a concurrent call, which holds it until that call ends), in 4 MiB steps so
        that it is written only when that changes. False when the kernel refuses it."""
        if s.cg is None:
            return True
        _procs, lim, sw, usage = s.cg
        held = 0
        if usage >= 0:
            try:
                held = int(os.pread(usage, 32, 0))
            except (OSError, ValueError):
                held = 0
        limit = memory + (held // HELD_STEP) * HELD_STEP  # rounded down: never more than its memory
        if s.cg_limit == limit:
            return True
        text = b"%d" % limit
        down, up = (lim, sw), (sw, lim)  # memory <= memory+swap at every step
        orders = [down if limit < s.cg_limit else up] if s.cg_limit >= 0 else [down, up]
        for i, order in enumerate(orders):
            try:
                for fd in order:
                    if fd >= 0:
                        os.pwrite(fd, text, 0)
                break
            except OSError as e:
                if i == len(orders) - 1:
                    _log(f"slot {s.index}: cannot set its memory limit to {limit}: {e}")
                    s.cg_limit = -1  # unknown: both orders are tried next time
                    return False
        s.cg_limit = limit
        return True

    def feed(self, s: Slot) -> None:
        call = s.call
        if call is None or s.req_w < 0:
            return
        view = memoryview(call.wire)[call.written :]
        try:
            while view:
                n = os.write(s.req_w, view)
                call.written += n
                view = view[n:]
        except BlockingIOError:
            if not s.wreg:
                s.wreg = True
                self.sel.register(s.req_w, selectors.EVENT_WRITE, lambda ev, s=s: self.feed(s))
            return
        except BrokenPipeError:
            pass
        self.close_req(s)

    def close_req(self, s: Slot) -> None:
        if s.req_w >= 0:
            if s.wreg:
                self.sel.unregister(s.req_w)
            os.close(s.req_w)
        s.req_w = -1
        s.wreg = False

    def on_res(self, s: Slot) -> None:
        try:
            data = os.read(s.res_r, 1 << 20)
        except BlockingIOError:
            return
        if s.state == "forking":
            s.ready_buf += data
            if s.ready_buf[:1] == b"R" and len(s.ready_buf) == 1:
                s.state = "ready"
                s.fails = 0
                s.failing_since = 0.0
                if not self.ready_sent and all(x.state == "ready" for x in self.slots):
                    self.ready_sent = True
                    self.send({"op": "ready", "protocol": PROTOCOL, "slots": len(self.slots), **self.info})
                self.dispatch()
            elif s.ready_buf[:1] == b"F" or not data or len(s.ready_buf) > 1:
                text = s.ready_buf[1:].decode("utf-8", "replace")
                err, _, why = text.partition(" ")
                self.start_failed(s, f"its new process failed to start: {why or text or 'no word'}",
                                  transient=err.isdigit() and int(err) in TRANSIENT_ERRNOS)
            return
        call = s.call
        if not data:
            self.sel.unregister(s.res_r)
            return
        if call is None:
            return
        call.res += data
        if len(call.res) > call.cap + 64 and call.killed is None:
            self.kill(s, "result")  # a result frame is at most the cap and its head
            return
        if self.result_complete(call):
            self.answer_early(s)
            self.maybe_finish(s)

    @staticmethod
    def result_complete(call: Call) -> bool:
        return len(call.res) >= 4 and len(call.res) >= 4 + U32.unpack_from(call.res, 0)[0]

    def on_out(self, s: Slot, fd: int) -> None:
        call = s.call
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.sel.unregister(fd)
            return
        if call is None:
            return
        buf = call.out if fd == s.out_r else call.err
        room = call.cap - len(buf)
        buf += data[: max(room, 0)]
        if len(data) > room and call.killed is None:
            self.kill(s, "output")

    def expire(self, call: Call) -> None:
        call.timer = None
        for s in self.slots:
            if s.call is call:
                if call.killed is None and s.state == "busy" and not self.result_complete(call):
                    self.kill(s, "timeout")
                return
        if not call.done:  # still queued: no slot ever ran it
            call.killed = "timeout"
            self.respond(None, call)

    def kill(self, s: Slot, why: str) -> None:
        call = s.call
        if call is not None and call.killed is None:
            call.killed = why
        with contextlib.suppress(OSError):
            os.killpg(s.pid, signal.SIGKILL)  # the call did setsid: its group is its pid
        if s.live:  # not a pid that may have been reused
            with contextlib.suppress(OSError):
                os.kill(s.pid, signal.SIGKILL)

    def exited(self, s: Slot, pid: int) -> None:
        if pid != s.pid:
            return
        s.live = False
        if s.pidfd >= 0:
            with contextlib.suppress(KeyError):
                self.sel.unregister(s.pidfd)
            os.close(s.pidfd)
            s.pidfd = -1
        if s.state in ("forking", "ready"):
            # Killed by the memory cgroup's OOM killer while it waited (every call process
            # has oom_score_adj 1000), or it could not start: the slot's own trouble.
            self.start_failed(s, f"its {'waiting' if s.state == 'ready' else 'new'} process exited before a "
                                 f"call (status {self.statuses.get(pid)})", transient=True)
            return
        call = s.call
        if call is not None and not call.exited:
            call.exited = True
            self.maybe_finish(s)

    def maybe_finish(self, s: Slot) -> None:
        call = s.call
        if call is None or s.state != "busy" or not call.exited:
            return
        while not self.result_complete(call):  # the exit can be seen before the result's bytes are read
            try:
                data = os.read(s.res_r, 1 << 20)
            except (BlockingIOError, OSError):
                break
            if not data:
                break
            call.res += data
        if call.killed is None and not self.result_complete(call) and s.pid not in self.statuses:
            # Died without a result: its exit status says how. The zygote reaps lazily: ask.
            if not s.waited and self.ctl is not None:
                s.waited = True
                send_msg(self.ctl, f"W {s.pid}")  # answered with "X pid status"
            return
        if call.killed is None and not self.result_complete(call) and self.never_took(s, call) and call.tries < 3:
            # Its process died before it had read its request (the OOM killer took it while it
            # waited, a moment before the call came): the call never ran; it runs on another.
            call.requeue = True
        s.state = "sweeping"
        s.sweeps = 0
        s.reaped = False
        self.sweep(s)

    @staticmethod
    def never_took(s: Slot, call: Call) -> bool:
        """The slot's dead process never got as far as running its call's code: it did not say
        "g" after reading its request (call_child)."""
        if call.written < len(call.wire):
            return True
        if s.go_r < 0:
            return False
        try:
            return os.read(s.go_r, 1) != b"g"  # EOF: it died before the byte
        except OSError:
            return False

    def known_pids(self, s: Slot) -> set[int]:
        known = {os.getpid(), self.zygote}
        known.update(x.pid for x in self.slots if x.live and x is not s)  # not an exited one's: reusable
        return known

    def alone(self, s: Slot) -> bool:
        """True only if no process but the slot's own can have its uid, found from a few small
        /proc files instead of every process's status (:func:`proc_uids`).

        Every process a call starts descends from the call's process, and the zygote is the
        subreaper of their orphans: so each one is a child of the call's process (while that
        lives), a child of the zygote, or below one of those. So there are none if the call's
        process has no children and every other child of the zygote is a live slot's process,
        a zombie whose threads have all ended (which runs nothing: a leader that ended alone
        with the raw ``exit`` leaves its threads running, :func:`_dead`), or a process none of
        whose uids is this slot's (the
        process of a call of another slot, a fork for another slot still root, an orphan of
        another call: none can have a descendant of this uid). A zombie's children were handed
        to the zygote when it died, possibly after the zygote's list was read: so while a read
        shows new zombies, the list is read again and what is new is checked the same way.
        False whenever anything else is there, or /proc cannot say: the caller then scans
        every process's uid."""
        if not self.children_ok:
            return False
        try:
            if s.live:
                try:
                    tids = os.listdir(f"/proc/{s.pid}/task")
                except (FileNotFoundError, ProcessLookupError):
                    tids = []  # exited and reaped already: its children went to the zygote
                for tid in tids:  # every thread's children
                    if _read(f"/proc/{s.pid}/task/{tid}/children").strip():
                        return False
            z = f"/proc/{self.zygote}/task/{self.zygote}/children"
            seen = {x.pid for x in self.slots if x.live}
            for _ in range(4):
                zombies = False
                for pid in {int(x) for x in _read(z).split()} - seen:
                    seen.add(pid)
                    try:
                        state, uids, threads = _status(_read(f"/proc/{pid}/status"))
                    except (FileNotFoundError, ProcessLookupError):
                        state, uids, threads = b"X", set(), 1  # gone since: as a zombie, its children may move
                    if state in (b"Z", b"X"):
                        zombies = True
                    if _dead(state, threads):
                        continue
                    if s.uid in uids or not uids:  # a live process, or a zombie leader whose threads run
                        return False
                if not zombies:
                    return True
            return False
        except (OSError, ValueError, IndexError):
            return False

    def answer_early(self, s: Slot) -> None:
        """Answer a call as soon as its result is in, when its process is the only one of its
        uid (it is exiting: our code, not the call's, runs after the result). The exit of a
        forked interpreter costs milliseconds; the slot is swept after it, before reuse.
        A call that left other processes is answered only once they are all dead."""
        call = s.call
        if call is None or call.done or call.killed is not None or s.state != "busy":
            return
        if not self.alone(s) and proc_uids({s.uid}, self.known_pids(s) | {s.pid}):
            return
        self.drain_output(s, call)
        if call.killed is None:
            self.respond(s, call)
            # Its process exits right after its result, unless the call forged the result
            # (it can write to its own result pipe) and lives on: then it is killed (killing
            # one that is already exiting loses nothing: its answer is out).
            call.timer = self.timer(LATE_EXIT_S, lambda: self.kill(s, "late") if s.call is call and not call.exited
                                    else None)

    def drain_output(self, s: Slot, call: Call) -> None:
        for fd in (s.out_r, s.err_r):
            while fd >= 0:  # what the call wrote before its result or its end
                try:
                    data = os.read(fd, 1 << 16)
                except (BlockingIOError, OSError):
                    break
                if not data:
                    break
                buf = call.out if fd == s.out_r else call.err
                room = call.cap - len(buf)
                buf += data[: max(room, 0)]
                if len(data) > room:
                    call.killed = call.killed or "output"
                    break

    def sweep(self, s: Slot) -> None:
        """Kill every process of the slot's uid; then answer the call and clean the slot."""
        left = set() if self.alone(s) else proc_uids({s.uid}, self.known_pids(s))
        if left:
            s.sweeps += 1
            if s.sweeps > 400:
                _log(f"cannot kill the processes of uid {s.uid}: {sorted(left)}")
                self.fatal(f"the processes a call left could not be killed (slot {s.index})")
            assert self.ctl is not None
            if s.sweeps % 2 == 1:
                send_msg(self.ctl, f"K {s.uid} {s.killer}")  # answered with "k", which sweeps again
            else:
                self.timer(0.005, lambda: self.sweep(s))
            return
        if s.sweeps and not s.reaped and self.ctl is not None:
            # It left processes, now killed: their zombies go too before the answer (the
            # zygote reaps lazily), so that nothing of this call is left in /proc.
            s.reaped = True
            send_msg(self.ctl, f"Z {s.uid}")  # answered with "z", which sweeps again
            return
        call = s.call
        s.call = None
        if call is not None and call.requeue:
            call.retry()
            self.queue.appendleft(call)
            call = None
            self.dispatch()  # on another slot that is ready (this one is not)
        elif call is not None and not call.done:
            self.drain_output(s, call)
        self.close_req(s)
        if s.go_r >= 0:
            os.close(s.go_r)
            s.go_r = -1
        for fd in (s.res_r, s.out_r, s.err_r):
            if fd >= 0:
                with contextlib.suppress(KeyError):
                    self.sel.unregister(fd)
                os.close(fd)
        s.res_r = s.out_r = s.err_r = -1
        self.by_pid.pop(s.pid, None)
        status = self.statuses.pop(s.pid, None)
        if call is not None:
            self.cancel(call.timer)
            if not call.done:
                self.respond(s, call, status)
        s.state = "cleaning"
        if os.path.basename(s.scratch).startswith(SPARE_PREFIX) and self.recycle(s.scratch):
            self.refork(s)
            return
        try:
            os.rmdir(s.scratch)  # left empty, as most calls leave it: no need for the thread
        except FileNotFoundError:
            pass  # its process failed before it made it
        except OSError:
            if not self.cleaner_thread.is_alive():
                self.fatal("the cleaner thread is gone")
            with self.clean_cv:
                self.cleanups.append((s, s.scratch))
                self.clean_cv.notify()
            return
        self.refork(s)

    def recycle(self, scratch: str) -> bool:
        """A spare its call left empty goes back to the spares, root's again: while a call holds
        the disk full no new directory can be made, and a slot whose calls need no disk must
        keep serving them on the spares it has (4 would last 4 calls). The call's uid is gone
        (swept), and once the directory is root's and 0700 no other uid can add to it: empty
        then is empty for the next call."""
        if len(self.spares) >= self.spares_wanted:
            return False  # the cleaner made its replacement meanwhile: removed as any other
        try:
            os.chown(scratch, 0, 0, follow_symlinks=False)
            st = os.lstat(scratch)
            if not stat.S_ISDIR(st.st_mode):
                return False
            os.chmod(scratch, 0o700)
            with os.scandir(scratch) as it:
                if next(it, None) is not None:
                    return False
        except OSError:
            return False
        self.spares.append(scratch)
        return True

    def refork(self, s: Slot) -> None:
        """The slot is clean: fork its next process (after a pause if its last ones failed)."""
        s.state = "idle"
        if not s.fails:
            self.prefork(s)
        else:
            self.timer(min(0.05 * 2 ** min(s.fails - 1, 6), 2.0), lambda: self.prefork(s) if s.state == "idle" else None)

    def start_failed(self, s: Slot, why: str, *, transient: bool) -> None:
        """A slot's new process could not get ready, or died waiting for a call: a call filled
        the disk (no room for the scratch directory), ran the pids out, or the OOM killer took
        it. That is the slot's trouble, never its neighbours': its process is killed, the
        slot swept and forked again after a pause. Only a slot that keeps failing for another
        reason gives up the worker."""
        if s.state not in ("forking", "ready"):
            return
        s.fails += 1
        if not s.failing_since:
            s.failing_since = _now()
        if not transient and s.fails >= MAX_START_FAILURES:
            _log(f"slot {s.index}: {why}")
            self.fatal(f"slot {s.index} could not start a call process {s.fails} times in a row")
        if s.fails in (1, 10) or s.fails % 100 == 0:
            _log(f"slot {s.index}: {why}; forking it again ({s.fails} in a row)")
        if s.live:
            self.kill(s, "restart")
        s.call = None
        s.state = "sweeping"
        s.sweeps = 0
        s.reaped = False
        self.sweep(s)

    def respond(self, s: Slot | None, call: Call, status: int | None = None) -> None:
        call.done = True
        self.cancel(call.timer)
        # stdout and stderr travel as raw bytes at the head of the payload, their sizes in the
        # header: as JSON strings they were escaped (a NUL is six bytes), and a call printing
        # control characters to its cap made a frame six times the cap, which ran the
        # supervisor out of memory (every call on the worker lost).
        h: dict[str, Any] = {"op": "result", "id": call.id, "out": len(call.out), "err": len(call.err),
                             "call_s": round(_now() - call.t0, 6)}
        payload = b""
        if call.killed == "timeout":
            h["kind"] = "timeout"
            if s is None:
                h["queued"] = True  # it waited for a slot all its time and never ran
        elif call.killed == "output":
            h["kind"] = "output"
            h["what"] = "stdout or stderr"
        elif call.killed == "memory":
            h["kind"] = "oom"
            h["detail"] = "its slot could not be limited to the call's memory"
        elif call.killed == "result":
            h["kind"] = "output"
            h["what"] = "result"
        elif self.result_complete(call):
            # Every byte of the result pipe is the call's to write: a frame too short for its
            # head, of an unknown kind or with a non-finite time is that call's own failure.
            n = U32.unpack_from(call.res, 0)[0]
            kind = call.res[4] if n >= 1 else -1
            if n < RESULT_HEAD.size - 4 or kind not in RESULT_KINDS:
                h["kind"] = "error"
                payload = protocol_error(f"the call wrote a malformed result frame ({n} bytes after its "
                                         f"length, kind {kind})")
            else:
                ran = RESULT_HEAD.unpack_from(call.res, 0)[2]
                payload = bytes(call.res[RESULT_HEAD.size : 4 + n])
                h["run_s"] = round(ran, 6) if 0.0 <= ran < 1e9 else 0.0
                h["kind"] = RESULT_KINDS[kind]
                if kind == K_TOO_LARGE:
                    h["what"] = "result"
        else:
            h["kind"] = "crash"
            if status is not None and os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                h["signal"] = sig
                if sig == signal.SIGKILL:
                    h["kind"] = "oom"  # a SIGKILL we did not send: the memory cgroup's OOM killer
                elif sig == signal.SIGXCPU:
                    h["kind"] = "timeout"
            elif status is not None and os.WIFEXITED(status):
                h["exit_code"] = os.WEXITSTATUS(status)
        self.send(h, call.out, call.err, payload)

    # -- cleaning (a thread: removing a large scratch tree must not stall other calls) --

    def clean_one(self, scratch: str) -> None:
        """Remove one scratch tree; one that cannot be removed now (moved under us, or held by a
        concurrent call that opened it) is taken from its call's uid (root's, 0700: no call
        can reach into it by path any more) and tried again later, when the calls that may
        hold a directory of it open have ended."""
        try:
            remove_tree(scratch)
            return
        except BaseException as e:  # the thread must live on
            _log(f"could not remove {scratch} now: {type(e).__name__}: {e}")
        try:
            os.chown(scratch, 0, 0, follow_symlinks=False)
            os.chmod(scratch, 0o700, follow_symlinks=False)
        except FileNotFoundError:
            return
        except BaseException as e2:
            _log(f"could not take {scratch} from its call's uid: {e2}")
            self.cleaner_failed = f"{scratch}: {e2}"
            return
        with self.clean_cv:
            self.retry.append((_now() + RETRY_CLEAN_S, scratch))

    def make_spares(self) -> None:
        """Scratch directories made ahead (root's, 0700, empty: no call can enter one before it
        is given to a slot's process, which chowns it to its uid). A call that fills the
        worker's disk and holds it must not keep the other slots from starting their next
        process (a directory needs room); while it does, they use these. Best effort."""
        while len(self.spares) < self.spares_wanted:
            path = f"{SCRATCH_ROOT}/{SPARE_PREFIX}{os.urandom(8).hex()}"
            try:
                os.mkdir(path, 0o700)
            except OSError:
                return  # no room now: the next wake-up tries again
            self.spares.append(path)

    def cleaner(self) -> None:
        """Remove the scratch trees calls left, one at a time. Whatever a call left (any depth,
        any number of entries, modes that refuse us) must not end this thread: a tree that
        cannot be removed is taken from the slot's uid (root's, mode 0700) and left."""
        while True:
            with self.clean_cv:
                while not self.cleanups and not (self.retry and self.retry[0][0] <= _now()):
                    short = len(self.spares) < self.spares_wanted
                    if short and self.spares_due <= _now():
                        break  # make spares (again: a full disk refused them before)
                    self.clean_cv.wait(RETRY_CLEAN_S if (self.retry or short) else None)
                due = self.retry.popleft()[1] if self.retry and self.retry[0][0] <= _now() else None
                item = self.cleanups.popleft() if due is None and self.cleanups else None
            self.make_spares()
            if len(self.spares) < self.spares_wanted:
                self.spares_due = _now() + RETRY_CLEAN_S  # no room: not before then
            if due is not None:
                self.clean_one(due)  # a tree set aside before: no slot waits for it
            if item is None:
                continue
            s, scratch = item
            self.clean_one(scratch)
            with self.clean_cv:
                self.cleaned.append(s)
            with contextlib.suppress(BlockingIOError):
                os.write(self.wake_w, b"x")

    def on_cleaned(self, _ev: int) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            with self.clean_cv:
                if not self.cleaned:
                    break
                s = self.cleaned.popleft()
            if self.cleaner_failed:  # what a call left is still open to its uid: no call may get it
                self.fatal("a call's scratch directory could not be removed nor closed to its uid")
            self.refork(s)


def _rmtree(path: str) -> None:
    try:
        remove_tree(path)
    except OSError as e:
        _log(f"could not remove {path}: {e}")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything below it, never following a symbolic link.

    Iterative and relative to one open directory at a time (it climbs back with ``..``): a
    call can leave a tree of any depth (``shutil.rmtree`` recurses, and a path 1,000 levels
    deep is longer than PATH_MAX), of any width, with modes that refuse writing. The tree
    may still change under it: a call can open its directories to every uid and a concurrent
    call (another slot, alive) can move one of them elsewhere while this runs, so every
    ``..`` is checked to be the directory it came down from (device and inode, as fts does);
    if not, it stops there and raises, having touched nothing outside the tree. Raises
    OSError when something stays."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    fd = os.open(path, _DIR_FLAGS)
    top = os.fstat(fd)
    if (top.st_dev, top.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise OSError(errno.ESTALE, f"{path} changed while it was opened")
    ids = [(top.st_dev, top.st_ino)]  # the directories from the top down to the one open
    stack: list[tuple[str, list[str]]] = []  # per level: its name in its parent, the parent's subdirectories to go
    try:
        todo = _clear_dir(fd)
        while True:
            if todo:
                name = todo.pop()
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    continue
                except PermissionError:  # mode 0 and no CAP_DAC_OVERRIDE: we own it anyway
                    os.chmod(name, 0o700, dir_fd=fd, follow_symlinks=False)
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                sst = os.fstat(sub)
                stack.append((name, todo))
                ids.append((sst.st_dev, sst.st_ino))
                os.close(fd)
                fd = sub
                todo = _clear_dir(fd)
                continue
            if not stack:
                break
            name, todo = stack.pop()
            ids.pop()
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            pst = os.fstat(parent)
            os.close(fd)
            fd = parent
            if (pst.st_dev, pst.st_ino) != ids[-1]:
                raise OSError(errno.EXDEV, f"a directory below {path} was moved out of it while it was removed")
            try:
                os.rmdir(name, dir_fd=fd)
            except PermissionError:  # a directory the call made read-only
                os.fchmod(fd, 0o700)
                os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _clear_dir(fd: int) -> list[str]:
    """Unlink every entry of the open directory that is not a directory; its subdirectories."""
    subdirs: list[str] = []
    fixed = False
    with os.scandir(fd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in entries:
        if is_dir:
            subdirs.append(name)
            continue
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        except PermissionError:
            if fixed:
                raise
            os.fchmod(fd, 0o700)  # a directory the call made read-only
            fixed = True
            os.unlink(name, dir_fd=fd)
    return subdirs


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[1] == "zygote":
        zygote_main(json.loads(argv[2]))
    elif len(argv) >= 2 and argv[1] == "supervise":
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        Supervisor().run()
    else:
        sys.stderr.write("usage: worker.py supervise|zygote CONFIG\n")
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv)
