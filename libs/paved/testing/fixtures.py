"""Locating build-produced fixtures from inside a test's runfiles."""

from paved.runfiles import tiny_model_dir

__all__ = ["TINY_MODEL_FILES", "tiny_model_dir"]

TINY_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
