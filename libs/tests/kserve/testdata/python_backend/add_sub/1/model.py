"""Sum and difference of two FP32 tensors; REQUESTS tells how many requests shared the
execute() call (dynamic batching passes them together, each with its own tensors)."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])
        self.scale = float(self.config["parameters"]["scale"]["string_value"])
        out0 = pb_utils.get_output_config_by_name(self.config, "OUTPUT0")
        self.out_dtype = pb_utils.triton_string_to_numpy(out0["data_type"])
        print(f"initialized {args['model_instance_name']} kind={args['model_instance_kind']}", flush=True)
        pb_utils.Logger.log_info(f"add_sub instance {args['model_instance_name']} ready")

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            count = np.full((a.shape[0], 1), len(requests), dtype=np.int32)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("OUTPUT0", ((a + b) * self.scale).astype(self.out_dtype)),
                        pb_utils.Tensor("OUTPUT1", ((a - b) * self.scale).astype(self.out_dtype)),
                        pb_utils.Tensor("REQUESTS", count),
                    ]
                )
            )
        return responses

    def finalize(self):
        print("finalize add_sub", flush=True)
