"""The FnCall backend's red-team suite (issue 22), shared by ``tests/abuse`` and ``dsec bench abuse``.

Each :class:`FnCase` attacks a real :class:`~dsec.backends.fncall.pool.FnCallPool` through
the only door a user has, the calls themselves (plus, for the edge's routes, HTTP), while a
:class:`CallLoad` keeps a steady stream of small calls on the same worker whose values are
checked one by one. :func:`run_fncall_cases` records, as :class:`~dsec.bench.abuse_cases.Check`
objects that can each fail:

- what the case's attack tried did not happen (a leftover of one call read or planted
  nothing in a later call's data, a malformed frame failed only its own call, typed, a
  call held no more memory than its ``memory``...);
- the worker stayed whole: no neighbour call failed, was lost or got a wrong value; no
  worker was lost or replaced (unless the case expects it); the worker still serves calls,
  including ones that leave files; nothing of any call is left in the worker (no task of a
  call's uid but the slots' waiting processes, threads of a zombie leader included; no
  scratch directory left); every ``FnCallWorkerLost`` anyone saw names its worker and
  carries no log of it.

The worker is inspected from the host, read-only, through its supervisor's
``/proc/<pid>/root`` (:class:`WorkerView`): the sandbox's own ``/proc`` and ``/fncall``.

Every attack is bounded even when the defence is missing: leftovers end themselves after a
deadline (or when the case tells them to), fills stop at a size, spinners at a time.
Must never: run an attack on the host, or leave a case's leftover running into the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsec.bench.abuse_cases import Check, Outcome
from dsec.bench.stats import percentile
from dsec.spec.fncall import (
    FnCall,
    FnCallError,
    FnCallFailed,
    FnCallTimeout,
    FnCallWorkerLost,
    FnOutcome,
    FnResult,
)

if TYPE_CHECKING:
    from dsec.backends.fncall.pool import FnCallPool
    from dsec.backends.fncall.workers import Worker
    from dsec.spec import ImageRef

MiB = 1 << 20
Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


# ------------------------------------------------------------------ sources ----
# What the attacking calls run (inside the worker sandbox, as a call's unprivileged uid).
# Kept here as plain source so that a unit test can compile every one of them.

SRC: dict[str, str] = {}

SRC["neighbour"] = """\
import numpy as np
def main(i, salt):
    return [int(np.arange(i % 7 + 1).sum()), salt]
"""


def neighbour_value(i: int, salt: str) -> list[Any]:
    return [sum(range(i % 7 + 1)), salt]


SRC["leave_file"] = """\
import os
def main(i):
    with open('left-behind', 'w') as f:
        f.write(str(i))
    return [i, sorted(os.listdir('.'))]
"""

_RES_FD = """\
def _res_fd():
    import fcntl, os
    for name in os.listdir('/proc/self/fd'):
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if not os.readlink('/proc/self/fd/%d' % fd).startswith('pipe:'):
                continue
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
                return fd
        except OSError:
            pass
    raise RuntimeError('no result pipe')
"""

# -- zombie leader: threads of a process whose leader thread ended with the raw exit syscall

SRC["zombie_spy"] = """\
import ctypes, json, os, platform, socket, threading, time

SYS_EXIT = {'x86_64': 60, 'amd64': 60, 'aarch64': 93, 'arm64': 93}[platform.machine().lower()]

def _uids(pid):
    with open('/proc/%d/status' % pid) as f:
        for line in f:
            if line.startswith('Uid:'):
                return {int(x) for x in line.split()[1:]}
    return set()

def spy(tag, ready, deadline):
    me, uid = os.getpid(), os.getuid()
    seen = {'uid': uid, 'pids': [], 'cwd': [], 'environ': [], 'secrets': [], 'planted': []}
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind('\\0' + tag)
    srv.listen(16)
    srv.setblocking(False)
    ready.set()
    done = set()
    while time.monotonic() < deadline:
        try:
            c, _ = srv.accept()
            c.setblocking(True)
            c.settimeout(2)
            c.sendall(json.dumps(seen).encode() + b'\\n')
            try:
                cmd = c.recv(16)
            except OSError:
                cmd = b''
            c.close()
            if cmd.startswith(b'quit'):
                return
        except OSError:
            pass
        for name in os.listdir('/proc'):
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            try:
                if uid not in _uids(pid):
                    continue
            except OSError:
                continue
            if pid not in seen['pids']:
                seen['pids'].append(pid)
            dirs = set()
            try:
                cwd = os.readlink('/proc/%d/cwd' % pid)
                dirs.add(cwd)
                if cwd not in seen['cwd']:
                    seen['cwd'].append(cwd)
            except OSError:
                pass
            try:
                with open('/proc/%d/environ' % pid, 'rb') as f:
                    for kv in f.read().split(b'\\0'):
                        k, _, v = kv.partition(b'=')
                        if k == b'DSEC_VICTIM_SECRET' and v.decode() not in seen['environ']:
                            seen['environ'].append(v.decode())
                        if k == b'HOME':
                            dirs.add(v.decode())
            except OSError:
                pass
            for d in dirs:
                if not d.startswith('/fncall/') or d in done:
                    continue
                try:
                    with open(os.path.join(d, 'secret.txt')) as f:
                        s = f.read()
                    if s and s not in seen['secrets']:
                        seen['secrets'].append(s)
                except OSError:
                    pass
                try:
                    with open(os.path.join(d, 'planted-' + tag), 'w') as f:
                        f.write('planted')
                    seen['planted'].append(d)
                    done.add(d)
                except OSError:
                    pass
        time.sleep(0.002)

def main(tag, seconds):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        ready = threading.Event()
        threading.Thread(target=spy, args=(tag, ready, time.monotonic() + seconds)).start()
        ready.wait(10)
        os.write(w, b'x')
        ctypes.CDLL(None).syscall(SYS_EXIT, 0)  # this thread alone: the spy thread runs on
        os._exit(0)
    os.close(w)
    os.read(r, 1)
    for _ in range(1000):  # until the child's leader is a zombie
        try:
            with open('/proc/%d/status' % pid) as f:
                if '\\nState:\\tZ' in f.read():
                    break
        except OSError:
            break
        time.sleep(0.002)
    return [os.getuid(), pid]
"""

SRC["zombie_victim"] = """\
import os, subprocess
def main(secret, seconds):
    with open('secret.txt', 'w') as f:
        f.write(secret)
    subprocess.run(['sleep', str(seconds)], env=dict(os.environ, DSEC_VICTIM_SECRET=secret), check=False)
    return [os.getuid(), sorted(n for n in os.listdir('.') if n != 'secret.txt')]
"""

SRC["collector"] = """\
import json, socket
def main(tags, quit):
    out = {}
    for tag in tags:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect('\\0' + tag)
            data = b''
            while not data.endswith(b'\\n'):
                b = s.recv(65536)
                if not b:
                    break
                data += b
            if quit:
                s.sendall(b'quit')
            out[tag] = json.loads(data) if data else 'connected'
        except OSError:
            out[tag] = None
        finally:
            s.close()
    return out
"""

# -- a leftover that stops the sweep's kill helper once it takes the call's uid

SRC["sigstop_spinner"] = """\
import os, signal, time
def main(seconds):
    call = os.getpid()
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        os.close(r)
        os.write(w, b'x')
        os.close(w)
        end = time.monotonic() + seconds
        def gone():
            try:
                with open('/proc/%d/status' % call) as f:
                    return '\\nState:\\tZ' in f.read()
            except OSError:
                return True
        while not gone() and time.monotonic() < end:
            time.sleep(0.0002)
        kill, stop = os.kill, signal.SIGSTOP
        while time.monotonic() < end:
            try:
                kill(-1, stop)
            except OSError:
                pass
        os._exit(0)
    os.close(w)
    os.read(r, 1)
    return os.getuid()
"""

# -- forged result frames: written to the call's own result pipe, then the process ends

FORGED: dict[str, str] = {
    "short_frame": "struct.pack('>I', 3) + b'abc'",
    "zero_length": "struct.pack('>I', 0)",
    "kind_only": "struct.pack('>I', 1) + b'V'",
    "error_not_json": "F(0x45, b'{not json')",
    "error_not_utf8": "F(0x45, b'{\\xff\\xfe}')",
    "error_deep_json": "F(0x45, b'{\"a\":' + b'[' * 100000 + b']' * 100000 + b'}')",
    "error_not_object": "F(0x45, b'[1,2,3]')",
    "error_huge_int": "F(0x45, b'{\"exc_type\":' + b'7' * 5000 + b'}')",
    "value_not_json": "F(0x56, b'\\xff\\xfe!@#$')",
    "value_deep_json": "F(0x56, b'[' * 100000 + b']' * 100000)",
    "value_huge_int": "F(0x56, b'7' * 5000)",
    "value_surrogate": "F(0x56, b'\"\\\\ud800\"')",
    "unknown_kind": "F(0x00, b'{}')",
    "huge_length": "struct.pack('>I', 0xFFFFFFF0) + b'x' * 64",
    "truncated": "struct.pack('>IBd', 100, 0x56, 0.0) + b'\"abc'",
    "garbage": "bytes(range(256)) * 4",
    "nan_time": "F(0x56, b'1', float('nan'))",
    "two_frames": "F(0x56, b'1') + struct.pack('>I', 3) + b'abc'",
}
"""Forged result frames (Python expressions of bytes), each written to the call's own result pipe."""

FORGED_WELL_FORMED = {"nan_time", "two_frames", "value_surrogate"}
"""Forged frames that are well formed: the call may get the value it forged (docs/FNCALL.md)."""

for _name, _expr in FORGED.items():
    SRC[f"forge_{_name}"] = _RES_FD + (
        "import os, struct, sys\n"
        "def F(kind, payload, ran=0.0):\n"
        "    return struct.pack('>IBd', 9 + len(payload), kind, ran) + payload\n"
        "def main():\n"
        f"    data = {_expr}\n"
        "    fd = _res_fd()\n"
        "    os.write(fd, data)\n"
        "    sys.stdout.flush()\n"
        "    os._exit(0)\n")

SRC["forge_stream"] = _RES_FD + """\
import os, struct
def main():
    fd = _res_fd()
    os.write(fd, struct.pack('>I', 0x7FFFFFFF))
    chunk = b'x' * 65536
    for _ in range(64):  # 4 MiB claiming to be a 2 GiB frame
        os.write(fd, chunk)
    os._exit(0)
"""

SRC["pipe_close_result"] = _RES_FD + """\
import os
def main():
    os.close(_res_fd())
    return 'nobody hears this'
"""

SRC["pipe_result_as_stdout"] = _RES_FD + """\
import os, sys
def main():
    os.dup2(_res_fd(), 1)
    print('this text goes where the result goes ' * 100, flush=True)
    return 1
"""

SRC["pipe_read_own_result"] = _RES_FD + """\
import os, struct
def main():
    fd = _res_fd()
    back = os.open('/proc/self/fd/%d' % fd, os.O_RDONLY | os.O_NONBLOCK)
    os.write(fd, struct.pack('>IBd', 9 + 1, 0x56, 0.0) + b'7')
    stolen = os.read(back, 100)  # take it back before the supervisor reads it
    os.write(fd, b'\\x00\\x00')
    return len(stolen)
"""

SRC["pipe_tiny_result"] = _RES_FD + """\
import fcntl, os
def main():
    fcntl.fcntl(_res_fd(), 1031, 4096)  # F_SETPIPE_SZ: the smallest result pipe
    return 'r' * (900 * 1024)
"""

SRC["pipe_nonblocking_flood"] = _RES_FD + """\
import os
def main():
    fd = _res_fd()
    os.set_blocking(fd, False)
    n = 0
    try:
        while n < (8 << 20):
            n += os.write(fd, b'\\xff' * 65536)
    except BlockingIOError:
        pass
    return n
"""

# -- the worker's disk, from the scratch directory

SRC["disk_fill"] = """\
import errno, os, time
def main(limit, hold):
    buf = b'\\1' * (1 << 20)
    n, err, i = 0, '', 0
    try:
        while n < limit:
            fd = os.open('fill%d' % i, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                for _ in range(16):
                    n += os.write(fd, buf)
                os.fsync(fd)
            finally:
                os.close(fd)
            i += 1
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno))
    d = 0
    try:
        while d < 20000:
            os.mkdir('d%d' % d)
            d += 1
    except OSError as e:
        err += '/' + errno.errorcode.get(e.errno, str(e.errno))
    time.sleep(hold)
    return [n, err, d]
"""

SRC["inode_fill"] = """\
import errno, os, time
def main(limit, hold):
    n, err = 0, ''
    try:
        while n < limit:
            if n % 5000 == 0:
                os.mkdir('b%d' % (n // 5000))
            os.close(os.open('b%d/%d' % (n // 5000, n), os.O_WRONLY | os.O_CREAT, 0o600))
            n += 1
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno))
    time.sleep(hold)
    return [n, err]
"""

SRC["deep_tree"] = """\
import os
def main(depth):
    for _ in range(depth):
        os.mkdir('d')
        os.chdir('d')
    with open('bottom', 'w') as f:
        f.write('x')
    return depth
"""

SRC["many_files"] = """\
import os
def main(n, wide):
    for i in range(n):
        os.close(os.open('f%d' % i, os.O_WRONLY | os.O_CREAT, 0o600))
    for j in range(wide):
        os.mkdir('w%d' % j)
        for k in range(10):
            with open('w%d/%d' % (j, k), 'w') as f:
                f.write('x' * 100)
    return n + wide * 11
"""

SRC["link_games"] = """\
import os, socket
def main():
    r = {}
    def t(name, fn):
        try:
            fn()
            r[name] = 'ok'
        except OSError as e:
            r[name] = e.strerror
    t('symlink_root', lambda: os.symlink('/', 'root'))
    t('symlink_etc', lambda: os.symlink('/etc', 'etc'))
    t('symlink_worker', lambda: os.symlink('/opt/dsec-fncall/worker.py', 'worker.py'))
    t('symlink_fncall', lambda: os.symlink('/fncall', 'fncall'))
    t('symlink_loop', lambda: (os.symlink('loop2', 'loop1'), os.symlink('loop1', 'loop2')))
    t('symlink_up', lambda: os.symlink('..', 'up'))
    t('symlink_proc_root', lambda: os.symlink('/proc/1/root', 'proc1root'))
    t('dir_of_symlinks', lambda: (os.mkdir('links'), [os.symlink(p, 'links/%d' % i) for i, p in
                                   enumerate(['/', '/etc', '/usr', '/opt', '/fncall', '/proc/self/cwd'])]))
    t('hardlink_worker', lambda: os.link('/opt/dsec-fncall/worker.py', 'worker-hard'))
    t('hardlink_passwd', lambda: os.link('/etc/passwd', 'passwd-hard'))
    t('fifo', lambda: os.mkfifo('fifo'))
    t('unix_socket', lambda: socket.socket(socket.AF_UNIX).bind('sock'))
    t('odd_names', lambda: [os.close(os.open(n, os.O_WRONLY | os.O_CREAT, 0o600)) for n in
                            (b'-rf', b'a\\nb', b'\\xff\\xfe', b' ', b'x' * 255, b'..\\x01')])
    t('setuid_file', lambda: (os.close(os.open('suid', os.O_WRONLY | os.O_CREAT, 0o755)), os.chmod('suid', 0o6755)))
    t('locked_dirs', lambda: (os.makedirs('locked/inner/deeper'), os.close(os.open('locked/inner/f', os.O_WRONLY | os.O_CREAT)),
                              os.chmod('locked/inner/deeper', 0), os.chmod('locked/inner', 0), os.chmod('locked', 0)))
    t('locked_file', lambda: (os.close(os.open('ro', os.O_WRONLY | os.O_CREAT)), os.chmod('ro', 0)))
    t('scratch_locked', lambda: os.chmod('.', 0))
    return r
"""

