"""Both rollout backends on both tiny models, against a teacher-forced HF forward."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import random
import time

import numpy as np
import pytest
import ray
import torch

from workbench.replay import routing_replay
from workbench.rollout.engine import (
    SamplingConfig,
    WeightSyncError,
    create_engine,
    expected_probe_logprobs,
    probe_ids,
)
from workbench.toy.models import load_hf_model, load_tokenizer
from workbench.toy.tasks import arithmetic_problem

VLLM_GAP_BOUND = 1e-4  # fp32 on CPU; measured ~2e-6 (the test prints it)


def prompts(path, n=4):
    import random

    tok = load_tokenizer(path)
    rng = random.Random(0)
    out = [tok.apply_chat_template(arithmetic_problem(rng).messages, add_generation_prompt=True)["input_ids"] for _ in range(n)]
    return out + [[5, 6, 7]]  # a short odd one: mixed lengths exercise left padding


def teacher_forced(model, sample, temperature=1.0, experts=None):
    """log p(sampled token) under one unpadded HF forward of prompt + completion."""
    full = sample.prompt_ids + sample.token_ids
    with routing_replay(model, None if experts is None else torch.as_tensor(experts)) as stats:
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    P = len(sample.prompt_ids)
    got = [lp[P - 1 + j, t].item() for j, t in enumerate(sample.token_ids)]
    return np.asarray(got), stats


def same_until_a_tie(model, a, b, temperature=0.0, tie=1e-3):
    """Two samples of one prompt at temperature 0 (or below vLLM's 0.01 minimum) must agree token
    for token, except where the model's best logits are within `tie` of each other: there a
    different batch shape (vLLM batches the concurrent requests, the reference runs them one by
    one) may pick either, and the two continuations then differ. Below the minimum both backends
    *sample* at temperature 0.01, so a token whose logit is a few hundredths below the best is a
    live choice too: the tie widens to 20 x 0.01 (such a token then has probability >= e^-20 of
    the best's). Returns how many leading tokens the samples share."""
    if temperature > 0:
        tie = max(tie, 20 * max(temperature, 0.01))
    k = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
    if k < len(a.token_ids):
        with torch.no_grad():
            logits = model(torch.tensor([a.prompt_ids + a.token_ids[:k]])).logits[0, -1].float()
        top = float(logits.max())
        gaps = (top - float(logits[a.token_ids[k]]), top - float(logits[b.token_ids[k]]))
        assert max(gaps) <= tie, f"samples at temperature {temperature} differ at token {k} ({a.token_ids[k]} vs {b.token_ids[k]}), not a tie: gaps to the best logit {gaps} > {tie}"
    return k


def perturbed(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


async def start(backend, path, **kw):
    e = create_engine(backend, model_path=str(path), **kw)
    await e.start()
    return e


# ----------------------------------------------------------------------------- reference sampler
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_reference_logprobs_equal_teacher_forced(name, request):
    path = request.getfixturevalue(f"{name}_path")

    async def main():
        e = await start("reference", path)
        s = SamplingConfig(temperature=0.7, max_tokens=24, seed=1)
        outs = await asyncio.gather(*[e.generate(p, s) for p in prompts(path)])
        await e.shutdown()
        return outs

    model = load_hf_model(path)
    for o in asyncio.run(main()):
        assert o.token_ids and len(o.token_ids) == len(o.logprobs) == len(o.versions)
        assert o.finish_reason in ("stop", "length") and set(o.versions) == {0}
        assert all(0 <= t < model.config.vocab_size for t in o.token_ids)
        tf, _ = teacher_forced(model, o, temperature=0.7)
        assert np.max(np.abs(tf - np.asarray(o.logprobs))) <= 1e-5


def test_reference_moe_experts_replay_exactly(moe_path):
    async def main():
        e = await start("reference", moe_path)
        outs = await asyncio.gather(*[e.generate(p, SamplingConfig(max_tokens=16), return_routed_experts=True) for p in prompts(moe_path)])
        await e.shutdown()
        return outs

    model = load_hf_model(moe_path)
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    for o in asyncio.run(main()):
        ex = o.routed_experts
        assert ex.shape == (len(o.prompt_ids) + len(o.token_ids), layers, k) and ex.dtype == np.int16
        assert (ex[:-1] >= 0).all() and (ex[-1] == -1).all()  # the last sampled token is never fed
        tf, stats = teacher_forced(model, o, experts=ex)
        assert np.max(np.abs(tf - np.asarray(o.logprobs))) <= 1e-5
        assert stats.disagreement_rate == 0.0 and stats.fallback == [1] * layers
        # The replay is really in charge: replaying wrong experts changes the log-probs, and the
        # disagreement statistic reports it.
        wrong = np.where(ex >= 0, (ex + 1) % model.config.num_experts, ex)
        tf_wrong, stats_wrong = teacher_forced(model, o, experts=wrong)
        assert np.max(np.abs(tf_wrong - np.asarray(o.logprobs))) > 1e-3
        assert stats_wrong.disagreement_rate > 0.5


def test_reference_stop_length_abort_pause(dense_path):
    async def main():
        e = await start("reference", dense_path)
        p = prompts(dense_path)[0]
        cut = await e.generate(p, SamplingConfig(max_tokens=3, ignore_eos=True))
        assert cut.finish_reason == "length" and len(cut.token_ids) == 3
        greedy = await e.generate(p, SamplingConfig(max_tokens=3, temperature=0, ignore_eos=True))
        stopped = await e.generate(p, SamplingConfig(max_tokens=3, temperature=0, stop_token_ids=[greedy.token_ids[0]]))
        assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[:1]
        # a stop string longer than 16 tokens stops it too (only the last 16 tokens' text was searched)
        run_on = await e.generate(p, SamplingConfig(max_tokens=40, temperature=0, ignore_eos=True))
        long_stop = e.tokenizer.decode(run_on.token_ids[2:30], skip_special_tokens=True)  # (as vLLM reads text)
        by_text = await e.generate(p, SamplingConfig(max_tokens=40, temperature=0, ignore_eos=True, stop=[long_stop]))
        assert by_text.finish_reason == "stop" and len(by_text.token_ids) <= 30, (len(by_text.token_ids), long_stop)
        # abort mid-flight
        task = asyncio.create_task(e.generate(p, SamplingConfig(max_tokens=900, ignore_eos=True), request_id="long"))
        await asyncio.sleep(0.3)
        await e.abort("long")
        aborted = await asyncio.wait_for(task, 30)
        assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 900
        # a paused engine makes no progress; resume continues the request
        await e.pause()
        task = asyncio.create_task(e.generate(p, SamplingConfig(max_tokens=60, ignore_eos=True)))
        await asyncio.sleep(0.5)
        assert not task.done()
        await e.resume()
        done = await asyncio.wait_for(task, 30)
        assert done.finish_reason == "length" and len(done.token_ids) == 60
        await e.shutdown()

    asyncio.run(main())


def test_reference_stop_strings_read_the_text_as_vllm_does():
    """The reference engine decoded the last tokens alone: a SentencePiece reply's first piece lost
    its space (" Observation" at a reply's start never stopped it, the record ran on past what the
    server cut), and a stop string spelling a special token stopped it where vLLM (its text without
    special tokens) does not."""
    from workbench.real_models import load_family
    from workbench.rollout.reference import ReferenceEngine, _Request

    e = object.__new__(ReferenceEngine)
    e.tokenizer, e.eos_ids = load_family("mistral-v3").tokenizer, set()
    prompt = e.tokenizer.encode("[INST] Go [/INST]", add_special_tokens=False)
    reply = e.tokenizer.encode("[INST] Go [/INST] Observation: x", add_special_tokens=False)[len(prompt):]

    def reason(stop, ids):
        r = _Request(prompt, SamplingConfig(max_tokens=100, stop=stop), "r", False, None, None)
        r.token_ids = ids
        return e._stop_reason(r, ids[-1])

    assert reason([" Observation"], reply) == "stop" and reason([" Thought"], reply) is None
    eos = e.tokenizer.convert_tokens_to_ids("</s>")
    assert reason(["</s>"], reply + [eos]) is None and reason([": x"], reply + [eos]) == "stop"
    long_reply = reply + e.tokenizer.encode(" and on" * 30, add_special_tokens=False) + reply  # (a window mid-reply)
    assert reason([" Observation"], long_reply) == "stop"


def test_wire_weights_round_trip_every_dtype_and_map_the_object_store(ray_local):
    """The CPU weight sync's form in Ray's object store: the same tensors come out, and what an
    engine receives are read-only views of the store's memory, not unpickled copies (the copy
    that made a 540 MB sync ~1 s slower). bfloat16 and float8, which numpy lacks, travel bit for
    bit as integers of their size."""
    from workbench.rollout.engine import WireWeights

    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16),
          "h": torch.randn(8, generator=g).half(), "step": torch.tensor(7), "f8": torch.ones(4).to(torch.float8_e4m3fn)}
    got = ray.get(ray.put(WireWeights.of(sd)))
    assert got.dtypes == {"w": "float32", "b": "bfloat16", "h": "float16", "step": "int64", "f8": "float8_e4m3fn"}
    assert not got.arrays["w"].flags.writeable and not got.arrays["b"].flags.writeable  # mapped, not copied
    assert got.arrays["b"].dtype == np.int16 and got.arrays["f8"].dtype == np.uint8
    out = got.tensors()
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k].float(), v.float()), k


