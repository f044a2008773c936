"""Canonicalization properties: deterministic, idempotent, only leading system text moves, words kept."""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import CanonicalizeConfig, CanonicalizeRule, load_config
from gateway.prompt.canonicalize import (
    BUILTIN_PATTERNS,
    canonicalize,
    compile_rules,
    normalize_whitespace,
    split_sentences,
)
from tests.conftest import REPO

USER_RULE = CanonicalizeRule(name="user_id", pattern=r"(?i)\buser[ _-]?(?:id)?[:#]?\s*\d+\b")
CFG = CanonicalizeConfig(enabled=True, rules=[USER_RULE], builtin_rules=sorted(BUILTIN_PATTERNS))
NO_WS = CFG.model_copy(update={"normalize_whitespace": False})

FRAGMENTS = [
    "Today is 2026-11-29 09:50:12",
    "2026-11-29T09:50:12Z",
    "at 10:15 am",
    "Sunday, November 29, 2026",
    "user 1234",
    "User id: 77",
    "id 1f0e2c4d-aaaa-bbbb-cccc-0123456789ab",
    "You are a helpful assistant",
    "Be brief",
    "[context: ",
    "\n\n[context: x 12:30]",
    "]",
    ". ",
    "! ",
    "? ",
    ", ",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\n\n",
    "ok",
    "42",
]
text = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    st.text(alphabet="ab1:-. \n\r\t[]", max_size=60),
)
text_part = text.map(lambda t: {"type": "text", "text": t})
image_part = st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
content = st.one_of(text, st.lists(st.one_of(text_part, image_part), max_size=3), st.none())
system_msg = st.builds(
    lambda r, c: {"role": r, "content": c}, st.sampled_from(["system", "developer"]), content
)
other_msg = st.builds(
    lambda r, c: {"role": r, "content": c}, st.sampled_from(["user", "assistant", "tool", "system"]), content
)
schema = st.dictionaries(st.sampled_from(["z", "a", "m", "b"]), st.just({"type": "string"}), max_size=4)
tool = st.builds(
    lambda n, p: {
        "type": "function",
        "function": {"name": n, "parameters": {"type": "object", "properties": p}},
    },
    st.sampled_from(["search", "add", "zap", "fetch"]),
    schema,
)
bodies = st.builds(
    lambda lead, rest, tools: {"model": "m", "messages": lead + rest, **({"tools": tools} if tools else {})},
    st.lists(system_msg, max_size=3),
    st.lists(other_msg, max_size=3),
    st.lists(tool, max_size=4),
)
NOTE = re.compile(r"(?:\A|\n\n)\[context: ([^\n]*)\]\Z")


def leading(messages: list[dict[str, Any]]) -> int:
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    return n


def texts(messages: list[dict[str, Any]]) -> list[str]:
    out = []
    for m in messages:
        c = m["content"]
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.extend(p["text"] for p in c if p.get("type") == "text")
    return out


def words(slot_texts: list[str], normalize: bool) -> Counter[str]:
    """Words of the leading system content with a trailing note's wrapper taken off."""
    slot_texts = [normalize_whitespace(t) if normalize else t for t in slot_texts]
    if slot_texts:
        slot_texts[-1] = NOTE.sub(lambda m: "\n\n" + m.group(1), slot_texts[-1])
    return Counter(" ".join(slot_texts).split())


