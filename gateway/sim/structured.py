"""Structured outputs: JSON that a grammar-constrained engine would produce for `response_format` and for
forced tool calls, generated from the JSON schema instead of sampled under it.

`from_schema` understands the keywords clients use: type (one or a list), properties, required, items,
prefixItems, enum, const, anyOf/oneOf (the first branch), allOf (merged), $ref into #/$defs or
#/definitions, minLength/maxLength, minimum/maximum (and exclusive ones), minItems/maxItems, format
(date-time, date, time, email, uuid, uri) and default. Everything else falls back: `pattern` and
`not` are ignored, an empty or unknown schema gives a string, recursion deeper than 6 levels keeps only
what is required. Objects carry every listed property; arrays two items unless bounds say otherwise.

The text is deterministic in the request's output seed; its token ids come from the shared tokenizer, so
`max_tokens` truncates it exactly where vLLM would stop (finish_reason "length", invalid JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.prompt.tokens import get_tokenizer
from gateway.sim.protocol import VOCAB

MAX_DEPTH = 6
_FORMATS = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "12:00:00",
    "email": "user@example.com",
    "uuid": "123e4567-e89b-12d3-a456-426614174000",
    "uri": "https://example.com/",
}


class _Gen:
    def __init__(self, root: dict[str, Any], seed: int) -> None:
        self.root = root
        self.seed = seed

    def word(self, k: int) -> str:
        return VOCAB[(self.seed + 7 * k) % len(VOCAB)].strip()

    def resolve(self, schema: Any) -> dict[str, Any]:
        seen = 0
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 16:
            node: Any = self.root
            for part in schema["$ref"].removeprefix("#/").split("/"):
                node = node.get(part) if isinstance(node, dict) and part else node
            schema, seen = node if isinstance(node, dict) else {}, seen + 1
        if not isinstance(schema, dict):
            return {}
        if isinstance(schema.get("allOf"), list):
            merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = self.resolve(part)
                props = {**merged.get("properties", {}), **part.get("properties", {})}
                req = [*merged.get("required", []), *part.get("required", [])]
                merged.update(part)
                merged.update(properties=props, required=req)
            return merged
        return schema

    def value(self, schema: Any, depth: int, k: int) -> Any:
        s = self.resolve(schema)
        if "const" in s:
            return s["const"]
        if isinstance(s.get("enum"), list) and s["enum"]:
            return s["enum"][(self.seed + k) % len(s["enum"])]
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key]:
                return self.value(s[key][0], depth, k)
        kind = s.get("type")
        if isinstance(kind, list):
            kind = next((t for t in kind if t != "null"), "null")
        if kind is None:
            kind = "object" if "properties" in s else "array" if "items" in s or "prefixItems" in s else None
        if kind == "object":
            return self.obj(s, depth, k)
        if kind == "array":
            return self.array(s, depth, k)
        if kind == "integer":
            return int(self.number(s, k, integer=True))
        if kind == "number":
            return self.number(s, k, integer=False)
        if kind == "boolean":
            return (self.seed + k) % 2 == 0
        if kind == "null":
            return None
        if "default" in s:
            return s["default"]
        return self.string(s, k)

    def obj(self, s: dict[str, Any], depth: int, k: int) -> dict[str, Any]:
        props = p if isinstance(p := s.get("properties"), dict) else {}
        required = [r for r in s.get("required", []) if isinstance(r, str)]
        names = list(props) if depth < MAX_DEPTH else [r for r in required if r in props]
        out = {name: self.value(props[name], depth + 1, k + i) for i, name in enumerate(names)}
        for i, name in enumerate(r for r in required if r not in out):
            out[name] = self.string({}, k + i)  # required but not described: any value will do
        return out

    def array(self, s: dict[str, Any], depth: int, k: int) -> list[Any]:
        prefix = p if isinstance(p := s.get("prefixItems"), list) else []
        lo = s.get("minItems", 0) if isinstance(s.get("minItems"), int) else 0
        hi = s.get("maxItems") if isinstance(s.get("maxItems"), int) else None
        n = max(lo, len(prefix), 2 if depth < MAX_DEPTH else 0)
        if hi is not None:
            n = max(min(n, hi), 0)
        items = s.get("items") if isinstance(s.get("items"), dict) else {}
        return [self.value(prefix[i] if i < len(prefix) else items, depth + 1, k + i) for i in range(n)]

    def number(self, s: dict[str, Any], k: int, integer: bool) -> float:
        lo = s.get("minimum", s.get("exclusiveMinimum"))
        hi = s.get("maximum", s.get("exclusiveMaximum"))
        lo = float(lo) if isinstance(lo, (int, float)) else None
        hi = float(hi) if isinstance(hi, (int, float)) else None
        step = 1.0 if integer else 0.25
        if lo is not None and "exclusiveMinimum" in s and "minimum" not in s:
            lo += step
        if hi is not None and "exclusiveMaximum" in s and "maximum" not in s:
            hi -= step
        base = lo if lo is not None else (hi - 10 if hi is not None else 0.0)
        span = (hi - base) if hi is not None else 100.0
        v = base + ((self.seed * 31 + k * 17) % 97) / 97 * max(span, 0.0)
        v = float(int(v)) if integer else round(v * 4) / 4
        if lo is not None and v < lo:
            v = lo if not integer else float(int(lo) + (lo != int(lo)))
        if hi is not None and v > hi:
            v = hi if not integer else float(int(hi))
        return v

    def string(self, s: dict[str, Any], k: int) -> str:
        if isinstance(s.get("format"), str) and s["format"] in _FORMATS:
            text = _FORMATS[s["format"]]
        else:
            text = " ".join(self.word(k + i) for i in range(3))
        lo = s.get("minLength", 0) if isinstance(s.get("minLength"), int) else 0
        hi = s.get("maxLength") if isinstance(s.get("maxLength"), int) else None
        while len(text) < lo:
            text += " " + self.word(k + len(text))
        if hi is not None:
            text = text[: max(hi, 0)]
        return text


def from_schema(schema: Any, seed: int) -> Any:
    """A value that validates against `schema` (within the keywords above)."""
    root = schema if isinstance(schema, dict) else {}
    return _Gen(root, seed).value(root, 0, 0)


def json_object(seed: int) -> dict[str, Any]:
    """What a model asked for `json_object` without a schema writes: some JSON object."""
    g = _Gen({}, seed)
    return {"answer": " ".join(g.word(i) for i in range(4)), "confidence": round((seed % 10) / 10 + 0.05, 2)}


@dataclass(slots=True)
class Script:
    """A fixed output: its token ids and each token's text (what a stream sends per token)."""

    ids: list[int]
    pieces: list[str]

    def text(self, start: int, end: int) -> str:
        return "".join(self.pieces[start:end])

    def __len__(self) -> int:
        return len(self.ids)


def script(value: Any) -> Script:
    # ASCII-only JSON (non-ASCII escaped), so that every token decodes to whole characters on its own.
    text = json.dumps(value)
    tok = get_tokenizer()
    ids = tok.encode(text)
    return Script(ids, [tok.decode([i]) for i in ids])
