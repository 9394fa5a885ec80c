"""Decoupled: one response per element of IN (OUT = the element, IDX = its index), then the
final flag alone. Request parameter "from_thread": true sends from a thread after execute()
returned; an empty IN sends nothing but the final flag."""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        assert pb_utils.using_decoupled_model_transaction_policy(config)

    def _stream(self, request):
        sender = request.get_response_sender()
        values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        for i, value in enumerate(values):
            if sender.is_cancelled():
                rid = request.request_id()
                pb_utils.Logger.log_info(f"repeat: request '{rid}' cancelled after {i} responses")
                break
            sender.send(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                        pb_utils.Tensor("IDX", np.array([i], dtype=np.uint32)),
                    ]
                )
            )
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            if params.get("from_thread"):
                threading.Thread(target=self._stream, args=(request,)).start()
            else:
                self._stream(request)
        return None