@pytest.mark.parametrize("cfg", [CFG, NO_WS], ids=["normalize", "raw"])
@settings(max_examples=300, deadline=None)
@given(body=bodies)
def test_properties(cfg: CanonicalizeConfig, body: dict[str, Any]) -> None:
    original = copy.deepcopy(body)
    result = canonicalize(body, cfg, "chat")
    out = result.body
    assert body == original  # the input is never mutated
    assert canonicalize(copy.deepcopy(body), cfg, "chat").body == out  # deterministic
    again = canonicalize(out, cfg, "chat")
    assert again.body is out and not again.changed  # idempotent
    assert result.changed == (out is not body)

    msgs_in, msgs_out = body["messages"], out["messages"]
    assert [m["role"] for m in msgs_out] == [m["role"] for m in msgs_in]
    lead = leading(msgs_in)
    for m_in, m_out in zip(msgs_in[lead:], msgs_out[lead:], strict=True):
        assert m_out is m_in  # turns after the leading system content are untouched
    for m_in, m_out in zip(msgs_in[:lead], msgs_out[:lead], strict=True):
        assert m_out.keys() == m_in.keys()
        if isinstance(m_in["content"], list):
            assert [p for p in m_out["content"] if p["type"] != "text"] == [
                p for p in m_in["content"] if p["type"] != "text"
            ]
            assert [p["type"] for p in m_out["content"]] == [p["type"] for p in m_in["content"]]
        else:
            assert type(m_out["content"]) is type(m_in["content"])
    assert words(texts(msgs_out[:lead]), cfg.normalize_whitespace) == words(
        texts(msgs_in[:lead]), cfg.normalize_whitespace
    )

    # The static text left behind matches no rule.
    static = texts(msgs_out[:lead])
    if static and NOTE.search(static[-1]) and result.changed:
        static[-1] = static[-1][: NOTE.search(static[-1]).start()]
        rules = compile_rules(cfg)
        assert not any(rules.lift(t)[1] for t in static)

    # Tools: same definitions, sorted by name, schemas serialized byte for byte as sent.
    tools_in, tools_out = body.get("tools", []), out.get("tools", [])
    dumps_in = sorted(json.dumps(t) for t in tools_in)
    assert sorted(json.dumps(t) for t in tools_out) == dumps_in
    names = [t["function"]["name"] for t in tools_out]
    assert names == sorted(names)


def test_moves_whole_volatile_sentences_to_a_trailing_note() -> None:
    body = {
        "messages": [
            {
                "role": "system",
                "content": "Today is 2026-11-29 09:50, user 1234. You are helpful.\r\nBe brief.  ",
            },
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Request a1b2c3d4-0000-1111-2222-333344445555."}],
            },
            {"role": "user", "content": "Today is 2026-11-29, hi"},
        ]
    }
    result = canonicalize(body, CFG, "chat")
    msgs = result.body["messages"]
    assert msgs[0]["content"] == "You are helpful.\nBe brief."
    assert msgs[1]["content"] == [
        {
            "type": "text",
            "text": "[context: Today is 2026-11-29 09:50, user 1234. "
            "Request a1b2c3d4-0000-1111-2222-333344445555.]",
        }
    ]
    assert msgs[2] is body["messages"][2]
    assert any("moved 2 volatile sentence(s)" in n for n in result.notes)
    assert all("1234" not in n for n in result.notes)  # notes never carry prompt content


def test_static_text_identical_whatever_the_values() -> None:
    outs = {
        canonicalize(
            {"messages": [{"role": "system", "content": f"Today is {d}, user {u}. You are X."}]}, CFG, "chat"
        )
        .body["messages"][0]["content"]
        .split("[context: ")[0]
        for d, u in [("2026-11-29 09:50", 1), ("Monday, March 3, 2025 at 11:02 PM", 987654), ("12/1/25", 5)]
    }
    assert outs == {"You are X.\n\n"}


@settings(max_examples=200, deadline=None)
@given(text=text)
def test_sentences_concatenate_back(text: str) -> None:
    sentences = split_sentences(text)
    assert "".join(sentences) == text
    assert all(s for s in sentences)
    assert all("\n" not in s[:-1] for s in sentences)


@settings(max_examples=200, deadline=None)
@given(text=text)
def test_window_matching_agrees_with_whole_text_search_on_single_sentence_matches(text: str) -> None:
    rules = compile_rules(CFG)
    _, moved, _ = rules.lift(text)
    for sentence in split_sentences(text):
        if any(p.search(sentence) for _, p in rules.patterns):
            assert sentence.strip() in moved


