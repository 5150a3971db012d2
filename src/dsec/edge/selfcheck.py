"""Self-check: the edge notices when the host state its runtime stands on vanished, repairs
what it can and says exactly what it cannot.

Every ``host_check_interval_s`` it runs every backend's ``heal`` (the container backend's
:meth:`ContainerRuntime.heal`: claims, directories,
cgroup parents, the /dev skeleton, layer mounts, the writable-layer store's mount, the
sandbox network's host tables and the spawner. Someone else's cleanup is the usual cause
(an operator's ``umount``, a script removing empty cgroups, another DSec instance sharing
a name before names were claimed). A create that fails on such a thing runs a pass at once
and is tried again (the runtime does that itself), so most repairs happen before anyone
notices. What is left unrepaired makes the edge unhealthy: ``healthy: false`` and
``problems`` in its health report, ``dsec_edge_healthy 0`` in its metrics.

Never raises out of the loop: a failing pass is itself a problem ("self-check failed").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from dsec.edge.loop import BackgroundLoop

if TYPE_CHECKING:
    from dsec.edge.backends import EdgeBackends

log = logging.getLogger("dsec.edge.selfcheck")

MAX_REPORTED = 20
"""Problems and repairs listed in a health report at most (the rest are in the log)."""


class SelfCheck(BackgroundLoop):
    task_name = "dsec-edge-selfcheck"

    def __init__(self, backends: EdgeBackends, *, interval: float) -> None:
        self.backends = backends
        self.interval = interval
        self.failure = ""
        """Why the last pass itself failed ("" when it ran)."""
        self.passes = 0

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check()

    async def check(self) -> None:
        """One pass (also run at start, before the edge serves)."""
        try:
            await self.backends.heal()
            self.failure = ""
        except Exception as exc:  # the check must outlive any one bad pass
            log.exception("self-check pass failed")
            self.failure = f"self-check failed: {exc!r}"
        self.passes += 1

    def problems(self) -> list[str]:
        out = [f.message for b in self.backends.by_kind.values() for f in b.host_problems]
        out += self.backends.registry_problems()
        if self.failure:
            out.append(self.failure)
        return out[:MAX_REPORTED]

    def repairs(self) -> list[str]:
        found = self.backends.host_repairs()[-MAX_REPORTED:]
        return [f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(f.at))} {f.message}" for f in found]
