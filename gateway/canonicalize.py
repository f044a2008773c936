"""Prompt canonicalization: make requests that mean the same thing share a byte-identical prefix.

Prefix caching only helps when prompts start with identical bytes. A system prompt such as
"Today is 2026-11-29 09:50, user 1234. You are ..." differs from request to request in its very
first block, so no engine can reuse anything. With a pool's `canonicalize.enabled`, this module
rewrites a chat request so that:

* Volatile sentences move to the end of the leading system content. The leading system content is
  the run of system/developer messages before the first other turn. Every configured rule and
  named built-in (`BUILTIN_PATTERNS`) is matched there; each SENTENCE containing a match (split
  after `.`, `!` or `?` followed by spaces or tabs, and after every newline) is removed whole and
  the removed sentences, stripped and joined by one space in their original order, are appended to
  the last text of the leading system content as a trailing note:
      "You are ...\\n\\n[context: Today is 2026-11-29 09:50, user 1234.]"
  Whole sentences, not just the matched fragments, move: the static text left behind has no holes
  ("Today is , user .") and is identical for every request that differs only in volatile values,
  whatever the values' lengths. The note carries the same words, so the model still sees them.
* Tool definitions are sorted by function name (stable; a schema's own key order is never touched).
* System content gets CRLF -> LF and trailing spaces/tabs removed from each line.

Guarantees, tested as properties: deterministic; idempotent (an existing trailing note is
recognised and kept, and the static part left behind matches no rule); only the leading
system/developer messages change, never their number, order or roles, and non-text parts stay as
they are; the multiset of whitespace-separated words of the leading system content is preserved
once the note's "[context: " and "]" wrapper is taken away (with whitespace normalization off,
only whitespace between moved sentences and the note may change).

Completions are left alone: a raw prompt has no reliable system/user boundary (the chat template may
already be applied), so nothing can be moved without risking the meaning of the prompt.

A "user 1234" id inside a sentence that has no date or time needs a rule, for example
    rules: [{name: user_id, pattern: '(?i)\\buser(?:[ _-]?id)?[:#]?\\s*\\d+\\b'}]
The `opt_out_header` is applied by the caller, which simply does not call `canonicalize`.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from gateway.config import CanonicalizeConfig

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_WEEKDAY = r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday|Mon|Tue|Wed|Thu|Fri|Sat|Sun)"

BUILTIN_PATTERNS: dict[str, str] = {
    "iso_datetime": r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?",
    "date": (
        r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b|\b\d{1,2}\.\d{1,2}\.\d{4}\b"
        rf"|\b(?:{_WEEKDAY},?\s+)?{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b"
        rf"|\b(?:{_WEEKDAY},?\s+)?\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?{_MONTH}\.?,?\s+\d{{4}}\b"
    ),
    "time": r"\b\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?\b(?:\s?[AaPp]\.?[Mm]\b\.?)?",
    "uuid": r"\b[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}\b",
    "unix_ts": r"\b1[5-9]\d{8}(?:\d{3})?\b",
    "hex_id": r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{16,}\b",
}

NOTE_PREFIX = "[context: "
_NOTE = re.compile(r"(?:\A|\n\n)\[context: ([^\n]*)\]\Z")
# A sentence ends after terminal punctuation followed by blanks, or at a newline (kept with it).
_BOUNDARY = re.compile(r"[.!?]+[ \t]+|\n")
_TRAILING_BLANKS = re.compile(r"[ \t]+(?=\n|\Z)")
_SYSTEM_ROLES = frozenset({"system", "developer"})

Patterns = tuple[tuple[str, re.Pattern[str]], ...]


@dataclass(slots=True)
class CanonicalResult:
    body: dict[str, Any]  # the input object itself when nothing changed
    notes: list[str] = field(default_factory=list)  # what changed, without prompt content

    @property
    def changed(self) -> bool:
        return bool(self.notes)


@lru_cache(maxsize=256)
def _compile(rules: tuple[tuple[str, str], ...], builtins: tuple[str, ...]) -> Patterns:
    compiled: list[tuple[str, re.Pattern[str]]] = []
    for name in builtins:
        if name not in BUILTIN_PATTERNS:
            raise ValueError(
                f"unknown built-in canonicalize rule {name!r}; known: {sorted(BUILTIN_PATTERNS)}"
            )
        compiled.append((name, re.compile(BUILTIN_PATTERNS[name])))
    for name, pattern in rules:
        try:
            compiled.append((name, re.compile(pattern)))
        except re.error as exc:
            raise ValueError(f"canonicalize rule {name!r}: invalid regex: {exc}") from None
    return tuple(compiled)


def compile_patterns(cfg: CanonicalizeConfig) -> Patterns:
    """The config's patterns, compiled once per distinct rule set; ValueError names a bad rule."""
    return _compile(tuple((r.name, r.pattern) for r in cfg.rules), tuple(cfg.builtin_rules))


def normalize_whitespace(text: str) -> str:
    if "\r\n" in text:
        text = text.replace("\r\n", "\n")
    return _TRAILING_BLANKS.sub("", text)


