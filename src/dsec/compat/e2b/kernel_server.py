"""One E2B code-interpreter context inside a sandbox: an IPython kernel fed cell by cell.

Runs **inside** the sandbox with its ``python3`` (the jupyter toolchain); never imports
dsec. Starts a kernel the way SandboxFusion's ``jupyter_driver.py`` does (written beside
this file: its kernel mode, unix-socket channels), answers ``{"type": "ready"}``, then reads
one JSON request a line on stdin (``{"code", "env_vars"}``) and writes E2B's execution
messages as lines that start with :data:`MARK`: one ``stdout``/``stderr`` chunk a cell (what
the cell printed, in one piece), ``result`` per ``execute_result``/``display_data``,
``error``, ``number_of_executions``, then ``end_of_execution``. The kernel lives as long as
this process: names, imports and files persist from cell to cell.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jupyter_driver as jd  # type: ignore[import-not-found,unused-ignore]

MARK = "\x1edsec-e2b "
MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
        "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
        "application/json": "json", "application/javascript": "javascript"}


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def result(data: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        key = MIME.get(mime)
        if key is not None:
            out[key] = value
        else:
            extra[mime] = value
    if extra:
        out["extra"] = extra
    return out


def start(cwd: str) -> tuple[Any, Any]:
    from jupyter_client.manager import KernelManager  # type: ignore[import-not-found,import-untyped,unused-ignore]

    work = tempfile.mkdtemp(prefix="dsec-e2b-kernel-")
    spec_dir = os.path.join(work, "kernels", jd.KERNEL_NAME)
    os.makedirs(spec_dir)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump({"argv": [sys.executable, jd.__file__, "--kernel", "-f", "{connection_file}"],
                   "display_name": "Python 3 (dsec)", "language": "python"}, f)
    os.environ["JUPYTER_PATH"] = work
    km = KernelManager(kernel_name=jd.KERNEL_NAME, transport="ipc", ip=os.path.join(work, "k"))
    km.start_kernel(cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=jd.KERNEL_START_S)
    return km, kc


def cell(kc: Any, code: str, env_vars: dict[str, str]) -> None:
    if env_vars:
        kc.execute("import os as _dsec_os; _dsec_os.environ.update(" + json.dumps(env_vars) + "); del _dsec_os",
                   silent=True, store_history=False)
    msg_id = kc.execute(code, allow_stdin=False)
    out = {"stdout": "", "stderr": ""}
    count = None
    messages: list[dict[str, Any]] = []
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=1.0)
        except queue.Empty:
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            out["stderr" if content.get("name") == "stderr" else "stdout"] += content.get("text", "")
        elif kind == "execute_input":
            count = content.get("execution_count")
        elif kind == "execute_result":
            messages.append(result(content.get("data", {}), True))
        elif kind == "display_data":
            messages.append(result(content.get("data", {}), False))
        elif kind == "error":
            messages.append({"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
                             "traceback": "\n".join(content.get("traceback", []))})
        elif kind == "status" and content.get("execution_state") == "idle":
            break
    for name in ("stdout", "stderr"):
        if out[name]:
            emit({"type": name, "text": out[name], "timestamp": now()})
    for m in messages:
        emit(m)
    if count is not None:
        emit({"type": "number_of_executions", "execution_count": count})
    emit({"type": "end_of_execution"})


def main() -> int:
    cwd = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    try:
        km, kc = start(cwd)
    except Exception as exc:
        emit({"type": "fatal", "message": f"the kernel did not start: {type(exc).__name__}: {exc}"})
        return 1
    emit({"type": "ready"})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            if req.get("interrupt"):
                km.interrupt_kernel()
                continue
            cell(kc, str(req.get("code", "")), dict(req.get("env_vars") or {}))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
