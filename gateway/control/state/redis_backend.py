"""Redis-shared state for several gateway instances, kept off the request path.

Per instance, one background task syncs every `sync_interval_s` and another reads the prefix stream:
- in-flight load: the instance rewrites its own per-replica counts in one MULTI (so readers never
  see half of them) under a per-instance key with a TTL of `instance_ttl_s`; live instances are
  listed in a sorted set scored by expiry. The sum over the other live instances lands in each
  `Replica.remote_inflight_*`. A gateway that dies stops refreshing and its counts expire.
- prefix index: blocks learned locally are appended to a capped stream within milliseconds of
  the routing decision (batched, deduplicated); every instance reads the stream with a blocking
  read from where it left off and merges the others' entries into its own index, so a prefix
  routed by one gateway is known to the others before its next request typically arrives.
- operator settings: route weights (a hash, one field per route rule) and drained replicas (a
  hash, one field per pool and URL); an admin change writes it at once, the other instances
  adopt it on their next sync, and an instance that starts later adopts the fleet's.
- rate limits: token buckets, charged in one Lua script, so N gateways never overshoot a
  shared limit (several buckets are charged all or none).
Replicas are identified across instances by (pool, URL), not by their local names.

When Redis is unreachable the gateway serves from local state (remote load counts as 0), logs a
warning once, and retries each interval. On reconnect it pushes settings changed meanwhile,
republishes its whole prefix index, and rereads the stream (from the start if Redis lost it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from gateway.config import EndpointConfig, StateConfig, check_weight
from gateway.control.state.base import Bucket, StateBackend
from gateway.routing.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from gateway.fleet.fleet import Fleet
    from gateway.routing.rollout import Rollouts

log = logging.getLogger(__name__)

# Entries (one per replica per sync tick, deduplicated): minutes of history at 5 ticks/s, bounded
# memory (a hot fleet's entries are mostly the few blocks that are new since the last tick).
STREAM_MAXLEN = 20_000
STREAM_IDLE_TTL_MS = 600_000  # a fleet idle this long has nothing worth replaying
MAX_OUTBOX_BLOCKS = 500_000  # beyond this the outbox is dropped and the next sync sends a snapshot
READ_BATCH = 1000
READ_BLOCK_MS = 500  # below the socket timeout
FLUSH_GAP_S = 0.005  # learned blocks go out this soon after a routing decision, batched
# Token buckets as in gateway.admission.limits, on Redis' clock (one clock for every gateway). KEYS: the
# buckets; ARGV: amount, rate, capacity per bucket. All pay or none does; returns each one's wait.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local levels, waits, blocked = {}, {}, false
for i = 1, #KEYS do
  local amount, rate, cap = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  local v = redis.call('HMGET', KEYS[i], 'level', 'stamp')
  local level, stamp = tonumber(v[1]), tonumber(v[2])
  if level == nil or stamp == nil then level, stamp = cap, now end
  level = math.min(cap, level + math.max(0, now - stamp) * rate)
  levels[i] = level
  local need = math.min(amount, cap) - level
  if need > 0 then waits[i] = tostring(need / rate); blocked = true else waits[i] = '0' end
end
if not blocked then
  for i = 1, #KEYS do
    local amount, rate, cap = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
    local level = levels[i] - amount
    redis.call('HSET', KEYS[i], 'level', tostring(level), 'stamp', tostring(now))
    -- A missing bucket is a full one: keep it only until it would have refilled.
    redis.call('PEXPIRE', KEYS[i], math.ceil(((cap - level) / rate + 1) * 1000))
  end
end
return waits
"""
_DOWN = (RedisError, OSError, asyncio.TimeoutError)
# XREAD's answer: per stream, its name and (entry id, fields) pairs.
_StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
_StreamReply = list[tuple[bytes, _StreamEntries]]


class SharedPrefixIndex(PrefixIndex):
    """A PrefixIndex that journals what it learns locally; what `merge` imports is not journaled."""

    def __init__(self, base: PrefixIndex, pool: str, backend: RedisState) -> None:
        super().__init__(base.default_capacity, base.speculative_ttl_s, prefix_closed=base.prefix_closed)
        self._pool = pool
        self._backend = backend

    def record(self, replica: str, block_hashes: Sequence[int], speculative: bool = False) -> None:
        super().record(replica, block_hashes, speculative)
        if not speculative and block_hashes:
            self._backend.journal(self._pool, replica, block_hashes)

    def merge(self, replica: str, block_hashes: Sequence[int]) -> None:  # type: ignore[override]
        PrefixIndex.record(self, replica, list(block_hashes)[::-1])