def test_reference_weight_update_and_partial_rollout(moe_path):
    model = load_hf_model(moe_path)
    new = perturbed(model)

    async def main():
        e = await start("reference", moe_path)
        p = prompts(moe_path)[0]
        long = asyncio.create_task(e.generate(p, SamplingConfig(max_tokens=300, ignore_eos=True)))
        await asyncio.sleep(0.3)
        model.load_state_dict(new)
        report = await e.update_weights(new, expected_probe=expected_probe_logprobs(model, probe_ids(e.vocab_size)), tol=1e-5)
        spanning = await long
        after = await e.generate(p, SamplingConfig(max_tokens=20))
        # a stale engine fails the post-sync check
        # (the same weights loaded again: the error says the engine serves its previous sync's)
        with pytest.raises(WeightSyncError, match=r"at \d+ of 47 probe positions, the first at \d+, the largest at \d+; .* previous sync's by up to 0\)"
                                                  r": it does not serve the new weights"):
            stale = expected_probe_logprobs(load_hf_model(moe_path), probe_ids(e.vocab_size))
            await e.update_weights(new, expected_probe=stale)
        await e.shutdown()
        return report, spanning, after

    report, spanning, after = asyncio.run(main())
    assert report.version == 1 and report.checked and report.probe_max_abs_diff <= 1e-5
    v = spanning.versions
    assert v[0] == 0 and v[-1] == 1 and v == sorted(v), "partial rollout must record both versions, in order"
    # each token is its version's policy on its whole context (the K/V is re-encoded at the load)
    versions, got = np.asarray(v), np.asarray(spanning.logprobs)
    old_tf, _ = teacher_forced(load_hf_model(moe_path), spanning)
    new_tf, _ = teacher_forced(model, spanning)
    assert np.max(np.abs(old_tf - got)[versions == 0]) <= 1e-5
    assert np.max(np.abs(new_tf - got)[versions == 1]) <= 1e-5
    assert set(after.versions) == {1}
    tf, _ = teacher_forced(model, after)
    assert np.max(np.abs(tf - np.asarray(after.logprobs))) <= 1e-5


def test_versions_must_increase(dense_path):
    async def main():
        e = await start("reference", dense_path)
        with pytest.raises(ValueError, match="must increase"):
            await e.update_weights({}, version=0)
        # a state dict that does not fit loads nothing: the model keeps every old weight, the version
        # stays (load_state_dict copied what fitted, then the load was refused: half new, old label)
        before = {k: v.clone() for k, v in e.model.state_dict().items()}
        new = {k: v + 1.0 for k, v in before.items()}
        name = next(iter(new))
        new[name] = new[name][:1]  # one tensor of another shape
        with pytest.raises(ValueError, match=r"nothing loaded.*other shapes"):
            await e.update_weights(new)
        assert all(torch.equal(before[k], v) for k, v in e.model.state_dict().items())
        assert e.info()["version"] == 0
        await e.shutdown()

    asyncio.run(main())


def test_bad_requests_are_refused(dense_path):
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="unknown rollout backend 'nope'"):
        create_engine("nope", model_path=str(dense_path))

    async def main():
        e = await start("reference", dense_path, max_model_len=64)
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await e.generate([1] * 60, SamplingConfig(max_tokens=10))
        with pytest.raises(ValueError, match="prompt_ids must be in"):
            await e.generate([100000], SamplingConfig(max_tokens=1))
        ok = await e.generate([5, 6], SamplingConfig(max_tokens=2))  # still serving
        assert len(ok.token_ids) >= 1
        await e.shutdown()

    asyncio.run(main())


def test_reference_stops_on_every_id_of_an_eos_list(dense_path, tmp_path):
    """Llama 3 configs give eos_token_id as a list: the reference backend starts and stops on
    each of its ids (vLLM does), not only on the tokenizer's end of turn."""
    import json
    import shutil

    async def greedy(path, p, **kw):
        e = await start("reference", path)
        out = await e.generate(p, SamplingConfig(max_tokens=12, temperature=0, **kw))
        await e.shutdown()
        return out

    eot = load_tokenizer(dense_path).eos_token_id
    tok = load_tokenizer(dense_path)
    p = tok.apply_chat_template([{"role": "user", "content": "Say something about books."}], add_generation_prompt=True)["input_ids"]
    free = asyncio.run(greedy(dense_path, p, ignore_eos=True))
    before_eot = free.token_ids[: free.token_ids.index(eot)] if eot in free.token_ids else free.token_ids
    k, stop_id = next((k, t) for k, t in reversed(list(enumerate(before_eot))) if t not in before_eot[:k])
    llama_like = tmp_path / "llama_like"
    shutil.copytree(dense_path, llama_like)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((llama_like / name).read_text())
        cfg["eos_token_id"] = [eot, stop_id]
        (llama_like / name).write_text(json.dumps(cfg))
    out = asyncio.run(greedy(llama_like, p))
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: k + 1] and stop_id != eot


