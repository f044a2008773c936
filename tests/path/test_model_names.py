"""The response model rename and the whole-event stream rewrite: byte-exact, split-proof, content-safe."""

from __future__ import annotations

import random

import orjson
import pytest

from gateway.path.model_names import ModelRename
from gateway.path.sse_events import EventStream


def _chunk(model: str, content: str) -> bytes:
    doc = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": model,
        "choices": [{"delta": {"content": content}}],
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


UPSTREAM = "llama-3.1-8b-fp8"
# Content that names the upstream model, as text and as JSON a model might generate: escaped on the wire.
TRICKY = f'say "model":"{UPSTREAM}" and {UPSTREAM}, or {{"model": "{UPSTREAM}"}}'
STREAM = (
    _chunk(UPSTREAM, "Hello")
    + _chunk(UPSTREAM, TRICKY)
    + b'data: {"error": {"message": "engine overloaded", "type": "ServiceUnavailableError", "param": null, '
    b'"code": 503}}\n\n' + _chunk(UPSTREAM, "") + b"data: [DONE]\n\n"
)


def _decoded(stream: bytes) -> list[object]:
    return [orjson.loads(e[6:]) for e in stream.split(b"\n\n") if e.startswith(b"data: {")]


def test_rename_replaces_the_member_in_every_serialization_and_nothing_else() -> None:
    rename = ModelRename([UPSTREAM], "llama")
    body = orjson.dumps({"model": UPSTREAM, "choices": [{"message": {"content": TRICKY}}]})
    out = orjson.loads(rename.apply(body))
    assert out["model"] == "llama"
    assert out["choices"][0]["message"]["content"] == TRICKY  # generated text is never touched
    spaced = f'{{"model": "{UPSTREAM}", "x": 1}}'.encode()
    assert orjson.loads(rename.apply(spaced))["model"] == "llama"
    longer = orjson.dumps({"model": UPSTREAM + "-v2"})
    assert rename.apply(longer) == longer  # the closing quote is part of the match


def test_rename_non_ascii_names_in_both_encodings() -> None:
    rename = ModelRename(["modèle-interne"], "public")
    raw = '{"model":"modèle-interne"}'.encode()
    escaped = b'{"model": "mod\\u00e8le-interne"}'
    assert orjson.loads(rename.apply(raw))["model"] == "public"
    assert orjson.loads(rename.apply(escaped))["model"] == "public"


def test_rename_of_the_clients_own_name_is_nothing() -> None:
    assert not ModelRename(["llama"], "llama")


def test_stream_split_anywhere_gives_the_same_bytes_as_whole() -> None:
    """Every single split point and many random multi-splits: output identical, events intact."""
    whole = EventStream(ModelRename([UPSTREAM], "llama"))
    expected = whole.feed(STREAM) + whole.flush()
    docs = _decoded(expected)
    assert [d["model"] for d in docs if "model" in d] == ["llama"] * 3  # type: ignore[index,operator]
    assert docs[1]["choices"][0]["delta"]["content"] == TRICKY  # type: ignore[index]
    assert docs[2] == {
        "error": {
            "message": "engine overloaded",
            "type": "upstream_error",
            "param": None,
            "code": "service_unavailable",
        }
    }
    splits = [[i] for i in range(1, len(STREAM))]
    rng = random.Random(7)
    splits += [sorted(rng.sample(range(1, len(STREAM)), k)) for k in (2, 5, 20, 80) for _ in range(50)]
    for cuts in splits:
        events = EventStream(ModelRename([UPSTREAM], "llama"))
        pieces = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
        out = [events.feed(p) for p in pieces]
        # What is relayed before the end is always whole events: a client never waits on a held one.
        assert all(o == b"" or o.endswith(b"\n\n") for o in out), cuts
        assert b"".join(out) + events.flush() == expected, cuts


def test_stream_without_rename_still_normalizes_error_events_only() -> None:
    events = EventStream(None)
    out = events.feed(STREAM) + events.flush()
    docs = _decoded(out)
    assert [d.get("model") for d in docs] == [UPSTREAM, UPSTREAM, None, UPSTREAM]  # type: ignore[union-attr]
    assert docs[2]["error"]["type"] == "upstream_error"  # type: ignore[index]


def test_an_unterminated_tail_comes_out_at_flush_and_a_huge_event_is_not_held() -> None:
    events = EventStream(ModelRename([UPSTREAM], "llama"), max_event_bytes=64)
    assert events.feed(b'data: {"model":"' + UPSTREAM.encode() + b'"') == b""
    assert events.flush() == b'data: {"model":"llama"'
    big = b"data: " + b"x" * 100
    assert events.feed(big) == big  # beyond max_event_bytes: relayed as it stands


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"error": "not an object"}\n\n',
        b'data: {"error": {"message": "x"\n\n',  # cut JSON: left alone
        b'data: {"id": "1", "error": {"message": "x"}}\n\n',  # not an error event
    ],
)
def test_events_that_are_not_error_events_pass_unchanged(event: bytes) -> None:
    events = EventStream(None)
    assert events.feed(event) + events.flush() == event
