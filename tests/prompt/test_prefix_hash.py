"""Prompt serialization and chained block hashes: what shares a block, what never does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import CanonicalizeConfig, CanonicalizeRule
from gateway.prompt.canonicalize import canonicalize
from gateway.prompt.prefix_hash import PrefixHasher, chain_seed, prompt_pieces, prompt_text
from gateway.prompt.tokens import get_tokenizer

BC = 16
words = st.text(alphabet="abcdefgh .,\n", min_size=0, max_size=200)
uni = st.text(min_size=0, max_size=120)


def chat(system: str, user: str, **extra: object) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def leading_shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=150, deadline=None)
@given(a=uni, b=uni)
def test_blocks_equal_exactly_where_text_prefixes_are_equal(a: str, b: str) -> None:
    hasher = PrefixHasher(block_chars=BC)
    ha = hasher.block_hashes("m", None, a)
    hb = hasher.block_hashes("m", None, b)
    assert len(ha) == len(a) // BC
    assert leading_shared(ha, hb) == min(common_prefix(a, b) // BC, len(ha), len(hb))
    assert hasher.block_hashes("m", None, a) == ha  # deterministic


@settings(max_examples=100, deadline=None)
@given(system=words, u1=words, u2=words)
def test_same_system_prompt_shares_exactly_its_blocks(system: str, u1: str, u2: str) -> None:
    hasher = PrefixHasher(block_chars=BC)
    t1, t2 = prompt_text(chat(system, u1), "chat"), prompt_text(chat(system, u2), "chat")
    f1, f2 = hasher.features("m", None, t1), hasher.features("m", None, t2)
    assert leading_shared(f1.block_hashes, f2.block_hashes) == min(
        common_prefix(t1, t2) // BC, len(f1.block_hashes), len(f2.block_hashes)
    )
    # Everything up to the end of the system turn is common to both.
    assert common_prefix(t1, t2) >= len(f"<|system|>{system}\n<|user|>")


@settings(max_examples=50, deadline=None)
@given(text=st.text(min_size=BC, max_size=300), s1=st.text(max_size=8), s2=st.text(max_size=8))
def test_cache_salt_isolates_the_whole_chain(text: str, s1: str, s2: str) -> None:
    hasher = PrefixHasher(block_chars=BC)
    a = hasher.block_hashes("m", s1, text)
    b = hasher.block_hashes("m", s2 + "x", text) if s1 == s2 else hasher.block_hashes("m", s2, text)
    assert not set(a) & set(b)
    assert not set(hasher.block_hashes("m", None, text)) & set(a)
    assert not set(hasher.block_hashes("other", s1, text)) & set(a)


def test_roles_tools_and_parts_are_part_of_the_prompt() -> None:
    as_system = prompt_text({"messages": [{"role": "system", "content": "hello"}]}, "chat")
    as_user = prompt_text({"messages": [{"role": "user", "content": "hello"}]}, "chat")
    assert as_system != as_user
    parts = prompt_text(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}, "chat"
    )
    assert parts == as_user
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}
    with_image = prompt_text({"messages": [{"role": "user", "content": [image]}]}, "chat")
    assert len(with_image) < 100
    other_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,B"}}
    assert with_image != prompt_text({"messages": [{"role": "user", "content": [other_image]}]}, "chat")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"z": {}, "a": {}}}}}
    with_tools = prompt_text({"tools": [tool], "messages": [{"role": "user", "content": "hello"}]}, "chat")
    assert with_tools.startswith("<|tools|>") and with_tools.endswith(as_user)
    assert with_tools.index('"z"') < with_tools.index('"a"')  # schema key order as sent


def test_completions_prompt_shapes() -> None:
    assert prompt_text({"prompt": "abc"}, "completions") == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}, "completions") == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}, "completions") == "1 2 3"
    assert prompt_text({"prompt": [[4, 5], [6]]}, "completions") == "4 5"
    assert prompt_text({"prompt": None}, "completions") == ""
    assert prompt_text([], "chat") == ""  # type: ignore[arg-type]
    assert prompt_text({"instructions": "sys", "input": "hi"}, "responses") == "<|system|>sys\n<|user|>hi\n"


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog. " * 40 + "tail",
        json.dumps(
            [
                {"name": f"tool_{i}", "parameters": {"properties": {"a": {"type": "string"}}}}
                for i in range(30)
            ]
        ),
        Path(__file__).read_text(),
        "这是一个测试句子\uff0c用于检查分词器的行为\u3002" * 40,
    ],
    ids=["prose", "json", "code", "cjk"],
)
def test_token_counts_close_to_whole_text_count(text: str) -> None:
    true = get_tokenizer().count(text)
    hasher = PrefixHasher(block_chars=64)
    f = hasher.features("m", None, text)
    assert len(f.block_tokens) == len(f.block_hashes) == len(text) // 64
    assert sum(f.block_tokens) <= f.prompt_tokens
    assert abs(f.prompt_tokens - true) <= max(2, true // 200)
    again = hasher.features("m", None, text)  # served from the token cache
    assert (again.block_tokens, again.prompt_tokens) == (f.block_tokens, f.prompt_tokens)


@settings(max_examples=100, deadline=None)
@given(
    head=st.text(alphabet="ab .\n", max_size=120),
    tails=st.lists(st.text(alphabet="ab .\n", max_size=60), max_size=4),
)
def test_token_cache_is_transparent(head: str, tails: list[str]) -> None:
    warm = PrefixHasher(block_chars=BC)
    for tail in tails:
        texts = [head + tail, head + tail[::-1], head]
        for t in texts:
            assert warm.features("m", None, t) == PrefixHasher(block_chars=BC).features("m", None, t)


def test_token_cache_is_bounded() -> None:
    hasher = PrefixHasher(block_chars=8, token_cache_size=10)
    hasher.features("m", None, os.urandom(400).hex())
    assert hasher.cached_blocks() == 10


def test_non_ascii_suffix_keeps_ascii_blocks() -> None:
    hasher = PrefixHasher(block_chars=BC)
    ascii_text = "a" * (BC * 3)
    assert hasher.block_hashes("m", None, ascii_text + "é" * BC)[:3] == hasher.block_hashes(
        "m", None, ascii_text
    )


def test_seed_depends_on_model_and_salt() -> None:
    assert len({chain_seed("m", None), chain_seed("m", ""), chain_seed("m", "s"), chain_seed("n", None)}) == 4


DYN_CFG = CanonicalizeConfig(
    enabled=True, rules=[CanonicalizeRule(name="user_id", pattern=r"(?i)\buser[ _-]?(?:id)?[:#]?\s*\d+\b")]
)
STATIC = "You are a helpful assistant for ACME Corp. Answer briefly, cite the handbook, never guess. " * 6


@settings(max_examples=60, deadline=None)
@given(
    stamps=st.lists(
        st.tuples(
            st.datetimes().map(lambda d: d.strftime("%Y-%m-%d %H:%M:%S")),
            st.integers(0, 10**9),
            st.text(alphabet="abc xyz?", max_size=40),
        ),
        min_size=2,
        max_size=4,
    )
)
def test_dynamic_system_prompt_shares_leading_blocks_after_canonicalization(
    stamps: list[tuple[str, int, str]],
) -> None:
    hasher = PrefixHasher(block_chars=64)
    raw, canon = [], []
    for when, user, question in stamps:
        body = chat(f"Today is {when}, user {user}. {STATIC}", question)
        raw.append(hasher.block_hashes("m", None, prompt_text(body, "chat")))
        canonical = canonicalize(body, DYN_CFG, "chat").body
        canon.append(hasher.block_hashes("m", None, prompt_text(canonical, "chat")))
        assert canonical["messages"][0]["content"].startswith(STATIC.rstrip() + "\n\n[context: Today is ")
    static_blocks = len(f"<|system|>{STATIC.rstrip()}\n\n[context: ") // 64
    for other in canon[1:]:
        assert leading_shared(canon[0], other) >= static_blocks
    if len({(w, u) for w, u, _ in stamps}) == len(stamps):
        assert all(leading_shared(raw[0], other) == 0 for other in raw[1:])


def test_tool_order_shares_blocks_after_canonicalization() -> None:
    def tool(name: str) -> dict[str, object]:
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}

    cfg = CanonicalizeConfig(enabled=True)
    msgs = [{"role": "user", "content": "hi"}]
    a = canonicalize({"tools": [tool("b"), tool("a")], "messages": msgs}, cfg, "chat").body
    b = canonicalize({"tools": [tool("a"), tool("b")], "messages": msgs}, cfg, "chat").body
    assert prompt_text(a, "chat") == prompt_text(b, "chat")


# Pieces repeat across prompts (as system prompts and earlier turns do), in varied lengths, with
# spaces (which move token cuts) and non-ASCII text (which moves byte offsets).
pieces_pool = st.lists(st.text(alphabet="ab é\n", min_size=0, max_size=70), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(pool=pieces_pool, data=st.data())
def test_piece_cache_gives_the_uncached_features(pool: list[str], data: st.DataObject) -> None:
    # Tiny limits: short pieces are cached and the cache evicts all the time.
    warm = PrefixHasher(block_chars=8, piece_min_blocks=2, piece_cache_blocks=12)
    for _ in range(6):
        pieces = data.draw(st.lists(st.sampled_from(pool), max_size=5))
        salt = data.draw(st.sampled_from([None, "s"]))
        text = "".join(pieces)
        got = warm.features("m", salt, text, pieces)
        assert got == PrefixHasher(block_chars=8).features("m", salt, text)
        assert got.block_hashes == warm.block_hashes("m", salt, text)
    assert sum(len(hashes) for hashes, _ in warm._pieces.values()) <= 12


def test_the_partial_block_carried_into_a_piece_is_part_of_its_key() -> None:
    warm = PrefixHasher(block_chars=8, piece_min_blocks=2)
    question = "z y x w v u t s r q p o n m"
    # The same full first block, then carries that differ in one character or in where a space is.
    for head in ("abcdefgh13", "abcdefgh 3", "abcdefgh1 ", "abcdefgh12"):
        text = head + question
        assert warm.features("m", None, text, [head, question]) == PrefixHasher(block_chars=8).features(
            "m", None, text
        )


def test_a_piece_seen_again_is_kept_and_not_hashed_any_more() -> None:
    hasher = PrefixHasher(block_chars=16)
    hashed: list[int] = []
    hash_blocks = hasher._hash_blocks

    def spy(h: int, text: str, first: int, last: int) -> list[int]:
        hashed.append(last - first)
        return hash_blocks(h, text, first, last)

    hasher._hash_blocks = spy  # type: ignore[method-assign]
    system = "<|system|>" + "You are terse. " * 40 + "\n"
    assert len(system) // 16 == 38
    questions = [f"<|user|>Question {i}: " + "what is it, and why so? " * 8 + "\n" for i in range(3)]
    kept = []
    for question in questions:
        hashed.clear()
        hasher.features("m", None, system + question, [system, question])
        kept.append(hasher.cached_pieces())
    assert kept == [0, 1, 1]  # the system prompt from its second sighting, no question ever
    assert sum(hashed) == len(system + questions[2]) // 16 - 38  # only the blocks after the system prompt


def test_pieces_must_join_to_the_text() -> None:
    with pytest.raises(ValueError):
        PrefixHasher(block_chars=8).features("m", None, "a" * 40, ["a" * 39])


def test_prompt_pieces_join_to_prompt_text() -> None:
    body = {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    }
    assert prompt_pieces(body, "chat") == [
        '<|tools|>[{"type":"function","function":{"name":"f"}}]\n',
        "<|system|>s\n",
        "<|user|>u\n",
    ]
    assert "".join(prompt_pieces(body, "chat")) == prompt_text(body, "chat")
    assert prompt_pieces({"prompt": "abc"}, "completions") == ["abc"]


def test_a_detached_hasher_reads_the_caches_changes_none_and_hands_back_what_it_learned() -> None:
    hasher = PrefixHasher(block_chars=16, piece_min_blocks=2)
    system = "<|system|>" + "You are terse. " * 40 + "\n"
    questions = [f"<|user|>Question {i}: " + "what is it, and why so? " * 8 + "\n" for i in range(3)]
    for question in questions[:2]:  # the system prompt is kept from its second sighting
        hasher.features("m", None, system + question, [system, question])
    before = (hasher.cached_blocks(), hasher.cached_pieces())
    detached = hasher.detached()
    counted: list[str] = []
    count = detached._count
    detached._count = lambda text: counted.append(text) or count(text)  # type: ignore[method-assign,func-returns-value]
    text = system + questions[2]
    got = detached.features("m", None, text, [system, questions[2]])
    assert got == PrefixHasher(block_chars=16).features("m", None, text)
    assert (hasher.cached_blocks(), hasher.cached_pieces()) == before  # the shared caches are untouched
    assert sum(map(len, counted)) < len(questions[2]) + 40  # the system prompt came from the shared caches
    hasher.absorb(detached)
    assert hasher.cached_blocks() > before[0]
    again = hasher.detached()
    again._count = lambda text: counted.append(text) or count(text)  # type: ignore[method-assign,func-returns-value]
    counted.clear()
    assert again.features("m", None, text, [system, questions[2]]) == got
    assert sum(map(len, counted)) < 100  # all but the last block and the tail were absorbed