def test_reference_and_vllm_agree_at_temperature_zero_and_below_vllms_minimum(vllm_moe, moe_path):
    """Greedy (temperature 0): vLLM 0.32 reports the log-prob of the unscaled logits, i.e.
    log_softmax(logits) (sampler.py: greedy requests skip the temperature), and so does the
    reference backend. 0 < temperature < 0.01 is raised to 0.01 by vLLM (sampling_params.py);
    the reference backend does the same, instead of dividing by the tiny temperature."""
    tok = load_tokenizer(moe_path)
    chat = tok.apply_chat_template([{"role": "user", "content": "Say something about books."}], add_generation_prompt=True)["input_ids"]
    # 1e-6: raised to 0.01 before vLLM's greedy test (the reference took < 1e-5 as greedy)
    cases = [(p, t) for p in [chat] + prompts(moe_path)[:2] for t in (0.0, 0.001, 1e-6)]

    async def reference():
        e = await start("reference", moe_path)
        outs = [await e.generate(p, SamplingConfig(max_tokens=12, temperature=t, ignore_eos=True)) for p, t in cases]
        await e.shutdown()
        return outs

    ours = asyncio.run(reference())
    theirs = ray.get([vllm_moe.generate.remote(p, SamplingConfig(max_tokens=12, temperature=t, ignore_eos=True)) for p, t in cases])
    model = load_hf_model(moe_path)
    for (p, t), a, b in zip(cases, ours, theirs):
        k = same_until_a_tie(model, a, b, temperature=t)
        # (initial=0: the samples may part at their first token, a near tie at temperature 0.01)
        assert np.max(np.abs(np.asarray(a.logprobs[:k]) - np.asarray(b.logprobs[:k])), initial=0.0) <= VLLM_GAP_BOUND, (t, a.logprobs, b.logprobs)
        if t == 0:
            tf, _ = teacher_forced(model, b)  # temperature 1: the unscaled logits
            assert np.max(np.abs(tf - np.asarray(b.logprobs))) <= VLLM_GAP_BOUND
    # a divergence that is not a tie still fails: the reference's first token swapped for its worst
    a = ours[0]
    with torch.no_grad():
        worst = int(model(torch.tensor([a.prompt_ids])).logits[0, -1].argmin())
    swapped = dataclasses.replace(a, token_ids=[worst] + a.token_ids[1:])
    with pytest.raises(AssertionError, match="not a tie"):
        same_until_a_tie(model, a, swapped)
    with pytest.raises(AssertionError, match="not a tie"):
        same_until_a_tie(model, a, swapped, temperature=0.001)
    # the cases do reach a near tie, where the temperature used below 0.01 shows in the log-prob
    assert min(lp for (p, t), b in zip(cases, theirs) if t > 0 for lp in b.logprobs) < -1e-2


def test_vllm_tokens_without_a_weight_version_raise(moe_path):
    """A token vLLM returns without a weight-version label (weight_versions None: no label was
    ever set; or spans that do not cover every token) must not be recorded as version -1,
    which every staleness check would take for a prompt token. vLLM 0.32 does this only when
    update_weight_version was never called, which VLLMEngine.start always does; so the engine's
    AsyncLLM is replaced here by a stub that returns vLLM's own output objects."""
    import shutil
    import types

    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, WeightVersionSpan

    from workbench.rollout.vllm_engine import VLLMEngine

    def stub(spans):
        async def generate(prompt, params, request_id):
            yield types.SimpleNamespace(finished=True, outputs=[CompletionOutput(
                index=0, text="ab", token_ids=[7, 8], cumulative_logprob=-0.3,
                logprobs=[{7: Logprob(-0.1)}, {8: Logprob(-0.2)}], finish_reason="length", weight_versions=spans)])
        return types.SimpleNamespace(generate=generate)

    e = VLLMEngine(str(moe_path))
    try:
        for spans, match in [(None, "no weight version for 2 of the 2"),
                             ([WeightVersionSpan("3", 0, 1)], "no weight version for 1 of the 2"),
                             ([WeightVersionSpan("v3", 0, 2)], "integer labels")]:
            e.llm = stub(spans)
            with pytest.raises(RuntimeError, match=match):
                asyncio.run(e.generate([5, 6], SamplingConfig(max_tokens=2)))
        e.llm = stub([WeightVersionSpan("3", 0, 1), WeightVersionSpan("4", 1, 2)])
        out = asyncio.run(e.generate([5, 6], SamplingConfig(max_tokens=2)))
        assert out.versions == [3, 4] and out.logprobs == [-0.1, -0.2]
    finally:
        shutil.rmtree(e._shm, ignore_errors=True)


# ----------------------------------------------------------------------------- vLLM (CPU build)
def test_vllm_syncs_a_model_whose_names_transformers_changes(moe_path, tmp_path):
    """transformers 5 holds Mixtral as `mlp` with fused experts; vLLM's Mixtral loads checkpoint
    names (`block_sparse_moe.experts.N.w1`) and refused the trainer's ("no module or parameter
    named 'layers.0.mlp'"), midway through its layerwise reload. The engine loads the checkpoint
    layout (checkpoint_format), and serves the new weights: its probe equals the trainer's."""
    import shutil

    from transformers import AutoModelForCausalLM, MixtralConfig

    from workbench.rollout.vllm_engine import VLLMEngine

    cfg = MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=256, eos_token_id=509, pad_token_id=507)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(moe_path / f, tmp_path)
    model = load_hf_model(tmp_path)
    model.load_state_dict(perturbed(model))
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()  # the in-memory names sent

    async def sync():
        engine = VLLMEngine(str(tmp_path), max_model_len=256)
        await engine.start()
        try:
            expected = expected_probe_logprobs(model, probe_ids(model.config.vocab_size))
            return await engine.update_weights({k: v.detach().clone() for k, v in model.state_dict().items()}, 1,
                                               expected_probe=expected, tol=1e-3)
        finally:
            await engine.shutdown()

    report = asyncio.run(sync())
    assert report.checked and report.probe_max_abs_diff < 1e-4



def test_vllm_moe_samples_well_formed_and_match_hf(vllm_moe, moe_path, capsys):
    model = load_hf_model(moe_path)
    refs = [vllm_moe.generate.remote(p, SamplingConfig(max_tokens=24, seed=i)) for i, p in enumerate(prompts(moe_path))]
    gaps = []
    for o in ray.get(refs):
        assert o.token_ids and len(o.token_ids) == len(o.logprobs) == len(o.versions)
        assert all(0 <= t < model.config.vocab_size for t in o.token_ids)
        assert o.finish_reason in ("stop", "length") and set(o.versions) == {0}
        tf, _ = teacher_forced(model, o)
        gaps.append(np.max(np.abs(tf - np.asarray(o.logprobs))))
    with capsys.disabled():
        print(f"\n[measured] vLLM(CPU, fp32) vs HF teacher-forced log-prob gap: max {max(gaps):.2e}, mean {np.mean(gaps):.2e}")
    assert max(gaps) <= VLLM_GAP_BOUND


