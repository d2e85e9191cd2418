"""The notebook surface: workbench.connect(), its handles and its run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench
from workbench.session import ConfigError, WorkbenchConfig


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['bogus'\]"):
        WorkbenchConfig.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match=r"unknown trainer field\(s\) \['lrr'\]"):
        WorkbenchConfig.from_dict({"trainer": {"lrr": 1e-3}})
    with pytest.raises(ConfigError, match="LoopConfig.mode 'fast' unknown"):
        WorkbenchConfig.from_dict({"loop": {"mode": "fast"}})
    with pytest.raises(ConfigError, match="backend 'sglang' unknown"):
        WorkbenchConfig(backend="sglang")
    with pytest.raises(ConfigError, match=r"neither a named model \(\['dense', 'moe', 'smollm2', 'tiny-qwen3'\]\)"):
        WorkbenchConfig(model="/nonexistent/model")
    # the KL reference too (it failed in every trainer rank, after the engines had started); a Path is
    # kept as text, so config.json holds the trainer's settings (it kept them out: a resume asked again)
    with pytest.raises(ConfigError, match=r"trainer.ref_model_path '/no/such/dir' is neither a named model"):
        WorkbenchConfig.from_dict({"trainer": {"ref_model_path": "/no/such/dir", "kl_coef": 0.1}})
    from pathlib import Path as _Path

    from workbench.session import config_record

    here = _Path(__file__).parent
    cfg = WorkbenchConfig.from_dict({"trainer": {"ref_model_path": here}, "loop": {"teacher": here}})
    assert (cfg.trainer.ref_model_path, cfg.loop.teacher) == (str(here), str(here)) and config_record(cfg)["_unsaved"] == []
    from workbench.session import model_path, trainer_config  # (a named reference: the ranks get its directory)

    assert trainer_config(WorkbenchConfig.from_dict({"trainer": {"ref_model_path": "dense"}})).ref_model_path == model_path("dense")
    with pytest.raises(ConfigError, match="sampling 'loose' unknown"):
        WorkbenchConfig(sampling="loose")
    with pytest.raises(ConfigError, match="Duplicate GPU detected"):  # NCCL refuses two group ranks on one GPU
        WorkbenchConfig(placement="colocated", engine_kwargs={"weight_transfer": "nccl"})
    for t in (0.0, 0.005, 2.5):  # vLLM samples below 0.01 at 0.01 and refuses above 2
        with pytest.raises(ConfigError, match=r"temperature must be in \[0.01, 2\]"):
            WorkbenchConfig(temperature=t)
    with pytest.raises(ConfigError, match="profile must be None, a family name or a dict"):
        WorkbenchConfig(profile=3)
    with pytest.raises(ConfigError, match="num_engines must be an integer >= 1"):
        WorkbenchConfig(num_engines=0)
    with pytest.raises(ConfigError, match="max_request_bytes must be an integer >= 1"):
        WorkbenchConfig(max_request_bytes=0)
    # a turn's budget: 8 on the toy models, else 1024 within half the context (8 cut every real reply)
    from workbench.profiles import ModelProfile
    from workbench.session import default_max_tokens

    assert WorkbenchConfig().max_tokens is None and WorkbenchConfig(max_tokens=24).max_tokens == 24
    assert [default_max_tokens(ModelProfile(f, end_of_turn="e", max_model_len=n))
            for f, n in (("toy", 1024), ("qwen3", 32768), ("smollm2", 1500))] == [8, 1024, 750]
    with pytest.raises(ConfigError, match="seed must be an integer >= 0"):
        WorkbenchConfig(seed=-1)
    # values accepted silently that trained the wrong way or not at all, or failed only after the
    # session had started: a negative max_grad_norm reversed every gradient (clip_grad_norm_ scales by
    # max_norm / norm), 0 zeroed them, NaN made the weights NaN; a bad lr or weight decay failed inside
    # the trainer's ranks; a None or text correction at the first run; a group of one gave every
    # advantage 0; a negative overlong coefficient paid a bonus for length
    for trainer, match in (({"max_grad_norm": -1.0}, "max_grad_norm must be > 0"), ({"max_grad_norm": 0}, "max_grad_norm must be > 0"),
                           ({"max_grad_norm": float("nan")}, "max_grad_norm must be > 0"), ({"lr": -1e-3}, "lr must be a finite number > 0"),
                           ({"lr": float("nan")}, "lr must be"), ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"),
                           ({"correction": None}, "correction must be a CorrectionConfig"), ({"correction": "tis"}, "correction must be")):
        with pytest.raises(ConfigError, match=f"trainer: TrainerConfig.{match}"):
            WorkbenchConfig.from_dict({"trainer": trainer})
    assert WorkbenchConfig.from_dict({"trainer": {"max_grad_norm": float("inf")}}).trainer.max_grad_norm == float("inf")  # no clipping
    from workbench.trainer.fsdp import TrainerConfig

    with pytest.raises(ValueError, match="correction must be a CorrectionConfig"):
        TrainerConfig(correction={"level": "geo"})  # (a dict becomes one through connect() alone)
    for loop, match in (({"group_size": 1}, "group_size 1: advantage 'grpo' compares each episode with the others"),
                        ({"group_size": 1, "advantage": "rloo"}, "group_size 1: advantage 'rloo'"),
                        ({"overlong_coef": -1.0}, "overlong_coef must be a finite number >= 0"),
                        ({"sync_tol": -1e-3}, "sync_tol must be a finite number >= 0"), ({"steps": -1}, "steps must be >= 0, got -1")):
        with pytest.raises(ConfigError, match=f"loop: LoopConfig.{match}"):
            WorkbenchConfig.from_dict({"loop": loop})
    # a per-token estimator has no group baseline: a group of one trains
    assert WorkbenchConfig.from_dict({"loop": {"group_size": 1, "advantage": "distill", "teacher": "dense"}}).loop.group_size == 1
    # the engines' context is the server's: taken from engine_kwargs (the server kept the profile's)
    assert WorkbenchConfig(engine_kwargs={"max_model_len": 512}).max_model_len == 512
    with pytest.raises(ConfigError, match="engine_kwargs max_model_len=512 differs from max_model_len=1024"):
        WorkbenchConfig(engine_kwargs={"max_model_len": 512}, max_model_len=1024)
    cfg = WorkbenchConfig.from_dict({"trainer": {"lr": 0.5, "correction": {"max_staleness": 2}}})
    assert cfg.trainer.lr == 0.5 and cfg.trainer.correction.max_staleness == 2
    assert cfg.trainer.correction.mode == "trunc"  # the rest of the default (TIS) is kept
    # another level or mode without a band gets that mode's band, not the TIS cap's [0, 2] (a geo
    # mask then trained sequences with a ratio of 0.6 that the documented band drops)
    corr = lambda d: WorkbenchConfig.from_dict({"trainer": {"correction": d}}).trainer.correction  # noqa: E731
    assert (corr({"level": "geo", "mode": "mask"}).low, corr({"level": "geo", "mode": "mask"}).high) == (0.99, 1.01)
    assert (corr({"mode": "clip"}).level, corr({"mode": "clip"}).low) == ("token", 0.99)
    assert (corr({"level": "seq", "mode": "trunc"}).high, corr({"mode": "mask", "high": 1.2}).low) == (2.0, 0.99)


def test_session_handles_run_and_run_directory(ray_local, moe_path, tmp_path):
    """connect() on the reference backend (it records MoE experts): step a rollout, one trainer
    step with its token report, sync, a background run with monitors, save and restore."""
    wb = workbench.connect(backend="reference", trainer_ranks=1, run_dir=str(tmp_path / "run"),
                           loop={"prompts_per_step": 4, "group_size": 4})
    try:
        assert wb.cfg.max_tokens == 8  # the toy's turn budget where none is given
        t = wb.rollout.episode()
        assert t.error is None and t.segments[0].routed_experts is not None and wb.rollout.last is t
        groups = wb.rollout.groups(2, progress=False)
        assert [len(g) for g in groups] == [4, 4]
        stats = wb.trainer.step()
        assert stats["version"] == wb.trainer.version and stats["replay"]["disagree_rate"] == 0
        assert stats["correction"]["kl_k3"] < 1e-6  # sampled by exactly the trainer's weights (after connect's sync)
        j = wb.journey()
        assert j.values["behaviour_logprob"] == pytest.approx(j.values["trainer_logprob"], abs=1e-5)
        ep = next(t for g in groups for t in g if t.error is None and any(t.segments[0].loss_mask))
        j = wb.journey(episode=ep.episode_id)  # by episode: the report row holding its segment
        assert j.values["token_id"] == ep.segments[0].token_ids[j.col.value] and ep.episode_id in j.heading.value
        ins = wb.inspect(ep)  # the inspector carries the step's report: a click opens the whole journey
        first = next(i for i, s in enumerate(x for x in ins.spans if x["kind"] == "token") if s["loss_mask"])
        assert ins.open_token(first).values["trainer_logprob"] is not None
        reports = wb.sync()
        assert all(r.checked for r in reports) and reports[0].version == wb.trainer.version
        gate, replay = wb.monitors()
        run = wb.run(2, monitors=[gate, replay], progress=False)
        # while it runs, nothing else may drive the trainer (a second thread's collectives could interleave)
        for call in (wb.sync, wb.trainer.step, wb.save, lambda: wb.run(1)):
            with pytest.raises(RuntimeError, match="in progress"):
                call()
        hist = run.wait(600)
        assert [h["step"] for h in hist] == [0, 1] and run.done and wb.next_step == 2
        assert list(gate.trace("gate_pass_ratio").y) == [h["gate_pass_ratio"] for h in hist]
        lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines] == [0, 1] and all(m["replay_disagree_rate"] == 0 for m in lines)
        assert sorted(p.name for p in (tmp_path / "run" / "trajectories").iterdir()) == ["step_00000.parquet", "step_00001.parquet"]
        saved = json.loads((tmp_path / "run" / "config.json").read_text())
        assert saved["backend"] == "reference" and saved["_routing_replay_off"] is None  # the reference engine records them
        assert saved["max_tokens"] == 8 and saved["_derived"] == ["max_tokens"]  # (a resume derives it again)
        [ran] = [json.loads(x) for x in (tmp_path / "run" / "runs.jsonl").read_text().splitlines()]
        assert (ran["first_step"], ran["steps"], ran["loop"]["steps"]) == (0, 2, 2)
        path = wb.save()
        v = wb.trainer.version
        wb.run(1, background=False, progress=False)
        assert wb.next_step == 3
        assert wb.restore(path)["next_step"] == 2 and wb.next_step == 2
        assert wb.trainer.version > v  # restoring syncs the engines under a new version
        # another checkpoint restored: the run's own checkpoint/, past it, holds the abandoned branch's
        # weights (a resume would continue from them beside the new branch's record): set aside too
        named = wb.save(str(tmp_path / "named"))
        wb.cfg.checkpoint_every = 1  # connect(checkpoint_every=1): a wb.run() without one saves at that cadence
        try:
            wb.run(1, background=False, progress=False)
        finally:
            wb.cfg.checkpoint_every = 0
        assert json.loads((tmp_path / "run" / "checkpoint" / "run_state.json").read_text())["next_step"] == 3
        assert wb.restore(named)["next_step"] == 2 and not (tmp_path / "run" / "checkpoint").exists()
        assert [p.name for p in (tmp_path / "run" / "abandoned").glob("*/checkpoint")] != []
        # a restore interrupted after the ranks loaded (a Ctrl-C does not stop them): the weights were the
        # checkpoint's, the version, step and engines the old branch's, and the next run trained the
        # engines' tokens as on-policy without a sync. Nothing trains until a restore finishes
        real_restore = wb._trainer.restore

        def interrupted(p):
            real_restore(p)
            raise KeyboardInterrupt

        wb._trainer.restore = interrupted
        with pytest.raises(KeyboardInterrupt):
            wb.restore(named)
        del wb._trainer.restore
        for call in (lambda: wb.run(1, background=False, progress=False), wb.sync, wb.save):
            with pytest.raises(RuntimeError, match=r"wb.restore\(.*\) did not finish \(KeyboardInterrupt"):
                call()
        assert wb.restore(named)["next_step"] == 2 and wb._torn_restore is None
        # a path with no checkpoint is refused before any rank loads: nothing torn, the session trains on
        with pytest.raises(FileNotFoundError, match="run_state.json missing"):
            wb.restore(str(tmp_path / "no-such-checkpoint"))
        assert wb._torn_restore is None
        wb.save()  # (the resume below starts from it)
        wb.rollout.last_groups = None
        with pytest.raises(LookupError, match="no groups to train on"):
            wb.trainer.step()
    finally:
        wb.shutdown()
    assert wb.engines == [] and wb._trainer is None
    # the run directory now holds a run: a new session refuses it, unless it resumes it
    with pytest.raises(ConfigError, match="already holds a run"):
        workbench.connect(backend="reference", run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="no checkpoint/ to resume from"):
        workbench.connect(backend="reference", run_dir=str(tmp_path / "empty"), resume=True)
    # a KL reference that tokenizes otherwise (the real Qwen3 tokenizer under the toy's ids), before anything starts
    with pytest.raises(ConfigError, match="trainer.ref_model_path 'tiny-qwen3' tokenizes differently from the policy"):
        workbench.connect(backend="reference", run_dir=str(tmp_path / "kl"), trainer={"kl_coef": 0.05, "ref_model_path": "tiny-qwen3"})
    # a session that stepped by hand and saved, or only evaluated, wrote no metrics.jsonl: taken over
    # all the same, its config.json was replaced and its checkpoint at the next save
    # (nor one that exported: the next session's wb.export() replaced that export)
    for held in ("checkpoint", "eval.jsonl", "export"):
        (tmp_path / held).mkdir(parents=True)
        (tmp_path / held / held).mkdir() if held != "eval.jsonl" else (tmp_path / held / held).write_text("{}\n")
        with pytest.raises(ConfigError, match=rf"already holds a run \({held}\)"):
            workbench.connect(backend="reference", run_dir=str(tmp_path / held))
    again = workbench.connect(backend="reference", trainer_ranks=1, run_dir=str(tmp_path / "run"), resume=True,
                              loop={"prompts_per_step": 4, "group_size": 4})
    try:
        # the checkpoint's position, and the history up to it (step 2 after it was an abandoned branch)
        assert again.next_step == 2 and [h["step"] for h in again.history] == [0, 1]
        again.run(1, background=False, progress=False)
        lines = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert lines == [0, 1, 2]  # step 2 re-run from the checkpoint taken before it
        # the first step 2 (trained after that checkpoint, abandoned by wb.restore) was set aside, not deleted
        asides = sorted((tmp_path / "run" / "abandoned").iterdir())  # (by wb.restore(path), wb.restore(named))
        assert len(asides) == 2 and all((a / "trajectories" / "step_00002.parquet").exists() for a in asides)
        assert all([json.loads(x)["step"] for x in (a / "metrics.jsonl").read_text().splitlines()] == [2] for a in asides)
    finally:
        again.shutdown()
    import ray

    assert ray.is_initialized()  # the session joined the test session's Ray and left it running


CLUSTER = """
import signal, sys, time, ray
ray.init(address="local", num_cpus=2, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
signal.signal(signal.SIGTERM, lambda *a: (ray.shutdown(), sys.exit(0)))
while True:
    time.sleep(1)
"""

CLIENT = """
import json, sys, ray, workbench
wb = workbench.connect(sys.argv[1], backend="reference", trainer_ranks=1, run_dir=sys.argv[2])
t = wb.rollout.episode()
joined = ray.get_runtime_context().gcs_address
wb.shutdown()
print("RESULT " + json.dumps({"error": t.error, "owns_ray": wb._owns_ray, "gcs": joined, "still_connected": ray.is_initialized()}))
"""


def test_connect_with_an_address_joins_that_cluster_and_leaves_it_running(tmp_path):
    """connect(address) attaches to a running Ray (here one owned by another process, as a
    cluster head would be): the session's actors run there, and shutdown leaves it up."""
    import os
    import subprocess
    import sys

    # token authentication (Ray's default) needs the cluster's token in the client; a real cluster
    # hands it out (RAY_AUTH_TOKEN); these two local processes opt out instead
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled"}
    cluster = subprocess.Popen([sys.executable, "-c", CLUSTER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        address = cluster.stdout.readline().strip()
        assert address, "the cluster process did not start Ray"
        out = subprocess.run([sys.executable, "-c", CLIENT, address, str(tmp_path / "run")], env=env, capture_output=True,
                             text=True, timeout=600)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        assert line, out.stderr[-3000:]
        result = json.loads(line[0][len("RESULT "):])
        assert result == {"error": None, "owns_ray": False, "gcs": address, "still_connected": True}
        assert cluster.poll() is None  # the cluster outlived the session
    finally:
        cluster.terminate()
        cluster.wait(60)


def test_a_resume_takes_the_runs_own_settings_where_not_given(tmp_path, capsys):
    """connect(run_dir=..., resume=True), as the dead-trainer message says, built the session from
    the defaults: the toy agent's tasks, seed 0, lr 1e-3 over a run's own (or another model,
    failing with a checkpoint key error after every engine started)."""
    import json

    from workbench.session import config_record, resolved_config

    first = resolved_config(model="dense", seed=3, temperature=0.7, tasks=str(tmp_path / "tasks.jsonl"),
                            trainer={"lr": 3e-4, "correction": {"level": "geo", "mode": "mask"}}, loop={"steps": 7})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(config_record(first)))
    again = resolved_config(run_dir=str(tmp_path / "run"), resume=True)
    assert (again.model, again.seed, again.temperature, again.tasks) == ("dense", 3, 0.7, str(tmp_path / "tasks.jsonl"))
    assert again.trainer == first.trainer and again.loop == first.loop and again.resume
    assert capsys.readouterr().err == ""
    # what is given wins, field by field, and is said
    lower = resolved_config(run_dir=str(tmp_path / "run"), resume=True, trainer={"lr": 1e-4})
    assert lower.trainer.lr == 1e-4 and lower.trainer.correction == first.trainer.correction
    said = capsys.readouterr().err  # the fields that changed, not the whole saved dict as if replaced
    assert 'trainer: {"lr": 0.0003} -> {"lr": 0.0001}' in said, said
    resolved_config(run_dir=str(tmp_path / "run"), resume=True, loop={"steps": 7})  # the same value: nothing said
    assert capsys.readouterr().err == ""
    # a correction field, named at its depth (one level deep, it was cut off behind the unchanged fields)
    resolved_config(run_dir=str(tmp_path / "run"), resume=True, trainer={"correction": {"max_staleness": 8}})
    said = capsys.readouterr().err
    assert '-> {"correction": {"max_staleness": 8}}' in said and "level" not in said, said
    # a WorkbenchConfig object cannot say which of its defaults were meant: the run's own are kept, and said
    obj = resolved_config(WorkbenchConfig(run_dir=str(tmp_path / "run"), resume=True, temperature=1.0))
    said = capsys.readouterr().err
    assert obj.temperature == 0.7 and "temperature" in said and "read as not given" in said and "seed: 3" in said, said
    with pytest.raises(ConfigError, match="checkpoint_every is a number of steps"):
        resolved_config(checkpoint_every=-1)
    # resume "false" (a YAML or papermill string) is no resume: the run's settings were read in, for a fresh session
    fresh = resolved_config(run_dir=str(tmp_path / "run"), resume="false")
    assert fresh.resume is False and (fresh.model, fresh.seed, fresh.trainer.lr) == ("moe", 0, 1e-3)
    # a model given as a pathlib.Path is kept as its text (its repr was kept, never resumable), and a
    # path to the same directory, relative or not, is the same model
    import os
    from pathlib import Path

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    as_path = resolved_config(model=ckpt, tasks=str(tmp_path / "tasks.jsonl"))
    assert as_path.model == str(ckpt) and "model" not in config_record(as_path)["_unsaved"]
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "config.json").write_text(json.dumps(config_record(as_path)))
    assert resolved_config(run_dir=tmp_path / "run2", resume=True).model == str(ckpt)
    assert resolved_config(run_dir=str(tmp_path / "run2"), resume=True, model=Path(os.path.relpath(ckpt))).model
    with pytest.raises(ConfigError, match="trained model 'dense'"):
        resolved_config(run_dir=str(tmp_path / "run"), resume=True, model="moe")
    # tasks given as a Python function cannot come back from the file: asked for again
    objects = resolved_config(tasks=lambda n, seed: [], seed=1)
    (tmp_path / "run" / "config.resume-20261206-000000.json").write_text(json.dumps(config_record(objects)))
    with pytest.raises(ConfigError, match=r"run's \['tasks'\] were Python objects"):
        resolved_config(run_dir=str(tmp_path / "run"), resume=True, model="moe")
    assert resolved_config(run_dir=str(tmp_path / "run"), resume=True, tasks=[]).seed == 1  # the newest session's
    # given again as asked: another function object (its repr differs), and objects said as changed (they crashed it)
    again = resolved_config(run_dir=str(tmp_path / "run"), resume=True, tasks=lambda n, seed: [],
                            loop=workbench.LoopConfig(steps=3))
    assert again.loop.steps == 3 and "loop:" in capsys.readouterr().err
    # Task objects are asked for again too (read back from the file, each task's info came nested under "info")
    from workbench.agents import Task

    listed = resolved_config(tasks=[Task([{"role": "user", "content": "hi"}], info={"tests": ["assert f() == 4"]})])
    assert config_record(listed)["_unsaved"] == ["tasks"]
    # a config object resuming gives only what it sets (its defaults overrode the run's, another model refused)
    (tmp_path / "run" / "config.resume-20261206-000001.json").write_text(json.dumps(config_record(first)))
    obj = resolved_config(WorkbenchConfig(run_dir=str(tmp_path / "run"), resume=True, seed=5))
    assert (obj.model, obj.seed, obj.temperature) == ("dense", 5, 0.7)
    # the context given alone on a run that set it in engine_kwargs (both copies were restored and refused each other)
    ctx = resolved_config(engine_kwargs={"max_model_len": 512}, tasks=str(tmp_path / "t.jsonl"))
    (tmp_path / "run" / "config.resume-20261206-000002.json").write_text(json.dumps(config_record(ctx)))
    assert resolved_config(run_dir=str(tmp_path / "run"), resume=True, max_model_len=1024).max_model_len == 1024
    assert resolved_config(run_dir=str(tmp_path / "run"), resume=True,
                           engine_kwargs={"max_model_len": 256}).max_model_len == 256
    # a turn budget connect() derived (half the context) is derived again on a resume: kept, a resume
    # that lowered the context kept one the size of the old context's half; one given is kept
    derived = {**config_record(resolved_config(max_model_len=2048, tasks=str(tmp_path / "t.jsonl"))), "max_tokens": 1024,
               "_derived": ["max_tokens"]}
    (tmp_path / "run" / "config.resume-20261206-000003.json").write_text(json.dumps(derived))
    assert resolved_config(run_dir=str(tmp_path / "run"), resume=True, max_model_len=512).max_tokens is None
    (tmp_path / "run" / "config.resume-20261206-000004.json").write_text(json.dumps({**derived, "_derived": []}))
    assert resolved_config(run_dir=str(tmp_path / "run"), resume=True, max_model_len=512).max_tokens == 1024


def test_connect_merges_trainer_and_correction_settings_field_by_field():
    from workbench import CorrectionConfig
    from workbench.session import resolved_config

    for base in (None, WorkbenchConfig()):
        # a mode's own band where no band is given (over a config object it kept the session's [0, 2])
        c = resolved_config(base, trainer={"correction": {"level": "geo", "mode": "mask"}}).trainer.correction
        assert (c.low, c.high) == (0.99, 1.01)
    assert resolved_config(WorkbenchConfig(), trainer={"correction": CorrectionConfig.tis(cap=5.0)}).trainer.correction.high == 5.0
    # a dict config's trainer and a trainer override: merged (the override replaced it whole)
    t = resolved_config({"trainer": {"lr": 3e-4}}, trainer={"micro_batch_size": 4}).trainer
    assert (t.lr, t.micro_batch_size) == (3e-4, 4)
    # the engines' kwargs, the frozen engines', a profile dict and the surrogate's kwargs too: a cluster
    # file's tensor_parallel_size and weight_transfer went with an override of the memory share
    import yaml

    file = yaml.safe_load((Path(__file__).parents[1] / "cluster" / "qwen3-30b-a3b.yaml").read_text())
    file["model"] = "moe"  # (the cluster's checkpoint is not here)
    c = resolved_config(file, engine_kwargs={"gpu_memory_utilization": 0.9})
    assert c.engine_kwargs == {**file["engine_kwargs"], "gpu_memory_utilization": 0.9}
    assert c.engine_kwargs["tensor_parallel_size"] == 2 and c.engine_kwargs["weight_transfer"] == "nccl"
    c = resolved_config({"frozen_engine_kwargs": {"tensor_parallel_size": 2}, "profile": {"tool_parser": "hermes"},
                         "trainer": {"surrogate": "ppo_clip", "surrogate_kwargs": {"eps_low": 0.1}}},
                        frozen_engine_kwargs={"max_model_len": 512}, profile={"chat_template_kwargs": {"enable_thinking": False}},
                        trainer={"surrogate_kwargs": {"eps_high": 0.3}})
    assert c.frozen_engine_kwargs == {"tensor_parallel_size": 2, "max_model_len": 512}
    assert c.profile == {"tool_parser": "hermes", "chat_template_kwargs": {"enable_thinking": False}}
    assert c.trainer.surrogate_kwargs == {"eps_low": 0.1, "eps_high": 0.3}
    # a family name under profile fields, nested template kwargs, the default surrogate named
    c = resolved_config({"profile": "qwen3", "trainer": {"surrogate_kwargs": {"eps_high": 0.28}}},
                        profile={"tool_parser": "hermes"}, trainer={"surrogate": "ppo_clip"})
    assert c.profile == {"family": "qwen3", "tool_parser": "hermes"} and c.trainer.surrogate_kwargs == {"eps_high": 0.28}
    c = resolved_config({"profile": {"chat_template_kwargs": {"enable_thinking": False, "x": 1}}},
                        profile={"chat_template_kwargs": {"x": 2}})
    assert c.profile == {"chat_template_kwargs": {"enable_thinking": False, "x": 2}}
    # another surrogate does not take the file's kwargs (PPO's clip widths are not GSPO's)
    c = resolved_config({"trainer": {"surrogate": "ppo_clip", "surrogate_kwargs": {"eps_low": 0.1}}}, trainer={"surrogate": "gspo"})
    assert c.trainer.surrogate == "gspo" and c.trainer.surrogate_kwargs == {}


def test_another_runs_audit_reads_its_tokens_with_that_runs_tokenizer(tmp_path):
    """wb.audit(run_dir=OTHER) / wb.revisit(run_dir=OTHER) re-rendered another model's tokens with
    this session's tokenizer (other text, nearly all of it drift): that run's kept policy's tokenizer
    (as the CLI reads it), else none; a run of this session's model keeps this session's."""
    import types

    from workbench.session import Workbench

    me = types.SimpleNamespace(cfg=WorkbenchConfig(), run_dir=tmp_path / "mine", profile=None, tokenizer="this session's")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model": "smollm2"}))
    assert Workbench._view_format(me, other) is None  # (no kept policy with tokenizer files)
    assert Workbench._view_format(me, None) == Workbench._view_format(me, me.run_dir) == "this session's"
    (other / "config.json").write_text(json.dumps({"model": "moe"}))
    assert Workbench._view_format(me, other) == "this session's"


def test_a_real_model_at_the_toys_lr_is_warned_of(moe_path):
    from workbench.checkpoints import smollm2_path
    from workbench.profiles import profile_for
    from workbench.session import TOY_LR, resolved_config, toy_lr_warning

    assert resolved_config().trainer.lr == TOY_LR
    real = profile_for(str(smollm2_path()))
    assert "is the toy models' default" in toy_lr_warning(real, TOY_LR)
    assert toy_lr_warning(real, 1e-6) is None and toy_lr_warning(profile_for(str(moe_path)), TOY_LR) is None


def test_the_sessions_timeouts_reach_its_runners(short_run):
    import ray

    times = ray.get(short_run._rollout.runners[0].__ray_call__.remote(lambda self: (self.episode_timeout_s, self.router.request_timeout_s)))
    assert times == (120, 90)


def test_episode_and_request_timeouts_are_session_settings():
    """The runners' episode and request timeouts were their constructors' defaults (300 s / 600 s)
    with no session field: long replies on a cluster timed out and left the batch (the longest
    episodes: a length bias), with no setting to change."""
    import inspect

    from workbench.rollout.runner import RolloutRunner
    from workbench.session import ConfigError, resolved_config

    defaults = inspect.signature(RolloutRunner).parameters
    c = resolved_config()
    assert (c.episode_timeout_s, c.request_timeout_s) == (defaults["episode_timeout_s"].default, defaults["request_timeout_s"].default)
    c = resolved_config({"episode_timeout_s": "1800"}, request_timeout_s=900)
    assert (c.episode_timeout_s, c.request_timeout_s) == (1800.0, 900)
    assert resolved_config(episode_timeout_s=None).episode_timeout_s is None  # no limit
    for bad in (0, -5, float("nan"), True):
        with pytest.raises(ConfigError, match="episode_timeout_s"):
            resolved_config(episode_timeout_s=bad)
    with pytest.raises(ConfigError, match="request_timeout_s"):
        resolved_config(request_timeout_s=None)


def test_a_run_directory_is_held_by_one_session(tmp_path, monkeypatch, capsys):
    """Two sessions started in one second (a sweep, parallel papermill runs) shared the default
    runs/<date-time>: config.json overwritten, metrics.jsonl interleaved, one checkpoint/ for both.
    The default is made new (-2, ...); a directory another live session holds is refused; a lock
    its process left behind is taken over; shutdown releases it (and a directory left empty)."""
    import json
    import subprocess
    import sys

    from workbench.session import RUN_DIR_LOCK, ConfigError, claim_run_dir, release_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt, *a: "20261206-101010")
    first_claim, second_claim = claim_run_dir(None), claim_run_dir(None)
    first, second = first_claim.path, second_claim.path
    assert (first.name, second.name) == ("20261206-101010", "20261206-101010-2")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = json.loads((first / RUN_DIR_LOCK).read_text())
        (first / RUN_DIR_LOCK).write_text(json.dumps({**lock, "pid": other.pid}))  # as another live session's
        with pytest.raises(ConfigError, match=rf"is in use by another session \(process {other.pid} on this machine\)"):
            claim_run_dir(first)
    finally:
        other.kill()
        other.wait()
    # another host's lock: live while its session's heartbeat touches it (it was taken over at once:
    # a second node's session moved a live run's steps aside and wrote into its checkpoint)
    import os
    import time

    from workbench.session import LOCK_STALE_S, touch_held_locks

    (first / RUN_DIR_LOCK).write_text(json.dumps({**lock, "pid": 12345, "host": "gpu-node-2"}))
    with pytest.raises(ConfigError, match=r"process 12345 on host 'gpu-node-2', its lock touched 0 s ago"):
        claim_run_dir(first)
    old = time.time() - LOCK_STALE_S - 10
    os.utime(first / RUN_DIR_LOCK, (old, old))
    taken = claim_run_dir(first)  # its process gone (here), or not touched for LOCK_STALE_S (there): taken over
    assert taken.path == first and not taken.created
    os.utime(first / RUN_DIR_LOCK, (old, old))
    touch_held_locks()  # the heartbeat keeps this session's lock fresh
    assert time.time() - (first / RUN_DIR_LOCK).stat().st_mtime < 5
    # a lock's age is read on the file system's clock, not this host's: a node whose clock ran ahead of
    # the file server's by more than LOCK_STALE_S took over a lock touched just now
    claimed = json.loads((first / RUN_DIR_LOCK).read_text())
    (first / RUN_DIR_LOCK).write_text(json.dumps({**claimed, "pid": 12345, "host": "gpu-node-2"}))
    real_time = time.time
    try:
        time.time = lambda: real_time() + LOCK_STALE_S + 60  # this host's clock ahead
        with pytest.raises(ConfigError, match=r"on host 'gpu-node-2', its lock touched 0 s ago"):
            claim_run_dir(first)
    finally:
        time.time = real_time
    assert not [p for p in first.iterdir() if p.name.startswith(".clock-")]
    # no file can be made there (a quota, a full disk): this host's clock, not a stale lock taken over
    import errno
    import tempfile

    def no_room(*a, **k):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkstemp", no_room)
        with pytest.raises(ConfigError, match=r"on host 'gpu-node-2', its lock touched 0 s ago"):
            claim_run_dir(first)
    (first / RUN_DIR_LOCK).write_text(json.dumps(claimed))
    # a held lock the heartbeat cannot touch is said (silent, another host's session took the run over)
    (first / RUN_DIR_LOCK).unlink()
    touch_held_locks()
    assert "cannot touch this session's run-directory lock" in capsys.readouterr().err
    touch_held_locks()
    assert "cannot touch" not in capsys.readouterr().err  # (once)
    (first / RUN_DIR_LOCK).write_text(json.dumps(claimed))
    release_run_dir(first_claim)  # (an earlier claim of this process: the later one's lock stays)
    assert json.loads((first / RUN_DIR_LOCK).read_text())["token"] == taken.token
    (first / "metrics.jsonl").write_text("{}\n")
    release_run_dir(taken)
    release_run_dir(second_claim)
    assert not (first / RUN_DIR_LOCK).exists() and (first / "metrics.jsonl").exists() and not second.exists()
    made = tmp_path / "made_by_the_user"  # an empty directory the user made stays
    made.mkdir()
    release_run_dir(claim_run_dir(made))
    assert made.is_dir() and not any(made.iterdir())