@given(text=st.text(alphabet="a \t\r\n", max_size=30))
def test_whitespace_normalization_is_a_fixpoint(text: str) -> None:
    once = normalize_whitespace(text)
    assert normalize_whitespace(once) == once
    assert "\r\n" not in once and not re.search(r"[ \t]\n|[ \t]\Z", once)
    assert once.split() == text.split()


def test_a_date_across_a_sentence_cut_moves_both_parts() -> None:
    body = {"messages": [{"role": "system", "content": "Hello. Today is Nov. 29, 2026. You are X."}]}
    out = canonicalize(body, CFG, "chat").body["messages"][0]["content"]
    assert out == "Hello. You are X.\n\n[context: Today is Nov. 29, 2026.]"


def test_user_id_alone_needs_the_rule() -> None:
    body = {"messages": [{"role": "system", "content": "User 1234. You are X."}]}
    assert not canonicalize(body, CanonicalizeConfig(enabled=True), "chat").changed
    assert (
        canonicalize(body, CFG, "chat").body["messages"][0]["content"]
        == "You are X.\n\n[context: User 1234.]"
    )


def test_disabled_and_completions_are_untouched() -> None:
    body = {"messages": [{"role": "system", "content": "Today is 2026-11-29. Hi  "}], "prompt": "2026-11-29"}
    assert canonicalize(body, CanonicalizeConfig(), "chat").body is body
    assert canonicalize(body, CFG, "completions").body is body


def test_only_tool_sorting_and_whitespace_when_moving_is_off() -> None:
    cfg = CFG.model_copy(update={"move_volatile_to_end": False})
    body = {"messages": [{"role": "system", "content": "Today is 2026-11-29.  \r\nHi"}]}
    assert canonicalize(body, cfg, "chat").body["messages"][0]["content"] == "Today is 2026-11-29.\nHi"


def test_bad_rules_are_reported_by_name() -> None:
    with pytest.raises(ValueError, match="'broken'"):
        compile_rules(CanonicalizeConfig(rules=[CanonicalizeRule(name="broken", pattern="(")]))
    with pytest.raises(ValueError, match="'nope'"):
        compile_rules(CanonicalizeConfig(builtin_rules=["nope"]))


def test_patterns_are_compiled_once_per_rule_set() -> None:
    assert compile_rules(CFG) is compile_rules(CFG.model_copy())


@pytest.mark.parametrize(
    ("name", "sample"),
    [
        ("iso_datetime", "2026-11-29T09:50:12.123+01:00"),
        ("date", "29 November 2026"),
        ("date", "Nov 29th, 2026"),
        ("date", "29.11.2026"),
        ("time", "9:05 p.m."),
        ("uuid", "1F0E2C4D-AAAA-BBBB-CCCC-0123456789AB"),
        ("unix_ts", "1795939812"),
        ("hex_id", "deadbeef00112233"),
    ],
)
def test_builtins_match_their_samples(name: str, sample: str) -> None:
    assert re.search(BUILTIN_PATTERNS[name], f"at {sample} now")


@pytest.mark.parametrize("static", ["version 1.2.10", "a ratio of 3 to 4", "room 1234", "the year 2026"])
def test_builtins_leave_ordinary_numbers_alone(static: str) -> None:
    body = {"messages": [{"role": "system", "content": f"You are X. Mind {static}."}]}
    assert not canonicalize(body, CanonicalizeConfig(enabled=True), "chat").changed


def test_the_example_config_catches_a_bare_user_id() -> None:
    settings = load_config(REPO / "config" / "canonicalize.example.yaml")
    cfg = settings.pool("support").canonicalize
    for sentence in ("User 1234.", "user_id=77.", "User id: 5."):
        body = {"messages": [{"role": "system", "content": f"{sentence} You are X."}]}
        assert (
            canonicalize(body, cfg, "chat").body["messages"][0]["content"]
            == f"You are X.\n\n[context: {sentence}]"
        )
