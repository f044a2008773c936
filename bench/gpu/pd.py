"""Prefill/decode disaggregation on real engines (bench/gpu/drive.sh, QUEUE=pd).

python3 -m bench.gpu.pd check KG GATEWAY REFERENCE   greedy answers through the PD pool against the
                                                    same requests on one engine, co-located
python3 -m bench.gpu.pd gone KG PREFILL DECODE       a decode leg whose prefill replica is gone
                                                    (killed) or stalled (stopped) after answering

`check` sends each request first through the gateway's PD pool, then straight to REFERENCE (an engine
serving it whole), one at a time so that no batch differs between the two; the answers must be the
same text (the benchmark's tokenizer has one token per word: the same text is the same tokens).
Whether the decode replica loaded the prompt's KV instead of computing it shows twice: the answer's
`usage.prompt_tokens_details.cached_tokens` (vLLM counts transferred tokens as cached), and the
decode replicas' `vllm:external_prefix_cache_hits` and NIXL transfer counters over the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import engine_metrics, text
from bench.gpu.host import MODEL, _endpoints, _write_json, replica_pid

KV_FIRST = {"do_remote_decode": True, "do_remote_prefill": False}


def _requests(n: int, seed: int = 5) -> list[dict[str, Any]]:
    """Greedy requests, prompts of 100 to 8,000 tokens, chat and completions, streamed and not; every
    fourth shares a 2,048-token prefix with the one before it."""
    rng = random.Random(seed)
    out = []
    shared = ""
    for i in range(n):
        size = rng.choice((100, 300, 1000, 2000, 4000, 7900))
        if i % 4 == 3 and shared:
            prompt = shared + text.words(f"pd-tail:{i}", max(size - 2048, 64))
        else:
            prompt = text.words(f"pd:{i}", size)
            shared = prompt[: len(text.words(f"pd:{i}", 2048))] if size > 2048 else shared
        chat, stream = i % 2 == 0, i % 3 == 0
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        out.append(body)
    return out


def _answer(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST one request; the text, usage, status, the serving replica and the time to the first byte."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    with client.stream("POST", url + path, json=body) as resp:
        raw = b""
        for chunk in resp.iter_bytes():
            first = first if first is not None else time.perf_counter() - started
            raw += chunk
    result: dict[str, Any] = {"status": resp.status_code, "replica": resp.headers.get("x-kvgate-replica")}
    if resp.status_code != 200:
        return result | {"error": raw[:500].decode(errors="replace")}
    if body.get("stream"):
        for line in raw.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return result | {"error": json.dumps(event)[:500]}
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                parts.append(delta.get("content") or choice.get("text") or "")
    else:
        doc = json.loads(raw)
        usage = doc.get("usage")
        choice = doc["choices"][0]
        parts.append((choice.get("message") or {}).get("content") or choice.get("text") or "")
    details = (usage or {}).get("prompt_tokens_details") or {}
    return result | {
        "text": "".join(parts),
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "ttfb_s": first,
    }


def check(kg: Path, gateway: str, reference: str, n: int) -> int:
    eps = _endpoints(kg)
    decodes = [u for u, r in zip(eps["urls"], eps.get("roles") or [], strict=False) if r == "decode"]
    before = engine_metrics.fleet_counters(decodes)
    rows = []
    with httpx.Client(timeout=300) as client:
        for i, body in enumerate(_requests(n)):
            pd = _answer(client, gateway, body)
            ref = _answer(client, reference, body)
            rows.append(
                {
                    "i": i,
                    "api": "chat" if "messages" in body else "completions",
                    "stream": bool(body.get("stream")),
                    "pd": pd,
                    "ref": {k: ref.get(k) for k in ("status", "text", "cached_tokens", "error")},
                    "identical": pd.get("text") is not None and pd.get("text") == ref.get("text"),
                }
            )
    delta = engine_metrics.counter_delta(before, engine_metrics.fleet_counters(decodes))
    ok = [r for r in rows if r["pd"]["status"] == 200 and "text" in r["pd"]]
    transferred = [
        r
        for r in ok
        if r["pd"].get("cached_tokens") and r["pd"]["cached_tokens"] >= 0.9 * r["pd"]["prompt_tokens"]
    ]
    summary = {
        "requests": len(rows),
        "answered": len(ok),
        "identical": sum(r["identical"] for r in rows),
        "differ": [r["i"] for r in rows if not r["identical"]],
        "cached_90pct_or_more": len(transferred),
        "prompt_tokens": sum(r["pd"].get("prompt_tokens") or 0 for r in ok),
        "cached_tokens": sum(r["pd"].get("cached_tokens") or 0 for r in ok),
        "decode_counters": delta,
        "by_kind": {
            f"{api}/{'stream' if stream else 'whole'}": sum(
                r["identical"] for r in rows if r["api"] == api and r["stream"] == stream
            )
            for api in ("chat", "completions")
            for stream in (False, True)
        },
    }
    out = kg / "res" / "pd_check"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _write_json(out / "summary.json", summary)
    print(json.dumps(summary, indent=1))
    return 0 if summary["answered"] == len(rows) else 1


def gone(kg: Path, tag: str, prefill: str, decode: str, how: str, timeout_s: float) -> int:
    """The prefill leg answers, then its replica is killed (`kill`) or stopped (`stop`) before the
    decode leg asks for the KV: what the decode replica answers, and after how long."""
    eps = _endpoints(kg)
    url = dict(zip(eps["names"], eps["urls"], strict=True))
    body = {"model": MODEL, "prompt": text.words(f"pd-gone:{how}", 3000), "max_tokens": 16}
    body |= {"temperature": 0, "ignore_eos": True}
    result: dict[str, Any] = {"how": how, "prefill": prefill, "decode": decode}
    with httpx.Client(timeout=timeout_s) as client:
        ref = client.post(url[decode] + "/v1/completions", json=body).json()["choices"][0]["text"]
        client.post(url[decode] + "/reset_prefix_cache")  # the decode leg must not find it locally
        leg = client.post(
            url[prefill] + "/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": KV_FIRST}
        )
        params = leg.json().get("kv_transfer_params")
        result["kv_transfer_params"] = params
        pid = replica_pid(kg, prefill, tag)
        os.killpg(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        started = time.perf_counter()
        try:
            resp = client.post(url[decode] + "/v1/completions", json={**body, "kv_transfer_params": params})
            doc = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
            answer = (doc.get("choices") or [{}])[0].get("text")
            details = (doc.get("usage") or {}).get("prompt_tokens_details") or {}
            result |= {
                "status": resp.status_code,
                "same_as_reference": answer == ref,
                "cached_tokens": details.get("cached_tokens"),
                "error": None if resp.status_code == 200 else resp.text[:300],
            }
        except httpx.HTTPError as exc:
            result |= {"status": None, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            result["seconds"] = round(time.perf_counter() - started, 2)
            if how == "stop":
                os.killpg(pid, signal.SIGCONT)
    out = kg / "res" / "pd_gone"
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / f"{how}.json", result)
    print(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.gpu.pd", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("kg", type=Path)
    c.add_argument("gateway")
    c.add_argument("reference", help="an engine's URL: the co-located answer")
    c.add_argument("--requests", type=int, default=200)
    g = sub.add_parser("gone")
    g.add_argument("kg", type=Path)
    g.add_argument("prefill", help="the prefill replica's name")
    g.add_argument("decode", help="the decode replica's name")
    g.add_argument("--how", choices=["kill", "stop"], default="kill")
    g.add_argument("--tag", default="pd")
    g.add_argument("--timeout-s", type=float, default=90.0)
    a = p.parse_args(argv)
    if a.cmd == "check":
        return check(a.kg, a.gateway, a.reference, a.requests)
    return gone(a.kg, a.tag, a.prefill, a.decode, a.how, a.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