def test_a_live_session_keeps_its_run_directory_from_another_of_its_process(short_run):
    """The run directory's lock lets a session of this process take over a directory another one
    held (a connect cell run again). Taken from a live session, its run went on writing steps into a
    metrics.jsonl the resume had set aside, and both saved into one checkpoint/: refused, naming
    the way out, before anything starts."""
    import workbench
    from workbench.session import ConfigError

    with pytest.raises(ConfigError, match=r"is held by a live session of this process .*shutdown\(\) first"):
        workbench.connect(backend="reference", run_dir=str(short_run.run_dir), resume=True)
    assert (short_run.run_dir / ".session.lock").is_file() and not short_run._shut_down


def test_a_resumed_sessions_first_run_says_how_its_loop_differs_from_the_runs_last(short_run, tmp_path, capsys):
    """wb.run's overrides (mode="async", advantage="rloo") are kept in runs.jsonl only: after a resume a
    plain wb.run() trained otherwise than the run it continues, unsaid. Its first run says so. And an
    override that is no loop setting (`steps=`, a typo) is a ConfigError listing them, not a TypeError."""
    import dataclasses

    from workbench.loop import LoopConfig
    from workbench.session import ConfigError, Workbench, WorkbenchConfig

    with pytest.raises(ConfigError, match=r"\['stepz'\] are no loop settings"):
        short_run.run(1, stepz=3)
    # distillation's sampling (temperature 1, known at connect()) is refused before its teacher's engines
    # load (minutes on a cluster, and they stayed up after the refusal)
    def teacher_started(name):
        raise AssertionError("the teacher started")

    sampling, trainer_cfg = short_run._rollout.sampling, short_run._trainer.cfg
    try:  # (rollout and trainer at one temperature: check_sampling passes it)
        short_run._rollout.sampling = dataclasses.replace(sampling, temperature=0.7)
        short_run._trainer.cfg = dataclasses.replace(trainer_cfg, temperature=0.7)
        short_run._teacher_engines = teacher_started
        with pytest.raises(ValueError, match="at temperature 1; the policy samples at temperature 0.7"):
            short_run.run(1, advantage="distill", teacher="dense")
    finally:
        short_run._rollout.sampling, short_run._trainer.cfg = sampling, trainer_cfg
        del short_run._teacher_engines
    # (0 or fewer ran nothing and wrote a runs.jsonl line a resume then read as the run's last wb.run())
    lines = (short_run.run_dir / "runs.jsonl").read_text()
    for bad in (0, -2, True, 1.5, "many"):
        with pytest.raises(ConfigError, match=r"wb.run: steps"):
            short_run.run(bad)
    assert (short_run.run_dir / "runs.jsonl").read_text() == lines
    # (a string failed after the first step had trained)
    with pytest.raises(ConfigError, match=r"wb.run: checkpoint_every must be a number, got 'often'"):
        short_run.run(1, checkpoint_every="often")
    wb = object.__new__(Workbench)
    wb.cfg, wb.run_dir, wb._resume_loop_said = WorkbenchConfig(resume=True, run_dir=str(tmp_path)), tmp_path, False
    last = dataclasses.asdict(LoopConfig(mode="async", async_lag=2, advantage="rloo"))
    (tmp_path / "runs.jsonl").write_text(json.dumps({"first_step": 0, "steps": 4, "checkpoint_every": 10, "loop": last}) + "\n")
    wb._say_resumed_loop_changes(LoopConfig(steps=9), {"checkpoint_every": 0, "keep_policy_every": 0})
    err = capsys.readouterr().err
    assert "differ from the resumed run's last wb.run(): " in err and "mode: 'async' -> 'sync'" in err and "steps" not in err
    assert "advantage: 'rloo' -> 'grpo'" in err
    assert "checkpoint_every: 10 -> 0" in err  # (a resumed plain wb.run(N) saved no checkpoint, unsaid)
    wb._say_resumed_loop_changes(LoopConfig(steps=9))  # once
    assert capsys.readouterr().err == ""


