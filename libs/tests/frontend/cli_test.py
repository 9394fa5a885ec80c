"""The serve CLI and config file: bad input exits 2 with a message naming the problem, before
any engine starts; good files parse into in-process and remote models plus KServe settings."""

import json
import socket

import pytest

from libs.tests.kserve.kserve_fakes import xgb_model_dir
from paved.frontend import config as config_file
from paved.frontend.config import RemoteModelConfig
from paved.frontend.server import main
from paved.testing.fixtures import tiny_model_dir


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--engine", "kserve://127.0.0.1:9"], "--engine needs --model"),
        (["--engine", "http://127.0.0.1:9", "--model", "m"], "expected kserve://HOST:PORT"),
        (["--engine", "kserve://127.0.0.1:9?colour=red", "--model", "m"], "unknown option(s) ['colour']"),
        (["--engine", "kserve://127.0.0.1:9", "--model", "m", "--dtype", "float32"], "--dtype"),
        (["--engine", "kserve://127.0.0.1:9", "--model", "m", "--config", "x.toml"], "not allowed with"),
        (
            ["--engine", "kserve://h:9", "--model", "m", "--port", "8001", "--kserve-grpc-port", "8001"],
            "differ",
        ),
        (["--engine", "kserve://h:9", "--model", "m", "--kserve-http-port", "70000"], "kserve_http_port"),
        (
            ["--engine", "kserve://h:9", "--model", "m", "--kserve-model-dir", "/nonexistent"],
            "kserve_model_dirs",
        ),
        (
            [
                "--engine",
                "kserve://h:9",
                "--model",
                "m",
                "--kserve-grpc-port",
                "0",
                "--kserve-model-dir",
                "/no",
            ],
            "not a KServe model directory",
        ),
        (["--model", "/nonexistent/model"], "not a Hugging Face model directory"),
    ],
)
def test_bad_flags_exit_2_with_a_message(capsys, argv, needle):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("fd", ["-1", "99999", "file", "udp"])
def test_a_listen_fd_that_is_not_a_tcp_socket_exits_2(capsys, tmp_path, fd):
    with open(tmp_path / "f", "w") as f, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        number = {"file": str(f.fileno()), "udp": str(udp.fileno())}.get(fd, fd)
        argv = ["--engine", "kserve://127.0.0.1:9", "--model", "m", "--port", "0", "--listen-fd", number]
        code = main(argv)
        assert udp.fileno() >= 0  # a refused descriptor is left to its owner
    assert code == 2
    assert f"--listen-fd {number}" in capsys.readouterr().err


def test_config_file_with_remote_and_kserve(tmp_path):
    path = tmp_path / "paved.toml"
    path.write_text(
        f"""
[server]
port = 8100
kserve_grpc_port = 8101
kserve_http_port = 0
kserve_model_dirs = ["{xgb_model_dir()}"]

[[models]]
name = "tiny"
path = "{tiny_model_dir()}"

[[models]]
name = "llama"
engine = "kserve://127.0.0.1:8001?max_model_len=4096"
max_queued_sequences = 64
"""
    )
    config = config_file.load(str(path))
    assert config.kserve and config.kserve_grpc_port == 8101 and config.kserve_http_port == 0
    assert config.kserve_model_dirs == [xgb_model_dir()]
    remote = config.models[1]
    assert isinstance(remote, RemoteModelConfig) and remote.max_queued_sequences == 64
    engine = config_file.make_engine(remote)
    assert (engine.target, engine.model) == ("127.0.0.1:8001", "llama")


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"name": "m", "engine": "kserve://h:1", "path": "/x"}, "unknown key(s) ['path']"),
        ({"name": "", "engine": "kserve://h:1"}, "non-empty 'name'"),
        ({"name": "m", "engine": "kserve://h"}, "expected kserve://HOST:PORT"),
        ({"name": "m", "engine": "kserve://h:1", "max_queued_sequences": 0}, "max_queued_sequences"),
    ],
)
def test_bad_remote_entries_name_the_problem(tmp_path, entry, needle):
    path = tmp_path / "paved.json"
    path.write_text(json.dumps({"models": [entry]}))
    with pytest.raises(ValueError) as e:
        config_file.load(str(path))
    assert needle in str(e.value)


def test_kserve_keys_are_validated_in_files(tmp_path):
    path = tmp_path / "paved.json"
    model = {"name": "m", "engine": "kserve://h:1"}
    path.write_text(json.dumps({"server": {"kserve_model_dirs": "xgb"}, "models": [model]}))
    with pytest.raises(ValueError, match="list of directory paths"):
        config_file.load(str(path))
    path.write_text(json.dumps({"server": {"kserve_grpc_port": "8001"}, "models": [model]}))
    with pytest.raises(ValueError, match="kserve_grpc_port must be an integer"):
        config_file.load(str(path))


def test_engines_started_settles_the_process(monkeypatch):
    """Once the engines are up the server freezes start-up's objects out of the collector and
    has vLLM (when loaded) cache its environment, as vLLM's own engine processes do."""
    import gc
    import sys
    import types

    import uvicorn

    from paved.frontend.registry import ModelRegistry
    from paved.frontend.server import _Server

    cached = []
    monkeypatch.setitem(
        sys.modules, "vllm.envs", types.SimpleNamespace(enable_envs_cache=lambda: cached.append(True))
    )
    gc.unfreeze()
    server = _Server(uvicorn.Config(app=None), ModelRegistry([]))
    try:
        server.engines_started()
        assert gc.get_freeze_count() > 0
        assert cached == [True]
    finally:
        gc.unfreeze()
