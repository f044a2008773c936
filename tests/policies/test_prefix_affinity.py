"""prefix_affinity: warm replicas win until their queue costs more than recomputing the prefix."""

from __future__ import annotations

from collections import Counter

from gateway.fleet.replica import Replica
from gateway.routing.policy import Candidate, load_policy
from policies.prefix_affinity import PrefixAffinity, PrefixAffinityParams
from tests.fleet.test_replica_speed import served
from tests.policies.helpers import candidates, complete, decide, engine_report, replicas, request, send

PROMPT = 2176  # a 2048-token system prompt and a 128-token question
SHARED = 2048


class Clock:
    """Time stands still unless a test moves it: the policy's queue estimate drains with time."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(clock: Clock | None = None, **args: object) -> PrefixAffinity:
    return PrefixAffinity(PrefixAffinityParams(**args), clock=clock or Clock())


def test_registered_as_an_entry_point() -> None:
    assert isinstance(load_policy("prefix_affinity"), PrefixAffinity)


def test_prefers_the_warm_replica_when_loads_are_equal() -> None:
    reps = replicas(3)
    ranked = policy().rank(request(PROMPT), candidates(reps, {"r1": SHARED}))
    assert ranked[0].replica.name == "r1"


def test_deeper_match_wins_between_warm_replicas() -> None:
    reps = replicas(3)
    ranked = policy().rank(request(PROMPT), candidates(reps, {"r0": 512, "r2": SHARED}))
    assert [c.replica.name for c in ranked] == ["r2", "r0", "r1"]


def test_spills_when_the_engine_queue_makes_the_warm_replica_slower() -> None:
    reps = replicas(3)
    # 4 requests of another gateway waiting x 1024 tokens: more than recomputing 2048 elsewhere.
    engine_report(reps[1], waiting=4)
    ranked = policy().rank(request(PROMPT), candidates(reps, {"r1": SHARED}))
    assert ranked[0].replica.name in ("r0", "r2")
    assert ranked[-1].replica.name == "r1"
    # A short queue is not worth a recompute: the warm replica keeps the request.
    engine_report(reps[1], waiting=1)
    ranked = policy().rank(request(PROMPT), candidates(reps, {"r1": SHARED}))
    assert ranked[0].replica.name == "r1"


def test_engine_waiting_counts_our_own_requests_at_their_size() -> None:
    p = policy(per_request_tokens=0)
    reps = replicas(2)
    for _ in range(3):  # three cache hits in flight on r1, 128 uncached tokens each
        req = request(PROMPT)
        send(reps[1], req)
        p.rank(req, [candidates(reps, {"r1": SHARED})[1]])
    engine_report(reps[1], waiting=3)  # the engine reports them waiting: 3 x 128, not 3 x 1024
    assert p.queued_tokens(reps[1]) == 3 * (PROMPT - SHARED)
    ranked = decide(p, request(PROMPT), candidates(reps, {"r1": SHARED}))
    assert ranked[0].replica.name == "r1"
    engine_report(reps[1], waiting=5)  # two more than ours: another gateway's, 1024 each
    assert p.queued_tokens(reps[1]) == 3 * (PROMPT - SHARED) + 2 * 1024


def test_streams_past_their_first_token_are_not_another_gateways_in_a_stale_scrape() -> None:
    p = policy(per_request_tokens=0)
    reps = replicas(2)
    streams = [request(PROMPT, stream=True) for _ in range(3)]
    for req in streams:
        send(reps[1], req)
        p.rank(req, [candidates(reps)[1]])
    for req in streams[:2]:
        p.on_first_token(req, reps[1])  # two are decoding now, still in flight
    engine_report(reps[1], waiting=3)  # scraped while all three waited
    assert p.queued_tokens(reps[1]) == PROMPT  # the one still waiting, not two more at 1024
    engine_report(reps[1], waiting=4)  # one more than ours in flight: another gateway's
    assert p.queued_tokens(reps[1]) == PROMPT + 1024


def test_duplicate_weight_keeps_a_prefix_on_its_replica_when_a_copy_is_barely_faster() -> None:
    reps = replicas(2)
    engine_report(reps[0], waiting=2)  # another gateway's 2 x 1024 tokens queued ahead on the warm one
    # Time to first token: 2048 queued + 128 + 2 x 32 in flight on r0 against 2176 on r1...
    ranked = policy(duplicate_weight=0).rank(request(PROMPT), candidates(reps, {"r0": SHARED}))
    assert ranked[0].replica.name == "r1"
    # ...but with the second copy's 2048 tokens weighted 1.5 (3200 on r1), the prefix stays on r0.
    ranked = policy().rank(request(PROMPT), candidates(reps, {"r0": SHARED}))
    assert ranked[0].replica.name == "r0"


def test_stale_engine_figures_are_ignored() -> None:
    reps = replicas(2)
    engine_report(reps[1], waiting=50)
    reps[1].engine.updated_at -= 60  # a minute old: the scrape stopped
    ranked = policy().rank(request(PROMPT), candidates(reps, {"r1": SHARED}))
    assert ranked[0].replica.name == "r1"


def test_own_inflight_work_counted_at_decision_time_spills_a_hot_prefix() -> None:
    """A burst of one hot prefix: the warm replica takes requests until its queue of uncached
    work outweighs a recompute, then the prefix spills; with two warm replicas it alternates."""
    p = policy(per_request_tokens=0)
    reps = replicas(3)
    warm = {"r1": SHARED}
    chosen = []
    sent = []
    for _ in range(40):
        req = request(PROMPT)
        first = p.rank(req, candidates(reps, warm))[0].replica
        sent.append((req, first, send(first, req)))  # the lease is taken right after ranking
        p.on_routed(req, first)
        chosen.append(first.name)
        warm.setdefault(first.name, SHARED)  # the replica now holds the prefix too
    # Each hit queues 128 uncached tokens; a spill recomputes 2048 more, weighted 1.5 for the
    # second copy: about 24 hits before spilling.
    first_spill = next(i for i, name in enumerate(chosen) if name != "r1")
    assert 22 <= first_spill <= 26, chosen
    counts = Counter(chosen)
    assert counts["r1"] >= 24 and len(counts) >= 2
    # Once the requests are done, the queue is empty again and affinity returns.
    for req, replica, lease in sent:
        lease.release()
        complete(p, req, replica)
    ranked = decide(p, request(PROMPT), candidates(reps, {"r1": SHARED}))
    assert ranked[0].replica.name == "r1"


def test_decode_load_spills_a_prefix_only_when_its_replica_is_far_busier() -> None:
    """Requests in flight cost 32 tokens each: a spread of 30 (ordinary fluctuation between
    replicas) keeps the prefix where it is; 100 more than elsewhere (a hot prefix) makes a copy pay."""
    p = policy()
    reps = replicas(2)
    for _ in range(30):
        send(reps[0], request(PROMPT))
    assert decide(p, request(PROMPT), candidates(reps, {"r0": SHARED}))[0].replica.name == "r0"
    for _ in range(70):
        send(reps[0], request(PROMPT))
    assert decide(p, request(PROMPT), candidates(reps, {"r0": SHARED}))[0].replica.name == "r1"


def test_other_gateways_requests_in_flight_count_as_decode_load() -> None:
    """Another gateway's 100 requests on the warm replica (shared state) weigh as our own would."""
    p = policy()
    reps = replicas(2)
    assert decide(p, request(PROMPT), candidates(reps, {"r0": SHARED}))[0].replica.name == "r0"
    reps[0].remote_inflight_requests = 100
    assert decide(p, request(PROMPT), candidates(reps, {"r0": SHARED}))[0].replica.name == "r1"


