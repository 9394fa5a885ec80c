"""The standalone KServe main (//services/kserve:serve) as a process: serves, answers, shows its
request metrics at /metrics on its HTTP port, stops on SIGTERM."""

import os
import re
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

from libs.tests.kserve.kserve_fakes import wait_for, xgb_model_dir


def test_serves_a_model_directory_and_stops_on_sigterm():
    code = "import sys; from paved.kserve.main import main; sys.exit(main(sys.argv[1:]))"
    args = ["--model-dir", xgb_model_dir(), "--grpc-port", "0", "--http-port", "0", "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"gRPC (\d+) HTTP (\d+)", line)
        assert match, line
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{match.group(1)}")
        assert wait_for(client.is_server_ready, timeout=30)
        x = np.zeros((2, 32), np.float32)
        t = grpcclient.InferInput("input__0", [2, 32], "FP32")
        t.set_data_from_numpy(x)
        assert client.infer("xgb_scorer", [t]).as_numpy("output__0").shape == (2, 3)
        client.close()
        # Its request metrics, on its HTTP port (what the launcher merges for a kserve package).
        with urllib.request.urlopen(f"http://127.0.0.1:{match.group(2)}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'paved_kserve_request_success_total{model="xgb_scorer",protocol="grpc"} 1.0' in text, text
        assert 'paved_kserve_inference_count_total{model="xgb_scorer",protocol="grpc"} 2.0' in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_arguments_exit_2(tmp_path):
    code = "import sys; from paved.kserve.main import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, "-c", code, "--model-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2 and "config.json" in result.stderr
