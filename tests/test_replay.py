"""Routing replay on the HF routers it supports (Qwen3-MoE, Mixtral), built from configs."""

import pytest
import torch

from workbench.replay import RouterCapture, moe_routers, register_expert_choice, routing_replay


def tiny(arch):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=64, num_experts_per_tok=2, max_position_embeddings=64)
    if arch == "mixtral":
        cfg = MixtralConfig(num_local_experts=4, **common)
    else:
        cfg = Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, **common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_replay_reproduces_the_recorded_forward_and_keeps_router_gradients(arch):
    model = tiny(arch)
    ids = torch.randint(0, 64, (2, 12))
    cap = RouterCapture(model)
    cap.active = True
    with torch.no_grad():
        recorded_logits = model(ids).logits
    cap.active = False
    experts = cap.pop().view(2, 12, len(moe_routers(model)), 2)
    cap.remove()
    # nudge the routers, as a training step would: live routing may now differ, replay may not
    with torch.no_grad():
        for r in moe_routers(model):
            r.weight.add_(0.3 * torch.randn_like(r.weight))
    with routing_replay(model, experts) as stats:
        out = model(ids).logits
        # counted on the device, a tensor per layer and forward, not read yet: no wait per layer on a GPU
        assert len(stats.pending) == 2 and all(isinstance(c, torch.Tensor) for _, c in stats.pending)
    assert stats.fallback == [0, 0] and stats.replayed == [24, 24] and stats.pending == []  # read in one transfer
    out.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))
    with torch.no_grad():
        live = model(ids).logits
        with routing_replay(model, experts) as stats:
            replayed = model(ids).logits
    assert stats.disagreement_rate > 0  # the nudged routers would choose differently...
    assert not torch.allclose(live, replayed)  # ...and replay overrides that choice
    # with the original router weights restored, replay is exact
    model2 = tiny(arch)
    with torch.no_grad(), routing_replay(model2, experts) as stats2:
        again = model2(ids).logits
    assert torch.equal(again, recorded_logits) and stats2.disagreement_rate == 0


def test_a_registered_expert_choice_is_the_one_replay_routes_with():
    model = tiny("qwen3_moe")
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        live = model(ids).logits
        other = torch.tensor([[0, 1], [2, 3]]).repeat(6, 2, 1).view(12, 2, 2)  # experts the router would not all pick
        with routing_replay(model, other) as good:
            replayed = model(ids).logits
        register_expert_choice(lambda live_ids, recorded_ids: live_ids)  # the workshop's broken choice: live routing
        try:
            with routing_replay(model, other) as stats:
                ignored = model(ids).logits
        finally:
            register_expert_choice(None)
    assert not torch.allclose(replayed, live) and torch.equal(ignored, live)
    # the statistic that catches it: recorded positions not routed as recorded (0 with replay working).
    # The disagreement is the router's (live vs recorded), the same either way: it read 0 with the
    # broken rule, when it compared live routing with the routing used (the two differ only past the
    # first layer, whose input the broken rule changed)
    assert good.unreplayed == [0, 0] and stats.unreplayed == stats.disagree and sum(stats.unreplayed) >= 20
    assert stats.disagreement_rate > 0.5 and good.disagreement_rate > 0.5


def test_unknown_router_is_refused_clearly():
    class FakeTopKRouter(torch.nn.Module):
        def forward(self, x):
            return x, x, x

    m = torch.nn.Sequential(FakeTopKRouter())
    with pytest.raises(NotImplementedError, match="no routing-replay rule for router class"):
        with routing_replay(m, torch.zeros(1, 1, 1, dtype=torch.long)):
            pass

    # transformers' DeepSeek-V3 / GLM-4.5 MoE spelling ("TopkRouter") was no router at all: replay did
    # nothing and its statistics were empty; now found (and refused without a rule)
    class DeepseekV3TopkRouter(FakeTopKRouter):
        pass

    with pytest.raises(NotImplementedError, match="DeepseekV3TopkRouter"):
        with routing_replay(torch.nn.Sequential(DeepseekV3TopkRouter()), torch.zeros(1, 1, 1, dtype=torch.long)):
            pass
    # recorded experts and no router found: refused, not silently live
    with pytest.raises(ValueError, match="no router module"):
        with routing_replay(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.zeros(1, 1, 1, dtype=torch.long)):
            pass
    with routing_replay(torch.nn.Sequential(torch.nn.Linear(2, 2)), -torch.ones(1, 1, 1, dtype=torch.long)) as stats:
        pass  # nothing captured (all -1): nothing to replay, a dense model's empty column


def _grads_with_replay(model, ids, experts, close_before_backward: bool):
    model.zero_grad(set_to_none=True)
    with routing_replay(model, experts) as stats:
        loss = model(ids).logits.float().logsumexp(-1).sum()
        if not close_before_backward:
            loss.backward()
    if close_before_backward:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, stats


def test_replay_holds_in_activation_checkpoint_recompute():
    """Checkpointed layers re-run their forward inside backward. The replay must apply there
    too, or the gradients are those of a different routing; and positions are counted once."""
    torch.manual_seed(1)
    model = tiny("qwen3_moe")
    ids = torch.randint(0, 64, (2, 12))
    experts = torch.randint(0, 4, (2, 12, 2, 1)).repeat(1, 1, 1, 2)
    experts[..., 1] = (experts[..., 0] + 1) % 4  # two distinct experts, unlike what live routing picks
    plain, stats_plain = _grads_with_replay(model, ids, experts, close_before_backward=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ckpt, stats_ckpt = _grads_with_replay(model, ids, experts, close_before_backward=False)
    assert plain.keys() == ckpt.keys()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-6, msg=n)
    assert stats_ckpt.replayed == stats_plain.replayed == [24, 24]  # the recompute is not counted again
    # the statistic's broken-mechanism counterpart: a context closed before backward leaves the
    # recompute to live routing: torch's checkpoint then sees a different forward and refuses,
    # or (when the tensor counts happen to match) the gradients differ
    from torch.utils.checkpoint import CheckpointError

    try:
        broken, _ = _grads_with_replay(model, ids, experts, close_before_backward=True)
    except CheckpointError:
        return
    assert any(not torch.allclose(broken[n], plain[n], rtol=1e-4, atol=1e-6) for n in plain)


