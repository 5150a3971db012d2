"""A TCP delay line: ``python -m dsec.bench.delayline --to HOST:PORT --delay-ms D``.

Listens on 127.0.0.1 (a free port, printed as ``listening PORT``) and forwards each
connection to HOST:PORT; every chunk read in either direction is written on only
``D`` ms after it arrived, in order, so a request/response pays ``2 D`` of round trip
while streams keep their throughput (a delay line, not a stop-and-wait). Stands in
for ``tc netem delay`` on kernels without it (dsec.bench.netshape). Runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def pump_in() -> None:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay_s, data))
        queue.put_nowait((0.0, b""))

    async def pump_out() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    await asyncio.gather(pump_in(), pump_out(), return_exceptions=True)


async def _main(host: str, port: int, delay_s: float) -> None:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(host, port)
        except OSError:
            cw.close()
            return
        try:
            await asyncio.gather(_pipe(cr, uw, delay_s), _pipe(ur, cw, delay_s))
        finally:
            for w in (uw, cw):
                w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--to", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, default=1.0)
    a = ap.parse_args()
    host, _, port = a.to.rpartition(":")
    try:
        import uvloop

        uvloop.run(_main(host, int(port), a.delay_ms / 1000))
    except ImportError:
        asyncio.run(_main(host, int(port), a.delay_ms / 1000))


if __name__ == "__main__":
    main()
