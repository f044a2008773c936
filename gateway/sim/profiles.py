"""Named hardware+model presets for the simulator, each naming where its numbers come from.

A profile fixes the roofline inputs (peak FLOP/s, HBM bandwidth, model shape) and the efficiencies and
overheads that turn them into step times. `h200-llama3.1-8b` is calibrated to the measured vLLM 0.26
figures (bench/sim_calibration.py); the others use the roofline formula with textbook efficiencies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    flops: float  # dense BF16 FLOP/s per GPU
    hbm_bw: float  # bytes/s per GPU
    memory_bytes: int  # per GPU, as the CUDA driver reports it


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    params: float  # non-embedding parameters
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    weight_bytes: int  # BF16 weights, all GPUs together

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_dtype_bytes


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    source: str
    hardware: Hardware
    model: ModelShape
    tp: int = 1
    mfu: float = 0.5
    mbu: float = 0.75
    step_overhead_s: float = 1e-3  # launch + scheduling, every step
    per_seq_s: float = 4e-6  # per sequence in the batch (sampling, metadata)
    prefill_step_overhead_s: float = 0.0  # extra for steps that carry a prefill chunk (no full CUDA graph)
    per_prompt_token_s: float = 0.0  # input processing, once per prompt token (cached or not)
    frontend_s: float = 0.0  # API server: request parsing, hand-off to the engine
    frontend_per_token_s: float = 0.0
    activation_bytes: int = 0  # per GPU, reserved besides weights when sizing the KV cache
    other_bytes: int = 0  # per GPU: CUDA graphs, non-torch allocations
    transfer_t0_s: float = 0.45e-3  # PD KV transfer: fixed part
    transfer_bw: float = 148e9  # PD KV transfer: effective bytes/s (Mooncake 8x RDMA)
    # CPU KV tier (--kv-offloading-size): host-to-GPU copy of offloaded blocks, effective bytes/s. An
    # assumption until measured on the H200: pinned-memory copies over PCIe Gen5 x16 (~55 GB/s peak)
    # reach about 40 GB/s with blocks of 16 tokens scattered over the layers.
    host_load_bw: float = 40e9
    # Replicas time-sharing one GPU (--gpu-share): the fraction of its time that does their work while
    # more than one has work queued; the rest goes to context switches (gateway.sim.device).
    timeslice_efficiency: float = 0.93


H200 = Hardware("H200", flops=989e12, hbm_bw=4.8e12, memory_bytes=143_771 * 1024**2)
H100 = Hardware("H100", flops=989e12, hbm_bw=3.35e12, memory_bytes=81_559 * 1024**2)
# A small, made-up accelerator for fast tests: steps of about a millisecond, a cache of a few thousand blocks.
TOY = Hardware("toy", flops=100e12, hbm_bw=1e12, memory_bytes=2 * GiB)

LLAMA_8B = ModelShape("llama-3.1-8b", 6.98e9, 32, 32, 8, 128, 16_060_000_000)
# The GPU kit's H100 shape (bench/gpu/card.py): hidden 3072, MLP 8192, tied embeddings (6.4 GB of BF16).
LLAMA_3B = ModelShape("llama-3.2-3b", 2.82e9, 28, 24, 8, 128, 6_425_000_000)
LLAMA_70B = ModelShape("llama-3.1-70b", 68.45e9, 80, 64, 8, 128, 141_000_000_000)
TINY = ModelShape("tiny-0.5b", 0.5e9, 24, 16, 2, 64, 1_000_000_000)

# Calibrated to vLLM on an H200; the H100 profile moves its efficiencies and overheads to another card.
H200_LLAMA_8B = Profile(
    "h200-llama3.1-8b",
    "calibrated to measurement: vLLM 0.26 on one H200, 2026-11-29 (bench/sim_calibration.py); "
    "four replicas sharing it (--gpu-share 4): results/gpu/, 2026-12-01",
    H200,
    LLAMA_8B,
    mfu=0.67,
    mbu=0.75,
    step_overhead_s=0.5e-3,
    per_seq_s=8e-6,
    prefill_step_overhead_s=3.5e-3,
    per_prompt_token_s=1.1e-6,
    frontend_s=4.3e-3,
    frontend_per_token_s=1.25e-6,
    activation_bytes=int(1.1 * GiB),
    other_bytes=int(0.788 * GiB),
)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        H200_LLAMA_8B,
        replace(
            H200_LLAMA_8B,
            name="h100-llama3.2-3b",
            source="the h200-llama3.1-8b calibration's efficiencies and overheads moved to an H100 and a "
            "Llama-3.2-3B shape (the GPU kit on an H100, bench/gpu): not measured as such",
            hardware=H100,
            model=LLAMA_3B,
        ),
        Profile(
            "h100x4-llama3.1-70b",
            "roofline formula (textbook efficiencies: MFU 0.5, MBU 0.75, 1 ms overhead), not measured",
            H100,
            LLAMA_70B,
            tp=4,
            activation_bytes=int(1.5 * GiB),
            other_bytes=int(1.0 * GiB),
        ),
        Profile(
            "h100-llama3.1-8b",
            "roofline formula (textbook efficiencies: MFU 0.5, MBU 0.75, 1 ms overhead), not measured",
            H100,
            LLAMA_8B,
            activation_bytes=int(1.1 * GiB),
            other_bytes=int(0.75 * GiB),
        ),
        Profile(
            "tiny",
            "roofline formula on a made-up toy accelerator: fast steps and a small cache for tests",
            TOY,
            TINY,
            step_overhead_s=0.2e-3,
            activation_bytes=int(0.1 * GiB),
        ),
    )
}

DEFAULT_PROFILE = "h200-llama3.1-8b"


def get_profile(name: str, **overrides: object) -> Profile:
    try:
        base = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
    return replace(base, **overrides) if overrides else base  # type: ignore[arg-type]
