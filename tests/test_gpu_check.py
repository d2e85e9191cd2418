"""scripts/gpu_check.sh runs only when a GPU machine is lent (minutes of device time a session, if
any): a check broken since its last run costs that time. Its --cpu mode runs the same code on CPU
with gloo at small sizes, so every check must give its figure here, --ab (the in-process A/B
against another checkout, here this one) included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_mode_gives_every_figure(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--ab", str(ROOT)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "gpu_check.jsonl").read_text().splitlines() if x.startswith("{")]
    figures = {x["check"]: x for x in lines}
    assert not [x for x in lines if "error" in x], lines
    assert {"fsdp", "routing", "logprobs", "load", "load_sharded", "replay", "trainer"} <= set(figures), sorted(figures)
    assert figures["fsdp"]["loss_fell"] and figures["logprobs"]["equal"] and figures["load"]["equal"]
    sharded = figures["load_sharded"]
    assert sharded["equal"] and sharded["bytes_read"] == sharded["checkpoint_bytes"]
    assert figures["replay"]["on_ab_s"] > 0  # the other checkout's routing_replay ran
    trainer = figures["trainer"]
    assert set(trainer["step_s"]) == {"plain", "trainer", "trainer_padded", "trainer_budget", "ab_trainer", "ab_trainer_budget"}
    assert trainer["micro_batches"]["trainer_budget"] < trainer["micro_batches"]["plain"]  # packing needs fewer forwards
    assert trainer["packed_vs_padded_logprob_diff"]["max"] < 1e-2
    assert (tmp_path / "profile_trainer_budget.txt").exists()
