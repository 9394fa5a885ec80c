"""The deliberately bad pin (images/testdata/bad_pin_gpu.lock.toml: Triton 25.09's vLLM backend,
which imports vllm.engine.metrics, with vLLM 0.33.0) must FAIL the compatibility check, with a
message naming the module and both versions. This test asserts that failure, so it passes."""

import subprocess

import pytest

from paved.images import compat
from paved.images import lock as locks


@pytest.fixture(scope="module")
def fixture_lock(runfile):
    return locks.load(runfile("BAD_PIN_LOCK"))


def test_the_fixture_is_the_seed_failure(fixture_lock):
    assert fixture_lock.triton.release == "25.09"
    assert "vllm.engine.metrics:StatLoggerBase" in fixture_lock.triton.vllm_backend_imports
    assert tuple(int(x) for x in fixture_lock.engine.version.split(".")[:3]) >= (0, 11, 2)


def test_the_check_fails_naming_module_and_both_versions(fixture_lock, runfile):
    report = compat.check(fixture_lock, compat.Wheel(runfile("GPU_WHEEL")), {})
    assert not report.ok
    metrics = [e for e in report.errors if "vllm.engine.metrics" in e]
    assert len(metrics) == 1, report.errors
    msg = metrics[0]
    assert "Triton 25.09" in msg and "vllm 0.33.0" in msg
    assert "has no module vllm.engine.metrics" in msg
    for name in ("StatLoggerBase", "Stats", "SupportsMetricsInfo", "build_1_2_5_buckets"):
        assert name in msg


def test_the_command_line_exits_nonzero_with_the_message(runfile, tmp_path):
    proc = subprocess.run(
        [
            str(runfile("TOOL")),
            "compat",
            "--lock",
            str(runfile("BAD_PIN_LOCK")),
            "--wheel",
            str(runfile("GPU_WHEEL")),
            "--out",
            str(tmp_path / "report.json"),
            "--strict",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "FAILED" in proc.stderr
    assert (
        "Triton 25.09" in proc.stderr
        and "vllm.engine.metrics" in proc.stderr
        and "vllm 0.33.0" in proc.stderr
    )