def test_queued_prefill_drains_while_requests_are_still_decoding() -> None:
    clock = Clock()
    p = policy(clock, per_request_tokens=0, prefill_tokens_per_s=10000)
    reps = replicas(2)
    leases = []
    for _ in range(3):  # three cold 2176-token prefills sent to r0, still in flight afterwards
        req = request(PROMPT)
        leases.append(send(reps[0], req))
        p.rank(req, [candidates(reps)[0]])
    assert p.queued_tokens(reps[0]) == 3 * PROMPT
    # The warm replica's queue costs more than recomputing the prefix on the idle one...
    assert decide(p, request(PROMPT), candidates(reps, {"r0": SHARED}))[0].replica.name == "r1"
    # ...until its prefills are done (0.5 s at 10k tokens/s), even though the requests still decode.
    clock.now += 0.7
    assert p.queued_tokens(reps[0]) == 0
    assert decide(p, request(PROMPT), candidates(reps, {"r0": SHARED}))[0].replica.name == "r0"
    assert reps[0].inflight_requests == 3


def test_streams_sent_behind_a_document_wait_until_its_first_token() -> None:
    """Engines prefill first come, first served: requests sent behind a 30k-token document wait
    whole until its first token comes, however long it takes (a long prompt prefills slower per
    token than the rate measured on short ones). Draining everything at the rate made them look
    done after 3.4 s and the next request queued behind the document (issue 18, routing-long)."""
    clock = Clock()
    p = policy(clock, per_request_tokens=0, prefill_tokens_per_s=10000)
    reps = replicas(2)
    document = request(30000, stream=True)
    chats = [request(1000, stream=True) for _ in range(4)]
    for req in (document, *chats):
        send(reps[0], req)
        p.rank(req, [candidates(reps)[0]])
    clock.now += 5.0  # 3.4 s of work at 10k tokens/s, but the document's first token has not come
    assert p.queued_tokens(reps[0]) == 4000
    # A request whose prefix r0 holds goes to r1: 4000 tokens queued on r0 cost more than
    # recomputing the 2048-token prefix there (3200 with the duplicate's weight).
    assert decide(p, request(PROMPT), candidates(reps, {"r0": SHARED}))[0].replica.name == "r1"
    # Its first token came: the chats start from now, the oldest first.
    p.on_first_token(document, reps[0])
    assert p.queued_tokens(reps[0]) == 4000
    clock.now += 0.15
    assert p.queued_tokens(reps[0]) == 3000
    for chat in chats:
        p.on_first_token(chat, reps[0])
    assert p.queued_tokens(reps[0]) == 0
    assert decide(p, request(PROMPT), candidates(reps, {"r0": SHARED}))[0].replica.name == "r0"


