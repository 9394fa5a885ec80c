"""Generate the tiny Llama fixture: a random-init HF-format model plus a byte-level BPE tokenizer.

No hub is reachable, so tests and local serving need a model we can make ourselves. Every
byte is a pure function of this file and corpus.txt: numpy's PCG64 stream for the weights,
a tokenizer trained on the in-repo corpus, JSON written with sorted keys. The sizes are the
smallest vLLM's CPU backend accepts (its attention needs a head size of at least 32).

Usage: generate_tiny.py --corpus corpus.txt --out DIR
"""

import argparse
import json
import os

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD, END = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|end|>"
ROLES = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, END, *ROLES]
VOCAB_TARGET = 4096
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 128, 256, 2, 4, 2
MAX_POSITIONS = 2048
SEED = 20261130

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ '<|end|>' }}\n"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


def train_tokenizer(corpus_path: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([corpus_path], trainer)
    return tok


def random_weights(vocab: int) -> dict:
    rng = np.random.Generator(np.random.PCG64(SEED))
    head_dim = HIDDEN // HEADS

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(HEADS * head_dim, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * head_dim)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        w[p + "input_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    w["model.norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    return w


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    tok = train_tokenizer(args.corpus)
    vocab = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(os.path.join(args.out, "tokenizer.json"))

    write_json(
        os.path.join(args.out, "config.json"),
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HIDDEN // HEADS,
            "hidden_act": "silu",
            "max_position_embeddings": MAX_POSITIONS,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "vocab_size": vocab,
            "bos_token_id": ids[BOS],
            "eos_token_id": [ids[EOS], ids[END]],
            "pad_token_id": ids[PAD],
            "attention_bias": False,
            "mlp_bias": False,
        },
    )
    write_json(
        os.path.join(args.out, "generation_config.json"),
        {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[END]], "pad_token_id": ids[PAD]},
    )
    write_json(
        os.path.join(args.out, "special_tokens_map.json"),
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": [END, *ROLES]},
    )
    write_json(
        os.path.join(args.out, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "additional_special_tokens": [END, *ROLES],
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    save_file(random_weights(vocab), os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
