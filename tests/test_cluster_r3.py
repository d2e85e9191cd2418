"""Routing replay (R3) on the GPU path, checked on CPU: the session asks vLLM for routed experts
when the profile is an MoE that captures and the trainer replays (the flag reaches vLLM's own
config, which refuses it on CPU), and vLLM's per-request arrays become compact, checked Sample
arrays that accumulate into the same segment columns as the reference sampler's."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from workbench.profiles import profile_for
from workbench.rollout import vllm_engine
from workbench.rollout.engine import Sample, SamplingConfig, create_engine
from workbench.rollout.vllm_engine import VLLMEngine, compact_experts, moe_shape, routing_off_reason, wants_routed_experts
from workbench.tokens import Accumulator, Segment


def test_routed_experts_are_wanted_for_an_moe_that_replays_on_an_engine_that_can(moe_path, dense_path):
    moe, dense = profile_for(moe_path), profile_for(dense_path)
    assert moe.moe and moe.capture_experts
    assert wants_routed_experts(moe, "vllm", True, gpus=16)
    assert not wants_routed_experts(moe, "vllm", True, gpus=0)  # vLLM's CPU build cannot
    assert wants_routed_experts(moe, "reference", True, gpus=0)
    assert not wants_routed_experts(moe, "vllm", False, gpus=16)  # the trainer would not replay them
    assert not wants_routed_experts(moe.replace(capture_experts=False), "vllm", True, gpus=16)
    assert not wants_routed_experts(dense, "vllm", True, gpus=16)
    # and why not, said at connect() and kept in config.json (an MoE trained on its own routing)
    assert routing_off_reason(moe, "vllm", True, gpus=16) is None and routing_off_reason(dense, "vllm", True, 0) is None
    assert "CPU build" in routing_off_reason(moe, "vllm", True, gpus=0)
    assert "no routing-replay rule" in routing_off_reason(moe.replace(capture_experts=False, family="gpt-oss"), "vllm", True, 16)
    assert routing_off_reason(moe, "reference", False, 0) == "trainer.routing_replay=False"


def test_the_flag_reaches_vllms_config_which_refuses_it_on_cpu(moe_path, dense_path, monkeypatch):
    # on CPU our engine refuses first, with the way out
    with pytest.raises(NotImplementedError, match="'reference' rollout backend"):
        VLLMEngine(str(moe_path), enable_return_routed_experts=True)
    # the engine arguments a GPU engine passes (built as on GPU), given to vLLM's own config:
    # vLLM refuses the routed-expert return here, so the flag is what it receives
    monkeypatch.setattr(vllm_engine, "on_cpu", lambda: False)
    engine = VLLMEngine(str(moe_path), enable_return_routed_experts=True, max_model_len=512)
    shutil.rmtree(engine._shm, ignore_errors=True)
    monkeypatch.undo()
    assert engine.engine_args["enable_return_routed_experts"] is True and engine.moe_shape == (8, 2)
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = {**engine.engine_args, "enforce_eager": True, "gpu_memory_utilization": 0.1}  # CPU-valid otherwise
    with pytest.raises(Exception, match="requires Model Runner V2"):
        AsyncEngineArgs(**args).create_engine_config()
    # a dense checkpoint cannot be asked for experts at all
    monkeypatch.setattr(vllm_engine, "on_cpu", lambda: False)
    with pytest.raises(ValueError, match="not an MoE"):
        VLLMEngine(str(dense_path), enable_return_routed_experts=True)


@pytest.fixture(scope="module")
def recorded(moe_path):
    """Routing recorded by the reference sampler on the tiny MoE: [P + T, layers, top_k] int16,
    -1 on the last sampled token. vLLM returns the same routing for the P + T - 1 fed positions."""
    async def main():
        e = create_engine("reference", model_path=str(moe_path))
        await e.start()
        out = await e.generate(list(range(5, 17)), SamplingConfig(max_tokens=6, ignore_eos=True), return_routed_experts=True)
        await e.shutdown()
        return out

    return asyncio.run(main())


def test_vllm_arrays_become_compact_and_accumulate_like_the_reference(recorded, moe_path):
    n = len(recorded.prompt_ids) + len(recorded.token_ids)
    ref = recorded.routed_experts
    assert ref.shape[0] == n and (ref[-1] == -1).all() and (ref[:-1] >= 0).all()
    as_vllm = ref[:-1].astype(np.int32)  # what vLLM hands back: the fed positions only
    num_experts, top_k = moe_shape(str(moe_path))
    compact = compact_experts(as_vllm, n, num_experts, top_k, "r1")
    assert compact.dtype == np.uint8 and compact.nbytes == as_vllm.nbytes // 4
    assert np.array_equal(compact, ref[:-1])
    # into a segment, as the loopback server's accumulator records a turn: the same int16 column
    sample = Sample(recorded.prompt_ids, recorded.token_ids, recorded.logprobs, recorded.versions, "length",
                    routed_experts=compact)
    seg = Segment(list(sample.prompt_ids) + list(sample.token_ids), [0] * len(sample.prompt_ids) + [1] * len(sample.token_ids),
                  [0.0] * len(sample.prompt_ids) + list(sample.logprobs), [-1] * len(sample.prompt_ids) + list(sample.versions))
    Accumulator._merge_experts(None, seg, sample)
    assert seg.routed_experts.dtype == np.int16 and np.array_equal(seg.routed_experts, ref)
    # more than 256 experts: int16
    assert compact_experts(np.array([[[300, 2]]]), 2, 384).dtype == np.int16


@pytest.mark.parametrize("bad, words", [
    (np.zeros((3, 2, 2), np.int32), "for 3 positions"),  # far too short for 12 + 6 tokens
    (np.zeros((17, 2, 3), np.int32), "3 experts per token"),
    (np.full((17, 2, 2), 8, np.int32), "the model has 8 experts"),
    (np.full((17, 2, 2), -1, np.int32), "the model has 8 experts"),
    (np.zeros((17, 2), np.int32), "expected integer ids"),
    (np.zeros((17, 2, 2), np.float32), "expected integer ids"),
])
def test_arrays_that_cannot_be_this_models_routing_are_refused(bad, words):
    with pytest.raises(RuntimeError, match=words):
        compact_experts(bad, 18, 8, 2, "r2")
