"""`reshape` as Triton validates it: the same repository of Python-backend models, each with one
`dims` / `reshape` pair, served by the real tritonserver 2.51 and by paved's KServe server; every
model must be READY on paved exactly when it is READY on Triton.

Triton's rule: a reshape without a variable-size dimension holds as many elements as `dims`; one
with variable-size dimensions (-1) splits, at them, into pieces of the same element counts as
`dims` does. So `dims [-1]` with `reshape [2, -1]` is refused (its leading piece holds 2 elements
where dims' holds 1): a request of 3 elements could not be reshaped. paved accepted it, and such a
request was answered 500 (numpy's "cannot reshape array of size 3"). paved still refuses more than
one -1 with a reshape, which Triton accepts (listed in `PAVED_STRICTER`).

A model both accept is asked with a variable-size request, and paved's answer must equal Triton's
bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from libs.tests.kserve.triton_server import TritonUrls, paved_kserve_server, triton_server

MODEL_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            y = x.reshape(x.shape[0], -1)
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Y", y)]))
        return out
"""

# name -> (input dims, input reshape)
CASES = {
    "var_lead_piece_differs": ([-1], [2, -1]),
    "var_pieces_swapped": ([2, -1], [-1, 2]),
    "var_trailing_piece_differs": ([-1, 4], [-1, 3]),
    "fixed_count_differs": ([2], [3]),
    "var_trailing_one": ([-1], [-1, 1]),
    "var_trailing_split": ([-1, 4], [-1, 2, 2]),
    "var_leading_merged": ([2, 3, -1], [6, -1]),
    "fixed_to_scalar": ([1], []),
    "two_variable": ([-1, 2, -1], [-1, 2, -1]),
}
# Accepted by Triton, refused by paved with the reason (its reshape handles one -1).
PAVED_STRICTER = {"two_variable"}


def _config(dims: list[int], reshape: list[int]) -> str:
    return (
        'backend: "python"\nmax_batch_size: 4\n'
        f'input [ {{ name: "X" data_type: TYPE_FP32 dims: {dims} reshape {{ shape: {reshape} }} }} ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reshape") / "repository"
    for name, (dims, reshape) in CASES.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(_config(dims, reshape))
        (root / name / "1" / "model.py").write_text(MODEL_PY)
    return root


def _index(urls: TritonUrls, *, settled: bool) -> dict[str, dict]:
    """The repository index by model name; with `settled`, once no model is still loading."""
    with httpclient.InferenceServerClient(urls.http) as client:
        deadline = time.monotonic() + 60
        while True:
            index = {m["name"]: m for m in client.get_model_repository_index()}
            loading = [n for n, m in index.items() if m.get("state") not in ("READY", "UNAVAILABLE")]
            if not (settled and loading) or time.monotonic() > deadline:
                return index
            time.sleep(0.1)


def _infer(urls: TritonUrls, model: str, x: np.ndarray) -> tuple[str, bytes, list[int]]:
    with httpclient.InferenceServerClient(urls.http) as client:
        tensor = httpclient.InferInput("X", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        wanted = [httpclient.InferRequestedOutput("Y", binary_data=True)]
        result = client.infer(model, [tensor], outputs=wanted)
        y = result.as_numpy("Y")
        return str(y.dtype), y.tobytes(), list(y.shape)


@pytest.fixture(scope="module")
def servers(repository, tmp_path_factory):
    flags = ["--exit-on-error=false", "--strict-readiness=false"]
    with (
        triton_server(repository, tmp_path_factory.mktemp("triton"), extra_args=flags) as triton,
        paved_kserve_server(repository, tmp_path_factory.mktemp("paved")) as paved,
    ):
        yield triton, paved


def test_a_reshape_loads_on_paved_exactly_when_it_loads_on_triton(servers):
    triton, paved = servers
    on_triton = {n: m.get("state") == "READY" for n, m in _index(triton, settled=True).items()}
    paved_index = _index(paved, settled=True)
    on_paved = {n: m.get("state") == "READY" for n, m in paved_index.items()}
    # The cases themselves: Triton refuses the ones whose pieces differ.
    assert {n for n, ready in on_triton.items() if not ready} == {
        "var_lead_piece_differs",
        "var_pieces_swapped",
        "var_trailing_piece_differs",
        "fixed_count_differs",
    }
    expected = {n: ready and n not in PAVED_STRICTER for n, ready in on_triton.items()}
    assert on_paved == expected, paved_index
    for name in [n for n, ready in expected.items() if not ready]:
        assert "reshape" in paved_index[name]["reason"], paved_index[name]


@pytest.mark.parametrize(
    "model, shape",
    [
        ("var_trailing_one", [1, 3]),
        ("var_trailing_one", [2, 0]),
        ("var_trailing_split", [2, 5, 4]),
        ("var_leading_merged", [1, 2, 3, 7]),
        ("fixed_to_scalar", [3, 1]),
    ],
)
def test_variable_size_requests_answer_as_triton_does(servers, model, shape):
    triton, paved = servers
    x = (np.arange(int(np.prod(shape)), dtype=np.float32) * np.float32(0.37)).reshape(shape)
    assert _infer(paved, model, x) == _infer(triton, model, x)
