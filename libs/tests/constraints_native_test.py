"""The pybind11 extension of cc/constraints, driven from Python like the vLLM adapters do."""

import numpy as np
import pytest

from paved import constraints


def _mask_allowing(batch: int, vocab: int, allowed: dict[int, list[int]]) -> np.ndarray:
    mask = np.zeros((batch, constraints.bitmask_words(vocab)), dtype=np.int32)
    for row, tokens in allowed.items():
        for t in tokens:
            mask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask


def test_apply_bitmask_sets_neg_inf_exactly_outside_allowed_set():
    vocab = 100
    logits = np.random.default_rng(0).standard_normal((2, vocab)).astype(np.float32)
    before = logits.copy()
    mask = _mask_allowing(2, vocab, {0: [0, 31, 32, 99], 1: list(range(vocab))})
    constraints.apply_bitmask(logits, mask)
    allowed = np.isfinite(logits[0])
    assert sorted(np.flatnonzero(allowed).tolist()) == [0, 31, 32, 99]
    np.testing.assert_array_equal(logits[0, allowed], before[0, allowed])
    np.testing.assert_array_equal(logits[1], before[1])


def test_apply_bitmask_only_touches_selected_rows():
    vocab = 64
    logits = np.zeros((3, vocab), dtype=np.float32)
    mask = _mask_allowing(3, vocab, {0: [1], 1: [2], 2: [3]})
    constraints.apply_bitmask(logits, mask, rows=[2])
    assert np.isfinite(logits[:2]).all()
    assert np.flatnonzero(np.isfinite(logits[2])).tolist() == [3]


@pytest.mark.parametrize(
    ("logits", "mask", "message"),
    [
        (np.zeros((2, 64), np.float64), np.zeros((2, 2), np.int32), "float32"),
        (np.zeros((2, 64), np.float32), np.zeros((2, 3), np.int32), "bitmask shape"),
        (np.zeros((2, 64), np.float32), np.zeros((2, 2), np.int64), "int32"),
        (np.zeros((64, 2), np.float32).T, np.zeros((2, 2), np.int32), "contiguous"),
    ],
)
def test_apply_bitmask_rejects_bad_arrays(logits, mask, message):
    with pytest.raises(ValueError, match=message):
        constraints.apply_bitmask(logits, mask)


def test_apply_bitmask_rejects_out_of_range_rows():
    with pytest.raises(IndexError):
        constraints.apply_bitmask(np.zeros((2, 32), np.float32), np.zeros((2, 1), np.int32), rows=[2])
