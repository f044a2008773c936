"""HTTP front of a simulated replica (aiohttp): the OpenAI endpoints, vLLM/SGLang extras, PD legs, faults.

One `Replica` is one engine with its own port, cache, metrics and request log; `serve` runs several in one
event loop. Streaming output is written once per engine step for all requests that produced tokens (one task
per step, not one wake-up per token). Requests are validated as vLLM validates them (`validation`); the
endpoints beside generation (models, tokenize, LoRA admin, pooling) live in `api`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from aiohttp import ClientSession, ClientTimeout, web

from gateway.prompt.tokens import get_tokenizer
from gateway.sim import protocol as proto
from gateway.sim import structured
from gateway.sim import validation as V
from gateway.sim.api import ApiExtras
from gateway.sim.device import SharedDevice
from gateway.sim.engine import FINISHED, Engine, EngineConfig, RealtimeRunner, Request
from gateway.sim.faults import HEADER as FAULT_HEADER
from gateway.sim.faults import FaultConfig, FaultSpec, FaultSyntaxError
from gateway.sim.kv_events import KVEventPublisher
from gateway.sim.outputs import (
    Plan,
    ResponseEvents,
    ResponseMeta,
    RichChunks,
    called_tool,
    chat_message,
    response_object,
    responses_usage,
)
from gateway.sim.protocol import HTTPError
from gateway.sim.serving_flags import ServingOptions

log = logging.getLogger("gateway.sim")
# A decode replica's KV fetch fails at once when the prefill replica is gone (vLLM recomputed in
# 0.17 s on the H200), but waits without a deadline on one that accepted it and hangs: a stopped
# vLLM prefill replica held the request until its client gave up (results/gpu/2026-12-02-pd).
_KV_FETCH_TIMEOUT = ClientTimeout(total=None, sock_connect=10)
# vLLM's text for a request whose KV could not be loaded (`kv_load_failure_policy: fail`).
_KV_LOAD_FAILED = "Internal server error"

RING_SIZE = 256
_ECHO_HEADERS = ("x-request-id", "x-vllm-priority", FAULT_HEADER, "authorization", "traceparent")
_JSON_ONLY = "Unsupported Media Type: Only 'application/json' is allowed"
VOCAB_SIZE = 128_256  # Llama 3.1's, the model the default profile simulates (what top_logprobs=-1 asks for)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """vLLM's `--enable-request-id-headers` (XRequestIdMiddleware): every answer, errors and GETs
    included, carries the request's X-Request-Id, or a fresh uuid4 hex without one."""
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex


@dataclass
class ReplicaOptions:
    engine: EngineConfig
    model: str
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    speedup: float = 1.0
    max_waiting: int | None = None
    api: str = "vllm"  # or "sglang"
    kv_role: str | None = None  # from --kv-transfer-config: kv_producer | kv_consumer | kv_both
    kv_load_failure_policy: str = "fail"  # --kv-transfer-config's, vLLM's default: recompute | fail
    disaggregation_mode: str | None = None  # SGLang: prefill | decode
    bootstrap_port: int | None = None
    kv_events: dict[str, Any] | None = None
    faults: FaultConfig = field(default_factory=FaultConfig)
    startup_delay_s: float = 0.0
    default_max_tokens: int = 64
    index: int = 0
    single_process_replica: bool = True  # a crash fault exits the process
    serving: ServingOptions = field(default_factory=ServingOptions)
    device: SharedDevice | None = None  # the GPU this replica time-shares with others of this process


class _Response:
    """One HTTP response fed by one or more engine requests (`n` choices per prompt)."""

    __slots__ = (
        "children",
        "cut_after",
        "dirty",
        "done",
        "fmt",
        "include_usage",
        "plan",
        "release",
        "resp",
        "room",
        "sent",
        "stream",
        "writes",
        "writing",
    )

    def __init__(self, stream: bool, plan: Plan) -> None:
        self.stream = stream
        self.plan = plan
        self.children: list[Request] = []
        self.sent: list[int] = []
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.dirty = False
        self.writing = False
        self.writes = 0
        self.cut_after: int | None = None
        self.fmt: proto.ChunkFormat | RichChunks | ResponseEvents | None = None
        self.resp: web.StreamResponse | None = None
        self.include_usage = False
        self.release: dict[str, Any] | None = None  # PD decode: where to release the prefill's blocks
        self.room: int | None = None  # SGLang prefill leg: the bootstrap room its KV is for

    def on_output(self, req: Request) -> None:  # engine callback, once per step per request
        if self.stream:
            self.dirty = True
        elif all(c.state == FINISHED for c in self.children) and not self.done.done():
            self.done.set_result("ok")

    def usage(self) -> dict[str, Any]:
        # vLLM reports the cached tokens of the first output a stream sees, of the last prompt otherwise.
        cached = self.children[0 if self.stream else -1].num_cached
        return proto.usage(self.plan.prompt_tokens, sum(c.num_output for c in self.children), cached)

    async def flush(self) -> None:
        if self.writing or self.done.done() or self.resp is None or self.fmt is None:
            return
        self.writing = True
        fmt = self.fmt
        plan = self.plan
        try:
            while self.dirty:
                self.dirty = False
                parts: list[bytes] = []
                for i, c in enumerate(self.children):
                    start = self.sent[i]
                    end = c.num_output if c.state == FINISHED else plan.held(i, c.num_output)
                    if end > start:
                        fin = plan.finish(c.finish_reason) if c.state == FINISHED else None
                        # A midstream fault counts chunks: then one token per chunk, never coalesced.
                        step = 1 if self.cut_after is not None else end - start
                        for a in range(start, end, step):
                            parts.append(fmt.piece(i, a, a + step, fin if a + step >= end else None))
                        self.sent[i] = end
                finished = all(c.state == FINISHED for c in self.children)
                if self.cut_after is not None and (finished or self.writes + len(parts) >= self.cut_after):
                    # Cut before [DONE] even when the output was shorter than N chunks.
                    parts = parts[: max(self.cut_after - self.writes, 0)]
                    if parts:
                        await self.resp.write(b"".join(parts))
                    self.done.set_result("cut")
                    return
                if finished:
                    if isinstance(fmt, ResponseEvents):
                        c0 = self.children[0]
                        parts.append(
                            fmt.closing(c0, responses_usage(plan.prompt_tokens, c0.num_output, c0.num_cached))
                        )
                    else:
                        if self.include_usage:
                            parts.append(fmt.usage_chunk(self.usage()))
                        parts.append(proto.DONE)
                self.writes += len(parts)
                await self.resp.write(b"".join(parts))
                if finished:
                    self.done.set_result("ok")
                    return
        except (ConnectionError, RuntimeError) as exc:
            if not self.done.done():
                self.done.set_result(f"disconnected: {exc.__class__.__name__}")
        finally:
            self.writing = False


