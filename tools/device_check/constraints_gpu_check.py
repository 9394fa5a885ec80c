"""Device check of paved's constraint masking on a GPU, against the CPU, without vLLM.

On a machine with a GPU (torch and numpy, no vLLM; the lent machines have no vLLM and its wheel
is far over what can be carried), from the repository root:

    python3 tools/device_check/constraints_gpu_check.py --require-cuda

It checks the two tensor paths paved's processor (paved.constraints.vllm_processor) takes
on a GPU that CPU tests only ever run on CPU tensors:

  * mask application: `_Engine.mask` on CUDA logits (float32, bfloat16, float16: host masks
    deduplicated, copied once, gathered and applied on the device by apply_bitmask_torch)
    against the C++ in-place masker on CPU float32 logits, value for value, for batches of
    states of three constraint kinds, rows without a constraint, and a batch larger than the
    last (the host buffers grow);
  * Model Runner V2's adapter (`apply(logits, ctx)`): CUDA ctx tensors and a CUDA token history
    (req_states.all_token_ids.gpu), with reordered rows, a partial prefill and a resumed row
    whose history diverged (the device history is read back), against a twin run on CPU.

The native module is imported from bazel-bin/cc/constraints when it is there, else built here
from cc/constraints with g++ and pybind11 (about a minute). vLLM's three interface modules the
processor imports are stubbed when vLLM is absent; nothing checked calls into them.

Without CUDA (no --require-cuda) the device path runs on CPU tensors and is compared against
the C++ masker the same way, so the script itself is known to work on any machine. Writes
constraints_gpu_check.json to $OUT when OUT is set. Exit 0: all equal; 1: a mismatch; 2: CUDA
required and absent.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import enum
import importlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The library's sources as //cc/constraints builds them (every .cc but the tests) and the module.
_LIB_SRCS = sorted(p.name for p in (ROOT / "cc/constraints").glob("*.cc") if not p.name.endswith("_test.cc"))
NATIVE_SRCS = [*_LIB_SRCS, "python/module.cc"]


def _import_native(build_dir: Path, rebuild: bool) -> str:
    """Import _paved_constraints; returns where it came from."""
    candidates = [] if rebuild else [ROOT / "bazel-bin" / "cc" / "constraints", build_dir]
    for candidate in candidates:
        if not candidate.is_dir():
            continue
        sys.path.insert(0, str(candidate))
        try:
            importlib.import_module("_paved_constraints")
            return str(candidate)
        except ImportError:  # built for another interpreter: build it for this one
            sys.path.remove(str(candidate))
    import pybind11

    build_dir.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{ROOT}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    flags = ["-O2", "-std=c++17", "-fPIC", "-pthread", *includes]

    def compile_one(src: str) -> Path:
        obj = build_dir / (src.replace("/", "_") + ".o")
        # Our own sources, the machine's compiler (S603, S607).
        cmd = ["g++", *flags, "-c", str(ROOT / "cc/constraints" / src), "-o", str(obj)]
        subprocess.run(cmd, check=True)  # noqa: S603
        return obj

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        objs = list(pool.map(compile_one, NATIVE_SRCS))
    target = build_dir / ("_paved_constraints" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = ["g++", "-shared", "-pthread", *map(str, objs), "-o", str(target)]
    subprocess.run(cmd, check=True)  # noqa: S603
    sys.path.insert(0, str(build_dir))
    importlib.import_module("_paved_constraints")
    return f"built in {build_dir}"


def _stub_vllm() -> bool:
    """Stand-ins for the vLLM names vllm_processor imports, when vLLM is not installed."""
    try:
        importlib.import_module("vllm.v1.sample.logits_processor.interface")
        return False
    except ImportError:
        pass

    class MoveDirectionality(enum.Enum):
        UNIDIRECTIONAL = 0
        SWAP = 1

    @dataclasses.dataclass
    class BatchUpdate:
        batch_size: int
        removed: list
        added: list
        moved: list

    class LogitsProcessor:  # both runners' base; the checked paths never call into it
        pass

    v1 = types.ModuleType("vllm.v1.sample.logits_processor.interface")
    v1.BatchUpdate, v1.MoveDirectionality, v1.LogitsProcessor = (
        BatchUpdate,
        MoveDirectionality,
        LogitsProcessor,
    )
    v2 = types.ModuleType("vllm.v1.worker.gpu.sample.logits_processor.interface")
    v2.LogitsProcessor = type("LogitsProcessor", (), {})
    for name in (
        "vllm",
        "vllm.v1",
        "vllm.v1.sample",
        "vllm.v1.sample.logits_processor",
        "vllm.v1.worker",
        "vllm.v1.worker.gpu",
        "vllm.v1.worker.gpu.sample",
        "vllm.v1.worker.gpu.sample.logits_processor",
    ):
        sys.modules[name] = types.ModuleType(name)
    sys.modules[v1.__name__], sys.modules[v2.__name__] = v1, v2
    return True


# A small vocabulary: every byte, some multi-byte tokens, EOS (no bytes) last.
MULTI = [b"Du", b"ne", b"Hyper", b"ion", b"Found", b"ation", b"Sol", b"aris", b", ", b"Dune, ", b'{"', b'":']
TOKENS = [bytes([b]) for b in range(256)] + MULTI + [b""]
EOS = len(TOKENS) - 1
VOCAB = len(TOKENS)
SPECS = [
    {"type": "choice", "items": ["Dune", "Hyperion", "Foundation", "Solaris"], "k": 2, "separator": ", "},
    {"type": "regex", "pattern": "(ab|cd)+x?y[0-9]{1,3}"},
    {
        "type": "json_schema",
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
            "required": ["a"],
        },
    },
]


def _params(spec: dict, max_tokens: int = 64):
    from paved.constraints import spec as specs

    return types.SimpleNamespace(
        extra_args={specs.EXTRA_ARGS_KEY: spec},
        max_tokens=max_tokens,
        ignore_eos=False,
        structured_outputs=None,
    )


def _allowed(logits):
    import torch

    return torch.isfinite(logits.float().cpu())


def check_masks(device: str, rng) -> dict:
    """_Engine.mask on `device` logits (the device path) vs the C++ masker on CPU float32."""
    import numpy as np
    import torch

    from paved.constraints.vllm_processor import PavedLogitsProcessor

    proc = PavedLogitsProcessor.for_vocab(TOKENS, [EOS], 4096)
    engine = proc._get_engine()
    compared = 0
    for batch in (3, 17, 64, 9):  # a larger batch after a smaller one grows the host buffers
        states = []
        for i in range(batch):
            if i % 5 == 4:
                states.append(None)  # a row without a constraint
                continue
            params = _params(SPECS[i % len(SPECS)])
            proc.validate_params(params)
            state = engine.track(params, [1, 2, 3]).state
            for _ in range(int(rng.integers(0, 12))):  # walk to a random reachable state
                ref = torch.zeros((1, VOCAB), dtype=torch.float32)
                engine.masker.apply([state], ref.numpy())
                ok = np.flatnonzero(np.isfinite(ref.numpy()[0]))
                ok = ok[ok != EOS]
                if len(ok) == 0:
                    break
                if not state.advance(int(rng.choice(ok))):
                    raise AssertionError("a token the mask allowed was refused")
            states.append(state)
        base = torch.from_numpy(rng.standard_normal((batch, VOCAB)).astype(np.float32))
        expected = base.clone()
        engine.masker.apply(states, expected.numpy())  # CPU float32: the C++ in-place path
        keep = torch.isfinite(expected)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            logits = base.to(dtype).to(device)
            engine.mask(logits, states)
            want = torch.where(keep, base.to(dtype), torch.tensor(float("-inf"), dtype=dtype))
            got = logits.cpu()
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[:5].tolist()
                raise AssertionError(f"mask on {device} {dtype} batch {batch} differs at {bad}")
            compared += batch
    return {"rows_compared": compared}


class _Host:
    def __init__(self, array):
        self.np = array


class _Device:
    def __init__(self, tensor):
        self.gpu = tensor


class V2Driver:
    """Model Runner V2's calls to paved's processor, on `device` tensors (0.33's Sampler:
    add_request per request, then apply(logits, ctx) per step; its post_update writes each
    sampled token into all_token_ids on the device)."""

    def __init__(self, device: str, slots: int = 8, max_len: int = 256):
        import numpy as np
        import torch

        from paved.constraints.vllm_processor import PavedLogitsProcessor

        self.device = device
        self.tokens = torch.zeros((slots, max_len), dtype=torch.int32, device=device)
        self.prompt_len = np.zeros(slots, dtype=np.int32)
        req_states = types.SimpleNamespace(
            all_token_ids=_Device(self.tokens), prompt_len=_Host(self.prompt_len)
        )
        self.proc = PavedLogitsProcessor.for_vocab(TOKENS, [EOS], 4096, req_states=req_states)

    def do(self, op: tuple):
        """Runs one scripted call; a step returns its allowed-token matrix (on the host)."""
        import torch

        if op[0] == "add":
            _, slot, spec, prompt = op
            self.prompt_len[slot] = len(prompt)
            self.tokens[slot, : len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
            params = _params(spec)
            self.proc.validate_params(params)
            if not self.proc.add_request(slot, params):
                raise AssertionError(f"slot {slot}: the processor declined a constrained request")
            return None
        if op[0] == "write":  # post_update's sampled token, or a resumed row's new history
            _, slot, start, values = op
            self.tokens[slot, start : start + len(values)] = torch.tensor(values, dtype=torch.int32)
            return None
        _, order, pos, input_ids = op
        ctx = types.SimpleNamespace(
            expanded_idx_mapping=torch.tensor(order, dtype=torch.int32, device=self.device),
            pos=torch.tensor(pos, dtype=torch.int64, device=self.device),
            input_ids=torch.tensor(input_ids, dtype=torch.int32, device=self.device),
        )
        logits = torch.zeros((len(order), VOCAB), dtype=torch.float32, device=self.device)
        return _allowed(self.proc.apply(logits, ctx))


def _v2_script(rng) -> list:
    """A V2 run scripted on CPU (each sampled token chosen from the CPU masks): reordered rows,
    a partial prefill first, a row resumed with a shorter, different history."""
    import numpy as np

    cpu = V2Driver("cpu")
    script: list = []

    def do(op: tuple):
        script.append(op)
        return cpu.do(op)

    prompts = {0: [5, 6, 7], 2: [8, 9], 5: [1, 2, 3, 4], 7: [3]}
    history: dict[int, list[int]] = {s: [] for s in prompts}
    for i, slot in enumerate(prompts):
        do(("add", slot, SPECS[i % len(SPECS)], prompts[slot]))
    for step in range(40):
        order = [int(s) for s in rng.permutation(sorted(prompts))]
        chunk = step == 0
        pos = [len(prompts[s]) - 2 if chunk else len(prompts[s]) + len(history[s]) - 1 for s in order]
        inputs = [(prompts[s] + history[s])[p] for s, p in zip(order, pos, strict=True)]
        allowed = do(("step", order, pos, inputs))
        if chunk:
            continue  # the token sampled after a partial prefill is discarded
        for row, slot in enumerate(order):
            ok = np.flatnonzero(allowed[row].numpy())
            ok = ok[ok != EOS]
            if len(ok) and len(history[slot]) < 40:
                token = int(rng.choice(ok))
                do(("write", slot, len(prompts[slot]) + len(history[slot]), [token]))
                history[slot].append(token)
        if step == 20 and len(history[5]) > 2:  # preempted, resumed with another history
            keep = history[5][:1]
            do(("write", 5, len(prompts[5]), keep + [0] * (len(history[5]) - 1)))
            history[5] = keep
    return script


def check_v2(device: str, rng) -> dict:
    script = _v2_script(rng)
    cpu_driver, dev_driver = V2Driver("cpu"), V2Driver(device)
    cpu = [m for m in map(cpu_driver.do, script) if m is not None]
    dev = [m for m in map(dev_driver.do, script) if m is not None]
    for step, (a, b) in enumerate(zip(cpu, dev, strict=True)):
        if not bool((a == b).all()):
            raise AssertionError(f"V2 step {step}: masks on {device} differ from CPU")
    return {"steps_compared": len(cpu), "rows_compared": sum(int(a.shape[0]) for a in cpu)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--require-cuda", action="store_true", help="exit 2 when CUDA is not available")
    ap.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(), "paved_native_build"))
    ap.add_argument("--rebuild", action="store_true", help="build the native module even if one imports")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "libs"))
    import numpy as np
    import torch

    result: dict = {"torch": torch.__version__, "python": sys.version.split()[0]}
    cuda = torch.cuda.is_available()
    result["device"] = torch.cuda.get_device_name(0) if cuda else "cpu (CUDA not available)"
    if not cuda and args.require_cuda:
        print(json.dumps(result))
        print("CUDA is required (--require-cuda) and not available", file=sys.stderr)
        return 2
    result["native"] = _import_native(Path(args.build_dir), args.rebuild)
    result["vllm_stubbed"] = _stub_vllm()
    device = "cuda" if cuda else "cpu"
    status = 0
    try:
        result["masks"] = check_masks(device, np.random.default_rng(1))
        result["v2_adapter"] = check_v2(device, np.random.default_rng(2))
    except AssertionError as e:
        result["failure"] = str(e)
        status = 1
    if not cuda:
        result["note"] = "no CUDA: the device path ran on CPU tensors, compared against the C++ masker"
    result["ok"] = status == 0
    text = json.dumps(result, indent=1, sort_keys=True)
    print(text)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "constraints_gpu_check.json").write_text(text + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
