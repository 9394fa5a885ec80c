"""BLS: SUM from add_sub through exec(), DIFF through async_exec() (execute is a coroutine),
STREAMED from the decoupled `repeat` through exec(decoupled=True), ERROR: the error a call to
a model that does not exist comes back with."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            inputs = [pb_utils.Tensor("INPUT0", a[None, :]), pb_utils.Tensor("INPUT1", b[None, :])]
            summed = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT0"], inputs=inputs
            ).exec()
            if summed.has_error():
                raise pb_utils.TritonModelException(summed.error().message())
            diff = await pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT1"], inputs=inputs
            ).async_exec()
            streamed = []
            repeat = pb_utils.InferenceRequest(
                model_name="repeat",
                requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", a.astype(np.int32))],
            )
            for response in repeat.exec(decoupled=True):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                out = pb_utils.get_output_tensor_by_name(response, "OUT")
                if out is not None:
                    streamed.append(int(out.as_numpy()[0]))
            missing = pb_utils.InferenceRequest(
                model_name="no_such_model", requested_output_names=["OUTPUT0"], inputs=inputs
            ).exec()
            error = missing.error().message() if missing.has_error() else ""
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor(
                            "SUM", pb_utils.get_output_tensor_by_name(summed, "OUTPUT0").as_numpy()[0]
                        ),
                        pb_utils.Tensor(
                            "DIFF", pb_utils.get_output_tensor_by_name(diff, "OUTPUT1").as_numpy()[0]
                        ),
                        pb_utils.Tensor("STREAMED", np.array(streamed, dtype=np.int32)),
                        pb_utils.Tensor("ERROR", np.array([error.encode()], dtype=np.object_)),
                    ]
                )
            )
        return responses
