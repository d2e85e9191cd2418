"""The agent API. A user file defines `AgentRunner`, one of two shapes:

- `Env` (the framework owns the LLM loop): Gymnasium-aligned async `reset(task)` ->
  (observation, info) and `step(message)` -> (observation, reward, terminated, truncated,
  info). Observations are chat messages; the framework renders them through the chat template
  via the same accumulator the loopback server uses (an env never writes template markers).
- `ChatAgent` (the user owns the loop): async `run(ctx)` calls a stock OpenAI or Anthropic SDK
  at `ctx.base_url` / `ctx.anthropic_base_url` and returns its reward (and info).

Everything else, the reward included, is ordinary code. The file may also define
`tasks(n, seed)` returning its own prompts.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Task:
    """One prompt: the opening messages, optional tools (OpenAI function specs) and a label
    (whatever the reward needs, e.g. the right answer)."""

    messages: list[dict]
    tools: list[dict] | None = None
    label: Any = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    info: dict = field(default_factory=dict)


@dataclass
class AgentContext:
    """What a ChatAgent gets: where to send its requests, and the task."""

    base_url: str  # OpenAI SDK base_url of this episode's (recorded) session
    anthropic_base_url: str  # Anthropic SDK base_url of the same session
    side_base_url: str  # OpenAI base_url that records nothing (judges, reference calls)
    side_anthropic_base_url: str
    api_key: str
    model: str
    task: Task
    episode_id: str
    group_id: str
    clients: Any = field(default=None, repr=False)  # the runner's shared SDK clients (see openai())
    # the policy's budget per reply (the loop's SamplingConfig.max_tokens): what a recorded request
    # without max_tokens gets. An agent that sends its own decides its budget itself (a recipe's
    # max_tokens parameter did nothing for agents that hard-coded one); Anthropic's SDK needs one
    max_tokens: int | None = None

    def openai(self, side: bool = False):
        """A stock `openai.AsyncOpenAI` for this episode (side=True: the non-recording route).
        It shares the runner's connection pool: building a fresh SDK client costs ~25 ms of CPU
        (TLS set-up, even for http), which adds up over thousands of episodes. Do not close it."""
        import openai

        url = self.side_base_url if side else self.base_url
        if self.clients is None:
            return openai.AsyncOpenAI(base_url=url, api_key=self.api_key, max_retries=0)
        return self.clients.openai.with_options(base_url=url)

    def anthropic(self, side: bool = False):
        """A stock `anthropic.AsyncAnthropic` for this episode; same sharing as openai()."""
        import anthropic

        url = self.side_anthropic_base_url if side else self.anthropic_base_url
        if self.clients is None:
            return anthropic.AsyncAnthropic(base_url=url, api_key=self.api_key, max_retries=0)
        return self.clients.anthropic.with_options(base_url=url)

    @property
    def messages(self) -> list[dict]:
        # deep: a message's content may be a list of parts, which one agent changing changed
        # for every sibling of its group (another prompt under one baseline)
        return copy.deepcopy(self.task.messages)

    @property
    def tools(self) -> list[dict] | None:
        # this episode's own copy, made once: a group's episodes share one Task, and one agent
        # appending to the list gave its siblings other tools (another prompt under one baseline)
        if "_tools" not in self.__dict__:
            self.__dict__["_tools"] = copy.deepcopy(self.task.tools)
        return self.__dict__["_tools"]

    @property
    def label(self) -> Any:
        # this episode's own copy, as tools: an agent popping a test from a structured label changed
        # its siblings' reward rule, and the label recorded with every episode of the group
        if "_label" not in self.__dict__:
            self.__dict__["_label"] = copy.deepcopy(self.task.label)
        return self.__dict__["_label"]


class ChatAgent:
    """Subclass and implement `run`; return a reward (float) or (reward, info)."""

    async def run(self, ctx: AgentContext) -> float | tuple[float, dict]:
        raise NotImplementedError


class Env:
    """Subclass and implement `reset` and `step`, async or plain (a plain one runs on the
    runner's event loop: keep it quick; one that blocks it over a second is reported, see
    rollout/loop_watch.py). `max_turns` bounds the framework's loop (the episode is
    truncated there); `tools` (OpenAI function specs) are shown to the model (None: the task's;
    [] shows none)."""

    max_turns: int = 8
    tools: list[dict] | None = None

    async def reset(self, task: Task) -> tuple[list[dict], dict]:
        """Return the opening messages (usually task.messages) and an info dict."""
        return copy.deepcopy(task.messages), {}

    async def step(self, message: dict) -> tuple[list[dict], float, bool, bool, dict]:
        """Take the assistant's message (role, content, tool_calls); return the new messages it
        causes (e.g. tool results or a user follow-up), reward, terminated, truncated, info."""
        raise NotImplementedError


class AgentLoadError(ValueError):
    pass


@dataclass
class AgentSpec:
    """A loaded agent file: its AgentRunner class, its kind, and its own tasks() if any."""

    path: str
    runner: type
    kind: str  # "env" | "chat"
    tasks: Any = None

    def make(self):
        return self.runner()


_loading = threading.RLock()  # (re-entrant: an agent file may load another agent file, load_agent("base.py"))


def load_agent(path: str | Path) -> AgentSpec:
    """Import the user's file and find `AgentRunner` (a subclass of Env or ChatAgent)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise AgentLoadError(f"agent file {str(path)!r} does not exist")
    if path.suffix != ".py":
        raise AgentLoadError(f"agent file {str(path)!r} is not a .py file")
    # named by the path's digest, the same in every process: cloudpickle pickles the file's classes
    # by module name, and hash(str) is salted per process, so an object of the agent's own class
    # (an Enum in info) pickled on a runner could not be unpickled on the driver
    # (a dot in the stem, "agent.v2.py", read as a package path: its classes could not be pickled)
    stem = re.sub(r"\W", "_", path.stem)
    name = f"workbench_agent_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:16]}"
    # the file's module once per content in a process: connect() loads it for its tasks() and the
    # rollout again, and a second run replaced the first's classes, so a task label of the file's own
    # class (an Enum, a dataclass) pickled from the first copy reached the runners as a class of no
    # module there: every isinstance and == False, every reward 0, silently. An edited file loads anew
    digest = hashlib.sha1(path.read_bytes()).hexdigest()
    with _loading:  # (one load at a time: another thread saw a module still running its file)
        module = sys.modules.get(name)
        if module is None or getattr(module, "__workbench_source__", None) != digest:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses and pickling need the module registered
            try:
                spec.loader.exec_module(module)
            except BaseException as e:  # (an interrupt or SystemExit too: a half-run module was kept)
                sys.modules.pop(name, None)  # (a failed load is not kept: the next call runs the file again)
                if not isinstance(e, Exception):
                    raise
                raise AgentLoadError(f"importing agent file {str(path)!r} failed: {type(e).__name__}: {e}") from e
            module.__workbench_source__ = digest  # (marked once whole)
    runner = getattr(module, "AgentRunner", None)
    if runner is None:
        raise AgentLoadError(f"agent file {str(path)!r} defines no AgentRunner")
    if not inspect.isclass(runner) or not issubclass(runner, (Env, ChatAgent)):
        raise AgentLoadError(
            f"AgentRunner in {str(path)!r} must be a class deriving from workbench.agents.Env or "
            f"workbench.agents.ChatAgent, got {runner!r}"
        )
    kind = "env" if issubclass(runner, Env) else "chat"
    # (against the base classes' own: they define them, so a check for the name always passed and
    # an agent with a typo, `step` for `run`, failed every episode with NotImplementedError)
    if kind == "chat" and runner.run is ChatAgent.run:
        raise AgentLoadError(f"AgentRunner in {str(path)!r} has no run(ctx) method of its own")
    if kind == "env" and runner.step is Env.step:
        raise AgentLoadError(f"AgentRunner in {str(path)!r} (an Env) has no step(message) method of its own")
    return AgentSpec(str(path), runner, kind, getattr(module, "tasks", None))


