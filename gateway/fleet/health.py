"""Active health checks: poll each replica's health endpoint, eject and readmit by thresholds."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Iterable

import aiohttp

from gateway.config import HealthConfig
from gateway.fleet.replica import Replica

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self, cfg: HealthConfig, replicas: Callable[[], Iterable[Replica]], tls: ssl.SSLContext | None = None
    ) -> None:
        self.cfg = cfg
        self._replicas = replicas
        self._tls = tls  # the upstream TLS settings, when they are not the defaults
        self._session: aiohttp.ClientSession | None = None
        self._fails: dict[str, int] = {}
        self._oks: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if not self.cfg.enabled:
            return
        connector = aiohttp.TCPConnector(ssl=self._tls if self._tls is not None else True)
        self._session = aiohttp.ClientSession(connector=connector)
        self._task = asyncio.create_task(self._run(), name="kvgate-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        while True:
            replicas = list(self._replicas())
            await asyncio.gather(*(self.check(r) for r in replicas))
            await asyncio.sleep(self.cfg.interval_s)

    async def probe(self, replica: Replica) -> bool:
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                assert self._session is not None
                async with self._session.get(replica.url + self.cfg.path) as resp:
                    await resp.read()
                    return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def check(self, replica: Replica) -> None:
        ok = await self.probe(replica)
        name = replica.name
        if ok:
            replica.breaker.probe_now()  # an engine back from a crash is tried at once, not after open_s
            self._fails[name] = 0
            self._oks[name] = self._oks.get(name, 0) + 1
            if not replica.healthy and self._oks[name] >= self.cfg.success_threshold:
                replica.healthy = True
                log.info("replica %s healthy again", name)
        else:
            self._oks[name] = 0
            self._fails[name] = self._fails.get(name, 0) + 1
            if replica.healthy and self._fails[name] >= self.cfg.failure_threshold:
                replica.eject()
                log.warning("replica %s ejected: %d failed health checks", name, self._fails[name])

    def forget(self, name: str) -> None:
        self._fails.pop(name, None)
        self._oks.pop(name, None)
