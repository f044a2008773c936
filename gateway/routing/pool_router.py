"""A pool's router: what is learned about its replicas for routing, and how a request is routed.

Per pool: the routing policy (which picks both legs of a prefill/decode pool's requests, and hears
how each request ended), the prompt hasher and token counter, what the replicas are believed to
hold (`gateway.routing.matching`), the engines' tokens per character
(`gateway.routing.token_scale`), and its LoRA adapters (`gateway.routing.lora`). A request's
features are measured here and `route` makes its `Decision` (`gateway.routing.decision`), through
which it reports back. It follows the pool's membership as a `PoolListener`: a replica that leaves
is forgotten, a KV capacity that changes resizes its index.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

from gateway.config import KVEventsSource, PoolConfig
from gateway.fleet.engines import adapter_for_spec
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.prompt.endpoints import Endpoint
from gateway.prompt.prefix_hash import PrefixHasher, batch_tokens, prompt_pieces
from gateway.prompt.tokens import Tokenizer, TokenizerError, get_tokenizer, load_tokenizer, model_tokenizer
from gateway.routing.decision import Decision
from gateway.routing.lora import PoolLora
from gateway.routing.matching import PrefixMatch
from gateway.routing.policy import Candidate, Policy, RequestFeatures, load_policy
from gateway.routing.precise_prefix import PrecisePrefix
from gateway.routing.token_scale import TokenScale

log = logging.getLogger(__name__)


def engine_tokenizer(cfg: PoolConfig) -> tuple[str | None, bool]:
    """The tokenizer the pool's engines use, if known, and whether the config named it (an explicit
    one must load; a discovered one may fail with a warning)."""
    if cfg.tokenizer:
        return cfg.tokenizer, True
    spec = cfg.engines
    if spec is None:
        return None, False
    adapter = adapter_for_spec(spec)
    model = spec.model or cfg.model
    hint = adapter.tokenizer_hint(spec, model)
    if hint is None and adapter.hub_tokenizer:
        found = model_tokenizer(model)
        hint = str(found) if found is not None else None
    return hint, False


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


class PoolRouter:
    def __init__(self, pool: Pool, policy: Policy[Any] | None = None) -> None:
        self.pool = pool
        cfg = pool.cfg
        self.policy = policy or load_policy(cfg.policy.type, cfg.policy.args)
        self.tokenizer = pool_tokenizer(cfg)
        self.count = (self.tokenizer or get_tokenizer()).count
        prefix = cfg.prefix
        self.hasher = PrefixHasher(
            block_chars=prefix.block_chars, token_cache_size=prefix.token_cache_entries, count=self.count
        )
        self.match = PrefixMatch(cfg, pool.upstream_model)
        self.scale = TokenScale(cfg.name, prefix.block_chars, self._resize)
        self.lora = PoolLora(pool)
        self._rng = random.Random()
        pool.listen(self)

    @property
    def name(self) -> str:
        return self.pool.name

    @property
    def precise(self) -> PrecisePrefix | None:
        """Precise prefix mode's KV event index (None: approximate mode)."""
        return self.match.precise

    @property
    def engine_tokens(self) -> PrecisePrefix | None:
        """What has an engine tokenize a prompt, where the pool routes by its engines' token blocks
        (precise mode, a prefix-matching policy); None where nothing needs them."""
        return self.match.precise if self.policy.uses_prefix_match else None

    # -- following the pool's membership (PoolListener) -------------------------------
    def replica_added(self, replica: Replica, kv_events: KVEventsSource | None) -> None:
        self.match.added(replica.name, kv_events)

    def replica_removed(self, name: str) -> None:
        self.match.removed(name)
        self.lora.forget(name)
        self.scale.forget(name)

    def engine_reported(self, replica: Replica, capacity_changed: bool) -> None:
        if capacity_changed:
            self.match.set_capacity(replica, self.scale.sized)
        if replica.engine.prompt_tokens_total is not None:
            self.scale.observe_prompt_counter(replica.name, replica.engine.prompt_tokens_total)

    def _resize(self) -> None:
        """Tokens per block moved: every replica's index budget is sized again."""
        for replica in self.pool.replicas.values():
            self.match.set_capacity(replica, self.scale.sized)

    # -- per request ------------------------------------------------------------------
    def features(
        self,
        body: Mapping[str, Any],
        endpoint: Endpoint,
        request_id: str,
        headers: Mapping[str, str],
        hasher: PrefixHasher | None = None,
    ) -> RequestFeatures:
        """The request's routing features. With a `hasher` of its own (`detached`: work done off
        the event loop) nothing of the pool changes: the caller hands it back with `absorb`."""
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
            self.scale.learn_token_size(len(text), pf.prompt_tokens)
        prompt_tokens, block_tokens = pf.prompt_tokens, pf.block_tokens
        scale = self.scale.scale
        exact_first, others = batch_tokens(body, endpoint, self.count)
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

    def detached(self) -> PrefixHasher:
        """A hasher that reads the pool's caches and changes nothing: `features` off the event loop."""
        return self.hasher.detached()

    def absorb(self, hasher: PrefixHasher, features: RequestFeatures) -> None:
        """Back on the event loop: what a detached hasher learned joins the pool's caches, and the
        prompt it measured the pool's figures."""
        self.hasher.absorb(hasher)
        self.scale.learn_token_size(len(features.text), features.prompt_tokens)

    def offered(self, features: RequestFeatures, role: str) -> list[Candidate]:
        """The candidates the policy is offered for a leg: available replicas (in a pool larger
        than `policy.max_candidates`, those `PrefixMatch.shortlist` keeps) that serve the request's
        adapter, each with the prompt's blocks it is believed to hold."""
        policy, pool = self.policy, self.pool
        limit = self.pool.cfg.policy.max_candidates
        shortlisted = None
        if limit and len(pool.members(role)) > limit and policy.uses_prefix_match:
            shortlisted = self.match.shortlist(pool, features, role, limit, self._rng)
        candidates = self._eligible(features, pool.serving(role) if shortlisted is None else shortlisted)
        if not candidates and shortlisted is not None:  # none of those available: look at all
            candidates = self._eligible(features, pool.serving(role))
        return candidates

    def _eligible(self, features: RequestFeatures, replicas: list[Replica]) -> list[Candidate]:
        adapter = features.adapter
        if adapter is not None:
            replicas = self.lora.eligible(replicas, adapter)
        if not self.policy.uses_prefix_match:
            return [Candidate(r) for r in replicas]
        candidates = self.match.candidates(features, replicas)
        if adapter is not None:
            self.lora.credit(candidates, adapter)
        return candidates

    def rank(self, features: RequestFeatures) -> list[Candidate]:
        """Available replicas that serve whole requests (or decode legs), ranked best first."""
        return self.policy.rank(features, self.offered(features, "decode"))

    def route(self, features: RequestFeatures) -> Decision:
        """The request's decision: its candidates ranked (both legs of a prefill/decode pool's)."""
        if not self.pool.disaggregated:
            return Decision(self, features, self.rank(features), [])
        decode = self.offered(features, "decode")
        pair = self.policy.select_pair(features, self.offered(features, "prefill"), decode)
        return Decision(self, features, pair.decode, pair.prefill)

    def learn(self, features: RequestFeatures, replica: Replica, prefill_leg: bool = False) -> None:
        """The request went to `replica`: it will hold the prompt's blocks once prefilled. The
        policy hears of it (`on_routed`) unless it is a prefill leg: the request's route is its
        decode replica."""
        name = replica.name
        self.match.learn(features, name, None if prefill_leg else self.policy)
        self.scale.routed(name, len(features.text))
        if features.adapter is not None:
            self.lora.routed(name, features.adapter)
        if not prefill_leg:
            self.policy.on_routed(features, replica)

    def observe_usage(self, prompt_chars: int, engine_prompt_tokens: int) -> None:
        """An engine's usage figures for a prompt of `prompt_chars` characters (TokenScale)."""
        self.scale.observe_usage(prompt_chars, engine_prompt_tokens)
