"""For COUNT = n: n responses, response i carrying INDEX = [i] and OUT = DATA * (i + 1); then the
final flag alone."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            data = pb_utils.get_input_tensor_by_name(request, "DATA").as_numpy()
            for i in range(count):
                sender.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[
                            pb_utils.Tensor("INDEX", np.array([i], dtype=np.int32)),
                            pb_utils.Tensor("OUT", (data * np.float32(i + 1)).astype(np.float32)),
                        ]
                    )
                )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
