"""Token counts in the engines' own units: where the engine's tokenizer differs from cl100k (the
H200 run: 2,112 engine tokens counted as 6,296), the gateway learns the engines' tokens per
character from their usage figures, or counts with their tokenizer.json, so that prefix index
sizing and job-size estimates are in engine tokens."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from gateway.config import load_config
from gateway.fleet.pool import Pool
from gateway.prompt.tokens import (
    WordTokenizer,
    engine_prompt_tokens,
    get_tokenizer,
    load_tokenizer,
    model_tokenizer,
    usage_figure,
)
from gateway.routing.pool_router import PoolRouter
from tests.conftest import gateway_settings, wait_until
from tests.simfleet import sim_process


def numbered_words(key: str, n: int) -> str:
    """The GPU kit's prompts: words `tN`, one token each for its tokenizer, about three for cl100k."""
    rng = random.Random(key)
    return " ".join(f"t{rng.randrange(1, 128000)}" for _ in range(n))


def chat(system: str, question: str, **extra: object) -> dict[str, object]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "m", "messages": messages, "max_tokens": 2, **extra}


@pytest.fixture(scope="module")
def word_level_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with a WordLevel tokenizer.json like the GPU kit's (gpu/build/make_model.py),
    made with `tokenizers` once for the module (its 128k-word vocabulary takes a moment)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(1, 128000)} | {"<unk>": 0}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("llama")
    tok.save(str(path / "tokenizer.json"))
    return path


def test_usage_figures_are_found_without_parsing_and_never_in_generated_text() -> None:
    body = (
        b'{"choices":[{"text":"x"}],"usage":{"prompt_tokens":2112,"total_tokens":2114,"completion_tokens":2}}'
    )
    assert engine_prompt_tokens(body) == 2112
    chunk = (
        b'data: {"choices":[],"usage":{"prompt_tokens": 17,"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
    )
    assert engine_prompt_tokens(chunk) == 17
    assert usage_figure(chunk, b"cached_tokens") == 0 and usage_figure(body, b"cached_tokens") is None
    # The same words inside generated text are escaped JSON: no match.
    assert engine_prompt_tokens(b'{"choices":[{"text":"\\"prompt_tokens\\": 5"}]}') is None
    assert engine_prompt_tokens(b'{"usage":{"prompt_tokens":"many"}}') is None
    assert engine_prompt_tokens(b'{"usage":{"prompt_tokens":99999999999999999}}') is None


def test_the_word_tokenizers_agree_and_differ_threefold_from_cl100k(word_level_model: Path) -> None:
    text = numbered_words("a", 300)
    words = WordTokenizer()
    assert words.count(text) == 300 and words.encode("t5 t127999 t7") == [5, 127999, 7]
    hf = load_tokenizer(str(word_level_model))
    assert hf.encode(text) == words.encode(text)
    assert model_tokenizer(str(word_level_model)) == word_level_model / "tokenizer.json"
    assert 2.5 < get_tokenizer().count(text) / 300 < 3.5  # what the H200 run saw


async def test_usage_figures_teach_the_pool_the_engines_tokens(gateway) -> None:
    """A simulator counting one token per word (the GPU kit's tokenizer) behind a gateway that
    counts cl100k: after a few responses the gateway's estimates and its index are in the
    engine's tokens, from non-streamed bodies and the streamed usage chunk alike."""
    with sim_process("--tokenizer", "builtin:words") as url:
        settings = gateway_settings(
            [url], pool={"policy": {"type": "prefix_affinity"}, "endpoints": [{"url": url, "kind": "sim"}]}
        )
        gw = await gateway(settings)
        pool = gw.runtime.routers["p"]
        replica = next(iter(pool.pool.replicas.values()))
        await wait_until(lambda: replica.kv_capacity_tokens is not None, timeout=10, what="KV capacity")
        async with httpx.AsyncClient(timeout=30) as c:
            for i in range(8):
                r = await c.post(
                    gw.url + "/v1/chat/completions", json=chat(numbered_words(f"s{i}", 400), "t1 t2")
                )
                assert r.status_code == 200
            streamed = chat(
                numbered_words("s-stream", 400), "t3", stream=True, stream_options={"include_usage": True}
            )
            async with c.stream("POST", gw.url + "/v1/chat/completions", json=streamed) as r:
                assert r.status_code == 200
                await r.aread()
            await wait_until(lambda: pool.scale._usage_samples == 9, timeout=5, what="nine usage figures")
            probe = chat(numbered_words("probe", 400), "t4")
            engine_count = (await c.post(url + "/tokenize", json={"messages": probe["messages"]})).json()[
                "count"
            ]
        assert 0.25 < pool.scale.scale < 0.45  # cl100k counts ~3 tokens per `tN` word
        features = pool.features(probe, "chat", "x", {})
        assert abs(features.prompt_tokens - engine_count) <= 0.1 * engine_count
        # The index holds as many blocks as the engine's KV holds tokens of this text.
        text_tokens_per_char = engine_count / len(features.text)
        capacity = pool.match.index.stats()["replicas"][replica.name]["capacity"]
        held_chars = capacity * pool.pool.cfg.prefix.block_chars
        assert (
            abs(held_chars * text_tokens_per_char - replica.kv_capacity_tokens)
            <= 0.15 * replica.kv_capacity_tokens
        )