# Advantages are float32: a group holding a reward of 1e39 made an inf advantage (dr_grpo, rloo),
# two of 1e308 a NaN (grpo), one of 1e155 silently all-zero advantages (grpo's variance overflows)
MAX_ABS_REWARD = 1e6


def reward_value(reward, what: str = "the episode's reward") -> float:
    """A reward as a float, or a clear error: a real number (numpy's too, as Gymnasium's
    SupportsFloat: a reward model's float32 scores failed every episode; not a bool, numpy's
    included, nor a string), finite, within +-MAX_ABS_REWARD."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(f"{what} must be a number (int or float), got {reward!r} ({type(reward).__name__})")
    try:
        value = float(reward)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{what} is an integer of {len(str(abs(reward)))} digits: past a float's range") from None
    if not math.isfinite(value):  # one NaN advantage makes the loss, so every weight, NaN at the next update
        raise ValueError(f"{what} is {value}: a reward must be a finite number")
    if abs(value) > MAX_ABS_REWARD:
        raise ValueError(f"{what} is {value:g}: beyond +-{MAX_ABS_REWARD:g} (agents.MAX_ABS_REWARD) the group's "
                         f"float32 advantages overflow; scale the reward down")
    return value


def as_reward(result) -> tuple[float, dict]:
    """A ChatAgent's return value as (reward, info), with a clear error for anything else."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        reward, info = result
    else:
        reward, info = result, {}
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(f"an agent must return a reward (a number) or (reward, info), got {result!r}")
    return reward_value(reward), info