# -- memory beyond the call's own limit

SRC["mem_memfd"] = """\
import os
def main(target):
    fds, held = [], 0
    buf = b'\\1' * (1 << 20)
    while held < target:
        if held % (128 << 20) == 0:  # a new one below RLIMIT_FSIZE
            fds.append(os.memfd_create('hog'))
        held += os.write(fds[-1], buf)
        print('held', held, flush=True)
    return held
"""

SRC["mem_pipes"] = """\
import fcntl, os
def main(target):
    held, fds = 0, []
    buf = b'\\1' * 65536
    try:
        while held < target:
            r, w = os.pipe2(os.O_NONBLOCK)
            fds += [r, w]
            try:
                fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
            except OSError:
                pass
            while held < target:
                try:
                    held += os.write(w, buf)
                except BlockingIOError:
                    break
            print('held', held, flush=True)
    except OSError as e:
        print('stopped:', e, flush=True)
    return held
"""

SRC["mem_sockets"] = """\
import socket
def main(target):
    held, socks = 0, []
    buf = b'\\1' * 65536
    try:
        while held < target:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            socks += [a, b]
            for s in (a, b):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 20)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
                s.setblocking(False)
            for s in (a, b):
                while held < target:
                    try:
                        held += s.send(buf)
                    except BlockingIOError:
                        break
            print('held', held, flush=True)
    except OSError as e:
        print('stopped:', e, flush=True)
    return held
"""

SRC["mem_tmpfs"] = """\
import os
def main(target):
    held = 0
    for d in ('/dev/shm', '/run/shm', '/tmp', '/var/tmp', '/run', '/run/lock', '/dev/mqueue'):
        try:
            fd = os.open(os.path.join(d, 'hog-%d' % os.getpid()), os.O_WRONLY | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            while held < target:
                held += os.write(fd, b'\\1' * (1 << 20))
                print('held', held, d, flush=True)
        except OSError as e:
            print('stopped:', d, e, flush=True)
        finally:
            os.close(fd)
    return held
"""

SRC["mem_hog_shielded"] = """\
import os, subprocess
def main(target):
    # its only other holder is a tiny program: an OOM kill of this (big) process frees nothing
    fds = [os.memfd_create('hog', 0) for _ in range(target // (128 << 20) + 1)]  # each below RLIMIT_FSIZE
    p = subprocess.Popen(['sleep', '20'], pass_fds=fds)
    buf = b'\\1' * (1 << 20)
    held = 0
    try:
        while held < target:
            held += os.write(fds[held // (128 << 20)], buf)
            if held % (32 << 20) == 0:
                print('held', held, flush=True)
    finally:
        p.wait()
    return held
"""

# -- exceptions and their messages

SRC["big_exception"] = """\
def main(n, ch):
    raise ValueError(ch * n)
"""

SRC["big_exception_chain"] = """\
def main(n):
    try:
        raise KeyError('k' * n)
    except KeyError as e:
        raise RuntimeError('r' * n) from e
"""

# -- channels between calls

SRC["left_listeners"] = """\
import array, os, socket, time
def main(tag, seconds):
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind('\\0' + tag)
        s.listen(4)
        t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        t.bind(('127.0.0.1', 0))
        t.listen(4)
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(('127.0.0.1', 0))
        os.write(w, b'%d %d' % (t.getsockname()[1], u.getsockname()[1]))
        for x in (s, t, u):
            x.setblocking(False)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for x in (s, t):
                try:
                    c, _ = x.accept()
                    c.sendall(b'still here')
                    c.close()
                except OSError:
                    pass
            try:
                _, addr = u.recvfrom(64)
                u.sendto(b'still here', addr)
            except OSError:
                pass
            time.sleep(0.005)
        os._exit(0)
    os.close(w)
    tcp, udp = (int(x) for x in os.read(r, 64).split())
    # A listening socket whose only reference is a message queued on a socket that is itself
    # in flight (SCM_RIGHTS cycle): nothing holds it once this process exits.
    s2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s2.bind('\\0' + tag + '-inflight')
    s2.listen(1)
    a, b = socket.socketpair()
    a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [s2.fileno(), b.fileno()]))])
    s2.close()
    b.close()
    a.close()
    return [tcp, udp]
"""

SRC["probe_listeners"] = """\
import socket
def main(tag, tcp, udp):
    out = {}
    for name, fam, kind, addr in (('abstract', socket.AF_UNIX, socket.SOCK_STREAM, '\\0' + tag),
                                  ('inflight', socket.AF_UNIX, socket.SOCK_STREAM, '\\0' + tag + '-inflight'),
                                  ('tcp', socket.AF_INET, socket.SOCK_STREAM, ('127.0.0.1', tcp))):
        s = socket.socket(fam, kind)
        s.settimeout(2)
        try:
            s.connect(addr)
            out[name] = s.recv(64).decode() or 'connected'
        except OSError:
            out[name] = None
        finally:
            s.close()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(1)
    try:
        u.sendto(b'hello', ('127.0.0.1', udp))
        out['udp'] = u.recv(64).decode()
    except OSError:
        out['udp'] = None
    with open('/proc/net/unix') as f:
        out['unix_names'] = [ln.split()[-1] for ln in f if tag in ln]
    return out
"""

SRC["time_wait"] = """\
import socket
def main():
    srv = socket.socket()
    srv.bind(('127.0.0.1', 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    c = socket.create_connection(('127.0.0.1', port))
    s, _ = srv.accept()
    c.sendall(b'hi')
    s.recv(2)
    c.close()  # the side that closes first is left in TIME_WAIT
    s.close()
    srv.close()
    return port
"""

SRC["read_net_tcp"] = """\
def main(*ports):
    hexports = [':%04X ' % port for port in ports]
    seen = []
    for table in ('/proc/net/tcp', '/proc/net/tcp6', '/proc/net/udp', '/proc/net/udp6'):
        try:
            with open(table) as f:
                seen += [ln.strip() for ln in f if any(h in ln for h in hexports)]
        except OSError:
            pass
    return seen
"""

SRC["peek_victim"] = """\
import os, subprocess, sys
def main(secret, seconds):
    with open('secret.txt', 'w') as f:
        f.write(secret)
    p = subprocess.Popen([sys.executable, '-c', 'import sys, time; time.sleep(float(sys.argv[1]))', str(seconds),
                          '--token=' + secret], env=dict(os.environ, DSEC_VICTIM_SECRET=secret))
    p.wait()
    return [os.getuid(), sorted(os.listdir('.'))]
"""

SRC["peek_attacker"] = """\
import os, time
def main(seconds):
    me, my_pids = os.getuid(), {os.getpid()}
    got = {'cmdline': [], 'environ': [], 'cwd': [], 'fd': [], 'maps': [], 'mem': [], 'files': [], 'pids': 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for name in os.listdir('/proc'):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open('/proc/%d/status' % pid) as f:
                    uid = int(f.read().split('\\nUid:')[1].split()[0])
            except (OSError, IndexError, ValueError):
                continue
            if uid == me or uid == 0:
                continue
            got['pids'] += 1
            for what, path in (('cmdline', 'cmdline'), ('environ', 'environ'), ('maps', 'maps')):
                try:
                    with open('/proc/%d/%s' % (pid, path), 'rb') as f:
                        data = f.read(65536).replace(b'\\0', b' ').decode('utf-8', 'replace')
                    if data and data not in got[what]:
                        got[what].append(data[:2000])
                except OSError:
                    pass
            try:
                cwd = os.readlink('/proc/%d/cwd' % pid)
                got['cwd'].append(cwd)
                with open(os.path.join(cwd, 'secret.txt')) as f:
                    got['files'].append(f.read())
            except OSError:
                pass
            try:
                got['fd'].append(os.listdir('/proc/%d/fd' % pid))
            except OSError:
                pass
            try:
                with open('/proc/%d/mem' % pid, 'rb') as f:
                    got['mem'].append(pid)
            except OSError:
                pass
        time.sleep(0.01)
    return got
"""

SRC["signal_victim"] = """\
import os, time
def main(seconds, salt):
    time.sleep(seconds)
    return [os.getuid(), salt]
"""

SRC["signal_everyone"] = """\
import ctypes, os, signal, time
def main(seconds):
    me = os.getpid()
    hits = []
    libc = ctypes.CDLL(None, use_errno=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for name in os.listdir('/proc'):
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                    hits.append([pid, int(sig)])
                except OSError:
                    pass
            try:
                fd = os.pidfd_open(pid)
                try:
                    if libc.syscall(424, fd, int(signal.SIGKILL), None, 0) == 0:  # pidfd_send_signal
                        hits.append([pid, 'pidfd'])
                finally:
                    os.close(fd)
            except OSError:
                pass
        for target in (-1, 0):
            try:
                os.kill(target, signal.SIGCONT)
            except OSError:
                pass
        time.sleep(0.02)
    return hits
"""

SRC["machinery"] = """\
import ctypes, os, signal
def main():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    targets = {}
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open('/proc/%s/cmdline' % name, 'rb') as f:
                cmd = f.read()
        except OSError:
            continue
        if b'supervise' in cmd:
            targets['supervisor'] = int(name)
        elif b'zygote' in cmd and int(name) != os.getpid() and int(name) != os.getppid():
            pass
    targets['init'] = 1
    targets['zygote'] = os.getppid()
    if 'supervisor' not in targets:  # /proc hides it (hidepid): try every low pid instead
        for pid in range(2, 40):
            if pid not in (os.getpid(), os.getppid()):
                targets['guess-%d' % pid] = pid
    done = []
    for who, pid in targets.items():
        for req, label in ((16, 'PTRACE_ATTACH'), (0x4206, 'PTRACE_SEIZE')):
            if libc.ptrace(req, pid, None, None) == 0:
                done.append([who, label])
        for path, mode in (('mem', 'r+b'), ('mem', 'rb'), ('environ', 'rb'), ('maps', 'rb'), ('stack', 'rb'),
                           ('syscall', 'rb'), ('auxv', 'rb'), ('io', 'rb')):
            try:
                with open('/proc/%d/%s' % (pid, path), mode):
                    done.append([who, 'open ' + path + ' ' + mode])
            except OSError:
                pass
        for path in ('oom_score_adj', 'comm', 'timerslack_ns', 'clear_refs'):
            try:  # written back unchanged where readable: a success is the finding, not a change
                try:
                    with open('/proc/%d/%s' % (pid, path), 'rb') as f:
                        same = f.read() or b'1'
                except OSError:
                    same = b'1'
                with open('/proc/%d/%s' % (pid, path), 'wb', buffering=0) as f:
                    f.write(same if path != 'clear_refs' else b'5')
                done.append([who, 'write ' + path])
            except OSError:
                pass
        for path in ('cwd', 'root', 'exe'):
            try:
                os.listdir('/proc/%d/%s' % (pid, path)) if path != 'exe' else os.readlink('/proc/%d/exe' % pid)
                done.append([who, path])
            except OSError:
                pass
        try:
            os.listdir('/proc/%d/fd' % pid)
            done.append([who, 'fd'])
        except OSError:
            pass
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            try:
                os.kill(pid, sig)
                done.append([who, 'kill %d' % sig])
            except OSError:
                pass
    fds = sorted(int(x) for x in os.listdir('/proc/self/fd'))
    extra = []
    for fd in fds:
        try:
            extra.append([fd, os.readlink('/proc/self/fd/%d' % fd)])
        except OSError:
            pass
    return [done, sorted(targets), extra]
"""

SRC["ipc_objects"] = """\
import ctypes, os
def main():
    libc = ctypes.CDLL(None, use_errno=True)
    def tried(fn):
        # in a child: a syscall the sandbox's filter answers with SIGSYS must not end the call
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if fn() >= 0 else 1)
            finally:
                os._exit(1)
        return os.waitpid(pid, 0)[1] == 0
    made = []
    calls = {'shmget': (29, (0x5eed, 4096, 0o1666)), 'semget': (64, (0x5eed, 1, 0o1666)),
             'msgget': (68, (0x5eed, 0o1666)), 'mq_open': (240, (b'dsec-mq', 0o100 | 0o2, 0o666, None)),
             'add_key': (248, (b'user', b'dsec-key', b'data', 4, -4)), 'keyctl': (250, (0, -4, 0)),
             'request_key': (249, (b'user', b'dsec-key', None, 0))}
    for name, (nr, args) in calls.items():
        for bits, label in ((0, ''), (0x40000000, ' x32')):
            if tried(lambda: libc.syscall(nr | bits, *args)):
                made.append(name + label)
    for name, fn in (('shmget', lambda: libc.shmget(0x5eed2, 4096, 0o1666)),
                     ('semget', lambda: libc.semget(0x5eed2, 1, 0o1666)),
                     ('msgget', lambda: libc.msgget(0x5eed2, 0o1666))):
        if tried(fn):
            made.append('libc ' + name)
    try:
        with open('/dev/mqueue/dsec-mq2', 'w'):
            made.append('/dev/mqueue file')
    except OSError:
        pass
    return made
"""

SRC["find_writable"] = """\
import os, stat
def main():
    wrote = []
    me = os.getcwd()
    skip = ('/proc', '/sys', me)
    stack = ['/']
    dirs = 0
    while stack and dirs < 20000:
        d = stack.pop()
        dirs += 1
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        if os.access(d, os.W_OK):
            try:
                p = os.path.join(d, '.dsec-w-%d' % os.getpid())
                os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                os.unlink(p)
                wrote.append(d)
            except OSError:
                pass
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False) and not e.path.startswith(skip):
                    stack.append(e.path)
                elif not e.is_symlink() and os.access(e.path, os.W_OK) and not stat.S_ISCHR(os.stat(e.path).st_mode):
                    try:
                        with open(e.path, 'ab'):
                            wrote.append(e.path)
                    except OSError:
                        pass
            except OSError:
                pass
    for path in ('/tmp', '/var/tmp', '/dev/shm', '/run', '/run/lock', '/fncall', '/dev/mqueue', '/',
                 '/opt/dsec-fncall', '/usr/lib/python3/dist-packages', '/etc'):
        try:
            p = os.path.join(path, '.dsec-x-%d' % os.getpid())
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(p)
            wrote.append(path)
        except OSError:
            pass
    for path in ('/etc/passwd', '/opt/dsec-fncall/worker.py', '/fncall'):
        for fn in (lambda p: os.chmod(p, 0o777), lambda p: os.chown(p, os.getuid(), os.getgid()),
                   lambda p: os.utime(p, (0, 0))):
            try:
                fn(path)
                wrote.append('attr ' + path)
            except OSError:
                pass
    try:
        os.listdir('/fncall')
        wrote.append('listed /fncall')
    except OSError:
        pass
    return [sorted(set(wrote)), dirs]
"""

