"""Workload generators: seeded determinism, exact token lengths, Mooncake sharing structure."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Any

import pytest

from bench import text
from bench.workloads import WORKLOADS, MooncakeTrace, make_workload, mooncake_dir
from gateway.prompt.tokens import get_tokenizer

SMALL: dict[str, dict[str, Any]] = {
    "shared-prefix": {"groups": 3, "prompts_per_group": 4, "system_tokens": 64, "question_tokens": 8},
    "dynamic-system-prompt": {"groups": 2, "prompts_per_group": 3, "system_tokens": 64, "question_tokens": 8},
    "prefix-repetition": {"num_prefixes": 2, "prefix_tokens": 64, "suffix_tokens": 8, "num_requests": 10},
    "multi-turn": {"sessions": 3, "turns": 3, "system_tokens": 32, "user_tokens": 8, "output_tokens": 8},
    "mixed-priority": {"num_requests": 20, "batch_prompt_tokens": 300},
    "long-prompt": {"num_requests": 20, "long_fraction": 0.2, "long_min_tokens": 300, "long_max_tokens": 400},
    "mooncake": {"length_scale": 0.05, "max_requests": 20},
    "lora-mix": {"adapters": 4, "system_tokens": 16, "question_tokens": 8, "num_requests": 40},
    "tool-agent": {"sessions": 4, "turns": 3, "system_tokens": 32, "user_tokens": 8, "output_tokens": 8},
    "prefix-surge": {"groups": 3, "system_tokens": 32, "question_tokens": 8, "num_requests": 40},
}

needs_trace = pytest.mark.skipif(
    not (mooncake_dir() / "conversation_trace.jsonl").exists(), reason="Mooncake traces not present"
)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_every_workload_has_a_small_case() -> None:
    assert set(SMALL) == set(WORKLOADS)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_same_seed_same_requests_other_seed_other_text(name: str) -> None:
    if name == "mooncake" and not (mooncake_dir() / "conversation_trace.jsonl").exists():
        pytest.skip("Mooncake traces not present")
    first = make_workload(name, SMALL[name]).build(seed=7)
    again = make_workload(name, SMALL[name]).build(seed=7)
    other = make_workload(name, SMALL[name]).build(seed=8)
    assert first == again
    assert [r.messages for r in first] != [r.messages for r in other]
    assert [r.index for r in first] == list(range(len(first)))


@pytest.mark.parametrize(
    "name", ["shared-prefix", "prefix-repetition", "mixed-priority", "long-prompt", "lora-mix"]
)
def test_prompt_tokens_are_exact(name: str) -> None:
    tok = get_tokenizer()
    for req in make_workload(name, SMALL[name]).build(seed=1):
        assert sum(len(tok.encode(m["content"])) for m in req.messages) == req.prompt_tokens


def test_concatenated_blocks_tokenize_as_their_parts() -> None:
    tok = get_tokenizer()
    parts = [text.block(f"b{i}", 37, i) for i in range(20)] + [text.words(f"w{i}", 5) for i in range(20)]
    joined = "".join(parts)
    assert tok.encode(joined) == [t for p in parts for t in tok.encode(p)]
    assert len(tok.encode(joined)) == 20 * 37 + 20 * 5


def test_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    tok = get_tokenizer()
    w = make_workload("shared-prefix", SMALL["shared-prefix"])
    reqs = w.build(seed=3)
    by_group: dict[str, list[list[int]]] = {}
    for r in reqs:
        by_group.setdefault(r.group or "", []).append(tok.encode(r.prompt_text()))
    assert len(by_group) == 3 and all(len(v) == 4 for v in by_group.values())
    for prompts in by_group.values():
        assert common_prefix(prompts[0], prompts[1]) >= 64
    groups = list(by_group.values())
    assert common_prefix(groups[0][0], groups[1][0]) < 64


def test_dynamic_prompt_starts_with_time_and_user_then_shares_the_rest() -> None:
    reqs = make_workload("dynamic-system-prompt", SMALL["dynamic-system-prompt"]).build(seed=0)
    systems = [r.messages[0]["content"] for r in reqs if r.group == "g0"]
    assert all(s.startswith("Today is 2026-11-29T") and ", user " in s for s in systems)
    assert len(set(systems)) == len(systems)  # the volatile head differs per request
    assert len({s.split(". You are", 1)[1] for s in systems}) == 1  # the static rest is shared


def test_dynamic_prompt_as_a_line_of_words_the_kit_tokenizer_knows() -> None:
    params = {**SMALL["dynamic-system-prompt"], "head": "line"}
    reqs = make_workload("dynamic-system-prompt", params).build(seed=0)
    systems = [r.messages[0]["content"] for r in reqs if r.group == "g0"]
    heads = [s.split("\n", 1)[0] for s in systems]
    assert all(h.startswith("time ") and " session " in h for h in heads)
    assert len(set(heads)) == len(heads)  # per request
    assert len({s.split("\n", 1)[1] for s in systems}) == 1  # the rest shared
    vocab = {w.strip() for w in text.vocabulary()}
    assert all(w in vocab for h in heads for w in h.split()[1:] if w != "session")  # no <unk> on the GPU
    with pytest.raises(ValueError, match="head"):
        make_workload("dynamic-system-prompt", {**params, "head": "banner"}).build(seed=0)


def test_multi_turn_resends_history_and_waits_for_the_previous_turn() -> None:
    reqs = make_workload("multi-turn", SMALL["multi-turn"]).build(seed=0)
    by_session: dict[str, list[Any]] = {}
    for r in reqs:
        by_session.setdefault(r.group or "", []).append(r)
    for turns in by_session.values():
        assert turns[0].depends_on is None
        for prev, cur in itertools.pairwise(turns):
            assert cur.depends_on == prev.index
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert cur.messages[len(prev.messages)]["role"] == "assistant"


def test_mixed_priority_marks_classes() -> None:
    reqs = make_workload("mixed-priority", SMALL["mixed-priority"]).build(seed=0)
    assert {r.priority for r in reqs} == {"interactive", "batch"}
    assert all(r.kind == r.priority for r in reqs)
    assert all(r.prompt_tokens == (300 if r.priority == "batch" else 256) for r in reqs)


def test_make_workload_coerces_and_rejects_unknown_parameters() -> None:
    w = make_workload("shared-prefix", {"groups": "5", "output-tokens": "9"})
    assert dataclasses.asdict(w)["groups"] == 5 and dataclasses.asdict(w)["output_tokens"] == 9
    with pytest.raises(ValueError, match="no parameter 'nope'"):
        make_workload("shared-prefix", {"nope": "1"})
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope")


def _expected_shared(a: Any, b: Any, ids_a: list[int], ids_b: list[int], bt: int) -> int:
    k = common_prefix(ids_a, ids_b)
    if k == len(ids_a) or k == len(ids_b):  # one prompt's blocks are a prefix of the other's
        return min(a.prompt_tokens, b.prompt_tokens, k * bt)
    return k * bt


@needs_trace
@pytest.mark.parametrize(("scale", "n"), [(1.0, 40), (0.1, 300)])
def test_mooncake_replay_shares_exactly_the_common_blocks(scale: float, n: int) -> None:
    tok = get_tokenizer()
    w = MooncakeTrace(length_scale=scale, max_requests=n)
    rows = w.rows()
    reqs = w.build(seed=0)
    assert len(reqs) == n
    encoded = [tok.encode(r.prompt_text()) for r in reqs]
    shared_pairs = 0
    for i in range(n):
        assert len(encoded[i]) == reqs[i].prompt_tokens
        for j in range(max(0, i - 30), i):
            ids_i, ids_j = rows[i]["hash_ids"], rows[j]["hash_ids"]
            expected = _expected_shared(reqs[i], reqs[j], ids_i, ids_j, w.block_tokens)
            assert common_prefix(encoded[i], encoded[j]) == expected, (i, j)
            shared_pairs += expected > 0
    assert shared_pairs > 0  # the trace does share prefixes; otherwise the test proves nothing
    if scale == 1.0:
        assert w.block_tokens == 512


@needs_trace
def test_mooncake_scaling_and_timing_options() -> None:
    full = MooncakeTrace(max_requests=50, length_scale=0.01, time_scale=1.0).build(seed=0)
    fast = MooncakeTrace(max_requests=50, length_scale=0.01, time_scale=0.5, output_scale=0.001).build(seed=0)
    assert [r.at for r in fast] == [pytest.approx((r.at or 0) * 0.5) for r in full]
    assert all(f.max_tokens == 1 for f in fast) and any(r.max_tokens > 1 for r in full)
    capped = MooncakeTrace(max_requests=50, length_scale=0.01, max_input_tokens=30)
    kept = capped.build(seed=0)
    assert all(r.prompt_tokens <= 30 for r in kept) and capped.dropped == 50 - len(kept)


def test_mooncake_missing_trace_names_the_path(tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        MooncakeTrace(data_dir=str(tmp_path)).build(seed=0)


@needs_trace
def test_mooncake_groups_skip_the_prefix_every_request_shares() -> None:
    reqs = MooncakeTrace(length_scale=0.01, max_requests=300).build(seed=0)
    sizes = Counter(r.group for r in reqs)
    assert max(sizes.values()) < 0.1 * len(reqs)  # block 0 starts every request; it is no group
    assert len(sizes) < len(reqs)  # but turns of one conversation do share a group


def test_lora_mix_asks_for_adapters_by_popularity() -> None:
    reqs = make_workload("lora-mix", {"adapters": 4, "num_requests": 400, "question_tokens": 8}).build(seed=3)
    counts = Counter(r.model for r in reqs)
    assert set(counts) == {"lora-0", "lora-1", "lora-2", "lora-3"}
    assert counts["lora-0"] > counts["lora-1"] > counts["lora-3"]  # Zipf: the first is the hot one
    uniform = make_workload("lora-mix", {"adapters": 4, "num_requests": 400, "zipf_s": 0}).build(seed=3)
    assert max(Counter(r.model for r in uniform).values()) < 140


def test_tool_agent_sessions_share_their_agents_tools_then_grow() -> None:
    reqs = make_workload("tool-agent", SMALL["tool-agent"]).build(0)
    tools = {r.group: r.messages[0]["content"] for r in reqs}
    assert len(tools) == 4 and len(set(tools.values())) == 2  # sessions 0, 2 and 1, 3 share an agent
    assert tools["s0"] == tools["s2"] != tools["s1"] == tools["s3"]
    last = max((r for r in reqs if r.group == "s0"), key=lambda r: r.index)
    assert last.depends_on is not None and len(last.messages) == 1 + 2 * 2 + 1


def test_prefix_surge_starts_mid_run_with_one_new_prefix() -> None:
    reqs = make_workload("prefix-surge", SMALL["prefix-surge"] | {"surge_at": 0.5}).build(0)
    surge = [r for r in reqs if r.kind == "surge"]
    assert surge and min(r.index for r in surge) >= 20
    assert {r.group for r in surge} == {"g3"}
    assert {r.messages[0]["content"] for r in surge} == {surge[0].messages[0]["content"]}
    assert "g3" not in {r.group for r in reqs if r.kind == "background"}
