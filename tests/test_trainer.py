"""The FSDP2 trainer on Ray (2 gloo ranks on CPU): log-probs, routing replay, a training step,
gathering weights, and syncing them into a rollout engine."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import ray
import pytest
import torch

from workbench.correction import CorrectionConfig
from workbench.rollout.engine import SamplingConfig, create_engine, expected_probe_logprobs, probe_ids
from workbench.tokens import Segment, training_tensors
from workbench.toy.models import load_hf_model
from workbench.trainer.fsdp import Trainer, TrainerConfig, token_logprobs


@pytest.fixture(scope="module")
def samples(moe_path):
    """Completions of the MoE from the reference sampler, with their routed experts."""
    async def main():
        e = create_engine("reference", model_path=str(moe_path))
        await e.start()
        outs = await asyncio.gather(*[e.generate(list(range(5 + i, 15 + 2 * i)), SamplingConfig(max_tokens=12, ignore_eos=True),
                                                 return_routed_experts=True) for i in range(5)])
        await e.shutdown()
        return outs

    return asyncio.run(main())


def batch_of(samples, rewards=None):
    segs = []
    for s in samples:
        P, T = len(s.prompt_ids), len(s.token_ids)
        segs.append(Segment(s.prompt_ids + s.token_ids, [0] * P + [1] * T, [0.0] * P + s.logprobs,
                            [-1] * P + s.versions, s.routed_experts))
    b = training_tensors(segs)
    r = torch.tensor(rewards if rewards is not None else [1.0, -1.0] * 3)[: len(segs)]
    b["advantages"] = r[:, None] * b["loss_mask"]
    return b


@pytest.fixture(scope="module")
def trainer(ray_local, moe_path):
    # (lr 1e-4: one Adam step at 1e-3 overshot on one toy build, positive-advantage tokens less likely after it)
    t = Trainer(str(moe_path), world_size=2, cfg=TrainerConfig(lr=1e-4, micro_batch_size=2,
                                                               correction=CorrectionConfig.tis()))
    yield t
    t.shutdown()


def test_fsdp_logprobs_equal_the_sampler_with_replay(trainer, samples):
    b = batch_of(samples)
    lp = trainer.logprobs(b)
    m = b["loss_mask"].bool()
    assert torch.max(torch.abs(lp[m] - b["behaviour_logprobs"][m])) <= 1e-5


def test_a_replay_rule_registered_in_the_driver_is_the_ranks_rule(ray_local, moe_path, samples):
    """register_replay_rule in a notebook reached only the driver's process: the trainer's checks
    passed there and each rank (a process importing workbench.replay afresh) had no such rule, so
    the first replayed step raised after a whole rollout. The ranks get the driver's rules. Shown
    with a rule registered over the toy's router whose gate weights are uniform: the ranks'
    log-probs then leave the sampler's (with their own rule they equal it, the test above)."""
    from workbench import replay

    own = replay.REPLAY_RULES["Qwen3MoeTopKRouter"]

    @replay.register_replay_rule("Qwen3MoeTopKRouter")
    def uniform(router, logits, ids):
        return torch.full(ids.shape, 1.0 / ids.shape[-1], dtype=logits.dtype)

    try:
        t = Trainer(str(moe_path), world_size=1, cfg=TrainerConfig(micro_batch_size=8))
        try:
            b = batch_of(samples)
            m = b["loss_mask"].bool()
            assert torch.max(torch.abs(t.logprobs(b)[m] - b["behaviour_logprobs"][m])) > 1e-3
        finally:
            t.shutdown()
    finally:
        replay.register_replay_rule("Qwen3MoeTopKRouter")(own)


def test_a_kl_reference_that_routes_otherwise_routes_live(ray_local, moe_path, dense_path, samples):
    """kl_coef with a dense ref_model_path (a documented choice: any frozen reference) handed the
    policy's recorded experts to the reference's forward, which raised at every step (it has no
    router). The reference replays only where it routes as the policy does: its own frozen copy."""
    b = batch_of(samples)
    for ref, replays in ((dense_path, False), (None, True)):
        t = Trainer(str(moe_path), world_size=1, cfg=TrainerConfig(micro_batch_size=8, kl_coef=0.1,
                                                                  ref_model_path=str(ref) if ref else None))
        try:
            assert ray.get(t.workers[0].__ray_call__.remote(lambda w: w.ref_replays)) == replays
            stats = t.train_step(b)
            assert stats["kl_ref"] is not None and math.isfinite(stats["kl_ref"]), ref
        finally:
            t.shutdown()


def test_without_replay_routing_disagrees_and_the_statistics_show_it(trainer, moe_path):
    """Forward consistency's broken-mechanism test. A bf16 sampler (as vLLM serves on GPU) picks
    different experts than the fp32 trainer at ~1% of positions. Replay follows the sampler's
    choice; without it the trainer routes its own way: the disagreement statistic counts those
    positions, and the train-vs-rollout KL is larger."""
    async def main():
        e = create_engine("reference", model_path=str(moe_path), dtype="bfloat16", seed=3)
        await e.start()
        outs = await asyncio.gather(*[e.generate(list(range(5 + i, 25 + i)), SamplingConfig(max_tokens=24, ignore_eos=True),
                                                 return_routed_experts=True) for i in range(12)])
        await e.shutdown()
        return outs

    b = batch_of(asyncio.run(main()), rewards=[1.0, -1.0] * 6)
    m = b["loss_mask"].bool()

    def k3(lp):
        lr = (lp - b["behaviour_logprobs"])[m]
        return float((lr.exp() - 1 - lr).mean())

    lp_replay, st_replay = trainer.logprobs(b, replay=True, with_stats=True)
    lp_live, st_live = trainer.logprobs(b, replay=False, with_stats=True)
    assert st_live["disagree_rate"] > 0 and len(st_live["disagree_rate_per_layer"]) == 2
    # layer 0 sees the same input either way, so it counts the same flips; later layers' inputs
    # already depend on the routing before them
    assert st_live["disagree"][0] == st_replay["disagree"][0] > 0
    # none: a row's last token (never fed to the engine, no record) predicts nothing and is not counted
    assert st_live["fallback"] == st_replay["fallback"] == [0, 0]
    assert k3(lp_live) > 1.5 * k3(lp_replay), (k3(lp_live), k3(lp_replay))
    print(f"\n[measured] bf16 sampler vs fp32 trainer: disagreement {st_live['disagree_rate']:.4f}, "
          f"k3 with replay {k3(lp_replay):.2e}, without {k3(lp_live):.2e}")


