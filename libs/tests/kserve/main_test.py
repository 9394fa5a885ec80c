"""The standalone KServe main (//services/kserve:serve) as a process: serves, answers, shows its
request metrics at /metrics on its HTTP port, stops on SIGTERM."""

import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

from libs.tests.kserve.kserve_fakes import kserve_main, run_kserve_main, wait_for, xgb_model_dir


def test_serves_a_model_directory_and_stops_on_sigterm():
    with kserve_main("--model-dir", xgb_model_dir(), "--log-level", "warning") as (grpc_port, http_port):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert wait_for(client.is_server_ready, timeout=30)
        x = np.zeros((2, 32), np.float32)
        t = grpcclient.InferInput("input__0", [2, 32], "FP32")
        t.set_data_from_numpy(x)
        assert client.infer("xgb_scorer", [t]).as_numpy("output__0").shape == (2, 3)
        client.close()
        # Its request metrics, on its HTTP port (what the launcher merges for a kserve package).
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'paved_kserve_request_success_total{model="xgb_scorer",protocol="grpc"} 1.0' in text, text
        assert 'paved_kserve_inference_count_total{model="xgb_scorer",protocol="grpc"} 2.0' in text


def test_bad_arguments_exit_2(tmp_path):
    result = run_kserve_main("--model-dir", str(tmp_path))
    assert result.returncode == 2 and "config.json" in result.stderr
