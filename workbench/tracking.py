"""Experiment tracking beside metrics.jsonl: TensorBoard event files and Weights & Biases in
offline mode (no account, nothing leaves the machine; `wandb sync DIR` uploads later).

`WorkbenchConfig.loggers=["tensorboard", "wandb"]` makes the session write every step's
metrics (and every evaluation's) to run_dir/tensorboard/ and run_dir/wandb/. Each logger is
also a monitor (on_step(metrics)), so a script's loop.run(on_step=logger.on_step) works too.
Both packages are optional: `pip install -e ".[tracking]"` (the dev extra, which `make test`
installs, includes it). What is logged: every number of a step's metrics (bools as 0/1) under
its name, and dicts of numbers one level deep as name/key (e.g. staleness_hist/1); strings,
None and lists are left to metrics.jsonl, and so are the dicts whose keys change with the run
(UNBOUNDED_KEYS: a policy version, an error's text), which made a new metric every step (10,000
tags after 10,000 steps, over W&B's limit for a whole project).
"""

from __future__ import annotations

import json
from pathlib import Path

LOGGERS = ("tensorboard", "wandb")
WANDB_STEP = "rl_step"  # W&B's x axis: the RL step (see WandbLogger)
EXTRA_HINT = "pip install -e '.[tracking]' (the dev extra includes it)"


UNBOUNDED_KEYS = ("tokens_per_version", "groups_per_version", "failure_reasons")


