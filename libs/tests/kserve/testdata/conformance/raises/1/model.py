import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] < 0:
                raise pb_utils.TritonModelException("negative input refused by the model")
            if x[0] == 0:
                responses.append(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError("zero refused by the model"))
                )
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Y", x)]))
        return responses
