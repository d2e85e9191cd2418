"""Code with unit tests: the policy writes a small Python function, which runs in the sandbox
(workbench.sandbox: isolated interpreter, no network, time and memory limits) on the task's test
inputs; reward = the share of tests whose returned value is right, judged outside the sandbox.
Used by notebooks/recipes/code_agent.ipynb.
For your own task: tasks() (the prompt, the function's name, the tests) and nothing else."""

from __future__ import annotations

import ast
import asyncio
import json
import random
import re

from workbench.agents import ChatAgent, Task
from workbench.examples.code_agent import sandbox_pool
from workbench.sandbox import run_python

# the function each task asks for: (name, operator); its reference solution returns `x <op> k`
KINDS = [("add_k", "+"), ("times_k", "*"), ("minus_k", "-")]


def tasks(n: int, seed: int = 0) -> list[Task]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name, op = rng.choice(KINDS)
        k = rng.randint(1, 9)
        solution = f"def {name}(x):\n    return x {op} {k}"
        scope: dict = {}
        exec(solution, scope)  # the reference solution makes the tests' expected values
        tests = [[x, scope[name](x)] for x in rng.sample(range(-5, 20), 4)]
        prompt = f"Write a Python function {name}(x) that returns x {op} {k}. Reply with the code only."
        out.append(Task([{"role": "user", "content": prompt}], label={"name": name, "tests": tests, "solution": solution},
                        id=f"code-{seed}-{i}"))  # (the seed's and position's: a resumed run's tasks keep their ids)
    return out


# The harness runs the policy's code and only reports what the function returned, as JSON; the
# expected answers never enter the sandbox and are compared here, in the trusted process. Why: RL
# learns whatever earns reward. A harness that counted passes inside the sandbox and printed
# "PASSED n" was beaten by `print("PASSED 4")` (and "PASSED 400": reward 100), by a return value
# whose __eq__ is always True, and by an __eq__ returning 10**400 (score() raised, and a failed
# episode is dropped, not scored 0). Returned values are compared as JSON, so an object can only
# pass by being the right value. Each test reports ["ok", value] or ["error", its type]: when an
# exception read as None, code that raised (or defined nothing) passed every test expecting None.
# The policy's code runs as a module of its own, not __main__, and may end with sys.exit() or
# exit(): a right solution with its own `if __name__ == "__main__": unittest.main()` (unittest exits)
# or a final exit() (not defined under `python -S`) scored 0, and RL learned to stop testing. Nor
# does an error after the function's def void it: a driver line reading stdin (empty: EOFError)
# scored a right function 0; its tests still need right return values, compared here.
HARNESS = """
import json, sys, types
module = sys.modules["solution"] = types.ModuleType("solution")  # (dataclasses and pickle look it up)
solution = module.__dict__
solution.update(exit=sys.exit, quit=sys.exit)
try:
    exec(compile({code!r}, "solution.py", "exec"), solution)
except BaseException:
    pass
out = []
for x in json.loads({inputs!r}):
    try:
        out.append(["ok", json.loads(json.dumps(solution[{name!r}](x)))])
    except BaseException as e:
        out.append(["error", type(e).__name__])
print("\\n" + {marker!r} + json.dumps(out))
"""
MARKER = "RESULTS "
_FENCED = re.compile(r"```[^\n`]*\n(.*?)```", re.S)  # any info string: python, Python, py, python3.11, none


def code_of(reply: str, name: str | None = None) -> str:
    """The code in a reply: its last fenced block that defines `name` (prose, a usage example or
    an output block around it, as real models write them), else its last fenced block, else the
    whole reply."""
    blocks = _FENCED.findall(reply)
    # ([ \t]*, not \s*: from every line start \s* ran on over the newlines after it, quadratic, in the
    # runner's thread: 40,000 newlines took 3 s, every episode of the runner stalled behind it)
    defining = [b for b in blocks if name and re.search(rf"^[ \t]*def\s+{re.escape(name)}\s*\(", b, re.M)]
    if defining or blocks:
        return (defining or blocks)[-1]
    # no closed block: an opening fence cut by max_tokens or never closed ("```python\n<code>"), or
    # prose before the code ("Here is the function:\n<code>"): from the function's definition on
    # (both scored 0 with a right solution)
    opened = re.search(r"```[^\n`]*\n", reply)
    if opened:  # the code after the fence, its imports included
        return reply[opened.end():].strip()
    start = re.search(rf"^[ \t]*def\s+{re.escape(name)}\s*\(", reply, re.M) if name else None
    if start is None:
        return _parsable_head(reply.strip())
    # from the first top-level import, helper or decorator above the function that still parses with
    # it (cutting at the def alone dropped "import operator" above it: NameError, a right answer 0).
    # The text above is joined to the function's own parsable head (cut from the whole reply, the
    # head search gave up past 50 lines of prose after the function, and the import went again)
    head = _parsable_head(reply[start.start():].strip())
    above = [m.start() for m in _TOP_LEVEL_CODE.finditer(reply, 0, start.start())][:20]
    for s in above:
        code = reply[s:start.start()] + head
        if _parses(code):
            return code.strip()
    return head


