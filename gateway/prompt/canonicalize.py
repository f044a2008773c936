"""Prompt canonicalization: make requests that mean the same thing share a byte-identical prefix.

Prefix caching only helps when prompts start with identical bytes. A system prompt such as
"Today is 2026-11-29 09:50, user 1234. You are ..." differs from request to request in its very
first block, so no engine can reuse anything. With a pool's `canonicalize.enabled`, this module
rewrites a chat request so that:

* Volatile sentences move to the end of the leading system content. The leading system content is
  the run of system/developer messages before the first other turn. Every configured rule and
  named built-in (`BUILTIN_PATTERNS`) is matched there; each SENTENCE a match touches (text is
  cut after every '. ', '! ', '? ' and newline; `VolatileRules` says how matching is windowed) is
  removed whole, and the removed sentences, stripped and joined by one space in their original
  order, are appended to the last text of the leading system content as a trailing note:
      "You are ...\\n\\n[context: Today is 2026-11-29 09:50, user 1234.]"
  Whole sentences, not just the matched fragments, move: the static text left behind has no holes
  ("Today is , user .") and is identical for every request that differs only in volatile values,
  whatever the values' lengths. The note carries the same words, so the model still sees them.
* Tool definitions are sorted by function name (stable; a schema's own key order is never touched).
* System content gets CRLF -> LF and trailing spaces, tabs and CRs removed from each line.

Guarantees, tested as properties: deterministic; idempotent (an existing trailing note is
recognised and kept, and the static part left behind matches no rule); only the leading
system/developer messages change, never their number, order or roles, and non-text parts stay as
they are; the multiset of whitespace-separated words of the leading system content is preserved
once the note's "[context: " and "]" wrapper is taken away (with whitespace normalization off,
only whitespace between moved sentences and the note may change).

Completions are left alone: a raw prompt has no reliable system/user boundary (the chat template may
already be applied), so nothing can be moved without risking the meaning of the prompt.

A "user 1234" id inside a sentence that has no date or time needs a rule, for example (see
config/canonicalize.example.yaml)
    rules: [{name: user_id, pattern: '(?i)\\buser(?:[ _-]?id)?\\s*[:#=]?\\s*\\d+\\b'}]
The `opt_out_header` is applied by the caller, which simply does not call `canonicalize`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from gateway.config import CanonicalizeConfig

if TYPE_CHECKING:
    from gateway.prompt.endpoints import Endpoint

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
_TRAILING_BLANKS = re.compile(r"[ \t\r]+(?=\n|\Z)")
_SYSTEM_ROLES = frozenset({"system", "developer"})
_SENTENCE_ENDS = (". ", "! ", "? ")
_MEMO_SIZE = 20_000


@dataclass(slots=True)
class CanonicalResult:
    body: dict[str, Any]  # the input object itself when nothing changed
    notes: list[str] = field(default_factory=list)  # what changed, without prompt content

    @property
    def changed(self) -> bool:
        return bool(self.notes)


def split_sentences(text: str) -> list[str]:
    """Cut after every '. ', '! ', '? ' and newline; the pieces concatenate back to `text`.

    Plain str.split, not a regex: it is the first step for every system prompt and Python's
    regex engine scans character classes several times slower than str methods do.
    """
    out: list[str] = []
    lines = text.split("\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        pieces = [line]
        for mark in _SENTENCE_ENDS:
            if mark in line:
                split: list[str] = []
                for piece in pieces:
                    sub = piece.split(mark)
                    split.extend(s + mark for s in sub[:-1])
                    split.append(sub[-1])
                pieces = split
        if i < last:
            pieces[-1] += "\n"
        out.extend(p for p in pieces if p)
    return out


class VolatileRules:
    r"""One config's compiled patterns and the sentence-lifting that uses them.

    Patterns are matched in windows of two consecutive sentences, not over the whole text: the
    windows of a repeated system prompt repeat, so their results are memoized and a request only
    pays regex scans for the sentences it has not been seen with. A match therefore spans at most
    two sentences (enough for "Nov. 29, 2026"), and `^`/`\A` anchor at a sentence start.
    """

    def __init__(self, patterns: tuple[tuple[str, re.Pattern[str]], ...]) -> None:
        self.patterns = patterns
        # window -> (hits first sentence, hits second sentence, rule names); () when nothing matches
        self._windows: dict[str, tuple[bool, bool, tuple[str, ...]] | tuple[()]] = {}
        self._settled: dict[
            tuple[Callable[[str], str], str], tuple[str, tuple[str, ...], frozenset[str]]
        ] = {}

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def _scan(self, window: str, first_len: int) -> tuple[bool, bool, tuple[str, ...]] | tuple[()]:
        first = second = False
        names: list[str] = []
        for name, pattern in self.patterns:
            for m in pattern.finditer(window):
                if m.end() == m.start():
                    continue
                if name not in names:
                    names.append(name)
                first = first or m.start() < first_len
                second = second or m.end() > first_len
                if first and (second or first_len == len(window)):
                    break
        return (first, second, tuple(names)) if names else ()

    def _window(self, sentences: list[str], i: int) -> tuple[bool, bool, tuple[str, ...]] | tuple[()]:
        window = sentences[i] + sentences[i + 1] if i + 1 < len(sentences) else sentences[i]
        found = self._windows.get(window)
        if found is None:
            found = self._scan(window, len(sentences[i]))
            if len(self._windows) >= _MEMO_SIZE:
                self._windows.clear()
            self._windows[window] = found
        return found

    def _lift(self, sentences: list[str], moved: list[str], fired: set[str]) -> list[str]:
        """Drop every sentence a match touches, appending it (stripped) to `moved`. After a removal
        only the windows that became adjacent are new, so only those are scanned again."""
        check: Iterable[int] = range(len(sentences))
        while True:
            hit = [False] * len(sentences)
            for i in check:
                found = self._window(sentences, i)
                if found:
                    first, second, names = found
                    if first:
                        hit[i] = True
                    if second:
                        hit[i + 1] = True
                    fired.update(names)
            if not any(hit):
                return sentences
            kept: list[str] = []
            junctions: list[int] = []
            for sentence, h in zip(sentences, hit, strict=True):
                if not h:
                    kept.append(sentence)
                elif stripped := sentence.strip():
                    moved.append(stripped)
                if h and kept and (not junctions or junctions[-1] != len(kept) - 1):
                    junctions.append(len(kept) - 1)
            sentences, check = kept, junctions

    def lift(self, text: str) -> tuple[str, list[str], set[str]]:
        """Remove every sentence a match touches, until none does: (the rest, removed sentences
        stripped, names of the rules that matched)."""
        moved: list[str] = []
        fired: set[str] = set()
        kept = self._lift(split_sentences(text), moved, fired)
        return ("".join(kept) if moved or fired else text), moved, fired

    def settle(self, text: str, post: Callable[[str], str]) -> tuple[str, tuple[str, ...], frozenset[str]]:
        """Lift, apply `post`, and repeat until nothing changes, so the static text left behind is a
        fixpoint: that is what makes canonicalization idempotent. Memoized: a static prompt costs
        one lookup."""
        key = (post, text)
        done = self._settled.get(key)
        if done is not None:
            return done
        current, moved, fired = self.lift(text)
        while (after := post(current)) != current:
            current, more, names = self.lift(after)
            moved.extend(more)
            fired |= names
        done = (current, tuple(moved), frozenset(fired))
        if len(self._settled) >= 1024:
            self._settled.clear()
        self._settled[key] = done
        return done


@lru_cache(maxsize=256)
def _compile(rules: tuple[tuple[str, str], ...], builtins: tuple[str, ...]) -> VolatileRules:
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
    return VolatileRules(tuple(compiled))


def compile_rules(cfg: CanonicalizeConfig) -> VolatileRules:
    """The config's rules, compiled once per distinct rule set; ValueError names a bad rule."""
    return _compile(tuple((r.name, r.pattern) for r in cfg.rules), tuple(cfg.builtin_rules))


