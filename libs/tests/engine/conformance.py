"""The engine contract (paved.engine.protocol), one suite for every engine.

A test module picks its engines by defining `ENGINES` and importing everything from here:
`conformance_test.py` runs the simulated engine and KServeEngine (over paved's KServe gRPC
server fronting a sim engine); `conformance_vllm_test.py` runs VllmEngine on //models/tiny,
one engine for the whole target. Where an engine cannot carry something through its transport
(the KServe v2 vLLM tensors have no token ids or stop reasons), CAPS says so, and the test
checks that the engine refuses it at admission rather than faking it.

No assertion depends on timing: "the slot is freed" is read from engine state, polled with a
bound, and the long requests used to observe an abort are far longer than the test needs.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from libs.tests.kserve.kserve_fakes import LoopThread, wait_for
from paved.constraints.spec import validate_spec
from paved.engine.protocol import (
    ChatPrompt,
    Constraint,
    Engine,
    EngineOverloadedError,
    GenerateRequest,
    GenerateStream,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    SamplingOptions,
    TextPrompt,
    TokenPrompt,
)
from paved.testing.fixtures import tiny_model_dir

MODEL = "conformance"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["ok", "level", "note"],
    "additionalProperties": False,
}
# A request that cannot finish while a test looks at it (it is closed or aborted first).
LONG = 400

_ALL = {
    "token_ids": True,  # deltas carry token ids (else only num_tokens)
    "stop_reason": True,
    "token_prompt": True,
    "prefill_only": True,  # max_tokens=0 with prompt logprobs and echo
    "overload": True,  # a full queue raises EngineOverloadedError (the fixture bounds it)
    "abort_counted": True,  # aborts are visible in vllm:request_success{finished_reason="abort"}
}
CAPS = {
    "sim": dict(_ALL),
    "kserve": {
        **_ALL,
        "token_ids": False,
        "stop_reason": False,
        "token_prompt": False,
        "prefill_only": False,
    },
    # No queue bound is configured for the in-process engine, and vLLM's own counters see
    # only requests the engine core finished (an abort from the frontend is not one).
    "vllm": {**_ALL, "overload": False, "abort_counted": False},
}


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


class Harness:
    """An engine under test plus what the suite reads of its internal state."""

    def __init__(self, kind: str, engine, *, backend=None, stop=None):
        self.kind = kind
        self.engine = engine
        self.caps = CAPS[kind]
        self._backend = backend  # the sim engine behind a KServe server
        self._stop = stop

    def in_flight(self) -> int:
        """Requests still holding engine resources (the backend's, for a remote engine)."""
        e = self.engine
        if self.kind == "sim":
            return e.num_running + e.num_waiting
        if self.kind == "kserve":
            return len(e._calls) + self._backend.num_running + self._backend.num_waiting
        return len(e._active) + e._llm.output_processor.get_num_unfinished_requests()

    def aborted(self) -> float:
        source = self._backend if self.kind == "kserve" else self.engine
        for family in source.metrics():
            if family.name == "vllm:request_success":
                return sum(s.value for s in family.samples if s.labels.get("finished_reason") == "abort")
        return 0.0


def _make_sim(tokenizer: str | None = None):
    from paved.engine.sim import SimConfig, SimEngine

    # max_waiting=0: a request that cannot start at once is refused, so the overload case is
    # reachable with one long request and no timing.
    return SimEngine(
        SimConfig(
            MODEL,
            tokens_per_s=0 if tokenizer is None else 400,
            max_num_seqs=MAX_NUM_SEQS,
            max_waiting=0,
            max_model_len=MAX_MODEL_LEN,
            tokenizer=tokenizer,
        )
    )


@pytest.fixture(scope="module")
def harness(loop, engine_kind):
    if engine_kind == "sim":
        engine = _make_sim()
        loop.run(engine.start())
        yield Harness("sim", engine)
        loop.run(engine.stop())
    elif engine_kind == "kserve":
        from paved.engine.kserve_engine import KServeEngine
        from paved.kserve.server import KServeServer

        # The backend is paced (400 tokens/s per sequence) so that a closed stream is cancelled
        # while its request still runs: the abort is then observable, not just its absence.
        backend = _make_sim(tiny_model_dir())

        async def start():
            await backend.start()
            server = KServeServer([backend], [], host="127.0.0.1", grpc_port=0, http_port=None)
            await server.start()
            engine = KServeEngine.from_uri(
                f"kserve://127.0.0.1:{server.grpc_port}?tokenizer={tiny_model_dir()}",
                MODEL,
                connect_timeout_s=30,
            )
            await engine.start()
            return server, engine

        server, engine = loop.run(start())
        yield Harness("kserve", engine, backend=backend)

        async def stop():
            await engine.stop()
            await server.stop(grace_s=1)
            await backend.stop()

        loop.run(stop())
    elif engine_kind == "vllm":
        from paved.engine.vllm_config import VllmModelConfig
        from paved.engine.vllm_engine import VllmEngine

        engine = VllmEngine(
            VllmModelConfig(
                name=MODEL,
                path=tiny_model_dir(),
                dtype="float32",
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=MAX_NUM_SEQS,
                enforce_eager=True,
            )
        )
        loop.run(engine.start(), timeout=600)
        yield Harness("vllm", engine)
        loop.run(engine.stop(), timeout=120)
    else:
        raise ValueError(engine_kind)


@pytest.fixture()
def h(harness, loop):
    """Each test starts and must end with nothing in flight."""
    assert harness.in_flight() == 0
    yield harness
    assert wait_for(lambda: harness.in_flight() == 0, timeout=30), "a test left a request in flight"


# ---- helpers -------------------------------------------------------------------------------
_ids = iter(range(1_000_000))


def request(prompt="The quick brown fox", *, stream=False, echo=False, **sampling) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(
        f"conf-{next(_ids)}",
        MODEL,
        TextPrompt(prompt) if isinstance(prompt, str) else prompt,
        SamplingOptions(**sampling),
        stream=stream,
        echo=echo,
    )


async def _collect(engine, req):
    stream = await engine.generate(req)
    try:
        return [out async for out in stream]
    finally:
        await stream.aclose()


def collect(loop, h, req):
    return loop.run(_collect(h.engine, req), timeout=120)


def text_of(outputs, index=0) -> str:
    return "".join(c.text for out in outputs for c in out.choices if c.index == index)


def tokens_of(outputs, index=0) -> int:
    return sum(c.token_count for out in outputs for c in out.choices if c.index == index)


def finishes(outputs, index=0) -> list:
    return [c.finish_reason for out in outputs for c in out.choices if c.index == index and c.finish_reason]


def check_shape(outputs, n: int) -> None:
    """The delta invariants every output stream keeps."""
    assert outputs, "no output"
    assert outputs[-1].finished and not any(out.finished for out in outputs[:-1])
    assert outputs[0].prompt_tokens and all(out.prompt_tokens is None for out in outputs[1:])
    for index in range(n):
        reasons = finishes(outputs, index)
        assert len(reasons) == 1, f"choice {index} finished {reasons}"
        last = [c for out in outputs for c in out.choices if c.index == index][-1]
        assert last.finish_reason == reasons[0], "a delta followed the finishing one"
    assert {c.index for out in outputs for c in out.choices} == set(range(n))


# ---- the contract --------------------------------------------------------------------------
def test_ready_models_and_card(h):
    assert isinstance(h.engine, Engine)
    assert h.engine.ready()
    (card,) = h.engine.models()
    assert card.id == MODEL and card.kind == "generate"
    assert card.max_model_len == MAX_MODEL_LEN
    assert "paved" in card.constraint_backends
    assert card.max_logprobs >= 2


@pytest.mark.parametrize("stream", [True, False])
def test_deltas_concatenate_to_the_same_output(loop, h, stream):
    """Streamed or not, the deltas of a greedy request add up to the same text and tokens."""
    reference = collect(loop, h, request(max_tokens=12, ignore_eos=True, stream=False))
    assert len(reference) == 1, "stream=False sends one final output"
    outputs = collect(loop, h, request(max_tokens=12, ignore_eos=True, stream=stream))
    check_shape(outputs, 1)
    assert text_of(outputs) == text_of(reference) and text_of(outputs)
    assert tokens_of(outputs) == 12 and finishes(outputs) == ["length"]
    if h.caps["token_ids"]:
        ids = [t for out in outputs for c in out.choices for t in c.token_ids]
        assert len(ids) == 12
        assert ids == [t for out in reference for c in out.choices for t in c.token_ids]
    if stream:
        assert len(outputs) > 1, "a streaming request gets more than one delta"


def test_usage_counts_match_tokenize(loop, h):
    prompt = "Count these prompt tokens, please."
    ids = loop.run(h.engine.tokenize(MODEL, prompt, add_special_tokens=True))
    assert ids and all(isinstance(t, int) for t in ids)
    outputs = collect(loop, h, request(prompt, max_tokens=5, ignore_eos=True))
    assert outputs[0].prompt_tokens == len(ids)
    assert tokens_of(outputs) == 5


def test_continue_final_message_renders_the_last_message_open(loop, h):
    """The chat template renders a continued assistant message open: no end of turn and no new
    assistant header, so fewer prompt tokens than the same messages closed."""
    messages = [{"role": "user", "content": "Count to ten"}, {"role": "assistant", "content": "1, 2, 3,"}]
    closed = collect(loop, h, request(ChatPrompt(messages), max_tokens=2, ignore_eos=True))
    opened = collect(
        loop,
        h,
        request(
            ChatPrompt(messages, add_generation_prompt=False, continue_final_message=True),
            max_tokens=2,
            ignore_eos=True,
        ),
    )
    assert 0 < opened[0].prompt_tokens < closed[0].prompt_tokens
    assert tokens_of(opened) == 2


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_ends_with_length(loop, h, max_tokens):
    outputs = collect(loop, h, request(max_tokens=max_tokens, ignore_eos=True, stream=True))
    check_shape(outputs, 1)
    assert tokens_of(outputs) == max_tokens and finishes(outputs) == ["length"]


def test_natural_end_is_stop(loop, h):
    """Without ignore_eos the model may end by itself: then finish_reason is stop (not length)."""
    outputs = collect(loop, h, request(max_tokens=MAX_MODEL_LEN - 64, temperature=1.0, seed=3))
    check_shape(outputs, 1)
    (reason,) = finishes(outputs)
    assert reason in ("stop", "length")
    if reason == "length":
        assert tokens_of(outputs) == MAX_MODEL_LEN - 64


@pytest.mark.parametrize("stream", [True, False])
def test_n_choices(loop, h, stream):
    outputs = collect(
        loop, h, request(n=3, max_tokens=6, ignore_eos=True, temperature=1.0, seed=11, stream=stream)
    )
    check_shape(outputs, 3)
    for index in range(3):
        assert tokens_of(outputs, index) == 6 and finishes(outputs, index) == ["length"]
        assert text_of(outputs, index)


@pytest.mark.parametrize("stream", [True, False])
def test_choices_that_end_apart_each_finish_once(loop, h, stream):
    """n > 1 where a stop string ends some choices before the others: each choice still
    finishes exactly once, and nothing of it follows its finish."""
    sampling = dict(n=3, max_tokens=24, ignore_eos=True, temperature=1.0, seed=11)
    reference = collect(loop, h, request(**sampling))
    texts = [text_of(reference, i) for i in range(3)]
    # A character some choice holds early and another does not hold at that place.
    ends = {c: [t.find(c) if c in t else len(t) for t in texts] for c in set(texts[0][1:12])}
    stop = next((c for c, at in sorted(ends.items()) if len(set(at)) > 1 and min(at) > 0), None)
    assert stop, f"no stop string ending the choices apart in {texts!r}"
    outputs = collect(loop, h, request(stop=[stop], stream=stream, **sampling))
    check_shape(outputs, 3)
    for index, text in enumerate(texts):
        cut = text.find(stop)
        assert text_of(outputs, index) == (text if cut < 0 else text[:cut])
        assert finishes(outputs, index) == ["length" if cut < 0 else "stop"]


def test_stop_string_truncates_and_is_reported(loop, h):
    reference = text_of(collect(loop, h, request(max_tokens=40, ignore_eos=True)))
    # A stop string from the middle of the greedy output, at its first occurrence.
    stop = next(
        (
            reference[i : i + 2]
            for i in range(3, len(reference) - 2)
            if reference.find(reference[i : i + 2]) >= 3
        ),
        None,
    )
    assert stop, f"no usable stop string in {reference!r}"
    outputs = collect(loop, h, request(max_tokens=40, ignore_eos=True, stop=[stop], stream=True))
    check_shape(outputs, 1)
    assert text_of(outputs) == reference[: reference.find(stop)]
    assert finishes(outputs) == ["stop"]
    if h.caps["stop_reason"]:
        assert outputs[-1].choices[-1].stop_reason == stop


def test_logprobs(loop, h):
    outputs = collect(loop, h, request(max_tokens=4, ignore_eos=True, logprobs=2, stream=True))
    positions = [lp for out in outputs for c in out.choices for lp in c.logprobs or ()]
    assert len(positions) == 4
    for lp in positions:
        assert lp.logprob is not None and lp.logprob <= 0
        assert 1 <= len(lp.top) <= 2
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)


