"""Roofline step-time model (simulator.md) and KV-cache sizing for one engine replica.

A step's GEMMs read the weights once and do 2*N FLOPs per token; attention reads every context token's KV and
does 4*L*d FLOPs per (query, key) pair. The two run as separate kernels, so their times add; within the
GEMMs a smooth maximum of compute and weight-read time (cube norm) stands in for the roofline knee,
which real kernels round off. Fixed and per-sequence overheads come on top. The constants live in the profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.sim.profiles import Profile

_FP8_DTYPES = {"fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"}
_BF16_DTYPES = {"auto", "bf16", "bfloat16", "float16", "half"}


def kv_dtype_bytes(kv_cache_dtype: str) -> int:
    if kv_cache_dtype in _FP8_DTYPES:
        return 1
    if kv_cache_dtype in _BF16_DTYPES:
        return 2
    raise ValueError(f"unsupported --kv-cache-dtype {kv_cache_dtype!r}")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, as sums over its sequences (no per-sequence objects needed)."""

    prefill_tokens: int = 0  # sum p_i: new prompt tokens this step
    prefill_attn_pairs: float = 0.0  # sum p_i * (c_i + p_i / 2)
    prefill_ctx_tokens: int = 0  # sum (c_i + p_i): KV read by the prefill chunks
    decode_seqs: int = 0  # B
    decode_ctx_tokens: int = 0  # sum ctx_j
    prompt_tokens_admitted: int = 0  # cached + new prompt tokens of requests first scheduled this step
    num_seqs: int = 0
    stall_s: float = 0.0  # blocking work before the forward pass: LoRA swap-ins, adapter loads


class CostModel:
    def __init__(
        self, profile: Profile, kv_cache_dtype: str = "auto", tp: int | None = None, gpu_share: int = 1
    ) -> None:
        p = profile
        self.profile = p
        self.tp = tp or p.tp
        # A replica alone in its process on a GPU it shares with gpu_share - 1 others it cannot see: its
        # steps take its 1/gpu_share of the time-sliced GPU, busy or not (gateway.sim.device).
        self.slowdown = 1.0 if gpu_share == 1 else gpu_share / p.timeslice_efficiency
        self.kv_bpt = p.model.kv_bytes_per_token(kv_dtype_bytes(kv_cache_dtype))
        flops = self.tp * p.hardware.flops * p.mfu
        bw = self.tp * p.hardware.hbm_bw * p.mbu
        m = p.model
        self._lin_s_per_token = 2 * m.params / flops
        self._attn_s_per_pair = 4 * m.layers * m.heads * m.head_dim / flops
        self._kv_read_s_per_token = self.kv_bpt / bw
        self._weights_s3 = (m.weight_bytes / bw) ** 3

    def step_time(self, s: StepShape) -> float:
        p = self.profile
        lin = self._lin_s_per_token * (s.prefill_tokens + s.decode_seqs)
        gemm = (lin**3 + self._weights_s3) ** (1 / 3)
        attn = max(
            self._attn_s_per_pair * (s.prefill_attn_pairs + s.decode_ctx_tokens),
            self._kv_read_s_per_token * (s.prefill_ctx_tokens + s.decode_ctx_tokens),
        )
        t = gemm + attn + p.step_overhead_s + p.per_seq_s * s.num_seqs
        if s.prefill_tokens:
            t += p.prefill_step_overhead_s
        return (t + p.per_prompt_token_s * s.prompt_tokens_admitted + s.stall_s) * self.slowdown

    @property
    def host_load_s_per_token(self) -> float:
        """Copying one token's KV from the CPU tier to the GPU."""
        return self.kv_bpt / self.profile.host_load_bw

    def frontend_time(self, prompt_tokens: int) -> float:
        return self.profile.frontend_s + self.profile.frontend_per_token_s * prompt_tokens

    def transfer_time(self, tokens: int) -> float:
        """PD KV hand-off of `tokens` tokens over the profile's link, alone on it (the engine shares it)."""
        return self.profile.transfer_t0_s + tokens * self.kv_bpt / self.profile.transfer_bw

    def num_gpu_blocks(
        self,
        block_size: int,
        gpu_memory_utilization: float = 0.92,
        kv_cache_memory_bytes: int | None = None,
    ) -> int:
        """Blocks vLLM would report: what is left of the memory share after weights and activations."""
        p = self.profile
        per_gpu: float
        if kv_cache_memory_bytes is not None:
            per_gpu = kv_cache_memory_bytes
        else:
            per_gpu = (
                gpu_memory_utilization * p.hardware.memory_bytes
                - p.model.weight_bytes / self.tp
                - p.activation_bytes
                - p.other_bytes
            )
        if per_gpu <= 0:
            raise ValueError("no memory left for the KV cache: raise --gpu-memory-utilization")
        # Each GPU holds its KV heads' share of every token.
        return int(per_gpu * self.tp // (block_size * self.kv_bpt))