def test_replay_disagreement_is_none_where_nothing_was_replayed():
    """Every position fell back (no routing captured: vLLM on CPU, an MoE run without capture):
    the disagreement rate read 0.0, a perfect agreement nobody measured, in the replay monitor,
    the loggers and the audit's fallback. None now, and per layer where that layer replayed nothing."""
    from workbench.trainer.fsdp import replay_summary

    none = replay_summary([{"replayed": [0, 0], "fallback": [40, 40], "disagree": [0, 0], "unreplayed": [0, 0], "compared": [0, 0]}])
    assert none["disagree_rate"] is None and none["disagree_rate_per_layer"] == [None, None]
    some = replay_summary([{"replayed": [10, 0], "fallback": [0, 8], "disagree": [1, 0], "unreplayed": [0, 0], "compared": [10, 0]},
                           {"replayed": [10, 0], "fallback": [0, 8], "disagree": [3, 0], "unreplayed": [0, 0], "compared": [10, 0]}])
    assert some["disagree_rate"] == 0.2 and some["disagree_rate_per_layer"] == [0.2, None]
    # the rate is over the positions compared (the trainer's current rows), not every replayed one
    part = replay_summary([{"replayed": [10, 10], "fallback": [0, 0], "disagree": [1, 0], "unreplayed": [0, 0], "compared": [4, 0]}])
    assert part["disagree_rate"] == 0.25 and part["disagree_rate_per_layer"] == [0.25, None]


def test_disagreement_is_compared_where_asked_and_the_trainer_asks_its_versions_rows():
    """routing_replay's `compare` leaves positions out of the disagreement (not out of replay or its
    coverage counts), packed or not; the trainer compares only rows its trained version sampled
    whole (current_rows): a stale row's record is an older router's."""
    from workbench.trainer.fsdp import current_rows, replayed_logprobs

    model = tiny("qwen3_moe")
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(ids)
    cap = RouterCapture(model)
    cap.active = True
    with torch.no_grad():
        model(ids)
    cap.active = False
    experts = cap.pop().view(2, 12, len(moe_routers(model)), 2)
    cap.remove()
    with torch.no_grad():
        for r in moe_routers(model):  # (a training step's move)
            r.weight.add_(0.3 * torch.randn_like(r.weight))
        for packed in (False, True):
            with replayed_logprobs(model, ids, mask, 1.0, experts, positions=mask, packed=packed) as (_, every):
                pass
            only_first = torch.tensor([[1], [0]]) * mask
            with replayed_logprobs(model, ids, mask, 1.0, experts, positions=mask, packed=packed, compare=only_first) as (_, first):
                pass
            assert every.replayed == first.replayed and every.fallback == first.fallback  # coverage counts unchanged
            assert sum(first.compared) == 12 * len(first.compared) and sum(every.compared) == 24 * len(every.compared)
            assert 0 < sum(first.disagree) < sum(every.disagree), (first.disagree, every.disagree)
    versions = torch.tensor([[-1, -1, 3, 3], [-1, -1, 2, 3], [-1, -1, -1, -1]])
    assert current_rows({"versions": versions}, 3).flatten().tolist() == [True, False, True]


def test_a_per_decoder_layer_record_replays_each_router_its_own_layer():
    # vLLM records [T, num_hidden_layers, k] with a dense layer's rows left 0 (DeepSeek-V3's first
    # layers, Qwen3-MoE's mlp_only_layers); the routers must read their own layers' rows
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    def model():
        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=64, num_experts_per_tok=2,
                             max_position_embeddings=64, num_experts=4, moe_intermediate_size=32,
                             norm_topk_prob=True, mlp_only_layers=[0])
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)

    recorder, ids = model(), torch.randint(0, 64, (1, 12))
    assert len(moe_routers(recorder)) == 2
    cap = RouterCapture(recorder)
    cap.active = True
    with torch.no_grad():
        recorded_logits = recorder(ids).logits
    per_router = cap.pop().view(12, 2, 2)
    cap.remove()
    per_layer = torch.zeros(12, 3, 2, dtype=per_router.dtype)  # the dense layer 0's rows: 0, as vLLM leaves them
    per_layer[:, 1:] = per_router
    nudged = model()
    with torch.no_grad():
        for r in moe_routers(nudged):
            r.weight.add_(0.5 * torch.randn_like(r.weight))
        live = nudged(ids).logits
        with routing_replay(nudged, per_layer) as stats:
            from_layers = nudged(ids).logits
        with routing_replay(nudged, per_router) as _:
            from_routers = nudged(ids).logits
    assert stats.disagreement_rate > 0 and not torch.allclose(live, from_layers)  # the nudge moved routing...
    assert torch.equal(from_layers, from_routers)  # ...and both records replay the same experts
    fresh = model()
    with torch.no_grad(), routing_replay(fresh, per_layer) as exact:
        assert torch.equal(fresh(ids).logits, recorded_logits) and exact.disagreement_rate == 0
    with pytest.raises(ValueError, match="4 layers; the model has 2 MoE layers of 3"):
        with routing_replay(fresh, torch.zeros(12, 4, 2, dtype=torch.long)):
            pass
