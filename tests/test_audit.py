"""The run audit page (wb.audit, python -m workbench.audit) and step time travel (wb.revisit),
on one short real run (conftest.short_run)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.tokens import Segment, Trajectory, read_trajectories, write_trajectories
from workbench.widgets.audit import CHECKS, read_metrics


def test_audit_page_of_a_real_run(short_run, tmp_path):
    """Every statistic has its section and its column for every step; this healthy run breaks
    no threshold; the page is self-contained (no URL, no script)."""
    page = short_run.audit(tmp_path / "audit.html")
    html = page.read_text()
    print(f"audit page: {page.stat().st_size} bytes")
    for key, title, _ in CHECKS:
        assert f"id='stat-{key}'" in html and title in html
    assert "Violations: 0" in html and "<tr><td>2</td>" in html
    assert not re.search(r"https?://|<script|src=", html)
    # read back from the run directory alone: the kept policies, the trajectories and the log
    assert sorted(p.name for p in (short_run.run_dir / "policies").iterdir()) == ["step_00000", "step_00002"]


def test_a_breach_is_flagged_and_linked_to_its_token_view(short_run, tmp_path):
    """A copy of the run with step 1's sync probe difference over its limit and step 0's share of
    tokens kept under its minimum (metrics.jsonl), and an identity mismatch recorded in one
    episode of step 2 (its parquet): all are flagged, the step statistics linked to the step's
    trajectories, the mismatch to that episode's token view; the command line writes the same
    page."""
    run = tmp_path / "copy"
    shutil.copytree(short_run.run_dir, run, ignore=shutil.ignore_patterns("policies", "checkpoint"))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lines[1]["sync_max_abs_diff"] = 0.5
    assert lines[0]["token_keep_ratio"] == 1.0  # the run's own (no token-level mask)
    lines[0]["token_keep_ratio"] = 0.4  # what a token-level mask dropping 60% of the tokens logs
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    step2 = run / "trajectories" / "step_00002.parquet"
    trajs = read_trajectories(step2)
    trajs[1].segments[0].stats["identity_mismatch"] = 3
    write_trajectories(trajs, step2)
    bad = trajs[1].episode_id.replace("-", "_")

    out = subprocess.run([sys.executable, "-m", "workbench.audit", str(run), "-o", str(tmp_path / "a.html")],
                         capture_output=True, text=True, check=True)
    assert "a.html" in out.stdout
    html = (tmp_path / "a.html").read_text()
    assert "Violations: 3" in html
    assert re.search(r"<li class='v' id='v-1-sync_max_abs_diff'>step 1: .*= 0\.5 .*href='#step-1'", html)
    assert re.search(r"<li class='v' id='v-0-token_keep_ratio'>step 0: .*= 0\.4 .*href='#step-0'", html)
    assert re.search(rf"<li class='v' id='v-2-identity_mismatch'>step 2: .*= 3 .*href='#t-2-{bad}'", html)
    assert f"<div class='traj' id='t-2-{bad}'>" in html and "<div id='step-1'>" in html
    assert "<td class='bad'><a href='#v-2-identity_mismatch'>3</a></td>" in html
    assert not re.search(r"https?://", html)
    # a check switched off from the command line ("none": shown, not flagged)
    from workbench.widgets.audit import main

    main([str(run), "-o", str(tmp_path / "b.html"), "--token-keep-ratio", "none"])
    assert "Violations: 2" in (tmp_path / "b.html").read_text()
    # token views stop at the page's budget (a long run flagged at every step made a page of GBs): the
    # later flagged steps name their trajectory file; every violation is still listed and linked
    from workbench.widgets.audit import audit_html

    capped = audit_html(run, max_view_bytes=1)
    assert "Violations: 3" in capped and capped.count("<div class='traj'") == 1  # (the first view spends it)
    assert "token views left out" in capped and "trajectories/step_00002.parquet" in capped and "<div id='step-2'>" in capped
    # every link goes somewhere: a view left out keeps its id on the note that says so (they went nowhere)
    ids = set(re.findall(r"id='([^']+)'", capped))
    assert not [h for h in re.findall(r"href='#([^']+)'", capped) if h not in ids]
    assert f"id='t-2-{bad}'>{bad}: token view left out" in capped


def test_a_run_copied_without_its_trajectories_is_not_audited_clean(short_run, tmp_path):
    """The token-identity checks were computed from trajectories/ only: a run directory copied
    without them (a cluster run's large files left behind) read 0 mismatches, clean. Each step
    logs them now (batch_from_groups' totals); a step with neither is not recorded (–), and the
    page says which steps had no trajectories."""
    from workbench.widgets.audit import audit_html

    run = tmp_path / "copy"
    shutil.copytree(short_run.run_dir, run, ignore=shutil.ignore_patterns("policies", "checkpoint", "trajectories"))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["identity_mismatch"] == 0 and m["unexpected_seals"] == 0 for m in lines)  # logged by the run
    lines[1]["identity_mismatch"] = 2  # what a retokenizing accumulator's step logs
    del lines[2]["identity_mismatch"]  # a run from before the totals were logged
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    html = audit_html(run)
    assert "Violations: 1" in html and re.search(r"id='v-1-identity_mismatch'>step 1: .*= 2 ", html)
    assert f"No trajectories/step_*.parquet for {len(lines)} step(s) (0..{len(lines) - 1})" in html


def test_the_audit_holds_a_step_to_the_settings_its_run_used(short_run, tmp_path):
    """wb.run(n, sync_tol=0.1) (a bf16 run's tolerance): the audit read config.json's 1e-3 and
    flagged every sync. Each step logs the sync_tol and episode rules its loop ran with."""
    from workbench.widgets.audit import audit_html

    run = tmp_path / "copy"
    shutil.copytree(short_run.run_dir, run, ignore=shutil.ignore_patterns("policies", "checkpoint"))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["sync_tol"] == 1e-3 and m["on_failed"] and m["on_truncated"] for m in lines)  # logged by the run
    for m in lines:
        m["sync_max_abs_diff"], m["sync_tol"] = 0.02, 0.1
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    html = audit_html(run)
    # the plot's line and the heading say the tolerance the steps were held to (they drew config.json's)
    assert "Violations: 0" in html and "weight sync; max 0.1; 0 step(s) flagged" in html
    lines[0]["sync_tol"] = 0.05
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert "weight sync; max 0.1 (the last step's; per step 0.05 to 0.1); 0 step(s) flagged" in audit_html(run)
    for m in lines:
        del m["sync_tol"]  # a run from before: config.json's tolerance
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert f"Violations: {len(lines)}" in audit_html(run)
    # an async run bound by training samples every token a version behind: no step after the first has a
    # token of the trained version, and its forward check (k3) measured nothing but read as within
    assert "(forward consistency) not measured" not in audit_html(run)
    for m in lines[1:]:
        m.update(mode="async", async_lag=1, kl_k3_current=None, sync_tol=0.1)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    html = audit_html(run)
    assert f"k3 with replay (forward consistency) not measured on {len(lines) - 1} of {len(lines)} step(s) (1..{len(lines) - 1})" in html


def test_revisit_recomputes_the_logged_step(short_run):
    """Step 2 again on the policy it trained from (kept: keep_policy_every=2) and its saved
    trajectories: loss, gradient norm, gate, IS weights, KL with and without replay and replay
    disagreement equal the logged ones; the per-token report covers the batch. A step without a
    kept policy is refused, naming the setting."""
    rv = short_run.revisit(short_run.run_dir, 2)
    logged = read_metrics(short_run.run_dir)[2]
    assert rv.version == logged["version"] - 1 and rv.differences() == {} and logged["kl_k3_live"] is not None
    # a statistic the logged step did not measure (kl_k3_live off its cadence: None) is not compared;
    # one it did, and that differs, is
    rv.logged = {**logged, "kl_k3_live": None}
    assert rv.differences() == {}
    rv.logged = {**logged, "kl_k3_live": logged["kl_k3_live"] + 1.0}
    assert set(rv.differences()) == {"kl_k3_live"}
    # NaN logged and NaN recomputed (a step skipped for a non-finite gradient: grad_norm NaN) agree
    rv.logged, saved = {**logged, "grad_norm": math.nan}, rv.recomputed
    rv.recomputed = {**saved, "grad_norm": math.nan}
    assert rv.differences() == {}
    rv.logged, rv.recomputed = logged, saved
    # several updates a step: the later ones moved with the run's optimizer state, the revisit's is
    # fresh (every step's loss and gradient norm differed, however rightly it trained): not compared
    rv.logged = {**logged, "updates": 2, "loss": logged["loss"] + 1.0, "grad_norm": 7.0, "gate_pass_ratio": -1.0}
    assert set(rv.differences()) == {"gate_pass_ratio"} and "not comparable" in rv._repr_html_()
    rv.logged = {**logged, "loss": logged["loss"] + 1.0}
    assert set(rv.differences()) == {"loss"} and "not comparable" not in rv._repr_html_()
    rv.logged = logged
    counts = rv.recomputed["is_weight_hist"]["counts"]
    assert sum(counts) > 0 and counts == logged["is_weight_hist"]["counts"]
    # a zero loss is right only when no group had an advantage (the engine's batching, hence the
    # rewards, vary from run to run: both of step 2's groups may have drawn equal rewards)
    rewards: dict[str, set] = {}
    for t in read_trajectories(short_run.run_dir / "trajectories" / "step_00002.parquet"):
        rewards.setdefault(t.group_id, set()).add(t.reward)
    assert (rv.recomputed["loss"] != 0) == any(len(r) > 1 for r in rewards.values()), (rv.recomputed["loss"], rewards)
    rep = rv.report
    assert rep["trainer_logprobs"].shape == rep["is_weight"].shape == rv.batch["input_ids"].shape
    assert int(rep["loss_mask"].sum()) == sum(logged["tokens_per_version"].values())
    assert "equal" in rv._repr_html_() and rv.journey(0).values["gate_keep"] in (True, False)
    with pytest.raises(FileNotFoundError, match="keep_policy_every"):
        short_run.revisit(None, 1)


def test_a_run_keeps_the_policy_it_starts_from_unless_it_holds_that_version(tmp_path):
    """A run's first step keeps the policy the previous run's last step wrote, but only where it
    holds the trainer's version: weights changed between the runs (wb.trainer.step + wb.sync, a
    wb.restore of another checkpoint) are written again. (A fake trainer: the branch is the
    session's own; the export is the trainer's, tested with revisit above.)"""
    import types

    from workbench.session import POLICY_MARK, RunHandle

    exports = []

    class Trainer:
        version, vocab_size = 7, 100
        weights = "w7"  # what the probe reads: the weights, not their version

        def export_hf(self, path):
            exports.append(self.version)
            Path(path).mkdir(parents=True)

        def probe(self, ids):
            return [float(len(self.weights))] + [float(ord(c)) for c in self.weights]

    from workbench.correction import CorrectionConfig
    from workbench.loop import LoopConfig
    from workbench.session import WorkbenchConfig, kept_settings

    def kept_loop_settings(policy, loop):
        return kept_settings(policy, {"loop": loop})["loop"]

    # a resumed session's trainer settings: not config.json's (they went to config.resume-*.json)
    resumed = WorkbenchConfig(temperature=0.7)
    resumed.trainer.correction = CorrectionConfig.tis(cap=3.0)
    handle = types.SimpleNamespace(keep_policy_every=2, cfg=LoopConfig(advantage="rloo", on_failed="zero"),
                                   _wb=types.SimpleNamespace(run_dir=tmp_path, _trainer=Trainer(), cfg=resumed))
    keep = lambda step, replace=True: RunHandle._keep_policy(handle, step, replace)  # noqa: E731
    keep(4)
    keep(4, replace=False)  # the next run's first step: the same version, kept
    assert exports == [7] and json.loads((tmp_path / "policies" / "step_00004" / POLICY_MARK).read_text())["version"] == 7
    handle._wb._trainer.version, handle._wb._trainer.weights = 8, "w8"  # the weights moved between the runs
    keep(4, replace=False)
    assert exports == [7, 8] and json.loads((tmp_path / "policies" / "step_00004" / POLICY_MARK).read_text())["version"] == 8
    keep(3)  # not a kept step
    assert exports == [7, 8]
    # the run's loop settings (its overrides) are kept beside it: what wb.revisit rebuilds the batch with
    kept = kept_loop_settings(tmp_path / "policies" / "step_00004", {"advantage": "grpo"})
    assert (kept["advantage"], kept["on_failed"]) == ("rloo", "zero")
    first_session = {"trainer": dataclasses.asdict(WorkbenchConfig().trainer), "temperature": 1.0, "model": "toy-moe"}
    d = kept_settings(tmp_path / "policies" / "step_00004", first_session)
    step_cfg = WorkbenchConfig.from_dict({k: d[k] for k in ("trainer", "loop", "temperature", "trainer_ranks")})
    assert step_cfg.trainer.correction == resumed.trainer.correction and step_cfg.temperature == 0.7 and d["model"] == "toy-moe"
    # a next run's first step keeps the weights (same version) and records its own settings
    handle.cfg = LoopConfig(advantage="grpo")
    keep(4, replace=False)
    assert exports == [7, 8] and kept_loop_settings(tmp_path / "policies" / "step_00004", None)["advantage"] == "grpo"
    assert kept_loop_settings(tmp_path / "policies" / "step_00006", {"advantage": "grpo"}) == {"advantage": "grpo"}
    # ... whatever the next run's keep_policy_every: a second wb.run without it trains the step too
    # (run 1's advantage and episode rules stayed in the mark, and wb.revisit used them)
    handle.keep_policy_every, handle.cfg = 0, LoopConfig(advantage="rloo", on_failed="zero")
    keep(4, replace=False)
    assert exports == [7, 8] and kept_loop_settings(tmp_path / "policies" / "step_00004", None)["on_failed"] == "zero"
    handle._wb._trainer.version = 9  # the same weights renumbered (a sync: wb.restore() syncs past the engines)
    handle.cfg = LoopConfig(advantage="grpo")
    keep(4, replace=False)  # kept: the same probe log-probs; the mark takes the version and this run's settings
    mark = json.loads((tmp_path / "policies" / "step_00004" / POLICY_MARK).read_text())
    assert exports == [7, 8] and (mark["version"], mark["loop"]["advantage"]) == (9, "grpo")
    handle._wb._trainer.version, handle._wb._trainer.weights = 10, "w10"  # other weights (a wb.trainer.step() + sync)
    keep(4, replace=False)  # this run does not keep step 4: the old one is moved aside (revisit used its weights)
    assert exports == [7, 8] and not (tmp_path / "policies" / "step_00004").exists()
    [aside] = (tmp_path / "abandoned").glob("*/policies/step_00004-v9")
    assert json.loads((aside / POLICY_MARK).read_text())["version"] == 9


def test_a_restore_sets_aside_the_abandoned_branchs_policies_and_evaluations(tmp_path, capsys):
    """wb.restore / a resume to next_step 2 sets aside what the steps after the checkpoint left:
    their metrics and trajectories (as before), the policies kept for steps > 2 (they start from
    the abandoned branch's weights: wb.revisit of a re-run step 3 paired them with its new
    trajectories) and the evaluations of the weights after steps >= 2 (a re-run step's
    evaluation was a second record beside them). policies/step_00002 holds the checkpoint's own
    weights: it stays."""
    import types

    from workbench.session import Workbench

    run = tmp_path
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in range(4)) + '{"step": 4, "ver')
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": i, "eval_pass@1": i / 10}) + "\n" for i in (-1, 1, 2, 3)))
    for i in range(4):
        (run / "trajectories").mkdir(exist_ok=True)
        (run / "trajectories" / f"step_{i:05d}.parquet").write_text("x")
        (run / "policies" / f"step_{i:05d}").mkdir(parents=True)
    kept = Workbench._set_aside(types.SimpleNamespace(run_dir=run), 2)
    assert [m["step"] for m in kept] == [0, 1]
    [aside] = list((run / "abandoned").iterdir())
    assert sorted(p.name for p in (run / "policies").iterdir()) == ["step_00000", "step_00001", "step_00002"]
    assert sorted(p.name for p in (aside / "policies").iterdir()) == ["step_00003"]
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [-1, 1]
    assert [json.loads(x)["step"] for x in (aside / "eval.jsonl").read_text().splitlines()] == [2, 3]
    assert sorted(p.name for p in (aside / "trajectories").iterdir()) == ["step_00002.parquet", "step_00003.parquet"]
    assert "were not in the checkpoint" in capsys.readouterr().out


def test_the_audit_flags_a_failed_sync_nan_and_unreplayed_routing():
    """Three breaches the page passed as "within its threshold": a step whose weight sync raised
    (its sync_max_abs_diff is None then, so the probe check could never fire), a NaN statistic (a
    NaN compares False), and recorded routing the forward did not use. A run that captured no
    routing shows its disagreement as not measured, not as 0."""
    from workbench.widgets.audit import Thresholds, _over, step_values

    base = {"step": 0, "version": 1, "episodes": 4, "gate_pass_ratio": 1.0, "token_keep_ratio": 1.0, "kl_k3": 1e-5,
            "kl_k3_current": 1e-5, "replay_disagree_rate": 0.0, "replay_positions": 100, "replay_unreplayed": 0}
    th = Thresholds()
    flagged = lambda m: sorted(k for k, v in step_values(m, [])[0].items() if _over(k, v, getattr(th, k, None)))  # noqa: E731
    assert flagged(base) == []
    assert flagged({**base, "sync_error": "WeightSyncError: probe differs by 0.7"}) == ["sync_failed"]
    assert flagged({**base, "kl_k3": float("nan"), "kl_k3_current": float("nan")}) == ["kl_k3"]
    assert flagged({**base, "gate_pass_ratio": float("nan")}) == ["gate_pass_ratio"]
    assert flagged({**base, "replay_unreplayed": 12}) == ["replay_unreplayed"]
    # a step whose gradient was NaN (its update skipped: the weights stood still) read clean; a zero one
    # (every advantage 0: nothing to learn) is not a breach
    assert flagged({**base, "grad_norm": float("nan"), "updates_skipped": 1}) == ["nonfinite_gradient"]
    assert flagged({**base, "grad_norm": float("inf")}) == ["nonfinite_gradient"]
    assert flagged({**base, "grad_norm": 0.0, "updates_skipped": 1}) == [] and flagged({**base, "grad_norm": 0.7}) == []
    # async: the stale tokens' KL is the staleness; the check reads the trained version's own tokens
    assert flagged({**base, "kl_k3": 0.3}) == [] and flagged({**base, "kl_k3_current": 0.3}) == ["kl_k3"]
    assert step_values({**base, "replay_positions": 0}, [])[0]["replay_disagree_rate"] is None
    from workbench.loop import STALE_KL_LIMIT

    assert th.kl_k3_stale == STALE_KL_LIMIT  # held where the loop warns
    assert flagged({**base, "kl_k3_stale": 1.4}) == ["kl_k3_stale"] and flagged({**base, "kl_k3_stale": 0.6}) == []
    # one layer replayed from another layer's record: its rate averaged over 24 layers passed
    assert flagged({**base, "replay_disagree_per_layer": [0.01] * 23 + [0.97], "replay_disagree_rate": 0.05}) == [
        "replay_disagree_worst_layer"]


def test_the_audit_flags_seals_where_the_agent_changed_what_the_model_saw():
    """Qwen3 (thinking) seals template_rewrite at every user turn and eviction past the kept
    conversations is normal: every step of such a healthy run was red. Only the agent's own
    changes (history_rewritten, assistant_changed) are flagged; the table keeps every reason."""
    from workbench.tokens import Segment, Trajectory
    from workbench.widgets.audit import _episode

    def seg(reason):
        s = Segment([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0, 0])
        s.seal_reason = reason
        return s

    t = Trajectory([seg("template_rewrite"), seg("evicted"), seg("history_rewritten"), seg("assistant_changed"),
                    seg("episode_end")], 1.0, "g", "e", {})
    e = _episode(t, 0)
    assert e["unexpected_seals"] == 2 and e["seals"] == ["template_rewrite", "evicted", "history_rewritten",
                                                          "assistant_changed", "episode_end"]


def test_the_audit_holds_each_step_to_the_staleness_its_loop_guarantees():
    """A sync step trains on tokens of the version it trains (its rollout waits for the sync); an
    async one at most async_lag versions older. Held to the trainer's max_staleness (4) alone, a
    sync loop whose rollout stopped waiting for the sync (every token one version stale, and no
    token of the trained version, so kl_k3_current None) read clean."""
    from workbench.widgets.audit import _over, step_limits, step_values

    limits = {"max_staleness": 4, "kl_k3": 0.05}
    broken = {"step": 3, "version": 4, "mode": "sync", "max_staleness_kept": 1, "kl_k3": 0.4, "kl_k3_current": None}
    flagged = lambda m, given=False: sorted(  # noqa: E731
        k for k, v in step_values(m, [])[0].items() if _over(k, v, step_limits(m, limits, given).get(k)))
    assert flagged(broken) == ["kl_k3", "max_staleness"]
    assert flagged({**broken, "max_staleness_kept": 0, "kl_k3": 1e-5}) == []
    lagged = {**broken, "mode": "async", "async_lag": 1, "kl_k3_current": 1e-5}
    assert flagged(lagged) == [] and flagged({**lagged, "max_staleness_kept": 2}) == ["max_staleness"]
    assert flagged({**broken, "mode": "async", "kl_k3_current": 1e-5, "max_staleness_kept": 3}) == []  # no lag logged: 4
    # the step's own gate, where it logged it: a session resumed with max_staleness 1 -> 4 and async_lag 4
    # (config.resume-*.json, which the page does not read) had its steps held to config.json's 1
    resumed = {**broken, "mode": "async", "async_lag": 4, "kl_k3_current": 1e-5, "max_staleness_kept": 3}
    limits["max_staleness"] = 1  # (config.json's)
    assert flagged(resumed) == ["max_staleness"] and flagged({**resumed, "max_staleness_gate": 4}) == []
    assert flagged({**resumed, "max_staleness_gate": 2}) == ["max_staleness"]
    assert flagged({**broken, "kl_k3": 1e-5}, given=True) == []  # a threshold the caller gave is the one
    # the episodes blamed are those the batch trained on: not a failed one the step dropped (or masked)
    def at(episode_id, version, error=None):
        return Trajectory([Segment([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, version, version])], 1.0, "g",
                          episode_id, {}, error)

    trajs = [at("fresh", 3), at("stale", 1), at("timed-out", 0, error="episode timed out")]
    for rules, blamed in (({"on_failed": "drop"}, {"stale"}), ({"on_failed": "mask"}, {"stale"}),
                          ({"on_failed": "zero"}, {"stale", "timed-out"})):
        per_episode = step_values(broken, trajs, rules)[1]["max_staleness"]
        assert {ep for ep, v in per_episode.items() if v > 0} == blamed, rules


def test_an_audit_plot_of_a_non_finite_value_keeps_the_rest_drawn():
    """A NaN step (flagged) cut the audit's polyline at it, its red linked dot had cy='nan' (not
    drawn) and, first, made the range [0, 1], flattening a KL of 1e-5 under a 1e-3 limit."""
    from workbench.widgets.audit import _plot

    html = _plot("kl_k3", [0, 1, 2, 3], [math.nan, 1e-5, 2e-5, 1e-5], 1e-3, {0})
    points = re.findall(r"points='([^']*)'", html)
    assert points and "nan" not in " ".join(points) and "cy='nan'" not in html
    assert "href='#v-0-kl_k3'" in html and "step 0: nan" in html and ">0.001</text>" in html


def _synthetic_run(d, lines, trajs):
    """A run directory written by hand: config.json, metrics.jsonl, trajectories/."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"loop": {"sync_tol": 1e-3}, "trainer": {"correction": {"max_staleness": 4}}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    for s, ts in trajs.items():
        write_trajectories(ts, d / "trajectories" / f"step_{s:05d}.parquet")
    return d


def test_a_stopped_runs_leftover_groups_count_in_the_last_steps_rates():
    """The finished groups no step took when a run stops are written into the last step's untrained/
    file after its metrics line: the page added their episodes to the denominator and none of their
    failures to the numerator (8 of 8 trained episodes truncated read 0.125; 8 timed-out leftovers
    read a failed_rate of 0). The file's episodes are counted whole."""
    from workbench.tokens import Segment, Trajectory
    from workbench.widgets.audit import step_values

    def traj(ep, err=None, truncated=False):
        s = Segment([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.5], [-1, 0, 0])
        s.seal_reason = "episode_end"
        return Trajectory([s], 0.0, "g", ep, {"untaken": True} if ep.startswith("u") else {}, err, truncated=truncated)

    trained = [traj(f"t{i}", truncated=i < 3) for i in range(8)]
    m = {"step": 9, "version": 10, "trained_version": 9, "episodes": 8, "failed_episodes": 0, "truncated_episodes": 3}
    leftovers = [traj(f"u{i}", err="episode timed out" if i < 8 else None) for i in range(16)]
    v = step_values(m, trained, untrained=leftovers)[0]
    assert v["failed_rate"] == pytest.approx(8 / 24) and v["truncated_rate"] == pytest.approx(3 / 24)
    # without the file, the line's own counts (as before)
    v = step_values({**m, "untrained_episodes": 4, "untrained_failed_episodes": 2}, trained)[0]
    assert v["failed_rate"] == pytest.approx(2 / 12) and v["truncated_rate"] == pytest.approx(3 / 12)


def test_an_identity_break_keeps_its_token_view_and_its_logged_count(tmp_path):
    """A step of 20 timed-out episodes and one with an identity mismatch: the failed ones took
    every token view (16), the mismatch's link went nowhere. And a copy with trajectories/ but
    without untrained/ read the breaks from the trajectories alone: the logged count (which holds
    the untrained groups') was ignored, and the page read clean."""
    from workbench.tokens import Segment, Trajectory
    from workbench.widgets.audit import audit_html

    def traj(ep, err=None):
        s = Segment([1, 2, 3, 4], [0, 1, 1, 1], [0.0, -0.5, -0.5, -0.5], [-1, 0, 0, 0],
                    messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "hi"}])
        s.seal_reason = "episode_end"
        return Trajectory([s], 1.0, "g0", ep, {}, err)

    base = {"step": 0, "version": 1, "trained_version": 0, "mode": "sync", "gate_pass_ratio": 1.0, "token_keep_ratio": 1.0,
            "kl_k3": 1e-5, "max_staleness_kept": 0, "sync_max_abs_diff": 1e-4, "retokenization_drift": 0, "sync_tol": 1e-3}
    ts = [traj(f"f{i:02d}", err="episode timed out") for i in range(20)] + [traj("bad")]
    ts[-1].segments[0].stats["identity_mismatch"] = 2
    html = audit_html(_synthetic_run(tmp_path / "a", [{**base, "episodes": 1, "dropped_episodes": 20, "failed_episodes": 20,
                                                       "identity_mismatch": 2, "unexpected_seals": 0}], {0: ts}))
    assert "href='#t-0-bad'" in html and "id='t-0-bad'" in html
    # every link has its view (the failed episodes' links, cut in another order, went nowhere)
    assert all(f"id='{h}'" in html for h in re.findall(r"href='#(t-[^']*)'", html)) and "more without a token view" in html
    html = audit_html(_synthetic_run(tmp_path / "b", [{**base, "episodes": 4, "failed_episodes": 0, "identity_mismatch": 3,
                                                       "unexpected_seals": 1, "untrained_episodes": 2}],
                                     {0: [traj(f"e{i}") for i in range(4)]}))
    assert "id='v-0-identity_mismatch'" in html and "id='v-0-unexpected_seals'" in html
    # a step that trained nothing (every episode failed) is said so, not as an async step's
    nothing = {**base, "kl_k3": None, "episodes": 0, "segments": 0, "dropped_episodes": 4, "failed_episodes": 4, "updates_skipped": 1}
    html = audit_html(_synthetic_run(tmp_path / "c", [nothing], {}))
    assert "1 step(s) measured nothing of the forward (0)" in html and "an async run" not in html
    # ... every episode masked (counted as episodes, trained nothing), and a step whose training was
    # interrupted after an update (no sync: it read clean, its weights moved and the engines not synced)
    masked = {**nothing, "step": 1, "episodes": 4, "masked_episodes": 4, "dropped_episodes": 0}
    interrupted = {**base, "step": 2, "kl_k3": None, "episodes": 4, "segments": 4, "train_interrupted": "PartialUpdate"}
    html = audit_html(_synthetic_run(tmp_path / "d", [{**nothing, "failed_episodes": 0}, masked, interrupted], {}))
    assert "3 step(s) measured nothing of the forward (0..2)" in html and "an async run" not in html
    assert "id='v-2-sync_failed'" in html and "Every statistic of every step is within" not in html
