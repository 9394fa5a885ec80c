"""Generate the XGBoost scoring fixture: a KServe model directory (config.json + model.ubj).

A 3-class softprob booster trained on seeded synthetic data (single-threaded `hist`, so the
bytes are identical on every machine and run), with a Triton-style config: one FP32 input
[32 features], one FP32 output [3 class probabilities], max_batch_size 64, dynamic batching.
The default (100 rounds of depth 6: 300 trees) is the test fixture //models/xgb; the
benchmark's //models/xgb:bench is the same recipe at 500 rounds of depth 8 (1500 trees).
"""

import argparse
import json
import os

import numpy as np
import xgboost

FEATURES = 32
CLASSES = 3


def config(name: str) -> dict:
    return {
        "name": name,
        "backend": "xgboost",
        "max_batch_size": 64,
        "input": [{"name": "input__0", "data_type": "TYPE_FP32", "dims": [FEATURES]}],
        "output": [{"name": "output__0", "data_type": "TYPE_FP32", "dims": [CLASSES]}],
        "dynamic_batching": {"max_queue_delay_microseconds": 500, "preferred_batch_size": [32, 64]},
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        # One predict thread: the batcher, not OpenMP, provides the parallelism being measured.
        "parameters": {"predict_type": {"string_value": "value"}, "nthread": {"string_value": "1"}},
    }


def train(rounds: int, depth: int) -> xgboost.Booster:
    rng = np.random.default_rng(20240501)
    x = rng.standard_normal((4000, FEATURES)).astype(np.float32)
    score = x[:, 0] + x[:, 1] * x[:, 2] - 0.5 * x[:, 3] ** 2
    y = np.digitize(score, [-0.5, 0.5])
    params = {
        "objective": "multi:softprob",
        "num_class": CLASSES,
        "max_depth": depth,
        "eta": 0.1,
        "seed": 0,
        "nthread": 1,
        "tree_method": "hist",
    }
    return xgboost.train(params, xgboost.DMatrix(x, label=y), num_boost_round=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="directory to write config.json and model.ubj into")
    parser.add_argument("--name", default="xgb_scorer")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--depth", type=int, default=6)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    train(args.rounds, args.depth).save_model(os.path.join(args.out, "model.ubj"))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config(args.name), f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
