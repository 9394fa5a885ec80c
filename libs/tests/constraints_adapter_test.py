"""paved's vLLM logits-processor adapter against a brute-force reference, under the batch
events vLLM produces: add/remove/move/swap, chunked prefill, preemption (truncated outputs,
outputs kept, or outputs folded into the re-added prompt), for both model runners.

The reference (constraints_reference.py) knows every complete output of a small constraint, so
"is token t allowed after text T with n tokens generated" is decidable by enumeration.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcRequestState

from libs.tests.constraints_reference import (
    EOS,
    MAX_MODEL_LEN,
    SPECS,
    TOKENS,
    VOCAB,
    DeviceTensor,
    HostTensor,
    Request,
    allowed_rows,
    reference_allowed,
)
from paved.constraints.spec import EXTRA_ARGS_KEY
from paved.constraints.vllm_processor import PavedLogitsProcessor, _Engine


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_v1_adapter_matches_reference_under_batch_events(data):
    proc = PavedLogitsProcessor.for_vocab(TOKENS, [EOS], MAX_MODEL_LEN)
    rows: list[Request | None] = []  # persistent batch, as vLLM's InputBatch keeps it
    waiting: list[tuple[Request, str]] = []  # preempted requests and how they come back
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for _ in range(data.draw(st.integers(400, 450))):  # >= 10k steps in all
        removed, added, moved = [], [], []
        op = data.draw(st.sampled_from(["add", "add", "remove", "move", "swap", "preempt", "resume", "step"]))
        if op == "add" and len(rows) < 12:
            kind = data.draw(st.sampled_from(sorted(SPECS)))
            # The longest shortest-output here is "Dune, Solaris" + EOS = 14 tokens.
            req = Request(kind, data.draw(st.integers(14, 40)), [1, 2, 3])
            index = rows.index(None) if None in rows else len(rows)
            if index == len(rows):
                rows.append(None)
            rows[index] = req
            added.append((index, req.params, req.prompt, req.outputs))
        elif op in ("remove", "preempt") and any(rows):
            index = data.draw(st.sampled_from([i for i, r in enumerate(rows) if r]))
            req, rows[index] = rows[index], None
            removed.append(index)
            if op == "preempt":
                waiting.append((req, data.draw(st.sampled_from(["kept", "truncated", "folded"]))))
        elif op == "resume" and waiting and None in rows:
            req, how = waiting.pop(0)
            if how == "truncated":  # the output list is discarded; a folded prompt stays
                req.history = req.history[: len(req.history) - len(req.outputs)]
                req.outputs = []
            elif how == "folded":  # vllm issue 29045: outputs become part of the prompt
                req.prompt = req.prompt + req.outputs
                req.outputs = []
            index = rows.index(None)
            rows[index] = req
            added.append((index, req.params, req.prompt, req.outputs))
        elif op == "move" and None in rows and any(rows):
            src = data.draw(st.sampled_from([i for i, r in enumerate(rows) if r]))
            dst = rows.index(None)
            rows[dst], rows[src] = rows[src], None
            moved.append((src, dst, MoveDirectionality.UNIDIRECTIONAL))
        elif op == "swap" and len(rows) >= 2:
            a, b = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=2, max_size=2, unique=True))
            rows[a], rows[b] = rows[b], rows[a]
            moved.append((a, b, MoveDirectionality.SWAP))
        if removed or added or moved:
            proc.update_state(BatchUpdate(len(rows), removed, added, moved))
        else:
            proc.update_state(None)

        # float32 on CPU is masked in place by the C++ engine; any other dtype takes the device
        # path (distinct host masks gathered by torch), as on a GPU.
        dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
        logits = torch.zeros((len(rows), VOCAB), dtype=dtype)
        proc.apply(logits)
        masks = allowed_rows(logits.float())
        for index, req in enumerate(rows):
            if req is None:
                assert masks[index] == set(range(VOCAB)), "unconstrained row was masked"
                continue
            expected = reference_allowed(req.kind, req.history, req.max_tokens)
            assert masks[index] == expected, (req.kind, req.history, index)
            # Chunked prefill: this step's sampled token is discarded, nothing is appended.
            if req.done() or (data.draw(st.booleans()) and data.draw(st.booleans())):
                continue
            token = int(rng.choice(sorted(expected)))
            req.outputs.append(token)
            req.history.append(token)
        # Finished requests leave the batch, as the scheduler removes them.
        for index, req in enumerate(rows):
            if req is not None and req.done():
                assert req.history[-1] == EOS, f"budget ran out before the constraint closed: {req.history}"
                rows[index] = None
                proc.update_state(BatchUpdate(len(rows), [index], [], []))


def test_v2_adapter_tracks_slots_prefill_and_resume():
    slots, max_len = 4, 64
    tokens = torch.zeros((slots, max_len), dtype=torch.int32)
    prompt_len = np.zeros(slots, dtype=np.int32)
    req_states = LogitsProcRequestState(
        device=torch.device("cpu"),
        max_num_reqs=slots,
        vocab_size=VOCAB,
        all_token_ids=DeviceTensor(tokens),
        prompt_len=HostTensor(prompt_len),
        prefill_len=HostTensor(prompt_len.copy()),
        total_len=DeviceTensor(torch.zeros(slots, dtype=torch.int32)),
    )
    proc = PavedLogitsProcessor.for_vocab(TOKENS, [EOS], MAX_MODEL_LEN, req_states=req_states)
    rng = np.random.default_rng(7)
    reqs = {1: Request("pair", 30, [5, 6, 7]), 3: Request("regex", 10, [8, 9])}
    for slot, req in reqs.items():
        prompt_len[slot] = len(req.prompt)
        tokens[slot, : len(req.prompt)] = torch.tensor(req.prompt)
        assert proc.add_request(slot, req.params) is True
    assert proc.add_request(0, SamplingParams(max_tokens=5)) is False

    def step(prefill: bool = False):
        order = [3, 0, 1]  # rows are reordered every step
        pos = []
        for s in order:
            req = reqs.get(s)
            n = len(req.prompt) + len(req.history) if req else 1
            pos.append(n - 2 if prefill else n - 1)
        input_ids = [int(tokens[s, p]) for s, p in zip(order, pos, strict=True)]
        ctx = LogitsContext(
            expanded_idx_mapping=torch.tensor(order),
            idx_mapping=torch.tensor(order),
            idx_mapping_np=np.array(order),
            expanded_local_pos=torch.zeros(len(order), dtype=torch.int32),
            input_ids=torch.tensor(input_ids),
            pos=torch.tensor(pos),
            seq_lens_upper_bound_np=np.array(pos) + 1,
        )
        logits = torch.zeros((len(order), VOCAB), dtype=torch.float32)
        proc.apply(logits, ctx)
        return dict(zip(order, allowed_rows(logits), strict=True))

    for i in range(12):
        masks = step(prefill=i == 0)
        assert masks[0] == set(range(VOCAB))
        for slot, req in reqs.items():
            if req.done():
                continue
            expected = reference_allowed(req.kind, req.history, req.max_tokens)
            assert masks[slot] == expected, (slot, req.history)
            if i == 0:
                continue  # prefill chunk: the sampled token is discarded
            token = int(rng.choice(sorted(expected)))
            tokens[slot, len(req.prompt) + len(req.history)] = token
            req.history.append(token)
        if i == 6:  # preemption: slot 1 is resumed with different history -> full resync
            req = reqs[1]
            req.history = req.history[:1]
            tokens[1, len(req.prompt) + 1 :] = 0


def test_bad_specs_fail_at_admission():
    with pytest.raises(ValueError, match="paved_constraint"):
        PavedLogitsProcessor.validate_params(SamplingParams(extra_args={EXTRA_ARGS_KEY: {"type": "nope"}}))
    with pytest.raises(ValueError, match="ignore_eos"):
        PavedLogitsProcessor.validate_params(
            SamplingParams(ignore_eos=True, extra_args={EXTRA_ARGS_KEY: SPECS["one"]})
        )
    PavedLogitsProcessor.validate_params(SamplingParams(max_tokens=3))  # no spec: nothing to check


def test_budget_too_small_for_any_output_falls_back_to_unbudgeted_masks():
    proc = PavedLogitsProcessor.for_vocab(TOKENS, [EOS], MAX_MODEL_LEN)
    req = Request("pair", 3, [1])
    proc.update_state(BatchUpdate(1, [], [(0, req.params, req.prompt, req.outputs)], []))
    logits = torch.zeros((1, VOCAB), dtype=torch.float32)
    proc.apply(logits)
    # Without a budget every title's first byte or token is allowed; EOS is not.
    assert allowed_rows(logits)[0] == reference_allowed("pair", [], None)


def test_async_placeholder_masks_from_the_last_known_state_then_catches_up():
    proc = PavedLogitsProcessor.for_vocab(TOKENS, [EOS], MAX_MODEL_LEN)
    req = Request("regex", 20, [1])
    proc.update_state(BatchUpdate(1, [], [(0, req.params, req.prompt, req.outputs)], []))
    a, b = TOKENS.index(b"a"), TOKENS.index(b"b")

    def mask():
        logits = torch.zeros((1, VOCAB), dtype=torch.float32)
        proc.apply(logits)
        return allowed_rows(logits)[0]

    req.outputs.extend([a, -1])  # "a" known, the next token still on the device
    assert mask() == reference_allowed("regex", [a], 20)
    req.outputs[-1] = b  # vLLM's repair before the next sampler run
    assert mask() == reference_allowed("regex", [a, b], 20)
    # A forbidden token that slipped through (masked from a stale state) ends the row.
    req.outputs.append(a)
    assert mask() == {EOS}


def test_tokenizer_ids_past_the_models_vocabulary_are_left_out():
    # A token added to the tokenizer without an embedding row (a fine-tune's pad token, or an
    # EOS id the config lists past it): vLLM's logits stop at the model's vocabulary size, so
    # such ids can never be sampled. Refusing them failed the engine's first constrained step.
    engine = _Engine([*TOKENS, b"<pad>", b"xyz"], [EOS, VOCAB + 1], VOCAB, MAX_MODEL_LEN)
    assert engine.vocab.size == VOCAB
    proc = PavedLogitsProcessor.for_vocab(TOKENS, [EOS], MAX_MODEL_LEN)
    proc._engine = engine
    req = Request("one", 20, [1])
    proc.update_state(BatchUpdate(1, [], [(0, req.params, req.prompt, req.outputs)], []))
    logits = torch.zeros((1, VOCAB), dtype=torch.float32)
    proc.apply(logits)
    assert allowed_rows(logits)[0] == reference_allowed("one", [], 20)
