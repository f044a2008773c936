"""LoadScraper against real HTTP servers that report, fail and hang."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.engines import get_adapter
from gateway.fleet.load_scraper import LoadScraper
from tests.conftest import wait_until


def vllm_metrics(running: int, waiting: int, usage: float, blocks: str = "52478") -> str:
    labels = 'engine="0",model_name="m"'
    return (
        f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {running}.0\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}.0\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {usage}\n"
        f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n'
    )


@dataclass
class FakeEngine:
    url: str = ""
    status: int = 200
    body: str = ""
    hang: bool = False
    hits: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.hang:
            await self.release.wait()
        return web.Response(status=self.status, text=self.body)


@pytest.fixture
async def engines() -> AsyncIterator[Callable[[str], asyncio.Future[FakeEngine]]]:
    runners: list[web.AppRunner] = []
    fakes: list[FakeEngine] = []

    async def make(body: str) -> FakeEngine:
        fake = FakeEngine(body=body)
        app = web.Application()
        app.router.add_get("/metrics", fake.handle)
        app.router.add_get("/v1/loads", fake.handle)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        fake.url = f"http://127.0.0.1:{port}"
        runners.append(runner)
        fakes.append(fake)
        return fake

    yield make  # type: ignore[misc]
    for fake in fakes:
        fake.release.set()
    for runner in runners:
        await runner.cleanup()


async def test_scrapes_and_tracks_changes(engines) -> None:
    engine = await engines(vllm_metrics(3, 1, 0.25))
    updates: list[tuple[str, EngineLoad]] = []
    scraper = LoadScraper(interval_s=0.05, on_update=lambda name, load: updates.append((name, load)))
    scraper.add("r0", engine.url, get_adapter("vllm"))
    assert not scraper.get("r0").is_fresh(60)
    await scraper.start()
    try:
        await wait_until(lambda: scraper.get("r0").running == 3)
        load = scraper.get("r0")
        assert (load.waiting, load.kv_usage, load.kv_capacity_tokens) == (1, 0.25, 52478 * 16)
        assert load.is_fresh(1.0)
        assert updates and updates[0][0] == "r0"
        engine.body = vllm_metrics(9, 4, 0.8)
        await wait_until(lambda: scraper.get("r0").waiting == 4)
        assert scraper.loads["r0"].running == 9
    finally:
        await scraper.stop()


async def test_failed_scrapes_keep_the_old_figure_and_its_age(engines) -> None:
    engine = await engines(vllm_metrics(5, 2, 0.5))
    scraper = LoadScraper(interval_s=0.05)
    scraper.add("r0", engine.url, get_adapter("vllm"))
    await scraper.start()
    try:
        await wait_until(lambda: scraper.get("r0").running == 5)
        engine.status = 500
        hits = engine.hits
        await wait_until(lambda: engine.hits >= hits + 3)  # several failed scrapes later
        stale = scraper.get("r0")
        seen_at = stale.updated_at
        assert stale.running == 5
        await wait_until(lambda: engine.hits >= hits + 5)
        assert scraper.get("r0").updated_at == seen_at
        assert not scraper.get("r0").is_fresh(3.0, now=seen_at + 3.5)
        engine.status = 200
        await wait_until(lambda: scraper.get("r0").updated_at > seen_at)
    finally:
        await scraper.stop()


async def test_a_hanging_engine_does_not_delay_the_others(engines) -> None:
    stuck = await engines(vllm_metrics(1, 0, 0.1))
    stuck.hang = True
    healthy = await engines(vllm_metrics(2, 0, 0.2))
    scraper = LoadScraper(interval_s=0.05, timeout_s=2.0)
    scraper.add("stuck", stuck.url, get_adapter("vllm"))
    scraper.add("healthy", healthy.url, get_adapter("vllm"))
    await scraper.start()
    try:
        await wait_until(lambda: stuck.hits >= 1 and "healthy" in scraper.loads)
        first = scraper.loads["healthy"].updated_at
        # Several fresh figures from the healthy engine while the stuck scrape still waits.
        await wait_until(lambda: healthy.hits >= 5)
        assert scraper.loads["healthy"].updated_at > first
        assert "stuck" not in scraper.loads and stuck.hits == 1
    finally:
        await scraper.stop()


async def test_timeout_then_recovery(engines) -> None:
    engine = await engines(vllm_metrics(1, 0, 0.1))
    engine.hang = True
    scraper = LoadScraper(interval_s=0.05, timeout_s=0.1)
    scraper.add("r0", engine.url, get_adapter("vllm"))
    await scraper.start()
    try:
        await wait_until(lambda: engine.hits >= 3)  # each hung request timed out, then retried
        assert "r0" not in scraper.loads
        engine.hang = False
        await wait_until(lambda: scraper.get("r0").running == 1)
    finally:
        await scraper.stop()


async def test_remove_and_capacity_carry_over(engines) -> None:
    engine = await engines(vllm_metrics(1, 0, 0.1))
    control = await engines(vllm_metrics(1, 0, 0.1))
    scraper = LoadScraper(interval_s=0.05)
    await scraper.start()  # replicas join after start, as launched engines do
    try:
        scraper.add("r0", engine.url, get_adapter("vllm"))
        scraper.add("control", control.url, get_adapter("vllm"))
        await wait_until(lambda: scraper.get("r0").num_gpu_blocks == 52478)
        engine.body = vllm_metrics(7, 0, 0.3, blocks="None")
        await wait_until(lambda: scraper.get("r0").running == 7)
        assert scraper.get("r0").num_gpu_blocks == 52478
        scraper.remove("r0")
        assert "r0" not in scraper.loads
        hits, control_hits = engine.hits, control.hits
        await wait_until(lambda: control.hits >= control_hits + 4)  # several intervals later
        assert engine.hits <= hits + 1 and "r0" not in scraper.loads
    finally:
        await scraper.stop()


async def test_sglang_v1_loads(engines) -> None:
    engine = await engines('{"loads": [{"num_running_reqs": 4, "num_waiting_reqs": 6, "token_usage": 0.7}]}')
    scraper = LoadScraper(interval_s=0.05)
    scraper.add("s0", engine.url, get_adapter("sglang"))
    await scraper.start()
    try:
        await wait_until(lambda: scraper.get("s0").waiting == 6)
        assert scraper.get("s0").kv_usage == 0.7
    finally:
        await scraper.stop()
