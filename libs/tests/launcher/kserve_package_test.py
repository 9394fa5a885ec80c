"""Kserve-mode packages: the XGBoost fixture (//models/xgb) packaged with `--mode kserve`, and
the launcher serving it through paved.kserve.

  * the package: no tokenizer, the whole directory as weights; build_package refuses a model id
    other than the Triton config's `name`, and model.json refuses a kserve package with a
    tokenizer or plugins and an LLM package without a tokenizer;
  * the launcher (its CLI, as the control plane's local driver starts it): KServe v2 gRPC on the
    public gRPC port and HTTP on the public HTTP port score as xgboost does; /health/ready is
    200 once ready; its metrics port shows paved.kserve's paved_kserve_* request metrics for
    those inferences; SIGTERM drains and exits 0; `--mode` cannot turn it into an LLM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import xgboost

from paved.launcher.build import build_package
from paved.launcher.build import main as build_main
from paved.launcher.gate import free_port
from paved.launcher.main import main as launch_main
from paved.launcher.package import PackageError, parse_model_json
from paved.launcher.testing import LauncherProcess, minimal_hf_dir
from paved.runfiles import runfile

XGB = "xgb_scorer"


@pytest.fixture(scope="module")
def xgb_dir(tmp_path_factory) -> str:
    # Just the model directory's two files (a checkout's bazel-bin folder holds more).
    out = tmp_path_factory.mktemp("xgb-dir")
    for name in ("config.json", "model.ubj"):
        shutil.copyfile(runfile(f"models/xgb/{name}"), out / name)
    return str(out)


@pytest.fixture(scope="module")
def package(tmp_path_factory, xgb_dir):
    out = tmp_path_factory.mktemp("xgb") / "pkg"
    build_package(xgb_dir, str(out), XGB, "1", mode="kserve")
    return out


def test_the_package_is_the_model_directory_without_a_tokenizer(package, xgb_dir, tmp_path, capsys):
    m = json.loads((package / "model.json").read_text())
    assert m["mode"] == "kserve" and m["tokenizer"] is None
    assert sorted(f["path"] for f in m["weights"]["files"]) == sorted(os.listdir(xgb_dir))
    # The model id is the name KServe clients call: it must be the config's.
    assert build_main(["--hf-dir", xgb_dir, "--out", str(tmp_path / "p"), "--model-id", "other",
                       "--version", "1", "--mode", "kserve"]) == 2  # fmt: skip
    assert "names the model 'xgb_scorer', not 'other'" in capsys.readouterr().err
    with_tokenizer = dict(m, tokenizer={"uri": "tokenizer", "files": m["weights"]["files"][:1]})
    with pytest.raises(PackageError, match="a kserve package has no tokenizer"):
        parse_model_json(json.dumps(with_tokenizer))
    llm = dict(m, mode="embedded")
    with pytest.raises(PackageError, match=r"mode .embedded. needs a tokenizer"):
        parse_model_json(json.dumps(llm))
    # An LLM folder still needs its tokenizer files.
    hf = minimal_hf_dir(tmp_path / "hf")
    for name in os.listdir(hf):
        if name.startswith("tokenizer"):
            os.remove(os.path.join(hf, name))
    with pytest.raises(ValueError, match="no tokenizer files"):
        build_package(hf, str(tmp_path / "llm"), "fake", "1")


def _status_ports(admin_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/status", timeout=10) as r:
        return json.loads(r.read())["ports"]


def _ready(path: str, port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status


def test_the_launcher_serves_a_kserve_package_over_grpc_and_http(package, tmp_path, xgb_dir):
    grpc_port, http_port, admin_port = free_port(), free_port(), free_port()
    args = [
        str(package), "--cache-dir", str(tmp_path / "cache"), "--port", str(http_port),
        "--admin-port", str(admin_port),
        "--grpc-port", str(grpc_port), "--metrics-dir", str(tmp_path / "prom"), "--metrics-port", "0",
    ]  # fmt: skip
    proc = LauncherProcess(args, str(tmp_path / "launcher.log"))
    try:
        assert proc.wait_line(r"paved launcher: ready: xgb_scorer:1 on http .*grpc", 120), proc.stderr()[
            -3000:
        ]
        assert _ready("/health/ready", http_port) == 200
        assert _ready("/v2/health/ready", http_port) == 200
        x = np.random.default_rng(2).standard_normal((5, 32)).astype(np.float32)
        expected = xgboost.Booster(model_file=os.path.join(xgb_dir, "model.ubj")).inplace_predict(x)
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        h = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        try:
            for module, client in ((grpcclient, g), (httpclient, h)):
                t = module.InferInput("input__0", [5, 32], "FP32")
                t.set_data_from_numpy(x)
                assert np.array_equal(client.infer(XGB, [t]).as_numpy("output__0"), expected)
        finally:
            g.close()
            h.close()
        metrics_port = _status_ports(admin_port)["metrics"][1]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        # Both sources are up: the engine files, and paved.kserve's own /metrics (its process
        # families; its request metrics it records in the files too, and those are the ones kept).
        assert 'paved_metrics_proxy_up{source="engine"} 1.0' in text, text[:2000]
        assert 'paved_metrics_proxy_up{source="frontend"} 1.0' in text, text[:2000]
        # The two inferences above, one per protocol, of 5 rows each, exactly once each.
        for protocol in ("grpc", "http"):
            labels = f'{{model="xgb_scorer",protocol="{protocol}"}}'
            assert f"paved_kserve_request_success_total{labels} 1.0" in text, text
            assert f"paved_kserve_inference_count_total{labels} 5.0" in text, text
            assert f"paved_kserve_request_duration_seconds_count{labels} 1.0" in text, text
        # Once each: the child's copy of what the files hold is not repeated.
        assert text.count("\npaved_kserve_request_success_total{") == 2, text
        assert "process_cpu_seconds_total" in text  # the child's own families are merged
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr()[-3000:]
    finally:
        proc.kill()


def test_mode_cannot_turn_a_kserve_package_into_an_llm(package, tmp_path, capsys):
    args = [str(package), "--cache-dir", str(tmp_path / "cache"), "--port", "0", "--mode", "embedded"]
    assert launch_main(args) == 1
    assert "is a kserve package" in capsys.readouterr().err