SRC["env_globals_set"] = """\
import builtins, json, os, sys
import numpy as np
def main(tag):
    os.environ['DSEC_LEFT'] = tag
    os.putenv('DSEC_LEFT2', tag)
    builtins.dsec_left = tag
    json.dumps = lambda *a, **k: tag
    np.dsec_left = tag
    np.random.seed(12345)
    sys.path.insert(0, '/tmp/' + tag)
    sys.modules['dsec_left'] = tag
    return tag
"""

SRC["env_globals_check"] = """\
import builtins, json, os, sys
import numpy as np
def main(tag):
    left = []
    if 'DSEC_LEFT' in os.environ or 'DSEC_LEFT2' in os.environ:
        left.append('environ')
    if hasattr(builtins, 'dsec_left'):
        left.append('builtins')
    if json.dumps({'a': 1}) != '{"a": 1}':
        left.append('json.dumps')
    if hasattr(np, 'dsec_left'):
        left.append('numpy attribute')
    np2 = np.random.RandomState(12345).random_sample()
    if np.random.random_sample() == np2:
        left.append('numpy seed')
    if any(tag in p for p in sys.path) or 'dsec_left' in sys.modules:
        left.append('sys')
    return left
"""

SRC["stdout_after_result"] = _RES_FD + """\
import os, struct, sys, time
def main(tag, seconds):
    fd = _res_fd()
    os.write(fd, struct.pack('>IBd', 9 + 1, 0x56, 0.0) + b'1')
    if os.fork() == 0:
        os.setsid()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for out in (1, 2):
                try:
                    os.write(out, ('LEAK-' + tag + '\\n').encode())
                except OSError:
                    pass
            time.sleep(0.01)
        os._exit(0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.write(1, ('LEAK-' + tag + '\\n').encode())
        except OSError:
            break
        time.sleep(0.01)
    return 2
"""

SRC["print_and_return"] = """\
import sys
def main(i):
    print('clean', i)
    print('clean-err', i, file=sys.stderr)
    return i
"""

SRC["limits_raise"] = """\
import ctypes, os, resource
def main():
    got = []
    for name in ('RLIMIT_NPROC', 'RLIMIT_NOFILE', 'RLIMIT_FSIZE', 'RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_CORE',
                 'RLIMIT_MSGQUEUE', 'RLIMIT_MEMLOCK', 'RLIMIT_RTPRIO', 'RLIMIT_NICE', 'RLIMIT_STACK'):
        res = getattr(resource, name)
        soft, hard = resource.getrlimit(res)
        if hard == resource.RLIM_INFINITY:
            continue
        try:
            resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            got.append(name)
        except (OSError, ValueError):
            pass
    try:
        os.nice(-5)
        got.append('nice -5')
    except OSError:
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        got.append('SCHED_FIFO')
    except OSError:
        pass
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(251, 1, 0, (1 << 13) | 0) == 0:  # ioprio_set(IOPRIO_WHO_PROCESS, self, RT class)
        got.append('ioprio RT')
    for v in (b'0', b'-1000', b'999'):
        try:
            with open('/proc/self/oom_score_adj', 'wb') as f:
                f.write(v)
            with open('/proc/self/oom_score_adj') as f:
                if int(f.read()) < 1000:
                    got.append('oom_score_adj ' + v.decode())
        except OSError:
            pass
    return got
"""

SRC["limits_check"] = """\
import resource
def main():
    return [list(resource.getrlimit(resource.RLIMIT_NPROC)), list(resource.getrlimit(resource.RLIMIT_NOFILE)),
            list(resource.getrlimit(resource.RLIMIT_FSIZE))]
"""

SRC["setuid_tries"] = """\
import os
def main():
    got = []
    uid = os.getuid()
    for name, fn in (('setuid 0', lambda: os.setuid(0)), ('setresuid 0', lambda: os.setresuid(0, 0, 0)),
                     ('seteuid 0', lambda: os.seteuid(0)), ('setuid next slot', lambda: os.setuid(uid + 1)),
                     ('setuid prev slot', lambda: os.setuid(uid - 1)), ('setgid 0', lambda: os.setgid(0)),
                     ('setgroups 0', lambda: os.setgroups([0])), ('setfsuid', lambda: os.setreuid(uid + 1, -1))):
        try:
            fn()
            got.append(name)
        except OSError:
            pass
    st = {}
    with open('/proc/self/status') as f:
        for line in f:
            k, _, v = line.partition(':')
            st[k] = v.strip()
    if st.get('NoNewPrivs') != '1':
        got.append('no_new_privs is not set')
    for cap in ('CapEff', 'CapPrm', 'CapAmb'):
        if int(st.get(cap, '0'), 16):
            got.append(cap + ' ' + st[cap])
    if os.getuid() != uid or os.geteuid() != uid:
        got.append('uid changed')
    return got
"""

SRC["process_tricks"] = """\
import ctypes, os, signal, time
def main(seconds):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    kids = 0
    def child(fn):
        nonlocal kids
        if os.fork() == 0:
            try:
                fn()
            finally:
                os._exit(0)
        kids += 1
    def sleeper():
        time.sleep(seconds)
    def double_fork():
        os.setsid()
        if os.fork() == 0:
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1):
                signal.signal(s, signal.SIG_IGN)
            sleeper()
    def stopped():
        os.kill(os.getpid(), signal.SIGSTOP)
        sleeper()
    def traced():
        libc.ptrace(0, 0, None, None)  # PTRACE_TRACEME: its parent traces it
        os.kill(os.getpid(), signal.SIGSTOP)
        sleeper()
    def orphan_subreaper():
        libc.prctl(36, 1, 0, 0, 0)
        if os.fork() == 0:
            sleeper()
    for fn in (sleeper, double_fork, stopped, traced, orphan_subreaper):
        child(fn)
    for _ in range(20):  # zombies nobody waits for
        if os.fork() == 0:
            os._exit(0)
    time.sleep(0.2)
    return kids
"""

SRC["fork_bomb"] = """\
import os, threading, time
def main(seconds):
    procs = threads = 0
    err = ''
    try:
        while procs < 1000:
            if os.fork() == 0:
                time.sleep(seconds)
                os._exit(0)
            procs += 1
    except OSError as e:
        err = e.strerror
    try:
        while threads < 1000:
            threading.Thread(target=time.sleep, args=(seconds,), daemon=True).start()
            threads += 1
    except (RuntimeError, OSError):
        pass
    return [procs, threads, err]
"""

SRC["cpu_spin"] = """\
import os, signal
def main(kids):
    for s in (signal.SIGTERM, signal.SIGXCPU, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
        signal.signal(s, signal.SIG_IGN)
    for _ in range(kids):
        if os.fork() == 0:
            os.setsid()
            while True:
                pass
    while True:
        pass
"""

SRC["sleep_no_sigterm"] = """\
import signal, time
def main():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGXCPU, signal.SIG_IGN)
    time.sleep(60)
"""

SRC["fd_exhaustion"] = """\
import ctypes, os, select, time
def main(hold):
    fds = []
    kinds = {}
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, make in (('inotify', lambda: libc.inotify_init1(0o2000000)), ('eventfd', lambda: os.eventfd(0)),
                       ('epoll', lambda: select.epoll().detach()), ('null', lambda: os.open('/dev/null', os.O_RDONLY))):
        n = 0
        while True:
            try:
                fd = make()
            except OSError:
                break
            if fd < 0:
                break
            fds.append(fd)
            n += 1
        kinds[kind] = n
    time.sleep(hold)  # held while concurrent calls try theirs
    return [len(fds), kinds]
"""

SRC["fd_check"] = """\
import ctypes, os
def main():
    libc = ctypes.CDLL(None, use_errno=True)
    ino = [libc.inotify_init1(0o2000000) for _ in range(8)]
    err = '' if all(x >= 0 for x in ino) else os.strerror(ctypes.get_errno())
    fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(200)]
    return [sum(1 for x in ino if x >= 0), len(fds), err]
"""


SRC["fd_keeper"] = """\
import array, json, os, socket, time
def main(tag, seconds):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind('\\0' + tag)
    srv.listen(4)
    srv.settimeout(seconds)
    kept, sizes = [], []
    end = time.monotonic() + seconds
    try:
        c, _ = srv.accept()
        c.settimeout(max(end - time.monotonic(), 0.1))
        msg, anc, _f, _a = c.recvmsg(64, socket.CMSG_SPACE(4 * 4))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array('i')
                a.frombytes(data[: len(data) - len(data) % 4])
                kept += list(a)
        sizes = [os.fstat(fd).st_size for fd in kept]
        c.sendall(b'kept')
    except OSError as e:
        return ['no fd', str(e)]
    time.sleep(max(end - time.monotonic(), 0))
    return sizes
"""

SRC["fd_giver"] = """\
import array, os, socket
def main(tag, size):
    fd = os.memfd_create('charged-here')
    buf = b'\\1' * (1 << 20)
    held = 0
    while held < size:
        held += os.write(fd, buf)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect('\\0' + tag)
    s.sendmsg([b'fd'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [fd]))])
    s.recv(8)
    return [os.getuid(), held]
"""

SRC["alloc_victim"] = """\
import os
def main(n):
    b = bytearray(n)
    for i in range(0, n, 4096):
        b[i] = 1
    return [os.getuid(), len(b)]
"""

SRC["output_amplify"] = """\
import os
def main(cap):
    chunk = b'\\xff' * (1 << 20)
    for fd in (1, 2):
        left = cap
        while left > 0:
            left -= os.write(fd, chunk[:left])
    return '\\x01' * (cap // 6 - 2)
"""

SRC["odd_exceptions"] = """\
import sys
class BadStr(Exception):
    def __str__(self):
        raise RuntimeError('no str for you')
class HugeStr(Exception):
    def __str__(self):
        return 'h' * (8 << 20)
class NotStr(Exception):
    def __str__(self):
        return 42
def deep(n):
    return deep(n + 1)
def main(kind):
    if kind == 'SystemExit':
        sys.exit(3)
    if kind == 'KeyboardInterrupt':
        raise KeyboardInterrupt
    if kind == 'GeneratorExit':
        raise GeneratorExit
    if kind == 'BadStr':
        raise BadStr()
    if kind == 'HugeStr':
        raise HugeStr()
    if kind == 'NotStr':
        raise NotStr()
    if kind == 'Recursion':
        deep(0)
    if kind == 'CircularValue':
        x = []
        x.append(x)
        return x
    if kind == 'BadToList':
        class T:
            def tolist(self):
                return self
        return T()
    if kind == 'NestedValue':
        v = []
        for _ in range(100000):
            v = [v]
        return v
    return kind
"""

SRC["scratch_opened_up"] = """\
import os, socket
def main(tag):
    os.chmod('.', 0o777)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect('\\0' + tag)
    s.sendall(os.getcwd().encode())
    s.recv(8)
    return os.getcwd()
"""

SRC["scratch_racer"] = """\
import os, socket, time
def main(tag, seconds):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind('\\0' + tag)
    srv.listen(1)
    srv.settimeout(seconds)
    c, _ = srv.accept()
    path = c.recv(4096).decode()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    c.sendall(b'ok')
    c.close()
    made = swaps = 0
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:  # keep filling the other call's scratch dir while it is cleaned
        i += 1
        try:
            os.mkdir('r%d' % i, dir_fd=fd)
            sub = os.open('r%d' % i, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            for k in range(20):
                os.close(os.open('f%d' % k, os.O_WRONLY | os.O_CREAT, 0o666, dir_fd=sub))
            os.chmod('r%d' % i, 0, dir_fd=fd)
            os.close(sub)
            made += 21
        except OSError:
            time.sleep(0.001)
        try:  # a directory that is a symbolic link a moment later, and a directory again
            os.mkdir('sw', dir_fd=fd)
            os.rename('sw', 'sw-away', src_dir_fd=fd, dst_dir_fd=fd)
            os.symlink('/', 'sw', dir_fd=fd)
            os.unlink('sw', dir_fd=fd)
            os.rmdir('sw-away', dir_fd=fd)
            swaps += 1
        except OSError:
            pass
    return [path, made, swaps]
"""


SRC["climb_setup"] = """\
import os, socket
def main(tag, depth, width, targets):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect('\\0' + tag)
    bname = s.recv(256).decode()
    os.umask(0)
    os.chmod('.', 0o755)
    # The cleaner takes a directory's subdirectories last-made first: 'srv' is entered before
    # the targets, which stay on its list for later, relative to wherever it then is.
    for t in targets:
        os.makedirs('mnt/' + t)
    holder = 'mnt/srv/' + bname
    os.makedirs(holder + '/x')
    for d in ('mnt', 'mnt/srv', holder, holder + '/x'):
        os.chmod(d, 0o777)
    fd = os.open(holder + '/x', os.O_RDONLY | os.O_DIRECTORY)
    for i in range(depth):
        for k in range(width):
            os.close(os.open('f%d' % k, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        if i == 3:
            os.close(os.open('c', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        os.mkdir('d', 0o755, dir_fd=fd)
        nfd = os.open('d', os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)
    s.sendall(os.path.abspath(holder).encode())
    s.recv(8)
    return os.getcwd()
"""

SRC["climb_racer"] = """\
import os, socket, time
def main(tag, seconds):
    me = os.getcwd()
    here = os.open('.', os.O_RDONLY | os.O_DIRECTORY)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind('\\0' + tag)
    srv.listen(1)
    srv.settimeout(seconds)
    c, _ = srv.accept()
    c.sendall(os.path.basename(me).encode())
    holder_path = c.recv(4096).decode()
    holder = os.open(holder_path, os.O_RDONLY | os.O_DIRECTORY)
    x = os.open('x', os.O_RDONLY | os.O_DIRECTORY, dir_fd=holder)
    c.sendall(b'ok')
    c.close()
    end = time.monotonic() + seconds
    moved = ''
    while time.monotonic() < end:  # until the cleaner is inside x's chain (the canary at level 3 went)
        try:
            os.stat('d/d/d/c', dir_fd=x)
        except FileNotFoundError:
            try:
                os.rename('x', 'x', src_dir_fd=holder, dst_dir_fd=here)  # x now lives in our own scratch dir
                moved = 'moved'
            except OSError as e:
                moved = 'rename: %s' % e
            break
        except OSError:
            pass
    time.sleep(2.0)
    return [moved, os.path.exists(me)]
"""


SRC["awkward_values"] = """\
def main(kind, depth):
    if kind == 'surrogate_value':
        return ['\\ud800', '\\udfff']
    if kind == 'surrogate_key':
        return {'\\ud800': 1}
    if kind == 'surrogate_error':
        raise ValueError('\\udfff')
    if kind == 'surrogate_print':
        import sys
        sys.stdout.buffer.write(b'\\xed\\xa0\\x80\\n')
        return 1
    if kind == 'nested':
        v = 1
        for _ in range(depth):
            v = [v]
        return v
    if kind == 'nested_error':
        v = 1
        for _ in range(depth):
            v = [v]
        raise ValueError(v)
    if kind == 'nan':
        return [float('nan'), float('inf')]
    return kind
"""


SRC["net_counters"] = """\
def main():
    out = {}
    try:
        with open('/proc/net/snmp') as f:
            lines = f.read().splitlines()
        for i in range(0, len(lines) - 1, 2):
            names, values = lines[i].split(), lines[i + 1].split()
            if names[0] in ('Tcp:', 'Udp:'):
                for n, v in zip(names[1:], values[1:]):
                    out[names[0][:-1] + '.' + n] = int(v)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open('/proc/net/dev') as f:
            for line in f:
                if line.strip().startswith('lo:'):
                    out['lo.rx_packets'] = int(line.split(':', 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return out
"""

