"""What a generation request's choices say, and the bodies and SSE events that carry it.

The plain case (text, no logprobs) keeps the byte templates of `protocol.ChunkFormat`: a streaming step
writes one chunk per running request. Everything else goes through `Plan` and the dict-built formats here:
logprobs, structured outputs and tool calls (both a `Script`: fixed token ids and texts), and the
Responses API's event stream.

Layouts as vLLM 0.33-era serving code writes them (chat_completion/serving.py at 5e918640): a forced
named tool call's message has `content: ""` and `tool_calls`, its finish_reason is the output's ("stop",
or "length" when cut), while `tool_choice: "required"` ends with "tool_calls"; streamed, the first delta of
a call carries id, type, function.name and the first argument text, later deltas only argument text, with
the tool call `index` set to the choice index (as vLLM does for named calls).

`tool_choice: "auto"` (with `--enable-auto-tool-choice`): the simulated model calls a tool when the
conversation's last message is the user's and names one of the tools (the first named, in `tools`
order); its output is then what vLLM's hermes parser (vllm/tool_parsers/hermes_tool_parser.py) turns
into a call: `content: null` (nothing before `<tool_call>`), the call at `index` 0 of the message's
calls, and finish_reason "tool_calls" (vLLM's `auto_tools_called`).
"""

from __future__ import annotations

import itertools
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from gateway.sim import logprobs as lp
from gateway.sim import protocol as proto
from gateway.sim.structured import Script

if TYPE_CHECKING:
    from gateway.sim.engine import Request


