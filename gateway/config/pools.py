"""A pool: one model's replicas (launched, listed or discovered) and how requests reach them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from gateway.config.base import Strict
from gateway.config.endpoints import DiscoveryConfig, EndpointConfig
from gateway.config.engines import EngineSpec
from gateway.config.prefix import CanonicalizeConfig, PolicyConfig, PrefixConfig


class ClientPassthrough(Strict):
    """Engine-steering input a pool's clients may send through (see gateway/path/sanitize.py)."""

    body_fields: list[str] = Field(
        default_factory=list, description="e.g. kv_transfer_params, for engines that take it from clients"
    )
    headers: list[str] = Field(
        default_factory=list, description="e.g. x-sim-fault, for fault-injection tests against the simulator"
    )


class FailoverConfig(Strict):
    """Continuing an answer on another replica when its engine fails mid-answer (docs/failover.md)."""

    mid_stream: bool = Field(
        True, description="Continue chat and completions answers whose attempt failed after it began"
    )
    max_resumes: int = Field(1, ge=0, description="Continuations one answer may take")
    budget_ratio: float = Field(
        1.0,
        ge=0,
        description="Continuations allowed in the last 10 s as a fraction of the streams at risk (the"
        " pool's requests in flight and those continued; at least 10). 1: every stream a failure cuts"
        " is continued (each at most max_resumes times)",
    )
    max_kept_bytes: int = Field(
        1 << 20,
        ge=0,
        description="Bytes of a streamed answer kept to continue it: past them the answer is relayed on"
        ' without failover (kvgate_resume_blocked_total{reason="too_long"}). A non-streamed answer'
        " assembled here is bounded by upstream.max_response_bytes instead",
    )
    non_streamed: bool = Field(
        False,
        description="Continue non-streamed answers too: engines are asked for them as streams, assembled "
        "here (the body then holds id, created, model, text, finish and stop reason, usage: an engine's "
        "other fields are not carried, hence opt-in)",
    )


class PDConfig(Strict):
    """When a request of a prefill/decode pool is handed off between two replicas."""

    min_uncached_tokens: int = Field(512, ge=0, description="Disaggregate only above this many new tokens")
    max_transfer_tokens: int = Field(
        0,
        ge=0,
        description="Disaggregate only while the prompts of hand-offs whose decode leg has not begun to"
        " answer (their KV in transfer) hold fewer tokens than this; beyond, the decode replica prefills"
        " the request itself (0: no bound). Size it as the link's bytes/s over the KV bytes per token,"
        " times the queueing accepted (docs/engines.md)",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_prefill_policy(cls, data: Any) -> Any:
        if isinstance(data, dict) and "prefill_policy" in data:
            raise ValueError(
                "prefill_policy was removed (deprecated since the last release): the pool's policy "
                "picks both legs (Policy.select_pair; by default the prefill leg by least load); "
                "remove the key, and move a custom prefill ranking into your policy's select_pair"
            )
        return data


Task = Literal["generate", "embed", "classify", "score"]


class AdapterSpec(Strict):
    """A LoRA adapter clients may ask for."""

    name: str = Field(min_length=1, max_length=256, description="The adapter's name at the engines")
    path: str | None = Field(None, min_length=1, description="Where an engine loads it from (load_on_demand)")


class PoolLoraConfig(Strict):
    """The LoRA adapters a pool's replicas serve, as routing facts."""

    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        description="Adapters clients may ask for by name; taken to be on every replica unless `discover` "
        "reads a replica's own list or `load_on_demand` loads them (engines.lora.modules are added)",
    )
    discover: bool = Field(
        False, description="Learn each replica's adapters (and max_model_len) from its /v1/models"
    )
    discover_interval_s: float = Field(10.0, gt=0, description="How often each replica's /v1/models is read")
    load_on_demand: bool = Field(
        False,
        description="Load a declared adapter onto a replica that lacks it (POST /v1/load_lora_adapter "
        "with its path) before sending it the request",
    )
    load_timeout_s: float = Field(120.0, gt=0, description="Longest wait for an adapter to load")
    load_retry_s: float = Field(
        10.0, gt=0, description="After a failed load, wait this long before trying that replica again"
    )
    affinity_tokens: int = Field(
        512,
        ge=0,
        description="Prefix-aware policies: an adapter believed resident on a replica counts as this "
        "many cached prompt tokens there (a swap-in, and a batch slot)",
    )
    slots_per_replica: int | None = Field(
        None, gt=0, description="Adapters a replica keeps resident (default: engines.lora.max_loras, else 1)"
    )

    @model_validator(mode="after")
    def _loadable(self) -> PoolLoraConfig:
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must be unique: {names}")
        if self.load_on_demand:
            missing = [a.name for a in self.adapters if a.path is None]
            if missing:
                raise ValueError(f"load_on_demand needs a path for every adapter; missing: {missing}")
        return self