def test_vllm_in_process_core_samples_as_the_core_process_does(vllm_moe, moe_path):
    """On CPU the engine core runs in the engine's own process (rollout/vllm_inproc.py): no child
    process, and seeded requests sample the same ids, log-probs and versions as AsyncLLM's core
    process (engine_core_in_process=False, the GPU path), which loads a sync from a file. That core
    process's stop leaves it not running (it exits, or is killed after its grace) and no ZMQ socket
    of its in /tmp."""
    import glob
    import os
    import stat
    import tempfile

    import psutil

    from workbench.rollout.actor import launch_engine, stop_engine

    def temp_dir_sockets() -> set[str]:
        return {p for p in glob.glob(os.path.join(tempfile.gettempdir(), "*")) if stat.S_ISSOCK(os.lstat(p).st_mode)}

    sockets_before = temp_dir_sockets()
    apart = launch_engine("vllm", model_path=str(moe_path), engine_core_in_process=False,
                          env={"VLLM_LOGGING_LEVEL": "WARNING"})
    try:
        hosts = [psutil.Process(ray.get(e.__ray_call__.remote(lambda self: os.getpid()))) for e in (vllm_moe, apart)]
        assert hosts[0].children() == []
        core = [c for c in hosts[1].children() if c.name() == "VLLM::EngineCore"]
        assert len(core) == 1, hosts[1].children()
        asks = [(p, SamplingConfig(max_tokens=12, seed=7 + i)) for i, p in enumerate(prompts(moe_path))]
        here, there = ([ray.get(e.generate.remote(p, s)) for p, s in asks] for e in (vllm_moe, apart))
        for a, b in zip(here, there):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert np.allclose(a.logprobs, b.logprobs, atol=1e-5) and a.versions == b.versions
        # its weight sync goes by file (the in-process core's by reference: the test above), here
        # while a request runs: its K/V is recomputed in the core process too, so each of its
        # tokens is its own version's policy on the whole context
        model = load_hf_model(moe_path)
        model.load_state_dict(perturbed(model))
        expected = expected_probe_logprobs(model, probe_ids(model.config.vocab_size))
        long = apart.generate.remote(prompts(moe_path)[1], SamplingConfig(max_tokens=900, ignore_eos=True))
        time.sleep(0.2)
        report = ray.get(apart.update_weights.remote(model.state_dict(), None, expected))
        assert report.checked and report.probe_max_abs_diff <= VLLM_GAP_BOUND
        spanning = ray.get(long)
        versions, got = np.asarray(spanning.versions), np.asarray(spanning.logprobs)
        assert set(spanning.versions) == {0, 1} and spanning.versions == sorted(spanning.versions)
        assert np.max(np.abs(teacher_forced(load_hf_model(moe_path), spanning)[0] - got)[versions == 0]) <= VLLM_GAP_BOUND
        assert np.max(np.abs(teacher_forced(model, spanning)[0] - got)[versions == 1]) <= VLLM_GAP_BOUND
    finally:
        stop_engine(apart)
    assert temp_dir_sockets() - sockets_before == set()  # vLLM's went into the engine's temp dir, removed with it
    deadline = time.time() + 30  # a killed process is "running" while the kernel frees its memory
    while core[0].is_running() and core[0].status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.1)
    assert not core[0].is_running() or core[0].status() == psutil.STATUS_ZOMBIE


def test_an_unstreamed_request_gets_its_final_output_only(vllm_moe, moe_path):
    """generate() asks vLLM for the final output only: one output handed from the engine's thread to
    its event loop for a 12-token request, where a streamed one gets one per engine step (each was
    built and consumed, per request and step, for nothing). The Sample is the streamed one's."""
    from workbench.rollout.engine import Sample

    def counting(actor):  # in the engine's process: count the outputs the thread hands to the loop
        llm = actor.engine.llm
        llm.delivered = 0
        deliver = type(llm)._deliver

        def counted(batch):
            llm.delivered += len(batch)
            deliver(llm, batch)
        llm._deliver = counted

    def delivered(actor):
        llm = actor.engine.llm
        n, llm.delivered = llm.delivered, 0
        return n

    ask = SamplingConfig(max_tokens=12, ignore_eos=True, seed=5)
    ray.get(vllm_moe.__ray_call__.remote(counting))
    try:
        plain = ray.get(vllm_moe.generate.remote(prompts(moe_path)[0], ask))
        assert len(plain.token_ids) == 12 and ray.get(vllm_moe.__ray_call__.remote(delivered)) == 1
        streamed = [ray.get(r) for r in vllm_moe.generate_stream.options(num_returns="streaming").remote(prompts(moe_path)[0], ask)]
        assert ray.get(vllm_moe.__ray_call__.remote(delivered)) == 12
        final = streamed[-1]
        ids = sum(streamed[:-1], [])  # (the last step's ids come with the Sample)
        assert isinstance(final, Sample) and 0 < len(ids) < 12 and final.token_ids[:len(ids)] == ids
        assert (final.token_ids, final.versions) == (plain.token_ids, plain.versions)
        assert np.allclose(final.logprobs, plain.logprobs, atol=1e-6)
    finally:
        ray.get(vllm_moe.__ray_call__.remote(lambda actor: actor.engine.llm.__dict__.pop("_deliver", None) and None))


def test_the_loop_checks_the_log_probs_each_engine_reports(vllm_moe):
    """The running vLLM engine says what its log-probs are of (its model config's logprobs_mode);
    the loop's sampling check reads it from every engine: an engine reporting raw log-probs (of the
    distribution before temperature) is refused before a step. The check was handed nothing."""
    import types

    from workbench.correction import CorrectionConfig, CorrectionConfigError
    from workbench.loop import check_sampling
    from workbench.trainer.fsdp import TrainerConfig

    assert ray.get(vllm_moe.info.remote())["logprobs_mode"] == "processed_logprobs"
    trainer = types.SimpleNamespace(cfg=TrainerConfig(correction=CorrectionConfig()))
    check_sampling(None, trainer, [vllm_moe])
    raw = types.SimpleNamespace(info=types.SimpleNamespace(remote=lambda: ray.put({"logprobs_mode": "raw_logprobs"})))
    with pytest.raises(CorrectionConfigError, match="processed log-probs"):
        check_sampling(None, trainer, [vllm_moe, raw])


def test_vllm_cpu_kv_cache_holds_what_the_engine_needs(vllm_moe, moe_path):
    from workbench.rollout.vllm_engine import VLLMEngine, kv_bytes_per_token

    # the toy MoE: 2 layers x 2 KV heads x 32 dims, keys and values in fp32 = 1 KiB a token; the
    # session engine holds 128 sequences of max_model_len 1024 (128 MiB), not vLLM's ~1.5M tokens
    assert kv_bytes_per_token(str(moe_path)) == 1024
    assert abs(ray.get(vllm_moe.info.remote())["kv_cache_tokens"] - 128 * 1024) <= 128
    assert VLLMEngine(str(moe_path), kv_cache_tokens=5000).engine_args["kv_cache_memory_bytes"] == 5000 * 1024
    assert VLLMEngine(str(moe_path), kv_cache_tokens=10).engine_args["kv_cache_memory_bytes"] == (1024 + 256) * 1024
    # an explicit fraction of the machine's memory keeps vLLM's own sizing
    assert "kv_cache_memory_bytes" not in VLLMEngine(str(moe_path), gpu_memory_utilization=0.1).engine_args


def test_vllm_scores_a_sequence_that_fills_the_context(vllm_moe, moe_path):
    """A distillation teacher scores whole segments (probe_logprobs), and a reply the loopback
    cut at the context's end fills it exactly: as a prompt of max_model_len tokens vLLM refused it
    (it must leave room for a token), the rollout failed and its groups were lost. The last
    token's log-prob comes from the one sampled position instead, equal to the HF model's."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (1024,), generator=g).tolist()  # the session engine's max_model_len
    got = ray.get(vllm_moe.probe_logprobs.remote(ids))
    want = expected_probe_logprobs(load_hf_model(moe_path), ids)
    assert len(got) == len(want) == 1023
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3


def test_vllm_cpu_engine_compiles_nothing_for_log_probs(vllm_moe, moe_path):
    """vLLM's sampler torch.compiles its log-prob gather: on CPU ~2 s of Dynamo and Inductor on
    the first request, which was the whole of connect()'s first weight sync. The in-process core
    steps in a thread of its own, and torch's config is per thread, so Dynamo is turned off in
    that thread (VLLMEngine.start): no frame is compiled in the engine's process. (Start-up time
    itself is bench/'s to measure.)"""
    out = ray.get(vllm_moe.generate.remote(prompts(moe_path)[0], SamplingConfig(max_tokens=4, seed=1)))
    assert len(out.logprobs) == len(out.token_ids) > 0  # (the log-prob path ran)
    # (a lambda: cloudpickle sends it by value; the engine's process cannot import this module)
    compiled = ray.get(vllm_moe.__ray_call__.remote(
        lambda _: dict(importlib.import_module("torch._dynamo.utils").counters["frames"])))
    assert compiled == {}, f"frames compiled by Dynamo in the engine's process: {compiled}"