@dataclass(slots=True)
class Plan:
    """One generation request's output choices (`n` per prompt, prompts in order)."""

    kind: str  # "chat" | "completion" | "responses"
    model: str  # the model name responses carry (the adapter's, or the first served name)
    seeds: list[int] = field(default_factory=list)
    scripts: list[Script | None] = field(default_factory=list)
    logprobs: int | None = None  # chat: top_logprobs (logprobs on); completions: `logprobs`; None: off
    tool: str | None = None  # the forced function's name
    tool_required: bool = False  # tool_choice "required" (else a named function)
    tool_auto: bool = False  # tool_choice "auto", and the model called the tool
    tool_ids: list[str] = field(default_factory=list)
    prompt_tokens: int = 0  # summed over prompts
    # Per choice, a matched stop string: (the character its match starts at, the token holding
    # that character, the string). The text ends before the match; vLLM's stop_reason names it.
    stops: list[tuple[int, int, str] | None] = field(default_factory=list)

    @property
    def rich(self) -> bool:
        scripted = any(s is not None for s in self.scripts) or any(self.stops)
        return self.logprobs is not None or self.tool is not None or scripted

    def stop_at(self, i: int, stops: list[str], max_tokens: int) -> int:
        """Choice i's output tokens once `stops` (plain text only) end it: the first match of any,
        at the token that completes it (max_tokens when none matches)."""
        words = proto.output_words(self.seeds[i], 0, max_tokens)
        text = "".join(words)
        found = [(at, stop) for stop in stops if stop and (at := text.find(stop)) >= 0]
        self.stops.extend([None] * (i + 1 - len(self.stops)))
        if not found:
            return max_tokens
        at, stop = min(found)
        ends = list(itertools.accumulate(len(w) for w in words))
        holder = next(k for k, end in enumerate(ends) if end > at)
        self.stops[i] = (at, holder, stop)
        return next(k for k, end in enumerate(ends) if end >= at + len(stop)) + 1

    def held(self, i: int, produced: int) -> int:
        """Tokens of choice i that may be streamed while it runs: none from the one where a stop
        match begins (vLLM holds back what may start a stop string, so no client sees part of one)."""
        stop = self.stops[i] if i < len(self.stops) else None
        return produced if stop is None else min(produced, stop[1])

    def stop_reason(self, i: int) -> str | None:
        stop = self.stops[i] if i < len(self.stops) else None
        return None if stop is None else stop[2]

    def add_choice(self, seed: int, script: Script | None) -> None:
        self.seeds.append(seed)
        self.scripts.append(script)
        if self.tool is not None:
            self.tool_ids.append(f"chatcmpl-tool-{uuid.uuid4().hex}")

    def text(self, i: int, start: int, end: int) -> str:
        s = self.scripts[i]
        if s is not None:
            return s.text(start, end)
        stop = self.stops[i] if i < len(self.stops) else None
        if stop is None:
            return proto.output_text(self.seeds[i], start, end)
        offset = len(proto.output_text(self.seeds[i], 0, start))
        return proto.output_text(self.seeds[i], start, end)[: max(0, stop[0] - offset)]

    def tokens(self, i: int, start: int, end: int) -> list[str]:
        s = self.scripts[i]
        return s.pieces[start:end] if s is not None else proto.output_words(self.seeds[i], start, end)

    def finish(self, reason: str | None) -> str | None:
        """The finish_reason a choice reports: "required" tool calls that ended end with "tool_calls",
        as does every call the model chose to make."""
        if reason is not None and self.tool_auto:
            return "tool_calls"
        return "tool_calls" if reason == "stop" and self.tool_required else reason

    def chat_logprobs(self, i: int, start: int, end: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return {"content": lp.chat_content(self.seeds[i], start, self.tokens(i, start, end), self.logprobs)}

    def completion_logprobs(self, i: int, start: int, end: int, offset: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return lp.completion(self.seeds[i], start, self.tokens(i, start, end), self.logprobs, offset)

    def tool_call(self, i: int, arguments: str) -> dict[str, Any]:
        return {
            "id": self.tool_ids[i],
            "type": "function",
            "function": {"name": self.tool, "arguments": arguments},
        }


def called_tool(messages: list[Any], tools: list[Any]) -> Any | None:
    """The tool the simulated model calls under `tool_choice: "auto"`: the first of `tools` whose name
    the last message names, when that message is the user's (after a tool's answer it answers in text)."""
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        return None
    for tool in tools:
        if re.search(rf"(?<![\w-]){re.escape(tool.function.name)}(?![\w-])", content, re.IGNORECASE):
            return tool
    return None


def chat_message(plan: Plan, i: int, n_out: int) -> dict[str, Any]:
    text = plan.text(i, 0, n_out)
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if plan.tool is not None:
        content = None if plan.tool_auto else ""
        msg = {"role": "assistant", "content": content, "tool_calls": [plan.tool_call(i, text)]}
    msg.update(refusal=None, annotations=None, audio=None, function_call=None, reasoning=None)
    return msg


class RichChunks:
    """SSE chunks for chat and text completions built as dicts (logprobs, scripted text, tool calls)."""

    __slots__ = ("chat", "created", "model", "obj", "plan", "resp_id", "text_offsets")

    def __init__(self, plan: Plan, resp_id: str, created: int) -> None:
        self.plan = plan
        self.chat = plan.kind == "chat"
        self.obj = "chat.completion.chunk" if self.chat else "text_completion"
        self.resp_id = resp_id
        self.created = created
        self.model = plan.model
        self.text_offsets = [0] * len(plan.seeds)

    def _wrap(self, choice: dict[str, Any]) -> bytes:
        body = {"id": self.resp_id, "object": self.obj, "created": self.created, "model": self.model}
        body["choices"] = [choice]
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def piece(self, i: int, start: int, end: int, finish: str | None) -> bytes:
        plan = self.plan
        text = plan.text(i, start, end)
        if not self.chat:
            lps = plan.completion_logprobs(i, start, end, self.text_offsets[i])
            self.text_offsets[i] += len(text)
            reason = plan.stop_reason(i) if finish is not None else None
            return self._wrap(
                {"index": i, "text": text, "logprobs": lps, "finish_reason": finish, "stop_reason": reason}
            )
        delta: dict[str, Any] = {"role": "assistant"} if start == 0 else {}
        if plan.tool is not None:
            index = 0 if plan.tool_auto else i  # hermes numbers a message's calls; named ones the choice
            call: dict[str, Any] = {"index": index, "function": {"arguments": text}}
            if start == 0:
                call = {"id": plan.tool_ids[i], "type": "function", "index": index}
                call["function"] = {"name": plan.tool, "arguments": text}
            delta["tool_calls"] = [call]
        else:
            delta["content"] = text
        choice = {
            "index": i,
            "delta": delta,
            "logprobs": plan.chat_logprobs(i, start, end),
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = plan.stop_reason(i)
        return self._wrap(choice)

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        body = {"id": self.resp_id, "object": self.obj, "created": self.created, "model": self.model}
        return b"data: " + orjson.dumps({**body, "choices": [], "usage": usage}) + b"\n\n"


# ---- the Responses API (/v1/responses) ------------------------------------------------------------------


def responses_usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


@dataclass(slots=True)
class ResponseMeta:
    resp_id: str
    msg_id: str
    created: int
    model: str
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None


def response_object(
    meta: ResponseMeta, status: str, text: str | None, usage: dict[str, Any] | None, incomplete: bool = False
) -> dict[str, Any]:
    output = []
    if text is not None:
        item_status = "incomplete" if incomplete else "completed"
        content: list[dict[str, Any]] = [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        ]
        output.append(
            {
                "id": meta.msg_id,
                "type": "message",
                "role": "assistant",
                "status": item_status,
                "content": content,
            }
        )
    return {
        "id": meta.resp_id,
        "object": "response",
        "created_at": meta.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": meta.instructions,
        "max_output_tokens": meta.max_output_tokens,
        "metadata": None,
        "model": meta.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": None,
        "service_tier": "auto",
        "store": False,
        "temperature": meta.temperature if meta.temperature is not None else 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": meta.top_p if meta.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
    }


class ResponseEvents:
    """The Responses API's streamed events: created, in_progress, output_item.added, content_part.added,
    output_text.delta per step, then the .done events and completed (or incomplete), each as
    `event: TYPE` + `data: JSON` with a running sequence_number (no [DONE])."""

    __slots__ = ("meta", "plan", "seq")

    def __init__(self, plan: Plan, meta: ResponseMeta) -> None:
        self.plan = plan
        self.meta = meta
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def opening(self) -> bytes:
        m = self.meta
        resp = response_object(m, "in_progress", None, None)
        item = {
            "id": m.msg_id,
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return b"".join(
            (
                self.event("response.created", response=resp),
                self.event("response.in_progress", response=resp),
                self.event("response.output_item.added", output_index=0, item=item),
                self.event(
                    "response.content_part.added",
                    item_id=m.msg_id,
                    output_index=0,
                    content_index=0,
                    part=part,
                ),
            )
        )

    def piece(self, i: int, start: int, end: int, finish: str | None) -> bytes:
        delta = self.plan.text(i, start, end)
        return self.event(
            "response.output_text.delta",
            item_id=self.meta.msg_id,
            output_index=0,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def closing(self, req: Request, usage: dict[str, Any]) -> bytes:
        m = self.meta
        text = self.plan.text(0, 0, req.num_output)
        incomplete = req.finish_reason == "length"
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        resp = response_object(m, "incomplete" if incomplete else "completed", text, usage, incomplete)
        item = resp["output"][0]
        ids = {"item_id": m.msg_id, "output_index": 0, "content_index": 0}
        return b"".join(
            (
                self.event("response.output_text.done", **ids, text=text, logprobs=[]),
                self.event("response.content_part.done", **ids, part=part),
                self.event("response.output_item.done", output_index=0, item=item),
                self.event("response.incomplete" if incomplete else "response.completed", response=resp),
            )
        )
