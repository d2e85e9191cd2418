"""Code execution: the model's tool call is run as Python in the sandbox (isolated interpreter,
no network, wall-clock and memory limits, truncated output), and the output goes back as the
tool result. A `calc`-style call from the toy model runs as `print(<expression>)`."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor

from workbench.agents import ChatAgent, Task
from workbench.examples.tools import is_answer, tool_tasks
from workbench.sandbox import run_python

PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def tasks(n: int, seed: int = 0):
    return [Task(t.messages, tools=t.tools + [PYTHON_TOOL], label=t.label, id=t.id) for t in tool_tasks(n, seed)]


def python_code(arguments: str | None) -> str | None:
    """The code a tool call asks to run (a calc-style call's expression, printed), or None when
    its arguments are not a JSON object holding a string."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    code = args.get("code") or f"print({args.get('expression', '')})"
    return code if isinstance(code, str) else None


def timed_run(code: str, timeout_s: float, memory_mb: int):
    """run_python and the seconds it took, timed in the worker thread: the wait for a free thread
    (the runner's episodes share the pool) is not the program's time, and counted it scored right
    answers 0 under load."""
    started = time.monotonic()
    res = run_python(code, timeout_s, memory_mb, 1000)
    return res, time.monotonic() - started


# The threads sandbox runs wait in (each waits on its sandbox's process: a thread a run, CPU-light).
# Its own pool: on the event loop's default executor (cpu + 4 threads: 6 on 2 cores, shared with the
# runner's other blocking work) the runs of a runner's many episodes queued, the wait counted against
# episode_timeout_s and not against sandbox_budget_s, and looping episodes timed out and were dropped
# (on_failed="drop") instead of scored 0: 30 of 128 in a simulation of 256 episodes, half looping.
# With SANDBOX_THREADS, a runner's 256 episode slots at 15 s of budget each wait at most ~60 s.
SANDBOX_THREADS = 64


@functools.lru_cache(maxsize=1)
def sandbox_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(SANDBOX_THREADS, thread_name_prefix="sandbox")


async def run_sandboxed(code: str, timeout_s: float, memory_mb: int):
    """timed_run in sandbox_pool's threads: (SandboxResult, seconds it ran)."""
    return await asyncio.get_running_loop().run_in_executor(sandbox_pool(), timed_run, code, timeout_s, memory_mb)


class CodeAgent(ChatAgent):
    timeout_s, memory_mb = 5.0, 256
    # What one episode may spend in the sandbox, and how many calls of one reply run. Why: RL learns
    # whatever earns reward. Uncapped, a reply of many looping calls (a policy's max_tokens holds
    # many) ran past the runner's episode_timeout_s, and the failed episode was dropped
    # (on_failed="drop") instead of scored: looping escaped its 0. Past the budget the episode ends
    # scored 0; calls past the cap are answered "not run".
    sandbox_budget_s, max_calls_per_reply = 15.0, 4

    async def run(self, ctx):
        client = ctx.openai()  # a stock AsyncOpenAI at this episode's base_url
        messages, answer, runs = ctx.messages, None, []
        spent = 0.0  # wall seconds in the sandbox, this episode
        for _ in range(3):
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools)  # the policy's max_tokens
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                answer = msg.content
                break
            for i, call in enumerate(msg.tool_calls):
                code = python_code(call.function.arguments)
                if i >= self.max_calls_per_reply:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": f"[not run: at most {self.max_calls_per_reply} calls a reply]"})
                    continue
                if spent >= self.sandbox_budget_s:
                    return 0.0, {"runs": runs, "answer": None, "sandbox_budget_spent": True}
                if code is None:  # said to the model as the tool's result: raised, it failed (dropped) the episode
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": "[invalid arguments: expected a JSON object with a string 'code']"})
                    continue
                timeout_s = min(self.timeout_s, self.sandbox_budget_s - spent)
                res, took = await run_sandboxed(code, timeout_s, self.memory_mb)
                spent += took
                runs.append({"code": code, "exit_code": res.exit_code, "timed_out": res.timed_out})
                # what went wrong is said, not left as an empty or cut result the model cannot read
                notes = ([f"[timed out after {timeout_s:g} s]"] if res.timed_out else []) + \
                        (["[output truncated]"] if res.truncated else []) + \
                        ([f"[exit code {res.exit_code}]"] if res.exit_code not in (0, None) and not res.timed_out else [])
                # stderr too where the run failed: after any printed output (even a newline) the traceback
                # was left out, the model read its partial output and an exit code, never why
                # an output past run_python's cap is its first 1,000 characters: their head is shown (their
                # tail, the middle of the program's output, read as its end); a whole one, its end
                said = (res.stdout[:500] if res.stdout_truncated else res.stdout[-500:]) + ("\n" + res.stderr[-500:] if res.stderr and (not res.ok or not res.stdout) else "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "\n".join([said, *notes]).strip()})
        return float(is_answer(answer, ctx.label)), {"runs": runs, "answer": answer}


AgentRunner = CodeAgent
