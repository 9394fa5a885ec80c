"""Process environment vLLM needs to run robustly on CPU, in services and under `bazel test`.

Must run before `import vllm`, and at import time of any module that starts an engine:
vLLM's CPU build spawns its engine core with the `spawn` start method, which re-imports
the main module in the child. Values are defaults only; the operator's environment wins.
"""

import atexit
import os
import shutil
import tempfile


def apply_defaults(state_dir: str | None = None) -> None:
    """Set vLLM's environment defaults; `state_dir` holds its caches (default: a temp dir)."""
    state_dir = state_dir or os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
    defaults = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        # GiB of KV cache; vLLM's CPU default (4 GiB) is far more than a test needs.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Auto-binding pins every engine to CPU 0, so parallel engines slow each other down.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # Under the Bazel sandbox HOME falls back to a read-only /root; compile caches die there.
        "VLLM_CACHE_ROOT": os.path.join(state_dir, "vllm-cache"),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        # ZMQ ipc socket paths must stay under ~107 bytes; $TEST_TMPDIR paths are too long.
        rpc_dir = tempfile.mkdtemp(prefix="paved-rpc-", dir="/tmp")
        os.environ["VLLM_RPC_BASE_PATH"] = rpc_dir
        atexit.register(shutil.rmtree, rpc_dir, ignore_errors=True)
