"""The benchmark workloads of workloads.md as seeded generators, plus Mooncake trace replay.

A workload is a dataclass of its knobs (defaults from workloads.md) whose `build(seed)` returns
the requests in send order. The same seed gives the same requests, byte for byte. Lengths are in
tokens of the shared tokenizer (see bench.text); chat templates add a few tokens on top.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import random
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from bench import text
from gateway.prompt.tokens import get_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MOONCAKE_DIR = REPO_ROOT.parent / "shared" / "data" / "mooncake"
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(slots=True)
class BenchRequest:
    index: int
    messages: list[dict[str, str]]
    max_tokens: int
    prompt_tokens: int  # tokens of the message contents, template excluded
    group: str | None = None  # sent as x-kvgate-group (the oracle policy pins groups)
    priority: str | None = None  # sent as x-priority
    kind: str = "default"  # breakdown label in reports (short/long, interactive/batch)
    at: float | None = None  # intrinsic arrival offset in seconds (trace replay)
    depends_on: int | None = None  # index of a request that must finish first (next chat turn)
    model: str | None = None  # the model to ask for, when not the run's (a LoRA adapter)

    def prompt_text(self) -> str:
        """The messages joined, for the completions API."""
        return "".join(m["content"] for m in self.messages)


class Workload:
    name: ClassVar[str]
    summary: ClassVar[str]

    def build(self, seed: int) -> list[BenchRequest]:
        raise NotImplementedError


WORKLOADS: dict[str, type[Workload]] = {}


def _register(cls: type[Workload]) -> type[Workload]:
    WORKLOADS[cls.name] = cls
    return cls


def make_workload(name: str, params: dict[str, Any] | None = None) -> Workload:
    """Instantiate a workload by name; string values (from the CLI) are converted to field types."""
    try:
        cls = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in (params or {}).items():
        key = key.replace("-", "_")
        if key not in fields:
            raise ValueError(f"workload {name!r} has no parameter {key!r}; it has: {', '.join(fields)}")
        kwargs[key] = _coerce(fields[key].default, value) if isinstance(value, str) else value
    return cls(**kwargs)


def _coerce(default: Any, value: str) -> Any:
    if value.lower() in ("none", "null"):
        return None
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float) or default is None:
        try:
            return float(value) if "." in value or "e" in value.lower() else int(value)
        except ValueError:
            return value
    return value


def _chat(system: str | None, user: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system is not None else []
    return [*msgs, {"role": "user", "content": user}]


@_register
@dataclass
class SharedPrefix(Workload):
    name: ClassVar[str] = "shared-prefix"
    summary: ClassVar[str] = "G groups x P prompts, one system prompt per group (SGLang gsp)"
    groups: int = 64
    prompts_per_group: int = 32
    system_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 128
    # "single-token": words cl100k keeps as one token each; "numbered": ` tN` words, one token each
    # for the GPU kit's tokenizer (sim `--tokenizer builtin:words`) and about three for cl100k.
    vocabulary: str = "single-token"

    def __post_init__(self) -> None:
        if self.vocabulary not in ("single-token", "numbered"):
            raise ValueError(f"vocabulary {self.vocabulary!r}: expected single-token or numbered")

    def words(self, key: str, n: int) -> str:
        return text.numbered_words(key, n) if self.vocabulary == "numbered" else text.words(key, n)

    def system_prompt(self, seed: int, group: int) -> str:
        return self.words(f"sys:{seed}:{group}", self.system_tokens)

    def build(self, seed: int) -> list[BenchRequest]:
        rng = random.Random(f"shared-prefix:{seed}")
        pairs = [(g, p) for g in range(self.groups) for p in range(self.prompts_per_group)]
        rng.shuffle(pairs)
        systems = {g: self.system_prompt(seed, g) for g in range(self.groups)}
        out = []
        for i, (g, p) in enumerate(pairs):
            question = self.words(f"q:{seed}:{g}:{p}", self.question_tokens)
            out.append(
                BenchRequest(
                    index=i,
                    messages=_chat(systems[g], question),
                    max_tokens=self.output_tokens,
                    prompt_tokens=self.system_tokens + self.question_tokens,
                    group=f"g{g}",
                )
            )
        return out


@_register
@dataclass
class DynamicSystemPrompt(SharedPrefix):
    name: ClassVar[str] = "dynamic-system-prompt"
    summary: ClassVar[str] = "shared-prefix whose system prompt starts with the time and a user id"
    # "sentence": "Today is <ISO time>, user <UUID>. You are", what the built-in rules recognise;
    # "line": a line of its own, "time W W W session W W W W", its values words of the benchmark's
    # vocabulary: the GPU kit's one-token-per-word tokenizer maps a timestamp or a UUID to <unk>,
    # which would make every request's head the same tokens to the engine.
    head: str = "sentence"

    def build(self, seed: int) -> list[BenchRequest]:
        if self.head not in ("sentence", "line"):
            raise ValueError(f"head {self.head!r}: expected sentence or line")
        out = super().build(seed)
        if self.head == "line":
            for req in out:
                clock = self.words(f"time:{seed}:{req.index}", 3)
                line = f"time{clock} session{self.words(f'sid:{seed}:{req.index}', 4)}\n"
                req.messages[0]["content"] = line + req.messages[0]["content"].lstrip()
                req.prompt_tokens += get_tokenizer().count(line)
            return out
        rng = random.Random(f"dynamic:{seed}")
        start = dt.datetime(2026, 11, 29, 9, 0, 0, tzinfo=dt.UTC)
        for req in out:
            # ISO time and a UUID: what canonicalization's built-in rules recognise as volatile.
            now = start + dt.timedelta(seconds=req.index * 7 + rng.randrange(7))
            user = uuid.UUID(int=rng.getrandbits(128), version=4)
            head = f"Today is {now.strftime('%Y-%m-%dT%H:%M:%SZ')}, user {user}. You are"
            req.messages[0]["content"] = head + req.messages[0]["content"]
            req.prompt_tokens += get_tokenizer().count(head)
        return out


@_register
@dataclass
class PrefixRepetition(Workload):
    name: ClassVar[str] = "prefix-repetition"
    summary: ClassVar[str] = "K hot prefixes of A tokens, each request one prefix + random suffix (vLLM)"
    num_prefixes: int = 4
    prefix_tokens: int = 2048
    suffix_tokens: int = 128
    output_tokens: int = 128
    num_requests: int = 400

    def build(self, seed: int) -> list[BenchRequest]:
        rng = random.Random(f"prefix-repetition:{seed}")
        prefixes = [text.words(f"prefix:{seed}:{k}", self.prefix_tokens) for k in range(self.num_prefixes)]
        out = []
        for i in range(self.num_requests):
            k = rng.randrange(self.num_prefixes)
            suffix = text.words(f"suffix:{seed}:{i}", self.suffix_tokens)
            out.append(
                BenchRequest(
                    index=i,
                    messages=_chat(None, prefixes[k] + suffix),
                    max_tokens=self.output_tokens,
                    prompt_tokens=self.prefix_tokens + self.suffix_tokens,
                    group=f"p{k}",
                )
            )
        return out


@_register
@dataclass
class LoraMix(Workload):
    name: ClassVar[str] = "lora-mix"
    summary: ClassVar[str] = "requests over A LoRA adapters (Zipf popularity), each one asks for its adapter"
    adapters: int = 8
    adapter_prefix: str = "lora-"  # adapter k is named <prefix><k>
    zipf_s: float = 1.0  # popularity of adapter k ~ 1/(k+1)^s; 0 is uniform
    system_tokens: int = 0  # a system prompt shared by every adapter's requests (0: none)
    question_tokens: int = 512
    output_tokens: int = 64
    num_requests: int = 400

    def build(self, seed: int) -> list[BenchRequest]:
        rng = random.Random(f"lora-mix:{seed}")
        weights = [1.0 / (k + 1) ** self.zipf_s for k in range(self.adapters)]
        system = text.words(f"lora-sys:{seed}", self.system_tokens) if self.system_tokens else None
        out = []
        for i in range(self.num_requests):
            k = rng.choices(range(self.adapters), weights)[0]
            question = text.words(f"lora-q:{seed}:{i}", self.question_tokens)
            out.append(
                BenchRequest(
                    index=i,
                    messages=_chat(system, question),
                    max_tokens=self.output_tokens,
                    prompt_tokens=self.system_tokens + self.question_tokens,
                    group=f"{self.adapter_prefix}{k}",
                    kind=f"{self.adapter_prefix}{k}",
                    model=f"{self.adapter_prefix}{k}",
                )
            )
        return out


@_register
@dataclass
class MultiTurnChat(Workload):
    name: ClassVar[str] = "multi-turn"
    summary: ClassVar[str] = "sessions of T turns, each resending the whole history"
    sessions: int = 32
    turns: int = 6
    system_tokens: int = 512
    user_tokens: int = 128
    output_tokens: int = 128

    def system_prompt(self, seed: int, session: int) -> str:
        return text.words(f"mt-sys:{seed}:{session}", self.system_tokens)

    def build(self, seed: int) -> list[BenchRequest]:
        rng = random.Random(f"{self.name}:{seed}")
        # Interleave sessions at random while keeping each session's turns in order.
        order = [s for s in range(self.sessions) for _ in range(self.turns)]
        rng.shuffle(order)
        history = {s: [{"role": "system", "content": self.system_prompt(seed, s)}] for s in order}
        tokens = dict.fromkeys(history, self.system_tokens)
        turn = dict.fromkeys(history, 0)
        last: dict[int, int] = {}
        out = []
        for i, s in enumerate(order):
            t = turn[s]
            user = text.words(f"mt-user:{seed}:{s}:{t}", self.user_tokens)
            messages = [*history[s], {"role": "user", "content": user}]
            tokens[s] += self.user_tokens
            out.append(
                BenchRequest(
                    index=i,
                    messages=messages,
                    max_tokens=self.output_tokens,
                    prompt_tokens=tokens[s],
                    group=f"s{s}",
                    depends_on=last.get(s),
                )
            )
            # The next turn resends a fixed synthetic answer, so prompts do not depend on the engine.
            answer = text.words(f"mt-answer:{seed}:{s}:{t}", self.output_tokens)
            history[s] = [*messages, {"role": "assistant", "content": answer}]
            tokens[s] += self.output_tokens
            turn[s] = t + 1
            last[s] = i
        return out


@_register
@dataclass
class ToolAgent(MultiTurnChat):
    """An agent framework's traffic: every session starts with its agent's long tool definitions
    (shared by all sessions of that agent), then grows by short turns (a tool result or a user
    line, a short tool call back)."""

    name: ClassVar[str] = "tool-agent"
    summary: ClassVar[str] = "sessions sharing long tool definitions per agent, short growing turns"
    agents: int = 2
    sessions: int = 48
    turns: int = 8
    system_tokens: int = 4096
    user_tokens: int = 64
    output_tokens: int = 32

    def system_prompt(self, seed: int, session: int) -> str:
        return text.words(f"tools:{seed}:{session % self.agents}", self.system_tokens)


@_register
@dataclass
class PrefixSurge(Workload):
    """Shared-prefix traffic into which a new hot prefix bursts mid-run: from `surge_at` (share of
    the requests) on, `surge_share` of the requests carry the one new prefix."""

    name: ClassVar[str] = "prefix-surge"
    summary: ClassVar[str] = "G groups of shared prefixes; mid-run one new prefix takes a share of traffic"
    groups: int = 32
    system_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 64
    num_requests: int = 600
    surge_at: float = 0.4
    surge_share: float = 0.5

    def build(self, seed: int) -> list[BenchRequest]:
        rng = random.Random(f"prefix-surge:{seed}")
        systems = [text.words(f"surge-sys:{seed}:{g}", self.system_tokens) for g in range(self.groups + 1)]
        start = int(self.num_requests * self.surge_at)
        out = []
        for i in range(self.num_requests):
            hot = i >= start and rng.random() < self.surge_share
            g = self.groups if hot else rng.randrange(self.groups)
            out.append(
                BenchRequest(
                    index=i,
                    messages=_chat(systems[g], text.words(f"surge-q:{seed}:{i}", self.question_tokens)),
                    max_tokens=self.output_tokens,
                    prompt_tokens=self.system_tokens + self.question_tokens,
                    group=f"g{g}",
                    kind="surge" if hot else "background",
                )
            )
        return out


@_register
@dataclass
class MixedPriority(Workload):
    name: ClassVar[str] = "mixed-priority"
    summary: ClassVar[str] = "short interactive (high priority) and long batch (low priority) requests"
    num_requests: int = 400
    interactive_fraction: float = 0.7
    interactive_prompt_tokens: int = 256
    interactive_output_tokens: int = 64
    batch_prompt_tokens: int = 4096
    batch_output_tokens: int = 512
    interactive_class: str = "interactive"
    batch_class: str = "batch"

    def build(self, seed: int) -> list[BenchRequest]:
        rng = random.Random(f"mixed-priority:{seed}")
        out = []
        for i in range(self.num_requests):
            interactive = rng.random() < self.interactive_fraction
            n_in = self.interactive_prompt_tokens if interactive else self.batch_prompt_tokens
            cls = self.interactive_class if interactive else self.batch_class
            out.append(
                BenchRequest(
                    index=i,
                    messages=_chat(None, text.words(f"mixed:{seed}:{i}", n_in)),
                    max_tokens=self.interactive_output_tokens if interactive else self.batch_output_tokens,
                    prompt_tokens=n_in,
                    group=f"r{i}",
                    priority=cls,
                    kind=cls,
                )
            )
        return out


@_register
@dataclass
class LongPromptInterference(Workload):
    name: ClassVar[str] = "long-prompt"
    summary: ClassVar[str] = "steady short chats plus occasional 16k-32k-token documents"
    num_requests: int = 400
    long_fraction: float = 0.03
    short_prompt_tokens: int = 512
    short_output_tokens: int = 128
    long_min_tokens: int = 16384
    long_max_tokens: int = 32768
    long_output_tokens: int = 64

    def build(self, seed: int) -> list[BenchRequest]:
        rng = random.Random(f"long-prompt:{seed}")
        out = []
        for i in range(self.num_requests):
            long = rng.random() < self.long_fraction
            n_in = (
                rng.randint(self.long_min_tokens, self.long_max_tokens) if long else self.short_prompt_tokens
            )
            out.append(
                BenchRequest(
                    index=i,
                    messages=_chat(None, text.words(f"long:{seed}:{i}", n_in)),
                    max_tokens=self.long_output_tokens if long else self.short_output_tokens,
                    prompt_tokens=n_in,
                    group=f"r{i}",
                    kind="long" if long else "short",
                )
            )
        return out


def mooncake_dir(override: str | None = None) -> Path:
    return Path(override or os.environ.get("KVGATE_MOONCAKE_DIR") or DEFAULT_MOONCAKE_DIR)


@_register
@dataclass
class MooncakeTrace(Workload):
    """Replay of a Mooncake FAST'25 trace. Block k of a prompt is the text generated from hash id
    k, so requests that share k leading ids share exactly k blocks of prefix."""

    name: ClassVar[str] = "mooncake"
    summary: ClassVar[str] = "Mooncake FAST'25 trace replay (conversation|synthetic), scalable"
    trace: str = "conversation"
    data_dir: str | None = None
    length_scale: float = 1.0  # block size and lengths scale together, keeping the sharing structure
    output_scale: float | None = None  # defaults to length_scale
    time_scale: float = 1.0  # arrival offsets are multiplied by this (0.5 = twice as fast)
    start_s: float = 0.0  # skip the trace before this offset (trace time)
    max_requests: int | None = 500
    max_input_tokens: int | None = None  # drop longer (scaled) prompts: small simulated contexts
    group_max_share: float = 0.1  # x-kvgate-group: first block id shared by fewer requests than this
    dropped: int = field(default=0, init=False)

    @property
    def block_tokens(self) -> int:
        return max(2, round(MOONCAKE_BLOCK_TOKENS * self.length_scale))

    def path(self) -> Path:
        name = self.trace if self.trace.endswith(".jsonl") else f"{self.trace}_trace.jsonl"
        return mooncake_dir(self.data_dir) / name

    def rows(self) -> list[dict[str, Any]]:
        path = self.path()
        if not path.exists():
            raise FileNotFoundError(f"Mooncake trace not found: {path} (set data_dir or KVGATE_MOONCAKE_DIR)")
        rows = []
        with path.open() as fh:
            for line in fh:
                row = json.loads(line)
                if row["timestamp"] / 1000.0 < self.start_s:
                    continue
                rows.append(row)
                if self.max_requests is not None and len(rows) >= self.max_requests:
                    break
        return rows

    def scaled_input(self, input_length: int, n_blocks: int) -> int:
        bt = self.block_tokens
        scaled = round(input_length * bt / MOONCAKE_BLOCK_TOKENS)
        # Stay inside the last block, as the unscaled length does.
        return min(max(scaled, (n_blocks - 1) * bt + 1), n_blocks * bt)

    def build(self, seed: int) -> list[BenchRequest]:
        bt = self.block_tokens
        out_scale = self.length_scale if self.output_scale is None else self.output_scale
        blocks: dict[int, str] = {}
        # Hash ids are chained (an id fixes its whole prefix), so each id has one parent; siblings
        # (ids after the same parent) get distinct first tokens and so share nothing past the parent.
        children: dict[int | None, int] = {}
        out: list[BenchRequest] = []
        self.dropped = 0
        t0: float | None = None
        rows = self.rows()
        # A session's group is its first block that is not a fleet-wide hot prefix: in the
        # conversation trace every request starts with block 0, which would make one group.
        popularity = Counter(h for row in rows for h in set(row["hash_ids"]))
        hot = self.group_max_share * len(rows)
        for row in rows:
            ids: list[int] = row["hash_ids"]
            n_in = self.scaled_input(row["input_length"], len(ids))
            if self.max_input_tokens is not None and n_in > self.max_input_tokens:
                self.dropped += 1
                continue
            parts = []
            parent: int | None = None
            for k, h in enumerate(ids):
                if h not in blocks:
                    first = children.get(parent, 0)
                    children[parent] = first + 1
                    # The seed namespaces block texts, so two seeds replay with different text.
                    blocks[h] = text.block(f"mooncake:{seed}:{h}", bt, first)
                n = min(bt, n_in - k * bt)
                parts.append(blocks[h] if n == bt else _first_tokens(blocks[h], n))
                parent = h
            t = row["timestamp"] / 1000.0
            t0 = t if t0 is None else t0
            out.append(
                BenchRequest(
                    index=len(out),
                    messages=_chat(None, "".join(parts)),
                    max_tokens=max(1, math.ceil(row["output_length"] * out_scale)),
                    prompt_tokens=n_in,
                    group=f"h{next((h for h in ids if popularity[h] < hot), ids[-1])}" if ids else None,
                    at=(t - t0) * self.time_scale,
                )
            )
        return out


def _first_tokens(block_text: str, n: int) -> str:
    """The first n words (= tokens) of a block: words start at each space."""
    cut = -1
    for _ in range(n + 1):
        cut = block_text.find(" ", cut + 1)
        if cut == -1:
            return block_text
    return block_text[:cut]
