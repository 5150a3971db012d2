"""``/run_jupyter`` inside a sandbox: one IPython kernel, the request's cells in order.

Runs **inside** the request's sandbox with the toolchain's own ``python3`` (the jupyter
toolchain: ipykernel and jupyter_client from Debian); never imports dsec. Reads
``{"cells": [...], "cell_timeout": s, "total_timeout": s}`` as JSON on stdin, starts a
``python3`` kernel in its working directory, sends each cell to it in turn — one kernel,
so names, imports and files persist from cell to cell — and collects per cell what
Jupyter publishes: ``stream`` text (stdout, stderr), the ``data`` of ``execute_result``
and ``display_data`` messages, the ``content`` of ``error`` messages. A cell that raises
does not stop the next ones (as in a notebook). A cell past ``cell_timeout`` is
interrupted (its ``error`` holds the kernel's ``KeyboardInterrupt``) and the next cells
still run; past ``total_timeout`` the running cell is interrupted and no more run. Either
makes the status ``TimeLimitExceeded``.

The result is the last line of stdout: :data:`MARK` followed by JSON
``{"status": "Finished" | "TimeLimitExceeded", "cells": [...]}``.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import tempfile
import time
from typing import Any

MARK = "\x1edsec-jupyter-result "
KERNEL_NAME = "dsec-python3"
KERNEL_START_S = 60.0
INTERRUPT_GRACE_S = 5.0


def _drain_cell(kc: Any, msg_id: str, out: dict[str, Any], until: float) -> bool:
    """Collect the cell's iopub messages until the kernel is idle again; False at ``until``."""
    while True:
        remaining = until - time.monotonic()
        if remaining <= 0:
            return False
        try:
            msg = kc.get_iopub_msg(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["header"]["msg_type"]
        content = msg["content"]
        if kind == "stream":
            name = "stderr" if content.get("name") == "stderr" else "stdout"
            out[name] += content.get("text", "")
        elif kind in ("execute_result", "display_data"):
            out["display"].append(content.get("data", {}))
        elif kind == "error":
            out["error"].append(content)
        elif kind == "status" and content.get("execution_state") == "idle":
            return True


def run(req: dict[str, Any]) -> dict[str, Any]:
    from jupyter_client.manager import KernelManager  # type: ignore[import-not-found,import-untyped,unused-ignore]

    cells: list[str] = list(req.get("cells") or [])
    cell_timeout = float(req.get("cell_timeout") or 0)
    # The kernel's channels are unix sockets, and the kernel is this file in kernel mode
    # (below): a sandbox may not list network interfaces (netlink), and libzmq aborts the
    # process when a TCP bind cannot ask for them.
    work = tempfile.mkdtemp(prefix="dsec-kernel-")
    spec_dir = os.path.join(work, "kernels", KERNEL_NAME)
    os.makedirs(spec_dir)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump({"argv": [sys.executable, os.path.abspath(__file__), "--kernel", "-f", "{connection_file}"],
                   "display_name": "Python 3 (dsec)", "language": "python"}, f)
    os.environ["JUPYTER_PATH"] = work
    km = KernelManager(kernel_name=KERNEL_NAME, transport="ipc", ip=os.path.join(work, "k"))
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=KERNEL_START_S)
    deadline = time.monotonic() + float(req.get("total_timeout") or 45)  # the cells' own time
    results: list[dict[str, Any]] = []
    status = "Finished"
    try:
        for source in cells:
            now = time.monotonic()
            if now >= deadline:
                status = "TimeLimitExceeded"
                break
            until = min(deadline, now + cell_timeout) if cell_timeout > 0 else deadline
            out: dict[str, Any] = {"stdout": "", "stderr": "", "display": [], "error": []}
            msg_id = kc.execute(source, allow_stdin=False)
            done = _drain_cell(kc, msg_id, out, until)
            if not done:
                status = "TimeLimitExceeded"
                km.interrupt_kernel()
                if not _drain_cell(kc, msg_id, out, time.monotonic() + INTERRUPT_GRACE_S):
                    results.append(out)
                    break  # the kernel does not answer: nothing more can run in it
            results.append(out)
            if not done and time.monotonic() >= deadline:
                break
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return {"status": status, "cells": results}


def kernel(argv: list[str]) -> None:
    """Kernel mode: ipykernel, without the TCP pipe its IOPub thread opens for the output of
    forked children (a bind libzmq cannot make here; such output is not forwarded) and
    without debugpy (a quarter of the kernel's start-up CPU, for a debugger nobody attaches)."""
    sys.modules["debugpy"] = None  # type: ignore[assignment]  # ipykernel then runs without its debugger
    from ipykernel import iostream  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from ipykernel.kernelapp import launch_new_instance  # type: ignore[import-not-found,import-untyped,unused-ignore]

    def no_pipe(self: Any) -> None:
        self._pipe_flag = False

    iostream.IOPubThread._setup_pipe_in = no_pipe
    launch_new_instance(argv=argv)


def main() -> int:
    if sys.argv[1:2] == ["--kernel"]:
        kernel(sys.argv[2:])
        return 0
    req = json.load(sys.stdin)
    result = run(req)
    sys.stdout.write("\n" + MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