def test_vllm_engine_that_fails_to_start_leaves_no_temp_dir(moe_path):
    """A start vLLM refuses (here: a context longer than the model's) raises vLLM's error and
    removes the engine's temp dir: nothing will call shutdown() on an engine that never started."""
    import asyncio
    import glob

    from workbench.rollout.vllm_engine import VLLMEngine

    before = set(glob.glob("/dev/shm/workbench-sync-*"))
    engine = VLLMEngine(str(moe_path), max_model_len=1 << 20, kv_cache_tokens=1 << 10)
    with pytest.raises(Exception, match="max_model_len"):
        asyncio.run(engine.start())
    assert engine._shm is None and set(glob.glob("/dev/shm/workbench-sync-*")) == before


def test_vllm_routed_experts_refused_clearly_on_cpu(vllm_moe, moe_path):
    from workbench.rollout.vllm_engine import VLLMEngine

    with pytest.raises(NotImplementedError, match="reference"):
        VLLMEngine(str(moe_path), enable_return_routed_experts=True)
    with pytest.raises(NotImplementedError, match="does not return routed experts"):
        ray.get(vllm_moe.generate.remote([5, 6, 7], SamplingConfig(max_tokens=2), None, True))


def test_a_vllm_sync_drops_a_kv_connectors_cache_too(vllm_moe, moe_path):
    """vLLM clears a KV connector's cache (CPU offloading, LMCache: engine_kwargs) only when asked:
    after a sync a prefix hit there loaded K/V the old weights computed, under the new version."""
    def spy(host):
        engine = host.engine.llm.engine
        engine._resets, real = [], engine.reset_prefix_cache
        engine.reset_prefix_cache = lambda *a, **k: engine._resets.append((a, k)) or real(*a, **k)

    ray.get(vllm_moe.__ray_call__.remote(spy))
    try:
        ray.get(vllm_moe.update_weights.remote(load_hf_model(moe_path).state_dict(), None, None))
        resets = ray.get(vllm_moe.__ray_call__.remote(lambda host: host.engine.llm.engine._resets))
        assert resets and all(a[:2] == (True, True) for a, _ in resets), resets
    finally:
        ray.get(vllm_moe.__ray_call__.remote(lambda host: vars(host.engine.llm.engine).pop("reset_prefix_cache") and None))


def test_vllm_weight_update_partial_rollout_and_check(vllm_moe, moe_path):
    model = load_hf_model(moe_path)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(model)
    p = prompts(moe_path)[1]
    v0 = ray.get(vllm_moe.info.remote())["version"]
    try:
        # the new weights' probe first: the sync must land while the long request runs (on a fast
        # machine 300 tokens were done before the HF forward here had finished)
        model.load_state_dict(new)
        expected = expected_probe_logprobs(model, probe_ids(model.config.vocab_size))
        long = vllm_moe.generate.remote(p, SamplingConfig(max_tokens=900, ignore_eos=True))
        time.sleep(0.2)
        report = ray.get(vllm_moe.update_weights.remote(new, None, expected))
        assert report.version == v0 + 1 and report.checked and report.probe_max_abs_diff <= VLLM_GAP_BOUND
        spanning = ray.get(long)
        assert spanning.versions[0] == v0 and spanning.versions[-1] == v0 + 1
        assert spanning.versions == sorted(spanning.versions)
        # each token is exactly the policy of its version, on its whole context: the in-flight
        # request's K/V is recomputed under the new weights, not kept (vLLM's plain prefix-cache
        # reset refuses while a request holds blocks, and new requests then reused old K/V)
        versions = np.asarray(spanning.versions)
        old_tf, _ = teacher_forced(load_hf_model(moe_path), spanning)
        new_tf, _ = teacher_forced(model, spanning)
        got = np.asarray(spanning.logprobs)
        assert np.max(np.abs(old_tf - got)[versions == v0]) <= VLLM_GAP_BOUND
        assert np.max(np.abs(new_tf - got)[versions == v0 + 1]) <= VLLM_GAP_BOUND
        # a new request on a prefix the long one had cached under the old weights (> one KV block)
        shared = ray.get(vllm_moe.generate.remote(spanning.prompt_ids + spanning.token_ids[:400],
                                                  SamplingConfig(max_tokens=8, ignore_eos=True)))
        tf, _ = teacher_forced(model, shared)
        assert np.max(np.abs(tf - np.asarray(shared.logprobs))) <= VLLM_GAP_BOUND
        after = ray.get(vllm_moe.generate.remote(p, SamplingConfig(max_tokens=24)))
        assert set(after.versions) == {v0 + 1}
        tf, _ = teacher_forced(model, after)  # log-probs follow the new weights
        assert np.max(np.abs(tf - np.asarray(after.logprobs))) <= VLLM_GAP_BOUND
        # claiming the old weights as the truth must fail the check
        with pytest.raises(WeightSyncError):
            stale = expected_probe_logprobs(load_hf_model(moe_path), probe_ids(model.config.vocab_size))
            ray.get(vllm_moe.update_weights.remote(new, None, stale))
    finally:  # the engine is shared by the session: give it back its original weights
        model.load_state_dict(original)
        expected = expected_probe_logprobs(model, probe_ids(model.config.vocab_size))
        ray.get(vllm_moe.update_weights.remote(original, None, expected))


def test_k3_on_current_tokens_catches_old_kv_kept_across_a_sync(vllm_moe, moe_path):
    """The forward-consistency statistic on the partial-rollout mechanism: k3 on the tokens of the
    trainer's own version (kl_k3_current, staleness excluded) is ~0 when the engine recomputes an
    in-flight request's K/V at a sync, and large when it keeps the old weights' K/V (what the
    engine did before session 24, put back here for one sync)."""
    import types

    from workbench.correction import CorrectionConfig, correction_weights

    model = load_hf_model(moe_path)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(model, seed=3)
    model.load_state_dict(new)  # the trainer, one version ahead of the sampler's start

    def keep_old_kv(host, keep: bool):
        engine = host.engine
        if keep:
            async def plain_reset(self):  # refused by vLLM while a request holds blocks
                await self.llm.reset_prefix_cache()
            engine._drop_old_kv = types.MethodType(plain_reset, engine)
        else:
            engine.__dict__.pop("_drop_old_kv", None)

    def k3_current(keep: bool) -> dict:
        ray.get(vllm_moe.__ray_call__.remote(keep_old_kv, keep))
        try:
            v0 = ray.get(vllm_moe.info.remote())["version"]
            long = vllm_moe.generate.remote(prompts(moe_path)[1], SamplingConfig(max_tokens=900, ignore_eos=True))
            time.sleep(0.2)
            ray.get(vllm_moe.update_weights.remote(new))
            sample = ray.get(long)
        finally:
            ray.get(vllm_moe.__ray_call__.remote(keep_old_kv, False))
            ray.get(vllm_moe.update_weights.remote(original))
        trainer_lp, _ = teacher_forced(model, sample)
        row = lambda x, dtype=torch.float32: torch.tensor([list(x)], dtype=dtype)  # noqa: E731
        corr = correction_weights(row(trainer_lp), row(sample.logprobs), torch.ones(1, len(sample.token_ids)),
                                  row(sample.versions, torch.long), v0 + 1, CorrectionConfig())
        return corr.stats

    kept, recomputed = k3_current(keep=True), k3_current(keep=False)
    assert kept["tokens_current"] > 0 and recomputed["tokens_current"] > 0
    print(f"[measured] k3 on current-version tokens: old K/V kept {kept['kl_k3_current']:.3g}, "
          f"recomputed {recomputed['kl_k3_current']:.2g}")
    assert kept["kl_k3_current"] > 0.05
    assert recomputed["kl_k3_current"] < 1e-6


