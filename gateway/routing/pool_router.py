"""A pool's router: what is learned about its replicas for routing, and how a request is routed.

Per pool: the routing policy (which picks both legs of a prefill/decode pool's requests, and hears
how each request ended), the prompt hasher and token
counter, the prefix index (and, in precise mode, the KV event index with the approximate one as
its fallback), the engines' tokens per character, and its LoRA adapters (`gateway.routing.lora`).
It follows the pool's membership as a `PoolListener`: a replica that leaves is forgotten, a KV
capacity that changes resizes its index.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.config import KVEventsSource, PoolConfig
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.prompt.endpoints import Endpoint
from gateway.prompt.prefix_hash import PrefixHasher, batch_tokens, prompt_pieces
from gateway.prompt.tokens import Tokenizer, TokenizerError, get_tokenizer, load_tokenizer, model_tokenizer
from gateway.routing.lora import PoolLora
from gateway.routing.policy import Candidate, Outcome, Pair, Policy, RequestFeatures, load_policy
from gateway.routing.precise_prefix import PrecisePrefix
from gateway.routing.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # typical for English text; only sizes the prefix index until traffic is measured
# Usage figures needed before the engines' own tokens per character replace the gateway's count.
MIN_USAGE_SAMPLES = 8
MIN_USAGE_CHARS = 4096


def _flag(args: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def engine_tokenizer(cfg: PoolConfig) -> tuple[str | None, bool]:
    """The tokenizer the pool's engines use, if known, and whether the config named it (an explicit
    one must load; a discovered one may fail with a warning)."""
    if cfg.tokenizer:
        return cfg.tokenizer, True
    spec = cfg.engines
    if spec is None:
        return None, False
    flag = _flag([*spec.extra_args, *spec.sim.extra_args], "--tokenizer")
    if flag:
        return flag, False
    model = spec.model or cfg.model
    if spec.kind == "sim":  # the simulator reads a model directory's tokenizer, never a hub cache
        found = Path(model) / "tokenizer.json"
        return (str(found), False) if found.is_file() else (None, False)
    found_file = model_tokenizer(model)
    return (str(found_file), False) if found_file is not None else (None, False)


def pool_tokenizer(cfg: PoolConfig) -> Tokenizer | None:
    """The engines' tokenizer; None when unknown (counts then use cl100k, corrected from usage).
    TokenizerError only for one the config names."""
    spec, explicit = engine_tokenizer(cfg)
    if spec is None:
        return None
    try:
        tokenizer = load_tokenizer(spec)
    except TokenizerError as exc:
        if explicit:
            raise
        log.warning("pool %s: %s; learning the engines' tokens per character from their usage", cfg.name, exc)
        return None
    log.info("pool %s: token counts by the engines' tokenizer %s", cfg.name, tokenizer.name)
    return tokenizer


def _matched(
    index: PrefixIndex, hashes: Sequence[int], block_tokens: Sequence[int], replicas: list[Replica]
) -> list[Candidate]:
    """Candidates with the leading blocks of `hashes` each replica holds in `index`, and those
    it holds beyond them in CPU memory when the index has that tier."""
    if not hashes or not replicas:
        return [Candidate(r) for r in replicas]
    names = [r.name for r in replicas]
    if index.lower is None:
        matched = index.match(hashes, names)
        # A prefix held by many replicas gives them few distinct depths: sum each depth once, not
        # once per replica (up to 0.4 ms for a 2k-token prompt on 256 replicas).
        tokens = {k: sum(block_tokens[:k]) for k in set(matched.values())}
        return [Candidate(r, matched[r.name], tokens[matched[r.name]]) for r in replicas]
    tiers = index.match_tiers(hashes, names)
    tokens = {k: sum(block_tokens[:k]) for k in {d for pair in tiers.values() for d in pair}}
    out = []
    for r in replicas:
        gpu, reach = tiers[r.name]
        out.append(Candidate(r, gpu, tokens[gpu], reach - gpu, tokens[reach] - tokens[gpu]))
    return out


def _overrides(policy: Policy[Any], hook: str) -> bool:
    """Whether `policy` defines the hook itself, rather than inheriting Policy's, which does nothing."""
    return getattr(getattr(policy, hook), "__func__", None) is not getattr(Policy, hook)