SRC["net_signal"] = """\
import socket
def main(k):
    srv = socket.socket()
    srv.bind(('127.0.0.1', 0))
    srv.listen(64)
    for _ in range(k):
        c = socket.create_connection(('127.0.0.1', srv.getsockname()[1]))
        s, _ = srv.accept()
        s.close()
        c.close()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(('127.0.0.1', 0))
    for _ in range(k):
        u.sendto(b'x', u.getsockname())
    return [k, srv.getsockname()[1], u.getsockname()[1]]
"""


# ----------------------------------------------------------------- the edge ----


@dataclass(frozen=True)
class FnEdge:
    """A real edge running the fncall backend on the same image (its own pool), for the routes."""

    url: str
    token: str


# -------------------------------------------------------------- the worker ----


@dataclass(frozen=True)
class Task:
    """One task (thread) in a worker sandbox, as its own /proc shows it; pids are the sandbox's."""

    pid: int
    tid: int
    ppid: int
    state: str
    uid: int | None
    name: str


class WorkerView:
    """A worker sandbox seen from the host through its supervisor's ``/proc/<pid>/root``:
    the sandbox's own ``/proc`` and files. Read-only; the test's privileged eye."""

    def __init__(self, host_pid: int) -> None:
        self.host_pid = host_pid
        self.root = f"/proc/{host_pid}/root"
        self._map: list[tuple[int, int, int]] = []
        with open(f"/proc/{host_pid}/uid_map") as f:
            for line in f:
                inner, outer, count = (int(x) for x in line.split())
                self._map.append((inner, outer, count))

    @classmethod
    def of(cls, worker: Worker | None) -> WorkerView | None:
        pid = None if worker is None else worker.supervisor_pid
        if pid is None:
            return None
        try:
            return cls(pid)
        except OSError:
            return None

    def inner_uid(self, host_uid: int) -> int | None:
        for inner, outer, count in self._map:
            if outer <= host_uid < outer + count:
                return inner + host_uid - outer
        return None

    def tasks(self) -> list[Task]:
        out: list[Task] = []
        base = f"{self.root}/proc"
        for name in os.listdir(base):
            if not name.isdigit():
                continue
            try:
                tids = os.listdir(f"{base}/{name}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"{base}/{name}/task/{tid}/status", "rb") as fh:
                        text = fh.read().decode("utf-8", "replace")
                except OSError:
                    continue
                st: dict[str, str] = {}
                for line in text.splitlines():
                    k, _, v = line.partition(":")
                    st[k] = v.strip()
                uid = None
                with contextlib.suppress(ValueError, IndexError):
                    uid = self.inner_uid(int(st["Uid"].split()[0]))
                out.append(Task(int(name), int(tid), int(st.get("PPid", "0") or 0), st.get("State", "?")[:1], uid,
                                st.get("Name", "")))
        return out

    def cmdline(self, pid: int) -> str:
        try:
            with open(f"{self.root}/proc/{pid}/cmdline", "rb") as fh:
                return fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            return ""

    def zygote(self, tasks: Sequence[Task]) -> int | None:
        for pid in sorted({t.pid for t in tasks if t.uid == 0}):
            if "worker.py zygote" in self.cmdline(pid):
                return pid
        return None

    def leftovers(self, uid_lo: int, uid_hi: int, *, only: set[int] | None = None) -> list[str]:
        """Tasks of the call uids ``[uid_lo, uid_hi)`` (or of ``only``) that are not a slot's own
        process: for each uid at most one process, a child of the zygote, with one thread.
        Fully dead thread groups (zombies waiting for the zygote's lazy reap) do not count;
        a zombie leader whose threads still run does."""
        tasks = self.tasks()
        zygote = self.zygote(tasks)
        groups: dict[int, list[Task]] = {}
        for t in tasks:
            if t.uid is not None and uid_lo <= t.uid < uid_hi and (only is None or t.uid in only):
                groups.setdefault(t.pid, []).append(t)
        bad: list[str] = []
        per_uid: dict[int, list[int]] = {}
        for pid, ts in groups.items():
            live = [t for t in ts if t.state not in ("Z", "X")]
            if not live:
                continue
            leader = next((t for t in ts if t.tid == pid), ts[0])
            uid = leader.uid if leader.uid is not None else -1
            desc = (f"pid {pid} uid {uid} ({leader.name}, leader {leader.state}, {len(live)} live of {len(ts)} tasks, "
                    f"parent {leader.ppid})")
            if leader.ppid != zygote or len(ts) != 1:
                bad.append(desc)
            else:
                per_uid.setdefault(uid, []).append(pid)
        for uid, pids in per_uid.items():
            if len(pids) > 1:
                bad.append(f"uid {uid} has {len(pids)} processes: {sorted(pids)}")
        return bad

    def stopped(self) -> list[str]:
        """Tasks in the stopped or traced state (T, t): nothing of the worker's machinery may be."""
        return [f"pid {t.pid} tid {t.tid} uid {t.uid} ({t.name}) {t.state}" for t in self.tasks()
                if t.state in ("T", "t")]

    def scratch(self) -> list[str]:
        """Problems with /fncall: entries that are not an empty directory (a slot's waiting
        process has made its own, empty; the supervisor may keep more made ahead)."""
        base = f"{self.root}/fncall"
        bad: list[str] = []
        try:
            names = os.listdir(base)
        except OSError as exc:
            return [f"/fncall: {exc}"]
        for name in names:
            try:
                inner = os.listdir(f"{base}/{name}")
            except OSError as exc:
                bad.append(f"/fncall/{name}: {exc.strerror}")
                continue
            if inner:
                bad.append(f"/fncall/{name} holds {len(inner)} entries: {sorted(inner)[:5]}")
        return bad

    def scratch_count(self) -> int:
        try:
            return len(os.listdir(f"{self.root}/fncall"))
        except OSError:
            return -1

    def digest(self, path: str) -> str:
        try:
            with open(f"{self.root}{path}", "rb") as fh:
                return hashlib.sha256(fh.read()).hexdigest()
        except OSError as exc:
            return f"unreadable: {exc.strerror}"

    def mode(self, path: str) -> str:
        try:
            st = os.lstat(f"{self.root}{path}")
        except OSError as exc:
            return f"missing: {exc.strerror}"
        return f"{st.st_mode & 0o7777:o} {self.inner_uid(st.st_uid)}"


# ------------------------------------------------------------- neighbours ----


class CallLoad:
    """Neighbour calls: ``n`` loops, each one small call at a time on the pool's image (so on
    the attacked worker), each value checked. Any failure (lost, timed out, wrong value) is an
    error: a neighbour of an attack must not notice it, beyond its latency."""

    def __init__(self, pool: FnCallPool, image: ImageRef, *, n: int = 2, gap_s: float = 0.02,
                 timeout: float = 15.0) -> None:
        self.pool = pool
        self.image = image
        self.n = n
        self.gap_s = gap_s
        self.timeout = timeout
        self.samples: list[float] = []
        self.errors: list[str] = []
        self.lost: list[FnCallWorkerLost] = []
        self.calls = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = False

    async def _loop(self, k: int) -> None:
        i = 0
        while not self._stop:
            i += 1
            salt = f"n{k}-{i}-{secrets.token_hex(4)}"
            t0 = time.perf_counter()
            self.calls += 1
            try:
                r = await self.pool.call(self.image, SRC["neighbour"], [i, salt], timeout=self.timeout)
            except FnCallFailed as exc:
                if isinstance(exc, FnCallWorkerLost):
                    self.lost.append(exc)
                self.errors.append(f"{type(exc).__name__}: {exc}"[:500])
            except Exception as exc:
                self.errors.append(f"raised {type(exc).__name__}: {exc}"[:500])
            else:
                if r.value != neighbour_value(i, salt):
                    self.errors.append(f"wrong value {r.value!r} for {[i, salt]}")
                else:
                    self.samples.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(self.gap_s)

    def start(self) -> None:
        self._stop = False
        self._tasks = [asyncio.ensure_future(self._loop(k)) for k in range(self.n)]

    async def stop(self) -> None:
        self._stop = True
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []


# ------------------------------------------------------------------ cases ----


class FnAttack:
    """One case's handle: calls on the pool (never raising for a call's failure), checks."""

    def __init__(self, pool: FnCallPool, image: ImageRef, outcome: Outcome, *, edge: FnEdge | None,
                 quick: bool, load: CallLoad) -> None:
        self.pool = pool
        self.image = image
        self.outcome = outcome
        self.edge = edge
        self.quick = quick
        self.load = load
        self.lost: list[FnCallWorkerLost] = []
        self.tainted = False
        """The case damaged the worker beyond what the closing checks see: replaced after them."""

    def check(self, what: str, ok: bool, detail: Any = "") -> bool:
        self.outcome.checks.append(Check(what, ok, detail))
        return bool(ok)

    def note(self, what: str) -> None:
        """What the case saw of the documented channel it shows (its ``documented``)."""
        self.outcome.notes.append(what)

    def _note(self, out: Any) -> None:
        if isinstance(out, FnCallWorkerLost):
            self.lost.append(out)

    async def call(self, source: str, *args: Any, kwargs: dict[str, Any] | None = None,
                   **limits: Any) -> FnOutcome | Exception:
        """The call's result or its failure; any other exception is returned too (a bug to report)."""
        try:
            out: FnOutcome | Exception = await self.pool.call(self.image, source, list(args), kwargs, **limits)
        except Exception as exc:
            out = exc
        self._note(out)
        return out

    async def many(self, calls: Sequence[FnCall], **limits: Any) -> list[FnOutcome] | Exception:
        try:
            outs = await self.pool.call_many(self.image, list(calls), **limits)
        except Exception as exc:
            return exc
        for o in outs:
            self._note(o)
        return outs

    def worker(self) -> Worker | None:
        return next((w for w in self.pool.workers() if w.ready), None)

    def view(self) -> WorkerView | None:
        return WorkerView.of(self.worker())

    @property
    def slots(self) -> int:
        w = self.worker()
        return 6 if w is None else w.cfg.concurrency + w.cfg.spare

    @property
    def uid_range(self) -> tuple[int, int]:
        lo = self.pool.config.call_uid_base
        return lo, lo + self.slots

    async def http(self, path: str, body: dict[str, Any], *, timeout: float = 60.0) -> tuple[int, Any]:
        import httpx

        assert self.edge is not None
        async with httpx.AsyncClient(timeout=timeout) as h:
            r = await h.post(self.edge.url + path, json=body, headers={"authorization": f"Bearer {self.edge.token}"})
        try:  # in a thread of its own: a shallow stack, as a client's decoder would have (the SDK: sdk_many)
            doc = await asyncio.to_thread(json.loads, r.content)
        except (ValueError, RecursionError) as exc:
            doc = f"undecodable: {type(exc).__name__}: {exc}; {r.text[:300]}"
        return r.status_code, doc

    async def sdk_many(self, calls: Sequence[FnCall], **limits: Any) -> list[Any] | Exception:
        """The calls through the SDK's ``fncall_many`` (the edge's batch route), as a client would."""
        from dsec.sdk import AsyncClient

        assert self.edge is not None
        try:
            async with AsyncClient(self.edge.url, self.edge.token) as c:
                return list(await c.fncall_many(self.image, list(calls), **limits))
        except Exception as exc:
            return exc


FnCaseFn = Callable[[FnAttack], Awaitable[None]]


@dataclass(frozen=True)
class FnCase:
    name: str
    attack: str
    """What the attack tries."""
    asserts: str
    """What the case checks (beyond the checks every case ends with)."""
    defence: str
    """What is expected to contain it."""
    fn: FnCaseFn
    heavy: bool = False
    """Long or heavy on the machine: ``slow`` in tests."""
    needs_edge: bool = False
    """Needs an edge's HTTP routes (skipped without one)."""
    uses_edge: bool = False
    """Uses an edge's HTTP routes too when there is one."""
    replaces_worker: bool = False
    """The case replaces a worker on purpose (no 'no worker replaced' check)."""
    known_bug: str | None = None
    """Set while the case is known to get through (a tracked bug): tests mark it xfail(strict)."""
    documented: str | None = None
    """A channel the docs name as shared, which the case shows and does not count as a breach: what it
    checks is that nothing beyond that channel gets through."""


FNCALL_CASES: list[FnCase] = []


def fncase(name: str, *, attack: str, asserts: str, defence: str, **kw: Any) -> Callable[[FnCaseFn], FnCaseFn]:
    def deco(fn: FnCaseFn) -> FnCaseFn:
        FNCALL_CASES.append(FnCase(name, attack, asserts, defence, fn, **kw))
        return fn

    return deco


def _desc(out: Any) -> str:
    if isinstance(out, FnResult):
        return f"value {json.dumps(out.value)[:300]}"
    if isinstance(out, FnCallFailed):
        return f"{type(out).__name__}({out.code}): {str(out)[:300]}"
    return f"raised {type(out).__name__}: {str(out)[:300]}"


def _typed_failure(out: Any) -> bool:
    """A call's own failure: a FnCallFailed of the call, not of its worker."""
    return isinstance(out, FnCallFailed) and not isinstance(out, FnCallWorkerLost)


def _value(out: Any, default: Any = None) -> Any:
    return out.value if isinstance(out, FnResult) else default


def _held(out: Any) -> int:
    """The most a memory case printed it held (``held N`` lines), from its value or its stdout."""
    text = out.stdout if isinstance(out, FnResult) else str(getattr(out, "fields", {}).get("stdout", ""))
    most = 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "held" and parts[1].isdigit():
            most = max(most, int(parts[1]))
    if isinstance(out, FnResult) and isinstance(out.value, int):
        most = max(most, out.value)
    return most


# -- isolation between calls of the same slot ---------------------------------


@fncase("zombie_leader_threads",
        attack="a call forks a child that starts a thread and ends its leader with the raw exit syscall (not "
               "exit_group): the leader is a zombie, its thread runs on as the call's uid; it lists that uid's "
               "later processes, reads the environ and cwd of a program a later call exec'd, reads the secret "
               "file in that call's scratch dir, plants a file there, and answers on an abstract socket",
        asserts="no task of the attack calls' uids outlives its call (threads of a zombie leader included); no "
                "leftover answers a collector call; no victim secret reached a leftover; no victim found a planted "
                "file",
        defence="the sweep treats a uid as empty only when no task of it exists (threads of a zombie leader "
                "included) and kills every task of the uid before it serves another call")
async def _zombie_leader(a: FnAttack) -> None:
    token = secrets.token_hex(4)
    tags = [f"dsec-spy-{token}-{i}" for i in range(4)]
    life = 40.0
    atk = await a.many([FnCall(SRC["zombie_spy"], (tag, life)) for tag in tags], timeout=20)
    uids: set[int] = set()
    if isinstance(atk, list):
        uids = {int(o.value[0]) for o in atk if isinstance(o, FnResult)}
    victims: list[tuple[str, Any]] = []
    for _ in range(2 if a.quick else 4):
        secrets_ = [f"VICTIM-{secrets.token_hex(8)}" for _ in range(4)]
        outs = await a.many([FnCall(SRC["zombie_victim"], (s, 1.0)) for s in secrets_], timeout=20)
        if isinstance(outs, Exception):
            victims.append(("", outs))
        else:
            victims += list(zip(secrets_, outs, strict=True))
    report = _value(await a.call(SRC["collector"], tags, False, timeout=20), {})
    lo, hi = a.uid_range
    view = a.view()
    left = view.leftovers(lo, hi, only=uids) if view is not None and uids else []
    await a.call(SRC["collector"], tags, True, timeout=20)  # the leftovers, if any, end now
    reused = sum(1 for _, o in victims if isinstance(o, FnResult) and o.value[0] in uids)
    a.check(f"the attack calls ran ({len(uids)} uids; {reused} of {len(victims)} victim calls then ran on one of them)",
            len(uids) >= 1, [_desc(o) for o in atk] if isinstance(atk, list) else _desc(atk))
    a.check("no task of an attack call's uid outlived its call (threads of a zombie leader included)", not left, left)
    answered = {t: r for t, r in (report or {}).items() if r is not None}
    a.check("no leftover answered the collector on its abstract socket", not answered,
            {t: (r if not isinstance(r, dict) else {k: r[k] for k in ("uid", "pids", "cwd")}) for t, r in answered.items()})
    text = json.dumps(report)
    leaked = [s for s, _ in victims if s and s in text]
    a.check("no victim's secret reached a leftover (the environ of its exec'd program, its scratch file)", not leaked,
            f"{len(leaked)} secrets seen: {json.dumps(answered)[:1500]}")
    planted = [_desc(o) for _, o in victims if isinstance(o, FnResult) and o.value[1]]
    a.check("no victim found a file planted in its scratch dir", not planted, planted[:4])
    bad = [_desc(o) for _, o in victims if not (isinstance(o, FnResult) and isinstance(o.value, list))]
    a.check("every victim call returned its value", not bad, bad[:4])


@fncase("sigstop_sweep_helper",
        attack="a leftover (setsid, double fork) waits for its call to end, then spins kill(-1, SIGSTOP): once the "
               "sweep's kill helper takes the call's uid, it is stopped before it can kill, and the zygote waits on it",
        asserts="after each round a probe call succeeds; no process of the worker is left stopped; the leftover is gone",
        defence="the cleanup path cannot be stopped by what it cleans up (a kill that does not take the uid, or a "
                "helper that is waited for with a deadline and killed/continued)",
        heavy=True)  # ~60 s; dsec bench abuse runs it, and test_fncall_hostile's stopped-helper case is in every run
async def _sigstop(a: FnAttack) -> None:
    rounds = 4 if a.quick else 10
    failed: list[str] = []
    for i in range(rounds):
        atk = await a.call(SRC["sigstop_spinner"], 6.0, timeout=15)
        probe = await a.call("def main(i):\n    return i * 3", i, timeout=15)
        if _value(probe) != i * 3:
            failed.append(f"round {i}: attack {_desc(atk)}; probe {_desc(probe)}")
            break
    a.check(f"a probe call after each of {rounds} rounds succeeded", not failed, failed)
    await asyncio.sleep(0.5)
    view = a.view()
    stopped = view.stopped() if view is not None else []
    a.check("no process of the worker is left stopped (the kill helper, the zygote...)", not stopped, stopped)


# -- malformed output of a call --------------------------------------------------

_NORMAL = "def main(i):\n    return ['ok', i]"


@fncase("forged_result_frames",
        attack="calls write malformed frames to their own result pipe and end: shorter than the header, zero length, "
               "an 'E' frame whose payload is not JSON / not UTF-8 / nested 100,000 deep, a 'V' frame nested 100,000 "
               "deep, an unknown kind, a huge or truncated length, garbage, a 4 MiB stream under a 2 GiB length; "
               "alone, in a pool batch and (with an edge) through POST /v1/fncall and /v1/fncall/batch",
        asserts="each such call gets its own typed FnCallFailed (never FnCallWorkerLost, never another exception); "
                "every other call of a batch gets its own value; the routes answer 200 with a typed error",
        defence="every byte from a call is untrusted: the supervisor and the pool parse a call's frame as that call's "
                "data, a malformed one is that call's crash", uses_edge=True)
async def _forged(a: FnAttack) -> None:
    names = [*FORGED, "stream"]
    alone_bad: list[str] = []
    for name in names:
        out = await a.call(SRC[f"forge_{name}"], timeout=15)
        ok = _typed_failure(out) or (name in FORGED_WELL_FORMED and isinstance(out, FnResult))
        if not ok:
            alone_bad.append(f"{name}: {_desc(out)}")
    a.check("each malformed frame, alone, is its own call's typed failure", not alone_bad, alone_bad)
    batch_bad: list[str] = []
    for name in names:
        calls = [FnCall(SRC[f"forge_{name}"]), *(FnCall(_NORMAL, (i,)) for i in range(5))]
        outs = await a.many(calls, timeout=15)
        if isinstance(outs, Exception):
            batch_bad.append(f"{name}: the batch raised {type(outs).__name__}: {str(outs)[:200]}")
            continue
        ok = _typed_failure(outs[0]) or (name in FORGED_WELL_FORMED and isinstance(outs[0], FnResult))
        others = [_value(o) for o in outs[1:]]
        if not ok or others != [["ok", i] for i in range(5)]:
            batch_bad.append(f"{name}: {_desc(outs[0])}; others {[_desc(o) for o in outs[1:]]}")
    a.check("in a batch, each malformed frame fails only its call; the others get their values", not batch_bad,
            batch_bad)
    everything = [FnCall(SRC[f"forge_{n}"]) for n in names] + [FnCall(_NORMAL, (i,)) for i in range(8)]
    outs = await a.many(everything, timeout=20)
    ok = isinstance(outs, list) and [_value(o) for o in outs[len(names):]] == [["ok", i] for i in range(8)]
    a.check("one batch of every malformed frame and 8 normal calls: the normal ones get their values", ok,
            _desc(outs) if not isinstance(outs, list) else [_desc(o) for o in outs])
    if a.edge is None:
        return
    http_bad: list[str] = []
    worker_before = None
    for name in names:
        status, doc = await a.http("/v1/fncall", {"image": _image_name(a.image), "source": SRC[f"forge_{name}"],
                                                  "timeout": 15})
        code = doc.get("error", {}).get("code") if isinstance(doc, dict) else None
        well = name in FORGED_WELL_FORMED and isinstance(doc, dict) and doc.get("ok") is True
        if status != 200 or not (well or (code and code.startswith("fncall_") and code != "fncall_worker_lost")):
            http_bad.append(f"{name}: HTTP {status} {str(doc)[:200]}")
        status, doc = await a.http("/v1/fncall/batch", {
            "image": _image_name(a.image), "timeout": 15,
            "calls": [{"source": SRC[f"forge_{name}"]}, *({"source": _NORMAL, "args": [i]} for i in range(3))]})
        res = doc.get("results") if isinstance(doc, dict) else None
        if status != 200 or not isinstance(res, list) or len(res) != 4 or \
                [r.get("value") for r in res[1:]] != [["ok", i] for i in range(3)]:
            http_bad.append(f"{name} (batch): HTTP {status} {str(doc)[:300]}")
        else:
            worker_before = worker_before or res[1].get("worker")
            if res[1].get("worker") != worker_before:
                http_bad.append(f"{name} (batch): the edge's worker changed {worker_before} -> {res[1].get('worker')}")
    a.check("through the edge: every malformed frame is HTTP 200 with a typed error, a batch keeps the others' "
            "values, the edge's worker is never replaced", not http_bad, http_bad)


_AWKWARD = [("surrogate_value", 0), ("surrogate_key", 0), ("surrogate_error", 0), ("surrogate_print", 0),
            ("nested", 900), ("nested", 960), ("nested", 985), ("nested_error", 900), ("nan", 0)]


@fncase("awkward_values",
        attack="calls return (not forge) values a JSON writer may refuse: lone surrogates in a value, a key and an "
               "exception's message, surrogate bytes on stdout, lists nested 900-985 deep (just under the call's own "
               "recursion limit, over the pool's or the edge's once they sit deeper in the stack), NaN and Infinity; "
               "alone, in a pool batch and through the edge's routes",
        asserts="each is its own call's value or typed failure; a batch keeps the other calls' values; the routes "
                "answer 200",
        defence="what the pool decodes and the edge encodes cannot fail on a call's data (or fails that call alone, "
                "typed)", uses_edge=True)
async def _awkward(a: FnAttack) -> None:
    bad: list[str] = []
    for kind, depth in _AWKWARD:
        out = await a.call(SRC["awkward_values"], kind, depth, timeout=15)
        if not (isinstance(out, FnResult) or _typed_failure(out)):
            bad.append(f"{kind} {depth}: {_desc(out)}")
        outs = await a.many([FnCall(SRC["awkward_values"], (kind, depth)), FnCall(_NORMAL, (1,))], timeout=15)
        if not isinstance(outs, list) or _value(outs[1]) != ["ok", 1]:
            bad.append(f"{kind} {depth} in a batch: {_desc(outs) if not isinstance(outs, list) else _desc(outs[1])}")
    a.check("each awkward value is its own call's outcome, alone and in a batch", not bad, bad)
    if a.edge is None:
        return
    http_bad: list[str] = []
    for kind, depth in _AWKWARD:
        status, doc = await a.http("/v1/fncall", {"image": _image_name(a.image), "source": SRC["awkward_values"],
                                                  "args": [kind, depth], "timeout": 15})
        if status != 200 or not isinstance(doc, dict):
            http_bad.append(f"{kind} {depth}: HTTP {status} {str(doc)[:200]}")
        status, doc = await a.http("/v1/fncall/batch", {
            "image": _image_name(a.image), "timeout": 15,
            "calls": [{"source": SRC["awkward_values"], "args": [kind, depth]}, {"source": _NORMAL, "args": [1]}]})
        res = doc.get("results") if isinstance(doc, dict) else None
        if status != 200 or not isinstance(res, list) or len(res) != 2 or res[1].get("value") != ["ok", 1]:
            http_bad.append(f"{kind} {depth} (batch): HTTP {status} {str(doc)[:200]}")
    a.check("through the edge: HTTP 200 for each, a batch keeps the other call's value", not http_bad, http_bad)
    sdk_bad: list[str] = []
    for kind, depth in _AWKWARD:
        outs = await a.sdk_many([FnCall(SRC["awkward_values"], (kind, depth)), FnCall(_NORMAL, (1,))], timeout=15)
        if not isinstance(outs, list) or _value(outs[1]) != ["ok", 1]:
            sdk_bad.append(f"{kind} {depth}: {_desc(outs) if not isinstance(outs, list) else _desc(outs[1])}")
    a.check("through the SDK's fncall_many: the other call of each batch gets its value", not sdk_bad, sdk_bad)


def _image_name(image: ImageRef) -> Any:
    return image.model_dump(mode="json", exclude_none=True)


@fncase("result_pipe_games",
        attack="a call closes its result pipe and returns; dups it over stdout and prints; opens it again for "
               "reading through /proc/self/fd and takes its own frame back; shrinks it to one page and returns "
               "900 KiB; makes it non-blocking and floods it",
        asserts="each is that call's own outcome (a value or a typed failure, never FnCallWorkerLost or another "
                "exception)",
        defence="a call's pipes are its own; the supervisor reads them as untrusted data")
async def _pipe_games(a: FnAttack) -> None:
    bad: list[str] = []
    for name in ("pipe_close_result", "pipe_result_as_stdout", "pipe_read_own_result", "pipe_tiny_result",
                 "pipe_nonblocking_flood"):
        out = await a.call(SRC[name], timeout=15)
        ok = _typed_failure(out) or isinstance(out, FnResult)
        if name == "pipe_tiny_result":
            ok = isinstance(out, FnResult) and out.value == "r" * (900 * 1024)
        if not ok:
            bad.append(f"{name}: {_desc(out)}")
    a.check("every pipe game ends as its own call's outcome", not bad, bad)


@fncase("stdout_after_result",
        attack="a call forges its result, then it and a setsid child keep writing a marker to stdout and stderr "
               "for 2 s; calls run right after on every slot",
        asserts="no later call's stdout or stderr holds the marker; the forger is answered and its processes die",
        defence="each call has its own output pipes, made per call; a forger is killed 0.5 s after its answer")
async def _stdout_after(a: FnAttack) -> None:
    tag = secrets.token_hex(6)
    atk_task = asyncio.ensure_future(a.call(SRC["stdout_after_result"], tag, 2.0, timeout=15))
    later: list[Any] = []
    for round_ in range(4):
        outs = await a.many([FnCall(SRC["print_and_return"], (round_ * 10 + i,)) for i in range(4)], timeout=15)
        later += outs if isinstance(outs, list) else [outs]
        await asyncio.sleep(0.3)
    atk = await atk_task
    leaked = [_desc(o) for o in later if not isinstance(o, FnResult) or tag in o.stdout or tag in o.stderr]
    a.check(f"no later call's output holds the forger's marker ({len(later)} calls)", not leaked, leaked[:4])
    a.check("the forger got an outcome of its own", isinstance(atk, FnResult) or _typed_failure(atk), _desc(atk))


# -- the worker's disk -------------------------------------------------------------


async def _later_calls_that_leave_files(a: FnAttack, n: int, *, full_ok: bool = False) -> list[str]:
    """``n`` calls one after another, each leaving a file (so each slot's scratch dir goes
    through the cleaner); stops at the first that fails. With ``full_ok`` a call that ran and
    found the (shared) disk still full counts as run."""
    for i in range(n):
        out = await a.call(SRC["leave_file"], i, timeout=15)
        if _value(out, [None])[0] == i:
            continue
        if full_ok and isinstance(out, FnCallError) and out.fields.get("exc_type") == "OSError" and \
                ("quota" in str(out) or "No space" in str(out)):
            continue
        return [f"call {i} of {n}: {_desc(out)}"]
    return []


async def _space_comes_back(a: FnAttack, n: int = 8 * MiB, timeout: float = 60.0) -> None:
    """A call can write ``n`` bytes again within ``timeout`` (the attack's files are removed, and
    btrfs gives quota back at its next commit)."""
    deadline = time.monotonic() + timeout
    again: Any = None
    while time.monotonic() < deadline:
        again = await a.call("def main(n):\n    open('x', 'wb').write(b'1' * n)\n    return n", n, timeout=15)
        if _value(again) == n:
            break
        await asyncio.sleep(0.5)
    a.check(f"space comes back: a later call writes {n >> 20} MiB", _value(again) == n, _desc(again))


@fncase("disk_quota_fill",
        attack="a call fills the worker's disk quota from its scratch dir (files until EDQUOT/ENOSPC, then "
               "directories) and holds it for 3 s while the neighbours' calls end and their slots are re-forked",
        asserts="the fill stops at the quota; later calls (that leave files) run and succeed; space comes back",
        defence="a full disk fails only what needs the disk: the slot's pre-fork (its scratch dir) is retried, "
                "never fatal to the worker")
async def _disk_fill(a: FnAttack) -> None:
    w = a.worker()
    quota = w.cfg.resources.disk if w is not None else 64 * MiB
    atk = await a.call(SRC["disk_fill"], 2 * quota, 3.0, timeout=60)
    n = _value(atk, [0, "", 0])
    a.check("the fill stopped at the worker's quota", isinstance(atk, FnResult) and n[0] <= quota + 16 * MiB and n[1],
            _desc(atk))
    bad = await _later_calls_that_leave_files(a, 10, full_ok=True)
    a.check("10 later calls that leave files run (the disk may still be full for them)", not bad, bad)
    await _space_comes_back(a)


@fncase("disk_quota_held",
        attack="a call fills the worker's disk quota and holds it for 20 s, longer than its neighbours' timeout (15 s), "
               "while neighbour calls that write nothing keep coming",
        asserts="the neighbours, which need no disk, keep running and succeeding",
        defence="a slot's next process needs no new space: a slot whose scratch directory cannot be made takes one "
                "of the spares made ahead, and a spare its call left empty goes back to the spares (root's, 0700, "
                "checked empty), so the spares last while the disk is held")
async def _disk_held(a: FnAttack) -> None:
    w = a.worker()
    quota = w.cfg.resources.disk if w is not None else 64 * MiB
    atk = await a.call(SRC["disk_fill"], 2 * quota, 20.0, timeout=60)
    a.check("the fill ran and held", isinstance(atk, FnResult), _desc(atk))
    await _space_comes_back(a)


@fncase("inode_exhaustion",
        attack="a call creates empty files in its scratch dir until the filesystem refuses (or 200,000), holds them "
               "for 2 s while neighbours' slots are re-forked, and leaves them",
        asserts="later calls (that leave files) run and succeed; the files are all removed",
        defence="the scratch dir is removed in the cleaner, whatever it holds; a failing pre-fork is retried",
        heavy=True)
async def _inodes(a: FnAttack) -> None:
    atk = await a.call(SRC["inode_fill"], 200_000, 2.0, timeout=120)
    a.check(f"the attack ran ({_value(atk, ['?'])[0]} files)", isinstance(atk, FnResult), _desc(atk))
    bad = await _later_calls_that_leave_files(a, 10, full_ok=True)
    a.check("10 later calls that leave files run (the disk may still be full for them)", not bad, bad)
    await _space_comes_back(a)


@fncase("many_files_left",
        attack="a call leaves 20,000 files and 500 directories of 10 files in its scratch dir",
        asserts="later calls (that leave files) run and succeed; the files are all removed",
        defence="the scratch dir is removed in the cleaner, off the supervisor's loop")
async def _many_files(a: FnAttack) -> None:
    atk = await a.call(SRC["many_files"], 20_000, 500, timeout=60)
    a.check("the attack ran", isinstance(atk, FnResult), _desc(atk))
    bad = await _later_calls_that_leave_files(a, 10)
    a.check("10 later calls that leave files run and succeed", not bad, bad)


def _deep(depth: int) -> FnCaseFn:
    async def run(a: FnAttack) -> None:
        atk = await a.call(SRC["deep_tree"], depth, timeout=60)
        a.check(f"the attack ran ({depth} levels)", _value(atk) == depth, _desc(atk))
        bad = await _later_calls_that_leave_files(a, 2 * a.slots)
        a.check(f"{2 * a.slots} later calls that leave files run and succeed (none waits for a slot forever)", not bad,
                bad)

    return run


fncase("deep_tree_1000",
       attack="a call leaves a directory tree 1,000 levels deep in its scratch dir",
       asserts="the cleaner survives: twice as many later calls as slots, each leaving a file, run and succeed; "
               "the tree is removed",
       defence="removal that does not recurse on the stack (or survives its own failure); a dead cleaner is "
               "detected and the worker replaced")(_deep(1000))
fncase("deep_tree_5000",
       attack="a call leaves a directory tree 5,000 levels deep in its scratch dir",
       asserts="as deep_tree_1000", defence="as deep_tree_1000", heavy=True)(_deep(5000))


@fncase("scratch_link_games",
        attack="a call fills its scratch dir with symlinks to /, /etc, the worker program and /fncall, symlink loops, "
               "'..', hard links to root's files, a FIFO, a unix socket, odd names, a setuid file, directories and "
               "files of mode 000 and finally its scratch dir itself at mode 000",
        asserts="the worker program, /etc/passwd and /fncall are unchanged; later calls (that leave files) succeed; "
                "the scratch dir is removed",
        defence="the cleaner removes without following links (fd-relative, as root); the uid cannot write outside")
async def _links(a: FnAttack) -> None:
    view = a.view()
    paths = ("/opt/dsec-fncall/worker.py", "/etc/passwd", "/usr/bin/python3")
    before = {p: view.digest(p) for p in paths} if view else {}
    modes = {p: view.mode(p) for p in ("/fncall", "/etc", "/", "/opt/dsec-fncall")} if view else {}
    atk = await a.call(SRC["link_games"], timeout=30)
    a.check("the attack ran", isinstance(atk, FnResult), _desc(atk))
    bad = await _later_calls_that_leave_files(a, 10)
    a.check("10 later calls that leave files run and succeed", not bad, bad)
    await asyncio.sleep(1.0)
    view = a.view()
    after = {p: view.digest(p) for p in paths} if view else {}
    after_modes = {p: view.mode(p) for p in modes} if view else {}
    a.check("the worker program, /etc/passwd and python3 are unchanged", before == after, f"{before} -> {after}")
    a.check("/fncall, /etc, / keep their modes and owners", modes == after_modes, f"{modes} -> {after_modes}")


@fncase("cleanup_race",
        attack="a call opens its scratch dir to everyone (chmod 0777) and hands its path to a concurrent call, which "
               "keeps making directories of files (then mode 000) in it for 6 s, and a directory that turns into a "
               "symbolic link to / and back, racing the cleaner after the first call ends",
        asserts="the first call's slot serves later calls; the scratch dir is removed; nothing of either is left",
        defence="a scratch dir's removal cannot be kept busy forever by another uid (e.g. the scratch dir made "
                "unreachable before it is removed, or no other uid can enter it)")
async def _cleanup_race(a: FnAttack) -> None:
    tag = f"dsec-race-{secrets.token_hex(4)}"
    racer = asyncio.ensure_future(a.call(SRC["scratch_racer"], tag, 6.0, timeout=20))
    await asyncio.sleep(0.5)
    opened = await a.call(SRC["scratch_opened_up"], tag, timeout=15)
    bad = await _later_calls_that_leave_files(a, 2 * a.slots)
    raced = await racer
    a.check("the attack ran", isinstance(opened, FnResult) and isinstance(raced, FnResult),
            f"{_desc(opened)}; racer {_desc(raced)}")
    a.check(f"{2 * a.slots} later calls that leave files run and succeed", not bad, bad)


@fncase("cleaner_climbs_out",
        attack="a call builds mnt/srv/<its partner's scratch name>/x/<400 levels of 50 files> with the dirs on the way "
               "open to others, and 'mnt/opt' made before 'mnt/srv'; the partner, a concurrent call, waits until the "
               "cleaner is inside x's chain and moves x into its own scratch dir: a cleaner that climbs back with '..' "
               "comes out in the partner's scratch dir, then /fncall, then /, and goes on there with the names it "
               "listed before (rmdir /srv, clear /opt, rmdir /mnt)",
        asserts="nothing outside the first call's scratch dir is removed (/srv, /mnt, /opt/dsec-fncall/worker.py, the "
                "partner's own scratch dir all stay)",
        defence="the cleaner never resolves '..' (it keeps each parent's fd open) or checks that '..' is the directory "
                "it came from (same device and inode), and no other uid can write in a scratch dir being removed")
async def _climb(a: FnAttack) -> None:
    tag = f"dsec-climb-{secrets.token_hex(4)}"
    view = a.view()
    paths = ("/opt/dsec-fncall/worker.py", "/srv", "/mnt", "/opt")
    before = {p: view.mode(p) for p in paths} if view else {}
    digest = view.digest(paths[0]) if view else ""
    racer = asyncio.ensure_future(a.call(SRC["climb_racer"], tag, 10.0, timeout=30))
    await asyncio.sleep(0.5)
    setup = await a.call(SRC["climb_setup"], tag, 400, 50, ["opt"], timeout=30)
    raced = await racer
    await asyncio.sleep(1.0)
    view = a.view()
    after = {p: view.mode(p) for p in paths} if view else {}
    a.check("the attack ran (the partner moved x while the cleaner was inside it)",
            isinstance(setup, FnResult) and _value(raced, [""])[0] == "moved", f"{_desc(setup)}; {_desc(raced)}")
    a.check("the partner's own scratch dir was not removed by another call's cleanup",
            _value(raced, [None, True])[1] is True, _desc(raced))
    damaged = before != after or (view is not None and view.digest(paths[0]) != digest)
    a.check("nothing outside the scratch dir was removed (/srv, /mnt, /opt and the worker program stay)", not damaged,
            f"{before} -> {after}")
    if damaged:  # the worker's own files are gone: the cases after this one get a new worker
        a.tainted = True


# -- memory --------------------------------------------------------------------------

_MEM_LIMIT = 32 * MiB
MEMORY_SLACK = 0
"""Bytes over its ``memory`` a memory case lets a call hold (0: the strict check)."""


@fncase("memory_beyond_limit",
        attack="calls with memory=32 MiB hold 384 MiB in memfds (write, not map), in pipe buffers (F_SETPIPE_SZ), "
               "in unix socket buffers, and in any writable tmpfs (/dev/shm, /run...)",
        asserts="no call holds more than its 32 MiB in any of these ways (each reports what it held as it goes; "
                "a kill is fine)",
        defence="`memory` is a real bound on a call (e.g. a memory cgroup per call, kernel memory included), "
                "or documented as the mapping limit it is (then this case's expectation changes)")
async def _memory(a: FnAttack) -> None:
    target = 384 * MiB
    for name in ("mem_memfd", "mem_pipes", "mem_sockets", "mem_tmpfs"):
        out = await a.call(SRC[name], target, memory=_MEM_LIMIT, timeout=60)
        held = _held(out)
        a.check(f"{name.removeprefix('mem_')}: held at most memory={_MEM_LIMIT >> 20} MiB", held <= _MEM_LIMIT + MEMORY_SLACK,
                f"held {held >> 20} MiB; outcome {_desc(out)}")


@fncase("memory_hog_kills_neighbours",
        attack="two calls, each asking for 3/4 of the worker's memory (each under its own limit, together over the "
               "worker's), fill memfds also held by a tiny program each started (`sleep`): the kernel's OOM kill of "
               "a big call process frees nothing, and the next victims by size are the neighbours' calls and the "
               "slots' waiting processes",
        asserts="no neighbour call fails; the worker is not lost",
        defence="calls' memory limits that together fit the worker's (or a worker-level OOM that kills only the "
                "calls over their share)",
        heavy=True)
async def _hog(a: FnAttack) -> None:
    w = a.worker()
    limit = w.cfg.resources.memory if w is not None else 1024 * MiB
    each = min(a.pool.config.max_call_memory, limit * 3 // 4)
    outs = await a.many([FnCall(SRC["mem_hog_shielded"], (int(limit * 0.7),)) for _ in range(2)], memory=each,
                        timeout=60)
    got = outs if isinstance(outs, list) else [outs]
    held = ", ".join(f"{_held(o) >> 20} MiB ({type(o).__name__})" for o in got)
    a.check(f"the hogs ended as values or typed failures (held {held}, asked {each >> 20} MiB each)",
            all(isinstance(o, FnResult) or _typed_failure(o) for o in got), [_desc(o) for o in got])


@fncase("memory_charge_outlives_call",
        attack="a call fills a 40 MiB memfd (charged to its slot) and passes it over an abstract socket to a "
               "concurrent call that keeps it for 8 s; meanwhile later calls on every slot, memory=32 MiB, each "
               "touch 16 MiB",
        asserts="every later call gets its own memory (none fails with FnCallOOM because of what another call "
                "charged to its slot)",
        defence="a call's memory charge ends with the call (a fresh cgroup per call, or charges moved/refused)")
async def _charge(a: FnAttack) -> None:
    tag = f"dsec-keep-{secrets.token_hex(4)}"
    keeper = asyncio.ensure_future(a.call(SRC["fd_keeper"], tag, 8.0, timeout=20))
    await asyncio.sleep(0.5)
    giver = await a.call(SRC["fd_giver"], tag, 40 * MiB, memory=96 * MiB, timeout=15)
    victims: list[Any] = []
    for _ in range(3):
        outs = await a.many([FnCall(SRC["alloc_victim"], (16 * MiB,)) for _ in range(4)], memory=32 * MiB, timeout=15)
        victims += outs if isinstance(outs, list) else [outs]
    kept = await keeper
    a.check("the attack ran (the memfd was passed on and kept)", isinstance(giver, FnResult)
            and _value(kept, [None])[0] == 40 * MiB, f"giver {_desc(giver)}; keeper {_desc(kept)}")
    uid = _value(giver, [None])[0]
    bad = [_desc(o) for o in victims if not (isinstance(o, FnResult) and o.value[1] == 16 * MiB)]
    on_slot = sum(1 for o in victims if isinstance(o, FnResult) and o.value[0] == uid)
    a.check(f"every later call got its 16 MiB ({len(victims)} calls, {on_slot} succeeded on the giver's uid)", not bad,
            bad[:4])


# -- exceptions and the worker's messages ------------------------------------------------


@fncase("exception_message_large",
        attack="calls raise exceptions whose message is over half the output cap (64 KiB): 40 KiB of ASCII, 200 KiB, "
               "30,000 'é' (6 bytes each once JSON-escaped), and a chained pair of 40 KiB messages",
        asserts="each is FnCallError with its own exc_type and a traceback of the call's frames (the message may be "
                "cut), never FnCallOutputTooLarge for stdout or stderr",
        defence="an exception's report is bounded by cutting the message and the traceback, not by killing the call")
async def _big_exc(a: FnAttack) -> None:
    cap = 64 * 1024
    for label, src, args, exc_type in (
            ("40 KiB", SRC["big_exception"], (40 * 1024, "x"), "ValueError"),
            ("200 KiB", SRC["big_exception"], (200 * 1024, "y"), "ValueError"),
            ("30,000 é", SRC["big_exception"], (30_000, "é"), "ValueError"),
            ("chained 2 x 40 KiB", SRC["big_exception_chain"], (40 * 1024,), "RuntimeError")):
        out = await a.call(src, *args, output_cap=cap, timeout=15)
        ok = (isinstance(out, FnCallError) and out.fields.get("exc_type") == exc_type
              and "<fncall>" in str(out.fields.get("traceback", "")))
        a.check(f"{label}: FnCallError {exc_type} with the call's traceback", ok,
                f"{_desc(out)} fields {({k: str(v)[:80] for k, v in getattr(out, 'fields', {}).items()})}")


@fncase("odd_exceptions",
        attack="calls raise SystemExit, KeyboardInterrupt, GeneratorExit, an exception whose __str__ raises, returns "
               "8 MiB or a non-string, a RecursionError, and return a circular value, an object whose tolist() "
               "returns itself, a list nested 100,000 deep",
        asserts="each is that call's own typed outcome",
        defence="the call path catches BaseException and bounds what it reports")
async def _odd_exc(a: FnAttack) -> None:
    bad: list[str] = []
    for kind in ("SystemExit", "KeyboardInterrupt", "GeneratorExit", "BadStr", "HugeStr", "NotStr", "Recursion",
                 "CircularValue", "BadToList", "NestedValue"):
        out = await a.call(SRC["odd_exceptions"], kind, timeout=20)
        if not _typed_failure(out):
            bad.append(f"{kind}: {_desc(out)}")
    a.check("every odd exception or value is its own call's typed failure", not bad, bad)


@fncase("output_amplification",
        attack="calls with the largest output cap (as many as the worker's memory / 16 caps, at least one, below the "
               "concurrency) write it whole of 0xff bytes to stdout and to stderr (each byte a 6-byte \\ufffd escape "
               "once in JSON) and return a string of \\x01 as large as the cap allows",
        asserts="the worker is not lost and no neighbour call fails; the host process's peak memory grows by less "
                "than 16 x the cap",
        defence="output carried as bytes (or escaped once, bounded), not multiplied in the supervisor and the pool",
        heavy=True)
async def _amplify(a: FnAttack) -> None:
    cap = a.pool.config.max_output_cap
    w = a.worker()
    n = 1 if w is None else max(1, min(w.cfg.concurrency - 1, w.cfg.resources.memory // (16 * cap)))
    hwm0 = _reset_peak_rss()
    outs = await a.many([FnCall(SRC["output_amplify"], (cap,)) for _ in range(n)], output_cap=cap, timeout=60)
    grew = _peak_rss() - hwm0
    got = outs if isinstance(outs, list) else [outs]
    a.check(f"the {n} call(s) got their own outcomes", all(isinstance(o, FnResult) or _typed_failure(o) for o in got),
            [_desc(o) for o in got])
    a.check(f"the host process's peak memory grew by less than 16 x the cap ({cap >> 20} MiB) a call", grew < 16 * cap * n,
            f"{grew >> 20} MiB")


def _reset_peak_rss() -> int:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _peak_rss()


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


_LOG_MARKERS = ("its log", "Traceback", "/fncall/", "dsec-fncall[")


def _leaks_log(exc: BaseException) -> list[str]:
    text = str(exc) + " " + " ".join(str(v) for v in getattr(exc, "fields", {}).values())
    found = [m for m in _LOG_MARKERS if m in text]
    if "worker None" in text:
        found.append("worker None")
    return found


@fncase("lost_worker_messages",
        attack="(from the host, on a pool of its own) a supervisor is stopped (SIGSTOP) during a call; another writes "
               "a traceback with a scratch path into its log and is then killed (SIGKILL) during a call",
        asserts="the unresponsive worker's FnCallWorkerLost names it (not 'worker None'); the killed worker's "
                "carries its reason but none of its log",
        defence="the pool builds the message before it forgets the worker, and keeps the log for operators")
async def _lost_messages(a: FnAttack) -> None:
    from dsec.backends.fncall.config import FnCallConfig, FnCallImage
    from dsec.backends.fncall.pool import FnCallPool

    cfg = FnCallConfig(images=(FnCallImage(image=a.image, concurrency=1, spare=0),), answer_grace_s=0.5,
                       call_timeout_s=5)
    p = FnCallPool(cfg, a.pool.host, name=f"{a.pool.name}-lost"[:40])
    await p.start()
    try:
        (w,) = p.workers()
        sid, sup = w.sandbox_id, w.supervisor_pid or 0
        os.kill(sup, signal.SIGSTOP)
        try:
            try:
                await p.call(a.image, "1", timeout=0.5)
                out: Any = None
            except Exception as exc:
                out = exc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(sup, signal.SIGCONT)
        a.check("an unresponsive worker's FnCallWorkerLost names it",
                isinstance(out, FnCallWorkerLost) and sid is not None and sid in str(out)
                and out.fields.get("worker") == sid and "None" not in str(out), f"worker {sid}: {_desc(out)}")
        r = await p.call(a.image, "'back'", timeout=30)
        (w,) = p.workers()
        sid, sup = w.sandbox_id, w.supervisor_pid or 0
        marker = secrets.token_hex(6)
        with open(f"/proc/{sup}/fd/2", "w") as log:  # the supervisor's stderr: what a crash would leave there
            log.write(f"Traceback (most recent call last):\n  File \"/fncall/0-{marker}/x.py\", line 1\n"
                      f"struct.error: LOG-{marker}\n")
        await asyncio.sleep(0.3)
        task = asyncio.ensure_future(p.call(a.image, "import time\ntime.sleep(20)", timeout=30))
        await asyncio.sleep(0.5)
        os.kill(sup, signal.SIGKILL)
        try:
            await task
            out = None
        except Exception as exc:
            out = exc
        await p.call(a.image, "'back again'", timeout=30)  # the replacement is up: close() races nothing
        leaks = _leaks_log(out) if out is not None else []
        a.check(f"a killed worker's FnCallWorkerLost carries no log (after {_desc(r)})",
                isinstance(out, FnCallWorkerLost) and not leaks and marker not in str(out)
                and marker not in json.dumps(getattr(out, "fields", {}), default=str), f"{leaks}: {_desc(out)}")
    finally:
        await p.close()
    left = [sid for sid, rec in a.pool.host.sandboxes.items()
            if dict(getattr(getattr(rec, "spec", None), "labels", None) or {}).get("dsec.fncall.pool") == p.name]
    a.check("the pool of its own left no worker sandbox", not left, left)


# -- channels between calls -------------------------------------------------------------


@fncase("listeners_left_behind",
        attack="a call leaves a setsid'd, double-forked process listening on an abstract unix socket, a loopback TCP "
               "port and a UDP port, and a listening socket whose only reference is in flight on itself (SCM_RIGHTS "
               "cycle); a later call connects to each and lists /proc/net/unix",
        asserts="nothing answers a later call; the names are gone",
        defence="every process of the call's uid is killed before it is answered; in-flight sockets are collected")
async def _listeners(a: FnAttack) -> None:
    tag = f"dsec-left-{secrets.token_hex(4)}"
    atk = await a.call(SRC["left_listeners"], tag, 30.0, timeout=20)
    ports = _value(atk, [1, 1])
    await asyncio.sleep(0.2)
    seen = await a.call(SRC["probe_listeners"], tag, *ports, timeout=20)
    v = _value(seen, {})
    a.check("the attack ran", isinstance(atk, FnResult), _desc(atk))
    for k in ("abstract", "tcp", "udp", "inflight"):
        a.check(f"nothing answers a later call on the {k} listener", isinstance(seen, FnResult) and v.get(k) is None,
                _desc(seen))
    a.check("no socket name of the call is left in /proc/net/unix", isinstance(seen, FnResult) and not v.get("unix_names"),
            _desc(seen))


@fncase("tcp_time_wait",
        attack="a call opens a loopback connection and closes it first (TIME_WAIT for 60 s); a later call reads "
               "/proc/net/tcp and tcp6 for its port",
        asserts="the later call does not see the earlier call's connection (a channel across time)",
        defence="closed, or documented as shared (docs/FNCALL.md): then this case's expectation changes")
async def _time_wait(a: FnAttack) -> None:
    atk = await a.call(SRC["time_wait"], timeout=15)
    port = _value(atk, 0)
    seen = await a.call(SRC["read_net_tcp"], port, timeout=15)
    a.check("the attack ran", isinstance(atk, FnResult), _desc(atk))
    a.check("a later call sees none of the earlier call's connections in /proc/net/tcp",
            isinstance(seen, FnResult) and not seen.value, _desc(seen))


@fncase("net_counters_across_time",
        attack="a call opens 137 loopback TCP connections and sends 137 UDP datagrams; calls before and after it read "
               "the network namespace's counters (/proc/net/snmp Tcp/Udp, /proc/net/dev lo) and its socket tables",
        asserts="a later call finds none of the earlier call's sockets (/proc/net/tcp, tcp6, udp, udp6); the "
                "namespace's aggregate counters move by what the earlier call did, the channel across time "
                "docs/FNCALL.md names as shared",
        defence="sockets end with their call (no TIME_WAIT kept: the worker's tcp_max_tw_buckets is 0); the "
                "counters are documented, not closed: a network namespace per call would reset them, at +6 to "
                "9 ms of CPU per call on this kernel (measured: create and destroy), twice a call's own cost",
        documented="the network namespace's counters (/proc/net/snmp, /proc/net/dev) are the worker's, read by "
                   "every call: how many connections and datagrams earlier calls made (docs/FNCALL.md, shared)")
async def _net_counters(a: FnAttack) -> None:
    k = 137
    before = await a.call(SRC["net_counters"], timeout=15)
    atk = await a.call(SRC["net_signal"], k, timeout=30)
    got = _value(atk, [0, 0, 0])
    seen = await a.call(SRC["read_net_tcp"], *got[1:], timeout=15)
    after = await a.call(SRC["net_counters"], timeout=15)
    b, c = _value(before, {}), _value(after, {})
    diffs = {n: c[n] - b[n] for n in ("Tcp.ActiveOpens", "Tcp.PassiveOpens", "Udp.OutDatagrams", "Udp.InDatagrams")
             if n in b and n in c}
    a.check("the attack ran", isinstance(got, list) and got[0] == k, _desc(atk))
    a.check("a later call finds none of the earlier call's sockets (ports in /proc/net/tcp, tcp6, udp, udp6)",
            isinstance(seen, FnResult) and not seen.value, _desc(seen))
    a.note(f"documented channel: the counters moved by {diffs} (the earlier call's {k})")


@fncase("concurrent_proc_peek",
        attack="while a victim call runs a program with a secret in its argv and environment and a secret file in "
               "its scratch dir, a concurrent call (another uid) reads every process's cmdline, environ, maps, cwd, "
               "fd and mem and the file under its cwd",
        asserts="the concurrent call learns nothing of the secret; environ, maps, cwd, fd and mem of other calls are "
                "refused",
        defence="one uid per slot (ptrace access checks); /proc of other uids' processes hidden (hidepid) or a "
                "call's argv documented as visible")
async def _peek(a: FnAttack) -> None:
    secret = f"PEEK-{secrets.token_hex(8)}"
    victim = asyncio.ensure_future(a.call(SRC["peek_victim"], secret, 3.0, timeout=20))
    await asyncio.sleep(0.5)
    spy = await a.call(SRC["peek_attacker"], 2.0, timeout=20)
    v = await victim
    got = _value(spy, {})
    a.check("the victim returned its value", isinstance(v, FnResult), _desc(v))
    a.check("the peeking call ran (it saw other calls' processes, or /proc hid them: hidepid)", isinstance(spy, FnResult),
            _desc(spy))
    for k in ("environ", "maps", "cwd", "fd", "mem", "files"):
        a.check(f"another call's {k} is refused", not got.get(k), str(got.get(k))[:300])
    a.check("the secret is in nothing the concurrent call read (argv of the victim's program included)",
            secret not in json.dumps(got), [c for c in got.get("cmdline", []) if secret in c][:2])


@fncase("signal_concurrent_calls",
        attack="a call sends SIGSTOP, SIGKILL (kill and pidfd_send_signal) to every process it can see, for 2 s, "
               "while a victim call sleeps; also kill(-1) and kill(0) SIGCONT",
        asserts="no signal reached any process but its own; the victim returns its value",
        defence="one uid per slot: the kernel refuses signals to other uids")
async def _signals(a: FnAttack) -> None:
    salt = secrets.token_hex(4)
    victim = asyncio.ensure_future(a.call(SRC["signal_victim"], 2.5, salt, timeout=20))
    await asyncio.sleep(0.3)
    atk = await a.call(SRC["signal_everyone"], 2.0, timeout=20)
    v = await victim
    a.check("no signal from the call reached another process", isinstance(atk, FnResult) and not atk.value,
            _desc(atk))
    a.check("the concurrent victim returned its value", isinstance(v, FnResult) and v.value[1] == salt, _desc(v))


@fncase("attack_the_machinery",
        attack="a call ptraces (ATTACH, SEIZE) the zygote, the supervisor and the sandbox's init; opens their mem, "
               "environ, maps, stack, oom_score_adj; lists their cwd, root, fd; sends them SIGSTOP and SIGKILL; "
               "and lists its own open fds",
        asserts="every one of those is refused; the call holds no fd but its stdio and its own result pipe",
        defence="the machinery runs as root, the call as its own uid, non-dumpable, no_new_privs, no CAP_SYS_PTRACE")
async def _machinery(a: FnAttack) -> None:
    out = await a.call(SRC["machinery"], timeout=20)
    done, targets, fds = _value(out, [["?"], [], []])
    a.check("the zygote, supervisor and init were all targeted (the supervisor by every low pid when /proc hides "
            "it)", {"init", "zygote"} <= set(targets) and ("supervisor" in targets
                                                          or any(str(t).startswith("guess-") for t in targets)),
            _desc(out))
    a.check("nothing of the machinery could be traced, read, listed or signalled", not done, done)
    extra = [f for f in fds if f[0] > 2 and not str(f[1]).startswith("pipe:")]
    a.check("the call holds no fd but its stdio and pipes", len(fds) <= 6 and not extra, fds)


@fncase("ipc_and_keyrings",
        attack="a call makes SysV shared memory, semaphores and message queues, a POSIX message queue, and keys "
               "(add_key, keyctl, request_key), by libc and by raw and x32 syscall numbers",
        asserts="every one is refused",
        defence="the zygote's IPC seccomp filter (x32 numbers too) and the sandbox's filter (keyrings)")
async def _ipc(a: FnAttack) -> None:
    out = await a.call(SRC["ipc_objects"], timeout=15)
    a.check("no IPC object or key was made", isinstance(out, FnResult) and not out.value, _desc(out))


@fncase("write_outside_scratch",
        attack="a call walks the whole filesystem looking for a directory it can create a file in or a file it can "
               "open for writing, tries /tmp, /var/tmp, /dev/shm, /run, /fncall, site-packages, the worker program, "
               "and chmod/chown/utime on root's files, and lists /fncall",
        asserts="nothing outside its own scratch dir is writable or changeable; /fncall cannot be listed",
        defence="lockdown at start (no write for 'other'); /fncall root-owned 0711")
async def _writable(a: FnAttack) -> None:
    out = await a.call(SRC["find_writable"], timeout=60)
    wrote, dirs = _value(out, [["?"], 0])
    a.check(f"nothing outside the scratch dir is writable ({dirs} directories walked)", not wrote and dirs > 100,
            _desc(out))


@fncase("globals_and_environment",
        attack="a call sets environment variables, a builtin, patches json.dumps and numpy, seeds numpy's global "
               "generator and edits sys.path and sys.modules; later calls on every slot look for each",
        asserts="no later call sees any of it",
        defence="each call is a fresh fork of a zygote that never runs a call")
async def _globals(a: FnAttack) -> None:
    tag = secrets.token_hex(4)
    await a.call(SRC["env_globals_set"], tag, timeout=15)
    outs = await a.many([FnCall(SRC["env_globals_check"], (tag,)) for _ in range(2 * a.slots)], timeout=15)
    seen = [_desc(o) for o in (outs if isinstance(outs, list) else [outs]) if _value(o) != []]
    a.check("no later call sees a global, patch, seed or variable of the earlier one", not seen, seen[:4])


@fncase("limits_and_priority",
        attack="a call raises its rlimits (NPROC, NOFILE, FSIZE, AS, CPU, CORE, MSGQUEUE, MEMLOCK, RTPRIO, NICE, "
               "STACK) to unlimited, renices itself to -5, asks for SCHED_FIFO and real-time I/O priority, and "
               "lowers its oom_score_adj",
        asserts="every raise is refused; later calls have the configured limits",
        defence="hard rlimits set before the uid change; no CAP_SYS_RESOURCE, CAP_SYS_NICE")
async def _limits(a: FnAttack) -> None:
    out = await a.call(SRC["limits_raise"], timeout=15)
    a.check("no limit was raised, no priority gained", isinstance(out, FnResult) and not out.value, _desc(out))
    later = await a.call(SRC["limits_check"], timeout=15)
    cfg = a.pool.config
    want = [[cfg.call_processes] * 2, [cfg.call_nofile] * 2, [cfg.call_file_size] * 2]
    a.check("a later call has the configured NPROC, NOFILE and FSIZE", _value(later) == want, f"{_desc(later)} != {want}")


@fncase("setuid_attempts",
        attack="a call tries setuid/setresuid/seteuid to root and to the neighbouring slots' uids, setgid(0), "
               "setgroups([0]), and checks its no_new_privs and capability sets",
        asserts="every change is refused; no_new_privs is set; it has no capabilities",
        defence="an unprivileged uid with no capabilities and no_new_privs (setuid files grant nothing)")
async def _setuid(a: FnAttack) -> None:
    out = await a.call(SRC["setuid_tries"], timeout=15)
    a.check("no uid or group change, no_new_privs set, no capabilities", isinstance(out, FnResult) and not out.value,
            _desc(out))


@fncase("process_tricks",
        attack="a call makes itself a subreaper and leaves: a sleeper, a setsid'd double-forked sleeper ignoring "
               "SIGTERM/HUP/INT/USR1, a self-stopped child, a ptrace-stopped child, a child that is a subreaper of "
               "its own orphan, and 20 zombies",
        asserts="all of them are gone once the call is answered (the checks every case ends with)",
        defence="the sweep kills every process of the uid (SIGKILL reaches stopped and traced ones)")
async def _tricks(a: FnAttack) -> None:
    out = await a.call(SRC["process_tricks"], 30.0, timeout=20)
    a.check("the call returned", isinstance(out, FnResult), _desc(out))
    lo, hi = a.uid_range
    view = a.view()
    left = view.leftovers(lo, hi) if view is not None else []
    a.check("right after its answer, nothing of it is left", not left, left)


@fncase("fork_bomb",
        attack="a call forks until refused, then starts threads until refused, all sleeping 5 s",
        asserts="it gets at most call_processes (64) processes and threads; neighbours and later calls run",
        defence="RLIMIT_NPROC of the call's uid; the worker's pids cgroup")
async def _fork_bomb(a: FnAttack) -> None:
    out = await a.call(SRC["fork_bomb"], 5.0, timeout=20)
    procs, threads, _err = _value(out, [10**6, 10**6, ""])
    n = a.pool.config.call_processes
    a.check(f"at most {n} processes and threads", procs + threads < n, _desc(out))


@fncase("cpu_spin_past_timeout",
        attack="a call and 3 setsid'd children spin with SIGTERM, SIGXCPU, SIGINT, SIGHUP, SIGALRM ignored, past a "
               "1.5 s timeout; another sleeps 60 s with SIGTERM ignored and a 1 s timeout",
        asserts="both are FnCallTimeout; everything they started is gone",
        defence="the wall-clock timeout kills the call's process group and the sweep every process of its uid, with "
                "SIGKILL")
async def _cpu(a: FnAttack) -> None:
    out = await a.call(SRC["cpu_spin"], 3, timeout=1.5)
    a.check("the spinner is FnCallTimeout", isinstance(out, FnCallTimeout), _desc(out))
    out = await a.call(SRC["sleep_no_sigterm"], timeout=1.0)
    a.check("the sleeper is FnCallTimeout", isinstance(out, FnCallTimeout), _desc(out))


@fncase("fd_exhaustion",
        attack="a call opens inotify instances, eventfds, epolls and /dev/null until refused and holds them for 3 s "
               "while concurrent calls try to open theirs",
        asserts="it stops at its own limits; concurrent calls, and later calls on every slot, can each open 200 "
                "files and 8 inotify instances",
        defence="RLIMIT_NOFILE per call; kernel counts kept per call's uid (the sandbox's user namespace sums every "
                "uid's inotify instances under one limit: a per-call share, or documented as shared)")
async def _fds(a: FnAttack) -> None:
    atk = asyncio.ensure_future(a.call(SRC["fd_exhaustion"], 3.0, timeout=20))
    await asyncio.sleep(1.5)
    during = await a.many([FnCall(SRC["fd_check"]) for _ in range(3)], timeout=15)
    out = await atk
    a.check("it stopped at its open-files limit", isinstance(out, FnResult) and out.value[0] <= a.pool.config.call_nofile,
            _desc(out))
    bad = [_desc(o) for o in (during if isinstance(during, list) else [during]) if _value(o, [0, 0])[:2] != [8, 200]]
    a.check(f"concurrent calls open 200 files and 8 inotify instances (the attacker holds {_value(out, [0, {}])[1]})",
            not bad, bad[:3])
    lo, hi = a.uid_range
    for _ in range(40):  # until the attacker's process has exited (it is answered while it exits)
        view = a.view()
        if view is None or not view.leftovers(lo, hi):
            break
        await asyncio.sleep(0.1)
    outs = await a.many([FnCall(SRC["fd_check"]) for _ in range(2 * a.slots)], timeout=15)
    bad = [_desc(o) for o in (outs if isinstance(outs, list) else [outs]) if _value(o, [0, 0])[:2] != [8, 200]]
    a.check("later calls on every slot open 200 files and 8 inotify instances", not bad, bad[:4])


# ------------------------------------------------------------------ runner ----


async def _settled(a: FnAttack, timeout: float = 20.0) -> list[str]:
    """Until nothing of any call is left in the worker (or ``timeout``): what is left."""
    deadline = time.monotonic() + timeout
    left: list[str] = ["no ready worker"]
    while time.monotonic() < deadline:
        view = a.view()
        if view is not None:
            lo, hi = a.uid_range
            try:
                # Empty directories are fine (a waiting process's, or made ahead for later ones).
                left = view.leftovers(lo, hi) + view.scratch()
            except OSError as exc:
                left = [f"cannot read the worker: {exc}"]
            if not left:
                return []
        await asyncio.sleep(0.25)
    return left


async def _wait_ready(pool: FnCallPool, image: ImageRef, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = await pool.call(image, "'ready'", timeout=10)
            if r.value == "ready":
                return None
        except Exception as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.5)
    return last or "not ready"


async def _after(a: FnAttack, c: FnCase, workers0: set[str], restarts0: int) -> None:
    """The checks every case ends with."""
    load = a.load
    a.check(f"neighbour calls all returned their own values ({load.calls} calls: none failed, lost or wrong)",
            not load.errors, f"{len(load.errors)} failed: {load.errors[:5]}")
    bad = [f"{_leaks_log(e)}: {str(e)[:300]}" for e in [*a.lost, *load.lost] if _leaks_log(e)]
    a.check("every FnCallWorkerLost seen names its worker and carries no worker log", not bad, bad[:3])
    if not c.replaces_worker:
        now = a.pool.worker_sandboxes()
        a.check("no worker was lost or replaced", a.pool.stats.restarts == restarts0 and now == workers0,
                f"restarts {restarts0} -> {a.pool.stats.restarts}, workers {sorted(workers0)} -> {sorted(now)}")
    outs = await a.many([FnCall(SRC["leave_file"], (i,)) for i in range(a.slots + 2)], timeout=20)
    bad = [_desc(o) for i, o in enumerate(outs if isinstance(outs, list) else [outs]) if _value(o, [None])[0] != i]
    a.check(f"the worker still serves calls ({a.slots + 2} at once, each leaving a file)", not bad, bad[:4])
    left = await _settled(a)
    a.check("nothing of any call is left in the worker (tasks of call uids but the slots' own, scratch dirs)",
            not left, left[:8])
    if left:  # what is left would fail the cases after this one: they get a new worker
        a.tainted = True


async def run_fncall_case(pool: FnCallPool, image: ImageRef | str, c: FnCase, *, edge: FnEdge | None = None,
                          quick: bool = True, neighbours: int = 2, timeout: float = 300.0) -> Outcome:
    """Run one case with ``neighbours`` loops of neighbour calls on the same pool, then the checks
    every case ends with. Never raises for the attack's sake: everything lands in the Outcome."""
    from dsec.backends.fncall.workers import image_ref

    out = Outcome(c.name)
    if c.needs_edge and edge is None:
        out.skipped = "no edge in this run"
        return out
    ref = image_ref(image)
    if await _wait_ready(pool, ref, 30.0) is not None:
        # An earlier case left a worker that serves nothing (and that the pool did not notice):
        # that case has failed already; this one starts on a new worker.
        for w in list(pool.workers()):
            await w.stop("replaced by the abuse suite: it served no call")
        not_ready = await _wait_ready(pool, ref, 180.0)
        if not_ready is not None:
            out.error = f"the pool has no ready worker before the case: {not_ready}"
            return out
    workers0, restarts0 = pool.worker_sandboxes(), pool.stats.restarts
    load = CallLoad(pool, ref, n=neighbours)
    a = FnAttack(pool, ref, out, edge=edge, quick=quick, load=load)
    t0 = time.perf_counter()
    load.start()
    try:
        await asyncio.wait_for(c.fn(a), timeout)
    except Exception as exc:  # the outcome records it; the suite goes on
        out.error = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        await load.stop()
    out.seconds = time.perf_counter() - t0
    out.neighbour_execs = len(load.samples)
    out.neighbour_p50_ms = percentile(load.samples, 50) if load.samples else None
    try:
        await _after(a, c, workers0, restarts0)
    except Exception as exc:
        out.error = out.error or f"the closing checks raised {type(exc).__name__}: {exc}"[:2000]
    if a.tainted:
        for w in list(pool.workers()):
            await w.stop("replaced by the abuse suite: a case damaged its files")
    return out


async def run_fncall_cases(pool: FnCallPool, image: ImageRef | str, *, cases: Sequence[FnCase] | None = None,
                           edge: FnEdge | None = None, quick: bool = True, neighbours: int = 2,
                           timeout: float = 300.0, say: Progress = _quiet) -> list[Outcome]:
    """Every case (or ``cases``) in turn against ``pool``'s workers for ``image``; one Outcome each."""
    outs: list[Outcome] = []
    for c in FNCALL_CASES if cases is None else cases:
        say(f"fncall case {c.name}")
        o = await run_fncall_case(pool, image, c, edge=edge, quick=quick, neighbours=neighbours, timeout=timeout)
        say(o.report())
        outs.append(o)
    return outs


SUITE_WORKER: dict[str, Any] = {"cpu": 2.0, "memory": 1024 * MiB, "pids": 1024, "disk": 64 * MiB, "nofile": 4096}
"""The suite's worker sandbox: a small disk, so that the disk cases reach its quota quickly."""


def suite_config(image: ImageRef) -> Any:
    """The pool the suite runs against: numpy preloaded, 4 calls in flight, 2 spare, a small worker."""
    from dsec.backends.fncall.config import FnCallConfig, FnCallImage
    from dsec.spec import Resources

    return FnCallConfig(images=(FnCallImage(image=image, preload=("numpy",), concurrency=4, spare=2,
                                            resources=Resources(**SUITE_WORKER)),),
                        call_timeout_s=20, answer_grace_s=5)


async def quiet_baseline(pool: FnCallPool, image: ImageRef | str, seconds: float = 2.0) -> float | None:
    """The neighbour calls' p50 with nothing else running (ms)."""
    from dsec.backends.fncall.workers import image_ref

    load = CallLoad(pool, image_ref(image))
    load.start()
    await asyncio.sleep(seconds)
    await load.stop()
    return percentile(load.samples, 50) if load.samples else None


def run_fncall_suite(work: Any, *, quick: bool = True, only: Sequence[str] | None = None,
                     say: Progress = print) -> tuple[list[Outcome], float | None]:
    """The whole FnCall red team on its own (``dsec bench abuse``): an edge of its own under
    ``work`` (container + fncall backends, the Debian python3+numpy layer of ``dsec bench
    fncall``, cached under $DSEC_STATE_DIR/cache), the cases run on the edge's loop against its
    pool and routes, everything destroyed at the end. Needs root. The outcomes and the
    neighbour calls' quiet p50 (for :func:`fncall_outcomes_json`). Blocking."""
    from pathlib import Path

    from dsec.backends.container.config import ContainerConfig
    from dsec.bench.fncall import python_layer
    from dsec.edge.config import EdgeConfig
    from dsec.edge.testing import EdgeThread, prepare_busybox
    from dsec.images.store import LocalLayerStore
    from dsec.spec import ImageRef

    work = Path(work) / "dsec-fnabuse"  # layer mounts must have "dsec" in their path (the leak checks find them by it)
    cache = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache"
    state = work / "state"
    store = LocalLayerStore(state / "layers")
    try:
        ref = python_layer(store, cache, name="pyfn", tag="abuse", say=say)
    finally:
        store.close()
    prepare_busybox(state)
    image = ImageRef(base=ref)
    cfg = EdgeConfig(edge_id="fnabuse", cluster_key=secrets.token_bytes(32), port=0, state_dir=state,
                     run_dir=work / "run", destroy_on_shutdown=True, runtime_name=f"fnab{os.getpid() % 100000}",
                     backends=[ContainerConfig(), suite_config(image)])
    cases = [c for c in FNCALL_CASES if not only or c.name in only]
    edge = EdgeThread(cfg).start()
    try:
        pool = edge.service.backends.by_kind["fncall"].pool
        fe = FnEdge(edge.url, edge.admin_token())
        baseline = edge.call(quiet_baseline(pool, image), timeout=120)
        outs = edge.call(run_fncall_cases(pool, image, cases=cases, edge=fe, quick=quick, say=say),
                         timeout=600 * max(len(cases), 1))
        return outs, baseline
    finally:
        edge.stop(destroy_all=True)


def fncall_outcomes_json(outcomes: Sequence[Outcome], baseline_p50_ms: float | None) -> dict[str, Any]:
    """The flat JSON of the FnCall cases, beside the container's in ``dsec bench abuse``: per
    case ``case_fncall_<x>``, ``neighbour_ratio_fncall_<x>``, ``neighbour_samples_fncall_<x>``
    (the neighbours are calls: their p50 during the case over the quiet one), the totals as
    ``fncall_cases_total`` and the like. Case names get the prefix here: some are the
    container suite's too (``fork_bomb``)."""
    from dsec.bench.abuse_cases import outcomes_json

    named = [Outcome(f"fncall_{o.name}", o.checks, o.error, o.skipped, o.seconds, o.neighbour_p50_ms,
                     o.neighbour_execs, o.notes) for o in outcomes]
    flat = outcomes_json(named, baseline_p50_ms)
    per_case = {f"{p}{o.name}" for o in named for p in ("case_", "neighbour_ratio_", "neighbour_samples_")}
    return {k if k in per_case else f"fncall_{k}": v for k, v in flat.items()}


def fncall_case_named(name: str) -> FnCase:
    for c in FNCALL_CASES:
        if c.name == name:
            return c
    raise KeyError(name)


__all__ = ["FNCALL_CASES", "SRC", "CallLoad", "FnAttack", "FnCase", "FnEdge", "WorkerView", "fncall_case_named",
           "fncall_outcomes_json", "quiet_baseline", "run_fncall_case", "run_fncall_cases", "run_fncall_suite",
           "suite_config"]