def test_a_weight_load_that_fails_part_way_leaves_no_token_sampled_from_torn_weights(vllm_moe, moe_path):
    """A load that fails after copying (here the old K/V's drop refused, after every new weight
    is in: a fault vLLM gives only in odd states, put in for one sync) left the engine serving
    the new weights under the old version's label: the request in flight and every later one
    were recorded as the old policy. Now the request in flight fails, later ones are refused,
    info says why, and the next complete sync serves again; a load refused before any copy
    (a name the model lacks) keeps serving the old weights under their label."""
    import types

    from workbench.rollout.engine import TornWeights, WeightsNotLoaded

    model = load_hf_model(moe_path)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(model, seed=5)

    def refuse_kv_drop(host, on: bool):
        engine = host.engine
        if on:
            async def refused(self):
                raise RuntimeError("vLLM refused to drop the K/V (put in by the test)")
            engine._drop_old_kv = types.MethodType(refused, engine)
        else:
            engine.__dict__.pop("_drop_old_kv", None)

    v0 = ray.get(vllm_moe.info.remote())["version"]
    # refused before any copy: nothing torn, the same weights under the same label
    with pytest.raises(WeightsNotLoaded, match="unexpected"):
        ray.get(vllm_moe.update_weights.remote({**new, "model.not_a_layer.weight": torch.zeros(3)}))
    info = ray.get(vllm_moe.info.remote())
    assert info["version"] == v0 and info["torn"] is None
    before = ray.get(vllm_moe.generate.remote(prompts(moe_path)[0], SamplingConfig(max_tokens=6, ignore_eos=True)))
    tf, _ = teacher_forced(load_hf_model(moe_path), before)
    assert np.max(np.abs(tf - np.asarray(before.logprobs))) <= VLLM_GAP_BOUND  # still the original weights

    ray.get(vllm_moe.__ray_call__.remote(refuse_kv_drop, True))
    try:
        long = vllm_moe.generate.remote(prompts(moe_path)[1], SamplingConfig(max_tokens=900, ignore_eos=True))
        time.sleep(0.2)
        with pytest.raises(RuntimeError, match="put in by the test"):
            ray.get(vllm_moe.update_weights.remote(new))
    finally:
        ray.get(vllm_moe.__ray_call__.remote(refuse_kv_drop, False))
    try:
        with pytest.raises(TornWeights, match=f"neither version {v0}'s nor {v0 + 1}'s"):
            ray.get(long, timeout=60)
        with pytest.raises(TornWeights):
            ray.get(vllm_moe.generate.remote(prompts(moe_path)[0], SamplingConfig(max_tokens=4)), timeout=60)
        info = ray.get(vllm_moe.info.remote())
        assert info["version"] == v0 and info["verified_version"] == v0 and "failed part-way" in info["torn"]
    finally:  # the engine is shared by the session: give it back its original weights, whole
        expected = expected_probe_logprobs(load_hf_model(moe_path), probe_ids(model.config.vocab_size))
        ray.get(vllm_moe.update_weights.remote(original, v0 + 2, expected))
    assert ray.get(vllm_moe.info.remote())["torn"] is None
    after = ray.get(vllm_moe.generate.remote(prompts(moe_path)[0], SamplingConfig(max_tokens=6, ignore_eos=True)))
    assert set(after.versions) == {v0 + 2}


def test_an_engine_with_a_core_process_refuses_weights_before_its_core_sees_them(moe_path, tmp_path):
    """With vLLM's core in a process of its own (GPUs; engine_core_in_process=False) the worker's
    refusal comes back as a plain Exception, which the sync read as a load torn part-way: every
    request in flight failed over weights nothing had touched. The names and shapes are checked
    in the engine's own process first, and a file /dev/shm cannot take is no torn load either."""
    from workbench.rollout.engine import WeightsNotLoaded
    from workbench.rollout.vllm_engine import VLLMEngine

    e = VLLMEngine(str(moe_path), engine_core_in_process=False)  # not started: no core to reach
    assert not e.in_process_core
    good = load_hf_model(moe_path).state_dict()
    with pytest.raises(WeightsNotLoaded, match="unexpected"):
        asyncio.run(e._load_weights({**good, "model.not_a_layer.weight": torch.zeros(3)}))
    with pytest.raises(WeightsNotLoaded, match="shape mismatches"):
        asyncio.run(e._load_weights({**good, "lm_head.weight": good["lm_head.weight"][:-1]}))
    e._shm = str(tmp_path / "no-such-dir")
    with pytest.raises(WeightsNotLoaded, match="could not be written"):
        asyncio.run(e._load_weights(good))


