"""Writes the conformance repository's TorchScript and ONNX models (run from the main venv:
`.venv/bin/python libs/tests/kserve/testdata/conformance/generate.py`). Both compute
Y = X @ W + B with the same fixed weights, so a test can check them against numpy. The files are
committed; this script records how they were made."""

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
W = (np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5) / 4
B = np.array([0.5, -0.25, 1.0, 0.0], dtype=np.float32)


def torchscript(path: Path) -> None:
    import torch

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.from_numpy(W), requires_grad=False)
            self.b = torch.nn.Parameter(torch.from_numpy(B), requires_grad=False)

        def forward(self, x):
            return x @ self.w + self.b

    torch.jit.script(Linear()).save(str(path))


def onnx_model(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["Y"])],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="paved")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


if __name__ == "__main__":
    torchscript(HERE / "torch_linear" / "1" / "model.pt")
    onnx_model(HERE / "onnx_linear" / "1" / "model.onnx")
