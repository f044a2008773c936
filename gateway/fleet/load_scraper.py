"""Polls each replica's own load figures (waiting, running, KV usage) several times a second.

One polling task per replica, so a slow or dead engine never delays the others' figures. A
failed or timed-out scrape keeps the previous figure with its previous `updated_at`: consumers
see it age and go stale through `EngineLoad.is_fresh`, never a made-up fresh zero.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from gateway.config import ScrapeConfig
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.engines.base import EngineAdapter

log = logging.getLogger("kvgate.load_scraper")

LoadCallback = Callable[[str, EngineLoad], None]
# An engine is not trusted: a load page (vLLM's /metrics is some hundreds of KiB) beyond this is refused.
MAX_BODY_BYTES = 8 << 20


@dataclass(slots=True)
class _Target:
    url: str
    adapter: EngineAdapter
    task: asyncio.Task[None] | None = None
    failing: bool = False


class LoadScraper:
    """`loads[name]` holds each replica's latest successfully scraped `EngineLoad`."""

    def __init__(
        self,
        interval_s: float = 0.5,
        timeout_s: float | None = None,
        on_update: LoadCallback | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.interval_s = interval_s
        self._tls = tls  # the upstream TLS settings, when they are not the defaults
        # Shorter than the interval: a figure that arrives late is already out of date.
        self.timeout_s = timeout_s if timeout_s is not None else min(1.0, max(0.1, interval_s * 0.8))
        self.on_update = on_update
        self.loads: dict[str, EngineLoad] = {}
        self._targets: dict[str, _Target] = {}
        self._client: aiohttp.ClientSession | None = None

    @classmethod
    def from_config(
        cls, config: ScrapeConfig, on_update: LoadCallback | None = None, tls: ssl.SSLContext | None = None
    ) -> LoadScraper:
        return cls(interval_s=config.interval_s, on_update=on_update, tls=tls)

    def add(self, name: str, url: str, adapter: EngineAdapter) -> None:
        """Scrape a replica (again, if it was known: a restarted replica keeps its old figure
        until a fresh one arrives). Its engine must report its load (`adapter.load_path`)."""
        self.remove(name)
        if adapter.load_path is None:
            raise ValueError(f"replica {name}: a {adapter.kind} engine reports no load")
        target = _Target(url.rstrip("/") + adapter.load_path, adapter)
        self._targets[name] = target
        if self._client is not None:
            target.task = asyncio.create_task(self._poll(name, target), name=f"scrape {name}")

    def remove(self, name: str) -> None:
        target = self._targets.pop(name, None)
        if target is not None and target.task is not None:
            target.task.cancel()
        self.loads.pop(name, None)

    def get(self, name: str) -> EngineLoad:
        """The latest figure; a never-scraped `EngineLoad()` (not fresh) for an unknown replica."""
        return self.loads.get(name) or EngineLoad()

    async def start(self) -> None:
        if self._client is not None:
            return
        # No connection cap: one poller per replica, each with at most one request in flight.
        self._client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=0, ssl=self._tls if self._tls is not None else True),
            trust_env=False,
        )
        for name, target in self._targets.items():
            target.task = asyncio.create_task(self._poll(name, target), name=f"scrape {name}")

    async def stop(self) -> None:
        tasks = [t.task for t in self._targets.values() if t.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for target in self._targets.values():
            target.task = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def scrape_once(self, name: str) -> EngineLoad | None:
        """Scrape one replica now; the new figure, or None if the scrape failed."""
        return await self._scrape(name, self._targets[name])

    async def _scrape(self, name: str, target: _Target) -> EngineLoad | None:
        assert self._client is not None, "start() first"
        try:
            load = target.adapter.parse_load(await self._fetch(target.url))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if not target.failing:  # log the transition, not every 0.5 s
                log.warning("load scrape of %s (%s) failing: %s", name, target.url, exc)
                target.failing = True
            return None
        if target.failing:
            log.info("load scrape of %s recovered", name)
            target.failing = False
        previous = self.loads.get(name)
        if previous is not None and load.num_gpu_blocks is None:
            # Capacity is static: keep what an earlier scrape (or endpoint) told us.
            load.num_gpu_blocks, load.block_size = previous.num_gpu_blocks, previous.block_size
            load.cpu_capacity_tokens = previous.cpu_capacity_tokens
        load.updated_at = time.monotonic()
        if self._targets.get(name) is not target:  # removed or replaced while we waited
            return None
        self.loads[name] = load
        if self.on_update is not None:
            self.on_update(name, load)
        return load

    async def _fetch(self, url: str) -> bytes:
        assert self._client is not None
        async with self._client.get(url) as response:
            if response.status != 200:
                raise ValueError(f"status {response.status}")
            if (response.content_length or 0) > MAX_BODY_BYTES:
                raise ValueError(f"body of {response.content_length} bytes")
            body = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise ValueError(f"body over {MAX_BODY_BYTES} bytes")
            return bytes(body)

    async def _poll(self, name: str, target: _Target) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self._scrape(name, target)
            except Exception:
                log.exception("load scrape of %s crashed", name)
            # A fixed cadence, not interval-after-scrape: slow engines do not stretch it.
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())