class PoolConfig(Strict):
    """A pool: replicas serving one model, and how requests are routed among them."""

    name: str = Field(description="The pool's name, in routes, metrics and the admin API")
    model: str = Field(description="Model name the engines serve")
    served_model: str | None = Field(None, description="Rewrite `model` to this upstream (default: model)")
    tasks: list[Task] = Field(
        default_factory=lambda: list[Task](["generate"]),
        min_length=1,
        description="What the pool's engines serve: generate (chat, completions, responses), embed "
        "(embeddings, pooling, score, rerank), classify (classify, pooling), score (score, rerank, pooling)",
    )
    lora: PoolLoraConfig = Field(default_factory=PoolLoraConfig, description="The LoRA adapters served")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="The routing policy")
    canonicalize: CanonicalizeConfig = Field(
        default_factory=CanonicalizeConfig, description="Prompt canonicalization"
    )
    prefix: PrefixConfig = Field(default_factory=PrefixConfig, description="The prefix index")
    pd: PDConfig = Field(default_factory=PDConfig, description="Prefill/decode hand-offs")
    failover: FailoverConfig = Field(default_factory=FailoverConfig, description="Mid-answer failover")
    engines: EngineSpec | None = Field(None, description="Replicas launched and supervised by the gateway")
    endpoints: list[EndpointConfig] = Field(default_factory=list, description="Replicas someone else runs")
    discovery: DiscoveryConfig | None = Field(
        None,
        description="Replicas discovered from Kubernetes, joining and leaving as pods become ready or go",
    )
    tokenizer: str | None = Field(
        None,
        description="The engines' tokenizer, so that index sizing and job sizes are in their tokens: a "
        "tokenizer.json (or a model directory holding one; needs kvgate[tokenizers]), builtin:words or "
        "builtin:cl100k. Unset: a managed pool's --tokenizer flag or local model directory (vllm and "
        "sglang: also the Hugging Face cache), else cl100k counts corrected by the tokens per "
        "character learned from the engines' usage figures (or their prompt token counters)",
    )
    client_passthrough: ClientPassthrough = Field(
        default_factory=ClientPassthrough, description="Engine-steering input clients may send through"
    )
    priority_scheduling: bool = Field(
        False,
        description="The (unmanaged) endpoints run priority scheduling: forward each request's priority "
        "(managed fleets: engines.priority_scheduling)",
    )

    @model_validator(mode="after")
    def _has_replicas(self) -> PoolConfig:
        if self.engines is None and not self.endpoints and self.discovery is None:
            raise ValueError("needs `engines` (managed), `endpoints` (unmanaged) or `discovery`")
        if self.engines is not None and self.discovery is not None:
            raise ValueError("`engines` (launched here) and `discovery` exclude each other")
        if self.lora.load_on_demand and self.engines is not None:
            lora = self.engines.lora
            if self.engines.kind != "sglang" and (lora is None or not lora.runtime_updates):
                raise ValueError("lora.load_on_demand needs engines.lora.runtime_updates: true")
        if self.prefix.mode == "precise" and not (
            (self.engines is not None and self.engines.kv_events)
            or any(e.kv_events for e in self.endpoints)
            or self.discovery is not None  # each pod names its publisher (kvgate.io/kv-events-port)
        ):
            raise ValueError(
                "prefix.mode precise needs KV events: set engines.kv_events: true or endpoints[].kv_events"
            )
        return self

    @property
    def adapter_specs(self) -> list[AdapterSpec]:
        """Declared adapters: `lora.adapters`, then the managed engines' `--lora-modules`."""
        out = list(self.lora.adapters)
        names = {a.name for a in out}
        if self.engines is not None and self.engines.lora is not None:
            out += [
                AdapterSpec(name=m.name, path=m.path)
                for m in self.engines.lora.modules
                if m.name not in names
            ]
        return out

    @property
    def engine_block_size(self) -> int:
        """Tokens per engine KV block, as precise mode hashes them (vLLM's and the simulator's default 16)."""
        engines_bs = self.engines.block_size if self.engines is not None else None
        return self.prefix.engine_block_size or engines_bs or 16