class Replica:
    def __init__(self, opts: ReplicaOptions) -> None:
        self.opts = opts
        self.sglang = opts.api == "sglang"
        self.serving = opts.serving
        if self.serving.lora.enabled and opts.engine.lora is None:
            opts.engine.lora = self.serving.lora
        self.engine = Engine(opts.engine)
        self.runner = RealtimeRunner(self.engine, opts.speedup, device=opts.device)
        self.engine.on_output = self._on_output
        self.engine.on_step = self._on_step
        self.tokenizer = get_tokenizer()
        self.engine_id = f"sim-{uuid.uuid4().hex[:12]}"
        self.requests: deque[dict[str, Any]] = deque(maxlen=RING_SIZE)
        self.rooms: OrderedDict[int, asyncio.Future[int]] = OrderedDict()  # SGLang bootstrap rooms
        self.lease_stalls: OrderedDict[str, float] = OrderedDict()  # the `lease_stall` fault, by request
        self.kv_pub: KVEventPublisher | None = None
        self.started_at = 0.0
        self.crashed = False
        self.port = opts.port
        self.bootstrap_port = opts.bootstrap_port
        self._web: web.AppRunner | None = None
        self._sites: list[web.TCPSite] = []
        self._http: ClientSession | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.extras = ApiExtras(self)
        self.app = self._build_app()

    # ---- lifecycle -----------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        x = self.extras
        # Like vLLM, which registers routes by the model's tasks: a pooling model has no generation routes
        # and a generative one no pooling routes (404 either way).
        if self.serving.runner == "pooling":
            r.add_post("/v1/embeddings", x.embeddings)
            r.add_post("/pooling", x.pooling)
            for path in ("/score", "/v1/score"):
                r.add_post(path, x.score)
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                r.add_post(path, x.rerank)
        else:
            r.add_post("/v1/chat/completions", self.chat_completions)
            r.add_post("/v1/completions", self.completions)
            r.add_post("/v1/responses", self.responses)
        r.add_get("/health", self.health)
        r.add_get("/v1/models", x.models)
        r.add_post("/tokenize", x.tokenize)
        r.add_post("/detokenize", x.detokenize)
        if self.serving.lora.runtime_updating:
            r.add_post("/v1/load_lora_adapter", x.load_lora_adapter)
            r.add_post("/v1/unload_lora_adapter", x.unload_lora_adapter)
        r.add_get("/metrics", self.metrics)
        r.add_get("/sim/state", self.sim_state)
        r.add_get("/sim/requests", self.sim_requests)
        r.add_post("/sim/kv_events/faults", self.kv_event_faults)
        r.add_post("/sim/pd/release", self.pd_release)
        r.add_post("/sim/pd/lease", self.pd_lease)
        r.add_get("/sim/bootstrap/{room}", self.bootstrap_wait)
        for path in ("/sim/flush_cache", "/reset_prefix_cache", "/flush_cache"):
            r.add_post(path, self.flush_cache)
        if self.sglang:
            r.add_get("/v1/loads", self.loads)
            r.add_get("/get_load", self.loads)
            r.add_get("/health_generate", self.health)
            r.add_get("/server_info", self.sim_state)
        r.add_route("*", "/{tail:.*}", self.not_found)  # last: only what nothing else matched
        if self.serving.request_id_headers:
            app.on_response_prepare.append(_echo_request_id)
        return app

    async def start(self) -> None:
        o = self.opts
        self.extras.load_static_adapters()
        if o.kv_events is not None:
            self.kv_pub = KVEventPublisher.from_config(o.kv_events, self.engine.block_size, o.index, o.api)
            self.kv_pub.set_faults(o.faults.seed, o.faults.kv_drop_rate, o.faults.kv_reorder_rate)
            if self.kv_pub.replay_endpoint is not None:
                self._spawn(self.kv_pub.serve_replay())
            self.engine.pool.record_events = True
            if self.engine.cpu is not None:
                self.engine.cpu.record_events = True
        self._web = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._web.setup()
        ports = [(o.port, "port")]
        if o.bootstrap_port is not None:
            ports.append((o.bootstrap_port, "bootstrap_port"))
        for port, attr in ports:
            site = web.TCPSite(self._web, o.host, port, reuse_address=True)
            await site.start()
            self._sites.append(site)
            # Typed an AbstractServer; asyncio's and uvloop's servers (no common class) list their sockets.
            sockets = getattr(site._server, "sockets", None) or ()
            bound = sockets[0].getsockname()[1] if sockets else port
            setattr(self, attr, bound)
        self.started_at = time.monotonic()
        self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        for t in list(self._bg):
            t.cancel()
        if self._http is not None:
            await self._http.close()
        if self._web is not None:
            await self._web.cleanup()
        if self.kv_pub is not None:
            self.kv_pub.close()

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def _client(self) -> ClientSession:
        if self._http is None:
            self._http = ClientSession(timeout=ClientTimeout(total=None, sock_connect=5))
        return self._http

    # ---- engine callbacks ----------------------------------------------------------------------
    def _on_output(self, outputs: list[Request]) -> None:
        streams: list[_Response] = []
        for req in outputs:
            sink = req.sink
            if sink is None:
                continue
            sink.on_output(req)
            if isinstance(sink, _Response):
                if sink.stream and not sink.writing:
                    streams.append(sink)
                if req.num_output == 1 and sink.release is not None:
                    self._spawn(self._release_remote(sink.release))
                    sink.release = None
                if req.num_output == 1 and sink.room is not None:
                    self._resolve_room(sink.room, req.prompt_len)
        if streams:
            self._spawn(self._flush(streams))

    @staticmethod
    async def _flush(streams: list[_Response]) -> None:
        seen: set[int] = set()
        for s in streams:
            if id(s) not in seen:
                seen.add(id(s))
                await s.flush()

    def _on_step(self) -> None:
        if self.kv_pub is not None:
            events = self.engine.pool.take_events()
            if self.engine.cpu is not None:  # the connector's events follow the scheduler's, as in vLLM
                events += self.engine.cpu.take_events()
            self.kv_pub.publish(events)

    # ---- helpers -------------------------------------------------------------------------------
    def _error(
        self, status: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> web.Response:
        body = proto.error_body(status, message, flat=self.sglang, param=param, err_type=err_type)
        return web.json_response(body, status=status, dumps=lambda o: orjson.dumps(o).decode())

    def error_response(self, exc: HTTPError) -> web.Response:
        return self._error(exc.status, str(exc), exc.param, exc.err_type)

    def _starting(self) -> bool:
        return time.monotonic() - self.started_at < self.opts.startup_delay_s

    def _json(self, obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(
            body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers
        )

    async def not_found(self, request: web.Request) -> web.Response:
        """FastAPI's answer to a path it has no route for (vLLM's exception handlers leave it alone)."""
        return self._json({"detail": "Not Found"}, status=404)

    async def read_json(self, request: web.Request) -> dict[str, Any]:
        """The body of a JSON endpoint, refused as vLLM refuses it: another media type, bad JSON, or JSON
        that is not an object."""
        if request.content_type != "application/json" and not self.sglang:  # SGLang reads any body
            raise V.schema_error([_JSON_ONLY])
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            err = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
            raise V.schema_error([{**err, "ctx": {"error": exc.msg}}]) from None
        if not isinstance(body, dict):
            cls = _REQUEST_CLASS.get(request.path, "ChatCompletionRequest")
            err = {
                "type": "model_type",
                "loc": ("body",),
                "msg": f"Input should be a valid dictionary or instance of {cls}",
            }
            raise V.schema_error([{**err, "input": body, "ctx": {"class_name": cls}}])
        return body

    def resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model; 404 otherwise."""
        if name is None or name in self.opts.served_model_names:
            return None
        if name in self.extras.adapters:
            return name
        raise HTTPError(404, f"The model `{name}` does not exist.", "model", "NotFoundError")

    def model_name(self, lora: str | None) -> str:
        """What responses call the model: the adapter, else the first served name (whichever alias the
        request used), as vLLM's OpenAIServingModels.model_name does."""
        return lora or self.opts.served_model_names[0]

    def context_limit(self) -> int:
        ec = self.opts.engine
        limit = min(ec.max_model_len, self.engine.pool.num_blocks * self.engine.block_size)
        if not ec.enable_chunked_prefill:
            limit = min(limit, ec.max_num_batched_tokens)  # a prompt must fit one step's budget
        return limit

    async def _crash(self) -> None:
        self.crashed = True
        if self.opts.single_process_replica:
            log.error("x-sim-fault crash: exiting")
            os._exit(17)
        log.error("x-sim-fault crash: replica on port %s goes down", self.port)
        await self.runner.stop()
        for site in self._sites:
            await site.stop()
        server = self._web.server if self._web else None
        for conn in list(server.connections if server else []):
            transport = conn.transport
            if transport is not None:
                transport.abort()

    # ---- generation ----------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    def _record(self, request: web.Request, body: dict[str, Any], rid: str) -> None:
        self.requests.append(
            {
                "request_id": rid,
                "path": request.path,
                "received_at": time.time(),
                "headers": {h: request.headers[h] for h in _ECHO_HEADERS if h in request.headers},
                "body_keys": sorted(body),
                "body": body,
                "kv_transfer_params": body.get("kv_transfer_params"),
                "bootstrap": {
                    k: body[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if k in body
                },
            }
        )

    def _check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """vLLM's TokenizeParams checks; returns the context limit."""
        limit = self.context_limit()
        if max_tokens is not None and max_tokens > limit:
            raise V.bad_request(
                f"{param}={max_tokens} cannot be greater than max_model_len=max_total_tokens={limit}. "
                "Please request fewer output tokens.",
                param,
                max_tokens,
            )
        out = max(max_tokens or 0, 0)
        if prompt_len > limit - out or prompt_len >= limit:
            raise V.bad_request(
                f"You passed {prompt_len} input tokens and requested {out} output tokens. However, the "
                f"model's context length is only {limit} tokens, resulting in a maximum input length of "
                f"{limit - out} tokens. Please reduce the length of the input prompt.",
                "input_tokens",
                prompt_len,
            )
        return limit

    def _check_sampling(self, req: Any, max_tokens: int | None, n: int) -> None:
        """SamplingParams._verify_args, in its order, for the parameters the simulator reads."""
        if n < 1:
            raise V.bad_request(f"n must be at least 1, got {n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(req, name, None)
            if v is not None and not -2.0 <= v <= 2.0:
                raise V.bad_request(f"{name} must be in [-2, 2], got {v}.")
        t = req.temperature
        if t is not None:
            if not math.isfinite(t):
                raise V.bad_request(f"temperature must be a finite number, got {t}.", "temperature", t)
            if t < 0.0:
                raise V.bad_request(f"temperature must be non-negative, got {t}.", "temperature", t)
            if t > 2.0:
                raise V.bad_request(f"temperature must be in [0, 2], got {t}.", "temperature", t)
        if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
            raise V.bad_request(f"top_p must be in (0, 1], got {req.top_p}.", "top_p", req.top_p)
        if max_tokens is not None and max_tokens < 1:
            raise V.bad_request(f"max_tokens must be at least 1, got {max_tokens}.")

    def _check_logprobs(self, k: int | None) -> None:
        if k is None:
            return
        cap = self.serving.max_logprobs
        asked = VOCAB_SIZE if k == -1 else k  # -1: the whole vocabulary
        if cap != -1 and asked > cap:
            raise V.bad_request(
                f"Requested sample logprobs of {asked}, which is greater than max allowed: {cap}",
                "logprobs",
                asked,
            )

    def _priority(self, request: web.Request, prio_field: int) -> int:
        raw = request.headers.get("x-vllm-priority", prio_field)
        try:
            prio = int(raw or 0)
        except (TypeError, ValueError):
            raise V.bad_request("priority must be an integer", "priority") from None
        if prio and self.opts.engine.scheduling_policy != "priority" and not self.sglang:
            raise V.bad_request(f"Got priority {prio} but Priority scheduling is not enabled.")
        return prio

    def _check_tools(self, req: V.ChatCompletionRequest) -> None:
        """vLLM refuses tool choices its configuration cannot parse (render_chat_request)."""
        choice = req.tool_choice
        if self.sglang or choice in (None, "none") or self.serving.tool_call_parser:
            return
        if choice == "auto":
            if not self.serving.enable_auto_tool_choice:
                raise V.bad_request(
                    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
                )
            return
        shown = (
            f'function "{choice.function.name}"' if isinstance(choice, V.NamedToolChoice) else f'"{choice}"'
        )
        raise V.bad_request(f"tool_choice={shown} requires --tool-call-parser to be set")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        rid = request.headers.get("x-request-id") or ""
        try:
            if self.crashed or self._starting():
                raise HTTPError(503, "engine is starting up" if not self.crashed else "engine is dead")
            spec = FaultSpec.parse(request.headers[FAULT_HEADER]) if FAULT_HEADER in request.headers else None
            drawn = self.opts.faults.draw()
            if spec is None:
                spec = drawn
            if spec.crash or drawn.crash:
                await self._crash()
                raise HTTPError(503, "engine crashed")
            if spec.stall_s:
                await asyncio.sleep(spec.stall_s)
            if spec.status:
                raise HTTPError(spec.status, f"injected fault: status {spec.status}")
            body = await self.read_json(request)
            rid = rid or str(body.get("request_id") or uuid.uuid4().hex)
            self._record(request, body, rid)
            return await self._serve(request, body, kind, rid, spec)
        except FaultSyntaxError as exc:
            return self._error(400, str(exc), FAULT_HEADER)
        except HTTPError as exc:
            resp = self.error_response(exc)
            if exc.status in (429, 503):
                resp.headers["Retry-After"] = "1"
            return resp

    def _prompts(self, kind: str, req: Any, body: dict[str, Any]) -> list[list[int]]:
        """The token ids of each prompt (several only for a batched completion)."""
        enc = self.tokenizer.encode
        if kind == "chat":
            if not req.messages:
                # The chat template reads messages[0]; jinja's error becomes vLLM's 400.
                raise HTTPError(400, "list object has no element 0", None, "BadRequestError")
            text = proto.render_chat(  # the tools as sent
                req.messages, body.get("tools"), req.add_generation_prompt, req.continue_final_message
            )
            return [enc(text)]
        if kind == "responses":
            return [enc(proto.render_chat(responses_messages(req.instructions, req.input)))]
        prompt = req.prompt
        if isinstance(prompt, str):
            return [enc(prompt)]
        if not prompt:
            raise V.bad_request("please provide at least one prompt")
        if isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = [enc(p) if isinstance(p, str) else p for p in prompt]
        if any(not p for p in prompts):
            raise V.bad_request("The decoder prompt cannot be empty")
        return prompts

    def _plan(self, kind: str, req: Any, lora: str | None) -> tuple[Plan, Any]:
        """What the choices will say: the forced tool (and its parameters' schema), or a structured output
        format, and logprobs. Returns the plan and the schema source for scripted outputs (or None)."""
        plan = Plan(kind, self.model_name(lora))
        source: Any = None
        if kind == "chat":
            if req.logprobs:
                plan.logprobs = req.top_logprobs or 0
            choice = req.tool_choice
            if req.tools and (isinstance(choice, V.NamedToolChoice) or choice == "required"):
                name = (
                    choice.function.name
                    if isinstance(choice, V.NamedToolChoice)
                    else req.tools[0].function.name
                )
                tool = next(t for t in req.tools if t.function.name == name)
                plan.tool, plan.tool_required = name, choice == "required"
                return plan, ("schema", tool.function.parameters or {"type": "object"})
            if req.tools and choice == "auto" and not self.sglang:
                called = called_tool(req.messages, req.tools)
                if called is not None:
                    plan.tool, plan.tool_auto = called.function.name, True
                    return plan, ("schema", called.function.parameters or {"type": "object"})
        elif kind == "completion" and req.logprobs is not None:
            plan.logprobs = req.logprobs
        rf = getattr(req, "response_format", None)
        if rf is not None and rf.type == "json_object":
            source = ("object", None)
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            source = ("schema", rf.json_schema.json_schema or {})
        return plan, source

    async def _serve(
        self,
        request: web.Request,
        body: dict[str, Any],
        kind: str,
        rid: str,
        spec: FaultSpec,
    ) -> web.StreamResponse:
        o = self.opts
        if kind == "chat":
            req: Any = V.check_chat(body)
            max_tokens = (
                req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            )
            mt_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        elif kind == "completion":
            req = V.check_completion(body)
            # Without max_tokens the simulator ends the output naturally (--default-max-tokens).
            max_tokens, mt_param = (
                (req.max_tokens if body.get("max_tokens") is not None else None),
                "max_tokens",
            )
        else:
            req = V.parse(V.ResponsesRequest, body)
            max_tokens, mt_param = req.max_output_tokens, "max_output_tokens"
        lora = self.resolve_model(req.model)
        if kind == "responses" and req.previous_response_id:
            # The simulator stores no responses (vLLM: only with VLLM_ENABLE_RESPONSES_API_STORE).
            raise HTTPError(
                404, f"Response with id '{req.previous_response_id}' not found.", None, "NotFoundError"
            )
        if kind == "chat":
            self._check_tools(req)
        prompts = self._prompts(kind, req, body)
        for ids in prompts:
            limit = self._check_length(len(ids), max_tokens, mt_param)
        n = 1 if kind == "responses" or req.n is None else req.n
        self._check_sampling(req, max_tokens, n)
        plan, source = self._plan(kind, req, lora)
        self._check_logprobs(plan.logprobs)
        priority = self._priority(request, req.priority)
        stream = bool(req.stream)
        if o.max_waiting is not None and self.engine.num_waiting >= o.max_waiting:
            raise HTTPError(429, f"engine overloaded: {self.engine.num_waiting} requests waiting")

        out = _Response(stream, plan)
        remote_kv = kv_lease = False
        fetch: dict[str, Any] | None = None  # a decode leg's kv_transfer_params: the KV to load
        ktp = body.get("kv_transfer_params") if o.kv_role else None
        if isinstance(ktp, dict):
            if ktp.get("do_remote_decode"):
                kv_lease, max_tokens, n = True, 1, 1
            elif ktp.get("remote_block_ids"):
                fetch = ktp
        if fetch is not None and not stream:
            # vLLM answers a non-streamed request once it is done; a streamed one gets its head
            # first and waits for the KV after it (below).
            remote_kv = await self._remote_kv_reachable(fetch)
            if remote_kv:
                out.release = fetch
            elif o.kv_load_failure_policy == "fail":
                return self._error(500, _KV_LOAD_FAILED, err_type="InternalServerError")
        room = body.get("bootstrap_room")
        if isinstance(room, list):
            room = room[0] if room else None
        if o.disaggregation_mode == "prefill" and room is not None:
            max_tokens, n = 1, 1
            out.room = int(room)
        elif o.disaggregation_mode == "decode" and room is not None and body.get("bootstrap_host"):
            await self._await_bootstrap(str(body["bootstrap_host"]), body.get("bootstrap_port"), int(room))
            remote_kv = True

        seed = req.seed if isinstance(getattr(req, "seed", None), int) else None
        stop = getattr(req, "stop", None)
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        salt = req.cache_salt
        bs = self.engine.block_size
        vocab_ids = proto.vocab_token_ids() is not None
        for ids in prompts:
            plan.prompt_tokens += len(ids)
            room_left = limit - len(ids)
            for i in range(n):
                seed_i = proto.output_seed(ids, i, seed)
                script = None if source is None else _script(source, seed_i)
                plan.add_choice(seed_i, script)
                natural = max_tokens is None
                output_ids: Callable[[int, int], list[int]] | None
                if script is not None:
                    cap = min(max_tokens if max_tokens is not None else room_left, room_left)
                    natural = len(script) <= cap
                    mt = min(len(script), cap)
                    output_ids = partial(_slice, script.ids)
                else:
                    mt = max_tokens if max_tokens is not None else min(o.default_max_tokens, room_left)
                    output_ids = partial(proto.output_token_ids, seed_i) if vocab_ids else None
                    if stops and mt:
                        stopped = plan.stop_at(len(plan.seeds) - 1, stops, mt)
                        natural = natural or plan.stop_reason(len(plan.seeds) - 1) is not None
                        mt = stopped
                k = len(out.children)
                child = Request(
                    rid if len(prompts) * n == 1 else f"{rid}-{k}",
                    ids,
                    mt,
                    priority=priority,
                    cache_salt=salt,
                    block_size=bs,
                    remote_kv=remote_kv,
                    kv_lease=kv_lease,
                    sink=out,
                    output_ids=output_ids,
                    lora=lora,
                )
                if natural:
                    child.finish_reason = "stop"  # a natural end, as an unbounded request would have
                out.children.append(child)
                out.sent.append(0)
        if kv_lease and spec.lease_stall_s:
            for c in out.children:
                self.lease_stalls[c.id] = spec.lease_stall_s
            while len(self.lease_stalls) > 4096:
                self.lease_stalls.popitem(last=False)
        created = proto.now_s()
        prefix = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_"}[kind]
        resp_id = prefix + rid
        try:
            if stream:
                so = getattr(req, "stream_options", None)
                out.include_usage = bool(so and so.include_usage)
                out.cut_after = spec.midstream
                opening = b""
                if kind == "responses":
                    events = ResponseEvents(plan, _response_meta(req, resp_id, rid, created, plan.model))
                    opening = events.opening()
                    out.fmt = events
                elif plan.rich:
                    out.fmt = RichChunks(plan, resp_id, created)
                else:
                    out.fmt = proto.ChunkFormat(kind == "chat", resp_id, plan.model, created, plan.seeds)
                resp = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await resp.prepare(request)
                if fetch is not None:
                    if await self._remote_kv_reachable(fetch):
                        out.release = fetch
                        for c in out.children:
                            c.remote_kv = True
                    elif o.kv_load_failure_policy == "fail":
                        # vLLM's `fail` policy: the request ends with finish reason `error`, an
                        # error event in the begun 200 stream.
                        error = proto.error_body(500, _KV_LOAD_FAILED, err_type="InternalServerError")
                        await resp.write(b"data: " + orjson.dumps(error) + b"\n\n" + proto.DONE)
                        return resp
                if opening:
                    await resp.write(opening)
                out.resp = resp
                for c in out.children:
                    self.runner.submit(c)
                if await out.done == "cut" and request.transport is not None:
                    request.transport.abort()  # no [DONE], no chunked terminator: a broken stream
                return resp
            for c in out.children:
                self.runner.submit(c)
            await out.done
            if kind == "responses":
                result = self._responses_body(out, req, resp_id, rid, created)
            else:
                result = self._full_body(out, resp_id, created, kv_lease)
            return self._json(result)
        finally:
            if any(c.state != FINISHED for c in out.children):
                for c in out.children:
                    self.engine.abort(c)  # frees the blocks of a gone client
                self.runner.wake()

    def _full_body(self, out: _Response, resp_id: str, created: int, kv_lease: bool) -> dict[str, Any]:
        plan = out.plan
        chat = plan.kind == "chat"
        choices = []
        for i, c in enumerate(out.children):
            choice: dict[str, Any] = {"index": i}
            if chat:
                choice["message"] = chat_message(plan, i, c.num_output)
                choice["logprobs"] = plan.chat_logprobs(i, 0, c.num_output)
            else:
                choice["text"] = plan.text(i, 0, c.num_output)
                choice["logprobs"] = plan.completion_logprobs(i, 0, c.num_output, 0)
            choice.update(finish_reason=plan.finish(c.finish_reason), stop_reason=plan.stop_reason(i))
            choices.append(choice)
        result: dict[str, Any] = {
            "id": resp_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": plan.model,
            "choices": choices,
            "usage": out.usage(),
        }
        c0 = out.children[0]
        if kv_lease:
            o = self.opts
            result["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": list(c0.blocks),
                "remote_engine_id": self.engine_id,
                "remote_request_id": c0.id,
                # vLLM advertises VLLM_NIXL_SIDE_CHANNEL_HOST; a wildcard bind address is not reachable.
                "remote_host": os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
                or (o.host if o.host not in ("0.0.0.0", "::", "") else "127.0.0.1"),
                "remote_port": self.port,
                "tp_size": self.engine.cost.tp,
            }
        else:
            result["kv_transfer_params"] = None
        return result

    def _responses_body(
        self, out: _Response, req: Any, resp_id: str, rid: str, created: int
    ) -> dict[str, Any]:
        c0 = out.children[0]
        meta = _response_meta(req, resp_id, rid, created, out.plan.model)
        usage = responses_usage(out.plan.prompt_tokens, c0.num_output, c0.num_cached)
        text = out.plan.text(0, 0, c0.num_output)
        incomplete = c0.finish_reason == "length"
        return response_object(meta, "incomplete" if incomplete else "completed", text, usage, incomplete)

    # ---- PD ------------------------------------------------------------------------------------
    async def _release_remote(self, ktp: dict[str, Any]) -> None:
        url = f"http://{ktp['remote_host']}:{ktp['remote_port']}/sim/pd/release"
        try:
            async with self._client().post(url, json={"remote_request_id": ktp["remote_request_id"]}) as r:
                await r.read()
        except Exception as exc:  # the lease times out on the prefill side anyway
            log.warning("could not release remote KV blocks at %s: %s", url, exc)

    async def _remote_kv_reachable(self, ktp: dict[str, Any]) -> bool:
        """Whether the prefill replica named in `kv_transfer_params` still holds the prompt's
        blocks: a vLLM decode replica pulls them over NIXL and fails the load when it cannot."""
        host, port, rid = ktp.get("remote_host"), ktp.get("remote_port"), ktp.get("remote_request_id")
        if not (host and port and rid):
            return True  # nothing names a lease to check (a hand-crafted body): take the blocks as sent
        url = f"http://{host}:{port}/sim/pd/lease"
        try:
            async with self._client().post(
                url, json={"remote_request_id": rid}, timeout=_KV_FETCH_TIMEOUT
            ) as r:
                return r.status == 200 and bool((await r.json()).get("held"))
        except (OSError, TimeoutError, ValueError) as exc:
            log.warning("KV load from %s failed: %s", url, exc)
            return False

    async def pd_lease(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        rid = str(body.get("remote_request_id"))
        stall = self.lease_stalls.pop(rid, 0.0)
        if stall:
            await asyncio.sleep(stall)
        return self._json({"held": rid in self.engine.leased})

    async def pd_release(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        released = self.engine.release_lease(str(body.get("remote_request_id")))
        self.runner.wake()
        return self._json({"released": released})

    def _room(self, room: int) -> asyncio.Future[int]:
        fut = self.rooms.get(room)
        if fut is None:
            fut = self.rooms[room] = asyncio.get_running_loop().create_future()
            while len(self.rooms) > 4096:
                self.rooms.popitem(last=False)
        return fut

    def _resolve_room(self, room: int, prompt_len: int) -> None:
        fut = self._room(room)
        if not fut.done():
            fut.set_result(prompt_len)

    async def bootstrap_wait(self, request: web.Request) -> web.Response:
        """Decode side's long poll: returns once this prefill replica finished `room`'s prefill."""
        room = int(request.match_info["room"])
        timeout = float(request.query.get("timeout", "60"))
        try:
            n = await asyncio.wait_for(asyncio.shield(self._room(room)), timeout)
        except TimeoutError:
            return self._error(504, f"bootstrap room {room} not prefilled within {timeout}s")
        self.rooms.pop(room, None)
        return self._json({"room": room, "prompt_tokens": n})

    async def _await_bootstrap(self, host: str, port: Any, room: int) -> None:
        url = f"http://{host}:{port}/sim/bootstrap/{room}"
        try:
            async with self._client().get(url, params={"timeout": "60"}) as r:
                if r.status != 200:
                    raise HTTPError(500, f"KV transfer from {host}:{port} failed: {r.status}")
                await r.read()
        except OSError as exc:
            raise HTTPError(500, f"KV transfer from {host}:{port} failed: {exc}") from None

    # ---- other endpoints -----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.crashed or self._starting():
            return web.Response(status=503)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.engine.pool.reset_cache()
        # As vLLM's: the connector's (CPU) cache only with `?reset_external=true`.
        if ok and self.engine.cpu is not None and request.query.get("reset_external") == "true":
            self.engine.cpu.clear()
        self._on_step()
        return self._json({"success": ok}, status=200 if ok else 409)

    async def sim_state(self, request: web.Request) -> web.Response:
        o = self.opts
        state = self.engine.state()
        state.update(
            engine_id=self.engine_id,
            api=o.api,
            port=self.port,
            kv_role=o.kv_role,
            disaggregation_mode=o.disaggregation_mode,
            bootstrap_port=self.bootstrap_port,
            profile=o.engine.profile.name,
            profile_source=o.engine.profile.source,
            speedup=o.speedup,
            lag_events=self.runner.lag_events,
            step_timer_lag=self.runner.lag_summary(),
            kv_events_endpoint=self.kv_pub.endpoint if self.kv_pub else None,
            recent=[
                {k: r[k] for k in ("request_id", "path", "kv_transfer_params", "bootstrap", "body_keys")}
                for r in list(self.requests)[-16:]
            ],
        )
        return self._json(state)

    async def kv_event_faults(self, request: web.Request) -> web.Response:
        """`{"drop": N, "reorder": M}`: the next N KV event batches are not sent (numbered and kept for
        replay all the same), then the next M are each sent after the batch that follows them."""
        pub = self.kv_pub
        if pub is None:
            return self._error(404, "this replica publishes no KV events (--kv-events-config)")
        try:
            doc = await request.json()
            drop, reorder = int(doc.get("drop", 0)), int(doc.get("reorder", 0))
        except (ValueError, TypeError, AttributeError):
            return self._error(400, 'expected {"drop": N, "reorder": M}')
        if drop < 0 or reorder < 0:
            return self._error(400, "drop and reorder are counts (>= 0)")
        pub.drop_next += drop
        pub.reorder_next += reorder
        return self._json({"next_seq": pub.next_seq, "dropped": pub.dropped, "reordered": pub.reordered})

    async def sim_requests(self, request: web.Request) -> web.Response:
        last = int(request.query.get("last", "16"))
        items = list(self.requests)[-last:] if last > 0 else []
        return self._json(items)

    def _load(self) -> dict[str, Any]:
        e = self.engine
        m = e.metrics
        used = e.pool.num_used * e.block_size
        return {
            "dp_rank": 0,
            "num_running_reqs": len(e.running),
            "num_waiting_reqs": e.num_waiting,
            "num_used_tokens": used,
            "max_total_num_tokens": e.pool.num_blocks * e.block_size,
            "token_usage": e.pool.usage,
            "cache_hit_rate": m.prefix_cache_hits / m.prefix_cache_queries if m.prefix_cache_queries else 0.0,
        }

    async def loads(self, request: web.Request) -> web.Response:
        return self._json({"timestamp": time.time(), "dp_rank_count": 1, "loads": [self._load()]})

    async def metrics(self, request: web.Request) -> web.Response:
        text = self._sglang_metrics() if self.sglang else self._vllm_metrics()
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def _vllm_metrics(self) -> str:
        e = self.engine
        m = e.metrics
        # Every replica is its own server with one engine, as separate vLLM processes would be.
        lbl = f'engine="0",model_name="{self.opts.served_model_names[0]}"'
        lines: list[str] = []

        def one(name: str, kind: str, value: float) -> None:
            base = name[: -len("_total")] if kind == "counter" else name
            lines.append(f"# TYPE {base} {kind}")
            lines.append(f"{name}{{{lbl}}} {value}")

        one("vllm:num_requests_running", "gauge", len(e.running))
        one("vllm:num_requests_waiting", "gauge", e.num_waiting)
        one("vllm:kv_cache_usage_perc", "gauge", e.pool.usage)
        one("vllm:prefix_cache_queries_total", "counter", m.prefix_cache_queries)
        one("vllm:prefix_cache_hits_total", "counter", m.prefix_cache_hits)
        # Always, as vLLM's PrometheusStatLogger registers them (0 without a KV connector).
        one("vllm:external_prefix_cache_queries_total", "counter", m.external_prefix_cache_queries)
        one("vllm:external_prefix_cache_hits_total", "counter", m.external_prefix_cache_hits)
        if self.opts.kv_role is not None:
            lines += m.kv_transfer_time.render("vllm:nixl_xfer_time_seconds", lbl)
        if (cpu := e.cpu) is not None:  # the OffloadingConnector's (vllm/v1/kv_offload/cpu/common.py, ...)
            one("vllm:kv_offload_load_bytes_total", "counter", cpu.load_size.sum)
            one("vllm:kv_offload_store_bytes_total", "counter", cpu.store_size.sum)
            lines += cpu.load_size.render("vllm:kv_offload_load_size", lbl)
            lines += cpu.store_size.render("vllm:kv_offload_store_size", lbl)
            one("vllm:kv_offload_allocation_failure_total", "counter", cpu.allocation_failures)
            one("vllm:kv_offload_cpu_cache_usage_perc", "gauge", 0.0)  # blocks pinned by transfers in flight
        one("vllm:prompt_tokens_total", "counter", m.prompt_tokens)
        one("vllm:generation_tokens_total", "counter", m.generation_tokens)
        one("vllm:num_preemptions_total", "counter", m.num_preemptions)
        lines += m.ttft.render("vllm:time_to_first_token_seconds", lbl)
        lines += m.itl.render("vllm:inter_token_latency_seconds", lbl)
        lines += m.e2e.render("vllm:e2e_request_latency_seconds", lbl)
        lines += m.queue_time.render("vllm:request_queue_time_seconds", lbl)
        lines += m.prefill_time.render("vllm:request_prefill_time_seconds", lbl)
        lines += m.decode_time.render("vllm:request_decode_time_seconds", lbl)
        lines.append("# TYPE vllm:cache_config_info gauge")
        lines.append(
            f'vllm:cache_config_info{{block_size="{e.block_size}",num_gpu_blocks="{e.pool.num_blocks}",'
            f'cache_dtype="{self.opts.engine.kv_cache_dtype}",'
            # str() of vLLM's CacheConfig fields, "None" when unset
            f'kv_cache_memory_bytes="{self.opts.engine.kv_cache_memory_bytes}",'
            f'kv_offloading_size="{self.opts.engine.kv_offloading_size}",'
            f'kv_offloading_backend="native",{lbl}}} 1.0'
        )
        slots = e.lora_slots
        if slots is not None:
            # vLLM's LoRA gauge: adapters of running and waiting requests, valued by the time of the update.
            waiting = sorted({r.lora for r in e.waiting.requests() if r.lora is not None})
            lines.append("# TYPE vllm:lora_requests_info gauge")
            lines.append(
                f'vllm:lora_requests_info{{max_lora="{slots.max_loras}",'
                f'running_lora_adapters="{",".join(sorted(e.lora_running))}",'
                f'waiting_lora_adapters="{",".join(waiting)}"}} {time.time()}'
            )
        return "\n".join(lines) + "\n"

    def _sglang_metrics(self) -> str:
        e = self.engine
        m = e.metrics
        load = self._load()
        lbl = f'model_name="{self.opts.served_model_names[0]}"'
        lines: list[str] = []
        for name, value in (
            ("sglang:num_running_reqs", load["num_running_reqs"]),
            ("sglang:num_queue_reqs", load["num_waiting_reqs"]),
            ("sglang:token_usage", load["token_usage"]),
            ("sglang:cache_hit_rate", load["cache_hit_rate"]),
            ("sglang:num_used_tokens", load["num_used_tokens"]),
            ("sglang:max_total_num_tokens", load["max_total_num_tokens"]),
        ):
            lines += [f"# TYPE {name} gauge", f"{name}{{{lbl}}} {value}"]
        for name, value in (
            ("sglang:prompt_tokens_total", m.prompt_tokens),
            ("sglang:generation_tokens_total", m.generation_tokens),
            ("sglang:cached_tokens_total", m.prefix_cache_hits),
        ):
            lines += [f"# TYPE {name[:-6]} counter", f"{name}{{{lbl}}} {value}"]
        lines += m.ttft.render("sglang:time_to_first_token_seconds", lbl)
        lines += m.e2e.render("sglang:e2e_request_latency_seconds", lbl)
        return "\n".join(lines) + "\n"


_REQUEST_CLASS = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/responses": "ResponsesRequest",
    "/v1/embeddings": "EmbeddingCompletionRequest",
    "/tokenize": "TokenizeCompletionRequest",
    "/detokenize": "DetokenizeRequest",
}


def _slice(ids: list[int], start: int, end: int) -> list[int]:
    return ids[start:end]


def _script(source: tuple[str, Any], seed: int) -> structured.Script:
    kind, schema = source
    value = structured.json_object(seed) if kind == "object" else structured.from_schema(schema, seed)
    return structured.script(value)


def responses_messages(instructions: str | None, items: str | list[Any]) -> list[dict[str, Any]]:
    """The Responses API's input as chat messages: instructions first, then each message item (other
    items, such as function call outputs, as tool messages)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*msgs, {"role": "user", "content": items}]
    for item in items:
        if not isinstance(item, dict):
            continue
        if item.get("type", "message") == "message":
            msgs.append({"role": str(item.get("role", "user")), "content": item.get("content")})
        else:
            msgs.append({"role": "tool", "content": str(item.get("output", item.get("arguments", "")))})
    return msgs


def _response_meta(req: Any, resp_id: str, rid: str, created: int, model: str) -> ResponseMeta:
    return ResponseMeta(
        resp_id,
        f"msg_{rid}",
        created,
        model,
        req.instructions,
        req.max_output_tokens,
        req.temperature,
        req.top_p,
    )


async def serve(replicas: list[Replica], ready: asyncio.Event | None = None) -> None:
    """Start every replica, print where each listens, and run until cancelled."""
    for r in replicas:
        await r.start()
        extra = f" bootstrap_port={r.bootstrap_port}" if r.bootstrap_port else ""
        print(
            f"kvgate-sim listening on http://{r.opts.host}:{r.port} replica={r.opts.index}{extra}", flush=True
        )
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        for r in replicas:
            await r.stop()