class PoolRouter:
    def __init__(self, pool: Pool, policy: Policy[Any] | None = None) -> None:
        self.pool = pool
        cfg = pool.cfg
        self.policy = policy or load_policy(cfg.policy.type, cfg.policy.args)
        # Deprecated: a second policy ranking the prefill leg, instead of the policy's select_pair.
        prefill = cfg.pd.prefill_policy
        self.prefill_policy = load_policy(prefill.type, prefill.args) if prefill is not None else None
        if prefill is not None:
            log.warning(
                "pool %s: pd.prefill_policy is deprecated and goes in the next release: the pool's "
                "policy picks both legs (Policy.select_pair; by default the prefill leg by least load)",
                cfg.name,
            )
        self.tokenizer = pool_tokenizer(cfg)
        self._count = (self.tokenizer or get_tokenizer()).count
        prefix = cfg.prefix
        self.hasher = PrefixHasher(
            block_chars=prefix.block_chars, token_cache_size=prefix.token_cache_entries, count=self._count
        )
        # Precise mode matches engine token blocks against the engines' KV events; its index
        # replaces the one learned from text blocks.
        self.precise = (
            PrecisePrefix(cfg.prefix, pool.upstream_model, cfg.engine_block_size)
            if cfg.prefix.mode == "precise"
            else None
        )
        # `learn` records whole prompts' chains, and nothing is discarded: prefix-closed. In
        # precise mode it is the fallback for replicas whose KV events are missing.
        approximate = PrefixIndex.from_config(cfg.prefix, prefix_closed=True)
        self.prefix_index = self.precise.index if self.precise is not None else approximate
        self.fallback_index = approximate if self.precise is not None else None
        # Prompt characters and tokens seen: the index is sized in blocks of characters, the engine
        # in tokens, and characters per token vary with the text (code, CJK, generated benchmarks).
        self._text_chars = 0
        self._text_tokens = 0
        self._sized_tokens_per_block = 0.0
        self._cpu_tiers: set[str] = set()  # replicas the approximate index models a CPU tier for
        # The engines' own prompt tokens (usage.prompt_tokens) against the prompt characters the
        # gateway sent: tokens per character in the engines' units, whatever tokenizer counted.
        self._usage_chars = 0
        self._usage_tokens = 0
        self._usage_samples = 0
        # Without usage figures (streams without include_usage), the engines' prompt token counters
        # (vLLM's /metrics) against the characters routed to each replica since the last scrape.
        self._chars_routed: dict[str, int] = {}
        self._counter_seen: dict[str, tuple[float, int]] = {}
        self._counter_chars = 0
        self._counter_tokens = 0.0
        self.token_scale = 1.0  # engine tokens per counted token, once measured
        self.lora = PoolLora(pool)
        self._rng = random.Random()
        pool.listen(self)

    @property
    def name(self) -> str:
        return self.pool.name

    @property
    def cfg(self) -> PoolConfig:
        return self.pool.cfg

    # -- following the pool's membership (PoolListener) -------------------------------
    def replica_added(self, replica: Replica, kv_events: KVEventsSource | None) -> None:
        if self.precise is not None and kv_events is not None:
            self.precise.attach(replica.name, kv_events.endpoint, kv_events.topic)

    def replica_removed(self, name: str) -> None:
        self.prefix_index.remove_replica(name)
        self.lora.forget(name)
        if self.fallback_index is not None:
            self.fallback_index.remove_replica(name)
        self._chars_routed.pop(name, None)
        self._counter_seen.pop(name, None)
        self._cpu_tiers.discard(name)
        if self.precise is not None:
            self.precise.detach(name)

    def engine_reported(self, replica: Replica, capacity_changed: bool) -> None:
        if capacity_changed:
            self.set_kv_capacity(replica)
        if replica.engine.prompt_tokens_total is not None:
            self.observe_prompt_counter(replica.name, replica.engine.prompt_tokens_total)

    # -- per request ------------------------------------------------------------------
    def features(
        self,
        body: Mapping[str, Any],
        endpoint: Endpoint,
        request_id: str,
        headers: Mapping[str, str],
        hasher: PrefixHasher | None = None,
    ) -> RequestFeatures:
        """The request's routing features. With a `hasher` of its own (work done off the event
        loop) nothing of the pool changes: the caller reports the size with `learn_token_size`."""
        pieces = prompt_pieces(body, endpoint)
        text = "".join(pieces)
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        # The preparation step set `model` to the engines' name for the request: the base model's, or
        # an adapter's, whose prefixes are cached (and hashed here) apart from the base model's.
        model = body.get("model")
        adapter = self.lora.adapter_of(model) if isinstance(model, str) else None
        pf = (hasher or self.hasher).features(adapter or self.pool.upstream_model, salt, text, pieces)
        if hasher is None:
            self.learn_token_size(len(text), pf.prompt_tokens)
        prompt_tokens, block_tokens = pf.prompt_tokens, pf.block_tokens
        scale = self.token_scale
        exact_first, others = batch_tokens(body, endpoint, self._count)
        if exact_first is not None:
            # Token ids were hashed as text: the engine's own count, and blocks scaled to it.
            ratio = exact_first / max(1, prompt_tokens)
            block_tokens = [round(t * ratio) for t in block_tokens]
            prompt_tokens = exact_first
        elif scale != 1.0:  # the counting tokenizer is not the engines': state sizes in theirs
            prompt_tokens = round(prompt_tokens * scale)
            block_tokens = [round(t * scale) for t in block_tokens]
        prompt_tokens += round(others * scale)
        max_tokens = (
            body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
        )
        features = RequestFeatures(
            request_id=request_id,
            model=adapter or self.pool.upstream_model,
            pool=self.pool.name,
            endpoint=endpoint,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            block_hashes=pf.block_hashes,
            block_tokens=block_tokens,
            stream=bool(body.get("stream")),
            headers=headers,
            text=text,
            adapter=adapter,
        )
        if self.precise is not None:
            features.text_block_hashes, features.text_block_tokens = pf.block_hashes, block_tokens
        return features

    def candidates(
        self, features: RequestFeatures, replicas: Iterable[Replica], policy: Policy[Any]
    ) -> list[Candidate]:
        replicas = list(replicas)
        if not policy.uses_prefix_match:
            return [Candidate(r) for r in replicas]
        if self.precise is None or self.fallback_index is None:
            return _matched(self.prefix_index, features.block_hashes, features.block_tokens, replicas)
        # Precise mode: replicas whose KV events flow are matched on the engine's token blocks,
        # the others (events missing, no publisher, or the prompt could not be tokenized) on
        # the text blocks of the approximate index.
        now = time.monotonic()
        exact: list[Replica] = []
        fallback = replicas
        if features.block_hashes:
            flags = [self.precise.exact(r.name, now) for r in replicas]
            exact = [r for r, ok in zip(replicas, flags, strict=True) if ok]
            fallback = [r for r, ok in zip(replicas, flags, strict=True) if not ok]
        found = _matched(self.prefix_index, features.block_hashes, features.block_tokens, exact)
        found += _matched(
            self.fallback_index, features.text_block_hashes, features.text_block_tokens, fallback
        )
        if not exact or not fallback:
            return found
        order = {r.name: i for i, r in enumerate(replicas)}
        return sorted(found, key=lambda c: order[c.replica.name])

    def shortlist(self, features: RequestFeatures, role: str, policy: Policy[Any]) -> list[Replica] | None:
        """The replicas a prefix-matching policy is offered for a leg in a pool larger than
        `policy.max_candidates`; None: all that are available.

        Every stage of a decision (availability, the index match, the policy's estimate) is per
        replica: at 1,024 replicas they took a millisecond. The prompt's best holders (deepest
        match first) keep its cache hits, a uniform sample of the others keeps load in view (a
        least-loaded pick among 16 random replicas is within a few requests of the global one),
        and the replicas sharing a GPU with any of them come along, as a policy sums load per device."""
        limit = self.cfg.policy.max_candidates
        members = self.pool.members(role)
        if not limit or len(members) <= limit or not policy.uses_prefix_match:
            return None
        rng, pool = self._rng, self.pool
        indexes = [(self.prefix_index, features.block_hashes)]
        if self.fallback_index is not None:  # precise mode: replicas without KV events, by text blocks
            indexes.append((self.fallback_index, features.text_block_hashes))
        chosen: dict[Replica, None] = {}
        for index, hashes in indexes:
            for name in index.holders(hashes, limit // 2, rng):
                replica = pool.replicas.get(name)
                if replica is not None and pool.takes(replica, role):  # the index holds either leg
                    chosen[replica] = None
        for replica in rng.sample(members, limit):
            if len(chosen) >= limit:
                break
            chosen[replica] = None
        for device in {r.device for r in chosen if r.device is not None}:
            chosen.update(dict.fromkeys(pool.on_device(role, device)))
        return [r for r in chosen if r.available]

    def offered(self, features: RequestFeatures, role: str, policy: Policy[Any]) -> list[Candidate]:
        """The candidates a policy is offered for a leg: available replicas (those `shortlist`
        keeps, in a large pool) that serve the request's adapter."""
        shortlisted = self.shortlist(features, role, policy)
        candidates = self._eligible(
            features, self.pool.serving(role) if shortlisted is None else shortlisted, policy
        )
        if not candidates and shortlisted is not None:  # none of those available: look at all
            candidates = self._eligible(features, self.pool.serving(role), policy)
        return candidates

    def _eligible(
        self, features: RequestFeatures, replicas: list[Replica], policy: Policy[Any]
    ) -> list[Candidate]:
        adapter = features.adapter
        if adapter is None:
            return self.candidates(features, replicas, policy)
        candidates = self.candidates(features, self.lora.eligible(replicas, adapter), policy)
        if policy.uses_prefix_match:
            self.lora.credit(candidates, adapter)
        return candidates

    def rank(self, features: RequestFeatures) -> list[Candidate]:
        """Available replicas that serve whole requests (or decode legs), ranked best first."""
        return self.policy.rank(features, self.offered(features, "decode", self.policy))

    def select_pair(self, features: RequestFeatures) -> Pair:
        """Both legs of a request to a pool with prefill replicas, ranked best first."""
        policy, prefill_policy = self.policy, self.prefill_policy
        decode = self.offered(features, "decode", policy)
        if prefill_policy is None:
            return policy.select_pair(features, self.offered(features, "prefill", policy), decode)
        prefill = self.offered(features, "prefill", prefill_policy)
        return Pair(prefill_policy.rank(features, prefill), policy.rank(features, decode))

    def replica(self, candidate: Candidate) -> Replica | None:
        """The pool's replica a ranked candidate names; None when it left the pool since."""
        # Keyed by name: the path gets the gateway's own replica without casting back the
        # read-only view a policy saw, and plugins need no generics to return what they got.
        return self.pool.replicas.get(candidate.replica.name)

    def learn(self, features: RequestFeatures, replica: Replica, prefill_leg: bool = False) -> None:
        """The request went to `replica`: it will hold the prompt's blocks once prefilled."""
        name = replica.name
        # The policy that chose the replica hears of it. A prefill leg from select_pair is not the
        # request's route (on_routed names its decode replica): only a deprecated prefill policy
        # hears of one.
        deciding = self.prefill_policy if prefill_leg else self.policy
        # A prompt longer than this is learned by its head: all of it would hold the event loop.
        limit = self.cfg.prefix.max_learn_blocks
        if self.precise is None or self.fallback_index is None:
            if features.block_hashes:
                self.prefix_index.record(name, features.block_hashes[:limit])
                self._learn_cpu(name, features.block_hashes[:limit])
        else:
            blocks = features.block_hashes[:limit]
            if blocks:
                # New blocks for the engine to store: its events owe us a BlockStored.
                if self.prefix_index.match(blocks, [name])[name] < len(blocks):
                    self.precise.expect_events(name)
                # The engine's events confirm; until then the decision is a guess.
                self.prefix_index.record(name, blocks, speculative=True)
            if features.text_block_hashes:
                self.fallback_index.record(name, features.text_block_hashes[:limit])
                self._learn_cpu(name, features.text_block_hashes[:limit])
            if (
                deciding is not None
                and deciding.uses_prefix_match
                and not (blocks and self.precise.exact(name, time.monotonic()))
            ):
                self.precise.fallback_decisions[name] += 1
        self._chars_routed[name] = self._chars_routed.get(name, 0) + len(features.text)
        if features.adapter is not None:
            self.lora.routed(name, features.adapter)
        if deciding is not None:
            deciding.on_routed(features, replica)

    def completion_heard(self, paired: bool) -> bool:
        """Whether a policy that ranked the request (the prefill one too when `paired`) has an
        `on_complete` of its own: the base class's does nothing, so the Outcome need not be built."""
        policies = (self.policy, self.prefill_policy) if paired else (self.policy,)
        return any(_overrides(p, "on_complete") for p in policies if p is not None)

    def first_token_heard(self) -> bool:
        """Whether the pool's policy has an `on_first_token` of its own (the base class's does
        nothing, so a stream need not call it). A deprecated prefill policy never hears it: its leg's
        first token is not relayed."""
        return _overrides(self.policy, "on_first_token")

    def first_token(self, features: RequestFeatures, replica: Replica) -> None:
        """A streamed answer's first token came from `replica`: the policy hears of it. A hook that
        fails is logged: the stream goes on."""
        try:
            self.policy.on_first_token(features, replica)
        except Exception:
            log.exception(
                "pool %s: %s.on_first_token failed for request %s",
                self.name,
                type(self.policy).__qualname__,
                features.request_id,
            )

    def complete(
        self, features: RequestFeatures, replica: Replica | None, outcome: Outcome, paired: bool
    ) -> None:
        """The request ranked for this pool (by `select_pair` when `paired`) ended: the policies
        that ranked it hear how, once each. A hook that fails is logged: the answer, often sent
        already, is not the plugin's to change."""
        heard: list[tuple[Policy[Any], Replica | None]] = [(self.policy, replica)]
        if paired and self.prefill_policy is not None:
            prefill = outcome.prefill_replica
            heard.append(
                (self.prefill_policy, self.pool.replicas.get(prefill) if prefill is not None else None)
            )
        for policy, where in heard:
            try:
                policy.on_complete(features, where, outcome)
            except Exception:
                log.exception(
                    "pool %s: %s.on_complete failed for request %s",
                    self.name,
                    type(policy).__qualname__,
                    features.request_id,
                )

    def tokens_per_block(self) -> float:
        """Engine tokens in one hashed block of prompt text, as measured on this pool's traffic."""
        if self._text_chars < MIN_USAGE_CHARS:
            return self.cfg.prefix.block_chars / CHARS_PER_TOKEN * self.token_scale
        return self.cfg.prefix.block_chars * self._text_tokens / self._text_chars * self.token_scale

    def observe_usage(self, prompt_chars: int, engine_prompt_tokens: int) -> None:
        """An engine counted `engine_prompt_tokens` for a prompt of `prompt_chars` characters (its
        response's usage): once enough are seen, counts are scaled to the engines' tokens."""
        # An engine is not trusted: a figure no tokenizer could give for that text is dropped.
        if prompt_chars <= 0 or not 0 < engine_prompt_tokens <= 4 * prompt_chars + 4096:
            return
        self._usage_chars += prompt_chars
        self._usage_tokens += engine_prompt_tokens
        self._usage_samples += 1
        if self._usage_chars > 1 << 24:  # forget slowly, so the figure follows the traffic
            self._usage_chars //= 2
            self._usage_tokens //= 2
        self._rescale()

    def observe_prompt_counter(self, replica: str, prompt_tokens_total: float) -> None:
        """A scrape of a replica's prompt token counter: what it counted since the last scrape,
        against the prompt characters routed to it meanwhile. Figures are summed over scrapes, so
        a request counted by the gateway before the engine has prefilled it evens out. Used only
        while no response has carried usage figures (those are per request, and no other gateway's
        traffic can mix in)."""
        chars = self._chars_routed.get(replica, 0)
        previous = self._counter_seen.get(replica)
        self._counter_seen[replica] = (prompt_tokens_total, chars)
        if previous is None or prompt_tokens_total < previous[0]:  # first sight, or a restart
            return
        self._counter_tokens += prompt_tokens_total - previous[0]
        self._counter_chars += chars - previous[1]
        if self._counter_chars > 1 << 24:
            self._counter_chars //= 2
            self._counter_tokens /= 2
        self._rescale()

    def _rescale(self) -> None:
        """Scale counts to the engines' tokens per character: from usage figures when there are
        enough, else from the engines' counters."""
        if self._usage_samples >= MIN_USAGE_SAMPLES and self._usage_chars >= MIN_USAGE_CHARS:
            engine_per_char = self._usage_tokens / self._usage_chars
        elif not self._usage_samples and self._counter_chars >= 4 * MIN_USAGE_CHARS and self._counter_tokens:
            # Only where responses carry no usage at all: counters lag the characters routed by the
            # prompts still waiting for prefill, and the first long prompts of a run made them read a
            # hundredth of the true count (every block rounded to 0 tokens: no prefix matched) until
            # enough usage figures came.
            engine_per_char = self._counter_tokens / self._counter_chars
        else:
            return
        # An engine is not trusted: no tokenizer makes more than a token per byte of text.
        if not self._text_tokens or engine_per_char > 4:
            return
        scale = engine_per_char / (self._text_tokens / self._text_chars)
        # Within 5%, the counting tokenizer is the engines' (chat templates add a few tokens).
        scale = 1.0 if abs(scale - 1.0) < 0.05 else scale
        if scale != self.token_scale:
            if abs(scale - self.token_scale) > 0.2 * self.token_scale:
                log.info(
                    "pool %s: the engines count %.3g tokens per counted token (by their own figures): "
                    "token estimates and index sizes follow",
                    self.name,
                    scale,
                )
            self.token_scale = scale
            self._resize_if_moved()

    def learn_token_size(self, chars: int, tokens: int) -> None:
        self._text_chars += chars
        self._text_tokens += tokens
        if self._text_chars > 1 << 24:  # forget slowly, so the figure follows the traffic
            self._text_chars //= 2
            self._text_tokens //= 2
        self._resize_if_moved()

    def _resize_if_moved(self) -> None:
        sized = self._sized_tokens_per_block
        if sized and abs(self.tokens_per_block() - sized) > 0.2 * sized:
            for replica in self.pool.replicas.values():
                self.set_kv_capacity(replica)

    def _learn_cpu(self, replica: str, hashes: Sequence[int]) -> None:
        """The approximate index's CPU tier, for a replica whose engine offloads: vLLM writes prompt
        blocks through to CPU as they are computed, so the tier is a second, larger LRU over the
        same blocks, not a demotion target."""
        lower = (self.fallback_index or self.prefix_index).lower
        if lower is not None and replica in self._cpu_tiers:
            lower.record(replica, hashes)

    def set_kv_capacity(self, replica: Replica) -> None:
        """Size the replica's index budget from the engine's KV capacity, when it is known (and
        its CPU tier's from the engine's offloading size)."""
        cap = replica.kv_capacity_tokens
        cpu = replica.engine.cpu_capacity_tokens
        if cap and self.precise is not None:
            self.precise.set_capacity(replica.name, cap, cpu)
        approximate = self.fallback_index or self.prefix_index
        if cap and self.cfg.prefix.max_blocks_per_replica is None:
            self._sized_tokens_per_block = tokens_per_block = max(1.0, self.tokens_per_block())
            approximate.set_capacity(replica.name, max(1, int(cap / tokens_per_block)))
            if cpu:
                lower = approximate.add_lower_tier(approximate.default_capacity)
                lower.set_capacity(replica.name, max(1, int(cpu / tokens_per_block)))
                self._cpu_tiers.add(replica.name)
        if not cpu and replica.name in self._cpu_tiers:  # restarted without its CPU tier
            self._cpu_tiers.discard(replica.name)
            if approximate.lower is not None:
                approximate.lower.clear_replica(replica.name)
