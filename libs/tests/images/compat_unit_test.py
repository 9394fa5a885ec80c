"""The static checker on small synthetic wheels: what it finds, and what it must not flag."""

import textwrap
import zipfile

import pytest

from paved.images import compat
from paved.images import lock as locks

IFACE_V1 = """
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from vllm.config import VllmConfig

class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, sampling_params):
        return None

    @abstractmethod
    def __init__(self, vllm_config, device, is_pin_memory): ...

    @abstractmethod
    def apply(self, logits): ...

    @abstractmethod
    def update_state(self, batch_update): ...
"""

INIT = """
import typing
MODULE_ATTRS = {"SamplingParams": ".sampling_params:SamplingParams", "Ghost": ".nowhere:Ghost"}
if typing.TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams
else:
    def __getattr__(name):
        raise AttributeError(name)
"""


def make_wheel(tmp_path, files, name="vllm", version="0.99.0", requires=("torch==2.14.0",)):
    path = tmp_path / f"{name}-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, textwrap.dedent(text))
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return compat.Wheel(path)


BASE_FILES = {
    "vllm/__init__.py": INIT,
    "vllm/sampling_params.py": "class SamplingParams: ...\n",
    "vllm/v1/sample/logits_processor/__init__.py": "from .interface import *\n",
    "vllm/v1/sample/logits_processor/interface.py": IFACE_V1,
    "vllm/v1/metrics/loggers.py": (
        "from vllm.v1.metrics.buckets import build_1_2_5_buckets as b125\nclass StatLoggerBase: ...\n"
    ),
    "vllm/v1/metrics/buckets.py": "def build_1_2_5_buckets(max_value): ...\n",
    "vllm/_C.abi3.so": "",
    "vllm/plugins/__init__.py": "GROUP = 'vllm.logits_processors'\n",
}

OURS = """
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import LogitsProcessor as V1
import vllm.v1.metrics.loggers as loggers
try:
    from vllm.optional_thing import Maybe
except ImportError:
    Maybe = None

class Ours(V1):
    def __init__(self, vllm_config, *args): ...
    def apply(self, logits, ctx=None): ...
    def update_state(self, batch_update): ...
    @classmethod
    def validate_params(cls, sampling_params): ...
    def helper(self): ...

class Logger(loggers.StatLoggerBase):
    pass
"""


def test_collect_finds_imports_aliases_and_subclasses():
    refs, subs = compat.collect({"p.py": OURS})
    texts = {r.text() for r in refs}
    assert texts == {
        "vllm:SamplingParams",
        "vllm.v1.sample.logits_processor:LogitsProcessor",
        "vllm.v1.metrics.loggers",
        "vllm.optional_thing:Maybe",
    }
    assert [r.text() for r in refs if r.optional] == ["vllm.optional_thing:Maybe"]
    assert {s.qualname: s.vllm_bases for s in subs} == {
        "p.py:Ours": [("vllm.v1.sample.logits_processor", "LogitsProcessor")],
        "p.py:Logger": [("vllm.v1.metrics.loggers", "StatLoggerBase")],
    }


def test_a_compatible_wheel_passes(tmp_path):
    wheel = make_wheel(tmp_path, BASE_FILES)
    refs, subs = compat.collect({"p.py": OURS})
    assert compat.check_imports(wheel, refs, "paved") == []
    errors, checked = compat.check_subclasses(wheel, subs, [])
    assert errors == []
    ours = next(c for c in checked if c["class"] == "p.py:Ours")
    assert ours["overrides"] == ["__init__", "apply", "update_state", "validate_params"]  # not `helper`