def test_a_stream_that_ends_before_its_first_token_leaves_the_queue() -> None:
    p = policy(per_request_tokens=0)
    reps = replicas(2)
    req = request(PROMPT, stream=True)
    lease = send(reps[0], req)
    p.rank(req, [candidates(reps)[0]])
    assert p.queued_tokens(reps[0]) == PROMPT
    lease.release()
    complete(p, req, reps[0])  # the client went away, or the engine failed it
    assert p.queued_tokens(reps[0]) == 0


def test_cold_requests_spread_evenly() -> None:
    p = policy()
    reps = replicas(4)
    chosen = []
    for _ in range(12):
        req = request(PROMPT)
        first = p.rank(req, candidates(reps))[0].replica
        send(first, req)
        chosen.append(first.name)
    assert Counter(chosen) == {"r0": 3, "r1": 3, "r2": 3, "r3": 3}


def test_a_replica_skipped_while_busy_gets_the_next_new_prefixes() -> None:
    clock = Clock()
    p = policy(clock, per_request_tokens=0)
    reps = replicas(3)
    engine_report(reps[0], waiting=10)  # another gateway keeps r0 busy: new prefixes avoid it
    firsts = [decide(p, request(PROMPT), candidates(reps))[0].replica.name for _ in range(4)]
    assert Counter(firsts) == {"r1": 2, "r2": 2}
    engine_report(reps[0], waiting=0)
    clock.now += 10.0  # r1 and r2 have since prefilled what they were sent
    firsts = [decide(p, request(PROMPT), candidates(reps))[0].replica.name for _ in range(2)]
    assert firsts == ["r0", "r0"]  # catches up: round-robin alone would have given r1 or r2 one


def test_cold_requests_avoid_a_busy_replica() -> None:
    p = policy()
    reps = replicas(3)
    engine_report(reps[0], waiting=20)
    chosen = set()
    for _ in range(6):
        chosen.add(decide(p, request(PROMPT), candidates(reps))[0].replica.name)
    assert "r0" not in chosen


def test_retry_moves_the_charge_to_the_replica_that_served() -> None:
    p = policy(per_request_tokens=0)
    reps = replicas(2)
    req = request(PROMPT)
    ranked = p.rank(req, candidates(reps, {"r0": SHARED}))
    assert ranked[0].replica.name == "r0"
    # r0 refused (e.g. 429), the proxy walked on to r1 and the request was sent there.
    lease = send(reps[1], req)
    p.on_routed(req, reps[1])
    # The uncached tokens charged at decision time now count on r1, where the work is.
    assert p.queued_tokens(reps[1]) == PROMPT - SHARED
    assert p.queued_tokens(reps[0]) == 0
    lease.release()
    complete(p, req, reps[1])
    assert p.queued_tokens(reps[1]) == 0


