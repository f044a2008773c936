"""Which build runs: the hot path's modules compiled (mypyc, `make test-compiled`) or interpreted
(an editable install, `make test`), as the gateway reports it in `/metrics`. The suite is told
which to expect (KVGATE_EXPECT_BUILD), so a compiled run that silently imported the sources fails."""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.build import COMPILED, build_kind, compiled_modules
from gateway.config import Settings
from gateway.server import RunningGateway
from tests.conftest import gateway_settings
from tests.upstream_app import Upstream

EXPECTED = os.environ.get("KVGATE_EXPECT_BUILD", "interpreted")


def test_the_expected_build_is_the_one_imported() -> None:
    assert build_kind() == EXPECTED, [sys.modules[name].__file__ for name in COMPILED]


async def test_metrics_say_which_build_serves(
    upstreams: Callable[[int], Awaitable[list[Upstream]]],
    gateway: Callable[[Settings], Awaitable[RunningGateway]],
) -> None:
    ups = await upstreams(1)
    gw = await gateway(gateway_settings([ups[0].url]))
    async with httpx.AsyncClient(base_url=gw.url) as client:
        text = (await client.get("/metrics")).text
    [info] = [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvgate_build_info"
    ]
    modules = len(compiled_modules())
    assert info.labels == {"compiled": EXPECTED, "modules": f"{modules}/{len(COMPILED)}"} and info.value == 1
    assert modules == (len(COMPILED) if EXPECTED == "compiled" else 0)