def test_prompt_logprobs_and_echo_or_refused(loop, h):
    req = request("abc def", max_tokens=0, prompt_logprobs=1, echo=True)
    if not h.caps["prefill_only"]:
        with pytest.raises(InvalidRequestError):
            loop.run(h.engine.generate(req))
        return
    outputs = collect(loop, h, req)
    (out,) = outputs
    assert out.finished and [c.finish_reason for c in out.choices] == ["length"]
    assert out.choices[0].token_count == 0 and not out.choices[0].text
    assert out.prompt_text == "abc def" and len(out.prompt_token_ids) == out.prompt_tokens
    assert len(out.prompt_logprobs) == out.prompt_tokens and out.prompt_logprobs[0].logprob is None


def test_token_prompt_or_refused(loop, h):
    ids = loop.run(h.engine.tokenize(MODEL, "hello world", add_special_tokens=True))
    req = request(TokenPrompt(ids), max_tokens=3, ignore_eos=True)
    if not h.caps["token_prompt"]:
        with pytest.raises(InvalidRequestError):
            loop.run(h.engine.generate(req))
        return
    outputs = collect(loop, h, req)
    assert outputs[0].prompt_tokens == len(ids) and tokens_of(outputs) == 3


def test_admission_errors_raise_from_generate(loop, h):
    """Client mistakes raise from `await generate(...)`, before any stream exists."""
    cases = [
        (request(max_tokens=MAX_MODEL_LEN * 2), InvalidRequestError),
        (request(max_tokens=4, logprobs=10_000), InvalidRequestError),
        (
            request(max_tokens=4, constraint=Constraint("paved", "paved", {"type": "regex", "pattern": "("})),
            InvalidRequestError,
        ),
        (GenerateRequest("conf-nf", "no-such-model", TextPrompt("x")), ModelNotFoundError),
    ]
    for req, error in cases:
        with pytest.raises(error):
            loop.run(h.engine.generate(req))
    with pytest.raises(InvalidRequestError, match="context"):
        loop.run(h.engine.generate(request("x " * MAX_MODEL_LEN, max_tokens=1)))
    assert h.in_flight() == 0


