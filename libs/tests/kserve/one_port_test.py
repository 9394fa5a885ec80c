"""A frontend with KServe on serves KServe v2 HTTP on its own HTTP port too (under /v2), as
Triton serves every model over HTTP on one port: the port a replica advertises as its KServe
HTTP address. Real process (`python -m paved.frontend.server --engine sim://tiny
--kserve-grpc-port 0`, no --kserve-http-port), the real tritonclient (HTTP and gRPC) and httpx.
"""

import httpx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from servers import ServerProcess
from tritonclient.utils import InferenceServerException

from libs.tests.kserve.kserve_fakes import llm_inputs

MODEL = "tiny"
PARAMS = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        "--engine", f"sim://{MODEL}", "--model", MODEL, "--kserve-grpc-port", "0", ready_timeout_s=120
    )
    yield process
    process.terminate()


def test_the_llm_is_served_over_kserve_http_on_the_frontends_port(server):
    assert server.kserve_http_port is None  # no KServe HTTP port of its own
    host_port = server.url.removeprefix("http://")
    hc = httpclient.InferenceServerClient(host_port, network_timeout=60)
    gc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.kserve_grpc_port}")
    try:
        assert hc.is_server_live() and hc.is_server_ready()
        assert hc.is_model_ready(MODEL) and not hc.is_model_ready("nope")
        assert hc.get_model_metadata(MODEL)["name"] == MODEL
        inputs = llm_inputs(httpclient, "The quick brown fox", params=PARAMS, exclude=True)
        text = hc.infer(MODEL, inputs).as_numpy("text_output")[0]
        grpc_inputs = llm_inputs(grpcclient, "The quick brown fox", params=PARAMS, exclude=True)
        over_grpc = gc.infer(MODEL, grpc_inputs)
        assert text and text == over_grpc.as_numpy("text_output")[0]
        # KServe's own answers on its paths: an unknown model is its 404 with {"error": ...}.
        with pytest.raises(InferenceServerException) as e:
            hc.infer("nope", inputs)
        assert "404" in str(e.value.status())
    finally:
        hc.close()
        gc.close()
    # The OpenAI API and paved's probes on the same port are unchanged.
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(server.url + "/health/ready").status_code == 200
    missing = httpx.get(server.url + "/v2/models/nope/ready")
    assert missing.status_code == 400 and "error" in missing.json()