class RedisState(StateBackend):
    name = "redis"

    def __init__(self, cfg: StateConfig, fleet: Fleet, router: Rollouts) -> None:
        super().__init__(cfg, fleet, router)
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        # Blocking pool: a burst of counter calls waits for a connection instead of failing.
        pool = aioredis.BlockingConnectionPool.from_url(
            cfg.redis_url, max_connections=64, timeout=2.0, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        self._take = self._redis.register_script(_TAKE)
        self._connected = False
        self._ever_connected = False
        self._warned = False
        self.last_error: str | None = None
        self.resyncs = 0
        self.peers = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._wake = asyncio.Event()  # set when there are learned blocks to send
        self._stream_generation = 0  # bumped when the read position is reset
        self._stream_id = b"0-0"
        # Operator settings (weights, drain): (hash, field) -> raw value last applied or written,
        # and those written while Redis was away.
        self._seen: dict[tuple[str, str], bytes] = {}
        self._dirty: dict[tuple[str, str], bytes] = {}
        self._outbox: dict[tuple[str, str], list[Sequence[int]]] = {}  # (pool, replica name) -> prompts
        self._outbox_blocks = 0
        self._snapshot_due = False
        self._indexes: dict[str, SharedPrefixIndex] = {}  # per pool, what `share_index` handed out

    def share_index(self, pool: str, index: PrefixIndex) -> PrefixIndex:
        shared = self._indexes[pool] = SharedPrefixIndex(index, pool, self)
        return shared

    # -- keys -------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return ":".join((self.cfg.key_prefix, *parts))

    @property
    def _instances_key(self) -> str:
        return self._key("instances")

    @property
    def _stream_key(self) -> str:
        return self._key("prefix")

    @property
    def _weights_key(self) -> str:
        return self._key("weights")

    @property
    def _drain_key(self) -> str:
        return self._key("drain")

    @property
    def _endpoints_key(self) -> str:
        return self._key("endpoints")

    def _inflight_key(self, instance: str) -> str:
        return self._key("inflight", instance)

    # -- lifecycle --------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._connected

    async def start(self) -> None:
        try:
            await self._connect()
        except _DOWN as exc:
            self._down(exc)
        self._tasks = [
            asyncio.create_task(self._run(), name="kvgate-state-sync"),
            asyncio.create_task(self._read_stream(), name="kvgate-state-prefix-reader"),
        ]

    async def stop(self) -> None:
        # The flag, not only the cancellation: redis-py can turn a cancellation that lands inside
        # a command into a ConnectionError, which the loop takes for an outage and carries on.
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._connected:
            # Leave at once rather than after the TTL: the others stop counting our load now.
            with contextlib.suppress(*_DOWN):
                async with asyncio.timeout(2.0):
                    pipe = self._redis.pipeline(transaction=True)
                    pipe.delete(self._inflight_key(self.instance))
                    pipe.zrem(self._instances_key, self.instance)
                    await pipe.execute()
        await self._redis.aclose(close_connection_pool=True)

    async def _run(self) -> None:
        """A full sync every interval; in between, learned blocks are sent as soon as they come."""
        loop = asyncio.get_running_loop()
        next_sync = loop.time() + self.cfg.sync_interval_s
        while not self._stopping:
            wait = next_sync - loop.time()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
            self._wake.clear()
            try:
                if loop.time() >= next_sync:
                    next_sync = loop.time() + self.cfg.sync_interval_s
                    if not self._connected:
                        await self._connect()
                    await self._sync()
                elif self._connected:
                    await self._send_blocks()
            except _DOWN as exc:
                self._down(exc)
            except Exception:  # a bug here must not end sharing for good
                log.exception("state sync failed")
            await asyncio.sleep(FLUSH_GAP_S)

    async def _read_stream(self) -> None:
        """Merge the other instances' learned blocks as they arrive (a blocking read)."""
        while not self._stopping:
            if not self._connected:
                await asyncio.sleep(self.cfg.sync_interval_s)
                continue
            generation = self._stream_generation
            try:
                reply = await self._redis.xread(
                    {self._stream_key: self._stream_id}, count=READ_BATCH, block=READ_BLOCK_MS
                )
            except _DOWN:
                await asyncio.sleep(self.cfg.sync_interval_s)  # the sync loop notices and reconnects
                continue
            except Exception:
                log.exception("reading shared prefix entries failed")
                await asyncio.sleep(self.cfg.sync_interval_s)
                continue
            if reply and generation == self._stream_generation:
                # redis-py types replies for either decode_responses; this client decodes none.
                self._merge(cast("_StreamReply", reply)[0][1])

    def _down(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        if not self._warned:
            self._warned = True
            log.warning(
                "redis state at %s unreachable (%s): serving from local state until it returns",
                self.cfg.redis_url,
                self.last_error,
            )
        self._connected = False
        self._outbox.clear()
        self._outbox_blocks = 0
        for pool in self.fleet.pools.values():
            for replica in pool.replicas.values():
                replica.remote_inflight_requests = 0
                replica.remote_inflight_tokens = 0

    async def _connect(self) -> None:
        """(Re)join: push what changed while away, then let the next sync pull the rest."""
        await self._redis.ping()
        pipe = self._redis.pipeline(transaction=True)
        for (key, field), raw in self._dirty.items():
            pipe.hset(key, field, raw)
        for model, rules in self.router.routes.items():
            for i, rule in enumerate(rules):
                if len(rule.pools) > 1:  # seed the fleet's weights from this config if it has none
                    weights = _weights(dict(zip(rule.pools, rule.weights, strict=True)))
                    raw = orjson.dumps({**weights, "by": "config", "at": time.time()})
                    pipe.hsetnx(self._weights_key, f"{model}\t{i}", raw)
        pipe.xinfo_stream(self._stream_key)
        results = await pipe.execute(raise_on_error=False)
        last = results[-1]
        if isinstance(last, Exception) or _stream_id(_field(last, "last-generated-id")) < _stream_id(
            self._stream_id
        ):
            self._stream_id = b"0-0"  # the stream is new or Redis lost it: replay what it holds
            self._stream_generation += 1
        self._dirty.clear()
        # Whatever was learned while away (or before the first connection) goes out whole.
        self._snapshot_due = True
        if self._ever_connected:
            self.resyncs += 1
            log.info("redis state at %s is back: resynchronizing", self.cfg.redis_url)
        self._connected = True
        self._ever_connected = True
        self._warned = False
        self.last_error = None

    # -- sync -------------------------------------------------------------------------
    async def _sync(self) -> None:
        now = time.time()
        own = self._own_inflight()
        ttl_ms = int(self.cfg.instance_ttl_s * 1000)
        key = self._inflight_key(self.instance)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(key)
        if own:
            pipe.hset(key, mapping=own)
            pipe.pexpire(key, ttl_ms)
        pipe.zadd(self._instances_key, {self.instance: now + self.cfg.instance_ttl_s})
        pipe.zremrangebyscore(self._instances_key, "-inf", now)
        pipe.zrange(self._instances_key, 0, -1)
        pipe.hgetall(self._weights_key)
        pipe.hgetall(self._endpoints_key)
        pipe.hgetall(self._drain_key)
        self._add_blocks(pipe)
        results = await pipe.execute()
        offset = 3 + 2 * bool(own)  # delete, [hset, pexpire], zadd, zremrangebyscore
        instances = [m.decode() for m in results[offset] if m.decode() != self.instance]
        self.peers = len(instances)
        self._apply_weights(results[offset + 1])
        self._apply_endpoints(results[offset + 2])  # before drain: a drain may name an added replica
        self._apply_drain(results[offset + 3])
        reads = self._redis.pipeline(transaction=False)
        for other in instances:
            reads.hgetall(self._inflight_key(other))
        self._apply_remote_inflight(await reads.execute())

    def _add_blocks(self, pipe: Any) -> None:
        """Queue the outbox's blocks (and a due snapshot) as stream entries on `pipe`."""
        if self._snapshot_due:
            self._snapshot_due = False
            self._queue_snapshot()
        batches = self._take_outbox()
        for (pool, url), prompts in batches.items():
            packed = array("Q", [h for p in prompts for h in p]).tobytes()
            lengths = ",".join(str(len(p)) for p in prompts)
            entry = {"i": self.instance, "p": pool, "u": url, "n": lengths, "h": packed}
            pipe.xadd(self._stream_key, entry, maxlen=STREAM_MAXLEN, approximate=True)
        if batches:
            pipe.pexpire(self._stream_key, STREAM_IDLE_TTL_MS)

    async def _send_blocks(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        self._add_blocks(pipe)
        if len(pipe):
            await pipe.execute()

    def _replica_by_url(self) -> dict[tuple[str, str], Any]:
        return {(p.name, r.url): r for p in self.fleet.pools.values() for r in p.replicas.values()}

    def _own_inflight(self) -> dict[FieldT, EncodableT]:
        return {
            f"{p.name}\t{r.url}": f"{r.inflight_requests} {r.inflight_tokens}"
            for p in self.fleet.pools.values()
            for r in p.replicas.values()
            if r.inflight_requests or r.inflight_tokens
        }

    def _apply_remote_inflight(self, loads: list[dict[bytes, bytes]]) -> None:
        totals: dict[str, tuple[int, int]] = {}
        for load in loads:
            for field, value in load.items():
                req, tok = value.split()
                r0, t0 = totals.get(field.decode(), (0, 0))
                totals[field.decode()] = (r0 + int(req), t0 + int(tok))
        for (pool, url), replica in self._replica_by_url().items():
            replica.remote_inflight_requests, replica.remote_inflight_tokens = totals.get(
                f"{pool}\t{url}", (0, 0)
            )

    def _merge(self, entries: _StreamEntries) -> None:
        replicas = self._replica_by_url()
        for entry_id, fields in entries:
            self._stream_id = entry_id
            if fields[b"i"].decode() == self.instance:
                continue
            replica = replicas.get((fields[b"p"].decode(), fields[b"u"].decode()))
            if replica is None:
                continue  # a replica this instance does not route to
            index = self._indexes.get(replica.pool)
            if index is None:
                continue  # a pool that shares nothing (precise mode)
            hashes = array("Q")
            hashes.frombytes(fields[b"h"])
            start = 0
            for n in fields[b"n"].decode().split(","):
                end = start + int(n)
                # A prompt's blocks as `record` would take them: head last, so it ends most recent.
                index.merge(replica.name, hashes[start:end][::-1])
                start = end

    # -- prefix journal ---------------------------------------------------------------
    def journal(self, pool: str, replica: str, block_hashes: Sequence[int]) -> None:
        """A block list learned locally, to be shared on the next sync."""
        if not self._connected:
            return  # everything is republished as a snapshot on reconnect
        self._outbox.setdefault((pool, replica), []).append(block_hashes)
        self._outbox_blocks += len(block_hashes)
        self._wake.set()
        if self._outbox_blocks > MAX_OUTBOX_BLOCKS:
            self._outbox.clear()
            self._outbox_blocks = 0
            self._snapshot_due = True

    def _queue_snapshot(self) -> None:
        for pool, index in self._indexes.items():
            for name in self.fleet.pools[pool].replicas:
                blocks = index.snapshot(name)  # oldest first
                if blocks:
                    # One "prompt" whose head is the most recent entry, as `merge` expects reversed.
                    self._outbox[(pool, name)] = [blocks[::-1]]

    def _take_outbox(self) -> dict[tuple[str, str], list[Sequence[int]]]:
        out: dict[tuple[str, str], list[Sequence[int]]] = {}
        for (pool, name), prompts in self._outbox.items():
            pools = self.fleet.pools
            replica = pools[pool].replicas.get(name) if pool in pools else None
            if replica is not None:
                out[(pool, replica.url)] = dedupe(prompts)
        self._outbox = {}
        self._outbox_blocks = 0
        return out

    # -- operator settings: route weights, endpoints, drain ----------------------------
    def _changed(self, key: str, stored: Mapping[bytes, bytes]) -> list[tuple[str, dict[str, Any]]]:
        """The fields of a settings hash that changed since last applied or written here."""
        out = []
        for raw_field, raw in stored.items():
            field = raw_field.decode()
            if self._seen.get((key, field)) != raw:
                self._seen[(key, field)] = raw
                out.append((field, orjson.loads(raw)))
        return out

    async def _publish(self, key: str, field: str, value: dict[str, Any], who: str) -> None:
        raw = orjson.dumps({**value, "by": who, "at": time.time()})
        self._seen[(key, field)] = raw
        if self._connected:
            try:
                await self._redis.hset(key, field, raw)
                return
            except _DOWN as exc:
                self._down(exc)
        self._dirty[(key, field)] = raw

    def _apply_weights(self, stored: Mapping[bytes, bytes]) -> None:
        router = self.router
        for field, data in self._changed(self._weights_key, stored):
            model, _, index = field.rpartition("\t")
            try:
                if router.weights(model, int(index)) == data["weights"]:
                    continue
                for weight in data["weights"].values():
                    check_weight(float(weight))  # whoever wrote Redis, held to the file's bounds
                router.set_weights(model, data["weights"], int(index))
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("shared weights for route %s rule %s not applied: %s", model, index, exc)
                continue
            log.info(
                "route %s rule %s weights %s (shared state, set by %s)",
                model,
                index,
                data["weights"],
                data["by"],
            )

    def _apply_endpoints(self, stored: Mapping[bytes, bytes]) -> None:
        replicas = self._replica_by_url()  # one field per (pool, url): no field sees another's change
        for field, data in self._changed(self._endpoints_key, stored):
            pool_name, _, url = field.partition("\t")
            pool = self.fleet.pools.get(pool_name)
            if pool is None:
                continue
            present = replicas.get((pool_name, url))
            endpoint = data["endpoint"]
            try:
                if endpoint is not None and present is None:
                    replica = self.fleet.add_endpoint(pool, EndpointConfig(**endpoint))
                    log.info(
                        "pool %s: added replica %s at %s (shared state, by %s)",
                        pool_name,
                        replica.name,
                        url,
                        data["by"],
                    )
                elif endpoint is None and present is not None and not present.managed:
                    self.fleet.unregister(pool, present.name)
                    log.info(
                        "pool %s: removed replica %s (shared state, by %s)",
                        pool_name,
                        present.name,
                        data["by"],
                    )
            except ValueError as exc:  # e.g. its name is taken here by another replica
                log.warning("shared endpoint %s of pool %s not applied: %s", url, pool_name, exc)

    def _apply_drain(self, stored: Mapping[bytes, bytes]) -> None:
        replicas = self._replica_by_url()
        for field, data in self._changed(self._drain_key, stored):
            pool, _, url = field.partition("\t")
            replica = replicas.get((pool, url))
            if replica is not None and replica.draining != data["draining"]:
                replica.draining = data["draining"]
                action = "drain" if data["draining"] else "undrain"
                log.info(
                    "pool %s: %s replica %s (shared state, by %s)", pool, action, replica.name, data["by"]
                )

    async def publish_weights(
        self, model: str, rule_index: int, weights: Mapping[str, float], who: str
    ) -> None:
        await self._publish(self._weights_key, f"{model}\t{rule_index}", _weights(weights), who)

    async def publish_routes(self, who: str) -> None:
        for model, rules in self.router.routes.items():
            for i, rule in enumerate(rules):
                if len(rule.pools) > 1:
                    await self.publish_weights(
                        model, i, dict(zip(rule.pools, rule.weights, strict=True)), who
                    )

    async def publish_drain(self, pool: str, url: str, draining: bool, who: str) -> None:
        await self._publish(self._drain_key, f"{pool}\t{url}", {"draining": draining}, who)

    async def publish_endpoint(self, pool: str, url: str, endpoint: dict[str, Any] | None, who: str) -> None:
        await self._publish(self._endpoints_key, f"{pool}\t{url}", {"endpoint": endpoint}, who)

    # -- rate limits ------------------------------------------------------------------
    async def take(self, charges: Sequence[Bucket]) -> list[float]:
        if self._connected and charges:
            args: list[float] = []
            for c in charges:
                args += [c.amount, c.rate, c.capacity]
            try:
                waits = await self._take(keys=[self._key("bucket", c.key) for c in charges], args=args)
                return [float(w) for w in waits]
            except _DOWN as exc:
                self._down(exc)
        return self.buckets.take(charges)

    def status(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "connected": self._connected,
            "instance": self.instance,
            "peers": self.peers,
            "resyncs": self.resyncs,
            "last_error": self.last_error,
        }


def dedupe(prompts: list[Sequence[int]]) -> list[Sequence[int]]:
    """Drop blocks a later prompt repeats: merging what is left in order leaves the same index
    entries, in the same recency order, as merging every prompt (shared prefixes repeat a lot)."""
    seen: set[int] = set()
    out: list[Sequence[int]] = []
    for prompt in reversed(prompts):
        rest = [h for h in prompt if h not in seen]
        if rest:
            seen.update(rest)
            out.append(rest)
    return out[::-1]


def _weights(weights: Mapping[str, float]) -> dict[str, Any]:
    return {"weights": {k: float(v) for k, v in weights.items()}}


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _field(info: Mapping[Any, Any], name: str) -> Any:
    return info[name] if name in info else info[name.encode()]