def test_a_pool_counts_with_the_tokenizer_it_is_given(word_level_model: Path) -> None:
    model = word_level_model
    text = numbered_words("given", 700)
    body = {"model": "m", "prompt": text}
    for pool_cfg in (
        {"tokenizer": str(model / "tokenizer.json"), "endpoints": [{"url": "http://127.0.0.1:9"}]},
        {"tokenizer": "builtin:words", "endpoints": [{"url": "http://127.0.0.1:9"}]},
        # A managed pool whose model is a local directory: its tokenizer.json, found, not named.
        {"engines": {"kind": "sim", "model": str(model)}},
    ):
        settings = load_config(None, {"pools": [{"name": "p", "model": "m", **pool_cfg}]})
        pool = PoolRouter(Pool(settings.pools[0], settings.breaker, settings.scrape))
        assert pool.tokenizer is not None
        features = pool.features(body, "completions", "r", {})
        assert abs(features.prompt_tokens - 700) <= 2
        assert abs(sum(features.block_tokens) - 700) <= 12  # blocks cut at word starts


def test_the_simulator_counts_with_the_tokenizer_json_it_is_given(word_level_model: Path) -> None:
    model = word_level_model
    prompt = numbered_words("sim", 50)
    with sim_process("--tokenizer", str(model)) as url:
        tokens = httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert tokens == WordTokenizer().encode(prompt)


async def test_without_usage_figures_the_engines_own_counters_teach_the_pool(gateway) -> None:
    """Streams without `include_usage` carry no usage: the engines' prompt token counters
    (vllm:prompt_tokens_total, scraped with their load) against the characters routed to them."""
    with sim_process("--tokenizer", "builtin:words") as url:
        pool_cfg = {"policy": {"type": "prefix_affinity"}, "endpoints": [{"url": url, "kind": "sim"}]}
        gw = await gateway(gateway_settings([url], pool=pool_cfg, scrape={"interval_s": 0.1}))
        pool = gw.runtime.routers["p"]
        async with httpx.AsyncClient(timeout=30) as c:
            for i in range(8):
                async with c.stream(
                    "POST",
                    gw.url + "/v1/chat/completions",
                    json=chat(numbered_words(f"c{i}", 400), "t5", stream=True),
                ) as r:
                    assert r.status_code == 200
                    await r.aread()
        await wait_until(lambda: 0.25 < pool.scale.scale < 0.45, timeout=10, what="the counters to be read")
        assert pool.scale._usage_samples == 0


async def test_a_long_prompt_in_prefill_does_not_skew_the_count_when_usage_flows(gateway) -> None:
    """Responses with usage, too few yet to be trusted, and a long prompt still prefilling when the
    engine's counters are scraped: the counters, which do not count it yet, must not set the scale
    (they made every block of such prompts 0 tokens: no prefix matched until 8 responses came)."""
    with sim_process("--speedup", "0.15") as url:
        pool_cfg = {"policy": {"type": "prefix_affinity"}, "endpoints": [{"url": url, "kind": "sim"}]}
        gw = await gateway(gateway_settings([url], pool=pool_cfg, scrape={"interval_s": 0.05}))
        pool = gw.runtime.routers["p"]
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        path = gw.url + "/v1/chat/completions"
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", path, json=chat("w1 w2", "t0", **usage)) as r:
                await r.aread()
            await wait_until(lambda: pool.scale._usage_samples == 1, timeout=5, what="one usage figure")
            await wait_until(lambda: pool.scale._counter_tokens > 0, timeout=5, what="the counters read")
            document = " ".join(f"word{k}" for k in range(6000))
            long = asyncio.create_task(c.post(path, json=chat(document, "t1")))
            # Scraped while the engine prefills it (about 2 s of wall clock at this speed).
            await wait_until(
                lambda: pool.scale._counter_chars >= 4 * 4096, timeout=5, what="a scrape after it"
            )
            assert not long.done()
            assert pool.scale.scale == 1.0
            assert (await long).status_code == 200