def test_no_candidates() -> None:
    assert policy().rank(request(), []) == []


def test_replicas_sharing_a_gpu_weigh_their_decode_load_together() -> None:
    """A hundred requests on the warm replica push a prompt off it onto a replica of its own, but
    not onto an idle one on the same GPU, whose steps the hundred requests slow just the same;
    with `device_load` off the shared GPU is ignored and the prompt spills there."""
    reps = replicas(3)
    reps[0].device = reps[1].device = "gpu:0"
    reps[0].remote_inflight_requests = 100
    offered = {"r0": SHARED}
    assert decide(policy(), request(PROMPT), candidates(reps, offered))[0].replica.name == "r2"
    assert decide(policy(), request(PROMPT), candidates(reps[:2], offered))[0].replica.name == "r0"
    blind = policy(device_load=False)
    assert decide(blind, request(PROMPT), candidates(reps[:2], offered))[0].replica.name == "r1"


def measured(replica: Replica, tokens_per_s: float) -> None:
    """The proxy's measurement of `replica` after requests prefilled at `tokens_per_s`, one at a time."""
    for k in range(16):
        uncached = 128 if k % 2 else 2048
        replica.speed.observe(k, k + uncached / tokens_per_s, k + 0.5, uncached, 8)


def test_cold_prompts_go_to_the_replica_measured_faster() -> None:
    reps = replicas(2)
    measured(reps[0], 10_000)
    measured(reps[1], 40_000)
    p = policy()
    chosen = [decide(p, request(PROMPT), candidates(reps))[0].replica.name for _ in range(4)]
    assert chosen == ["r1"] * 4
    # Without measurement both look alike and new prefixes are dealt out in turn.
    p = policy(measured_speed=False)
    chosen = [decide(p, request(PROMPT), candidates(reps))[0].replica.name for _ in range(4)]
    assert sorted(chosen) == ["r0", "r0", "r1", "r1"]


def test_a_replica_not_measured_yet_counts_as_fast_as_the_measured_ones() -> None:
    """r2 has ended too few requests to be measured (it is prefilling a document): at the
    parameter's 10k tokens/s beside replicas measured at 6k it looked 1.6x faster, and the next
    document queued behind the first there instead of going to an idle replica."""
    reps = replicas(3)
    measured(reps[0], 6_000)
    measured(reps[1], 6_000)
    p = policy(prefill_tokens_per_s=10_000)
    document = request(15_000, stream=True)
    send(reps[2], document)
    p.rank(document, [candidates(reps)[2]])
    assert decide(p, request(30_000, stream=True), candidates(reps))[0].replica.name != "r2"


def test_a_replica_that_served_documents_is_not_taken_for_a_faster_one() -> None:
    """Both prefill at one pace, but r0 served documents among its chats and reads 1.7x faster
    overall: per-request overheads weigh on short prompts. The next document goes to the idle r1,
    not behind the 5k tokens queued on r0 (routing-long --quick: documents queued on two replicas
    of four)."""
    reps = replicas(2)
    served(reps[0], [256, 256, 256, 12_000] * 4)
    served(reps[1], [256] * 16)
    p = policy()
    queued = request(5_000, stream=True)
    send(reps[0], queued)
    p.rank(queued, [candidates(reps)[0]])
    assert decide(p, request(12_000, stream=True), candidates(reps))[0].replica.name == "r1"


def test_a_warm_slow_replica_still_beats_a_cold_fast_one() -> None:
    reps = replicas(2)
    measured(reps[0], 10_000)
    measured(reps[1], 40_000)
    ranked = decide(policy(), request(PROMPT), candidates(reps, {"r0": SHARED}))
    assert ranked[0].replica.name == "r0"


def test_a_slow_replica_spills_its_queue_sooner() -> None:
    """The same queued work on a replica measured 4x slower costs 4x the time: the warm replica's
    queue of three 1,000-token requests keeps the prefix on a fast replica, not on a slow one."""
    for slow, expected in ((False, "r0"), (True, "r1")):
        reps = replicas(2)
        measured(reps[0], 10_000 if slow else 40_000)
        measured(reps[1], 40_000)
        p = policy(per_request_tokens=0)
        for _ in range(3):
            queued = request(1000)
            p._charge(queued, "r0", 1000, p._clock())
            send(reps[0], queued)
        ranked = p.rank(request(PROMPT), candidates(reps, {"r0": SHARED}))
        assert ranked[0].replica.name == expected


