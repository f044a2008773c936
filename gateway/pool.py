"""A pool: the replicas serving one model configuration, its routing policy and prefix index."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.breaker import CircuitBreaker
from gateway.config import BreakerConfig, PoolConfig, ScrapeConfig
from gateway.engines import EngineAdapter, adapter_for_spec, get_adapter
from gateway.lora import PoolLora
from gateway.policy import Candidate, Policy, RequestFeatures, load_policy
from gateway.precise_prefix import PrecisePrefix
from gateway.prefix_hash import PrefixHasher, batch_tokens, prompt_pieces
from gateway.prefix_index import PrefixIndex
from gateway.replica import Replica, Role
from gateway.tokens import get_tokenizer

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # typical for English text; only sizes the prefix index


def _endpoint_adapter(cfg: PoolConfig) -> EngineAdapter | None:
    """An unmanaged pool's engine kind, as its first endpoint (or discovery) names it."""
    kind = (
        cfg.endpoints[0].kind if cfg.endpoints else cfg.discovery.kubernetes.kind if cfg.discovery else None
    )
    try:
        return get_adapter(kind) if kind is not None else None
    except KeyError:  # a plain OpenAI-compatible server
        return None


class Pool:
    def __init__(
        self,
        cfg: PoolConfig,
        breaker_cfg: BreakerConfig,
        scrape_cfg: ScrapeConfig,
        policy: Policy | None = None,
    ) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.model = cfg.model
        self.upstream_model = cfg.served_model or cfg.model
        self._breaker_cfg = breaker_cfg
        self._scrape_cfg = scrape_cfg
        self.replicas: dict[str, Replica] = {}
        self.policy = policy or load_policy(cfg.policy.type, cfg.policy.args)
        self.prefill_policy = load_policy(cfg.pd.prefill_policy.type, cfg.pd.prefill_policy.args)
        self.hasher = PrefixHasher(block_chars=cfg.prefix.block_chars)
        self._count = get_tokenizer().count
        # Precise mode matches engine token blocks against the engines' KV events; its index
        # replaces the one learned from text blocks.
        self.precise = (
            PrecisePrefix(cfg.prefix, self.upstream_model, cfg.engine_block_size)
            if cfg.prefix.mode == "precise"
            else None
        )
        self.prefix_index = (
            self.precise.index
            if self.precise is not None
            # `learn` records whole prompts' chains, and nothing is discarded: prefix-closed.
            else PrefixIndex.from_config(cfg.prefix, prefix_closed=True)
        )
        self._names = itertools.count()
        # Prompt characters and tokens seen: the index is sized in blocks of characters, the engine
        # in tokens, and characters per token vary with the text (code, CJK, generated benchmarks).
        self._text_chars = 0
        self._text_tokens = 0
        self._sized_tokens_per_block = 0.0
        # Managed pools know their engine exactly; unmanaged ones by each endpoint's kind.
        self.adapter = adapter_for_spec(cfg.engines) if cfg.engines is not None else None
        self.lora = PoolLora(cfg, self.adapter or _endpoint_adapter(cfg))

    def adapter_for(self, replica: Replica) -> EngineAdapter | None:
        if self.adapter is not None:
            return self.adapter
        try:
            return get_adapter(replica.kind)
        except KeyError:  # e.g. a plain OpenAI-compatible server: no load figures to read
            return None

    @property
    def pd_protocol(self) -> str | None:
        prefill = next((r for r in self.replicas.values() if r.role == "prefill"), None)
        adapter = self.adapter_for(prefill) if prefill is not None else None
        return adapter.pd_protocol if adapter is not None else None

    # -- membership -------------------------------------------------------------------
    def add_replica(
        self,
        url: str,
        *,
        name: str | None = None,
        role: Role = "mixed",
        kind: str = "vllm",
        bootstrap_port: int | None = None,
        managed: bool = False,
        healthy: bool = True,
    ) -> Replica:
        if name is None:
            name = f"{self.name}-{next(self._names)}"
            while name in self.replicas:
                name = f"{self.name}-{next(self._names)}"
        if name in self.replicas:
            raise ValueError(f"pool {self.name}: replica {name!r} exists")
        replica = Replica(
            name,
            url,
            self.name,
            role=role,
            kind=kind,
            breaker=CircuitBreaker(self._breaker_cfg.failure_threshold, self._breaker_cfg.open_s),
            bootstrap_port=bootstrap_port,
            managed=managed,
            healthy=healthy,
            stale_after_s=self._scrape_cfg.stale_after_s,
        )
        self.replicas[name] = replica
        log.info("pool %s: replica %s added at %s (role %s)", self.name, name, replica.url, role)
        return replica

    def remove_replica(self, name: str) -> Replica | None:
        replica = self.replicas.pop(name, None)
        if replica is not None:
            self.prefix_index.remove_replica(name)
            self.lora.forget(name)
            if self.precise is not None:
                self.precise.detach(name)
            log.info("pool %s: replica %s removed", self.name, name)
        return replica

    @property
    def disaggregated(self) -> bool:
        return any(r.role == "prefill" for r in self.replicas.values())

    def serving(self, role: str) -> list[Replica]:
        """Available replicas that can take the given leg: `decode` legs also go to mixed ones."""
        if role == "prefill":
            return [r for r in self.replicas.values() if r.role == "prefill" and r.available]
        return [r for r in self.replicas.values() if r.role != "prefill" and r.available]

    def has_healthy(self) -> bool:
        return any(r.healthy and r.role != "prefill" for r in self.replicas.values())

    # -- per request ------------------------------------------------------------------
    def features(
        self,
        body: Mapping[str, Any],
        endpoint: str,
        request_id: str,
        headers: Mapping[str, str],
    ) -> RequestFeatures:
        pieces = prompt_pieces(body, endpoint)
        text = "".join(pieces)
        salt = body.get("cache_salt")
        # The proxy set `model` to the engines' name for the request: the base model's, or an adapter's,
        # whose prefixes are cached (and hashed here) apart from the base model's.
        model = body.get("model")
        adapter = self.lora.adapter_of(model) if isinstance(model, str) else None
        pf = self.hasher.features(
            adapter or self.upstream_model, salt if isinstance(salt, str) else None, text, pieces
        )
        self._learn_token_size(len(text), pf.prompt_tokens)
        prompt_tokens, block_tokens = pf.prompt_tokens, pf.block_tokens
        exact_first, others = batch_tokens(body, endpoint, self._count)
        if exact_first is not None:
            # Token ids were hashed as text: the engine's own count, and blocks scaled to it.
            scale = exact_first / max(1, prompt_tokens)
            block_tokens = [round(t * scale) for t in block_tokens]
            prompt_tokens = exact_first
        prompt_tokens += others
        max_tokens = (
            body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
        )
        return RequestFeatures(
            request_id=request_id,
            model=adapter or self.upstream_model,
            pool=self.name,
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

    def candidates(
        self, features: RequestFeatures, replicas: Iterable[Replica], policy: Policy
    ) -> list[Candidate]:
        replicas = list(replicas)
        if not policy.uses_prefix_match or not features.block_hashes:
            return [Candidate(r) for r in replicas]
        matched = self.prefix_index.match(features.block_hashes, [r.name for r in replicas])
        block_tokens = features.block_tokens
        # A prefix held by many replicas gives them few distinct depths: sum each depth once, not
        # once per replica (up to 0.4 ms for a 2k-token prompt on 256 replicas).
        tokens = {k: sum(block_tokens[:k]) for k in set(matched.values())}
        out = []
        for r in replicas:
            k = matched[r.name]
            out.append(Candidate(r, k, tokens[k]))
        return out

    async def rank(self, features: RequestFeatures, role: str = "decode") -> list[Candidate]:
        """Available replicas for the leg, ranked best first by the pool's (or prefill) policy."""
        policy = self.prefill_policy if role == "prefill" else self.policy
        replicas = self.serving(role)
        adapter = features.adapter
        if adapter is None:
            return await policy.rank(features, self.candidates(features, replicas, policy))
        candidates = self.candidates(features, self.lora.eligible(replicas, adapter), policy)
        if policy.uses_prefix_match:
            self.lora.credit(candidates, adapter)
        return await policy.rank(features, candidates)

    def learn(self, features: RequestFeatures, replica: Replica, role: str = "decode") -> None:
        """The request went to `replica`: it will hold the prompt's blocks once prefilled."""
        if features.block_hashes:
            # In precise mode the engine's events confirm; until then the decision is a guess.
            self.prefix_index.record(
                replica.name, features.block_hashes, speculative=self.precise is not None
            )
        if features.adapter is not None:
            self.lora.routed(replica.name, features.adapter)
        (self.prefill_policy if role == "prefill" else self.policy).on_routed(features, replica)

    def tokens_per_block(self) -> float:
        """Tokens in one hashed block of prompt text, as measured on this pool's traffic."""
        if self._text_chars < 4096:
            return self.cfg.prefix.block_chars / CHARS_PER_TOKEN
        return self.cfg.prefix.block_chars * self._text_tokens / self._text_chars

    def _learn_token_size(self, chars: int, tokens: int) -> None:
        self._text_chars += chars
        self._text_tokens += tokens
        if self._text_chars > 1 << 24:  # forget slowly, so the figure follows the traffic
            self._text_chars //= 2
            self._text_tokens //= 2
        sized = self._sized_tokens_per_block
        if sized and abs(self.tokens_per_block() - sized) > 0.2 * sized:
            for replica in self.replicas.values():
                self.set_kv_capacity(replica)

    def set_kv_capacity(self, replica: Replica) -> None:
        """Size the replica's index budget from the engine's KV capacity, when it is known."""
        cap = replica.kv_capacity_tokens
        if cap and self.precise is not None:
            self.precise.set_capacity(replica.name, cap)
        elif cap and self.cfg.prefix.max_blocks_per_replica is None:
            self._sized_tokens_per_block = tokens_per_block = max(1.0, self.tokens_per_block())
            self.prefix_index.set_capacity(replica.name, max(1, int(cap / tokens_per_block)))