def test_replay_in_a_single_forward_catches_wrong_experts(moe_path, samples):
    model = load_hf_model(moe_path)
    b = batch_of(samples[:1])
    lp, stats = token_logprobs(model, b["input_ids"], b["attention_mask"], experts=b["routed_experts"])
    assert stats.disagreement_rate == 0 and stats.replayed[0] == b["input_ids"].shape[1] - 1
    wrong = torch.where(b["routed_experts"] >= 0, (b["routed_experts"] + 3) % 8, b["routed_experts"])
    lp_wrong, stats_wrong = token_logprobs(model, b["input_ids"], b["attention_mask"], experts=wrong)
    assert stats_wrong.disagreement_rate > 0.5 and not torch.allclose(lp, lp_wrong)


def test_train_step_moves_the_policy_and_sync_reaches_an_engine(trainer, samples, moe_path):
    b = batch_of(samples)
    before = trainer.logprobs(b)
    stats = trainer.train_step(b, report=True)
    assert stats["version"] == 1 and np.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    # the per-token report (the token journey's data) adds up to the step's loss and carries
    # this step's trainer log-probs and IS weights
    rep, m = stats["report"], b["loss_mask"].bool()
    assert rep["loss_contribution"].shape == b["input_ids"].shape
    assert abs(float(rep["loss_contribution"].sum()) - stats["loss"]) < 1e-5
    assert torch.equal(rep["trainer_logprobs"], before) and torch.equal(rep["input_ids"], b["input_ids"])
    assert torch.allclose(rep["is_weight"][m], torch.ones(int(m.sum())), atol=1e-4) and rep["gate_keep"][m].all()
    assert not rep["gate_keep"][~m].any() and (rep["loss_contribution"][~m] == 0).all()
    assert sum(stats["replay"]["replayed"]) > 0 and stats["replay"]["disagree_rate"] == 0
    after = trainer.logprobs(b)
    m = b["loss_mask"].bool()
    adv = b["advantages"][m]
    delta = (after - before)[m]
    assert (delta * adv).sum() > 0  # positive-advantage tokens became likelier, negative ones less
    sd = trainer.state_dict()
    model = load_hf_model(moe_path)
    assert set(sd) == set(model.state_dict()) and all(sd[k].shape == v.shape for k, v in model.state_dict().items())
    model.load_state_dict(sd)
    lp_hf, _ = token_logprobs(model, b["input_ids"], b["attention_mask"], experts=b["routed_experts"])
    assert torch.max(torch.abs(lp_hf[m] - after[m])) <= 1e-5  # the gathered weights are the trained ones
    # the weight sync's copy: the same weights, as numpy arrays the engines map (WireWeights)
    import ray

    ref, _, _ = trainer.weights_and_probe([5, 6, 7])
    wire = ray.get(ref).tensors()
    assert wire.keys() == sd.keys() and all(torch.equal(wire[k], v) for k, v in sd.items())

    async def sync():
        e = create_engine("reference", model_path=str(moe_path))
        await e.start()
        report = await e.update_weights(sd, expected_probe=expected_probe_logprobs(model, probe_ids(model.config.vocab_size)), tol=1e-5)
        await e.shutdown()
        return report

    report = asyncio.run(sync())
    assert report.checked and report.version == 1


def test_a_surrogate_registered_in_the_driver_trains_in_the_ranks(ray_local, moe_path, samples):
    """A rank imports the losses afresh: a surrogate registered in a notebook passed the config's
    check in the driver, and the ranks' first step raised "unknown surrogate" after a whole rollout
    (a sequence-level one got token_mean there). The ranks get the driver's registries."""
    from workbench.trainer.losses import SEQUENCE_SURROGATES, SURROGATES, gspo, register_surrogate

    def halved_gspo(logprobs, old_logprobs, advantages, weights, mask, eps_low=3e-4, eps_high=4e-4):
        return 0.5 * gspo(logprobs, old_logprobs, advantages, weights, mask, eps_low, eps_high)

    register_surrogate("test-halved-gspo", sequence_level=True)(halved_gspo)
    try:
        t = Trainer(str(moe_path), world_size=1, cfg=TrainerConfig(lr=1e-4, micro_batch_size=4, surrogate="test-halved-gspo",
                                                                   correction=CorrectionConfig.tis()))
        try:
            stats = t.train_step(batch_of(samples))
            aggregation = ray.get(t.workers[0].__ray_call__.remote(lambda self: self.cfg.loss_aggregation))
        finally:
            t.shutdown()
    finally:
        SURROGATES.pop("test-halved-gspo")
        SEQUENCE_SURROGATES.discard("test-halved-gspo")
    assert np.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert aggregation == "seq_mean_token_mean"


def test_replay_disagreement_is_compared_on_the_trained_versions_rows_only(ray_local, moe_path, samples):
    """A stale row's record is an older router's: live routing there differs by the optimizer's
    moves, and an async run read ~0.24 disagreement at every step (the audit's limit 0.05) with
    replay working. The trainer compares the rows its trained version sampled; a step of stale
    rows replays as before (its coverage counted) and measures no disagreement."""
    b = batch_of(samples)
    b["routed_experts"] = torch.where(b["routed_experts"] >= 0, (b["routed_experts"] + 3) % 8, b["routed_experts"])
    t = Trainer(str(moe_path), world_size=1, cfg=TrainerConfig(lr=1e-4, micro_batch_size=4, correction=CorrectionConfig.tis()))
    try:
        fresh = t.train_step(b)["replay"]  # (the batch's tokens are version 0's, the trainer's)
        stale_step = t.train_step(b)  # (now at version 1: every row one version stale)
        stale = stale_step["replay"]
    finally:
        t.shutdown()
    from workbench.loop import step_statistics

    logged = step_statistics(stale_step)  # (metrics.jsonl: the audit tells "not compared" from "not captured")
    assert logged["replay_compared"] == 0 and logged["replay_positions"] > 0 and logged["replay_disagree_rate"] is None
    assert fresh["disagree_rate"] > 0.5 and sum(fresh["compared"]) == sum(fresh["replayed"]) > 0
    assert stale["replayed"] == fresh["replayed"] and sum(stale["compared"]) == 0 and stale["disagree_rate"] is None