def test_prompt_too_long_names_the_numbers(loop, h):
    with pytest.raises(InvalidRequestError) as info:
        loop.run(h.engine.generate(request(max_tokens=MAX_MODEL_LEN * 2)))
    if isinstance(info.value, PromptTooLongError):
        assert info.value.max_model_len == MAX_MODEL_LEN
    assert str(MAX_MODEL_LEN) in str(info.value)


def test_overloaded_raises_from_generate(loop, h):
    if not h.caps["overload"]:
        pytest.skip(f"{h.kind}: no queue bound configured")

    async def run():
        hog = await h.engine.generate(request(n=MAX_NUM_SEQS, max_tokens=LONG, ignore_eos=True, stream=True))
        try:
            first = await anext(hog)
            assert not first.finished
            with pytest.raises(EngineOverloadedError):
                await h.engine.generate(request(max_tokens=4))
        finally:
            await hog.aclose()

    loop.run(run(), timeout=120)


@pytest.mark.parametrize("iterated", [True, False])
def test_closing_the_stream_aborts_and_frees_the_slot(loop, h, iterated):
    aborted = h.aborted()

    async def run():
        stream = await h.engine.generate(request(max_tokens=LONG, ignore_eos=True, stream=True))
        assert isinstance(stream, GenerateStream)
        if iterated:
            assert not (await anext(stream)).finished
        held = h.in_flight()
        await stream.aclose()
        return held

    held = loop.run(run(), timeout=120)
    assert held >= 1, "the request was not in the engine before the close"
    assert wait_for(lambda: h.in_flight() == 0, timeout=30), f"{h.in_flight()} request(s) still held"
    if h.caps["abort_counted"]:
        assert wait_for(lambda: h.aborted() > aborted, timeout=30)