def test_resolution_follows_reexports_lazy_tables_and_star_imports(tmp_path):
    wheel = make_wheel(tmp_path, BASE_FILES)
    assert wheel.resolve("vllm", "SamplingParams") == ("vllm.sampling_params", "SamplingParams")
    assert wheel.resolve("vllm", "Ghost") is None  # lazy table entry pointing nowhere
    assert wheel.resolve("vllm", "VllmConfig") is None  # TYPE_CHECKING only
    assert wheel.resolve("vllm.v1.sample.logits_processor", "LogitsProcessor") == (
        "vllm.v1.sample.logits_processor.interface",
        "LogitsProcessor",
    )
    assert wheel.resolve("vllm.v1.metrics.loggers", "b125") == (
        "vllm.v1.metrics.buckets",
        "build_1_2_5_buckets",
    )
    assert wheel.resolve("vllm.v1.metrics.loggers", "build_1_2_5_buckets") is None
    assert wheel.resolve("vllm", "v1") == "module"
    assert wheel.resolve("vllm._C", "anything") == "opaque"  # extension module


def test_a_removed_module_and_a_removed_name_are_named(tmp_path):
    files = dict(BASE_FILES)
    del files["vllm/v1/metrics/loggers.py"]
    files["vllm/sampling_params.py"] = "class SamplingParamsV2: ...\n"
    wheel = make_wheel(tmp_path, files)
    refs, _ = compat.collect({"p.py": OURS})
    errors = compat.check_imports(wheel, refs, "paved")
    assert len(errors) == 2
    assert (
        "paved imports SamplingParams from vllm (p.py:2), but vllm in vllm 0.99.0 does not define it"
        in errors
    )
    missing = "vllm.v1.metrics.loggers"
    assert f"paved imports {missing} (p.py:4), but vllm 0.99.0 has no module {missing}" in errors
    assert "vllm.optional_thing" not in " ".join(errors)  # guarded by `except ImportError`


def test_override_drift_is_caught(tmp_path):
    (tmp_path / "ref").mkdir()
    ref = make_wheel(tmp_path / "ref", BASE_FILES)
    drifted = dict(BASE_FILES)
    drifted["vllm/v1/sample/logits_processor/interface.py"] = (
        IFACE_V1.replace("def update_state(self, batch_update): ...", "def update(self, batch_update): ...")
        .replace("def apply(self, logits): ...", "def apply(self, logits, ctx, extra): ...")
        .replace("    @classmethod\n    def validate_params", "    @staticmethod\n    def validate_params")
        + "\n    @abstractmethod\n    def is_argmax_invariant(self): ...\n"
    )
    (tmp_path / "new").mkdir()
    wheel = make_wheel(tmp_path / "new", drifted, version="1.0.0")
    _, subs = compat.collect({"p.py": OURS})
    errors, _ = compat.check_subclasses(wheel, subs, [ref])
    text = "\n".join(errors)
    assert "overrides LogitsProcessor.update_state, but" in text and "no longer defines update_state" in text
    assert (
        "p.py:Ours.apply no longer fits" in text
        and "takes 2 positional arguments, callers may pass 3" in text
    )
    assert "validate_params" in text and "is a classmethod, the base's is a staticmethod" in text
    assert "does not implement is_argmax_invariant" in text and "abstract in" in text
    assert "does not implement update" in text


def test_without_a_reference_a_dropped_method_is_only_ours(tmp_path):
    drifted = dict(BASE_FILES)
    drifted["vllm/v1/sample/logits_processor/interface.py"] = IFACE_V1.replace(
        "    @abstractmethod\n    def update_state(self, batch_update): ...\n", ""
    )
    wheel = make_wheel(tmp_path, drifted)
    _, subs = compat.collect({"p.py": OURS})
    errors, checked = compat.check_subclasses(wheel, subs, [])
    assert errors == []
    assert "update_state" not in next(c for c in checked if c["class"] == "p.py:Ours")["overrides"]


def test_a_base_class_that_disappeared(tmp_path):
    files = dict(BASE_FILES)
    files["vllm/v1/metrics/loggers.py"] = "class Other: ...\n"
    wheel = make_wheel(tmp_path, files)
    _, subs = compat.collect({"p.py": OURS})
    errors, _ = compat.check_subclasses(wheel, subs, [])
    assert errors == [
        "p.py:Logger derives from vllm.v1.metrics.loggers.StatLoggerBase, which vllm 0.99.0 does not define"
    ]


