"""The simulated engine beyond the shared contract (conformance_test covers that): its capacity
model (max_num_seqs, KV budget, bounded waiting queue), vLLM's gauges on the frontend's
/metrics, `sim://` parsing and `serve --engine sim://...` validation.

Capacity is observed with tokens_per_s=0 plus requests far longer than the test needs, and
read from engine state, never from timing.
"""

import asyncio
import json

import httpx
import pytest

from paved.engine.protocol import (
    Constraint,
    EngineOverloadedError,
    EngineUnavailableError,
    GenerateRequest,
    InvalidRequestError,
    SamplingOptions,
    TextPrompt,
)
from paved.engine.sim import SimConfig, SimEngine
from paved.frontend import config as config_file
from paved.frontend.app import create_app
from paved.frontend.registry import ModelRegistry
from paved.frontend.server import main as serve_main


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def req(i, *, n=1, max_tokens=300, prompt="hello", **kw):
    return GenerateRequest(
        f"r{i}", "sim", TextPrompt(prompt), SamplingOptions(n=n, max_tokens=max_tokens, ignore_eos=True, **kw)
    )


def gauges(engine) -> dict:
    return {f.name: f.samples[0].value for f in engine.metrics() if f.type == "gauge"}


def test_max_num_seqs_and_the_waiting_queue():
    async def body():
        engine = SimEngine(SimConfig("sim", tokens_per_s=0, max_num_seqs=4, max_waiting=2, max_model_len=512))
        await engine.start()
        a = await engine.generate(req(1, n=3))
        b = await engine.generate(req(2, n=2))  # 3 + 2 > 4: waits
        c = await engine.generate(req(3))  # FIFO: waits behind b although it would fit
        assert (engine.num_running, engine.num_waiting) == (3, 3)
        with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
            await engine.generate(req(4))
        g = gauges(engine)
        assert g["vllm:num_requests_running"] == 3 and g["vllm:num_requests_waiting"] == 3
        await a.aclose()  # frees 3 sequences: b and c start
        assert (engine.num_running, engine.num_waiting) == (3, 0)
        for stream in (b, c):
            await stream.aclose()
        assert engine.num_running == 0 and engine.kv_usage == 0
        await engine.stop()

    run(body())


def test_kv_budget_makes_requests_wait():
    async def body():
        # 600 KV tokens: one request of 5 + 295 reserves 300, so the third waits.
        engine = SimEngine(SimConfig("sim", tokens_per_s=0, max_num_seqs=8, kv_tokens=600, max_model_len=512))
        await engine.start()
        streams = [await engine.generate(req(i, max_tokens=295)) for i in range(3)]
        assert (engine.num_running, engine.num_waiting) == (2, 1)
        assert gauges(engine)["vllm:kv_cache_usage_perc"] == pytest.approx(1.0)
        with pytest.raises(InvalidRequestError, match="KV tokens"):
            await engine.generate(req(9, n=2, max_tokens=400))  # could never fit
        await streams[0].aclose()
        assert (engine.num_running, engine.num_waiting) == (2, 0)
        for stream in streams[1:]:
            await stream.aclose()
        await engine.stop()

    run(body())


def test_finished_requests_release_capacity_and_count_tokens():
    async def body():
        engine = SimEngine(SimConfig("sim", tokens_per_s=0, max_num_seqs=1, max_model_len=512))
        await engine.start()
        streams = [await engine.generate(req(i, max_tokens=5)) for i in range(3)]
        for stream in streams:  # each waits for the one before it: max_num_seqs=1
            outputs = [out async for out in stream]
            assert outputs[-1].choices[-1].finish_reason == "length"
        counters = {
            s.name: s.value
            for f in engine.metrics()
            for s in f.samples
            if not s.labels.get("finished_reason")
        }
        assert counters["vllm:generation_tokens_total"] == 15 and counters["vllm:prompt_tokens_total"] == 15
        await engine.stop()

    run(body())


def test_stop_ends_in_flight_streams_and_refuses_new_work():
    async def body():
        engine = SimEngine(SimConfig("sim", tokens_per_s=0, max_num_seqs=1, max_model_len=512))
        await engine.start()
        running = await engine.generate(req(1))
        waiting = await engine.generate(req(2))
        await engine.stop()
        assert not engine.ready()
        for stream in (running, waiting):
            with pytest.raises(EngineUnavailableError):
                async for _ in stream:
                    pass
        with pytest.raises(EngineUnavailableError):
            await engine.generate(req(3))

    run(body())


def test_xgrammar_constraints_are_refused_not_dropped():
    async def body():
        engine = SimEngine(SimConfig("sim", tokens_per_s=0))
        await engine.start()
        assert engine.models()[0].constraint_backends == ("paved",)
        with pytest.raises(InvalidRequestError, match="not supported by the sim engine"):
            await engine.generate(req(1, constraint=Constraint("xgrammar", "regex", "[a-z]+")))
        await engine.stop()

    run(body())


def test_paved_regex_and_stop_strings_with_the_byte_tokenizer():
    async def body():
        engine = SimEngine(SimConfig("sim", tokens_per_s=0))
        await engine.start()
        spec = {"type": "regex", "pattern": "[0-9]{3}-[a-z]{2,4}"}
        request = GenerateRequest(
            "r",
            "sim",
            TextPrompt("id?"),
            SamplingOptions(max_tokens=20, constraint=Constraint("paved", "paved", spec)),
        )
        text = "".join([c.text async for out in await engine.generate(request) for c in out.choices])
        import re

        assert re.fullmatch(spec["pattern"], text), text
        await engine.stop()

    run(body())


