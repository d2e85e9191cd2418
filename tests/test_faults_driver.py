"""The driver process itself killed mid-run (issue 16, item 3 d): a notebook's kernel dies
(SIGKILL, nothing runs after it), and a new driver resumes the run from its directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from workbench.loop import recover_checkpoint
from workbench.tokens import read_trajectories

STEPS = 8

DRIVER = """
import json, sys, workbench
run_dir, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume"
wb = workbench.connect(backend="reference", trainer_ranks=1, run_dir=run_dir, resume=resume,
                       loop={"prompts_per_step": 2, "group_size": 2})
print("START " + json.dumps(wb.next_step), flush=True)
wb.run(steps - wb.next_step, background=False, progress=False, checkpoint_every=1)
print("DONE " + json.dumps([h["step"] for h in wb.history]), flush=True)
wb.shutdown()
"""


def marked(marker: str) -> list[int]:
    """The pids of processes whose environment carries `marker` (the driver's Ray inherits it:
    raylet, GCS, workers; their command lines are rewritten to ray::..., their env is not)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def reap(marker: str, grace: float) -> list[int]:
    """Wait up to `grace` s for the marked processes to exit; SIGKILL (by pid) any left, and
    return them ("pid:command")."""
    deadline = time.time() + grace
    while marked(marker) and time.time() < deadline:
        time.sleep(0.5)
    left = []
    for pid in marked(marker):
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")[:40]
            os.kill(pid, signal.SIGKILL)
            left.append(f"{pid}:{name}")
        except (OSError, ProcessLookupError):
            pass
    return left


def test_driver_killed_then_resumed(tmp_path):
    """(d) The driver (connect + run with checkpoint_every=1, reference backend, its own local
    Ray) is SIGKILLed once it has recorded 3 steps; a new driver process resumes with
    resume=True on the same run_dir. Survived: every step the dead driver recorded up to its last
    checkpoint (metrics lines, trajectories, the checkpoint itself; a kill during a save leaves
    the old or the new complete checkpoint, never a torn one). The new driver starts at the
    checkpoint's step and runs to the end: steps 0..7 each recorded once in metrics.jsonl and
    trajectories/, agreeing. Lost: the step in progress at the kill (and a step recorded after
    the last checkpoint, if the kill fell between its metrics line and its checkpoint): their
    record is moved to abandoned/ and they are re-run. The dead driver's Ray processes (raylet,
    GCS, workers) exit with it (Ray's fate sharing); any that did not are killed by pid here."""
    run_dir = tmp_path / "run"
    marker = f"WORKBENCH_FAULT_TEST={uuid.uuid4().hex}"
    ray_tmp = tempfile.mkdtemp(prefix="wbf", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_TMPDIR": ray_tmp, marker.split("=")[0]: marker.split("=")[1]})
    leftovers, first = [], None
    t = {"start": time.time()}
    try:
        first = subprocess.Popen([sys.executable, "-c", DRIVER, str(run_dir), str(STEPS), "new"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.time() < deadline, "the first driver recorded no 3 steps in 300 s"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        t["killed"] = time.time()
        before = metrics.read_text().splitlines()
        recorded = [json.loads(x)["step"] for x in before if x.strip().endswith("}")]
        assert recorded[:3] == [0, 1, 2] and len(recorded) < STEPS, recorded  # killed mid-run
        leftovers = reap(marker, grace=10)
        t["reaped"] = time.time()

        assert recover_checkpoint(str(run_dir / "checkpoint"))  # what resume=True does first
        resume_at = json.loads((run_dir / "checkpoint" / "run_state.json").read_text())["next_step"]
        assert resume_at in (len(recorded) - 1, len(recorded))  # the last checkpoint: after the last or second-to-last line
        orphans = sorted(p.name for p in (run_dir / "trajectories").iterdir() if int(p.stem[5:]) >= resume_at)

        second = subprocess.run([sys.executable, "-c", DRIVER, str(run_dir), str(STEPS), "resume"], env=env,
                                capture_output=True, text=True, timeout=600)
        out = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in second.stdout.splitlines()
               if line.startswith(("START ", "DONE "))}
        t["resumed"] = time.time()
        assert "DONE" in out, second.stderr[-3000:]
        assert out["START"] == resume_at and out["DONE"] == list(range(STEPS))
        assert reap(marker, grace=30) == []  # a driver that ends normally leaves nothing running
        t["reaped2"] = time.time()
    finally:
        if first is not None and first.poll() is None:
            first.kill()
        reap(marker, grace=0)
        subprocess.run(["rm", "-rf", ray_tmp])

    text = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines = [json.loads(x) for x in text]
    assert [m["step"] for m in lines] == list(range(STEPS))  # none repeated, none skipped
    assert text[:resume_at] == before[:resume_at]  # the checkpointed steps' record, untouched
    assert sorted(p.name for p in (run_dir / "trajectories").iterdir()) == [f"step_{k:05d}.parquet" for k in range(STEPS)]
    for m in lines:
        assert len(read_trajectories(run_dir / "trajectories" / f"step_{m['step']:05d}.parquet")) == m["episodes"] + m["dropped_episodes"]
    aside = list((run_dir / "abandoned").glob("*")) if (run_dir / "abandoned").exists() else []
    assert sorted(p.name for d in aside for p in (d / "trajectories").iterdir()) == orphans
    set_aside = [json.loads(x)["step"] for d in aside if (d / "metrics.jsonl").exists()
                 for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip().endswith("}")]
    assert set_aside == [s for s in recorded if s >= resume_at]
    print(f"killed after {len(recorded)} recorded steps; resumed at {resume_at}; set aside: steps {set_aside}, "
          f"trajectories {orphans}; Ray processes left by the dead driver: {leftovers}; "
          f"times {[(k, round(v - t['start'], 1)) for k, v in t.items()]}")


class _StubTrainer:
    """Trainer.save's layout (dcp/ with its index, then run_state.json last), nothing else."""

    def save(self, path, run_state):
        os.makedirs(os.path.join(path, "dcp"), exist_ok=True)
        open(os.path.join(path, "dcp", ".metadata"), "w").close()
        with open(os.path.join(path, "run_state.json"), "w") as f:
            json.dump(run_state, f)


def test_a_checkpoint_never_replaces_what_is_not_one(tmp_path):
    """save_checkpoint swaps the new checkpoint in by renaming the old one away and deleting it:
    given a run directory (wb.save(wb.run_dir)) it deleted metrics.jsonl and trajectories/.
    It refuses now, and so does recover_checkpoint beside a leftover; an empty or new directory
    and a checkpoint's own are fine."""
    from workbench.loop import save_checkpoint

    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="other than a checkpoint"):
        save_checkpoint(_StubTrainer(), str(run), {"next_step": 1})
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "trajectories"]
    _StubTrainer().save(str(run) + ".new", {"next_step": 2})  # a leftover complete .new beside it
    with pytest.raises(ValueError, match="other than a checkpoint"):
        recover_checkpoint(str(run))
    assert (run / "metrics.jsonl").exists()
    ck = tmp_path / "checkpoint"
    assert save_checkpoint(_StubTrainer(), str(ck), {"next_step": 1}) == str(ck)
    save_checkpoint(_StubTrainer(), str(ck), {"next_step": 2})  # over its own earlier one
    assert json.loads((ck / "run_state.json").read_text())["next_step"] == 2 and recover_checkpoint(str(ck))