def test_one_fsdp_unit_trains_exactly_as_a_unit_per_layer(ray_local, moe_path, samples):
    """TrainerConfig.shard_unit and reshard_after_forward: the whole model as one FSDP2 unit (the
    CPU default: fewer gloo collectives) and a unit per decoder layer (the GPU default), the root
    kept gathered from its forward to its backward (None, torch's rule: the default) or resharded
    (True), are the same computation: two steps on the same batch, with no-grad forwards (the
    live-routing KL, a probe) before and between them, give the same losses, gradient norms,
    probes and weights. Keeping the root gathered saves the backward's all-gather. With one rank
    the default keeps every unit gathered from its forward to its backward (nothing is sharded
    across ranks): no layer is gathered again for its backward."""
    def count_gathers(self=None) -> int:
        """In a rank (defined here: Ray pickles it by value): count from now on the FSDP2 units
        gathered (an all-gather; with one rank a copy, no collective); returns the count so far."""
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        if not hasattr(FSDPParamGroup, "_wb_gathers"):
            FSDPParamGroup._wb_gathers, unshard = [0], FSDPParamGroup.unshard

            def counted(group, *a, **k):
                if not group.is_unsharded and group._all_gather_result is None:  # (else unshard returns at once)
                    FSDPParamGroup._wb_gathers[0] += 1
                return unshard(group, *a, **k)

            FSDPParamGroup.unshard = counted
        return FSDPParamGroup._wb_gathers[0]

    def registered(t) -> set[str]:
        return ray.get(t.workers[0].__ray_call__.remote(lambda self: {type(p).__name__ for p in self.model.parameters()}))

    b, out = batch_of(samples), {}
    probe_ids = list(range(3, 19))
    for ranks, unit, units, reshard in ((2, "layer", 3, None), (2, "model", 1, True), (2, "model", 1, None),
                                        (1, "layer", 3, None), (1, "model", 1, None)):  # 2 decoder layers + the root
        t = Trainer(str(moe_path), world_size=ranks, cfg=TrainerConfig(lr=1e-3, micro_batch_size=2, shard_unit=unit,
                                                                       reshard_after_forward=reshard,
                                                                       correction=CorrectionConfig.tis()))
        try:
            assert [r["fsdp_units"] for r in t.footprint()] == [units] * ranks
            first = t.train_step(b)
            probe = t.probe(probe_ids)
            assert registered(t) == {"DTensor"}, "a probe left gathered parameters registered"
            before = ray.get(t.workers[0].__ray_call__.remote(count_gathers))
            second = t.train_step(b)
            gathers = ray.get(t.workers[0].__ray_call__.remote(count_gathers)) - before
            after_step = registered(t)
            out[ranks, unit, reshard] = ([first["loss"], second["loss"]], [first["grad_norm"], second["grad_norm"]], probe,
                                  t.state_dict(), gathers)
            # after the step's last no-grad forward and backward the shards are what is registered
            assert after_step == {"DTensor"}, (unit, reshard, after_step)
        finally:
            t.shutdown()
    ref_loss, ref_norm, ref_probe, ref_weights, _ = out[2, "layer", None]
    for key in ((2, "model", True), (2, "model", None)):
        loss, norm, probe, weights, _ = out[key]
        assert all(abs(x - y) < 1e-6 for x, y in zip(loss, ref_loss)), key
        assert all(abs(x - y) < 1e-5 * max(1.0, y) for x, y in zip(norm, ref_norm)), key
        assert all(abs(x - y) < 1e-5 for x, y in zip(probe, ref_probe)), key
        assert weights.keys() == ref_weights.keys() and all(torch.allclose(weights[k], ref_weights[k], atol=1e-6)
                                                            for k in weights), key
    assert ref_loss[0] != ref_loss[1]  # the first step changed the weights the second one saw
    # a step here: the live-routing forward (no grad, resharded after it) and the gradient forward
    # per micro-batch, then the backward, which gathers the one unit again only when it was
    # resharded after forward
    assert 0 < out[2, "model", None][4] < out[2, "model", True][4], {k: v[4] for k, v in out.items()}
    # one rank, a unit per layer: every unit stays gathered from its forward to its backward by
    # default, so each of the 3 units is gathered once a forward, as the one root unit is
    per_layer, one_unit = out[1, "layer", None], out[1, "model", None]
    assert all(abs(x - y) < 1e-6 for x, y in zip(per_layer[0], one_unit[0]))
    assert all(torch.allclose(per_layer[3][k], one_unit[3][k], atol=1e-6) for k in per_layer[3])
    assert 0 < per_layer[4] == 3 * one_unit[4], {k: v[4] for k, v in out.items()}
    assert any(not torch.equal(ref_weights[k], v) for k, v in load_hf_model(moe_path).state_dict().items())  # it trained


def test_the_trainer_store_listens_on_loopback_on_one_node(trainer):
    """torch's TCPStore binds every interface whatever host it is given: each session's
    unauthenticated store (gloo's and NCCL's connection endpoints) was reachable from the network.
    On a one-node cluster it listens on 127.0.0.1 only (tests/test_cluster.py: rank 0's node IP on
    several)."""
    import os

    import psutil

    host, port = trainer.rendezvous
    pid = ray.get(trainer.workers[0].__ray_call__.remote(lambda self: os.getpid()))
    listening = {c.laddr.ip for c in psutil.Process(pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert host == "127.0.0.1" and listening == {"127.0.0.1"}, listening


def test_cpu_ranks_keep_freed_memory_for_the_next_step(trainer):
    """keep_freed_memory (default): a CPU rank's glibc serves a large buffer from its heap and
    keeps it mapped after it is freed, where glibc's default maps each one afresh and unmaps it at
    free, so the next step faults its pages in again (SmolLM2's recipe step: 1.7x, bench/trainer.py)."""
    def freed_buffer(self=None) -> tuple[bool, int]:  # defined here: Ray pickles it by value
        """(a 64 MB tensor lies in the heap, kB of resident memory its free gave back)."""
        def rss_kb():
            return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))

        x = torch.ones(16 << 20)
        at = x.data_ptr()
        in_heap = any(line.rstrip().endswith("[heap]") and int(line.split("-")[0], 16) <= at < int(line.split()[0].split("-")[1], 16)
                      for line in open("/proc/self/maps"))
        before = rss_kb()
        del x
        return in_heap, before - rss_kb()

    assert trainer.cfg.keep_freed_memory
    ranks = ray.get([w.__ray_call__.remote(freed_buffer) for w in trainer.workers])
    default = ray.get(ray.remote(num_cpus=0)(freed_buffer).remote())  # a Ray worker with glibc's default
    assert default[0] is False and default[1] > 60_000, f"the control (glibc's default) kept its buffer: {default}"
    for in_heap, given_back_kb in ranks:
        assert in_heap and given_back_kb < 1_000, f"a rank mapped its buffer apart or unmapped it at free: {ranks}"