@pytest.mark.parametrize(
    ("marker", "expected"),
    [
        ("", True),
        ('platform_machine == "x86_64" or platform_machine == "s390x"', True),
        ('platform_system == "Darwin" or platform_machine == "ppc64le"', False),
        ('extra == "deepstream"', False),
        ('python_version >= "3.10" and sys_platform == "linux"', True),
        ('python_version < "3.9"', False),
        ('platform_machine != "riscv64"', True),
    ],
)
def test_markers(marker, expected):
    assert compat.marker_applies(marker, "3.11") is expected


def test_wheel_pins_torch_and_cuda(tmp_path):
    wheel = make_wheel(
        tmp_path,
        {"vllm/__init__.py": ""},
        requires=(
            'torch==2.13.0+cpu; platform_machine == "x86_64"',
            'torch==2.13.0; platform_system == "Darwin"',
            "nvidia-cutlass-dsl[cu13]==4.8.0",
            'nvidia-x-cu12>=1; extra == "old"',
        ),
    )
    assert compat.pinned_requirement(wheel, "torch", "3.11") == ["2.13.0+cpu"]
    assert compat.cuda_majors(wheel, "3.11") == {"13"}


def _gpu_lock(wheel, imports, rewrites=None, torch="2.14.0", cuda="13.0"):
    doc = {
        "schema": 1,
        "flavour": "gpu",
        "base": {
            "upstream": "nvidia/tritonserver:99.01-vllm-python-py3",
            "digest": "sha256:" + "a" * 64,
            "standin": True,
            "mirror_repository": "paved/base/gpu",
            "env": {"NVIDIA_TRITON_SERVER_VERSION": "99.01", "CUDA_VERSION": "13.*"},
        },
        "runtime": {"python": "/opt/paved/venv/bin/python", "python_version": "3.11"},
        "engine": {
            "distribution": "vllm",
            "version": wheel.version,
            "wheel": wheel.path.name,
            "sha256": wheel.sha256,
            "torch": torch,
            "cuda": cuda,
        },
        "triton": {"release": "99.01", "vllm_backend_source": "test", "vllm_backend_imports": imports},
    }
    if rewrites:
        doc["triton"]["vllm_backend_rewrites"] = rewrites
    return locks.parse(doc, "gpu.lock.toml", "f" * 64)


def test_triton_manifest_failure_names_module_and_both_versions(tmp_path):
    wheel = make_wheel(tmp_path, BASE_FILES)
    lock = _gpu_lock(
        wheel,
        [
            "vllm.engine.metrics:Stats",
            "vllm.engine.metrics:StatLoggerBase",
            "vllm.sampling_params:SamplingParams",
        ],
    )
    report = compat.check(lock, wheel, {})
    assert not report.ok
    (err,) = report.errors
    assert "Triton 99.01's vLLM backend" in err
    assert (
        "vllm.engine.metrics (StatLoggerBase, Stats)" in err
        and "vllm 0.99.0 has no module vllm.engine.metrics" in err
    )


def test_rewrites_fix_a_moved_name_and_are_reported_when_stale(tmp_path):
    wheel = make_wheel(tmp_path, BASE_FILES)
    imports = ["vllm.v1.metrics.loggers:build_1_2_5_buckets", "vllm.v1.metrics.loggers:StatLoggerBase"]
    assert not compat.check(_gpu_lock(wheel, imports), wheel, {}).ok
    fixed = _gpu_lock(
        wheel,
        imports,
        {"vllm.v1.metrics.loggers:build_1_2_5_buckets": "vllm.v1.metrics.buckets:build_1_2_5_buckets"},
    )
    report = compat.check(fixed, wheel, {})
    assert report.ok, report.errors
    assert report.checked["triton_vllm_backend_rewrites_no_longer_needed"] == []
    stale = _gpu_lock(
        wheel, imports, {"vllm.v1.metrics.loggers:StatLoggerBase": "vllm.v1.metrics.loggers:StatLoggerBase"}
    )
    assert compat.check(stale, wheel, {}).checked["triton_vllm_backend_rewrites_no_longer_needed"] == [
        "vllm.v1.metrics.loggers:StatLoggerBase"
    ]


