"""Pre-process -> LLM -> post-process in one Python model: the prompt is upper-cased, sent to
the server's LLM (parameter "llm") as a streaming BLS request with the vLLM backend's tensors,
and each streamed piece comes back wrapped in brackets."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.llm = json.loads(args["model_config"])["parameters"]["llm"]["string_value"]

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()[0].decode()
            llm_request = pb_utils.InferenceRequest(
                model_name=self.llm,
                requested_output_names=["text_output"],
                inputs=[
                    pb_utils.Tensor("text_input", np.array([prompt.upper().encode()], dtype=np.object_)),
                    pb_utils.Tensor("stream", np.array([True])),
                    pb_utils.Tensor(
                        "sampling_parameters",
                        np.array([json.dumps({"max_tokens": 3}).encode()], dtype=np.object_),
                    ),
                ],
            )
            for response in llm_request.exec(decoupled=True):
                if response.has_error():
                    sender.send(pb_utils.InferenceResponse(error=response.error()))
                    break
                text = pb_utils.get_output_tensor_by_name(response, "text_output")
                if text is not None:
                    piece = b"[" + text.as_numpy()[0] + b"]"
                    sender.send(
                        pb_utils.InferenceResponse(
                            [pb_utils.Tensor("TEXT", np.array([piece], dtype=np.object_))]
                        )
                    )
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