def test_full_state_dict_gathers_uneven_shards_in_one_collective(ray_local):
    """gather_full_tensors (the weight sync's gather) equals DTensor.full_tensor() of each tensor,
    on 2 gloo ranks with shards torch.chunk splits unevenly: 5 rows as 3 + 2, 1 row as 1 + 0 (an
    empty shard), 129 rows in bfloat16 (a second dtype's buffer), and the keys keep their order."""
    import ray

    from torch.distributed import TCPStore

    @ray.remote(num_cpus=0)
    def rank_main(rank: int, port: int):
        import torch.distributed as dist
        from torch.distributed import TCPStore
        from torch.distributed.fsdp import fully_shard

        from workbench.trainer.fsdp import gather_full_tensors

        store = TCPStore("127.0.0.1", port, 2, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1), torch.nn.Embedding(129, 3))
            model[2].to(torch.bfloat16)
            for part in model:
                fully_shard(part)
            state = model.state_dict()
            expected = {k: v.full_tensor() for k, v in state.items()}
            got = gather_full_tensors(state, rank, 2)
            if rank != 0:
                return got is None
            return list(got) == list(expected) and all(
                got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
        finally:
            dist.destroy_process_group()

    # the store listens where the OS put it (port 0), as the Trainer's rank 0 does: a port picked
    # free beforehand can be taken by another process before the rendezvous binds it (EADDRINUSE)
    store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    assert ray.get([rank_main.remote(r, store.port) for r in range(2)], timeout=120) == [True, True]


def test_checkpoint_then_resume_gives_the_same_next_step(ray_local, moe_path, samples, tmp_path):
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=2, correction=CorrectionConfig.tis())
    b1, b2 = batch_of(samples), batch_of(samples, rewards=[-1.0, 1.0, 0.5, -0.5, 1.0])
    a = Trainer(str(moe_path), world_size=2, cfg=cfg)

    def adamw(t):  # each rank's AdamW step counters and learning rates
        return ray.get([w.__ray_call__.remote(lambda self: (sorted({int(st["step"]) for st in self.optimizer.state.values()}),
                                                            [g["lr"] for g in self.optimizer.param_groups]))
                        for w in t.workers])

    try:
        # saved before any step: the save made the optimizer's state with a zero-gradient step,
        # which left AdamW's counters at 1 (the first real update 0.74x); they stay at 0
        a.save(str(tmp_path / "fresh"))
        assert all(steps == [0] for steps, _ in adamw(a))
        a.train_step(b1)
        a.save(str(tmp_path / "ckpt"), {"next_step": 1})
        uninterrupted = a.train_step(b2)
        after_a = a.logprobs(b2)
    finally:
        a.shutdown()
    b = Trainer(str(moe_path), world_size=2, cfg=cfg)
    try:
        assert b.restore(str(tmp_path / "ckpt"))["next_step"] == 1 and b.version == 1
        assert all(steps == [1] for steps, _ in adamw(b))
        resumed = b.train_step(b2)
        after_b = b.logprobs(b2)
        # a resume under another learning rate takes it (the checkpoint's was kept, silently)
        ray.get([w.__ray_call__.remote(lambda self: setattr(self.cfg, "lr", 3e-4)) for w in b.workers])
        b.restore(str(tmp_path / "ckpt"))
        assert all(lrs and set(lrs) == {3e-4} for _, lrs in adamw(b))
    finally:
        b.shutdown()
    assert resumed["loss"] == pytest.approx(uninterrupted["loss"], abs=1e-6)
    assert resumed["version"] == uninterrupted["version"] == 2
    assert torch.allclose(after_a, after_b, atol=1e-6)  # optimizer state restored too, not only weights
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer.restore(b, str(tmp_path / "nothing"))


def test_resumed_loop_neither_repeats_nor_skips_steps(ray_local, vllm_moe, moe_path, tmp_path):
    from workbench.agents import load_agent
    from workbench.loop import LoopConfig, run
    from workbench.rollout.actor import sync_weights
    from workbench.rollout.runner import Rollout

    agent = "workbench/examples/arithmetic_env.py"
    spec = load_agent(agent)
    seen = []

    def source(n, step):
        seen.append(step)
        return spec.tasks(n, seed=step)

    original = load_hf_model(moe_path).state_dict()
    rollout = Rollout(agent, [vllm_moe], str(moe_path), sampling=SamplingConfig(max_tokens=8))
    cfg = LoopConfig(steps=2, prompts_per_step=4, group_size=2)
    try:
        for steps in (2, 4):  # a first run of 2 steps, then a "restarted" run asked for 4 in all
            trainer = Trainer(str(moe_path), world_size=1, cfg=TrainerConfig(micro_batch_size=8))
            try:
                cfg.steps = steps
                # (every 3 steps: the run's last step is checkpointed too, or the restart redid both)
                hist = run(rollout, trainer, [vllm_moe], source, cfg, progress=False,
                                checkpoint_dir=str(tmp_path / "run"), checkpoint_every=3)
            finally:
                trainer.shutdown()
            assert [h["step"] for h in hist] == list(range(steps - 2, steps))
    finally:
        rollout.shutdown()
        sync_weights([vllm_moe], original)
    assert seen == [0, 4, 8, 12]  # the chunks' seeds: their data positions (prompts_per_step 4)


def test_kl_statistic_catches_a_missing_weight_sync(ray_local, vllm_moe, moe_path):
    """Invariant 2's measurement catching a broken mechanism: if the engines are not synced to
    the trainer's weights, behaviour and trainer log-probs disagree and k3 / max |delta p| show it."""
    from workbench.agents import load_agent
    from workbench.loop import LoopConfig, run
    from workbench.rollout.actor import sync_weights
    from workbench.rollout.runner import Rollout

    agent = "workbench/examples/arithmetic_env.py"
    spec = load_agent(agent)
    original = load_hf_model(moe_path).state_dict()
    g = torch.Generator().manual_seed(5)
    sync_weights([vllm_moe], {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()})
    rollout = Rollout(agent, [vllm_moe], str(moe_path), sampling=SamplingConfig(max_tokens=8))
    trainer = Trainer(str(moe_path), world_size=1, cfg=TrainerConfig(micro_batch_size=64))
    try:
        broken = run(rollout, trainer, [vllm_moe], lambda n, s: spec.tasks(n, seed=s),
                          LoopConfig(steps=1, prompts_per_step=8, group_size=4, initial_sync=False), progress=False)
        fixed = run(rollout, trainer, [vllm_moe], lambda n, s: spec.tasks(n, seed=s),
                         LoopConfig(steps=1, prompts_per_step=8, group_size=4), progress=False)
    finally:
        rollout.shutdown()
        trainer.shutdown()
        sync_weights([vllm_moe], original)
    assert broken[0]["kl_k3"] > 0.01 and broken[0]["max_abs_delta_p"] > 0.05
    assert fixed[0]["kl_k3"] < 1e-6 and fixed[0]["max_abs_delta_p"] < 1e-4
    # every token was sampled at the trainer's version: the current-version k3 sees the same
    assert broken[0]["kl_k3_current"] > 0.01 and fixed[0]["kl_k3_current"] < 1e-6


