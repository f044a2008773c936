"""LoRA adapters as routing facts: which replica of a pool can serve which adapter, which ones hold
it warm, and loading an adapter onto a replica on demand.

Facts come from three places. Adapters declared in the config (`pools[].lora.adapters`, and a managed
fleet's `engines.lora.modules`) are taken to be on every replica whose own list is unknown. With
`lora.discover` each replica's `/v1/models` is read every `discover_interval_s`: its list (cards with
a `parent`) then replaces the assumption for that replica, and its base cards give the engine's names
for the base model and its `max_model_len`. With `lora.load_on_demand`, a replica that lacks a
declared adapter is a candidate too: the gateway posts the adapter's name and path to the engine's
dynamic LoRA endpoint (vLLM's `/v1/load_lora_adapter`, SGLang's `/load_lora_adapter`) before the
request, once per replica however many requests wait for it, and remembers a failure for
`load_retry_s`.

Routing prefers a replica that holds the adapter warm. Each replica's recently routed adapters are an
LRU of `slots_per_replica` (the engine's `--max-loras` GPU slots, whose LRU it mirrors); for a
prefix-aware policy a resident adapter counts as `affinity_tokens` prompt tokens already cached there,
so an adapter's traffic stays where its weights are and a hot adapter spills onto another replica
exactly as a hot prefix does, once queueing there costs more than the swap. Prompt prefixes are
hashed per adapter (the chain is seeded by the adapter's name, as the engines key their caches), so
two adapters never share an index entry.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import aiohttp
import orjson

from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.routing.policy import Candidate

log = logging.getLogger(__name__)

MAX_MODELS_BODY = 1 << 20
MAX_CARDS = 4096
MAX_NAME = 256
LENGTH_POLL_S = 1.0  # how often a pool without a context length yet asks a replica for it, at first
LENGTH_POLL_MAX_S = 60.0


def parse_models(body: bytes) -> tuple[list[str], list[str], int | None]:
    """(base model names, adapter names, max_model_len) from an engine's `/v1/models` answer.

    vLLM (and the simulator) list the base model's names with `max_model_len` and each adapter with its
    `parent`; anything that is not such a list raises ValueError."""
    doc: Any = orjson.loads(body)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("no `data` list")
    bases: list[str] = []
    adapters: list[str] = []
    max_len: int | None = None
    for card in data[:MAX_CARDS]:
        if not isinstance(card, dict):
            continue
        name = card.get("id")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            continue
        if card.get("parent") is None:
            bases.append(name)
            length = card.get("max_model_len")
            if isinstance(length, int) and length > 0:
                max_len = length
        else:
            adapters.append(name)
    return bases, adapters, max_len


class PoolLora:
    """One pool's adapters: declared, learned per replica, loaded by the gateway, believed resident.
    Kept by the pool's router, which tells it when a replica leaves (`forget`)."""

    def __init__(self, pool: Pool) -> None:
        cfg = pool.cfg
        self.cfg = cfg.lora
        self.pool = pool
        self.base_model = pool.upstream_model
        self.declared = {a.name: a for a in cfg.adapter_specs}
        # A managed fleet's --lora-modules are on every replica from its start.
        self.preloaded = frozenset(
            m.name for m in (cfg.engines.lora.modules if cfg.engines and cfg.engines.lora else ())
        )
        engine_slots = cfg.engines.lora.max_loras if cfg.engines and cfg.engines.lora else None
        self.slots = self.cfg.slots_per_replica or engine_slots or 1
        self.learned: dict[str, frozenset[str]] = {}  # replica -> its adapters, from its /v1/models
        self.loaded: dict[str, set[str]] = {}  # replica -> adapters the gateway loaded there
        self.resident: dict[str, OrderedDict[str, None]] = {}  # replica -> adapters routed there lately
        self.base_names: frozenset[str] = frozenset()  # the engines' own names of the base model
        self.max_model_len: int | None = cfg.engines.max_model_len if cfg.engines else None
        self.loads = 0  # adapters loaded on demand (successfully)
        self.load_failures = 0
        self._failed: dict[tuple[str, str], float] = {}
        self._loading: dict[tuple[str, str], asyncio.Future[bool]] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.declared) or self.cfg.discover

    def names(self) -> list[str]:
        """Every adapter clients may ask this pool for, declared first."""
        out = dict.fromkeys(self.declared)
        for adapters in self.learned.values():
            out.update(dict.fromkeys(sorted(adapters)))
        return list(out)

    def knows(self, adapter: str) -> bool:
        return adapter in self.declared or any(adapter in s for s in self.learned.values())

    def upstream_name(self, adapter: str) -> str:
        """The `model` the engines are sent for `adapter`, in their dialect."""
        engine = self.pool.dialect
        return engine.lora_model(self.base_model, adapter) if engine is not None else adapter

    def adapter_of(self, upstream: str) -> str | None:
        """The adapter an engine-bound `model` names; None for the base model."""
        if upstream == self.base_model:
            return None
        engine = self.pool.dialect
        return engine.lora_adapter(self.base_model, upstream) if engine is not None else upstream

    # -- per replica ------------------------------------------------------------------------
    def has(self, replica: str, adapter: str) -> bool:
        """Is `adapter` known to be served by `replica` now (no load needed)?"""
        if adapter in self.preloaded or adapter in self.loaded.get(replica, ()):
            return True
        learned = self.learned.get(replica)
        if learned is not None:
            return adapter in learned
        return adapter in self.declared and not self.cfg.load_on_demand

    def serves(self, replica: str, adapter: str) -> bool:
        """May a request for `adapter` go to `replica` (perhaps after loading it there)?"""
        return self.has(replica, adapter) or (self.cfg.load_on_demand and adapter in self.declared)

    def eligible(self, replicas: Iterable[Replica], adapter: str) -> list[Replica]:
        return [r for r in replicas if self.serves(r.name, adapter)]

    def credit(self, candidates: Sequence[Candidate], adapter: str) -> None:
        """Count a resident adapter as `affinity_tokens` cached prompt tokens (prefix-aware policies)."""
        bonus = self.cfg.affinity_tokens
        if not bonus:
            return
        for c in candidates:
            if adapter in self.resident.get(c.replica.name, ()):
                c.matched_tokens += bonus

    def routed(self, replica: str, adapter: str) -> None:
        """A request for `adapter` went to `replica`: its weights are resident there now."""
        lru = self.resident.setdefault(replica, OrderedDict())
        lru[adapter] = None
        lru.move_to_end(adapter)
        while len(lru) > self.slots:
            lru.popitem(last=False)

    def learn(self, replica: str, bases: list[str], adapters: list[str], max_len: int | None) -> None:
        self.learned[replica] = frozenset(adapters)
        # What the engine lists now is what it has: loads it lost (a restart) are forgotten.
        self.loaded.pop(replica, None)
        if bases:
            self.base_names = self.base_names | frozenset(bases)
        if max_len is not None:
            self.max_model_len = max_len

    def forget(self, replica: str) -> None:
        """The replica left (or restarted, with nothing loaded): drop what was known of it."""
        self.learned.pop(replica, None)
        self.loaded.pop(replica, None)
        self.resident.pop(replica, None)
        for key in [k for k in self._failed if k[0] == replica]:
            del self._failed[key]

    # -- loading on demand --------------------------------------------------------------------
    async def ensure(self, replica: Replica, adapter: str, session: aiohttp.ClientSession) -> bool:
        """Make sure `replica` serves `adapter`, loading it there if needed; False if it cannot."""
        if self.has(replica.name, adapter):
            return True
        if not self.cfg.load_on_demand or adapter not in self.declared:
            return False
        key = (replica.name, adapter)
        failed_at = self._failed.get(key)
        if failed_at is not None and time.monotonic() - failed_at < self.cfg.load_retry_s:
            return False
        loading = self._loading.get(key)
        if loading is None:
            loading = asyncio.ensure_future(self._load(replica, adapter, session))
            self._loading[key] = loading
            loading.add_done_callback(lambda _: self._loading.pop(key, None))
        # Shielded: one client going away must not cancel a load other requests wait for.
        return await asyncio.shield(loading)

    async def _load(self, replica: Replica, adapter: str, session: aiohttp.ClientSession) -> bool:
        engine = self.pool.dialect
        path = engine.lora_load_path if engine is not None else "/v1/load_lora_adapter"
        body = {"lora_name": adapter, "lora_path": self.declared[adapter].path}
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.cfg.load_timeout_s):
                async with session.post(replica.url + path, json=body) as resp:
                    text = (await resp.content.read(4096)).decode(errors="replace")
                    status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return self._load_failed(replica, adapter, f"{type(exc).__name__}: {exc}")
        if (engine is not None and engine.lora_loaded(status, text)) or (engine is None and status == 200):
            self.loaded.setdefault(replica.name, set()).add(adapter)
            self._failed.pop((replica.name, adapter), None)
            self.loads += 1
            log.info(
                "pool %s: adapter %s loaded on %s in %.2f s",
                self.pool.name,
                adapter,
                replica.name,
                time.monotonic() - started,
            )
            return True
        return self._load_failed(replica, adapter, f"status {status}: {text[:200]}")

    def _load_failed(self, replica: Replica, adapter: str, why: str) -> bool:
        self._failed[(replica.name, adapter)] = time.monotonic()
        self.load_failures += 1
        log.warning(
            "pool %s: loading adapter %s on %s failed: %s", self.pool.name, adapter, replica.name, why
        )
        return False