def test_a_context_past_the_checkpoints_is_refused(ray_local, tmp_path):
    """max_model_len past the checkpoint's positions (README's example asked 2048 of the toy's
    1024): vLLM refused it late, naming an environment variable; the reference engine sampled past
    the positions the model was trained on. Refused at connect, naming both numbers."""
    import workbench
    from workbench.session import ConfigError

    with pytest.raises(ConfigError, match=r"max_model_len 4096 must be a positive integer within the checkpoint's context, 1024"):
        workbench.connect(backend="reference", max_model_len=4096, run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run" / ".session.lock").exists()
    from workbench.session import checkpoint_positions

    # as vLLM counts them: a linear or dynamic scaling multiplies; YaRN, llama3 and longrope configs state
    # the scaled length (multiplied, Llama-3.1's 131072 read as a million); no field: left to the engine
    llama31 = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    yarn = {"max_position_embeddings": 40960, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert checkpoint_positions(llama31) == 131072 and checkpoint_positions(yarn) == 40960
    assert checkpoint_positions({"max_position_embeddings": 2048, "rope_scaling": {"type": "linear", "factor": 2.0}}) == 4096
    assert checkpoint_positions({"model_type": "custom"}) is None
    # a sync is sent in the engines' half dtype (the object-store path sent the fp32 master weights), never
    # rounded for an fp32 engine (its probe failed); an engine_kwargs dtype over the profile's
    import types

    from workbench.session import sync_wire_dtype

    bf16, fp32 = types.SimpleNamespace(dtype="bfloat16"), types.SimpleNamespace(dtype="float32")
    assert sync_wire_dtype({}, bf16) == "bfloat16" and sync_wire_dtype({}, fp32) is None
    assert sync_wire_dtype({"dtype": "float32"}, bf16) is None and sync_wire_dtype({"dtype": "float16"}, fp32) == "float16"
    assert sync_wire_dtype({"dtype": "auto"}, bf16) is None
    # a quantized checkpoint as the policy: its engines hold quantized weights no dense sync replaces
    # (the names passed the check, the first sync's probe failed, blamed on its tolerance)
    import shutil

    from workbench.toy.models import toy_model_path

    quantized = tmp_path / "fp8"
    shutil.copytree(toy_model_path("moe"), quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConfigError, match=r"is a quantized checkpoint \(fp8\).*dequantized \(bf16\) checkpoint"):
        workbench.connect(backend="reference", model=str(quantized), run_dir=str(tmp_path / "run"))


def test_a_run_whose_set_up_fails_ends_and_a_logger_that_cannot_start_loses_no_step(tmp_path, monkeypatch):
    """A background run whose set-up raised (a full disk: the trajectories directory, runs.jsonl)
    died before its try: wait() and shutdown() waited for ever. A logger that cannot start (wandb.init
    timing out) raised out of the step's record, losing its metrics line at every run. And a second
    shutdown() shut Ray down again (another session's, started since)."""
    import types

    import workbench.tracking as tracking
    from workbench.loop import LoopConfig
    from workbench.session import RunHandle, Workbench, WorkbenchConfig

    bad = tmp_path / "run"
    bad.mkdir()
    (bad / "trajectories").write_text("a file where the directory goes")
    wb = object.__new__(Workbench)
    wb.run_dir, wb.next_step, wb.history, wb._run, wb._shut_down, wb._broken = bad, 0, [], None, False, None
    handle = RunHandle(wb, LoopConfig(steps=3), [], False, 0, 3)
    handle.start()
    assert handle._ended.wait(10) and handle.done
    with pytest.raises(RuntimeError):
        handle.wait(5)

    class NoService:
        def __init__(self, *a, **k):
            raise RuntimeError("Run initialization has timed out after 90.0 sec")

    monkeypatch.setattr(tracking, "WandbLogger", NoService)
    wb.cfg = WorkbenchConfig(run_dir=str(tmp_path / "other"))
    object.__setattr__(wb.cfg, "loggers", ["wandb"])
    wb._loggers, wb._loggers_tried = [], False
    wb._log({"step": 0, "loss": 1.0})  # said, and off: the run goes on
    wb._log({"step": 1, "loss": 0.5})
    assert wb._loggers == [] and wb._loggers_tried

    done = object.__new__(Workbench)
    done._shut_down = True
    done.shutdown()  # returns: nothing of it is left to stop


def test_a_step_whose_record_cannot_be_written_is_not_trained_again(tmp_path, monkeypatch):
    """A step trained and synced whose metrics line could not be written (a full disk) left
    next_step on it: the next wb.run() trained it again, on weights that held its update, on the
    same tasks. And the metrics file's close, failing again, skipped the views' end and escaped the
    run's thread. (metrics.jsonl is /dev/full here; the loop is a stand-in that records one step.)"""
    import workbench.session as session
    from workbench.loop import LoopConfig
    from workbench.session import RunHandle, Workbench

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to("/dev/full")
    wb = object.__new__(Workbench)
    wb.run_dir, wb.next_step, wb.next_position, wb.history, wb._run, wb._shut_down, wb._broken = run, 4, 64, [], None, False, None
    wb._rollout = wb.task_source = wb._teacher = None
    wb._trainer, wb.engines, wb.eval_tasks = __import__("types").SimpleNamespace(version=5), [], None

    def one_step(*a, on_step, **k):
        on_step({"step": 4, "data_next": 80, "loss": 0.1})

    monkeypatch.setattr(session, "run_loop", one_step)
    handle = RunHandle(wb, LoopConfig(steps=8), [], False, 0, 4)
    ended = []
    monkeypatch.setattr(handle.views, "on_end", lambda: ended.append(True))
    handle.run()  # (in this thread: what escaped it shows)
    assert handle.done and ended == [True] and isinstance(handle.error, OSError)
    assert (wb.next_step, wb.next_position) == (5, 80)


def test_a_step_interrupted_while_logged_or_retried_is_recorded_once(tmp_path, monkeypatch):
    """An interrupt inside the loggers' call (wandb.init on a run's first step: seconds) left
    next_step behind a step trained, synced and recorded: the next wb.run() trained it again (two
    metrics lines for it). And a line cut by a full disk had the next run's first line glued on:
    that step read as a torn line (dropped by the audit, set aside by a resume)."""
    import types

    import workbench.session as session
    from workbench.loop import LoopConfig
    from workbench.session import RunHandle, Workbench

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 3, "loss": 0.2}\n{"step": 4, "lo')  # cut mid-line
    wb = object.__new__(Workbench)
    wb.run_dir, wb.next_step, wb.next_position, wb.history, wb._run, wb._shut_down, wb._broken = run, 4, 64, [], None, False, None
    wb._rollout = wb.task_source = wb._teacher = None
    wb._trainer, wb.engines, wb.eval_tasks = types.SimpleNamespace(version=5), [], None

    def interrupted(m):
        raise KeyboardInterrupt

    wb._log = interrupted
    # (and a step retried after its training raised: its first try's untrained/ file was kept, the
    # audit adding it to the retry's counts)
    (run / "untrained").mkdir()
    (run / "untrained" / "step_00004.parquet").write_text("the first try's")
    written = []
    monkeypatch.setattr("workbench.tokens.write_trajectories", lambda trajs, path: written.append(path.name))

    def one_step(*a, on_step, on_groups, **k):
        on_groups(4, [])
        on_step({"step": 4, "data_next": 80, "loss": 0.1})

    monkeypatch.setattr(session, "run_loop", one_step)
    handle = RunHandle(wb, LoopConfig(steps=8), [], False, 0, 4)
    handle.run()
    assert handle.done and isinstance(handle.error, KeyboardInterrupt)
    assert (wb.next_step, wb.next_position) == (5, 80)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[1] == '{"step": 4, "lo' and json.loads(lines[2]) == {"step": 4, "data_next": 80, "loss": 0.1}
    assert written == ["step_00004.parquet"] and not (run / "untrained" / "step_00004.parquet").exists()


def test_export_is_written_beside_and_swapped_in_never_over_the_run_or_the_source(short_run, tmp_path, monkeypatch):
    """wb.export() wrote in place: a re-export kept an earlier export's files (an index naming
    shards the new one does not have: vLLM refused the directory), a kill mid-write left
    neither, wb.export(wb.run_dir) replaced the session's config.json with the model's, and
    wb.export(<the source checkpoint>) overwrote the weights the run started from. Now: beside,
    then swapped in, with a mark naming the version; a directory holding anything but an earlier
    export is refused, and so is the source. Cast to `dtype` on rank 0."""
    import json

    from safetensors import safe_open

    wb = short_run
    out = tmp_path / "export"
    assert wb.export(out, dtype="bfloat16") == str(out)
    (out / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-00001-of-00002.safetensors"}}')
    wb.export(out, dtype="bfloat16")  # over its own earlier one
    assert not (out / "model.safetensors.index.json").exists() and not (tmp_path / "export.new").exists()
    assert json.loads((out / "workbench_export.json").read_text()) == {"next_step": wb.next_step, "version": wb._trainer.version,
                                                                       "dtype": "bfloat16"}
    assert not (out / "workbench_policy.json").exists()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_tensor(k).dtype) for k in f.keys()}
    assert dtypes == {"torch.bfloat16"}
    config_before = (wb.run_dir / "config.json").read_text()
    with pytest.raises(ValueError, match="holds something other than an export"):
        wb.export(wb.run_dir)
    assert (wb.run_dir / "config.json").read_text() == config_before
    with pytest.raises(ValueError, match="the checkpoint the trainer started from"):
        wb.export(wb._trainer.model_path)
    # a kept policy (wb.revisit reran its step on the export's weights) and a model of workbench's cache
    # (every later session of that model loaded the export) were Hugging Face checkpoints, so replaced
    kept = next((wb.run_dir / "policies").glob("step_*"))
    cached = tmp_path / "cache" / "real" / "smollm2"
    cached.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (cached / name).write_text("{}")
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    for taken in (kept, cached):
        with pytest.raises(ValueError, match="holds something other than an export"):
            wb.export(taken)
    assert (kept / "workbench_policy.json").is_file() and (cached / "model.safetensors").read_text() == "{}"
    (out / "workbench_export.json").unlink()  # an export made before the mark: still replaced
    wb.export(out)
    assert json.loads((out / "workbench_export.json").read_text())["dtype"] == wb._trainer.cfg.dtype


def test_shutdown_live_ends_every_session_this_process_left_running(monkeypatch):
    """A notebook's Run All after one that failed or was interrupted before wb.shutdown() started a
    second session beside the first, whose engines and trainer (and an interrupted run) went on
    holding the machine. The connect cells call workbench.shutdown_live() first."""
    import workbench
    from workbench import session

    ended = []

    class Left:
        def shutdown(self):
            ended.append(self)

    import weakref

    left = [Left(), Left()]
    # (this process's own registry holds other tests' sessions: a registry of the two alone)
    monkeypatch.setattr(session, "_LIVE_SESSIONS", weakref.WeakValueDictionary({"/tmp/run-a": left[0], "/tmp/run-b": left[1]}))
    assert workbench.shutdown_live() == 2 and ended == left


def test_connect_interrupted_while_the_trainer_starts_keeps_it_to_shut_it_down(capsys):
    """The trainer's ranks and the runners start in threads (connect's longest part): an interrupt
    there raised out of connect() before either was kept, so shutdown() stopped neither and their
    actors outlived the session. They are waited for and kept (then shut down); one that failed is not."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from workbench.session import Workbench

    wb = object.__new__(Workbench)
    wb._trainer = wb._rollout = None
    started = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(lambda: (started.wait(10), "the trainer")[1])
        rollout = pool.submit(lambda: 1 / 0)
        threading.Timer(0.3, started.set).start()
        wb._adopt_started({"_trainer": trainer, "_rollout": rollout})
    assert wb._trainer == "the trainer" and wb._rollout is None
    assert "waiting for them, to shut them down" in capsys.readouterr().err


def test_the_teacher_a_run_distills_from_is_not_switched_under_it():
    """wb.trainer.batch() and wb.revisit() take the session's teacher: with a run distilling from
    another (wb.run(teacher=...)), they stopped the engine the run held, and its next scoring failed."""
    import types

    from workbench.session import Workbench

    wb = object.__new__(Workbench)
    wb._teacher, wb._run = ("the run's", ["its engine"]), types.SimpleNamespace(done=False)
    with pytest.raises(RuntimeError, match="cannot switch the teacher to 'another' while a run distills from \"the run's\""):
        wb._teacher_engines("another")
    assert wb._teacher == ("the run's", ["its engine"]) and wb._teacher_engines("the run's") == ["its engine"]


def test_a_checkpoint_records_its_task_pool_and_a_changed_one_is_said(capsys):
    """The checkpoint kept only the data position: a data file that gained a row since made the
    rest of the epoch another shuffle (tasks repeated and skipped), unsaid."""
    from workbench.agents import Task
    from workbench.data import TaskDataset
    from workbench.session import Workbench

    wb = object.__new__(Workbench)
    wb.next_step, wb.next_position = 6, 60
    wb.task_source = TaskDataset([Task([{"role": "user", "content": str(i)}]) for i in range(100)])
    state = wb._run_state()
    assert state == {"next_step": 6, "data_position": 60, "data_pool": 100}
    wb._check_data_pool(state)
    assert capsys.readouterr().err == ""
    wb.task_source = TaskDataset([Task([{"role": "user", "content": str(i)}]) for i in range(101)])
    wb._check_data_pool(state)
    assert "the task pool has 101 tasks; the checkpoint's run drew from 100" in capsys.readouterr().err


def test_an_actor_group_the_clusters_free_gpus_cannot_hold_is_refused(monkeypatch):
    """On a GPU cluster the session's placement plan holds every GPU of the shipped configs:
    wb.revisit's throwaway trainer (a GPU a rank) waited for them for ever, with no message. It is
    refused, naming the free GPUs and the way out; CPU sessions are not asked."""
    import ray

    import workbench.cluster
    from workbench.session import check_free_gpus

    monkeypatch.setattr(workbench.cluster, "cluster_gpus", lambda: 0)
    monkeypatch.setattr(ray, "available_resources", lambda: {})
    check_free_gpus(8, "anything", "")  # no GPUs in the cluster: nothing to check
    monkeypatch.setattr(workbench.cluster, "cluster_gpus", lambda: 16)
    monkeypatch.setattr(ray, "available_resources", lambda: {"GPU": 2.0})
    check_free_gpus(2, "two ranks", "")
    with pytest.raises(ConfigError, match=r"wb.revisit: its trainer needs 8 GPU\(s\) and the cluster has 2 free .*smaller world_size"):
        check_free_gpus(8, "wb.revisit: its trainer", "pass a smaller world_size", wait_s=0.1)


def test_the_last_live_session_of_a_process_stops_the_ray_it_shares(monkeypatch, tmp_path):
    """A second connect() in a kernel joins the first's Ray: the first's shutdown stopped Ray under the
    second's run (and the second's shutdown, calling its stale handles, started a bare Ray again). The
    owner hands Ray to a live session; the last one stops it."""
    import weakref

    import workbench.cluster
    import workbench.session
    from workbench.session import Workbench

    stopped = []
    monkeypatch.setattr(workbench.cluster, "shutdown_ray", lambda: stopped.append(1))
    monkeypatch.setattr(workbench.session, "_LIVE_SESSIONS", weakref.WeakValueDictionary())  # (this test's two only)

    def session(name: str, owns: bool) -> Workbench:
        wb = object.__new__(Workbench)
        wb.__dict__.update(_shut_down=False, _run=None, _teacher=None, judge_engine=None, _rollout=None, _trainer=None,
                           _greedy_rollout=None, _loggers=[], engines=[], placement=None, _run_dir_claim=None,
                           run_dir=tmp_path / name, _owns_ray=owns)
        workbench.session._LIVE_SESSIONS[str(wb.run_dir)] = wb
        return wb

    first, second = session("a", True), session("b", False)
    first.shutdown()
    assert stopped == [] and second._owns_ray
    second.shutdown()
    assert stopped == [1]