def test_a_torn_leftover_is_not_taken_for_a_checkpoint(tmp_path):
    """A leftover `.new` whose removal was killed part-way (its weights gone, its run_state.json
    still there) read as complete: recover_checkpoint took it and deleted the good checkpoint.
    Complete needs the weights' index too; save_checkpoint removes a leftover's run_state.json first."""
    from workbench.loop import save_checkpoint

    ck = tmp_path / "checkpoint"
    save_checkpoint(_StubTrainer(), str(ck), {"next_step": 10})
    torn = tmp_path / "checkpoint.new"
    _StubTrainer().save(str(torn), {"next_step": 12})
    os.unlink(torn / "dcp" / ".metadata")  # the rmtree got that far
    assert recover_checkpoint(str(ck))
    assert json.loads((ck / "run_state.json").read_text())["next_step"] == 10 and not torn.exists()
    # a recovery killed while it removed `path` (its run_state.json gone, its weights not yet) beside a
    # complete .new: a torn checkpoint, not something else to keep; the next recovery takes the .new
    _StubTrainer().save(str(torn), {"next_step": 12})
    os.unlink(ck / "run_state.json")
    assert recover_checkpoint(str(ck)) and json.loads((ck / "run_state.json").read_text())["next_step"] == 12


def test_a_symlinked_checkpoint_directory_is_saved_into_its_target(tmp_path):
    """checkpoint/ as a link to a larger disk: the swap's renames moved the link itself, the
    checkpoint landed on the run directory's disk, and the second save failed renaming onto the
    link (NotADirectoryError). The swap happens beside the link's target now."""
    from workbench.loop import save_checkpoint

    disk, run = tmp_path / "bigdisk" / "ck", tmp_path / "run"
    disk.mkdir(parents=True)
    run.mkdir()
    os.symlink(disk, run / "checkpoint")
    for step in (1, 2, 3):
        save_checkpoint(_StubTrainer(), str(run / "checkpoint"), {"next_step": step})
    assert (run / "checkpoint").is_symlink() and sorted(p.name for p in run.iterdir()) == ["checkpoint"]
    assert json.loads((disk / "run_state.json").read_text())["next_step"] == 3 and recover_checkpoint(str(run / "checkpoint"))
    assert sorted(p.name for p in disk.parent.iterdir()) == ["ck"]


def test_a_symlinked_checkpoint_set_aside_by_a_restore_keeps_its_disk(tmp_path):
    """wb.restore() of another checkpoint sets the run's own checkpoint/ (the abandoned branch)
    aside: with checkpoint/ a link to a larger disk, the link itself was moved (a relative one
    dangling) and the run's next saves landed on the run directory's disk. The target is set
    aside beside itself under a link in abandoned/, the run's link stays, and the next save goes
    to the disk it names."""
    import types

    from workbench.loop import save_checkpoint
    from workbench.session import Workbench

    disk, run = tmp_path / "big" / "ck", tmp_path / "run"
    disk.parent.mkdir()
    run.mkdir()
    os.symlink("../big/ck", run / "checkpoint")  # relative, as `ln -s` is often made
    save_checkpoint(_StubTrainer(), str(run / "checkpoint"), {"next_step": 5})
    Workbench._set_aside(types.SimpleNamespace(run_dir=run), 2, run / "checkpoint")
    [aside] = (run / "abandoned").glob("*/checkpoint")
    assert aside.is_symlink() and json.loads((aside / "run_state.json").read_text())["next_step"] == 5
    assert os.path.realpath(aside).startswith(str(tmp_path / "big"))
    assert (run / "checkpoint").is_symlink() and not disk.exists()  # the link stays; its target is made by the next save
    save_checkpoint(_StubTrainer(), str(run / "checkpoint"), {"next_step": 2})
    assert json.loads((disk / "run_state.json").read_text())["next_step"] == 2 and (run / "checkpoint").is_symlink()
