"""//models/tiny is deterministic and loads as a real HF model with its chat template."""

import hashlib
import json
import pathlib
import subprocess
import sys

import pytest

from paved.testing.fixtures import TINY_MODEL_FILES, tiny_model_dir


def _digests(directory: str) -> dict[str, str]:
    return {
        name: hashlib.sha256(pathlib.Path(directory, name).read_bytes()).hexdigest()
        for name in TINY_MODEL_FILES
    }


def _generate(out: str) -> None:
    subprocess.run(
        [sys.executable, "models/generate_tiny.py", "--corpus", "models/tiny/corpus.txt", "--out", out],
        check=True,
    )


def test_two_independent_generations_are_byte_identical_to_the_build(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    _generate(first)
    _generate(second)
    built = _digests(tiny_model_dir())
    assert _digests(first) == built
    assert _digests(second) == built


def test_tokenizer_and_config_agree_and_chat_template_renders():
    from transformers import AutoConfig, AutoTokenizer

    model_dir = tiny_model_dir()
    config = AutoConfig.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == config.vocab_size
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM CPU attention minimum
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|begin_of_text|><|user|>\nHi<|end|>\n<|assistant|>\n"
    text = '{"answer": "Paris", "score": 0.75}'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
def test_json_files_are_canonical(name):
    raw = pathlib.Path(tiny_model_dir(), name).read_text(encoding="utf-8")
    assert raw == json.dumps(json.loads(raw), indent=2, sort_keys=True) + "\n"