_TOP_LEVEL_CODE = re.compile(r"^(?:import [\w.]|from [\w.]+ import |def \w|class \w|@\w)", re.M)


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def _parsable_head(code: str, tries: int = 50) -> str:
    """`code`, or where it does not parse, its longest head ending before a line at the top level
    that does: unfenced code with an explanation after it ("def f(x): ...\n\nThis function
    returns ...") was a SyntaxError, a right solution scored 0."""
    parses = _parses
    try:
        ast.parse(code)
        return code
    except SyntaxError as e:
        if "null bytes" in str(e) or "surrogate" in str(e):
            return code  # no head of it is the reply's code: the sandbox's interpreter refuses it whole
    except (ValueError, RecursionError, MemoryError):  # (a NUL byte, a lone surrogate, nesting)
        return code
    lines = code.splitlines(keepends=True)
    cuts = [i for i in range(len(lines) - 1, 0, -1) if lines[i][:1] not in ("", " ", "\t", "\n", "\r")]
    # the longest heads first (helpers defined after the function stay), then as a last resort the end
    # of the def it starts with (only the last `tries` cuts were tried: a long explanation left none)
    for i in cuts[:tries] + sorted(cuts)[:1]:
        if parses("".join(lines[:i])):
            return "".join(lines[:i])
    return code


def same(got, want) -> bool:
    """Equal as JSON values of the same types, all the way down ([True] is not [1])."""
    if type(got) is not type(want):
        return False
    if isinstance(want, list):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return got == want


def score(code: str, label: dict, timeout_s: float = 5.0) -> tuple[float, dict]:
    """Run `code` and the label's test inputs in the sandbox, compare what it returned with the
    expected values here: (share passed, in [0, 1], details). A run that did not exit cleanly
    (a crash, a timeout, output cut) passes nothing."""
    code = code_of(code, label["name"])
    # the expected values as JSON gives them back (a tuple is a list, a dict's keys strings): a right
    # function returning a tuple never matched a tuple reference
    inputs, wanted = [x for x, _ in label["tests"]], json.loads(json.dumps([w for _, w in label["tests"]]))
    program = HARNESS.format(code=code, inputs=json.dumps(inputs), name=label["name"], marker=MARKER)
    # room for the right answers' JSON and each entry's ["ok", ...] (a 2,000-character cap scored a right
    # list-returning function 0; one of twice the answers' JSON a right one of 2,000 small tests)
    res = run_python(program, timeout_s, 256, 4000 + 2 * len(json.dumps(wanted)) + 48 * len(wanted))
    got = None
    lines = (res.stdout or "").splitlines()
    # the harness's line is the last one: a line the code printed itself comes earlier
    if res.exit_code == 0 and not res.timed_out and not res.stdout_truncated and lines and lines[-1].startswith(MARKER):
        try:
            got = json.loads(lines[-1][len(MARKER):])
        except Exception:  # not only ValueError: "[" * 1500 raised RecursionError, failing (dropping) the episode
            got = None
    if not isinstance(got, list) or len(got) != len(wanted):
        got = [["error", "no results"]] * len(wanted)  # code that does not even define the function passes nothing
    passed = sum(isinstance(g, list) and len(g) == 2 and g[0] == "ok" and same(g[1], w) for g, w in zip(got, wanted))
    total = len(wanted)
    return passed / total, {"passed": passed, "tests": total, "exit_code": res.exit_code, "timed_out": res.timed_out,
                            "truncated": res.stdout_truncated,
                            "ran": not res.stdout_truncated and lines[-1:] != [] and lines[-1].startswith(MARKER)}


class CodeWithTests(ChatAgent):
    async def run(self, ctx):
        # no max_tokens: the policy's (the recipe's max_tokens parameter) applies
        r = await ctx.openai().chat.completions.create(model=ctx.model, messages=ctx.messages)
        code = r.choices[0].message.content or ""
        # in the sandbox's own thread pool (code_agent.sandbox_pool): on the loop's default executor (6
        # threads on 2 cores) a runner's looping programs queued, 5 s each, and the wait counted against
        # episode_timeout_s: episodes timed out, were dropped (escaping their 0), right answers with them
        share, info = await asyncio.get_running_loop().run_in_executor(sandbox_pool(), score, code, ctx.label)
        return share, {**info, "code": code}


AgentRunner = CodeWithTests