def test_abort_by_request_id_ends_the_stream(loop, h):
    async def run():
        req = request(max_tokens=LONG, ignore_eos=True, stream=True)
        stream = await h.engine.generate(req)
        try:
            assert not (await anext(stream)).finished
            await h.engine.abort(req.request_id)
            return [out async for out in stream]
        finally:
            await stream.aclose()

    rest = loop.run(asyncio.wait_for(run(), 60), timeout=120)
    assert rest and rest[-1].finished
    assert finishes(rest) == ["abort"]


def test_structured_output_paved_json_is_valid(loop, h):
    spec = validate_spec({"type": "json_schema", "schema": SCHEMA})
    for seed in range(3):
        outputs = collect(
            loop,
            h,
            request(
                f"Answer in JSON ({seed}):",
                max_tokens=64,
                temperature=1.0,
                seed=seed,
                constraint=Constraint("paved", "paved", spec),
                stream=seed % 2 == 0,
            ),
        )
        check_shape(outputs, 1)
        text = text_of(outputs)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert finishes(outputs) == ["stop"], text


def test_structured_output_paved_choice(loop, h):
    spec = validate_spec({"type": "choice", "items": ["red", "green", "blue"], "k": 2, "separator": "|"})
    outputs = collect(
        loop,
        h,
        request(max_tokens=16, temperature=1.0, seed=5, constraint=Constraint("paved", "paved", spec)),
    )
    parts = text_of(outputs).split("|")
    assert len(parts) == 2 and set(parts) <= {"red", "green", "blue"}, text_of(outputs)
