"""The engine contract on the simulated engine and on KServeEngine (over paved's KServe gRPC
server fronting a sim engine with //models/tiny's tokenizer). No model runs: seconds."""

import pytest

from libs.tests.engine.conformance import *  # noqa: F403 (the suite's tests and fixtures)


@pytest.fixture(scope="module", params=["sim", "kserve"])
def engine_kind(request):
    return request.param
