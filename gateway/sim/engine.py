"""The engine core of one simulated replica: vLLM V1-style iteration-level scheduling over a KV block pool.

Each step admits work under a token budget (one token per decoding sequence, prefill chunks for the rest),
allocates KV blocks (preempting the newest, or lowest-priority, request when memory runs out), asks the cost
model how long the step takes, and at the step's end advances every scheduled request. Time is `Engine.now`
in simulated seconds: `run_until_idle`/`advance_to` step it virtually (deterministic tests, benchmarks), and
`RealtimeRunner` paces the same steps on the wall clock divided by a speedup factor.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.sim.cost_model import CostModel, StepShape
from gateway.sim.cpu_tier import CpuTier
from gateway.sim.device import SharedDevice, TimeSlicedGPU
from gateway.sim.kv_cache import BlockPool, block_hashes, chain_hash, root_hash
from gateway.sim.lora import AdapterSlots, LoraConfig
from gateway.sim.metrics import EngineMetrics
from gateway.sim.profiles import Profile

NEW, PENDING, TRANSFER, WAITING, RUNNING, FINISHED = (
    "new",
    "pending",
    "transfer",
    "waiting",
    "running",
    "finished",
)


class Sink(Protocol):
    def on_output(self, req: Request) -> None: ...


@dataclass(slots=True)
class EngineConfig:
    profile: Profile
    kv_cache_dtype: str = "auto"
    tp: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks: int | None = None  # direct override (tests)
    max_model_len: int = 131072
    scheduling_policy: str = "fcfs"  # or "priority"
    higher_priority_first: bool = False  # SGLang semantics
    kv_lease_timeout_s: float = 30.0  # prefill-side blocks held for a remote decode
    lora: LoraConfig | None = None  # --enable-lora and its limits
    gpu_share: int = 1  # a static 1/gpu_share of a time-sliced GPU (CostModel); see also SharedDevice
    kv_offloading_size: float | None = None  # GiB of CPU KV cache (--kv-offloading-size): the CPU tier


class Request:
    __slots__ = (
        "aborted",
        "arrival",
        "blocks",
        "cpu_next",
        "finish_reason",
        "finished_at",
        "first_token_at",
        "hashes",
        "id",
        "kv_lease",
        "lora",
        "max_tokens",
        "num_cached",
        "num_computed",
        "num_output",
        "num_preemptions",
        "num_registered",
        "output_ids",
        "prefill_target",
        "priority",
        "prompt_ids",
        "prompt_len",
        "ready_at",
        "remote_kv",
        "remote_kv_loaded",
        "root",
        "scheduled_at",
        "sink",
        "sort_key",
        "state",
        "transfer_s",
    )

    def __init__(
        self,
        req_id: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        block_size: int = 16,
        remote_kv: bool = False,
        kv_lease: bool = False,
        sink: Sink | None = None,
        output_ids: Callable[[int, int], list[int]] | None = None,
        lora: str | None = None,
    ) -> None:
        self.id = req_id
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens
        self.priority = priority
        self.lora = lora  # the LoRA adapter serving it: its blocks are hashed apart from the base model's
        self.hashes = block_hashes(prompt_ids, block_size, cache_salt, lora)  # grows with output blocks
        self.root = root_hash(cache_salt, lora)
        # Token ids of outputs [a, b): lets full blocks of generated tokens enter the prefix cache, as in
        # vLLM, so that the next turn of a conversation hits on this answer too.
        self.output_ids = output_ids
        self.remote_kv = remote_kv  # decode leg: the prompt's KV comes from a prefill replica
        self.remote_kv_loaded = False
        self.kv_lease = kv_lease  # prefill leg: keep the blocks for the decode replica to pull
        self.sink = sink
        self.state = NEW
        self.aborted = False
        self.blocks: list[int] = []
        self.num_computed = 0
        self.num_registered = 0
        self.cpu_next = 0  # the first prompt block the CPU tier has not considered (next_stored_chunk_idx)
        self.num_output = 0
        self.num_cached = 0
        self.num_preemptions = 0
        self.prefill_target = self.prompt_len
        self.arrival = self.ready_at = 0.0
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.transfer_s = 0.0
        self.sort_key: tuple[Any, ...] = ()

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


class _WaitQueue:
    """FCFS deque or priority heap; aborted entries are skipped lazily."""

    def __init__(self, priority: bool) -> None:
        self._priority = priority
        self._dq: deque[Request] = deque()
        self._heap: list[tuple[tuple[Any, ...], Request]] = []
        self.live = 0

    def push(self, req: Request, front: bool = False) -> None:
        self.live += 1
        if self._priority:
            heapq.heappush(self._heap, (req.sort_key, req))
        elif front:
            self._dq.appendleft(req)
        else:
            self._dq.append(req)

    def peek(self) -> Request | None:
        if self._priority:
            while self._heap and self._heap[0][1].aborted:
                heapq.heappop(self._heap)
            return self._heap[0][1] if self._heap else None
        while self._dq and self._dq[0].aborted:
            self._dq.popleft()
        return self._dq[0] if self._dq else None

    def pop(self) -> Request:
        self.live -= 1
        return heapq.heappop(self._heap)[1] if self._priority else self._dq.popleft()

    def requests(self) -> list[Request]:
        items = [r for _, r in self._heap] if self._priority else list(self._dq)
        return [r for r in items if not r.aborted]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = c = config
        self.cost = CostModel(c.profile, c.kv_cache_dtype, c.tp, c.gpu_share)
        self.block_size = c.block_size
        num_blocks = c.num_gpu_blocks or self.cost.num_gpu_blocks(
            c.block_size, c.gpu_memory_utilization, c.kv_cache_memory_bytes
        )
        self.pool = BlockPool(num_blocks, c.block_size, c.enable_prefix_caching)
        self.cpu: CpuTier | None = None
        if c.kv_offloading_size and c.enable_prefix_caching:
            block_bytes = self.cost.kv_bpt * c.block_size
            blocks = int(c.kv_offloading_size * (1 << 30)) // block_bytes
            self.cpu = CpuTier(blocks, self.cost.host_load_s_per_token, c.block_size, block_bytes)
        self.now = 0.0
        self.metrics = EngineMetrics()
        self.running: list[Request] = []
        self.waiting = _WaitQueue(c.scheduling_policy == "priority")
        self._pending: list[tuple[float, int, Request]] = []  # not yet past the front end
        self._pending_live = 0  # the entries of _pending not aborted
        self._leases: dict[str, Request] = {}
        self._lease_heap: list[tuple[float, str]] = []
        self._seq = itertools.count()
        # The KV link of a decode replica: vLLM posts the read of every request whose blocks it allocated
        # (NixlConnectorWorker.start_load_kv) and UCX moves them together, so transfers in flight share
        # the link's bandwidth (processor sharing) instead of queueing for it one at a time.
        self._link = TimeSlicedGPU()
        self._transfers: dict[int, tuple[float, Request]] = {}  # link job -> (start, request)
        self.on_output: Callable[[list[Request]], None] | None = None
        self.on_step: Callable[[], None] | None = None  # after each step (KV events flush)
        self.steps = 0
        self.last_step_s = 0.0
        lc = c.lora
        self.lora_slots = AdapterSlots(lc, c.profile.model, self.cost.tp) if lc and lc.enabled else None
        self.lora_running: dict[str, int] = {}  # adapter -> running requests using it
        self.stall_s = 0.0  # engine time owed to work between steps (a dynamic adapter load)

    # ---- requests ------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self.waiting.live + self._pending_live

    def add_request(self, req: Request, at: float | None = None) -> None:
        req.arrival = self.now if at is None else at
        req.ready_at = req.arrival + self.cost.frontend_time(req.prompt_len)
        p = req.priority if not self.config.higher_priority_first else -req.priority
        req.sort_key = (p, req.arrival, next(self._seq))
        heapq.heappush(self._pending, (req.ready_at, next(self._seq), req))
        self._pending_live += 1
        req.state = PENDING

    def abort(self, req: Request) -> None:
        if req.aborted or req.state == FINISHED:
            return
        req.aborted = True  # in _pending or the wait queue it is skipped when it surfaces
        if req.state == RUNNING:
            self.running.remove(req)
            self._lora_release(req)
        elif req.state == WAITING:
            self.waiting.live -= 1
        elif req.state in (PENDING, TRANSFER):
            self._pending_live -= 1
            for job, (_, r) in list(self._transfers.items()):
                if r is req:  # its share of the link goes to the others
                    del self._transfers[job]
                    self._link.cancel(job)
        if req.blocks:
            self.pool.free(req.blocks)
            req.blocks = []
        req.state = FINISHED
        req.finish_reason = "abort"

    def release_lease(self, req_id: str) -> bool:
        req = self._leases.pop(req_id, None)
        if req is None:
            return False
        self.pool.free(req.blocks)
        req.blocks = []
        return True

    @property
    def leased(self) -> dict[str, Request]:
        return self._leases

    # ---- clock ---------------------------------------------------------------------------------
    def tick(self) -> None:
        """Surface what became ready by `now`: requests past the front end, finished KV transfers, leases."""
        now = self.now
        pend = self._pending
        while pend and pend[0][0] <= now:
            _, _, req = heapq.heappop(pend)
            if req.aborted:
                continue
            if req.remote_kv:
                hit = len(self.pool.match_prefix(req.hashes)) * self.block_size
                job = next(self._seq)
                self._link.start(job, self.cost.transfer_time(max(req.prompt_len - hit, 0)), req.ready_at)
                self._transfers[job] = (req.ready_at, req)
                req.state = TRANSFER
                continue
            self._to_waiting(req)
        self._link.advance(now)
        for job in [j for j in self._transfers if j in self._link.done]:
            start, req = self._transfers.pop(job)
            req.transfer_s = self._link.done.pop(job) - start
            req.remote_kv_loaded = True
            self.metrics.kv_transfer_time.observe(req.transfer_s)
            self._to_waiting(req)
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, rid = heapq.heappop(self._lease_heap)
            self.release_lease(rid)

    def _to_waiting(self, req: Request) -> None:
        req.state = WAITING
        self._pending_live -= 1
        self.waiting.push(req)

    def _next_arrival(self) -> float | None:
        """When the next request becomes schedulable: past its front end, or its KV transfer done."""
        times = [
            t
            for t in (self._pending[0][0] if self._pending else None, self._link.next_end())
            if t is not None
        ]
        return min(times) if times else None

    def has_work(self) -> bool:
        return bool(self.running) or self.waiting.peek() is not None

    def next_event_time(self) -> float | None:
        times = []
        nxt = self._next_arrival()
        if nxt is not None:
            times.append(nxt)
        if self._lease_heap:
            times.append(self._lease_heap[0][0])
        return min(times) if times else None

    # ---- one step ------------------------------------------------------------------------------
    def _victim(self) -> Request:
        if self.waiting._priority:
            return max(self.running, key=lambda r: r.sort_key)
        return self.running[-1]

    def _lora_release(self, req: Request) -> None:
        if req.lora is not None:
            left = self.lora_running[req.lora] - 1
            if left:
                self.lora_running[req.lora] = left
            else:
                del self.lora_running[req.lora]

    def _lora_blocked(self, req: Request) -> bool:
        """vLLM's --max-loras: a batch uses at most that many adapters."""
        return (
            req.lora is not None
            and req.lora not in self.lora_running
            and self.lora_slots is not None
            and len(self.lora_running) >= self.lora_slots.max_loras
        )

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._lora_release(victim)
        self.pool.free(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        victim.num_registered = 0
        victim.prefill_target = victim.prompt_len + victim.num_output
        victim.num_preemptions += 1
        victim.state = WAITING
        self.metrics.num_preemptions += 1
        self.waiting.push(victim, front=True)

    def schedule(self) -> tuple[dict[Request, int], StepShape]:
        c = self.config
        bs = self.block_size
        pool = self.pool
        budget = c.max_num_batched_tokens
        sched: dict[Request, int] = {}
        preempted = False
        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            req = running[i]
            n = (
                min(req.prefill_target - req.num_computed, budget)
                if req.num_computed < req.prefill_target
                else 1
            )
            need = (req.num_computed + n + bs - 1) // bs - len(req.blocks)
            ok = True
            while need > 0:
                new = pool.allocate(need)
                if new is not None:
                    req.blocks += new
                    break
                victim = self._victim()
                if victim in sched:
                    budget += sched.pop(victim)
                vi = running.index(victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    ok = False
                    break
                if vi < i:
                    i -= 1
            if not ok:
                continue  # req left `running`: the same index is now the next request
            sched[req] = n
            budget -= n
            i += 1

        admitted_tokens = 0
        skipped: list[Request] = []
        if not preempted:
            waiting = self.waiting
            while budget > 0 and len(running) < c.max_num_seqs:
                head = waiting.peek()
                if head is None:
                    break
                req = head
                if req.lora is not None and self._lora_blocked(req):
                    skipped.append(waiting.pop())  # like vLLM V1: skip it, keep scanning
                    continue
                target = req.prefill_target
                hit = pool.match_prefix(req.hashes[: (target - 1) // bs])
                loaded = 0
                if self.cpu is not None and not req.remote_kv_loaded:
                    loaded = self.cpu.lookup(req.hashes, len(hit), (target - 1) // bs)
                    self.cpu.touch(req.hashes)  # all of them, GPU hit included, admitted or not
                start = (len(hit) + loaded) * bs
                if req.remote_kv_loaded:
                    start = target - 1  # the rest arrived from the prefill replica
                n = target - start
                if not c.enable_chunked_prefill and n > budget:
                    break
                n = min(n, budget)
                need = (start + n + bs - 1) // bs - len(hit)
                if need > pool.num_free - pool.evictable_among(hit):
                    break
                waiting.pop()
                pool.touch(hit)
                req.blocks = hit + (pool.allocate(need) or [])
                req.num_computed = start
                req.num_registered = len(hit)
                req.state = RUNNING
                if req.lora is not None:
                    self.lora_running[req.lora] = self.lora_running.get(req.lora, 0) + 1
                m = self.metrics
                m.prefix_cache_queries += req.prompt_len
                m.prefix_cache_hits += len(hit) * bs
                # Loaded through the KV connector, not computed: from a prefill replica or the CPU tier.
                external = start - len(hit) * bs
                if req.remote_kv or self.cpu is not None:
                    m.external_prefix_cache_queries += req.prompt_len - len(hit) * bs
                    m.external_prefix_cache_hits += external
                if self.cpu is not None and loaded:
                    self.stall_s += self.cpu.load(req.hashes[len(hit) : len(hit) + loaded])
                    # Only a load moves vLLM's store cursor past the hit: a request served from the GPU
                    # alone stores its GPU-hit blocks too, those the CPU tier has lost.
                    req.cpu_next = max(req.cpu_next, len(hit) + loaded)
                if req.scheduled_at is None:
                    req.scheduled_at = self.now
                    req.num_cached = start  # vLLM counts connector-loaded tokens as cached too
                    m.queue_time.observe(self.now - req.ready_at)
                    admitted_tokens += req.prompt_len
                running.append(req)
                sched[req] = n
                budget -= n
            for req in reversed(skipped):
                waiting.push(req, front=True)

        # Work owed between steps delays the next step that runs; an idle engine owes nothing.
        stall, self.stall_s = (self.stall_s if sched else 0.0), 0.0
        if self.lora_slots is not None and self.lora_running:
            stall += self.lora_slots.activate(r.lora for r in sched if r.lora is not None)
        p_tok = d_seqs = d_ctx = p_ctx = 0
        pairs = 0.0
        for req, n in sched.items():
            if req.num_computed < req.prefill_target:
                p_tok += n
                pairs += n * (req.num_computed + n / 2)
                p_ctx += req.num_computed + n
            else:
                d_seqs += 1
                d_ctx += req.num_computed + 1
        shape = StepShape(p_tok, pairs, p_ctx, d_seqs, d_ctx, admitted_tokens, len(sched), stall)
        return sched, shape

    def complete(self, sched: dict[Request, int], step_s: float) -> list[Request]:
        """Apply a step that ended at `self.now`; returns the requests that produced a token."""
        bs = self.block_size
        m = self.metrics
        now = self.now
        outputs: list[Request] = []
        decoded = 0
        for req, n in sched.items():
            if req.aborted:
                continue
            prefilling = req.num_computed < req.prefill_target
            req.num_computed += n
            if req.num_computed // bs > req.num_registered:
                self._register(req)
            if prefilling:
                if req.num_computed < req.prefill_target:
                    continue  # more chunks to go
            else:
                decoded += 1
            req.num_output += 1
            outputs.append(req)
            if req.first_token_at is None:
                req.first_token_at = now
                m.ttft.observe(now - req.arrival)
                m.prefill_time.observe(now - (req.scheduled_at or now))
                m.prompt_tokens += req.prompt_len
            if req.num_output >= req.max_tokens:
                self._finish(req)
        if decoded:
            m.itl.observe(step_s, decoded)
        m.generation_tokens += len(outputs)
        return outputs

    def _register(self, req: Request) -> None:
        """Publish the request's blocks whose every token now has its KV computed."""
        bs = self.block_size
        plen = req.prompt_len
        hashes = req.hashes
        full = req.num_computed // bs
        if req.output_ids is None:
            full = min(full, len(hashes))
        for b in range(req.num_registered, full):
            lo, hi = b * bs, (b + 1) * bs
            tokens = list(req.prompt_ids[lo:hi]) if lo < plen else []
            if hi > plen:
                tokens += req.output_ids(max(lo - plen, 0), hi - plen)  # type: ignore[misc]
            if b == len(hashes):
                hashes.append(chain_hash(hashes[b - 1] if b else req.root, tokens))
            self.pool.register(req.blocks[b], hashes[b], hashes[b - 1] if b else None, tokens)
        req.num_registered = max(req.num_registered, full)
        # This step's store job: vLLM offloads prompt blocks only, by default.
        stop = min(full, plen // bs)
        if self.cpu is not None and stop > req.cpu_next:
            self.cpu.store(hashes[req.cpu_next : stop])
            req.cpu_next = stop

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        self._lora_release(req)
        req.state = FINISHED
        req.finished_at = self.now
        req.finish_reason = req.finish_reason or "length"
        m = self.metrics
        m.requests_finished += 1
        m.e2e.observe(self.now - req.arrival)
        m.decode_time.observe(self.now - (req.first_token_at or self.now))
        if req.kv_lease:
            self._leases[req.id] = req
            heapq.heappush(self._lease_heap, (self.now + self.config.kv_lease_timeout_s, req.id))
        else:
            self.pool.free(req.blocks)
            req.blocks = []

    def _after_step(self, outputs: list[Request]) -> None:
        self.steps += 1
        if outputs and self.on_output is not None:
            self.on_output(outputs)
        if self.on_step is not None:
            self.on_step()

    def step(self) -> float:
        """One virtual step: schedule at `now`, advance by its duration, apply it. Returns the duration."""
        self.tick()
        sched, shape = self.schedule()
        if not sched:
            return 0.0
        t = self.cost.step_time(shape)
        self.now += t
        self.last_step_s = t
        self._after_step(self.complete(sched, t))
        return t

    # ---- virtual clock drivers -----------------------------------------------------------------
    def advance_to(self, t: float) -> None:
        """Run steps (and idle gaps) until simulated time `t`; a step in progress may overshoot it."""
        while self.now < t:
            if self.step():
                continue
            nxt = self.next_event_time()
            self.now = t if nxt is None or nxt > t else max(self.now, nxt)

    def run_until_idle(self, limit_s: float = 1e6) -> None:
        while self.now < limit_s:
            if self.step():
                continue
            nxt = self._next_arrival()
            if nxt is None:
                return  # nothing will change any more (only leases left, or work that cannot fit)
            self.now = max(self.now, nxt)

    def state(self) -> dict[str, Any]:
        p = self.pool
        return {
            "now_s": self.now,
            "running": len(self.running),
            "waiting": self.num_waiting,
            "num_gpu_blocks": p.num_blocks,
            "block_size": p.block_size,
            "used_blocks": p.num_used,
            "free_blocks": p.num_free,
            "cached_blocks": p.num_cached,
            "kv_cache_usage": p.usage,
            "leased_requests": len(self._leases),
            "steps": self.steps,
            "last_step_ms": self.last_step_s * 1e3,
            "counters": self.metrics.as_dict(),
            "lora": None
            if self.lora_slots is None
            else {
                "running": dict(self.lora_running),
                "gpu_slots": list(self.lora_slots.gpu),
                "cpu_cache": list(self.lora_slots.cpu),
                "swaps": self.lora_slots.swaps,
                "disk_loads": self.lora_slots.disk_loads,
            },
            # The CPU tier's occupancy, which vLLM shows nowhere (its usage gauge counts transfers in flight).
            "cpu_tier": None
            if self.cpu is None
            else {
                "num_blocks": self.cpu.num_blocks,
                "cached_blocks": self.cpu.num_cached,
                "stored_blocks": self.cpu.stores,
                "loaded_blocks": self.cpu.loads,
                "allocation_failures": self.cpu.allocation_failures,
            },
        }


def run_collecting_gaps(engine: Engine, requests: list[Request]) -> list[float]:
    """Run `requests` together on a virtual-clock engine until idle; the gaps (seconds) between each
    request's consecutive outputs, i.e. the simulated inter-token latencies, for calibration and tests."""
    last: dict[str, float] = {}
    gaps: list[float] = []

    def on_output(outs: list[Request]) -> None:
        for r in outs:
            if r.id in last:
                gaps.append(engine.now - last[r.id])
            last[r.id] = engine.now

    engine.on_output = on_output
    for r in requests:
        engine.add_request(r)
    engine.run_until_idle()
    return gaps


class RealtimeRunner:
    """Paces an engine's steps on the event loop's clock: simulated seconds = wall seconds * speedup.

    Each step sleeps until an absolute deadline, so wake-up jitter does not accumulate; if the loop falls
    more than `max_lag_s` behind (an overloaded CPU), the simulated clock jumps forward instead of bursting.
    With a `device` shared by several runners of this process, each step runs on it time-sliced with theirs.
    """

    def __init__(
        self,
        engine: Engine,
        speedup: float = 1.0,
        max_lag_s: float = 0.05,
        device: SharedDevice | None = None,
    ) -> None:
        self.engine = engine
        self.speedup = speedup
        self.device = device
        self.max_lag_s = max_lag_s
        self._wake = asyncio.Event()
        self._t0 = 0.0
        self._task: asyncio.Task[None] | None = None
        self.lag_events = 0
        self.wake_lag_s: deque[float] = deque(maxlen=2048)  # how late each step's timer fired

    def lag_summary(self) -> dict[str, float]:
        """Step-timer lateness in wall ms (p50/p99/max over the last steps): event-loop lag."""
        lags = sorted(self.wake_lag_s)
        if not lags:
            return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        n = len(lags)
        return {
            "p50_ms": lags[n // 2] * 1e3,
            "p99_ms": lags[min(n - 1, n * 99 // 100)] * 1e3,
            "max_ms": lags[-1] * 1e3,
        }

    def sim_now(self) -> float:
        """Simulated time of this instant (for request arrivals between steps)."""
        wall = (asyncio.get_running_loop().time() - self._t0) * self.speedup
        return max(self.engine.now, wall)

    def submit(self, req: Request) -> None:
        self.engine.add_request(req, at=self.sim_now())
        self._wake.set()

    def wake(self) -> None:
        """Re-run the scheduler now: blocks were freed outside a step (abort, lease release)."""
        self._wake.set()

    def start(self) -> None:
        self._t0 = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _step_time(self, shape: StepShape) -> float:
        t = self.engine.cost.step_time(shape)
        if self.device is None:
            return t
        start = self._t0 + self.engine.now / self.speedup
        return (await self.device.run(t / self.speedup, start) - start) * self.speedup

    async def _run(self) -> None:
        eng = self.engine
        loop = asyncio.get_running_loop()
        speed = self.speedup
        idle = True
        while True:
            wall_sim = (loop.time() - self._t0) * speed
            if idle:
                # Resume at the event we slept for, not at the (jittery) moment the timer fired: simulated
                # times then match the virtual clock exactly, whatever the speedup.
                nxt = eng.next_event_time()
                eng.now = max(eng.now, wall_sim if nxt is None else min(wall_sim, nxt))
            elif wall_sim - eng.now > self.max_lag_s * speed:
                eng.now = wall_sim  # too far behind to catch up: the engine just ran slower
                self.lag_events += 1
            idle = False
            eng.tick()
            sched, shape = eng.schedule() if eng.has_work() else ({}, None)
            if sched and shape is not None:
                t = await self._step_time(shape)
                delay = self._t0 + (eng.now + t) / speed - loop.time()
                # Yield even when late: the previous step's output (SSE writes) must go out before the next
                # step, or a late runner would batch steps back to back and keep itself late.
                await asyncio.sleep(max(delay, 0.0))
                self.wake_lag_s.append(max(0.0, loop.time() - self._t0 - (eng.now + t) / speed))
                eng.now += t
                eng.last_step_s = t
                eng._after_step(eng.complete(sched, t))
                continue
            idle = True
            nxt = eng.next_event_time()
            self._wake.clear()
            timeout = None if nxt is None else max(0.0, self._t0 + nxt / speed - loop.time())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