def _lift(text: str, patterns: Patterns, fired: set[str]) -> tuple[str, list[str]]:
    """Remove every sentence overlapping a match; return the rest and the removed sentences."""
    spans: list[tuple[int, int]] = []
    for name, pattern in patterns:
        for m in pattern.finditer(text):
            if m.end() > m.start():
                spans.append((m.start(), m.end()))
                fired.add(name)
    if not spans:
        return text, []
    starts = [0]
    starts.extend(m.end() for m in _BOUNDARY.finditer(text) if m.end() < len(text))
    hit = [False] * len(starts)
    for a, b in spans:
        for i in range(bisect_right(starts, a) - 1, bisect_right(starts, b - 1)):
            hit[i] = True
    ends = [*starts[1:], len(text)]
    kept: list[str] = []
    moved: list[str] = []
    for s, e, h in zip(starts, ends, hit, strict=True):
        if not h:
            kept.append(text[s:e])
        elif sentence := text[s:e].strip():
            moved.append(sentence)
    return "".join(kept), moved


def _settle(
    text: str, patterns: Patterns, fired: set[str], post: Callable[[str], str]
) -> tuple[str, list[str]]:
    """Lift until nothing matches, so the static text left behind is a fixpoint (idempotence)."""
    moved: list[str] = []
    while True:
        kept, lifted = _lift(text, patterns, fired)
        kept = post(kept)
        if not lifted and kept == text:
            return text, moved
        moved.extend(lifted)
        text = kept


def _identity(text: str) -> str:
    return text


def _tool_key(tool: Any) -> tuple[str, str]:
    if not isinstance(tool, dict):
        return ("", "")
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
    return (name if isinstance(name, str) else "", str(tool.get("type", "")))


def _text_slots(lead: list[dict[str, Any]]) -> list[tuple[int, int | None, str]]:
    """(message index, part index or None for string content, text) of each text in order."""
    slots: list[tuple[int, int | None, str]] = []
    for mi, message in enumerate(lead):
        content = message.get("content")
        if isinstance(content, str):
            slots.append((mi, None, content))
        elif isinstance(content, list):
            for pi, part in enumerate(content):
                if (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    slots.append((mi, pi, part["text"]))
    return slots


def _canonical_system(
    lead: list[dict[str, Any]], cfg: CanonicalizeConfig, notes: list[str]
) -> list[dict[str, Any]] | None:
    slots = _text_slots(lead)
    if not slots:
        return None
    texts = [t for _, _, t in slots]
    post = normalize_whitespace if cfg.normalize_whitespace else _identity
    if cfg.normalize_whitespace:
        texts = [normalize_whitespace(t) for t in texts]
        if texts != [t for _, _, t in slots]:
            notes.append("normalized whitespace in the leading system content")
    patterns = compile_patterns(cfg) if cfg.move_volatile_to_end else ()
    if patterns:
        host = texts[-1]
        prior = _NOTE.search(host)
        if prior is not None:
            texts[-1] = host[: prior.start()]
        fired: set[str] = set()
        moved: list[str] = []
        for k, text in enumerate(texts):
            texts[k], lifted = _settle(text, patterns, fired, post)
            moved.extend(lifted)
        if moved:
            static, lifted = _settle(texts[-1].rstrip(), patterns, fired, lambda s: post(s).rstrip())
            moved.extend(lifted)
            if prior is not None:
                moved.append(prior.group(1))
            note = NOTE_PREFIX + " ".join(moved) + "]"
            texts[-1] = f"{static}\n\n{note}" if static else note
            notes.append(
                f"moved {len(moved) - (prior is not None)} volatile sentence(s) to the end of the "
                f"leading system content (rules: {', '.join(sorted(fired))})"
            )
        else:
            texts[-1] = host
    if all(new == old for new, (_, _, old) in zip(texts, slots, strict=True)):
        return None
    out = list(lead)
    copied: set[int] = set()
    for new, (mi, pi, old) in zip(texts, slots, strict=True):
        if new == old:
            continue
        if mi not in copied:
            out[mi] = dict(out[mi])
            if pi is not None:
                out[mi]["content"] = list(out[mi]["content"])
            copied.add(mi)
        if pi is None:
            out[mi]["content"] = new
        else:
            out[mi]["content"][pi] = {**out[mi]["content"][pi], "text": new}
    return out


def canonicalize(
    body: dict[str, Any], cfg: CanonicalizeConfig, endpoint: Literal["chat", "completions"]
) -> CanonicalResult:
    """Canonical form of a request body; never mutates `body`."""
    if not cfg.enabled or endpoint != "chat":
        return CanonicalResult(body)
    notes: list[str] = []
    out = body
    tools = body.get("tools")
    if cfg.sort_tools and isinstance(tools, list) and len(tools) > 1:
        ordered = sorted(tools, key=_tool_key)
        if any(a is not b for a, b in zip(ordered, tools, strict=True)):
            out = {**body, "tools": ordered}
            notes.append(f"sorted {len(tools)} tool definitions by name")
    messages = body.get("messages")
    if isinstance(messages, list):
        lead = 0
        while (
            lead < len(messages)
            and isinstance(messages[lead], dict)
            and messages[lead].get("role") in _SYSTEM_ROLES
        ):
            lead += 1
        if lead:
            new_lead = _canonical_system(messages[:lead], cfg, notes)
            if new_lead is not None:
                if out is body:
                    out = dict(body)
                out["messages"] = new_lead + messages[lead:]
    return CanonicalResult(out, notes)