def test_async_loop_overlaps_rollout_with_training_and_corrects_staleness(ray_local, vllm_moe, moe_path):
    """Async mode: the rollout of step k+1 runs while step k trains, so some tokens are one
    version stale when trained; they keep their sampling version and the gate lets them through
    (staleness 1 <= max_staleness). A lag beyond max_staleness is refused up front."""
    import threading

    from workbench.agents import load_agent
    from workbench.loop import LoopConfig, run
    from workbench.rollout.actor import sync_weights
    from workbench.rollout.runner import Rollout

    agent = "workbench/examples/arithmetic_env.py"
    spec = load_agent(agent)
    original = load_hf_model(moe_path).state_dict()
    rollout = Rollout(agent, [vllm_moe], str(moe_path), sampling=SamplingConfig(max_tokens=8))
    trainer = Trainer(str(moe_path), world_size=1, cfg=TrainerConfig(lr=1e-3, micro_batch_size=64,
                                                                     correction=CorrectionConfig.tis(max_staleness=1)))
    try:
        with pytest.raises(ValueError, match="max_staleness=1"):
            run(rollout, trainer, [vllm_moe], lambda n, s: spec.tasks(n, seed=s), LoopConfig(mode="async", async_lag=2))
        stop = threading.Event()
        hist = run(rollout, trainer, [vllm_moe], lambda n, s: spec.tasks(n, seed=100 + s),
                   LoopConfig(steps=6, prompts_per_step=8, group_size=8, mode="async", async_lag=1), progress=False,
                   on_step=lambda m: m["step"] == 3 and stop.set(), stop=stop)
    finally:
        rollout.shutdown()
        trainer.shutdown()
        sync_weights([vllm_moe], original)
    assert [h["step"] for h in hist] == [0, 1, 2, 3]  # the stop event ended the run after step 3
    # (a step whose every update was skipped keeps its version and is not synced: no probe difference)
    assert all(h["failed_episodes"] == 0 and (h["sync_max_abs_diff"] <= 1e-3 if h["version"] != h["trained_version"]
                                              else h["sync_max_abs_diff"] is None) for h in hist)
    # overlap: step k+1's rollout started before step k's training ended
    assert any(b["rollout_start"] < a["train_end"] for a, b in zip(hist, hist[1:]))
    stale = [h["staleness_hist"] for h in hist[1:]]
    assert any(s.get(1, 0) > 0 for s in stale) and all(max(s) <= 1 for s in stale)
    assert all(h["gate_pass_ratio"] == 1.0 and h["stale_dropped"] == 0 for h in hist)
    assert hist[0]["kl_k3"] < 1e-6  # step 0 was sampled by exactly the trainer's weights
    assert any(h["kl_k3"] > 1e-7 for h in hist[1:])  # stale tokens: the k3 statistic sees the version gap
    assert hist[0]["kl_k3_stale"] is None  # ... and kl_k3_stale is that gap alone (None: no stale token)
    assert any(h["kl_k3_stale"] is not None and h["kl_k3_stale"] > 1e-7 for h in hist[1:])
    # ... which is all of it: the tokens of the trainer's own version match its forward (an episode
    # spanning a sync had its K/V recomputed under the new weights)
    current = [h for h in hist if h["tokens_current"]]
    assert all(h["kl_k3_current"] is None for h in hist if not h["tokens_current"])  # nothing measured reads None, not 0
    # step 0 is all current tokens; later steps have some or none, as the timing falls (8-token
    # episodes finish before the sync here: a request spanning one is checked in
    # tests/test_engines.py, token by token against each version's weights)
    assert hist[0]["tokens_current"] > 0 and all(h["kl_k3_current"] < 1e-6 for h in current)


def test_nccl_weight_sync_is_refused_clearly_without_gpus(trainer, vllm_moe):
    """The GPU path is wired end to end (trainer ranks, engine actor, vLLM engine); on CPU each
    side refuses with a message that names the CPU path. (tests/test_nccl_sync.py covers its
    logic over gloo into vLLM's own receiver.)"""
    with pytest.raises(ray.exceptions.RayTaskError, match="before init_nccl"):
        ray.get(vllm_moe.update_weights_nccl.remote({"names": [], "dtype_names": [], "shapes": []}))
    with pytest.raises(ray.exceptions.RayTaskError, match="NCCL weight sync needs CUDA GPUs.*On CPU use the file path"):
        trainer.init_nccl_sync([vllm_moe])
    assert trainer.nccl is None  # syncs keep the CPU path
    # the engine says its NCCL ranks (tensor x pipeline parallel), which the group's layout reads where
    # none are given (each read as 1, a tensor-parallel engine's workers took the next engine's ranks)
    assert ray.get(vllm_moe.info.remote())["workers"] == 1


def test_dense_bf16_mixed_precision_with_a_kl_penalty_to_the_reference(ray_local, dense_path):
    """A dense model, FSDP2 mixed precision (bf16 compute, fp32 master weights and gradient
    reduction; what GPUs run, here on gloo), and the KL-to-reference penalty: 0 while the
    policy equals its reference, > 0 once it has moved."""
    g = torch.Generator().manual_seed(0)
    segs = [Segment(torch.randint(3, 500, (40,), generator=g).tolist(), [0] * 20 + [1] * 20, [0.0] * 40, [-1] * 20 + [0] * 20)
            for _ in range(6)]
    b = training_tensors(segs)
    b["advantages"] = torch.tensor([1.0, 1.0, 0.5, 0.5, 1.0, -1.0])[:, None] * b["loss_mask"]
    m = b["loss_mask"].bool()
    model = load_hf_model(dense_path)
    with torch.no_grad():
        lp_fp32, _ = token_logprobs(model, b["input_ids"], b["attention_mask"])
    t = Trainer(str(dense_path), world_size=2, cfg=TrainerConfig(lr=1e-3, micro_batch_size=4, mixed_precision="bfloat16",
                                                                 kl_coef=0.5, correction=CorrectionConfig.tis()))
    try:
        lp = t.logprobs(b)
        gap = float((lp - lp_fp32)[m].abs().max())
        assert 0 < gap < 0.2, gap  # bf16 compute: close to fp32, not equal
        b["behaviour_logprobs"] = lp * b["loss_mask"]
        first = t.train_step(b)
        assert first["kl_ref"] == 0.0 and first["correction"]["kl_k3"] < 1e-6 and first["policy_shift"] == 0.0
        # at ratio 1 the PPO loss is -(token mean of the advantages), whatever the number of ranks
        assert first["loss"] == pytest.approx(-float(b["advantages"][m].mean()), abs=2e-3)
        second = t.train_step(b)
        assert second["kl_ref"] > 0 and np.isfinite(second["loss"])
        # the frozen reference has no backward: it is resharded after its no-grad forwards
        assert ray.get(t.workers[0].__ray_call__.remote(
            lambda self: {type(p).__name__ for p in self.ref_model.parameters()})) == {"DTensor"}
        after = t.logprobs(b)
        assert float(((after - lp) * b["advantages"])[m].sum()) > 0  # moved in the advantages' direction
        sd = t.state_dict()
        assert all(v.dtype == torch.float32 for v in sd.values())  # master weights stay fp32
    finally:
        t.shutdown()


