"""Which GPU the device lent, and the kit's shape on it: one H100 (80 GB) or one H200 (141 GB).

python3 -m bench.gpu.card detect KG MODEL_DIR    read nvidia-smi (or KG_CARD), write KG/card.json and
                                                 KG/card.env, and the model folder's config.json
python3 -m bench.gpu.card render TEMPLATE OUT NAME=VALUE...  a fleet template (bench/gpu/*.yaml.tmpl) with
                                                 its @NAME@ placeholders filled in

Four 8B replicas (16 GB of weights each) do not fit an H100 beside their KV and CUDA graphs: there the
kit runs the same one-token-per-word tokenizer with a Llama-3.2-3B-shaped dummy model (6.4 GB of BF16
weights, 112 KiB of BF16 KV a token) and BF16 KV, as measured from outside on 2026-12-07; on an H200
the Llama-3.1-8B shape with FP8 KV, as every H200 run. Each replica's KV bytes are explicit
(`--kv-cache-memory-bytes`, vLLM 0.26's CacheConfig.kv_cache_memory_bytes, which skips the memory
profiling that four replicas starting together confuse). Every result names the card: card.json
travels with the results and the summary's first line says it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1 << 30
# nvidia-smi's memory.total, MiB: an H100 SXM reports 81,559, an H200 143,771.
H200_MIN_MIB = 100_000

# Llama-3.2-3B over make_model.py's Llama-3.1-8B config (hidden 3072, MLP 8192, 28 layers, 24 heads,
# 8 KV heads of 128, tied embeddings, RoPE scaling factor 32).
LLAMA_3B = {
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


@dataclass(frozen=True)
class Card:
    card: str  # h100 | h200: the scenario sizes the queue runs (`--size h100`)
    shape: str
    sim_profile: str  # the simulator's profile for the same shape on the same GPU
    kv_cache_dtype: str  # the fleets' KV dtype ("auto": the model's BF16)
    kv_cache_memory_bytes: int  # per replica, the routing and PD fleets
    kv_tokens: int  # what vLLM reports for it
    tiers_kv_cache_memory_bytes: int  # per replica, the CPU-tier fleet (QUEUE=tiers)
    tiers_offload_gib: int  # its CPU tier per replica (--kv-offloading-size)


CARDS = {
    # 8 GiB of BF16 KV each (74,898 tokens): 4 x (6.4 GB weights + 8.6 GB KV + graphs) = 69 GB used on
    # 2026-12-07. The tier fleet: 3 GiB of GPU KV (28,086 tokens) and 12 GiB of CPU (112,347) each.
    "h100": Card("h100", "llama-3.2-3b", "h100-llama3.2-3b", "auto", 8 * GIB, 74_898, 3 * GIB, 12),
    # 6,227,702,579 bytes = 95,027 FP8 tokens each (fleet.yaml of the H200 runs). The tier fleet: 3 GiB
    # of FP8 GPU KV (49,152 tokens) and 12 GiB of CPU (196,608) each.
    "h200": Card("h200", "llama-3.1-8b", "h200-llama3.1-8b", "fp8", 6_227_702_579, 95_027, 3 * GIB, 12),
}


def detect(smi: str) -> str:
    """h100 or h200 from `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`."""
    first = smi.strip().splitlines()[0]
    name, _, mib = first.rpartition(",")
    if "H200" in name or float(mib) >= H200_MIN_MIB:
        return "h200"
    return "h100"


def query_gpu() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def write_model_config(model_dir: Path, card: Card) -> None:
    """The model folder's config.json in the card's shape (the 8B config kept beside it)."""
    path = model_dir / "config.json"
    base_path = model_dir / "config-8b.json"
    if not base_path.exists():
        base_path.write_text(path.read_text())
    config = json.loads(base_path.read_text())
    if card.shape == "llama-3.2-3b":
        config.update(LLAMA_3B)
    path.write_text(json.dumps(config, indent=1))


def card_detect(kg: Path, model_dir: Path) -> int:
    forced = os.environ.get("KG_CARD")
    smi = "" if forced else query_gpu()
    name = forced or detect(smi)
    card = CARDS[name]
    write_model_config(model_dir, card)
    doc = {**asdict(card), "nvidia_smi": smi.strip() or None, "forced_by_KG_CARD": bool(forced)}
    (kg / "card.json").write_text(json.dumps(doc, indent=1))
    env = {
        "CARD": card.card,
        "KV_DTYPE": card.kv_cache_dtype,
        "KV_BYTES": card.kv_cache_memory_bytes,
        "TIERS_KV_BYTES": card.tiers_kv_cache_memory_bytes,
        "TIERS_OFFLOAD_GIB": card.tiers_offload_gib,
        "SIM_PROFILE": card.sim_profile,
    }
    (kg / "card.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    print(f"card {card.card}: {card.shape}, {card.kv_cache_dtype} KV, {card.kv_cache_memory_bytes} B each")
    return 0


def render(template: Path, out: Path, values: dict[str, str]) -> None:
    """A fleet template with its @NAME@ placeholders filled in."""
    text = template.read_text()
    for name, value in values.items():
        text = text.replace(f"@{name}@", value)
    if "@" in "".join(line.split("#", 1)[0] for line in text.splitlines()):
        raise SystemExit(f"{template}: a placeholder is left unfilled in {out}")
    out.write_text(text)


def main(argv: list[str]) -> int:
    if argv[:1] == ["detect"] and len(argv) == 3:
        return card_detect(Path(argv[1]), Path(argv[2]))
    if argv[:1] == ["render"] and len(argv) >= 3:
        values = dict(arg.split("=", 1) for arg in argv[3:])
        render(Path(argv[1]), Path(argv[2]), values)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
