"""Misbehaves on request. OP: 0 answers its process id; 1 exits the process (os._exit);
2 hangs; 3 dies of SIGSEGV; 4 raises ValueError; 5 answers with a TritonError (INVALID_ARG);
6 returns an output the config does not declare."""

import ctypes
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            op = int(pb_utils.get_input_tensor_by_name(request, "OP").as_numpy()[0])
            if op == 1:
                os._exit(3)
            if op == 2:
                time.sleep(3600)
            if op == 3:
                ctypes.string_at(0)
            if op == 4:
                raise ValueError("boom from faulty")
            if op == 5:
                error = pb_utils.TritonError("op 5 is refused", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            name = "UNDECLARED" if op == 6 else "PID"
            pid = pb_utils.Tensor(name, np.array([os.getpid()], dtype=np.int64))
            responses.append(pb_utils.InferenceResponse([pid]))
        return responses
