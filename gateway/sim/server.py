"""HTTP front of a simulated replica (aiohttp): the OpenAI endpoints, vLLM/SGLang extras, PD legs, faults.

One `Replica` is one engine with its own port, cache, metrics and request log; `serve` runs several in one
event loop. Streaming output is written once per engine step for all requests that produced tokens (one task
per step, not one wake-up per token).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from aiohttp import ClientSession, ClientTimeout, web

from gateway.sim import protocol as proto
from gateway.sim.engine import FINISHED, Engine, EngineConfig, RealtimeRunner, Request
from gateway.sim.faults import HEADER as FAULT_HEADER
from gateway.sim.faults import FaultConfig, FaultSpec, FaultSyntaxError
from gateway.sim.kv_events import KVEventPublisher
from gateway.tokens import get_tokenizer

log = logging.getLogger("gateway.sim")

RING_SIZE = 256
_ECHO_HEADERS = ("x-request-id", "x-vllm-priority", FAULT_HEADER, "authorization", "traceparent")


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
    disaggregation_mode: str | None = None  # SGLang: prefill | decode
    bootstrap_port: int | None = None
    kv_events: dict[str, Any] | None = None
    faults: FaultConfig = field(default_factory=FaultConfig)
    startup_delay_s: float = 0.0
    default_max_tokens: int = 64
    index: int = 0
    single_process_replica: bool = True  # a crash fault exits the process


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class _Response:
    """One HTTP response fed by one or more engine requests (`n` choices)."""

    __slots__ = (
        "children",
        "cut_after",
        "dirty",
        "done",
        "fmt",
        "include_usage",
        "release",
        "resp",
        "room",
        "seeds",
        "sent",
        "stream",
        "writes",
        "writing",
    )

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.children: list[Request] = []
        self.seeds: list[int] = []
        self.sent: list[int] = []
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.dirty = False
        self.writing = False
        self.writes = 0
        self.cut_after: int | None = None
        self.fmt: proto.ChunkFormat | None = None
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
        c0 = self.children[0]
        return proto.usage(c0.prompt_len, sum(c.num_output for c in self.children), c0.num_cached)

    async def flush(self) -> None:
        if self.writing or self.done.done() or self.resp is None or self.fmt is None:
            return
        self.writing = True
        try:
            while self.dirty:
                self.dirty = False
                parts: list[bytes] = []
                for i, c in enumerate(self.children):
                    start, end = self.sent[i], c.num_output
                    if end > start:
                        fin = c.finish_reason if c.state == FINISHED else None
                        # A midstream fault counts chunks: then one token per chunk, never coalesced.
                        step = 1 if self.cut_after is not None else end - start
                        for a in range(start, end, step):
                            content = proto.output_json(self.seeds[i], a, a + step)
                            parts.append(self.fmt.chunk(i, content, a == 0, fin if a + step >= end else None))
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
                    if self.include_usage:
                        parts.append(self.fmt.usage_chunk(self.usage()))
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
        self.engine = Engine(opts.engine)
        self.runner = RealtimeRunner(self.engine, opts.speedup)
        self.engine.on_output = self._on_output
        self.engine.on_step = self._on_step
        self.tokenizer = get_tokenizer()
        self.engine_id = f"sim-{uuid.uuid4().hex[:12]}"
        self.requests: deque[dict[str, Any]] = deque(maxlen=RING_SIZE)
        self.rooms: OrderedDict[int, asyncio.Future[int]] = OrderedDict()  # SGLang bootstrap rooms
        self.kv_pub: KVEventPublisher | None = None
        self.started_at = 0.0
        self.crashed = False
        self.port = opts.port
        self.bootstrap_port = opts.bootstrap_port
        self._web: web.AppRunner | None = None
        self._sites: list[web.TCPSite] = []
        self._http: ClientSession | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.app = self._build_app()

    # ---- lifecycle -----------------------------------------------------------------------------
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/health", self.health)
        r.add_get("/v1/models", self.models)
        r.add_post("/tokenize", self.tokenize)
        r.add_get("/metrics", self.metrics)
        r.add_get("/sim/state", self.sim_state)
        r.add_get("/sim/requests", self.sim_requests)
        r.add_post("/sim/pd/release", self.pd_release)
        r.add_get("/sim/bootstrap/{room}", self.bootstrap_wait)
        for path in ("/sim/flush_cache", "/reset_prefix_cache", "/flush_cache"):
            r.add_post(path, self.flush_cache)
        if self.sglang:
            r.add_get("/v1/loads", self.loads)
            r.add_get("/get_load", self.loads)
            r.add_get("/health_generate", self.health)
            r.add_get("/server_info", self.sim_state)
        return app

    async def start(self) -> None:
        o = self.opts
        if o.kv_events is not None:
            self.kv_pub = KVEventPublisher.from_config(o.kv_events, self.engine.block_size, o.index)
            self.engine.pool.record_events = True
        self._web = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._web.setup()
        ports = [(o.port, "port")]
        if o.bootstrap_port is not None:
            ports.append((o.bootstrap_port, "bootstrap_port"))
        for port, attr in ports:
            site = web.TCPSite(self._web, o.host, port, reuse_address=True)
            await site.start()
            self._sites.append(site)
            server = site._server
            bound = server.sockets[0].getsockname()[1] if server and server.sockets else port  # type: ignore[union-attr]
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
            self.kv_pub.publish(self.engine.pool.take_events())

    # ---- helpers -------------------------------------------------------------------------------
    def _error(self, status: int, message: str, param: str | None = None) -> web.Response:
        body = proto.error_body(status, message, flat=self.sglang, param=param)
        return web.json_response(body, status=status, dumps=lambda o: orjson.dumps(o).decode())

    def _starting(self) -> bool:
        return time.monotonic() - self.started_at < self.opts.startup_delay_s

    def _json(self, obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(
            body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers
        )

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
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    def _tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise HTTPError(400, "messages must be a non-empty list", "messages")
            return self.tokenizer.encode(proto.render_chat(msgs, body.get("tools")))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise HTTPError(400, "prompt must be a string or a list of token ids (one prompt)", "prompt")

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

    def _max_tokens(self, body: dict[str, Any], prompt_len: int) -> int:
        ec = self.opts.engine
        limit = min(ec.max_model_len, self.engine.pool.num_blocks * self.engine.block_size)
        if not ec.enable_chunked_prefill:
            limit = min(limit, ec.max_num_batched_tokens)  # a prompt must fit one step's budget
        if prompt_len >= limit:
            raise HTTPError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages.",
                "messages",
            )
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if mt is None:
            return min(self.opts.default_max_tokens, limit - prompt_len)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise HTTPError(400, "max_tokens must be a positive integer", "max_tokens")
        if prompt_len + mt > limit:
            raise HTTPError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + mt} tokens ({prompt_len} in the messages, {mt} in the completion).",
                "max_tokens",
            )
        return mt

    def _priority(self, request: web.Request, body: dict[str, Any]) -> int:
        raw = request.headers.get("x-vllm-priority", body.get("priority", 0))
        try:
            prio = int(raw or 0)
        except (TypeError, ValueError):
            raise HTTPError(400, "priority must be an integer", "priority") from None
        if prio and self.opts.engine.scheduling_policy != "priority" and not self.sglang:
            raise HTTPError(400, f"Got priority {prio} but Priority scheduling is not enabled.", "priority")
        return prio

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        rid = request.headers.get("x-request-id") or ""
        headers = {"x-request-id": rid} if rid else {}
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
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError:
                raise HTTPError(400, "request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise HTTPError(400, "request body must be a JSON object")
            rid = rid or str(body.get("request_id") or uuid.uuid4().hex)
            self._record(request, body, rid)
            return await self._serve(request, body, chat, rid, spec, headers)
        except FaultSyntaxError as exc:
            return self._error(400, str(exc), FAULT_HEADER)
        except HTTPError as exc:
            resp = self._error(exc.status, str(exc), exc.param)
            resp.headers.update(headers)
            if exc.status in (429, 503):
                resp.headers["Retry-After"] = "1"
            return resp

    async def _serve(
        self,
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        rid: str,
        spec: FaultSpec,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        o = self.opts
        model = body.get("model") or o.served_model_names[0]
        if model not in o.served_model_names:
            raise HTTPError(404, f"The model `{model}` does not exist.", "model")
        stream = bool(body.get("stream", False))
        if body.get("stream_options") is not None and not stream:
            raise HTTPError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        n = body.get("n", 1)
        if not isinstance(n, int) or n < 1:
            raise HTTPError(400, "n must be a positive integer", "n")
        priority = self._priority(request, body)
        prompt_ids = self._tokens(body, chat)
        max_tokens = self._max_tokens(body, len(prompt_ids))
        if o.max_waiting is not None and self.engine.num_waiting >= o.max_waiting:
            raise HTTPError(429, f"engine overloaded: {self.engine.num_waiting} requests waiting")

        out = _Response(stream)
        remote_kv = kv_lease = False
        ktp = body.get("kv_transfer_params") if o.kv_role else None
        if isinstance(ktp, dict):
            if ktp.get("do_remote_decode"):
                kv_lease, max_tokens, n = True, 1, 1
            elif ktp.get("remote_block_ids"):
                remote_kv = True
                if ktp.get("remote_host") and ktp.get("remote_port") and ktp.get("remote_request_id"):
                    out.release = ktp
        room = body.get("bootstrap_room")
        if isinstance(room, list):
            room = room[0] if room else None
        if o.disaggregation_mode == "prefill" and room is not None:
            max_tokens, n = 1, 1
            out.room = int(room)
        elif o.disaggregation_mode == "decode" and room is not None and body.get("bootstrap_host"):
            await self._await_bootstrap(str(body["bootstrap_host"]), body.get("bootstrap_port"), int(room))
            remote_kv = True

        seed = body.get("seed") if isinstance(body.get("seed"), int) else None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        bs = self.engine.block_size
        for i in range(n):
            seed_i = proto.output_seed(len(prompt_ids), i, seed)
            req = Request(
                rid if n == 1 else f"{rid}-{i}",
                prompt_ids,
                max_tokens,
                priority=priority,
                cache_salt=salt,
                block_size=bs,
                remote_kv=remote_kv,
                kv_lease=kv_lease,
                sink=out,
                output_ids=partial(proto.output_token_ids, seed_i) if proto.vocab_token_ids() else None,
            )
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                req.finish_reason = "stop"  # a natural end, as an unbounded request would have
            out.children.append(req)
            out.seeds.append(seed_i)
            out.sent.append(0)
        created = proto.now_s()
        resp_id = ("chatcmpl-" if chat else "cmpl-") + rid
        try:
            if stream:
                so = body.get("stream_options") or {}
                out.include_usage = bool(so.get("include_usage"))
                out.cut_after = spec.midstream
                out.fmt = proto.ChunkFormat(chat, resp_id, model, created)
                resp = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
                )
                await resp.prepare(request)
                out.resp = resp
                for c in out.children:
                    self.runner.submit(c)
                if await out.done == "cut" and request.transport is not None:
                    request.transport.abort()  # no [DONE], no chunked terminator: a broken stream
                return resp
            for c in out.children:
                self.runner.submit(c)
            await out.done
            return self._json(self._full_body(out, chat, resp_id, model, created, kv_lease), headers=headers)
        finally:
            if any(c.state != FINISHED for c in out.children):
                for c in out.children:
                    self.engine.abort(c)  # frees the blocks of a gone client
                self.runner.wake()

    def _full_body(
        self, out: _Response, chat: bool, resp_id: str, model: str, created: int, kv_lease: bool
    ) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(out.children):
            text = proto.output_text(out.seeds[i], 0, c.num_output)
            choice: dict[str, Any] = {"index": i}
            if chat:
                choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
            else:
                choice["text"] = text
            choice.update(logprobs=None, finish_reason=c.finish_reason, stop_reason=None)
            choices.append(choice)
        result: dict[str, Any] = {
            "id": resp_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
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

    # ---- PD ------------------------------------------------------------------------------------
    async def _release_remote(self, ktp: dict[str, Any]) -> None:
        url = f"http://{ktp['remote_host']}:{ktp['remote_port']}/sim/pd/release"
        try:
            async with self._client().post(url, json={"remote_request_id": ktp["remote_request_id"]}) as r:
                await r.read()
        except Exception as exc:  # the lease times out on the prefill side anyway
            log.warning("could not release remote KV blocks at %s: %s", url, exc)

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

    async def models(self, request: web.Request) -> web.Response:
        o = self.opts
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "sglang" if self.sglang else "vllm",
                "root": o.model,
                "parent": None,
                "max_model_len": o.engine.max_model_len,
            }
            for name in o.served_model_names
        ]
        return self._json({"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
            ids = self._tokens(body, chat="messages" in body)
        except HTTPError as exc:
            return self._error(exc.status, str(exc), exc.param)
        except orjson.JSONDecodeError:
            return self._error(400, "request body is not valid JSON")
        return self._json({"count": len(ids), "max_model_len": self.opts.engine.max_model_len, "tokens": ids})

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.engine.pool.reset_cache()
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
            f'cache_dtype="{self.opts.engine.kv_cache_dtype}",{lbl}}} 1.0'
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
