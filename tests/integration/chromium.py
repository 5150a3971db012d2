"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol, for page tests.

No browser driver package: the DevTools protocol is JSON over one WebSocket, spoken here
with ``websockets`` (a dependency already). :class:`Page` does what a person does —
opens a URL, types into a field, clicks an element at its place on the screen, reads
the visible text — and takes screenshots; it also collects what the page's console
reported (exceptions, errors, Content-Security-Policy refusals) for the test to check.

Skips the test when ``chromium`` is missing (``bash scripts/setup.sh`` installs it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

BINARY_NAMES = ("chromium", "chromium-browser")


def find_chromium() -> str | None:
    for name in BINARY_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class PageError(AssertionError):
    """The page did not get where the test waited for (its visible text is attached)."""


class Page:
    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.console: list[str] = []
        """Console errors, uncaught exceptions and browser log errors (CSP refusals among them)."""
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self._ws:
            msg = json.loads(raw)
            if "id" in msg:
                fut = self._pending.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            method = msg.get("method", "")
            p = msg.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                self.console.append(f"exception: {d.get('text')} {d.get('exception', {}).get('description', '')}")
            elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                self.console.append("console." + p["type"] + ": " + " ".join(
                    str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                e = p["entry"]
                self.console.append(f"log ({e.get('source')}): {e.get('text')} {e.get('url', '')}")
            await self._events.put(msg)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        i = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        await self._ws.send(json.dumps({"id": i, "method": method, "params": params}))
        msg = await asyncio.wait_for(fut, 30)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        result: dict[str, Any] = msg.get("result", {})
        return result

    async def goto(self, url: str) -> None:
        while not self._events.empty():
            self._events.get_nowait()
        await self.send("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while True:
            ev = await asyncio.wait_for(self._events.get(), max(0.1, deadline - time.monotonic()))
            if ev.get("method") == "Page.loadEventFired":
                return

    async def eval(self, expression: str) -> Any:
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:80]}: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    async def text(self, selector: str = "body") -> str:
        """What a person reads in that element (``innerText``: hidden elements are left out)."""
        value = await self.eval(f"(() => {{ const n = document.querySelector({json.dumps(selector)}); "
                                "return n ? n.innerText : null; })()")
        return "" if value is None else str(value)

    async def visible(self, selector: str) -> bool:
        return bool(await self.eval(
            f"(() => {{ const n = document.querySelector({json.dumps(selector)}); if (!n) return false; "
            "const r = n.getBoundingClientRect(); return r.width > 0 && r.height > 0 && "
            "getComputedStyle(n).visibility !== 'hidden'; })()"))

    async def wait_for(self, expression: str, timeout: float = 15.0, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise PageError(f"waited {timeout:g} s for {what or expression}; the page reads:\n"
                                f"{(await self.text())[:3000]}\nconsole: {self.console}")
            await asyncio.sleep(0.1)

    async def wait_text(self, selector: str, needle: str, timeout: float = 15.0) -> str:
        """Until ``needle`` shows in the element; returns its text."""
        js = (f"(() => {{ const n = document.querySelector({json.dumps(selector)}); "
              f"return n && n.innerText.includes({json.dumps(needle)}) ? n.innerText : ''; }})()")
        return str(await self.wait_for(js, timeout, what=f"{needle!r} in {selector}"))

    async def _center(self, selector: str) -> tuple[float, float]:
        box = await self.eval(
            f"(() => {{ const n = document.querySelector({json.dumps(selector)}); if (!n) return null; "
            "n.scrollIntoView({block: 'center'}); const r = n.getBoundingClientRect(); "
            "return [r.left + r.width / 2, r.top + r.height / 2, r.width, r.height]; })()")
        if not box or box[2] <= 0 or box[3] <= 0:
            raise PageError(f"{selector} is not on the screen")
        return float(box[0]), float(box[1])

    async def click(self, selector: str) -> None:
        """A mouse click where the element is drawn (what is on top there receives it)."""
        x, y = await self._center(selector)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            await self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    async def type(self, selector: str, text: str) -> None:
        """Click into the field, then type ``text`` as keyboard input."""
        await self.click(selector)
        await self.send("Input.insertText", text=text)

    async def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            await self.send("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                            windowsVirtualKeyCode=13, nativeVirtualKeyCode=13, text="\r" if kind == "keyDown" else "")

    async def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            m = await self.send("Page.getLayoutMetrics")
            size = m.get("cssContentSize") or m["contentSize"]
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size["width"],
                                                            "height": size["height"], "scale": 1})
        data = (await self.send("Page.captureScreenshot", **params))["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        await self._ws.close()


@contextlib.asynccontextmanager
async def chromium_page(*, width: int = 1440, height: int = 900) -> AsyncIterator[Page]:
    """One page of a throwaway headless Chromium (its own profile directory, removed after)."""
    from websockets.asyncio.client import connect

    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: bash scripts/setup.sh installs Debian's package")
    with tempfile.TemporaryDirectory(prefix="dsec-chromium-") as profile:
        log = open(Path(profile) / "chromium.log", "wb")  # noqa: SIM115 - closed below
        args = [binary, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-sync", "--mute-audio",
                "--hide-scrollbars", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium's own sandbox refuses to run as root
        proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        page: Page | None = None
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"chromium did not start: {(Path(profile) / 'chromium.log').read_text()[-2000:]}")
                await asyncio.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            async with httpx.AsyncClient() as h:
                targets = (await h.get(f"http://127.0.0.1:{port}/json/list")).json()
            ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
            page = Page(await connect(ws_url, max_size=None, open_timeout=10))
            for domain in ("Page", "Runtime", "Log"):
                await page.send(f"{domain}.enable")
            await page.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                            deviceScaleFactor=1, mobile=False)
            yield page
        finally:
            if page is not None:
                await page.close()
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)  # its zygote and renderers, whatever is left
            log.close()
