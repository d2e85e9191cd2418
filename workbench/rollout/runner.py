"""Rollout on Ray: runner actors host a loopback server and run many agent episodes
concurrently; `Rollout` is the driver-side handle over them.

    engines (EngineHost actors) <- EngineRouter <- LoopbackServer <- agents   (one runner actor)
    Rollout.run_groups(tasks, G) -> runner.run_group(task, G) -> G Trajectories per task

An agent that raises, hangs or outlives `episode_timeout_s` fails only its own episode: the
trajectory keeps what was recorded and carries the error. An episode whose conversation outgrew
the context (`max_model_len`), or that ended on a reply cut by the policy's `max_tokens`, is not
an error: it keeps what was recorded and is marked `Trajectory.truncated` (the framework-owned
Env loop ends at a turn with no room left).
A dead engine's requests go to a live engine; when none is left, episodes fail with a clear
error and the run goes on. `sampling` is the policy's: the loopback server samples every
recorded turn with its temperature/top_p, whatever an agent sends (`sampling_mode`, see
loopback/server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import gc
import inspect
import json
import threading
import time
import traceback
import uuid

import ray

from ..agents import AgentContext, Task, as_reward, load_agent, reward_value
from ..tokens import Trajectory
from .engine import SamplingConfig
from .loop_watch import LoopWatch


class RolloutRunner:
    """Ray actor body (also usable in-process, e.g. in tests)."""

    def __init__(self, agent_path: str, engines: list, model_path: str, sampling: SamplingConfig | None = None,
                 episode_timeout_s: float = 300.0, max_concurrent_episodes: int = 256,
                 return_routed_experts: bool = False, request_timeout_s: float = 600.0,
                 sampling_mode: str = "override", max_model_len: int | None = None, tool_parser: str | None = None,
                 profile=None, max_request_bytes: int | None = None, side_engine=None):
        """`profile`: the checkpoint's ModelProfile (None: read off `model_path`); it sets the
        server's template kwargs, end of turn, parser and context, and adds the family's stop
        tokens to the policy sampling. `max_model_len` / `tool_parser` override it. `side_engine`:
        the engine that serves the non-recording side route (a judge; None: the policy's engines)."""
        import dataclasses

        from ..loopback.server import LoopbackServer
        from ..profiles import profile_for
        from ..toy.models import load_tokenizer
        from .router import EngineRouter

        self.spec = load_agent(agent_path)
        if self.spec.kind == "chat":  # the SDKs its episodes' clients come from (_shared_clients), imported
            # here: imported on the first episode (~1.5 s, more on a loaded machine) it ran inside the
            # episodes' timeout, and on CI 16 sync agents under a 3.5 s timeout all timed out
            import anthropic  # noqa: F401
            import openai  # noqa: F401
        self.profile = profile or profile_for(model_path)
        if self.profile.chat_format == "tekken":  # mistral-common's (TekkenFormat renders with it): transformers'
            from ..tekken import load_tokenizer as tekken_tokenizer  # failed every Tekken checkpoint's runner

            tokenizer = tekken_tokenizer(model_path)
        else:
            tokenizer = load_tokenizer(model_path)
        sampling = sampling or SamplingConfig(max_tokens=128)
        if not sampling.ignore_eos:  # the family's turn-ending tokens stop a turn (unless told to run on)
            stops = sorted(set(sampling.stop_token_ids) | set(self.profile.stop_token_ids(tokenizer)))
            sampling = dataclasses.replace(sampling, stop_token_ids=stops)
        self.sampling = sampling
        self.episode_timeout_s = episode_timeout_s
        self.router = EngineRouter(engines, request_timeout_s)
        self.server = LoopbackServer(self.router, tokenizer, max_model_len=max_model_len,
                                     tool_parser=tool_parser, return_routed_experts=return_routed_experts,
                                     policy_sampling=self.sampling, sampling_mode=sampling_mode, profile=self.profile,
                                     max_request_bytes=max_request_bytes,
                                     # a judge behind a router of its own: its calls get request_timeout_s, and one
                                     # nobody waits for any more is cancelled in the engine (ray.cancel), as the
                                     # policy's are (awaited on its actor handle, they sampled on to max_tokens)
                                     side_engine=EngineRouter([side_engine], request_timeout_s) if side_engine else None).start()
        self._slots = max_concurrent_episodes
        self._sem = None
        self._clients = None
        self._sync_pool = None
        self._loop_watch = None  # LoopWatch: agent code blocking the episodes' event loop, reported
        self._orphans: set = set()  # timed-out episodes still running (cancelled; held: the loop keeps weak references)
        # synchronous agents' runs still going in their threads after their episodes ended (timed out: a
        # thread cannot be cancelled; the episode's task ended at once, so _orphans never held them)
        self._sync_orphans: set = set()
        self._sync_busy, self._sync_lock = 0, threading.Lock()  # sync agents' threads running an agent
        self._calls: dict[str, dict] = {}  # run_groups calls running: their groups finished so far (finished_groups)
        # What is alive now (torch, Ray, the SDKs, the tokenizer: ~300,000 objects) lives as long as the
        # runner: out of the collector's walk. A full collection walked it all while every in-flight
        # request waited (60-117 ms each, a few per bench run: the loopback's occasional p99 of
        # 117-147 ms); frozen, the serving phase's full collections took 5-33 ms (bench/loopback.py)
        gc.collect()  # what is garbage already is not frozen with the rest
        gc.freeze()

    def ready(self) -> dict:
        import os

        return {"agent": self.spec.path, "kind": self.spec.kind, "server": self.server.url, "pid": os.getpid()}

    def stats(self) -> dict:
        # orphaned_episodes: timed out, cancelled, still running (an agent that ignores its cancellation)
        # loop_stalls: times agent code blocked the episodes' event loop over STALL_WARN_S, and where
        stalls = self._loop_watch.stats() if self._loop_watch is not None else {"count": 0, "longest_s": 0.0, "where": {}}
        return {"router": self.router.state(), "server": self.server.summary(),
                "orphaned_episodes": len(self._orphans) + len(self._sync_orphans),
                "loop_stalls": stalls}

    async def run_group(self, task: Task, n: int, group_id: str | None = None) -> list[Trajectory]:
        """n episodes of one task (a group, for group-relative advantages), concurrently."""
        group_id = group_id or uuid.uuid4().hex[:12]
        return list(await asyncio.gather(*[self.run_episode(task, group_id) for _ in range(n)]))

    async def run_groups(self, tasks: list[Task], n: int, call_id: str | None = None) -> list[list[Trajectory]]:
        """run_group for each task, in one call (Rollout.submit_groups: a Ray call per group cost
        the driver and this runner CPU, and their first turns reached the router in separate
        passes, so separate engine calls). A group that raises fails alone, as its own call did.
        `call_id`: the groups finished so far are kept under it while the call runs (a caller that
        stops waiting takes them with finished_groups: the call's returns come all at its end)."""
        finished = self._calls.setdefault(call_id, {}) if call_id is not None else {}

        async def one(i: int, task: Task):
            try:
                finished[i] = await self.run_group(task, n)
            except Exception as e:
                finished[i] = _failed_group(task, n, f"the group failed in its runner: {e!r}"[:400], runner_lost=False)
            return finished[i]

        try:
            got = await asyncio.gather(*[one(i, t) for i, t in enumerate(tasks)], return_exceptions=True)
        finally:
            self._calls.pop(call_id, None)
        return [_failed_group(t, n, f"the group failed in its runner: {g!r}"[:400], runner_lost=False)
                if isinstance(g, BaseException) else g for t, g in zip(tasks, got)]

    def finished_groups(self, call_id: str) -> dict[int, list[Trajectory]]:
        """The groups of a running run_groups call that have finished, by their place in it."""
        return dict(self._calls.get(call_id, {}))

    async def run_episode(self, task: Task, group_id: str = "") -> Trajectory:
        loop = asyncio.get_running_loop()
        if self._loop_watch is None or self._loop_watch.loop is not loop:  # (in-process use: a loop per asyncio.run)
            if self._loop_watch is not None:
                self._loop_watch.stop()
            self._loop_watch = LoopWatch(loop, self.spec.path)
            self._sem = asyncio.Semaphore(self._slots)  # (one that waited is bound to its loop)
        # each episode its own copy of the task: a group's episodes shared one, and an Env whose reset
        # popped a test from task.label (or an agent changing ctx.task.info) changed its siblings'
        # reward rule (identical replies, different rewards: advantages for nothing) and the label recorded
        own = copy.deepcopy(task)
        async with self._sem:
            started = loop.time()
            episode_id = uuid.uuid4().hex[:16]
            sid = self.server.open_session(episode_id)
            reward, info, error, cut = 0.0, {}, None, False
            # what an Env episode earned so far: a failed one keeps it (LoopConfig.on_failed="keep" means
            # the reward it got; a chat agent's crash returned none, so its reward is 0)
            partial = {"reward": 0.0, "info": {}}
            episode = asyncio.ensure_future(_exit_is_failure(
                self._env_episode(own, sid, partial) if self.spec.kind == "env" else self._chat_episode(own, sid, group_id)))
            try:
                # asyncio.wait, not wait_for: wait_for waits out an agent that swallows its cancellation
                # (its retry loop: recorded as a success 5 s past a 0.5 s timeout), and read the agent's
                # own TimeoutError (a tool's, a socket's) as the episode's
                done, _ = await asyncio.wait({episode}, timeout=self.episode_timeout_s)
                if episode in done:
                    reward, info, cut = episode.result()
                    partial["reward"] = reward  # (an info that cannot be recorded fails the episode, not its reward)
                    info = _agent_info(info)
                else:
                    error = f"episode timed out after {self.episode_timeout_s:g} s"
                    episode.cancel()  # not awaited: an agent that ignores it runs on, its session closed below
                    self._orphans.add(episode)
                    episode.add_done_callback(self._forget)
            except asyncio.CancelledError as e:
                # the agent's own cancellation (it cancelled a sub-task and awaited it): its episode
                # fails, not the group with its siblings' finished episodes; this task being
                # cancelled (the runner shutting down) goes on up
                task_ = asyncio.current_task()
                if task_ is not None and task_.cancelling():
                    episode.cancel()
                    await self.server.close_session_async(sid, wait=False)
                    raise
                error = f"CancelledError: the agent's episode was cancelled ({e})"
            except Exception as e:  # (_exit_is_failure made every other BaseException of the agent's one)
                # (format_exception_only: an exception whose __str__ raises escaped the f-string here,
                # losing the whole group)
                error = f"{''.join(traceback.format_exception_only(type(e), e)).strip()}\n{''.join(traceback.format_exc(limit=-3))}"
            if error is not None:
                reward, info = partial["reward"], dict(partial["info"])
                try:
                    info = _agent_info(info)
                except (TypeError, ValueError):
                    info = {}  # (its error says why)
            # a failed episode's in-flight request is not waited for (it waited up to the request
            # timeout, 600 s, past the episode's): only a finished episode's turns all count, and
            # those within the episode's time (a turn its agent gave up on held the group's slot
            # up to the request timeout, its reply thrown away)
            wait = False if error is not None else True if self.episode_timeout_s is None else \
                max(0.0, self.episode_timeout_s - (loop.time() - started))
            segments, state = await self.server.close_session_async(sid, wait=wait, details=True)
            # the task's label beside its id: the record alone can score the episode again
            task_info = {"task_id": task.id, **({"task_label": task.label} if task.label is not None else {})}
            return Trajectory(segments, reward, group_id, episode_id, {**info, **task_info}, error,
                              truncated=state["truncated"] or cut)

    def _forget(self, episode: asyncio.Task) -> None:
        """A timed-out episode that ended at last: let go of it (its error, if any, read: unread, asyncio logs it)."""
        self._orphans.discard(episode)
        if not episode.cancelled():
            episode.exception()

    def _sync_agents(self):
        """The thread pool synchronous agents run in (made on first use): a thread per episode slot,
        and SYNC_AGENT_SPARE_THREADS more, since an agent stuck past its episode's timeout keeps its
        thread while its slot goes to the next episode (Python cannot stop a thread)."""
        if self._sync_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._sync_pool = ThreadPoolExecutor(self._slots + SYNC_AGENT_SPARE_THREADS, thread_name_prefix="sync-agent")
        return self._sync_pool

    def _sync_done(self, _work) -> None:
        """A sync agent's call ended (or was cancelled before it ran): its thread is free again."""
        with self._sync_lock:
            self._sync_busy -= 1

    def _shared_clients(self):
        """One OpenAI and one Anthropic SDK client per runner (made on its event loop); agents get
        per-episode copies through ctx.openai() / ctx.anthropic() that share their connection pool.
        Made again on another event loop (in-process use, asyncio.run per call: the first loop's
        clients held sessions of a closed loop, and every later episode failed on them)."""
        loop = asyncio.get_running_loop()
        if self._clients is not None and self._clients.loop is not loop:
            self._clients = None  # (their sessions went with their loop; nothing left to close on this one)
        if self._clients is None:
            import types

            import anthropic
            import openai

            # Each SDK's own aiohttp transport (DefaultAioHttpClient; aiohttp is a dependency),
            # not its default httpx one: the agents' SDK calls share this process with the server,
            # and per request httpx took 3.9 ms of client CPU, aiohttp 1.1 ms (the same SDK call
            # and reply against an instant engine, 32 at a time; bench/loopback.py). The SDKs,
            # their types and their errors are the stock ones either way.
            s = self.server
            self._clients = types.SimpleNamespace(
                loop=loop,
                openai=openai.AsyncOpenAI(base_url=s.base_url(None), api_key=s.api_key, max_retries=0,
                                          http_client=openai.DefaultAioHttpClient()),
                anthropic=anthropic.AsyncAnthropic(base_url=s.base_url(None, "anthropic"), api_key=s.api_key, max_retries=0,
                                                   http_client=anthropic.DefaultAioHttpClient()))
        return self._clients

    async def _chat_episode(self, task: Task, sid: str, group_id: str):
        s = self.server
        ctx = AgentContext(base_url=s.base_url(sid), anthropic_base_url=s.base_url(sid, "anthropic"),
                           side_base_url=s.base_url(None), side_anthropic_base_url=s.base_url(None, "anthropic"),
                           api_key=s.api_key, model=s.model_name, task=task, episode_id=sid, group_id=group_id,
                           clients=self._shared_clients(), max_tokens=self.sampling.max_tokens)
        agent = self.spec.make()
        if inspect.iscoroutinefunction(agent.run):
            result = await agent.run(ctx)
        else:  # a synchronous agent (stock sync SDK client) runs in a thread, not on this loop
            # its own pool, one thread per episode slot: the loop's default executor has cpu + 4
            # threads, so on 2 cores the 7th concurrent sync episode waited for a thread (its timeout
            # running) and a few stuck agents starved every later episode. In the caller's context
            # (contextvars: tracing, logging), as asyncio.to_thread runs it
            pool = self._sync_agents()
            with self._sync_lock:
                if self._sync_busy >= pool._max_workers:
                    # every thread is held by an agent still running past its episode: this one would wait
                    # for a thread and time out, saying only "timed out" (every later episode too)
                    raise RuntimeError(f"all {pool._max_workers} threads for synchronous agents are held by agents still "
                                       f"running past their episodes' timeouts; this episode cannot start (fix the agent "
                                       f"that hangs, or make it async)")
                self._sync_busy += 1
            # counted free by the future's callback: it runs whether the call ran or was cancelled while
            # queued (a count decremented by the call itself leaked then)
            work = pool.submit(contextvars.copy_context().run, agent.run, ctx)
            work.add_done_callback(self._sync_done)
            try:
                result = await asyncio.wrap_future(work)
            except asyncio.CancelledError:  # the episode timed out: its thread runs on, counted until it ends
                if not work.done():
                    self._sync_orphans.add(work)
                    work.add_done_callback(self._sync_orphans.discard)
                raise
            result = await _resolved(result)
        return (*as_reward(result), False)

    async def _env_episode(self, task: Task, sid: str, partial: dict | None = None):
        """The framework-owned loop: render -> sample -> env.step, through the server's accumulator.
        (reward, info, truncated): truncated when the Env's step said so (and not terminated) or
        max_turns ran out first, so that LoopConfig.on_truncated applies to it as to an episode
        cut by the context (it trained on a partial reward as if finished). `partial` follows the
        reward and info so far, for an episode that fails part-way."""
        from ..loopback.openai_api import check_tools
        from ..loopback.protocol import RequestError

        env = self.spec.make()
        name = type(env).__name__
        observation, info = _reset_pair(await _resolved(env.reset(task)), f"{type(env).__name__}.reset")
        # read once, after reset (an Env may set a task's turn budget there: read before, 0 ran no turn, silently)
        max_turns = env.max_turns
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            # (0 ran no turn, every episode reward 0 with no tokens, silently; None failed each one on an addition)
            raise TypeError(f"{name}.max_turns must be an integer >= 1 (the turns an episode may take), got {max_turns!r}")
        if max_turns == 1:  # its group's first turns may go as one engine call (EngineRouter._call)
            self.router.single_turn.add(sid)
        _check_env_messages(observation, f"{type(env).__name__}.reset")
        # its own copy: an Env whose reset returns task.info itself had every episode of the group
        # (one Task, run concurrently) update one dict, each sibling's step info in the others'
        info = dict(info or {})
        partial = {} if partial is None else partial
        partial["info"] = info
        messages = [dict(m) for m in observation]
        tools = task.tools if env.tools is None else env.tools  # (an Env's [] hides the task's tools)
        try:
            check_tools(tools)  # as a request's are (HTTP: a 400)
        except RequestError as e:
            raise TypeError(f"{name}'s tools (Env.tools, else the task's): {e.message}") from None
        total, turns, cut = 0.0, 0, False
        for turns in range(1, max_turns + 1):
            reply = await self.server.turn(sid, messages, tools, self.sampling)
            if reply.truncated and not reply.token_ids:  # no room left in the context: the episode ends here
                turns -= 1  # (this turn sampled nothing: info["turns"] counted it)
                break
            message = reply.assistant_message()
            messages.append(message)
            # a copy: the Env editing the message it is given (its content stripped) changed the history's,
            # so the next request differed from the reply recorded: a seal (assistant_changed) every turn
            step = await _resolved(env.step(copy.deepcopy(message)))
            if not (isinstance(step, tuple) and len(step) == 5) or not all(
                    type(flag).__name__ in ("bool", "bool_") for flag in step[2:4]):
                # (an old Gym 4-tuple failed on unpacking, unnamed; terminated="False" ended the episode)
                raise TypeError(f"{name}.step must return (observation, reward, terminated, truncated, info), as "
                                f"Gymnasium's step, the two flags bools; got {step!r:.120}")
            observation, reward, terminated, truncated, step_info = step
            total += reward_value(reward, f"the reward {type(env).__name__}.step returned at turn {turns}")
            # the running total is checked before a failed episode may keep it (on_failed="keep" kept a
            # total the final check refused as too large)
            partial["reward"] = reward_value(total, f"{type(env).__name__}'s total reward at turn {turns}")
            info.update(step_info or {})
            if terminated or truncated:
                cut = bool(truncated) and not terminated
                break
            _check_env_messages(observation, f"{type(env).__name__}.step at turn {turns}")
            messages += [dict(m) for m in observation]
        else:  # max_turns ran out before the Env ended the episode
            cut = True
        if "turns" in info:
            raise ValueError(f"{name}'s info uses the reserved key 'turns' (set by workbench: the episode's turns); "
                             f"name it otherwise")
        return (*as_reward((total, {**info, "turns": turns})), cut)  # a non-finite total fails the episode

    async def shutdown(self) -> None:
        if self._loop_watch is not None:
            self._loop_watch.stop()
        for episode in list(self._orphans):  # timed-out episodes still running: cancelled again, not awaited
            episode.cancel()
        if self._clients is not None:  # their connection pools (aiohttp sessions), on the loop they live on
            if self._clients.loop is asyncio.get_running_loop():  # (another loop's went with it)
                await self._clients.openai.close()
                await self._clients.anthropic.close()
            self._clients = None
        if self._sync_pool is not None:  # (a stuck sync agent's thread is left to die with the process)
            self._sync_pool.shutdown(wait=False, cancel_futures=True)
        self.server.stop()


async def _resolved(value):
    """`value`, awaited where it is awaitable: a Gymnasium-style Env's synchronous reset / step (it
    failed every episode: "object tuple can't be used in 'await' expression"), or a coroutine a
    wrapped run() returned from its thread (it was the reward)."""
    return await value if inspect.isawaitable(value) else value


async def _exit_is_failure(episode):
    """The episode, with a SystemExit its agent raised (sys.exit()) or any other BaseException
    but a cancellation or a close (KeyboardInterrupt, pytest.fail's) turned into an ordinary
    error inside its own task: out of its task one stopped the runner's event loop (Python 3.11),
    and with it every episode in flight, or failed the whole group, its siblings' episodes lost."""
    try:
        return await episode
    except SystemExit as e:
        raise RuntimeError(f"the agent called sys.exit({e.code!r})") from None
    except (Exception, asyncio.CancelledError, GeneratorExit):  # (GeneratorExit: the coroutine closed at the loop's end)
        raise
    except BaseException as e:
        raise RuntimeError(f"the agent raised {''.join(traceback.format_exception_only(type(e), e)).strip()}") from None


# keys of an episode's info the framework writes: an agent's "eval" made its training episode an
# evaluation one, which batch_from_groups refuses (the whole step failed); its "task_id" / "task_label"
# were replaced by the task's, silently (an Env's "turns" too: _env_episode)
RESERVED_INFO = ("eval", "eval_greedy", "task_id", "task_label")


def _agent_info(info: dict) -> dict:
    """The agent's info, checked where the episode can still fail alone: it is written to the
    step's parquet file (json, str() for what JSON cannot hold) and sent from the runner by Ray
    (pickled). A tuple key or a lock in it failed the step's record or the whole group."""
    import pickle

    for key in RESERVED_INFO:
        if key in info:
            raise ValueError(f"the agent's info uses the reserved key {key!r} (set by workbench); name it otherwise")
    try:
        json.dumps(info, default=str)
        # loaded too: an exception that pickles but cannot be rebuilt (openai's APIStatusError: keyword-only
        # arguments) failed the group's return in the driver, and the run with it
        pickle.loads(pickle.dumps(info))
    except Exception as e:
        raise TypeError(f"the agent's info cannot be recorded ({type(e).__name__}: {e}); keep it to JSON values "
                        f"with string keys") from None
    return info


def _reset_pair(reset, where: str) -> tuple:
    """An Env's reset result as (messages, info), as Gymnasium's (observation, info). The messages
    alone were unpacked: two of them as the pair (the error then said a dict was no list of
    messages), one or three a bare unpacking error."""
    if not (isinstance(reset, tuple) and len(reset) == 2):
        raise TypeError(f"{where} must return (messages, info), as Gymnasium's reset returns (observation, info); "
                        f"got {type(reset).__name__}" + (f" of {len(reset)}" if isinstance(reset, (list, tuple)) else ""))
    return reset


def _check_env_messages(messages, where: str) -> None:
    """An Env's observation: chat messages whose content is text (a string, or OpenAI text parts),
    as the loopback's routes require of an agent's. Anything else (a dict a template might
    tojson, image parts) rendered as "" for the template, so the policy was prompted and
    trained on an empty tool result, silently: the episode fails naming it instead."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"{where} must return a list of chat messages, got {type(messages).__name__}")
    from ..loopback.openai_api import ROLES

    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"{where}: message {i} must be a dict with a 'role', got {m!r:.80}")
        if m["role"] not in ROLES - {"developer"}:  # (as a request's: a template drops a role it does not know, and an
            # observation in "function" or "observation" left the prompt silently, its reply trained as if seen)
            raise TypeError(f"{where}: message {i} has role {m['role']!r}; an Env's messages take "
                            f"{sorted(ROLES - {'developer'})} (a tool's result: 'tool')")
        c = m.get("content")
        if not (c is None or isinstance(c, str) or (isinstance(c, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c))):
            raise TypeError(f"{where}: message {i} ({m['role']}) has content {c!r:.80} ({type(c).__name__}): content "
                            f"must be a string or a list of text parts (json.dumps a structured result)")


FINISHED_ASK_S = 10.0  # a stopped rollout's wait for a runner to say which groups of a shared call finished
SYNC_AGENT_SPARE_THREADS = 64  # threads for synchronous agents stuck past their episode (RolloutRunner._sync_agents)


class RunnersLost(RuntimeError):
    """Every rollout runner actor of a Rollout is dead."""


class RolloutStopped(Exception):
    """run_groups' `stop` was set while it waited: `groups`, those finished by then (the others
    are left to finish on their runners, abandon_groups)."""

    def __init__(self, groups: list):
        super().__init__(f"the rollout was stopped with {len(groups)} group(s) finished")
        self.groups = groups


class Rollout:
    """Driver-side handle: `num_runners` runner actors over the given engine actors.

    A runner that dies (its process killed, out of memory, ...) fails the groups it was running:
    each of their episodes comes back as a failed Trajectory (no segments, `error` naming the
    runner and the cause), which the loop counts and drops (LoopConfig.on_failed). They are not
    re-run on another runner: a task that kills its runner would kill every runner in turn, and
    nothing of those episodes was recorded (their segments lived in the dead process). Groups not
    yet started go to the live runners; with none left, run_groups raises RunnersLost."""

    def __init__(self, agent_path: str, engines: list, model_path: str, num_runners: int = 1, **runner_kwargs):
        from ..loopback.protocol import check_sampling_mode

        load_agent(agent_path)  # fail here, in the caller's process, with a clear error
        # the policy's sampling, as the runners use it (the loop checks it against the trainer's)
        self.sampling = runner_kwargs.setdefault("sampling", None) or SamplingConfig(max_tokens=128)
        runner_kwargs["sampling"] = self.sampling
        self.sampling_mode = check_sampling_mode(runner_kwargs.setdefault("sampling_mode", "override"))
        self.engines = list(engines)
        # episodes in flight per runner: at most its episode slots (it runs no more at once); the
        # rest wait here, so that they go to whichever runner is alive and free
        self._slots = runner_kwargs.get("max_concurrent_episodes", 256)
        actor = ray.remote(RolloutRunner).options(num_cpus=0, max_concurrency=1000)
        self.runners = [actor.remote(str(agent_path), self.engines, str(model_path), **runner_kwargs)
                        for _ in range(num_runners)]
        self.info = ray.get([r.ready.remote() for r in self.runners])
        self._names = {id(r): f"rollout runner {i} (pid {info['pid']})" for i, (r, info) in enumerate(zip(self.runners, self.info))}
        self.lost: list[str] = []  # the runners that died, and why
        # episodes in flight per runner over every caller (the loop's rollout thread, evaluation,
        # wb.rollout): one shared count, so each group goes to the least loaded runner of all
        self.outstanding = {id(r): 0 for r in self.runners}
        self._lock = threading.Lock()
        # groups a caller stopped waiting for (run_groups interrupted): their runners still run them,
        # so their slots are given back when they finish (_release_abandoned), not before, not never
        self._abandoned: dict = {}  # ref -> (runner, group size)
        # the groups sent in one runner call (submit_groups): ref -> (the call's id, the group's place in it)
        self._shared: dict = {}

    def _lose(self, runner, error: BaseException) -> str:
        import sys

        name, cause = self._names[id(runner)], " ".join(str(error).split())[:300]
        if runner in self.runners:
            self.runners.remove(runner)
            # killed too: ActorUnavailableError may be transient (a network blip between nodes), and a
            # runner dropped from the list is out of shutdown()'s reach (its process, its agents and
            # their sandboxes lived on)
            with contextlib.suppress(Exception):
                ray.kill(runner)
            self.lost.append(f"{name} died: {cause}")
            print(f"workbench: {name} died ({len(self.runners)} runner(s) left): {cause}", file=sys.stderr)
        return f"{name} died while running this episode: {cause}"

    def submit_group(self, task: Task, group_size: int):
        """Start one group on the runner with the fewest outstanding episodes (over every caller)
        that has room for it: (ref, runner), or None while every runner is full. finish_group
        collects it."""
        started = self.submit_groups([task], group_size)
        return started[0] if started else None

    def submit_groups(self, tasks: list[Task], group_size: int) -> list[tuple]:
        """Start the leading groups of `tasks` that fit, each placed as submit_group places one.
        Where all of them fit, the groups placed on one runner go as one call (RolloutRunner.
        run_groups) with a return per group. Why: a Ray call per group cost CPU in this process,
        the runner and the engine (its first turns came in separate calls): the quickstart's 16
        groups as 16 calls 0.168 s of CPU a rollout, as one 0.129 s (2026-12-07). Not where some
        must wait for room: a call's groups come back together, so each would hold its slots until
        the call's slowest group finished, and the waiting ones start later. Returns (ref, runner)
        per group started, in order: fewer than `tasks` while every runner is full."""
        placed = []
        with self._lock:
            if not self.runners:
                raise RunnersLost(f"no rollout runner left: {'; '.join(self.lost) or 'all were shut down'}")
            self._release_abandoned()
            room = max(self._slots, group_size)  # a group larger than the slots runs alone
            for _ in tasks:
                free = [r for r in self.runners if self.outstanding[id(r)] + group_size <= room]
                if not free:
                    break
                runner = min(free, key=lambda r: self.outstanding[id(r)])
                self.outstanding[id(runner)] += group_size
                placed.append(runner)
        refs, by_runner = [None] * len(placed), {}
        for i, runner in enumerate(placed):
            by_runner.setdefault(id(runner) if len(placed) == len(tasks) else i, (runner, []))[1].append(i)
        try:
            for runner, at in by_runner.values():
                if len(at) == 1:
                    refs[at[0]] = runner.run_group.remote(tasks[at[0]], group_size)
                else:
                    call_id = uuid.uuid4().hex  # (one a runner call: finished_groups asks each runner for its own)
                    calls = runner.run_groups.options(num_returns=len(at)).remote([tasks[i] for i in at], group_size, call_id)
                    for k, (i, ref) in enumerate(zip(at, calls)):
                        refs[i] = ref
                        self._shared[ref] = (call_id, k)
        except BaseException:  # (a task Ray cannot serialize, Ctrl-C): the groups not sent give their slots
            # back, those sent are left to finish and give theirs then; kept, the counts leaked, and once
            # they reached the slots every later rollout waited for ever
            with self._lock:
                for ref, runner in zip(refs, placed):
                    if ref is None:
                        self.outstanding[id(runner)] -= group_size
            self.abandon_groups([(ref, runner) for ref, runner in zip(refs, placed) if ref is not None], group_size)
            raise
        return list(zip(refs, placed))

    def _finished_in_calls(self, inflight: dict) -> list[tuple[int, list[Trajectory]]]:
        """(task index, group) of the groups in flight that finished inside a runner call still
        running (submit_groups' shared calls: their returns come all at the call's end, so a stop
        found none of them ready, and the finished ones went unrecorded), asked of their runners.
        Their refs stay in flight (abandoned: the call's slots come back when it ends)."""
        calls: dict = {}
        for ref, (i, runner) in inflight.items():
            if ref in self._shared:
                call_id, k = self._shared[ref]
                calls.setdefault(call_id, (runner, {}))[1][k] = i
        asked = {call_id: runner.finished_groups.remote(call_id) for call_id, (runner, _) in calls.items()}
        got = []
        for call_id, ref in asked.items():
            try:  # (a runner that does not answer: its groups are left as before)
                finished = ray.get(ref, timeout=FINISHED_ASK_S)
            except Exception:
                continue
            got += [(calls[call_id][1][k], group) for k, group in finished.items() if k in calls[call_id][1]]
        return got

    def _release_abandoned(self) -> None:
        """(Under the lock.) Give back the slots of abandoned groups that have finished."""
        if self._abandoned:
            ready, _ = ray.wait(list(self._abandoned), num_returns=len(self._abandoned), timeout=0)
            for ref in ready:
                runner, n = self._abandoned.pop(ref)
                self._shared.pop(ref, None)
                self.outstanding[id(runner)] = self.outstanding.get(id(runner), n) - n

    def finish_group(self, ref, runner, task: Task, group_size: int) -> list[Trajectory]:
        """The trajectories of a group submit_group started (ready, or waited for); a dead
        runner's group comes back as failed episodes naming it."""
        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            if isinstance(e, ray.exceptions.ActorUnavailableError) and _answers(runner):
                # a blip (Ray's temporary error), the runner alive: this group's episodes are lost, the
                # runner is kept (killed, all its groups went, and with one runner the run ended)
                cause = " ".join(str(e).split())[:300]
                return _failed_group(task, group_size, f"{self._names[id(runner)]} was unreachable for a moment while "
                                     f"running this episode (the runner is kept): {cause}", runner_lost=False)
            with self._lock:
                return _failed_group(task, group_size, self._lose(runner, e))
        except (ray.exceptions.RayTaskError, ray.exceptions.RaySystemError) as e:  # the group failed in a live
            # runner (its return not sendable, a bug), or its return could not be loaded here: its episodes fail, not the run
            first = (str(e).strip().splitlines() or ["?"])[-1][:300]
            return _failed_group(task, group_size, f"the group failed in its runner: {first}", runner_lost=False)
        finally:
            with self._lock:
                self.outstanding[id(runner)] -= group_size
                self._shared.pop(ref, None)

    def run_groups(self, tasks: list[Task], group_size: int = 1, progress: bool = True,
                   stop: threading.Event | None = None) -> list[list[Trajectory]]:
        """`group_size` episodes per task; returns one list of trajectories per task, in order.
        Each group goes to the runner with the fewest outstanding episodes that has room (a
        runner's groups as one call where all fit: submit_groups); the others wait until one has.
        Once `stop` is set it waits no more: RolloutStopped, holding the groups finished (a stopped run waited out a whole rollout,
        up to its episodes' timeouts, to throw it away). `tasks`: Tasks, or records as a data file
        holds them (an agent file's tasks() may return either; connect() takes both)."""
        from tqdm.auto import tqdm

        from ..data import task_from_record

        # (a dict went on as it was: every episode failed on task.id)
        tasks = [t if isinstance(t, Task) else task_from_record(t, f"tasks[{i}]") for i, t in enumerate(tasks)]
        waiting = list(range(len(tasks)))[::-1]  # pop() takes the next task
        inflight: dict = {}  # ref -> (task index, runner)
        out: list = [None] * len(tasks)

        def submit():
            if waiting:
                for ref, runner in self.submit_groups([tasks[i] for i in reversed(waiting)], group_size):
                    inflight[ref] = (waiting.pop(), runner)

        try:
            submit()
            with tqdm(total=len(tasks), desc=f"rollout ({group_size}/group)", disable=not progress) as bar:
                while inflight or waiting:
                    if stop is not None and stop.is_set():  # (the groups finished meanwhile first: left, they went
                        ready, _ = ray.wait(list(inflight), num_returns=len(inflight), timeout=0) if inflight else ([], [])
                        for ref in ready:  # unrecorded with the ones still running)
                            i, r = inflight.pop(ref)
                            out[i] = self.finish_group(ref, r, tasks[i], group_size)
                        for i, group in self._finished_in_calls(inflight):
                            out[i] = group
                        # (a call that ended meanwhile dropped its finished groups from the runner: its returns now)
                        ready, _ = ray.wait(list(inflight), num_returns=len(inflight), timeout=0) if inflight else ([], [])
                        for ref in ready:
                            i, r = inflight.pop(ref)
                            out[i] = self.finish_group(ref, r, tasks[i], group_size)
                        raise RolloutStopped([g for g in out if g is not None])
                    if not inflight:  # every runner is full with another caller's groups
                        time.sleep(0.05)
                        submit()
                        continue
                    done, _ = ray.wait(list(inflight), num_returns=1, timeout=None if stop is None else 0.1)
                    for ref in done:
                        i, r = inflight.pop(ref)
                        out[i] = self.finish_group(ref, r, tasks[i], group_size)
                        bar.update(1)
                    if not self.runners:
                        raise RunnersLost(f"every rollout runner died: {'; '.join(self.lost)}")
                    submit()
        finally:
            # interrupted (Ctrl-C in a notebook, an error): the groups still running keep their
            # slots until they finish. Dropped, their counts leaked, and once they reached the
            # runners' slots every later rollout waited for ever with no message
            self.abandon_groups([(ref, r) for ref, (_, r) in inflight.items()], group_size)
        return out

    def abandon_groups(self, started: list, group_size: int) -> None:
        """Groups submit_group started that no caller will collect: they keep their runners' slots
        until they finish, then give them back (_release_abandoned), without anyone waiting."""
        with self._lock:
            self._abandoned.update({ref: (runner, group_size) for ref, runner in started})

    def run_episodes(self, tasks: list[Task], progress: bool = True) -> list[Trajectory]:
        return [g[0] for g in self.run_groups(tasks, 1, progress)]

    def stats(self) -> list[dict]:
        return ray.get([r.stats.remote() for r in self.runners])

    def shutdown(self) -> None:
        for r in self.runners:
            try:
                ray.get(r.shutdown.remote(), timeout=30)
            except Exception:  # dead or stuck: killed below all the same
                pass
            finally:
                ray.kill(r)
        self.runners = []


def _answers(runner, waits=(1.0, 2.0)) -> bool:
    """Whether a runner Ray called unavailable answers again, asked after each of `waits` seconds."""
    for wait in waits:
        time.sleep(wait)
        try:
            ray.get(runner.stats.remote(), timeout=10)  # (any of RolloutRunner's methods: a cheap one)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
    return False


def _failed_group(task: Task, n: int, reason: str, runner_lost: bool = True) -> list[Trajectory]:
    group_id = uuid.uuid4().hex[:12]
    return [Trajectory([], 0.0, group_id, uuid.uuid4().hex[:16], {"task_id": task.id, "runner_lost": runner_lost}, reason)
            for _ in range(n)]