def scalars(metrics: dict) -> dict[str, float]:
    """The loggable numbers of one metrics dict (see the module doc)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or isinstance(v, (int, float)):
            out[k] = float(v)
        elif isinstance(v, dict) and k not in UNBOUNDED_KEYS:
            out.update({f"{k}/{kk}": float(vv) for kk, vv in v.items() if isinstance(vv, (int, float))})
    return out


class TensorBoardLogger:
    """Scalars into TensorBoard event files under `log_dir` (torch's SummaryWriter)."""

    name = "tensorboard"

    def __init__(self, log_dir: str | Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            raise ImportError(f"loggers=['tensorboard'] needs the tensorboard package ({e}): {EXTRA_HINT}") from e
        self.log_dir, self.writer = str(log_dir), None
        self.purge_from(purge_step)

    def purge_from(self, step: int | None) -> None:
        """Write on from `step`: what the event files hold at or after it is hidden (a resumed or
        restored run trains those steps again; TensorBoard showed both branches, one over the other)."""
        from torch.utils.tensorboard import SummaryWriter

        if self.writer is not None:
            self.writer.close()
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=step)  # (0 too: a restore to the start)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in scalars(metrics).items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()  # a notebook reads the run while it goes; a crash keeps what was logged

    def on_step(self, metrics: dict) -> None:
        self.log(metrics, int(metrics["step"]))

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run in offline mode, written under `directory` (its wandb/ folder)."""

    name = "wandb"
    _open: set = set()  # this process's WandbLoggers not closed yet (close() leaves their service running)

    def __init__(self, directory: str | Path, config: dict | None = None, project: str = "workbench",
                 name: str | None = None, run_id: str | None = None, next_step: int = 0):
        """`run_id`: the W&B run to write (an existing one continued: W&B's resume="allow"), so a
        resumed session's steps land in its run, not a second one (`wandb sync` uploads both parts
        of the run's offline directories into one run). Every step logs its `branch`: W&B cannot hide
        what it logged, as TensorBoard's purge does, so a step trained again (a wb.restore(), a
        resume from a checkpoint before the last logged step) is a new branch, told apart by it.
        The branch and the last step logged are kept in wandb/workbench_branch.json: a resumed
        session writing from `next_step` on continues them."""
        self._branch_file = Path(directory) / "wandb" / "workbench_branch.json"
        try:
            kept = json.loads(self._branch_file.read_text())
            self.branch, self.last_step = int(kept["branch"]), int(kept["last_step"])
        except (OSError, ValueError, KeyError, TypeError):
            self.branch, self.last_step = 0, -1
        self.purge_from(next_step)
        try:
            import wandb
        except ImportError as e:
            raise ImportError(f"loggers=['wandb'] needs the wandb package ({e}): {EXTRA_HINT}") from e
        import os

        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # offline means nothing leaves the machine
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(mode="offline", dir=str(directory), project=project, name=name, config=config or {},
                              id=run_id, resume="allow" if run_id else None,
                              settings=wandb.Settings(silent=True, x_disable_stats=True, console="off"), reinit="create_new")
        # the RL step is a logged field every metric is plotted against, not W&B's own step, which
        # only increases: wb.eval() before training (step -1) and a step re-run after wb.restore()
        # were dropped ("less than the current step ... ignored")
        self.run.define_metric(WANDB_STEP)
        self.run.define_metric("*", step_metric=WANDB_STEP)
        self.directory = str(directory)
        WandbLogger._open.add(self)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log({**scalars(metrics), WANDB_STEP: step, "branch": self.branch})
        if step > self.last_step:
            self.last_step = step
            self._keep()

    def purge_from(self, step: int | None) -> None:
        """The steps from `step` on are trained again (wb.restore(), a resume): past a logged one, a new branch."""
        if step is not None and step <= self.last_step:
            self.branch, self.last_step = self.branch + 1, step - 1
            self._keep()

    def _keep(self) -> None:
        self._branch_file.parent.mkdir(parents=True, exist_ok=True)
        _replace_text(self._branch_file, json.dumps({"branch": self.branch, "last_step": self.last_step}))

    def on_step(self, metrics: dict) -> None:
        self.log(metrics, int(metrics["step"]))

    def close(self) -> None:
        import wandb

        self.run.finish()
        WandbLogger._open.discard(self)
        # finish() can return before wandb-core has written the run file (seen under load: the
        # file held only its header); teardown waits for the service to end, so the record is
        # complete on disk when close() returns. It ends the process's wandb service, and with it
        # every run still live in the process: a user's own wandb.init() run raised at its next
        # log, another session's logger was dropped. Only when no other run is live (else that
        # run's own finish or teardown completes the file)
        others = WandbLogger._open or (wandb.run is not None and wandb.run is not self.run)
        if not others:
            wandb.teardown()


def _replace_text(path: Path, text: str) -> None:
    """`path` holds `text`, whole or as before: write_text truncates, then writes, and a kill between
    left it empty (the branch file then read as a fresh run: branch 0 again, a re-trained step's
    lines under the abandoned branch's number; the run id file, a new W&B run)."""
    import os

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wandb_run_id(run_dir: str | Path) -> str:
    """The run directory's W&B run id, made on first use and kept in wandb/workbench_run_id: every
    session of the run (a resume) writes the same W&B run."""
    import uuid

    path = Path(run_dir) / "wandb" / "workbench_run_id"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    _replace_text(path, run_id + "\n")
    return run_id


def make_loggers(names: list, run_dir: str | Path, config: dict | None = None, next_step: int = 0) -> list:
    """Loggers for `names` (LOGGERS; an object with log/on_step/close passes through), writing from
    `next_step` on (TensorBoard hides what its files hold from there: a resumed run's abandoned steps)."""
    out = []
    try:
        for n in names:
            if not isinstance(n, str):
                out.append(n)
            elif n == "tensorboard":
                out.append(TensorBoardLogger(Path(run_dir) / "tensorboard", next_step))
            elif n == "wandb":
                out.append(WandbLogger(Path(run_dir), config, name=Path(run_dir).name, run_id=wandb_run_id(run_dir),
                                       next_step=next_step))
            else:
                raise ValueError(f"unknown logger {n!r}; known: {LOGGERS}")
    except BaseException:  # the ones already started are closed (a wandb run left open kept every later
        for logger in out:  # WandbLogger.close() from completing its files)
            if isinstance(logger, (TensorBoardLogger, WandbLogger)):
                try:
                    logger.close()
                except Exception:
                    pass
        raise
    return out