def test_more_updates_than_rows_runs_one_update_a_row(ray_local, dense_path):
    """updates_per_step above a rank's rows trains as one update a row: no empty mini-batch (one
    ran no forward yet averaged a zero gradient norm into the step's, and with
    micro_batch_tokens it ran a forward on no rows)."""
    g = torch.Generator().manual_seed(2)
    segs = [Segment(torch.randint(3, 500, (20,), generator=g).tolist(), [0] * 8 + [1] * 12, [0.0] * 20, [-1] * 8 + [0] * 12)
            for _ in range(3)]
    b = training_tensors(segs)
    b["advantages"] = torch.tensor([1.0, -1.0, 1.0])[:, None] * b["loss_mask"]
    results = []
    for updates in (4, 3):
        t = Trainer(str(dense_path), world_size=1, cfg=TrainerConfig(lr=1e-2, updates_per_step=updates, micro_batch_tokens=64,
                                                                     correction=CorrectionConfig(enabled=False, max_staleness=None)))
        try:
            b["behaviour_logprobs"] = t.logprobs(b) * b["loss_mask"]
            stats = t.train_step(b)
            assert stats["updates"] == 3  # one a row
            results.append((stats["loss"], stats["grad_norm"], t.logprobs(b)))
        finally:
            t.shutdown()
    (loss4, norm4, lp4), (loss3, norm3, lp3) = results
    assert norm3 > 0 and abs(norm4 - norm3) < 1e-6 * norm3 and abs(loss4 - loss3) < 1e-7 and torch.equal(lp4, lp3)


def test_updates_per_step_takes_as_many_updates_as_asked():
    """Runs of ceil(n / updates) rows took fewer updates than asked (6 rows in 4 updates: 3 of 2
    rows; 10 in 8: 5): the policy moved less per step than configured, and nothing said so."""
    from workbench.trainer.fsdp import update_runs

    for n, updates, sizes in ((6, 4, [2, 2, 1, 1]), (10, 8, [2, 2, 1, 1, 1, 1, 1, 1]), (9, 4, [3, 2, 2, 2]),
                              (5, 2, [3, 2]), (3, 5, [1, 1, 1]), (16, 4, [4] * 4), (7, 1, [7])):
        runs = update_runs(n, updates)
        assert [len(r) for r in runs] == sizes and [i for r in runs for i in r] == list(range(n)), (n, updates)


