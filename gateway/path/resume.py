"""Mid-stream failover: an answer whose engine failed after it began goes on at another replica.

The gateway sees every event it relays, so it knows the text already sent. When the attempt fails
after the answer began (the connection reset or closed early, a malformed event, an engine error
event, no bytes for the idle timeout), the next replica is asked to *continue* it:

- chat: the original messages plus an assistant message holding the text sent so far, left open;
- completions: the prompt followed by the text sent so far,

in the engines' dialect (the pool's engine adapter's `continuation`; an engine that cannot continue
an answer, such as a plain OpenAI-compatible server, gets no failover).

The continuation starts from the sent text cut back to its last word boundary: the engine may
tokenize a half-sent word differently from how it generated it, so the tail is generated again
and only what extends the text already sent is relayed (a regenerated tail that differs ends the
answer with an error: the client has seen text the continuation disowns). `max_tokens` (or
`max_completion_tokens`) shrinks by the tokens of the text the continuation starts from; every
other field (stop, seed, sampling, priority) is the client's own.

The client sees one answer: every continued event carries the first attempt's id, `created` and
model; the role is not sent twice; the usage chunk counts the whole answer as one generation
(`prompt_tokens`: the continuation's prompt less the text it started from, i.e. the original
prompt; `completion_tokens`: all the answer's tokens). A non-streamed answer is asked of the
engine as a stream and assembled here, so that it can be continued the same way.

What is not continued (`blocked`) ends as before: n > 1, logprobs, echo, token-id prompts,
structured output, a tool call or reasoning being streamed, a client's `x-kvgate-no-resume: 1`.

Memory stays bounded whatever an engine sends: a streamed answer keeps at most
`failover.max_kept_bytes` of its events; past them what was kept is dropped and the answer is
relayed on without failover (`too_long`). A non-streamed answer assembled here is bounded by
`upstream.max_response_bytes`, as a plain one is (`too_large`: 502 `upstream_response_too_large`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.config import FailoverConfig
from gateway.path.exchange import StreamOut
from gateway.path.sse_events import sse_error_event

# Asks an engine to go on from an answer's text: (body, chat, text) -> the continuation's body.
Continuation = Callable[[Mapping[str, Any], bool, str], dict[str, Any]]
NO_RESUME_HEADER = "x-kvgate-no-resume"
_DONE = b"[DONE]"
# Fields whose output a continuation cannot reproduce from text alone (besides response_format).
_STRUCTURED = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "regex",
    "ebnf",
    "json_schema",
)


def resumable(
    endpoint: str, body: Mapping[str, Any], headers: Mapping[str, str], cfg: FailoverConfig
) -> bool:
    """Whether an answer to this request may be continued on another replica (by an engine that
    can continue answers)."""
    if not cfg.mid_stream or cfg.max_resumes < 1 or headers.get(NO_RESUME_HEADER, "").strip() == "1":
        return False
    if not body.get("stream") and not cfg.non_streamed:
        return False
    if endpoint == "chat":
        if (
            not isinstance(body.get("messages"), list)
            or body.get("continue_final_message")
            or body.get("echo")
        ):
            return False
        if body.get("logprobs") or (body.get("tools") and body.get("tool_choice") not in (None, "none")):
            return False
    elif endpoint == "completions":
        if not isinstance(body.get("prompt"), str) or body.get("echo") or body.get("logprobs") is not None:
            return False
        if body.get("best_of") not in (None, 1) or body.get("suffix"):
            return False
    else:
        return False
    rf = body.get("response_format")
    structured = any(body.get(k) is not None for k in _STRUCTURED)
    if structured or (isinstance(rf, dict) and rf.get("type") not in (None, "text")):
        return False
    return body.get("n") in (None, 1)


class Resume:
    """One answer across its attempts: what was sent, and how the next attempt continues it."""

    def __init__(
        self,
        endpoint: str,
        body: dict[str, Any],
        cfg: FailoverConfig,
        count: Callable[[str], int],
        max_response_bytes: int,
        continue_body: Continuation,
    ) -> None:
        self.chat = endpoint == "chat"
        self.continue_body = continue_body  # the engines' way to ask them to go on from a text
        self.body = body  # as the engines are sent it (the model's upstream name in it)
        self.buffered = not body.get("stream")  # the client wants one JSON body: assembled here
        # What may be kept of the answer's events: all of an assembled answer, up to the bound of
        # any answer read whole; enough of a streamed one to continue it.
        self.max_kept = max_response_bytes if self.buffered else cfg.max_kept_bytes
        self.kept = 0  # bytes of events fed so far, while they are kept
        self.keep = True  # False once past `max_kept`: events go by unread where they can
        self.left = cfg.max_resumes
        self.count = count
        self.out: StreamOut | None = None  # the client's stream, once opened
        # The text sent, in order; events relayed untouched are kept as they came and read only if
        # the answer is continued (or assembled): most answers never are.
        self.text: list[str | bytes] = []
        self.reasoning: list[str] = []
        self.head: dict[str, Any] | None = None  # id, object, created, model of the first event
        self.finish: Any = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.done = False  # [DONE] relayed
        self.blocked: str | None = None  # why the answer can no longer be continued
        self.failure: str | None = None  # why the current attempt failed inside its stream
        self.error_event: bytes | None = None  # what the client is told should no replica go on
        self.continuing = False  # the current attempt is a continuation
        self.ended = False  # the text was whole (its finish reason sent) before this attempt
        self.seam = ""  # regenerated text still to be matched against what was sent
        self.seam_fresh = False  # no text of the continuation seen yet
        self.base_tokens = 0  # tokens of the text the current continuation started from

    # -- what engines are sent ----------------------------------------------------------------
    def first_body(self, payload: bytes) -> bytes:
        """The first attempt's body: a non-streamed request is asked as a stream with usage."""
        if not self.buffered:
            return payload
        doc = orjson.loads(payload)
        doc["stream"] = True
        doc["stream_options"] = {"include_usage": True}
        return orjson.dumps(doc)

    @property
    def whole(self) -> bool:
        """The answer was all sent: [DONE] was, or its finish reason and the usage it was owed."""
        self.settle()
        wants_usage = self.buffered or bool((self.body.get("stream_options") or {}).get("include_usage"))
        return self.done or (self.finish is not None and (self.usage is not None or not wants_usage))

    @property
    def continuable(self) -> bool:
        self.settle()
        return self.blocked is None and self.left > 0

    def continuation(self) -> dict[str, Any]:
        """The body that asks the next replica to go on from the text sent so far."""
        self.left -= 1
        sent = self.sent_text()
        cut = word_boundary(sent)
        self.seam = sent[cut:]
        self.seam_fresh = True
        start = sent[:cut]
        self.base_tokens = self.count(start) if start else 0
        doc = dict(self.body)
        if self.buffered:
            doc["stream"] = True
            doc["stream_options"] = {"include_usage": True}
        if start:  # else nothing to continue from: the request as it was, its first word regenerated
            doc = self.continue_body(doc, self.chat, start)
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(doc.get(key), int):
                doc[key] = max(1, doc[key] - self.base_tokens)
        self.continuing = True
        self.ended = self.finish is not None  # only the usage and [DONE] are missing
        self.failure = None
        return doc

    # -- what the client is sent --------------------------------------------------------------
    def feed(self, events: bytes) -> bytes:
        """Whole SSE events from the current attempt; what of them the client gets (b"" while
        assembling a non-streamed answer). Stops at the first event that fails the attempt."""
        if self.keep:
            self.kept += len(events)
            if self.kept > self.max_kept:
                if self.buffered:
                    self.blocked = self.failure = "too_large"
                    return b""
                self._forget()
        if self._plain(events):
            if self.keep:
                self.text.append(events)
            return b"" if self.buffered else events
        out: list[bytes] = []
        for event in events.split(b"\n\n"):
            if self.failure is not None:
                break
            if not event.strip():
                continue
            kept = self._event(event)
            if kept is not None and not self.buffered:
                out.append(kept + b"\n\n")
        return b"".join(out)

    def _forget(self) -> None:
        """Past `max_kept`: what was kept goes, and so does the chance to continue the answer."""
        self.settle()
        self.text, self.reasoning = [], []
        self.keep = False
        self.blocked = self.blocked or "too_long"

    def sent_text(self) -> str:
        """The answer's text so far (the events kept as they came read now)."""
        self.settle()
        return "".join(part for part in self.text if isinstance(part, str))

    def settle(self) -> None:
        """Read the events relayed untouched, in order, as if they had been read as they came."""
        if all(isinstance(part, str) for part in self.text):
            return
        parts, self.text = self.text, []
        failure, error_event = self.failure, self.error_event  # what broke the attempt, not these
        for part in parts:
            if isinstance(part, str):
                self.text.append(part)
                continue
            for event in part.split(b"\n\n"):
                if event:
                    self._event(event)  # one the client got as it was, even were it malformed
        self.failure, self.error_event = failure, error_event

    def _plain(self, events: bytes) -> bool:
        """Whether whole events of the first attempt can go out unread, by a few byte counts over
        them: JSON objects in `data:` lines, none cut short, no error event (what else they hold,
        a finish reason, usage, a tool call, is read should the answer be continued)."""
        if self.continuing or self.head is None or not events.endswith(b"\n\n"):
            return False
        n = events.count(b"\n\n")
        return (
            events.count(b"data: {") == n
            and events.count(b"}\n\n") == n
            and not events.count(b'data: {"error"')
        )

    def _event(self, event: bytes) -> bytes | None:
        data = b"\n".join(
            line[5:].lstrip() for line in event.lstrip(b"\r\n").splitlines() if line.startswith(b"data:")
        )
        if not data:
            return event  # a comment or a keep-alive
        if data.strip() == _DONE:
            self.done = True
            return event
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            self.failure = "malformed_event"
            return None
        if "error" in doc:
            self.failure = "engine_error"
            # As the engine would have ended it (vLLM and SGLang follow an error event with
            # [DONE]), the event already in the gateway's error form (sse_events).
            self.error_event = event + b"\n\ndata: [DONE]\n\n"
            return None
        choices = doc.get("choices")
        usage = doc.get("usage")
        if self.head is None:  # the answer's first event, whichever attempt sent it
            self.head = {k: doc.get(k) for k in ("id", "object", "created", "model")}
        elif self.continuing:
            doc.update((k, v) for k, v in self.head.items() if v is not None)
        if isinstance(usage, dict):
            if self.continuing:
                doc["usage"] = usage = self._whole(usage)
            self.usage = usage
        if not isinstance(choices, list) or not choices:
            return self._encode(doc, event)
        choice = choices[0]
        if not isinstance(choice, dict):
            self.failure = "malformed_event"
            return None
        if self.ended:
            return None  # regenerated only for the usage that follows it
        text = self._text(choice)
        if text is None:
            return None
        if choice.get("finish_reason") is not None and not self.ended:
            self.finish = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")
        if self.continuing and not text and self.finish is None and not usage:
            return None  # the seam's regenerated text, or the repeated role
        return self._encode(doc, event)

    def _text(self, choice: dict[str, Any]) -> str | None:
        """The event's text, the seam trimmed off; None when the event ends the attempt."""
        field = "text"
        holder = choice
        if self.chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                self.failure = "malformed_event"
                return None
            if delta.get("tool_calls") or delta.get("function_call"):
                self.blocked = "tool_call"  # arguments cannot be continued safely
            if delta.get("reasoning_content") or delta.get("reasoning"):
                if self.keep:
                    self.reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
                self.blocked = "reasoning"
            if self.continuing:
                delta.pop("role", None)
            field, holder = "content", delta
        text = holder.get(field)
        if not isinstance(text, str):
            return ""
        if self.seam and text:
            if self.seam[0].isspace() and not text[0].isspace() and self.seam_fresh:
                # An engine that decodes the continuation's first word without the space before
                # it: the client has that space already.
                self.seam = self.seam.lstrip()
            self.seam_fresh = False
            if text.startswith(self.seam):
                text, self.seam = text[len(self.seam) :], ""
            elif self.seam.startswith(text):
                text, self.seam = "", self.seam[len(text) :]
            else:
                self.blocked = self.failure = "diverged"
                message = "the answer's continuation disagreed with the text already sent"
                self.error_event = sse_error_event(message, "upstream_resume_diverged")
                return None
            holder[field] = text
        if self.keep:
            self.text.append(text)
        return text

    def _encode(self, doc: dict[str, Any], event: bytes) -> bytes:
        # The first attempt's events go out as the engine wrote them; a continuation's rewritten.
        return b"data: " + orjson.dumps(doc) if self.continuing else event

    def _whole(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage as the whole answer's: the text it started from was output."""
        base = self.base_tokens
        prompt = max(0, int(usage.get("prompt_tokens") or 0) - base)
        completion = int(usage.get("completion_tokens") or 0) + base
        whole = dict(
            usage, prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            whole["prompt_tokens_details"] = dict(
                details, cached_tokens=min(details["cached_tokens"], prompt)
            )
        return whole

    def assembled(self) -> bytes:
        """The non-streamed answer, from the events of every attempt."""
        head = self.head or {}
        text = self.sent_text()
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            choice["message"] = message
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self.finish, stop_reason=self.stop_reason)
        doc: dict[str, Any] = {
            "id": head.get("id"),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": [choice],
            "usage": self.usage,
        }
        return orjson.dumps(doc)


def word_boundary(text: str) -> int:
    """Where the text's last word begins (its leading whitespace included): tokenizers that glue a
    word to the space before it end a token there, whatever they made of the word itself. Whitespace
    after the last word stays with it: a seam of whitespace alone would check nothing, and a
    continuation that started over (or went elsewhere) would be relayed as if it went on."""
    i = len(text)
    while i > 0 and text[i - 1].isspace():
        i -= 1
    while i > 0 and not text[i - 1].isspace():
        i -= 1
    while i > 0 and text[i - 1].isspace():
        i -= 1
    return i