def normalize_whitespace(text: str) -> str:
    """CRLF -> LF and no trailing blanks on any line, in one pass (so it is its own fixpoint)."""
    # Single-character probes first: they are memchr-fast, two-character ones are not.
    if "\r" in text or text.endswith((" ", "\t")) or ("\n" in text and (" \n" in text or "\t\n" in text)):
        return _TRAILING_BLANKS.sub("", text)
    return text


def _find_note(text: str) -> tuple[int, str] | None:
    """(start, inner text) of a trailing note: "[context: ...]" ending the text, on its own line
    after a blank line or as the whole text. str methods only: this runs on every request."""
    if not text.endswith("]"):
        return None
    if text.startswith(NOTE_PREFIX) and "\n" not in text:
        return 0, text[len(NOTE_PREFIX) : -1]
    start = text.rfind("\n\n" + NOTE_PREFIX)
    inner = start + 2 + len(NOTE_PREFIX)
    if start == -1 or "\n" in text[inner:]:
        return None
    return start, text[inner:-1]


def _identity(text: str) -> str:
    return text


def _normalize_rstrip(text: str) -> str:
    return normalize_whitespace(text).rstrip()


def _rstrip(text: str) -> str:
    return text.rstrip()


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
    rules = compile_rules(cfg) if cfg.move_volatile_to_end else None
    if rules:
        host = texts[-1]
        prior = _find_note(host)
        if prior is not None:
            texts[-1] = host[: prior[0]]
        fired: set[str] = set()
        moved: list[str] = []
        for k, text in enumerate(texts):
            texts[k], lifted, names = rules.settle(text, post)
            moved.extend(lifted)
            fired |= names
        if moved:
            finish = _normalize_rstrip if cfg.normalize_whitespace else _rstrip
            static, lifted, names = rules.settle(texts[-1].rstrip(), finish)
            moved.extend(lifted)
            fired |= names
            if prior is not None:
                moved.append(prior[1])
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


def canonicalize(body: dict[str, Any], cfg: CanonicalizeConfig, endpoint: Endpoint) -> CanonicalResult:
    """Canonical form of a request body; never mutates `body`."""
    if not cfg.enabled or endpoint != "chat" or not isinstance(body, dict):
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
            and isinstance(role := messages[lead].get("role"), str)  # a list would not hash
            and role in _SYSTEM_ROLES
        ):
            lead += 1
        if lead:
            new_lead = _canonical_system(messages[:lead], cfg, notes)
            if new_lead is not None:
                if out is body:
                    out = dict(body)
                out["messages"] = new_lead + messages[lead:]
    return CanonicalResult(out, notes)