def test_several_updates_take_pi_old_from_their_own_micro_batch_cuts(ray_local, moe_path):
    """With several updates pi_old came from one no-grad pass over the rank's rows, cut into
    micro-batches otherwise than each update's gradient forwards (packing put other rows side by
    side): in bf16 rounding alone moved a sequence's mean log-ratio past GSPO's clip band, and which
    sequences got no gradient was decided by rounding. pi_old is each update's own cut now: the first
    update's equals a one-update step's on its rows, to the bit."""
    g = torch.Generator().manual_seed(3)
    lengths = [30, 21, 40, 16, 26, 16, 14, 24]  # cut 0-2, 3-7 whole; 0-1, 2-3 for the first update
    segs = [Segment(torch.randint(3, 500, (n,), generator=g).tolist(), [0] * 4 + [1] * (n - 4), [0.0] * n, [-1] * 4 + [0] * (n - 4))
            for n in lengths]
    b = training_tensors(segs)
    b["advantages"] = torch.tensor([1.0, -1.0] * 4)[:, None] * b["loss_mask"]
    b["behaviour_logprobs"] = torch.zeros_like(b["advantages"])
    first = {k: (v[:4] if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
    old = {}
    for updates, batch in ((2, b), (1, first)):
        t = Trainer(str(moe_path), world_size=1, cfg=TrainerConfig(lr=1e-3, dtype="bfloat16", micro_batch_tokens=100,
                                                                   updates_per_step=updates, surrogate="gspo",
                                                                   correction=CorrectionConfig(enabled=False, max_staleness=None)))
        try:
            old[updates] = t.train_step(batch, report=True)["report"]["trainer_logprobs"][:4]
        finally:
            t.shutdown()
    assert torch.equal(old[2], old[1])


def test_several_updates_per_step_move_the_ratios_off_one(ray_local, dense_path):
    """updates_per_step=2: two AdamW steps against one pi_old, so the second update's ratios
    differ from 1 (where PPO clipping acts); the loss is still the objective's mean. Each update
    trains the same rows on 2 ranks as on 1 (the batch's first 3 rows, then the last 2): each
    rank cut its own contiguous rows into the updates, so 2 ranks trained rows {0, 1, 3, 4} then
    {2}, another SGD path than one rank's (a resume onto other ranks changed the training)."""
    g = torch.Generator().manual_seed(1)
    segs = [Segment(torch.randint(3, 500, (30,), generator=g).tolist(), [0] * 10 + [1] * 20, [0.0] * 30, [-1] * 10 + [0] * 20)
            for _ in range(5)]  # 5 rows on 2 ranks: padding rows
    b = training_tensors(segs)
    b["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])[:, None] * b["loss_mask"]
    after = {}
    for ranks in (2, 1):
        t = Trainer(str(dense_path), world_size=ranks, cfg=TrainerConfig(lr=1e-3, micro_batch_size=2, updates_per_step=2,
                                                                         aggregation="seq_mean_token_mean",
                                                                         correction=CorrectionConfig(enabled=False,
                                                                                                     max_staleness=None)))
        try:
            before = t.logprobs(b)
            b["behaviour_logprobs"] = before * b["loss_mask"]
            stats = t.train_step(b, report=True)
            assert stats["policy_shift"] > 1e-3
            assert abs(float(stats["report"]["loss_contribution"].sum()) - stats["loss"]) < 1e-6
            assert torch.equal(stats["report"]["trainer_logprobs"], before)  # pi_old: the weights at the step's start
            m = b["loss_mask"].bool()
            after[ranks] = (t.logprobs(b), stats["loss"], stats["grad_norm"], stats["policy_shift"])
            assert float(((after[ranks][0] - before) * b["advantages"])[m].sum()) > 0, ranks
        finally:
            t.shutdown()
    (lp2, loss2, norm2, shift2), (lp1, loss1, norm1, shift1) = after[2], after[1]
    assert (lp2 - lp1).abs().max() < 1e-4 and abs(loss2 - loss1) < 1e-5 and abs(norm2 - norm1) < 1e-4 * norm1, \
        ((lp2 - lp1).abs().max(), loss2, loss1, norm2, norm1)
    # policy_shift: the mean |log pi - log pi_old| over the second update's tokens (rows 3-4), under
    # the weights the first update (rows 0-2) left; the first update's ratios are all 1, and counting
    # its tokens read 2/5 of the shift
    t = Trainer(str(dense_path), world_size=1, cfg=TrainerConfig(lr=1e-3, micro_batch_size=2, aggregation="seq_mean_token_mean",
                                                                 correction=CorrectionConfig(enabled=False, max_staleness=None)))
    try:
        first = {k: (v[:3] if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
        t.train_step(first)
        second = {k: (v[3:] if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
        m2 = second["loss_mask"].bool()
        expected = float((t.logprobs(second) - before[3:]).abs()[m2].mean())
    finally:
        t.shutdown()
    assert expected > 1e-3 and abs(shift1 - expected) < 1e-3 * expected + 1e-6 and abs(shift2 - expected) < 1e-3 * expected + 1e-6, \
        (shift1, shift2, expected)


def test_a_non_finite_gradient_is_no_update(trainer, samples):
    """A NaN advantage makes every gradient NaN (so do an inf log-prob, a diverged loss): the update
    was applied, every weight NaN after it, while grad_norm read 0.0 (NaN > 0 is False) and
    updates_skipped 0. It is skipped: grad_norm reads NaN and the weights stay as they were."""
    import math

    b = batch_of(samples)
    b["advantages"][0] = float("nan") * b["loss_mask"][0]
    probe_ids = list(range(3, 19))
    before, version = trainer.probe(probe_ids), trainer.version
    stats = trainer.train_step(b)
    assert math.isnan(stats["grad_norm"]) and stats["updates_skipped"] == 1, stats
    assert trainer.probe(probe_ids) == before
    # the weights did not move, so neither does the version (bumped, the engines took a sync of the
    # same weights and every token sampled before read one version stale)
    assert trainer.version == stats["version"] == stats["trained_version"] == version, stats
    # and it trained no token: counted, the skipped update's tokens read as trained (the no-signal
    # warning, which reads signal_tokens_trained, stayed quiet over steps that moved nothing)
    assert stats["signal_tokens_trained"] == 0, stats


def test_the_live_routing_forward_runs_on_its_cadence(trainer, samples):
    """TrainerConfig.measure_live_routing: the extra no-grad forward with live routing (kl_k3_live)
    runs on a trainer's first train_step and every N-th after it (default N = 10; it cost 1.35x the
    quickstart's step), decided by the driver for every rank at once (the forward has collectives);
    the other steps report None, not a stale or zero value."""
    assert trainer.cfg.measure_live_routing == 10
    done = trainer.steps_done  # this module's steps so far
    b, seen = batch_of(samples), []
    for i in range(done, done + 11):
        # sampled by the version trained (the live KL is measured on those tokens; none: None)
        b["versions"] = torch.where(b["loss_mask"].bool(), trainer.version, b["versions"])
        seen.append((i, trainer.train_step(dict(b))["kl_k3_live"]))
    assert [kl is not None for _, kl in seen] == [i % 10 == 0 for i, _ in seen]
    assert sum(kl is not None for _, kl in seen) in (1, 2) and all(kl > 0 for _, kl in seen if kl is not None)
    for bad in (-1, "10", 2.5):
        with pytest.raises(ValueError, match="measure_live_routing"):
            TrainerConfig(measure_live_routing=bad)


def test_the_sharded_update_is_the_plain_policy_gradient_update(ray_local, moe_path, samples):
    """The FSDP2 trainer (2 gloo ranks, correction off, live routing) takes the same steps as the
    textbook update in one process: token-mean policy-gradient loss -A * log p over the sampled
    tokens, clip at 1, AdamW (lr 1e-3, no decay), on the same model and batch. Three steps: the
    gradient norms agree, and every weight to a tenth of one step's move (a sign, a token mask,
    a loss scale between ranks or a sharded optimizer going wrong would each show)."""
    b = batch_of(samples, rewards=[1.0, -1.0, 0.5, -0.5, 2.0])
    t = Trainer(str(moe_path), world_size=2, cfg=TrainerConfig(lr=1e-3, micro_batch_size=64, routing_replay=False,
                                                               measure_live_routing=0, correction=CorrectionConfig(enabled=False)))
    try:
        norms = [t.train_step(dict(b))["grad_norm"] for _ in range(3)]
        sharded = t.state_dict()
    finally:
        t.shutdown()
    model = load_hf_model(moe_path).float().train()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    ids, mask, adv = b["input_ids"], b["loss_mask"][:, 1:].float(), b["advantages"][:, 1:].float()
    plain_norms = []
    for _ in range(3):
        logits = model(input_ids=ids, attention_mask=b["attention_mask"]).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        (-(adv * lp * mask).sum() / mask.sum()).backward()
        plain_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert norms == pytest.approx(plain_norms, rel=1e-4) and min(norms) > 1.0  # (clipped: the norm is the check on scale)
    plain = model.state_dict()
    assert sharded.keys() == plain.keys()
    moved = max(float((plain[k] - start[k]).abs().max()) for k in plain)
    worst = max(float((sharded[k].float() - plain[k]).abs().max()) for k in plain)
    assert moved > 2e-3 and worst < 0.1 * moved / 3, (moved, worst)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_parameters_the_optimizer_never_stepped_loads(tmp_path):
    """AdamW keeps no state for a parameter whose gradient stayed None (a module the forward never
    uses): saved so, a fresh optimizer's state dict (every parameter) could not be loaded from it
    ("Missing key in checkpoint state_dict"), after the crash a resume was for. TrainerWorker.save
    gives those parameters a fresh AdamW's zero state first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from workbench.trainer.fsdp import complete_optimizer_state

    def made():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = made()
    model["used"](torch.ones(2, 4)).sum().backward()
    opt.step()
    assert len(opt.state) == 2  # of 4 parameters
    complete_optimizer_state(opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    model2, opt2 = made()
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))  # raised "Missing key" without the completion
    steps = sorted(float(st["step"]) for st in state["optim"]["state"].values())
    assert steps == [0.0, 0.0, 1.0, 1.0]  # the unused ones fresh (step 0, zero moments)
    assert all(float(st["exp_avg"].abs().sum()) == 0 for st in state["optim"]["state"].values() if float(st["step"]) == 0)


def test_a_checkpoint_with_dropout_trains_without_it(ray_local, dense_path, tmp_path):
    """The trainer runs in training mode (gradient checkpointing needs it); the engine never drops
    out. With attention_dropout 0.5 in the checkpoint's config, pi_old (the gradient forward's own
    log-probs) was a dropped-out forward: every ratio and gate decision was noise. Switched off."""
    import json
    import shutil

    path = tmp_path / "dropout"
    shutil.copytree(dense_path, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    g = torch.Generator().manual_seed(4)
    segs = [Segment(torch.randint(3, 500, (24,), generator=g).tolist(), [0] * 8 + [1] * 16, [0.0] * 24, [-1] * 8 + [0] * 16)
            for _ in range(2)]
    b = training_tensors(segs)
    b["advantages"] = torch.tensor([1.0, -1.0])[:, None] * b["loss_mask"]
    t = Trainer(str(path), world_size=1, cfg=TrainerConfig(lr=1e-3, correction=CorrectionConfig(enabled=False, max_staleness=None)))
    try:
        before = t.logprobs(b)
        b["behaviour_logprobs"] = before * b["loss_mask"]
        report = t.train_step(b, report=True)["report"]
        m = b["loss_mask"].bool()
        assert (report["trainer_logprobs"][m] - before[m]).abs().max() < 1e-5
    finally:
        t.shutdown()


def test_a_step_that_failed_part_way_leaves_no_gradients_and_one_after_an_update_moves_the_version(trainer, samples):
    """A rank raising mid-step (an OOM after some micro-batches' backward) left its gradients: the
    next step's first update added them to its own (a batch of all-zero advantages then moved the
    weights), and a checkpoint of an optimizer without state saved none. One raising after an
    optimizer update moved the weights under an unchanged version (the engines were never synced
    to them): it raises PartialUpdate and the version moves. (The faults are injected into the
    real ranks: an OOM cannot be caused on demand.)"""
    import ray

    from workbench.trainer.fsdp import PartialUpdate

    def fail_clip(worker):  # after every micro-batch's backward, before any update
        import torch as t
        real = t.nn.utils.clip_grad_norm_

        def boom(*a, **k):
            t.nn.utils.clip_grad_norm_ = real
            raise RuntimeError("injected: out of memory")
        t.nn.utils.clip_grad_norm_ = boom

    def fail_after_update(worker):  # the update applied, then an error
        real = worker.optimizer.step

        def boom(*a, **k):
            del worker.optimizer.step
            real(*a, **k)
            raise RuntimeError("injected: after the update")
        worker.optimizer.step = boom

    def fresh(batch):  # sampled by the trainer's version: this module's earlier steps made the samples stale,
        batch = dict(batch)  # and the staleness gate dropped every row (no gradient to leave or apply)
        batch["versions"] = torch.where(batch["loss_mask"].bool(), trainer.version, batch["versions"])
        return batch

    probe_ids = list(range(3, 19))
    b, flat = batch_of(samples), batch_of(samples)
    flat["advantages"] = torch.zeros_like(flat["advantages"])
    ray.get([w.__ray_call__.remote(fail_clip) for w in trainer.workers])
    version, before = trainer.version, trainer.probe(probe_ids)
    with pytest.raises(Exception, match="injected: out of memory"):
        trainer.train_step(fresh(b))
    assert trainer.version == version and trainer.probe(probe_ids) == before
    stats = trainer.train_step(fresh(flat))  # the failed step's gradients were its update
    assert stats["grad_norm"] == 0.0 and stats["updates_skipped"] == 1 and trainer.probe(probe_ids) == before
    assert trainer.train_step(fresh(b))["grad_norm"] > 0  # (the batch does carry a gradient)

    before = trainer.probe(probe_ids)
    ray.get([w.__ray_call__.remote(fail_after_update) for w in trainer.workers])
    version = trainer.version
    with pytest.raises(PartialUpdate, match="failed after 1 optimizer update"):
        trainer.train_step(fresh(b))
    assert trainer.version == version + 1 and trainer.probe(probe_ids) != before


def test_a_profile_whose_replay_rule_the_models_routers_lack_is_refused_at_start(ray_local, tmp_path):
    """Replay looks a rule up by the router's class; the start-up check read only the profile's name
    for it, so a profile naming another model's rule (an override; Qwen2-MoE given Qwen3's) started
    and failed its first replayed step. The model's own router classes are checked at start."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from workbench.profiles import ModelProfile

    torch.manual_seed(0)
    Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                       shared_expert_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)).save_pretrained(tmp_path)
    profile = ModelProfile("qwen2.5", moe=True, capture_experts=True, replay_rule="Qwen3MoeTopKRouter")
    with pytest.raises(ValueError, match=r"no rule for this model's router class\(es\) \['Qwen2MoeTopKRouter'\]"):
        Trainer(str(tmp_path), world_size=1, profile=profile, cfg=TrainerConfig(micro_batch_size=2))


def test_a_step_failing_on_one_rank_stops_the_group(ray_local, moe_path, samples):
    """A rank failing a step the other did not (an OOM on the rank with the longest rows): the
    survivor waited in a collective the failed rank never entered, and the next step's collectives
    paired with this one's (an update from two batches' gradients, then a hang until gloo's
    timeout, and a process group no save could use). The group is stopped at once and said so.
    (The fault is injected into one real rank: an OOM on one rank cannot be caused on demand.)"""
    import ray

    from workbench.trainer.fsdp import TrainerOutOfStep

    t = Trainer(str(moe_path), world_size=2, cfg=TrainerConfig(lr=1e-3, micro_batch_size=2))
    try:
        def fail_once(worker):  # rank 1 only, before its first collective
            real = worker._train_step

            def boom(*a, **k):
                worker._train_step = real
                raise RuntimeError("injected: out of memory on rank 1")
            worker._train_step = boom

        ray.get(t.workers[1].__ray_call__.remote(fail_once))
        b = batch_of(samples)
        b["versions"] = torch.where(b["loss_mask"].bool(), t.version, b["versions"])
        with pytest.raises(TrainerOutOfStep, match=r"rank\(s\) \[1\] of 2 failed a train step .* injected: out of memory"):
            t.train_step(b)
        with pytest.raises(ray.exceptions.RayActorError):  # stopped: no call pairs with the lost one
            ray.get(t.workers[0].__ray_ready__.remote(), timeout=30)
    finally:
        t.shutdown()