def test_new_prefixes_are_dealt_in_proportion_to_measured_speed() -> None:
    reps = replicas(2)
    measured(reps[0], 10_000)
    measured(reps[1], 20_000)
    # Cold prompts short enough that speed alone leaves both within cold_spread_tokens.
    p = policy(cold_spread_tokens=1e9)
    chosen = Counter([decide(p, request(PROMPT), candidates(reps))[0].replica.name for _ in range(30)])
    assert chosen == {"r1": 20, "r0": 10}


def test_replicas_on_one_gpu_prefill_at_the_devices_pace() -> None:
    """Two replicas sharing a GPU, one measured while busier (slower): the GPU is one, so neither is
    faster, and the warm one keeps its prefix under the shared load; weighed by their own
    measurements the busy warm one would look 4x slower and its prefix would be recomputed beside it."""
    reps = replicas(2)
    reps[0].device = reps[1].device = "gpu:0"
    measured(reps[0], 10_000)
    measured(reps[1], 40_000)
    reps[0].remote_inflight_requests = 100
    offered = {"r0": SHARED}
    assert decide(policy(), request(PROMPT), candidates(reps, offered))[0].replica.name == "r0"
    for r in reps:
        r.device = None
    assert (
        decide(policy(device_load=False), request(PROMPT), candidates(reps, offered))[0].replica.name == "r1"
    )


def tiered(reps: list[Replica], gpu: dict[str, int], cpu: dict[str, int]) -> list[Candidate]:
    """Candidates holding `gpu` tokens on their GPU and `cpu` more in CPU memory (16 per block)."""
    out = candidates(reps, gpu)
    for c in out:
        c.cpu_matched_tokens = cpu.get(c.replica.name, 0)
        c.cpu_matched_blocks = c.cpu_matched_tokens // 16
    return out


def test_a_prefix_in_cpu_memory_beats_recomputing_it_unless_the_tier_is_ignored() -> None:
    reps = replicas(3)
    # r1's GPU evicted the prefix but its CPU tier holds it; r2 holds its first 512 tokens on GPU.
    offered = {"r2": 512}, {"r1": SHARED}
    assert policy().rank(request(PROMPT), tiered(reps, *offered))[0].replica.name == "r1"
    assert policy(cpu_tier=False).rank(request(PROMPT), tiered(reps, *offered))[0].replica.name == "r2"


def test_cpu_tokens_cost_their_load_time_so_a_gpu_copy_still_wins() -> None:
    reps = replicas(2)
    ranked = policy().rank(request(PROMPT), tiered(reps, {"r0": SHARED}, {"r1": SHARED}))
    assert [c.replica.name for c in ranked] == ["r0", "r1"]


def test_the_load_rate_is_learned_from_first_tokens_of_cpu_hits() -> None:
    clock = Clock()
    p = policy(clock, per_request_tokens=0, prefill_tokens_per_s=10000, cpu_load_tokens_per_s=400000)
    reps = replicas(2)
    assert round(p.load_tokens_per_s) == 400000
    for _ in range(30):
        req = request(PROMPT, stream=True)
        send(reps[0], req)
        p.rank(req, [tiered(reps, {}, {"r0": SHARED})[0]])
        # 128 uncached tokens at 10k tokens/s take 12.8 ms; the first token comes 112.8 ms after
        # the send: the 2048 CPU tokens took 100 ms, 20.5k tokens/s, slow enough to matter.
        clock.now += 0.1128
        p.on_first_token(req, reps[0])
        complete(p, req, reps[0])
    assert 19000 < p.load_tokens_per_s < 25000
    # Loading 2048 tokens now costs about as much as recomputing 1000: a replica holding the
    # prefix's first 1536 tokens on GPU beats one holding it all on CPU.
    ranked = p.rank(request(PROMPT), tiered(reps, {"r1": 1536}, {"r0": SHARED}))
    assert ranked[0].replica.name == "r1"
    # Non-streamed requests (no first token heard) and GPU hits teach nothing.
    before = p.load_tokens_per_s
    for offered in (tiered(reps, {}, {"r0": SHARED}), tiered(reps, {"r0": SHARED}, {})):
        req = request(PROMPT, stream=offered[0].cpu_matched_tokens == 0)
        p.rank(req, [offered[0]])
        clock.now += 1.0
        p.on_first_token(req, reps[0])
        complete(p, req, reps[0])
    assert p.load_tokens_per_s == before
