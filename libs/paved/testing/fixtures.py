"""Locating build-produced fixtures from inside a test's runfiles."""

import os

TINY_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def tiny_model_dir() -> str:
    """Absolute, symlink-resolved directory of //models/tiny.

    Resolved because vLLM keys its compile cache on the model path, and the sandbox path
    differs on every run. The test must list the fixture's files in `data`.
    """
    config = os.path.join(os.environ.get("TEST_SRCDIR", "."), "paved", "models", "tiny", "config.json")
    if not os.path.exists(config):
        config = os.path.join("models", "tiny", "config.json")
    if not os.path.exists(config):
        raise FileNotFoundError("//models/tiny is not in this target's runfiles; add it to `data`")
    return os.path.dirname(os.path.realpath(config))