class LoraWatch:
    """The HTTP side of the pools' LoRA facts: `/v1/models` discovery and on-demand loads."""

    def __init__(self, loras: Iterable[PoolLora], tls: ssl.SSLContext | None = None) -> None:
        self.loras = list(loras)
        self._tls = tls  # the upstream TLS settings, when they are not the defaults
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made lazily: it must belong to the running loop
            connector = aiohttp.TCPConnector(ssl=self._tls if self._tls is not None else True)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def start(self) -> None:
        for lora in self.loras:
            if lora.cfg.discover:
                self._tasks.append(asyncio.create_task(self._discover(lora), name=f"lora {lora.pool.name}"))
            elif lora.max_model_len is None:
                task = asyncio.create_task(self._context_length(lora), name=f"length {lora.pool.name}")
                self._tasks.append(task)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _discover(self, lora: PoolLora) -> None:
        while True:
            replicas = [r for r in lora.pool.replicas.values() if r.healthy]
            await asyncio.gather(*(self.read_models(lora, r) for r in replicas))
            await asyncio.sleep(lora.cfg.discover_interval_s)

    async def _context_length(self, lora: PoolLora) -> None:
        """A pool that does not discover adapters still learns its engines' `max_model_len` (for the
        model list) from the first healthy replica's `/v1/models` that states it; then it stops."""
        delay = LENGTH_POLL_S
        while lora.max_model_len is None:
            for replica in [r for r in lora.pool.replicas.values() if r.healthy]:
                if await self.read_models(lora, replica, adapters=False) and lora.max_model_len is not None:
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, LENGTH_POLL_MAX_S)  # engines that never state it are asked less

    async def read_models(self, lora: PoolLora, replica: Replica, adapters: bool = True) -> bool:
        """Read one replica's `/v1/models` into its pool's facts (with `adapters` false: its context
        length alone); False when that failed."""
        pool = lora.pool
        try:
            async with asyncio.timeout(min(5.0, lora.cfg.discover_interval_s)):
                async with self.session.get(replica.url + "/v1/models") as resp:
                    if resp.status != 200:
                        raise ValueError(f"status {resp.status}")
                    body = await _read_bounded(resp, MAX_MODELS_BODY)
            bases, names, max_len = parse_models(body)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            log.debug("pool %s: reading /v1/models of %s failed: %s", pool.name, replica.name, exc)
            return False
        if pool.replicas.get(replica.name) is not replica:  # replaced while we read
            return True
        if adapters:
            lora.learn(replica.name, bases, names, max_len)
        elif max_len is not None:
            lora.max_model_len = max_len
        return True


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    data = bytearray()
    async for chunk in resp.content.iter_chunked(65536):
        data += chunk
        if len(data) > limit:
            raise ValueError(f"body larger than {limit} bytes")
    return bytes(data)
