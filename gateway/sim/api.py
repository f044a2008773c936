"""The vLLM endpoints beside generation: `/v1/models`, `/tokenize`, `/detokenize`, the LoRA admin endpoints
and, for a pooling (embedding) model, `/v1/embeddings`, `/pooling`, `/score` and `/rerank`.

Shapes and texts from vLLM's sources: models/serving.py (model cards, load/unload answers and errors),
serve/tokenize/protocol.py and serving.py, pooling/{embed,pooling,score}/protocol.py. Pooling requests go
through the engine as prefill-only requests, so they queue, batch and use the prefix cache like the rest.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web

from gateway.sim import pooling as P
from gateway.sim import protocol as proto
from gateway.sim import validation as V
from gateway.sim.engine import FINISHED, Request
from gateway.sim.lora import LoraModule
from gateway.sim.protocol import HTTPError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from gateway.sim.server import Replica


class EmbeddingChatRequest(V.Lenient):
    model: str | None = None
    messages: list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    priority: int = 0


class _Batch:
    """Sink of a group of prefill-only requests: done when all have their first (pooled) output."""

    __slots__ = ("done", "left")

    def __init__(self, n: int) -> None:
        self.left = n
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_output(self, req: Request) -> None:
        if req.state == FINISHED:
            self.left -= 1
            if self.left == 0 and not self.done.done():
                self.done.set_result(None)


class ApiExtras:
    def __init__(self, replica: Replica) -> None:
        self.r = replica
        self.adapters: dict[str, LoraModule] = {}  # loaded LoRA adapters by name, in load order

    # ---- plumbing ------------------------------------------------------------------------------
    async def _answer(
        self, request: web.Request, work: Callable[[dict[str, Any]], Awaitable[web.Response]]
    ) -> web.Response:
        r = self.r
        try:
            if r.crashed or r._starting():
                raise HTTPError(503, "engine is starting up" if not r.crashed else "engine is dead")
            return await work(await r.read_json(request))
        except HTTPError as exc:
            return r.error_response(exc)

    async def _prefill(self, prompts: list[list[int]], lora: str | None, priority: int) -> list[Request]:
        r = self.r
        batch = _Batch(len(prompts))
        rid = uuid.uuid4().hex
        reqs = [
            Request(
                f"{rid}-{i}", ids, 1, priority=priority, block_size=r.engine.block_size, sink=batch, lora=lora
            )
            for i, ids in enumerate(prompts)
        ]
        try:
            for q in reqs:
                r.runner.submit(q)
            await batch.done
        finally:
            if any(q.state != FINISHED for q in reqs):
                for q in reqs:
                    r.engine.abort(q)
                r.runner.wake()
        return reqs

    def _tokens(self, value: Any) -> list[list[int]]:
        """Pooling inputs (str, list[str], token ids or lists of them) as token-id lists."""
        enc = self.r.tokenizer.encode
        if isinstance(value, str):
            return [enc(value)]
        if not value:
            raise V.bad_request("please provide at least one prompt")
        if isinstance(value[0], int):
            return [value]
        return [enc(v) if isinstance(v, str) else v for v in value]

    def _text(self, ids: list[int]) -> str:
        """The text of a pooling input's ids; none for ids the tokenizer has no text for (a client may
        send any integers): their vector is then their tokens' alone."""
        try:
            return self.r.tokenizer.decode(ids)
        except (KeyError, OverflowError, ValueError):
            return ""

    def _check_input_length(self, prompts: list[list[int]], operation: str) -> None:
        limit = self.r.opts.engine.max_model_len
        for ids in prompts:
            if len(ids) > limit:
                raise V.bad_request(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{len(ids)} tokens in the input for {operation}. Please reduce the length of the input.",
                    "input_tokens",
                    len(ids),
                )

    def _listing(self, prefix: str, model: str, data: list[dict[str, Any]], used: int) -> web.Response:
        """The list answer of the embeddings, pooling and score endpoints."""
        return self.r._json(
            {
                "id": f"{prefix}-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": data,
                "usage": P.usage(used),
            }
        )

    def _priority(self, request: web.Request, value: int) -> int:
        return self.r._priority(request, value)

    # ---- models and LoRA adapters --------------------------------------------------------------
    def load_static_adapters(self) -> None:
        slots = self.r.engine.lora_slots
        for m in self.r.serving.lora.modules:
            self.adapters[m.name] = m
            if slots is not None:
                slots.load(m.name)

    async def models(self, request: web.Request) -> web.Response:
        o = self.r.opts
        owner = "sglang" if self.r.sglang else "vllm"
        base = o.served_model_names[0]

        def card(name: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": owner,
                "root": root,
                "parent": parent,
                "max_model_len": max_len,
                "permission": [_permission()],
            }

        data = [card(name, o.model, None, o.engine.max_model_len) for name in o.served_model_names]
        data += [card(m.name, m.path, m.base_model_name or base, None) for m in self.adapters.values()]
        return self.r._json({"object": "list", "data": data})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        async def work(body: dict[str, Any]) -> web.Response:
            req = V.parse(V.LoadLoRARequest, body)
            if not req.lora_name or not req.lora_path:
                raise HTTPError(
                    400, "Both 'lora_name' and 'lora_path' must be provided.", None, "InvalidUserInput"
                )
            if not req.load_inplace and req.lora_name in self.adapters:
                raise HTTPError(
                    400,
                    f"The lora adapter '{req.lora_name}' has already been loaded. If you want to load the "
                    "adapter in place, set 'load_inplace' to True.",
                    None,
                    "InvalidUserInput",
                )
            engine = self.r.engine
            if engine.lora_slots is None:
                raise HTTPError(
                    400, "LoRA is not enabled. Use --enable-lora to enable LoRA.", None, "BadRequestError"
                )
            if req.load_inplace:
                engine.lora_slots.remove(req.lora_name)  # new weights: read them again
            cost = engine.lora_slots.load(req.lora_name)
            # The engine runs add_lora between steps: running requests wait for the read too.
            engine.stall_s += cost
            await asyncio.sleep(cost / self.r.opts.speedup)
            self.adapters[req.lora_name] = LoraModule(req.lora_name, req.lora_path)
            return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        return await self._answer(request, work)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        async def work(body: dict[str, Any]) -> web.Response:
            req = V.parse(V.UnloadLoRARequest, body)
            if not req.lora_name:
                raise HTTPError(
                    400,
                    "'lora_name' needs to be provided to unload a LoRA adapter.",
                    None,
                    "InvalidUserInput",
                )
            if req.lora_name not in self.adapters:
                raise HTTPError(
                    404, f"The lora adapter '{req.lora_name}' cannot be found.", None, "NotFoundError"
                )
            del self.adapters[req.lora_name]
            if self.r.engine.lora_slots is not None:
                self.r.engine.lora_slots.remove(req.lora_name)
            return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

        return await self._answer(request, work)

    # ---- tokenizer -----------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        async def work(body: dict[str, Any]) -> web.Response:
            req = V.parse(V.TokenizeRequest, body)
            if req.messages is None and req.prompt is None:
                raise V.schema_error(
                    [
                        {
                            "type": "missing",
                            "loc": ("body", "TokenizeCompletionRequest", "prompt"),
                            "msg": "Field required",
                            "input": body,
                        },
                        {
                            "type": "missing",
                            "loc": ("body", "TokenizeChatRequest", "messages"),
                            "msg": "Field required",
                            "input": body,
                        },
                    ]
                )
            self.r.resolve_model(req.model)
            tok = self.r.tokenizer
            if req.messages is not None:
                V.check_messages(req.messages)
                tools = [t.model_dump() for t in req.tools] if req.tools else None
                text = proto.render_chat(
                    req.messages, tools, req.add_generation_prompt, req.continue_final_message
                )
            else:
                text = req.prompt or ""
            ids = tok.encode(text)
            strs = [tok.decode([i]) for i in ids] if req.return_token_strs else None
            return self.r._json(
                {
                    "count": len(ids),
                    "max_model_len": self.r.opts.engine.max_model_len,
                    "tokens": ids,
                    "token_strs": strs,
                }
            )

        return await self._answer(request, work)

    async def detokenize(self, request: web.Request) -> web.Response:
        async def work(body: dict[str, Any]) -> web.Response:
            req = V.parse(V.DetokenizeRequest, body)
            self.r.resolve_model(req.model)
            try:
                text = self.r.tokenizer.decode(req.tokens)
            except (KeyError, ValueError, OverflowError) as exc:
                raise V.bad_request(f"Invalid token ids: {exc}") from None
            return self.r._json({"prompt": text})

        return await self._answer(request, work)

    # ---- pooling models ------------------------------------------------------------------------
    async def _vectors(
        self,
        request: web.Request,
        prompts: list[list[int]],
        model: str | None,
        priority: int,
        operation: str,
        normalize: bool = True,
    ) -> tuple[list[list[float]], int, str]:
        lora = self.r.resolve_model(model)
        self._check_input_length(prompts, operation)
        prio = self._priority(request, priority)
        await self._prefill(prompts, lora, prio)
        dim = self.r.serving.embedding_dim
        vectors = [P.embed(ids, self._text(ids), dim, normalize) for ids in prompts]
        return vectors, sum(len(p) for p in prompts), self.r.model_name(lora)

    async def embeddings(self, request: web.Request) -> web.Response:
        async def work(body: dict[str, Any]) -> web.Response:
            req: EmbeddingChatRequest | V.EmbeddingCompletionRequest
            if "messages" in body:
                req = V.parse(EmbeddingChatRequest, body)
                V.check_messages(req.messages)
                prompts = [self.r.tokenizer.encode(proto.render_chat(req.messages))]
            else:
                if "input" not in body:
                    err = {
                        "type": "missing",
                        "loc": ("body", "input"),
                        "msg": "Field required",
                        "input": body,
                    }
                    raise V.schema_error([err])
                req = V.parse(V.EmbeddingCompletionRequest, body)
                prompts = self._tokens(req.input)
            dims = req.dimensions
            if dims is not None and dims < 1:
                raise V.bad_request("Dimensions must be greater than 0")
            vectors, used, model = await self._vectors(
                request, prompts, req.model, req.priority, "embedding generation", req.normalize is not False
            )
            data = [
                {
                    "index": i,
                    "object": "embedding",
                    "embedding": P.encode(P.truncate(v, dims), req.encoding_format),
                }
                for i, v in enumerate(vectors)
            ]
            return self._listing("embd", model, data, used)

        return await self._answer(request, work)

    async def pooling(self, request: web.Request) -> web.Response:
        async def work(body: dict[str, Any]) -> web.Response:
            req = V.parse(V.EmbeddingCompletionRequest, body)
            prompts = self._tokens(req.input)
            vectors, used, model = await self._vectors(
                request, prompts, req.model, req.priority, "embedding generation"
            )
            data = [{"index": i, "object": "pooling", "data": v} for i, v in enumerate(vectors)]
            return self._listing("pool", model, data, used)

        return await self._answer(request, work)

    async def score(self, request: web.Request) -> web.Response:
        async def work(body: dict[str, Any]) -> web.Response:
            req = V.parse(ScoreRequest, body)
            first, second = req.pair()
            try:
                pairs = P.pair_up(len(first), len(second))
            except ValueError as exc:
                raise V.bad_request(str(exc)) from None
            prompts = self._tokens(first) + self._tokens(second)
            vectors, used, model = await self._vectors(request, prompts, req.model, req.priority, "score")
            a, b = vectors[: len(first)], vectors[len(first) :]
            data = [
                {"index": k, "object": "score", "score": P.cosine(a[i], b[j])}
                for k, (i, j) in enumerate(pairs)
            ]
            return self._listing("score", model, data, used)

        return await self._answer(request, work)

    async def rerank(self, request: web.Request) -> web.Response:
        async def work(body: dict[str, Any]) -> web.Response:
            req = V.parse(RerankRequest, body)
            docs = [req.documents] if isinstance(req.documents, str) else req.documents
            prompts = self._tokens(req.query) + self._tokens(docs)
            vectors, used, model = await self._vectors(request, prompts, req.model, req.priority, "score")
            q = vectors[0]
            results: list[dict[str, Any]] = [
                {"index": i, "document": {"text": d}, "relevance_score": P.cosine(q, v)}
                for i, (d, v) in enumerate(zip(docs, vectors[1:], strict=True))
            ]
            results.sort(key=lambda x: x["relevance_score"], reverse=True)
            if req.top_n > 0:
                results = results[: req.top_n]
            return self.r._json(
                {
                    "id": f"rerank-{uuid.uuid4().hex}",
                    "model": model,
                    "usage": {"prompt_tokens": used, "total_tokens": used},
                    "results": results,
                }
            )

        return await self._answer(request, work)


class ScoreRequest(V.Lenient):
    """vLLM's score request union, by field names: queries+documents, queries+items, data_1+data_2, or
    text_1+text_2 (each a string or a list of strings)."""

    model: str | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    priority: int = 0

    def pair(self) -> tuple[list[str], list[str]]:
        for a, b in (
            (self.queries, self.documents),
            (self.queries, self.items),
            (self.data_1, self.data_2),
            (self.text_1, self.text_2),
        ):
            if a is not None and b is not None:
                return ([a] if isinstance(a, str) else a), ([b] if isinstance(b, str) else b)
        raise V.schema_error(
            [
                {
                    "type": "missing",
                    "loc": ("body", "ScoreQueriesDocumentsRequest", "queries"),
                    "msg": "Field required",
                    "input": {},
                }
            ]
        )


class RerankRequest(V.Lenient):
    model: str | None = None
    query: str
    documents: str | list[str]
    top_n: int = 0
    priority: int = 0


def _permission() -> dict[str, Any]:
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": int(time.time()),
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
