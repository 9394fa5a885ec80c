"""Y = (X + 1) * 2, where X + 1 is add_sub's OUTPUT0 for INPUT0 = X, INPUT1 = ones (a BLS call)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="add_sub",
                requested_output_names=["OUTPUT0"],
                inputs=[
                    pb_utils.Tensor("INPUT0", x[None, :]),
                    pb_utils.Tensor("INPUT1", np.ones((1, 4), dtype=np.float32)),
                ],
            )
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            total = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()[0]
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Y", total * np.float32(2))])
            )
        return responses