def test_wheel_pin_drift(tmp_path):
    wheel = make_wheel(tmp_path, BASE_FILES, requires=("torch==2.15.0", "nvidia-foo-cu12==1"))
    report = compat.check(_gpu_lock(wheel, ["vllm.sampling_params:SamplingParams"]), wheel, {})
    text = "\n".join(report.errors)
    assert "pins torch 2.14.0, vllm 0.99.0 requires torch==2.15.0" in text
    assert "pins CUDA 13.0, vllm 0.99.0 requires CUDA ['12'] packages" in text


def test_entry_point_groups_must_still_be_read(tmp_path):
    wheel = make_wheel(tmp_path, BASE_FILES)
    lock = _gpu_lock(wheel, ["vllm.sampling_params:SamplingParams"])
    eps = "[vllm.logits_processors]\nx = paved.x:X\n\n[vllm.gone_group]\ny = paved.y:Y\n"
    report = compat.check(lock, wheel, {"libs/paved-0.1.0.dist-info/entry_points.txt": eps})
    (err,) = report.errors
    assert "vllm.gone_group" in err and "no module of vllm 0.99.0 reads" in err


def test_rewrite_backend_edits_only_the_listed_imports(tmp_path):
    src = tmp_path / "src" / "utils"
    src.mkdir(parents=True)
    (src / "m.py").write_text(
        "import json\n"
        "from vllm.v1.metrics.loggers import (\n    StatLoggerBase,\n    build_1_2_5_buckets,\n)\n"
        "from vllm.inputs.data import TokensPrompt as TP\n"
        "def f():\n    from vllm.inputs.data import TokensPrompt\n    return TokensPrompt\n"
    )
    rewrites = {
        "vllm.v1.metrics.loggers:build_1_2_5_buckets": "vllm.v1.metrics.buckets:build_1_2_5_buckets",
        "vllm.inputs.data:TokensPrompt": "vllm.inputs:TokensPrompt",
    }
    changes = compat.rewrite_backend(tmp_path / "src", rewrites)
    assert len(changes) == 3
    text = (src / "m.py").read_text()
    assert "from vllm.v1.metrics.loggers import StatLoggerBase\n" in text
    assert "from vllm.v1.metrics.buckets import build_1_2_5_buckets\n" in text
    assert "from vllm.inputs import TokensPrompt as TP\n" in text
    assert "    from vllm.inputs import TokensPrompt\n    return TokensPrompt\n" in text
    assert compat.backend_manifest(tmp_path / "src") == [
        "vllm.inputs:TokensPrompt",
        "vllm.v1.metrics.buckets:build_1_2_5_buckets",
        "vllm.v1.metrics.loggers:StatLoggerBase",
    ]


# vLLM 0.33.0's shape of what paved's processor relies on (gpu_model_runner.py:700-739,
# 3403-3416; gpu_input_batch.py), cut to the lines the check reads.
RUNNER_V1 = """
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.worker.gpu_input_batch import InputBatch

class GPUModelRunner:
    def __init__(self, vllm_config, device):
        model_config = vllm_config.model_config
        logits_processors = model_config.logits_processors
        custom_logitsprocs = tuple(logits_processors) if logits_processors is not None else ()
        self.input_batch = InputBatch(
            max_num_reqs=8,
            logitsprocs=build_logitsprocs(vllm_config, device, False, False, custom_logitsprocs),
            logitsprocs_need_output_token_ids=bool(custom_logitsprocs),
        )

    def _sample(self, logits, spec_decode_metadata):
        sampling_metadata = self.input_batch.sampling_metadata
        self.input_batch.update_async_output_token_ids()
        return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
"""
INPUT_BATCH = """
class InputBatch:
    def __init__(self, max_num_reqs, logitsprocs=None, logitsprocs_need_output_token_ids=False):
        self.logitsprocs_need_output_token_ids = logitsprocs_need_output_token_ids

    def _make_sampling_metadata(self):
        needs_output_token_ids = self.no_penalties or self.logitsprocs_need_output_token_ids
        return needs_output_token_ids

    def update_async_output_token_ids(self):
        pass
"""
RUNNER_FILES = {
    **BASE_FILES,
    "vllm/v1/worker/gpu_model_runner.py": RUNNER_V1,
    "vllm/v1/worker/gpu_input_batch.py": INPUT_BATCH,
}