def test_uri_options_and_errors():
    config = SimConfig.from_uri("sim://chat?tokens_per_s=12.5&max_num_seqs=3&kv_tokens=9000&max_waiting=0")
    assert (config.model, config.tokens_per_s, config.max_num_seqs, config.kv_tokens, config.max_waiting) == (
        "chat",
        12.5,
        3,
        9000,
        0,
    )
    assert SimConfig.from_uri("sim://", "named").model == "named"
    assert SimConfig("m", max_num_seqs=4, max_model_len=100).kv_tokens == 400
    for bad, fragment in (
        ("kserve://h:1", "expected sim://"),
        ("sim://m/x", "expected sim://"),
        ("sim://m?colour=red", "unknown option"),
        ("sim://m?tokens_per_s=fast", "tokens_per_s must be a number"),
        ("sim://m?tokens_per_s=-1", "tokens_per_s"),
        ("sim://m?tokens_per_s=inf", "tokens_per_s"),
        ("sim://m?max_num_seqs=0", "max_num_seqs"),
        ("sim://m?kv_tokens=1.5", "kv_tokens must be an integer"),
        ("sim://m?kv_tokens=10", "at least one full context"),
        ("sim://m?tokenizer=/nonexistent", "not a directory"),
        ("sim://", "needs a model name"),
    ):
        with pytest.raises(ValueError, match=fragment):
            SimConfig.from_uri(bad)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--engine", "sim://m?max_num_seqs=zero"], "max_num_seqs must be an integer"),
        (["--engine", "sim://m?speed=3"], "unknown option(s) ['speed']"),
        (["--engine", "sim://a", "--model", "b"], "names model 'a'"),
        (["--engine", "sim://"], "needs a model name"),
        (["--engine", "sim://m", "--max-num-seqs", "4"], "--max-num-seqs"),
    ],
)
def test_serve_rejects_bad_sim_uris_with_exit_2(argv, fragment, capsys):
    assert serve_main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_config_file_sim_model(tmp_path):
    path = tmp_path / "paved.json"
    path.write_text(json.dumps({"models": [{"name": "chat", "engine": "sim://chat?tokens_per_s=5"}]}))
    (model,) = config_file.load(str(path)).models
    engine = config_file.make_engine(model)
    assert isinstance(engine, SimEngine) and engine.config.tokens_per_s == 5
    path.write_text(json.dumps({"models": [{"name": "chat", "engine": "sim://chat?max_waiting=-1"}]}))
    with pytest.raises(ValueError, match="max_waiting"):
        config_file.load(str(path))


def test_gauges_on_the_frontends_metrics():
    async def body():
        engine = SimEngine(SimConfig("chat", tokens_per_s=0, max_num_seqs=2, max_model_len=512))
        registry = ModelRegistry([engine])
        await registry.start()
        app = create_app(registry)
        hog = await engine.generate(
            GenerateRequest("hog", "chat", TextPrompt("x"), SamplingOptions(max_tokens=400, ignore_eos=True))
        )
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://paved") as client:
                completion = await client.post(
                    "/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 3}
                )
                text = (await client.get("/metrics")).text
        finally:
            await hog.aclose()
            await engine.stop()
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 3
        assert 'vllm:num_requests_running{engine="0",model_name="chat"} 1.0' in text
        assert 'vllm:num_requests_waiting{engine="0",model_name="chat"} 0.0' in text
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="chat"}' in text
        assert 'vllm:generation_tokens_total{engine="0",model_name="chat"}' in text

    run(body())


def test_one_failure_cancels_the_sibling_generations():
    """A request's prompts are generated side by side: the first to fail cancels the others
    (which close their engine streams) before the error is raised; asyncio.gather left them
    generating for an answer that had already failed."""
    from paved.engine.streams import gather_or_cancel

    async def main():
        engine = SimEngine(SimConfig("sim", tokens_per_s=50, max_model_len=512))
        await engine.start()
        sibling_closed = asyncio.Event()

        async def long_prompt():
            stream = await engine.generate(req(1, max_tokens=400))
            try:
                async for _ in stream:
                    pass
            finally:
                await stream.aclose()
                sibling_closed.set()

        async def failing_prompt():
            await asyncio.sleep(0.1)
            raise RuntimeError("the engine died")

        with pytest.raises(RuntimeError, match="died"):
            await gather_or_cancel(long_prompt(), failing_prompt())
        assert sibling_closed.is_set()  # closed before the error reached the caller
        assert engine.num_running == 0
        assert await gather_or_cancel(asyncio.sleep(0, 1), asyncio.sleep(0, 2)) == [1, 2]
        await engine.stop()

    run(main())


def test_a_large_chat_prompt_is_rendered_off_the_event_loop():
    """A template over megabytes of messages takes long: past OFF_LOOP_RENDER_BYTES (the
    request's size, or the messages' text) it renders on a worker thread."""
    import asyncio
    import threading

    from paved.engine.protocol import ChatPrompt
    from paved.engine.text import OFF_LOOP_RENDER_BYTES, render_chat_template_off_loop

    threads: list[str] = []

    class Tokenizer:
        def apply_chat_template(self, messages, **kwargs):
            threads.append(threading.current_thread().name)
            return "".join(m["content"] for m in messages)

    async def go():
        small = ChatPrompt(messages=[{"role": "user", "content": "hi"}])
        big = ChatPrompt(messages=[{"role": "user", "content": "x" * (OFF_LOOP_RENDER_BYTES + 1)}])
        hinted = ChatPrompt(messages=[{"role": "user", "content": "hi"}], size_hint=OFF_LOOP_RENDER_BYTES + 1)
        for prompt in (small, big, hinted):
            assert (
                await render_chat_template_off_loop(Tokenizer(), prompt, "messages")
                == prompt.messages[0]["content"]
            )

    asyncio.run(go())
    main = threading.main_thread().name
    assert threads[0] == main and threads[1] != main and threads[2] != main