def test_a_reference_engine_whose_load_fails_part_way_fails_its_requests(moe_path):
    """The same rule on the reference backend (its own request queue): a load that raised after
    copying (a fault put in) fails the batch in flight and refuses new requests until a sync
    completes."""
    from workbench.rollout.engine import TornWeights, WeightsNotLoaded

    async def main():
        e = await start("reference", moe_path)
        try:
            model = load_hf_model(moe_path)
            new = perturbed(model, seed=6)
            real_load = e._load_weights

            async def half_then_fail(state_dict):
                half = dict(list(state_dict.items())[: len(state_dict) // 2])
                e.model.load_state_dict(half, strict=False)
                raise ConnectionError("transfer died (put in by the test)")

            with pytest.raises(WeightsNotLoaded):  # refused before any copy: not torn
                await e.update_weights({**new, "model.not_a_layer.weight": torch.zeros(3)})
            assert e.info()["torn"] is None
            running = asyncio.ensure_future(e.generate(prompts(moe_path)[0], SamplingConfig(max_tokens=400, ignore_eos=True)))
            await asyncio.sleep(0.3)
            e._load_weights = half_then_fail
            with pytest.raises(ConnectionError):
                await e.update_weights(new)
            with pytest.raises(TornWeights):
                await asyncio.wait_for(running, 60)
            with pytest.raises(TornWeights):
                await e.generate(prompts(moe_path)[0], SamplingConfig(max_tokens=4))
            assert e.info()["torn"] and e.version == 0
            e._load_weights = real_load
            await e.update_weights(new)
            s = await e.generate(prompts(moe_path)[0], SamplingConfig(max_tokens=4, ignore_eos=True))
            assert s.versions == [1] * 4 and e.info()["torn"] is None
        finally:
            await e.shutdown()

    asyncio.run(main())


def test_a_request_finishing_before_the_probe_verdict_waits_for_it(moe_path):
    """The engine resumes before its probe check (the trainer's probe may still be computing): a
    request finishing in that window came back as a valid Sample from weights that then failed
    the check, tagged the new version (staleness 0 to a trainer at that version). It waits for
    the verdict now: returned where the weights verify, TornWeights where they do not."""
    from workbench.rollout.engine import TornWeights, WeightSyncError

    async def main():
        e = await start("reference", moe_path)
        try:
            model = load_hf_model(moe_path)
            for good in (False, True):
                new = perturbed(model, seed=7 + good)
                trainers = asyncio.get_running_loop().create_future()  # the trainer's probe, still computing
                update = asyncio.ensure_future(e.update_weights(new, e.version + 1, expected_probe=trainers))
                while e._verifying is None or (good and e.torn is not None):
                    await asyncio.sleep(0.01)  # loaded and resumed, the verdict pending
                request = asyncio.ensure_future(e.generate(prompts(moe_path)[0], SamplingConfig(max_tokens=4, ignore_eos=True)))
                await asyncio.sleep(0.5)
                assert not request.done()  # sampled, held for the verdict
                m = load_hf_model(moe_path)
                m.load_state_dict(new if good else perturbed(model, seed=99))
                trainers.set_result(expected_probe_logprobs(m, probe_ids(m.config.vocab_size)))
                if good:
                    await update
                    assert (await request).versions == [2] * 4
                else:
                    with pytest.raises(WeightSyncError):
                        await update
                    with pytest.raises(TornWeights):
                        await request
            # a sync failing after the load in another way (its resume raised, the trainer's probe failed):
            # a request held for the verdict is failed, not left waiting for ever
            trainers = asyncio.get_running_loop().create_future()
            update = asyncio.ensure_future(e.update_weights(perturbed(model, seed=11), e.version + 1, expected_probe=trainers))
            while e._verifying is None or e.torn is not None:
                await asyncio.sleep(0.01)
            request = asyncio.ensure_future(e.generate(prompts(moe_path)[0], SamplingConfig(max_tokens=4, ignore_eos=True)))
            # and one still sampling then is ended too: it sampled on from the unverified weights, and a
            # later sync that verified cleared the refusal, so it came back whole, those tokens included
            long = asyncio.ensure_future(e.generate(prompts(moe_path)[1], SamplingConfig(max_tokens=900, ignore_eos=True)))
            await asyncio.sleep(0.5)
            trainers.set_exception(RuntimeError("a trainer rank died (put in by the test)"))
            with pytest.raises(RuntimeError, match="rank died"):
                await update
            with pytest.raises(TornWeights, match="did not complete its probe check"):
                await asyncio.wait_for(request, 10)
            good = perturbed(model, seed=12)
            m = load_hf_model(moe_path)
            m.load_state_dict(good)
            await e.update_weights(good, e.version + 1, expected_probe=expected_probe_logprobs(m, probe_ids(m.config.vocab_size)))
            with pytest.raises(TornWeights, match="did not complete its probe check"):
                await asyncio.wait_for(long, 30)
        finally:
            await e.shutdown()

    asyncio.run(main())


def test_vllm_seeded_requests_with_long_concurrent_prompts_keep_the_engine_alive(vllm_moe):
    """Seeded requests whose prompts together exceed a step's token budget: vLLM's CPU build
    killed its engine core as soon as one such prefill was chunked ("CPU Generator does not use
    offset"), failing every request then and after. The engine takes whole prefills on CPU."""
    rng = random.Random(0)
    prompts_ = [[rng.randrange(500) for _ in range(rng.randrange(100, 700))] for _ in range(48)]  # ~19k tokens
    refs = [vllm_moe.generate.remote(p, SamplingConfig(max_tokens=8, ignore_eos=True, seed=rng.randrange(1000))) for p in prompts_]
    samples = ray.get(refs, timeout=120)
    assert [len(s.token_ids) for s in samples] == [8] * 48
    # and the engine still serves
    assert len(ray.get(vllm_moe.generate.remote(prompts_[0][:20], SamplingConfig(max_tokens=4, ignore_eos=True)), timeout=60).token_ids) == 4


def test_in_process_engine_that_fails_a_step_fails_its_requests_and_later_calls():
    """InprocLLM when vLLM's step raises (a fault a real engine no longer gives on demand: a
    fake engine): every request in flight gets the error, later calls fail at once rather than
    wait on a dead thread, and shutdown still returns."""
    from workbench.rollout.vllm_inproc import InprocLLM

    class FailingEngine:
        vllm_config = model_config = None

        def __init__(self):
            self.requests, self.shut = [], False
            self.engine_core = self

        def add_request(self, request_id, prompt, params):
            self.requests.append(request_id)

        def has_unfinished_requests(self):
            return len(self.requests) >= 2  # steps once both requests are in

        def step(self):
            raise RuntimeError("boom in step")

        def shutdown(self):
            self.shut = True

    async def scenario():
        llm = InprocLLM.__new__(InprocLLM)
        llm._serve(engine := FailingEngine())

        async def drain(rid):
            async for _ in llm.generate({"prompt_token_ids": [1, 2]}, None, rid):
                pass

        got = await asyncio.wait_for(asyncio.gather(drain("a"), drain("b"), return_exceptions=True), 10)
        later = await asyncio.wait_for(asyncio.gather(llm.collective_rpc("load_weights"), drain("c"), return_exceptions=True), 10)
        llm.shutdown()
        return got, later, engine

    got, later, engine = asyncio.run(scenario())
    assert all(isinstance(e, RuntimeError) and "engine core failed" in str(e) and "boom in step" in str(e) for e in got), got
    assert all(isinstance(e, RuntimeError) and "has stopped" in str(e) for e in later), later
    assert engine.shut


def test_in_process_engine_adds_the_requests_of_one_pass_before_it_steps():
    """Requests made in one pass of the event loop (a rollout's batch) reach vLLM's engine before
    its first step (InprocLLM._add): added one call each, the engine's thread woke at the first and
    stepped with what had arrived while the loop made the rest (a prefill of a few, the others a
    step later; here each request's maker lets the GIL go, as a loop's other work does). A request
    vLLM refuses gets its own error; the others run."""
    import time as _time

    from workbench.rollout.vllm_inproc import InprocLLM

    class Out:
        def __init__(self, rid):
            self.request_id, self.finished, self.outputs = rid, True, []

    class CountingEngine:
        vllm_config = model_config = None

        def __init__(self):
            self.waiting, self.steps = [], []
            self.engine_core = self

        def add_request(self, request_id, prompt, params):
            if request_id == "bad":
                raise ValueError("prompt too long")
            self.waiting.append(request_id)

        def has_unfinished_requests(self):
            return bool(self.waiting)

        def step(self):
            self.steps.append(len(self.waiting))
            done, self.waiting = self.waiting, []
            return [Out(r) for r in done]

        def shutdown(self):
            pass

    async def scenario():
        llm = InprocLLM.__new__(InprocLLM)
        llm._serve(engine := CountingEngine())

        async def one(rid):
            _time.sleep(0.002)  # the loop's own work between two requests: the GIL goes to the engine's thread
            return [o.request_id async for o in llm.generate({"prompt_token_ids": [1, 2]}, None, rid)]

        got = await asyncio.wait_for(asyncio.gather(*[one(r) for r in [f"r{i}" for i in range(8)] + ["bad"]],
                                                    return_exceptions=True), 10)
        llm.shutdown()
        return got, engine

    got, engine = asyncio.run(scenario())
    assert engine.steps == [8], engine.steps  # one step with all of them
    assert got[:8] == [[f"r{i}"] for i in range(8)] and isinstance(got[8], ValueError), got

    # an abort by id (a torn weight load's) reaching the thread before the request's add: it found
    # nothing, and the add after it ran the request on; now the request is aborted once added
    class Aborting(CountingEngine):
        def __init__(self):
            super().__init__()
            self.log, self.states = [], {}
            self.output_processor = self

        @property
        def request_states(self):
            return self.states

        @property
        def external_req_ids(self):
            return {r: [r] for r in self.states}

        def add_request(self, request_id, prompt, params):
            self.log.append(("add", request_id))
            self.states[request_id] = type("State", (), {"make_request_output": lambda s, *a: Out(request_id)})()

        def abort_request(self, ids):
            self.log.append(("abort", *ids))
            self.states = {r: s for r, s in self.states.items() if r not in ids}

        def has_unfinished_requests(self):
            return False  # (never steps: only the abort ends the stream)

    class Out:  # noqa: F811  (with the outputs an abort's final output has)
        def __init__(self, rid):
            self.request_id, self.finished = rid, True
            self.outputs = [type("O", (), {"token_ids": []})()]

    async def aborted_first():
        llm = InprocLLM.__new__(InprocLLM)
        llm._serve(engine := Aborting())

        async def drain():
            return [o.finished async for o in llm.generate({"prompt_token_ids": [1, 2]}, None, "a")]

        streamed = asyncio.ensure_future(drain())
        abort = asyncio.ensure_future(llm.abort("a"))  # (queued to the thread in the pass that makes the request)
        got = await asyncio.wait_for(asyncio.gather(streamed, abort), 10)
        llm.shutdown()
        return got[0], engine.log

    finished, log = asyncio.run(aborted_first())
    assert log == [("add", "a"), ("abort", "a")] and finished == [True], log


def test_an_abort_before_asyncllm_registers_the_request_still_stops_it():
    """AsyncLLM (vLLM's engine core in its own process: the GPU path) registers a request only after
    awaiting its input processing, and drops the abort of an id it does not hold: a request given
    up within that window (EngineRouter aborts a coalesced call's request by id) sampled on to
    max_tokens, unread. The engine sends the abort again while the request is in flight. A fake
    AsyncLLM holds the window open (the race is microseconds on real vLLM)."""
    from vllm.sampling_params import RequestOutputKind  # noqa: F401  (vLLM's, as generate_stream imports it)

    from workbench.rollout.engine import RolloutEngine, TornWeights
    from workbench.rollout.vllm_engine import VLLMEngine

    class Output:
        def __init__(self, finish_reason):
            self.finished = True
            self.outputs = [type("O", (), {"token_ids": [5], "logprobs": [{5: type("L", (), {"logprob": -1.0})()}],
                                           "finish_reason": finish_reason,
                                           "weight_versions": [type("Span", (), {"version": 0, "start": 0, "end": 1})()]})()]

    class SlowToRegister:  # AsyncLLM's generate and abort, as far as the engine uses them
        def __init__(self, window_s):
            self.window_s, self.registered, self.aborted, self.aborts = window_s, set(), set(), []

        async def generate(self, prompt, params, request_id):
            await asyncio.sleep(self.window_s)  # (its input processing: the window)
            self.registered.add(request_id)
            for _ in range(100):  # 5 s: a long reply, unless aborted
                if request_id in self.aborted:
                    yield Output("abort")
                    return
                await asyncio.sleep(0.05)
            yield Output("length")

        async def abort(self, request_id):
            self.aborts.append(request_id)
            if request_id in self.registered:  # (an unknown id is dropped, as vLLM's output processor does)
                self.aborted.add(request_id)

    async def scenario(window_s, torn=False):
        engine = VLLMEngine.__new__(VLLMEngine)
        RolloutEngine.__init__(engine)
        engine.llm, engine._in_flight, engine._failed, engine._aborting = SlowToRegister(window_s), set(), {}, set()
        engine.supports_routed_experts = False
        t0 = time.monotonic()
        request = asyncio.ensure_future(engine.generate([1, 2, 3], SamplingConfig(max_tokens=4), "early"))
        await asyncio.sleep(0.01)
        if torn:  # a torn load fails what is in flight, before the request is registered
            await engine._fail_in_flight(TornWeights("torn"))
        else:
            await engine.abort("early")  # before the request is registered
        try:
            got = await asyncio.wait_for(request, 10)
        except TornWeights as e:
            got = e
        return got, time.monotonic() - t0, engine.llm.aborts

    sample, took, aborts = asyncio.run(scenario(0.2))
    assert sample.finish_reason == "abort" and took < 1.5, (sample.finish_reason, took)
    assert aborts[0] == "early" and len(aborts) >= 2, aborts  # (the first found nothing)
    # registered late (a burst's registrations queue on vLLM's input processing): still stopped
    sample, took, _ = asyncio.run(scenario(1.5))
    assert sample.finish_reason == "abort" and took < 4, (sample.finish_reason, took)
    # the torn load's abort, the same
    got, took, _ = asyncio.run(scenario(0.2, torn=True))
    assert isinstance(got, TornWeights) and took < 1.5, (got, took)


def test_vllm_abort_stop_strings_and_top_p(vllm_moe, moe_path):
    p = prompts(moe_path)[2]
    long = vllm_moe.generate.remote(p, SamplingConfig(max_tokens=600, ignore_eos=True), "to-abort")
    time.sleep(0.5)
    ray.get(vllm_moe.abort.remote("to-abort"))
    aborted = ray.get(long, timeout=60)
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 600
    assert len(aborted.token_ids) == len(aborted.logprobs) == len(aborted.versions)
    # pause keeps a request waiting; resume lets it finish
    ray.get(vllm_moe.pause.remote())
    try:
        held = vllm_moe.generate.remote(p, SamplingConfig(max_tokens=8, ignore_eos=True))
        ready, _ = ray.wait([held], timeout=1.5)
        assert not ready
    finally:
        ray.get(vllm_moe.resume.remote())
    assert len(ray.get(held, timeout=60).token_ids) == 8
    tok = load_tokenizer(moe_path)
    chat = tok.apply_chat_template([{"role": "user", "content": "Say something about books."}], add_generation_prompt=True)["input_ids"]
    free = ray.get(vllm_moe.generate.remote(chat, SamplingConfig(max_tokens=24, temperature=0)))
    text = tok.decode(free.token_ids, skip_special_tokens=True)
    assert " " in text, text
    cut = ray.get(vllm_moe.generate.remote(chat, SamplingConfig(max_tokens=24, temperature=0, stop=[" "])))
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(free.token_ids)
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]  # the ids that completed the stop string stay
    nucleus = ray.get(vllm_moe.generate.remote(chat, SamplingConfig(max_tokens=16, top_p=0.5, seed=3)))
    # top_p < 1: processed log-probs are renormalized over the nucleus, so never below the full-vocab ones
    model = load_hf_model(moe_path)
    tf, _ = teacher_forced(model, nucleus)
    assert all(lp >= t - 1e-4 for lp, t in zip(nucleus.logprobs, tf))


def test_a_tied_weight_is_written_for_a_core_process_under_both_names(tmp_path):
    """The trainer's gathered state dict holds a tied weight once under both names (lm_head =
    embed_tokens); safetensors refuses two names of one storage, so every sync of a tied model to
    vLLM's core process (the GPU path) failed with nothing loaded. vLLM needs both names (without
    lm_head its reload kept the old output embedding): the second is written as a copy."""
    from safetensors.torch import load_file, save_file

    from workbench.rollout.vllm_engine import file_tensors

    embed = torch.randn(8, 4)
    state = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4), "lm_head.weight": embed}
    save_file(file_tensors(state), tmp_path / "w.safetensors")
    back = load_file(tmp_path / "w.safetensors")
    assert list(back) == sorted(state) and all(torch.equal(back[k], v) for k, v in state.items())
    assert file_tensors(state)["model.norm.weight"].data_ptr() == state["model.norm.weight"].data_ptr()  # no copy of the rest