def _runner_errors(tmp_path, files):
    _, subs = compat.collect({"p.py": OURS})
    errors, checked = compat.check_runner_assumptions(make_wheel(tmp_path, files), subs)
    assert checked == [compat.ASYNC_IDS]  # Ours derives from the V1 interface
    return errors


def test_the_async_placeholder_repair_paved_relies_on_passes_as_in_0_33(tmp_path):
    assert _runner_errors(tmp_path, RUNNER_FILES) == []
    # Only a V1 processor of paved's makes the V1 runner's behaviour a requirement.
    (tmp_path / "x").mkdir()
    errors, checked = compat.check_runner_assumptions(make_wheel(tmp_path / "x", BASE_FILES), [])
    assert errors == checked == []


@pytest.mark.parametrize(
    "old, new, why",
    [
        # The repair no longer follows logits_processors (e.g. a per-class opt-in).
        (
            "logitsprocs_need_output_token_ids=bool(custom_logitsprocs)",
            "logitsprocs_need_output_token_ids=False",
            "no longer sets logitsprocs_need_output_token_ids",
        ),
        # The flag now comes from something other than the engine's logits_processors.
        (
            "logits_processors = model_config.logits_processors",
            "logits_processors = model_config.plugin_processors",
            "no longer sets logitsprocs_need_output_token_ids",
        ),
        # The repair moved after the sampler (or away).
        (
            "        self.input_batch.update_async_output_token_ids()\n",
            "",
            "no longer calls update_async_output_token_ids before sampling",
        ),
    ],
)
def test_a_runner_that_stops_repairing_listed_processors_fails(tmp_path, old, new, why):
    assert old in RUNNER_V1
    files = {**RUNNER_FILES, "vllm/v1/worker/gpu_model_runner.py": RUNNER_V1.replace(old, new)}
    (err,) = _runner_errors(tmp_path, files)
    assert why in err and "paved relies on that" in err and "vllm 0.99.0" in err


def test_an_input_batch_that_ignores_the_flag_fails(tmp_path):
    batch = INPUT_BATCH.replace(" or self.logitsprocs_need_output_token_ids", "")
    (err,) = _runner_errors(tmp_path, {**RUNNER_FILES, "vllm/v1/worker/gpu_input_batch.py": batch})
    assert "InputBatch no longer gates its output-token ids" in err


def test_v2_fields_paved_reads_are_checked(tmp_path):
    iface = (
        "from dataclasses import dataclass\n"
        "@dataclass(frozen=True)\nclass LogitsProcRequestState:\n    all_token_ids: object\n\n"
        "@dataclass(frozen=True)\nclass LogitsContext:\n    expanded_idx_mapping: object\n    pos: object\n\n"
        "class LogitsProcessor:\n    def apply(self, logits, ctx): ...\n"
    )
    buffers = (
        "class UvaBackedTensor:\n    def __init__(self):\n        self.np = None\n\n"
        "class StagedWriteTensor:\n    def __init__(self):\n        self.gpu = None\n"
    )
    files = {
        **BASE_FILES,
        "vllm/v1/worker/gpu/sample/logits_processor/interface.py": iface,
        "vllm/v1/worker/gpu/buffer_utils.py": buffers,
    }
    ours = "from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor\n"
    ours += "class V2(LogitsProcessor):\n    def apply(self, logits, ctx): ...\n"
    _, subs = compat.collect({"p.py": ours})
    errors, checked = compat.check_runner_assumptions(make_wheel(tmp_path, files), subs)
    assert len(checked) == 4
    iface_module = "vllm.v1.worker.gpu.sample.logits_processor.interface"
    assert errors == [
        f"paved's Model Runner V2 path reads input_ids of {iface_module}.LogitsContext, "
        "which vllm 0.99.0 no longer defines",
        f"paved's Model Runner V2 path reads prompt_len of {iface_module}.LogitsProcRequestState, "
        "which vllm 0.99.0 no longer defines",
    ]
