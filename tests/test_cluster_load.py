"""Loading a large model (issue 12 item 3): TrainerConfig.load="rank0" builds every rank's model
on the meta device, shards it empty, and fills the shards from rank 0's one read of the
checkpoint. The gathered weights, the buffers (rotary frequencies) and the log-probs must be
those of the checkpoint, for the MoE too (its per-expert tensors are fused by transformers).
Then the trained policy's Hugging Face export, and a resume of its checkpoint onto one rank."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.tokens import Segment, training_tensors
from workbench.profiles import profile_for
from workbench.toy.models import load_hf_model, load_tokenizer
from workbench.trainer.fsdp import Trainer, TrainerConfig, token_logprobs


def test_rank0_load_gives_every_rank_the_checkpoints_weights(ray_local, moe_path, tmp_path):
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=4, load="rank0", kl_coef=0.1)  # the reference model too
    trainer = Trainer(str(moe_path), world_size=2, cfg=cfg)
    try:
        reference = load_hf_model(moe_path)
        gathered = trainer.state_dict()
        expected = reference.state_dict()
        assert gathered.keys() == expected.keys()
        for k, v in expected.items():
            assert torch.equal(gathered[k], v), k
        # the forward (rotary buffers included) is the checkpoint's
        ids = list(range(5, 25))
        want, _ = token_logprobs(reference, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        got = trainer.probe(ids)
        assert max(abs(a - b) for a, b in zip(got, want[0, 1:].tolist())) < 1e-5
        # and it trains (the KL term runs through the rank-0-loaded reference model)
        # two different rows (the same row at advantages +1 and -1 would cancel to a zero gradient)
        segs = [Segment(row, [0] * 8 + [1] * 12, [0.0] * 20, [-1] * 8 + [0] * 12, None) for row in (ids, ids[::-1])]
        batch = training_tensors(segs)
        batch["behaviour_logprobs"] = trainer.logprobs(batch)
        batch["advantages"] = torch.tensor([1.0, -1.0])[:, None] * batch["loss_mask"]
        stats = trainer.train_step(batch)
        assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0 and stats["kl_ref"] is not None
        trained = trainer.state_dict()
        # export: a Hugging Face directory in the source's layout that transformers loads back
        out = trainer.export_hf(str(tmp_path / "export"))
        assert safetensor_keys(out) == safetensor_keys(moe_path)  # per-expert tensors, as vLLM reads them
        again = load_hf_model(out).state_dict()
        assert all(torch.equal(again[k], v) for k, v in trained.items())
        assert load_tokenizer(out).encode("12+7") == load_tokenizer(moe_path).encode("12+7")
        assert profile_for(out).family == profile_for(moe_path).family
        trainer.save(str(tmp_path / "ckpt"))
    finally:
        trainer.shutdown()
    # resume onto another world size: torch.distributed.checkpoint reshards 2 ranks' shards onto 1
    one = Trainer(str(moe_path), world_size=1, cfg=cfg)
    try:
        assert one.restore(str(tmp_path / "ckpt"))["world_size"] == 2 and one.version == 1
        restored = one.state_dict()
        assert all(torch.equal(restored[k], v) for k, v in trained.items())
    finally:
        one.shutdown()


def safetensor_keys(directory) -> set[str]:
    from pathlib import Path

    from safetensors import safe_open

    keys = set()
    for f in Path(directory).glob("*.safetensors"):
        with safe_open(str(f), "pt") as g:
            keys |= set(g.keys())
    return keys


def test_unknown_load_mode_is_refused():
    with pytest.raises(ValueError, match="load 'lazy' unknown"):
        TrainerConfig(load="lazy")
