"""The recipe notebooks (notebooks/recipes/), each run headless through papermill with its
test parameters (the notebook's metadata, workbench.test_parameters: 1-3 small steps on the
reference engine, 1 trainer rank) and checked on what it teaches, read from its results.json
and run directory. The CPU defaults run in `make recipes`.

Each kernel joins this test session's Ray (run_notebook(ray_address=...)) rather than starting
its own, and every recipe ends with wb.shutdown() (the kernel's actors end with it in any case)."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from workbench.notebooks import NOTEBOOK_DIR, run_notebook
from workbench.tokens import read_trajectories

RECIPES = NOTEBOOK_DIR / "recipes"


@pytest.fixture
def execute(ray_address):
    def run(name: str, run_dir, cpu_default: bool = False, timeout_s: int = 600) -> tuple[dict, list[dict]]:
        nb = nbformat.read(RECIPES / f"{name}.ipynb", as_version=4)
        run_notebook(f"recipes/{name}", run_dir, progress=False, timeout_s=timeout_s, ray_address=ray_address,
                     **({} if cpu_default else nb.metadata["workbench"]["test_parameters"]))
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return json.loads((run_dir / "results.json").read_text()), metrics
    return run


def trajectories(run_dir) -> list:
    return [t for f in sorted((run_dir / "trajectories").glob("step_*.parquet")) for t in read_trajectories(f)]


def test_recipes_are_committed_without_outputs_and_say_what_they_need():
    names = sorted(p.stem for p in RECIPES.glob("*.ipynb"))
    assert names, "no recipe notebooks"
    for name in names:
        nb = nbformat.read(RECIPES / f"{name}.ipynb", as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), f"{name} was committed with outputs"
        assert "parameters" in code[0].metadata.get("tags", []), f"{name}: first code cell is not tagged 'parameters'"
        meta = nb.metadata["workbench"]
        assert meta["cpu_minutes"] > 0 and meta["test_parameters"], name
        intro = nb.cells[0].source
        assert "To change for your task" in intro and "cluster (2x8 H100)" in intro, name


def _cluster_set(nb) -> dict:
    """The parameters of the intro table's "cluster (2x8 H100)" column that are Python literals."""
    import ast
    import re

    out = {}
    for line in nb.cells[0].source.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(\w+)`", cols[0]) if len(cols) == 4 else None
        literal = re.fullmatch(r"`(.+)`", cols[3]) if m else None
        if literal:
            out[m.group(1)] = ast.literal_eval(literal.group(1))
    return out


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES.glob("*.ipynb")))
def test_a_recipes_cluster_set_keeps_its_config_and_fits_2x8(name, monkeypatch):
    """Each recipe's cluster column, run as papermill would up to connect(): the session it asks for
    keeps the config file's fields (the recipes replaced its `loop` section, so the bf16 configs'
    sync_tol fell back to fp32's 1e-3 and connect()'s first sync failed), and its placement plan
    leaves the judge's / teacher's engines their GPUs (the plan took all 16 and the judge's engine
    was refused at connect(), the teacher's at the first step)."""
    import workbench
    from workbench.cluster import load_config_file
    from workbench.placement import ClusterSpec, check_frozen_room, plan_inputs, plan_placement
    from workbench.session import WorkbenchConfig

    nb = nbformat.read(RECIPES / f"{name}.ipynb", as_version=4)
    params = _cluster_set(nb)
    assert params.get("config"), name
    monkeypatch.chdir(RECIPES.parent.parent)  # the job runs from the repository's root

    class Connected(Exception):
        pass

    asked = {}

    def connect(config=None, **kw):
        asked.update({**(config or {}), **kw})
        raise Connected

    monkeypatch.setattr(workbench, "connect", connect)
    monkeypatch.setattr(workbench, "shutdown_live", lambda: 0)  # (this process's sessions are other tests')
    import workbench.cluster

    real_load = workbench.cluster.load_config_file

    def with_correction(path):  # (no cluster file has a correction section: one, so that it is checked)
        c = real_load(path)
        c.setdefault("trainer", {})["correction"] = {"level": "token", "mode": "clip", "low": 0.5, "high": 2.0}
        return c

    monkeypatch.setattr(workbench.cluster, "load_config_file", with_correction)
    load_config_file = with_correction
    ns: dict = {}
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    exec(code[0], ns)
    ns.update(params)  # papermill's injected cell
    for src in code[1:]:
        try:
            exec(src, ns)
        except Connected:
            break
    else:
        pytest.fail(f"{name} never calls workbench.connect")
    wanted = load_config_file(params["config"])
    # (the cluster's model paths do not exist here: named toy models stand in for them)
    cfg = WorkbenchConfig.from_dict({**asked, "model": "dense", **({"judge": "dense"} if asked.get("judge") else {})})
    for key, value in wanted.get("loop", {}).items():
        assert getattr(cfg.loop, key) == value, (name, key)
    for key in ("trainer_ranks", "max_tokens", "max_model_len", "backend"):
        if key in wanted:
            assert getattr(cfg, key) == wanted[key], (name, key)
    # and its trainer section (two recipes put their CPU lr over the config's: Qwen3-8B at 5e-5 and
    # 1e-4 instead of the file's 1e-6; one replaced the config's whole correction section)
    for key, value in wanted.get("trainer", {}).items():
        got = asked["trainer"][key]
        assert (got == value if key != "correction" else {k: got[k] for k in value if k != "max_staleness"} ==
                {k: v for k, v in value.items() if k != "max_staleness"}), (name, key)
    check_frozen_room(plan_placement(ClusterSpec.uniform(2, 8), **plan_inputs(asked)), asked)


def test_math_grpo(execute, tmp_path):
    results, metrics = execute("math_grpo", tmp_path)
    # pass@k on the held-out problems before and after training, from the same estimator
    for when in ("eval_before", "eval_after"):
        e = results[when]
        assert e["eval_tasks"] == 2 and e["eval_n"] == 2 and 0 <= e["eval_pass@1"] <= e["eval_pass@2"] <= 1
        assert "eval_greedy_pass@1" in e
    # the training tasks came from the data file (its ids), at the recorded data position
    assert [m["data_position"] for m in metrics] == [0] and metrics[0]["data_next"] == 2
    trained = trajectories(tmp_path)
    assert len(trained) == 4 and all(t.info["task_id"].startswith("word_problems_train:") for t in trained)
    assert results["eval_episodes"] == 2 * 2 * (2 + 1)  # 2 problems x (2 samples + 1 greedy), twice
    assert results["eval_best_constant_pass@1"] in (0.5, 1.0)  # a constant answer's, on the 2 held-out problems


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_tool_agent(sdk, execute, tmp_path):
    results, metrics = execute(f"tool_agent_{sdk}", tmp_path)
    # the stock SDK's episodes ran and trained: none failed, rewards from the final answer
    assert results["episodes"] == 4 and results["failed_episodes"] == 0 and results["rewards_binary"]
    assert metrics[0]["episodes"] == 4 and metrics[0]["failed_episodes"] == 0
    # a tool call's result went back and the model answered on: every such episode has 2+ recorded turns
    assert results["tool_episodes_continue"] and results["turns_mean"] >= 1 and results["calc_calls"] >= 1
    # both tools: one document task per step (2 episodes) opened with the agent's search through the SDK,
    # each search recorded as a tool turn (its passage in the messages and, loss-masked, in the token ids)
    assert results["document_episodes"] == 2 and results["search_calls_agent"] == 2 and results["search_turns_recorded"]


def test_code_agent(execute, tmp_path):
    results, _ = execute("code_agent", tmp_path)
    # the sandboxed tests grade: the reference solution passes all, a wrong one none, prose none
    assert results["by_hand"] == {"right": 1.0, "identity": 0.0, "not code": 0.0, "prints PASSED": 0.0}
    assert results["episodes"] == 4 and results["failed_episodes"] == 0 and results["reward_is_share_passed"]


def test_the_code_grader_waits_in_the_sandbox_pool(monkeypatch):
    """The grader's sandbox runs wait in the sandbox's own threads (code_agent.sandbox_pool), as
    CodeAgent's do: on the event loop's default executor (6 threads on 2 cores) a runner's looping
    programs queued 5 s each, the wait counted against episode_timeout_s, and episodes timed out and
    were dropped (not scored 0), right answers with them. (A fake client: the policy's reply.)"""
    import asyncio
    import sys
    import threading
    from types import SimpleNamespace

    sys.path.insert(0, str(RECIPES / "agents"))
    import code_tests

    seen = []
    monkeypatch.setattr(code_tests, "score", lambda code, label: (seen.append(threading.current_thread().name), (1.0, {}))[1])

    async def create(**kw):
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="def f(x): return x"))])

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    ctx = SimpleNamespace(openai=lambda: client, model="m", messages=[{"role": "user", "content": "?"}], label={})
    assert asyncio.run(code_tests.CodeWithTests().run(ctx))[0] == 1.0
    assert seen and seen[0].startswith("sandbox"), seen


def test_the_code_grader_pays_only_right_return_values():
    """RL learns whatever earns reward. The grader used to count passes inside the sandbox and read
    'PASSED n' from the code's output: printing it earned 1.0 ('PASSED 400': 100), a return value
    equal to everything 1.0, an __eq__ returning 10**400 crashed the grader (a failed episode is
    dropped, not scored 0). Now the expected values never enter the sandbox."""
    import sys

    sys.path.insert(0, str(RECIPES / "agents"))
    from code_tests import score, tasks

    label = tasks(1, seed=0)[0].label
    name = label["name"]
    hacks = {"prints PASSED": 'print("PASSED 4")\nraise SystemExit', "prints PASSED 400": 'print("PASSED 400")',
             "equal to everything": f"class A:\n    def __eq__(s, o): return True\ndef {name}(x): return A()",
             "huge __eq__": f"class A:\n    def __eq__(s, o): return 10**400\ndef {name}(x): return A()",
             "True for 1": f"def {name}(x): return True",
             "right, then hangs": label["solution"] + "\nwhile True: pass",
             # a marker line the JSON parser recurses out on (RecursionError, not ValueError: score raised)
             "deep marker": 'import os\nprint("RESULTS " + "[" * 1500, flush=True)\nos._exit(0)',
             "a NUL byte": label["solution"] + "\x00", "a lone surrogate": label["solution"] + "\n# \ud800"}
    for what, code in hacks.items():
        assert score(code, label, timeout_s=2)[0] == 0.0, what
    assert score(label["solution"], label)[0] == 1.0
    # a test expecting None: code that raises, or defines nothing, read as returning None and passed it
    find = {"name": "find", "tests": [[3, 0], [4, 2], [7, None], [9, None]]}
    assert score("", find)[0] == score("def find(x):\n    raise ValueError", find)[0] == 0.0
    assert score("def find(x):\n    return {3: 0, 4: 2}.get(x)", find)[0] == 1.0
    # right answers it scored 0: a tuple reference, a long list (its line cut at 2,000 characters),
    # prose around a fenced block, a ```py fence, output without a newline before the results
    pairs = {"name": "dm", "tests": [[x, divmod(x, 7)] for x in (3, 10, 15)]}
    assert score("def dm(x):\n    return divmod(x, 7)", pairs)[0] == 1.0
    assert score("def dm(x):\n    return [x // 7, x % 7 == x % 7]", pairs)[0] == 0.0  # [0, True] is not [0, 3]
    long = {"name": "rng", "tests": [[x, list(range(x))] for x in range(200, 204)]}
    assert score("def rng(x):\n    return list(range(x))", long)[0] == 1.0
    many = {"name": "inc", "tests": [[x, x + 3] for x in range(2000)]}  # (the results line outgrew a cap of 2x the answers)
    assert score("def inc(x):\n    return x + 3", many)[0] == 1.0
    # a right function, then a driver line reading stdin (empty: EOFError) or failing otherwise
    for driver in (f"print({name}(int(input())))", "raise RuntimeError('driver')"):
        assert score(label["solution"] + "\n" + driver, label)[0] == 1.0, driver
    for reply in (f"Here is the function:\n```python\n{label['solution']}\n```\nIt adds.", f"```py\n{label['solution']}\n```",
                  f"import sys\nsys.stdout.write('ok')\n{label['solution']}", f"```Python\n{label['solution']}\n```",
                  f"```python3.11\n{label['solution']}\n```",
                  f"```python\n{label['solution']}\n```\nUsage:\n```python\nprint({name}(2))\n```\n```\n5\n```",
                  # a fence never closed (cut by max_tokens), prose before unfenced code
                  f"```python\n{label['solution']}\n", f"Here is the function:\n{label['solution']}",
                  # unfenced code with an explanation after it (a SyntaxError: scored 0)
                  f"{label['solution']}\n\nThis function does what was asked.",
                  f"Here it is:\n{label['solution']}\nIt runs in O(1).",
                  label["solution"] + "\n\n" + "\n".join(f"- note {i}: it works." for i in range(80)),
                  # unfenced, with an import / a helper above the function (cut at the def: a NameError)
                  f"import operator as _op\n\n{label['solution']}\n\n_unused = _op.add",
                  f"Here it is:\nimport operator as _op\n\ndef _helper():\n    return _op\n\n{label['solution']}\nDone.",
                  # ... and 80 lines of prose after it (the head search gave up past 50: the import went)
                  "import operator as _op\n\n" + label["solution"].replace("return ", "return _op.pos(") + ")\n" +
                  "\n".join(f"- note {i}" for i in range(80))):
        assert score(reply, label)[0] == 1.0, reply
    # a right program logging to stderr past the output cap: its results line on stdout is whole (a cut
    # in either stream read as a cut run, scored 0)
    noisy = label["solution"] + "\nimport sys\nsys.stderr.write('log ' * 3000)"
    assert score(noisy, label)[0] == 1.0
    # a right solution with its own tests run under __main__ (unittest.main() exits), or ending with
    # exit() (not defined under python -S) or sys.exit(): it scored 0, and RL learned to stop testing
    tested = (label["solution"] + "\n\nimport unittest\n\nclass T(unittest.TestCase):\n    def test(self):\n"
              "        self.assertTrue(True)\n\nif __name__ == '__main__':\n    unittest.main()\n")
    # and a solution using a dataclass under postponed annotations (it looks its module up: none was registered)
    dataclassed = ("from __future__ import annotations\nfrom dataclasses import dataclass\n\n@dataclass\nclass K:\n"
                   "    k: int\n\n" + label["solution"])
    for ending in (tested, label["solution"] + "\nexit()", label["solution"] + "\nimport sys\nsys.exit(0)", dataclassed):
        assert score(ending, label)[0] == 1.0, ending
    from code_tests import code_of

    assert code_of("Sure.\nimport math\n\ndef f(x):\n    return math.sqrt(x)\n\nIt works.", "f").strip() == \
        "import math\n\ndef f(x):\n    return math.sqrt(x)"
    # a reply of newlines: the block search was quadratic (\s* from every line start; 3 s at 40,000
    # newlines, in the runner's thread); now linear, and it finds nothing to pass
    from code_tests import code_of

    assert code_of("```python\n" + "\n" * 200_000 + "```", name).strip() == ""


def test_judge_reward(execute, tmp_path):
    results, _ = execute("judge_reward", tmp_path)
    n = 2 + results["episodes"]  # the notebook's first look (one group of 2) and the trained step
    assert results["episodes"] == 4 and results["judge_engine"]
    # one recorded policy turn and one judge call per episode; the judge's never reached a trajectory
    assert results["requests"] == {"openai:session": n, "openai:side": n}
    assert results["recorded_turns"] == results["episodes"] and not results["rubric_in_trajectories"]
    # how often the judge's reply was a score (the toy judge's are not: the recipe says so) is reported
    assert 0.0 <= results["judge_parsed_rate"] <= 1.0 and 0.0 <= results["correct_rate"] <= 1.0


def test_distillation(execute, tmp_path):
    results, metrics = execute("distillation", tmp_path)
    assert results["teacher_engine_apart"] and len(results["reverse_kl"]) == 6
    assert [m["distill_reverse_kl"] for m in metrics] == results["reverse_kl"]
    # every step's reverse KL is a Monte Carlo estimate from its own samples (~64 tokens, noisier
    # than the fall): recorded per step, finite
    assert all(abs(kl) < 20 for kl in results["reverse_kl"])
    # the lesson: the exact reverse KL of the answer's first token, over the pool distilled on, falls
    # (the student's trained export against the teacher checkpoint). Sampling differs run to run (the
    # sessions' seeds mix in random session ids): 4 steps fell to 0.82-0.86x (a CI run failed at 0.862),
    # 6 steps to 0.73-0.78x (2026-12-05, 0.581 before); on another machine's toy build (0.388 before)
    # 0.55-0.76x in four runs and 0.92x in a CI run beside other work (2026-12-07). Held under 0.95x:
    # an update that trains nothing leaves it at 1.0x exactly (the same weights), a wrong sign raises it
    before, after = results["exact_kl_pool"]
    assert after < 0.95 * before, results["exact_kl_pool"]


def test_async_off_policy(execute, tmp_path):
    results, metrics = execute("async_off_policy", tmp_path)
    modes = results["modes"]
    assert set(modes) == {"sync", "async lag 1", "async lag 2"} and len(metrics) == 7  # a warm-up step first
    assert [m["mode"] for m in metrics] == ["sync"] * 3 + ["async"] * 4
    assert modes["sync"]["max_staleness_seen"] == 0  # sync: every token sampled by the weights it trains
    for lag, label in ((1, "async lag 1"), (2, "async lag 2")):  # within the lag, and the gate let them through
        assert modes[label]["max_staleness_seen"] <= lag and modes[label]["gate_pass_ratio"] == 1.0
    assert all(len(row["reward_per_step"]) == 2 and row["wall_s_per_step"] > 0 for row in modes.values())


def test_notebooks_list_shows_every_notebook_with_parameters_and_time(capsys, monkeypatch, tmp_path):
    from workbench.notebooks import main, notebooks

    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    recipes = [n for n in notebooks() if n.startswith("recipes/")]
    assert len(recipes) == len(list(RECIPES.glob("*.ipynb"))) and "00_quickstart" in notebooks()
    for name in recipes:
        minutes = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4).metadata["workbench"]["cpu_minutes"]
        assert f"{name}  (~{minutes:g} min on 2 CPU cores)" in out
    assert "recipes/math_grpo" in out and "eval_n=4" in out and "teacher='dense'" in out
    # a parameter the notebook does not have is refused before anything runs (papermill only
    # warned, and the notebook ran on its defaults)
    with pytest.raises(SystemExit):
        main(["00_quickstart", "-p", "lr", "3e-4"])
    assert "00_quickstart has no parameter(s) ['lr']" in capsys.readouterr().err
    # a bool parameter given as text: "false" is no Python literal, and stayed the string (a true value)
    import workbench.notebooks as nb

    got = {}

    def fake_run(name, run_dir, kernel, **params):
        got.update(params)
        out = Path(run_dir) / "out.ipynb"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("{}")
        return out

    monkeypatch.setattr(nb, "run_notebook", fake_run)
    main(["recipes/distillation", "-p", "exact_kl", "false", "--run-dir", str(tmp_path / "d")])
    assert got["exact_kl"] is False
    # no limit per cell unless one is asked (papermill's 30 min killed a longer training cell, and the kernel with it)
    assert got.pop("timeout_s") is None
    main(["recipes/distillation", "--timeout", "90", "--run-dir", str(tmp_path / "t")])
    assert got.pop("timeout_s") == 90
    with pytest.raises(SystemExit):
        main(["recipes/distillation", "-p", "exact_kl", "nope", "--run-dir", str(tmp_path / "e")])
    assert "parameter exact_kl is true or false, got 'nope'" in capsys.readouterr().err
    # a list parameter given as a bare word reached the notebook as a string, walked letter by letter
    main(["04_real_templates", "-p", "families", "qwen3", "--run-dir", str(tmp_path / "f")])
    assert got["families"] == ["qwen3"]
    main(["04_real_templates", "-p", "families", "qwen3, gpt-oss", "--run-dir", str(tmp_path / "g")])
    assert got["families"] == ["qwen3", "gpt-oss"]
    # "[a, b]" ('[a' and 'b]'), "a b" (one name) and a tuple (papermill passes its text on) are lists too
    for i, given in enumerate(("[qwen3, gpt-oss]", "qwen3 gpt-oss", "('qwen3', 'gpt-oss')")):
        main(["04_real_templates", "-p", "families", given, "--run-dir", str(tmp_path / f"g{i}")])
        assert got["families"] == ["qwen3", "gpt-oss"], given
    # a workshop notebook's exercise: "-p exercise yours,solution" reached its check cell as one name (a
    # KeyError after every other cell had run); the check cell reads it as both, and names a wrong one
    from workbench.notebooks import exercise_variants

    assert exercise_variants("yours,solution") == exercise_variants(["yours", "solution"]) == ["yours", "solution"]
    assert exercise_variants("always_seals", {"yours": 0, "always_seals": 0}) == ["always_seals"]
    with pytest.raises(ValueError, match="exercise='your'"):
        exercise_variants("your")
    # a negative number in exponent form is a value, not an option (argparse: "expected 2 arguments")
    main(["recipes/distillation", "-p", "lr", "-1e-3", "--run-dir", str(tmp_path / "n")])
    assert got["lr"] == -1e-3
    # a run directory holding a run is refused before papermill writes its notebook over the last one's;
    # a mistyped notebook name leaves no empty run directory behind
    (tmp_path / "n" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit):
        main(["recipes/distillation", "--run-dir", str(tmp_path / "n")])
    assert "holds a run already (metrics.jsonl)" in capsys.readouterr().err
    # ... unless its config resumes that run
    (tmp_path / "resume.yaml").write_text("resume: true\n")
    main(["recipes/math_grpo", "-p", "config", str(tmp_path / "resume.yaml"), "--run-dir", str(tmp_path / "n")])
    assert got["config"] == str(tmp_path / "resume.yaml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["00_quickstrat"])
    assert "no notebook '00_quickstrat'; the notebooks: 00_quickstart" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    # the run directory is --run-dir's (-p run_dir reached papermill twice: a TypeError, an empty directory made)
    with pytest.raises(SystemExit):
        main(["00_quickstart", "-p", "run_dir", str(tmp_path / "h")])
    assert "give the run directory as --run-dir" in capsys.readouterr().err and not (tmp_path / "h").exists()


def test_real_model_grpo(execute, tmp_path):
    results, metrics = execute("real_model_grpo", tmp_path)
    assert results["model"] == "smollm2" and results["steps"] == 1 and metrics[0]["failed_episodes"] == 0
    for when in ("eval_before", "eval_after"):  # held-out pass@k from the real model's own samples
        e = results[when]
        assert e["eval_tasks"] == 2 and 0 <= e["eval_pass@1"] <= e["eval_pass@2"] <= 1
    assert metrics[0]["sync_max_abs_diff"] <= 1e-3  # the engine serves the trained real weights


@pytest.mark.long  # the CPU default: 10 GRPO steps of 4x4 and two evaluations, 3.5-8 min on 2 quiet cores
def test_real_model_grpo_rises(execute, tmp_path):
    # the notebook's claim: SmolLM2-135M's training reward and held-out pass@1 (at temperature 1)
    # rise on the one-step problems. Six runs of seed 0/1 (unreplayed sampling): reward +0.07 to
    # +0.51, pass@1 +0.02 to +0.47; held-out reward up in the four runs that read it (this test's,
    # 0.26 -> 0.41, 0.27 -> 0.50, 0.27 -> 0.61). The sizes vary too much for a margin. Six steps on 8 problems
    # were not enough.
    results, metrics = execute("real_model_grpo", tmp_path, cpu_default=True, timeout_s=1800)
    assert results["steps"] == 10 and all(m["failed_episodes"] == 0 for m in metrics)
    before, after = results["eval_before"], results["eval_after"]
    assert before["eval_tasks"] == after["eval_tasks"] == 16 and before["eval_n"] == 4
    assert results["reward_last"] > results["reward_first"]
    assert after["eval_pass@1"] > before["eval_pass@1"] and after["eval_reward_mean"] > before["eval_reward_mean"]


def test_the_code_agent_answers_malformed_tool_arguments_instead_of_failing():
    """Arguments that are not a JSON object with a string 'code' raised in the agent, failing
    the episode, which the loop drops instead of scoring: a way out of a low reward. They are
    now said to the model as the tool's result."""
    from workbench.examples.code_agent import python_code

    assert python_code('{"code": "print(1)"}') == "print(1)" and python_code('{"expression": "2*3"}') == "print(2*3)"
    assert [python_code(a) for a in ("not json", "[1]", '{"code": 5}', '"print(1)"')] == [None] * 4


def test_the_code_agent_caps_its_sandbox_time_and_calls_so_looping_is_scored_not_dropped():
    """A reply of many looping calls ran 5 s each, past the runner's episode timeout: the failed
    episode was dropped (on_failed="drop"), not scored 0, so looping escaped its penalty. The
    agent now stops at its sandbox budget, scored 0, and runs at most max_calls_per_reply calls of
    a reply (real sandbox; the policy is a fake: the toy model does not write loops)."""
    import asyncio
    import time
    from types import SimpleNamespace

    from openai.types.chat import ChatCompletion

    from workbench.examples.code_agent import CodeAgent

    def completion(codes, content=None):
        calls = [{"id": f"c{i}", "type": "function", "function": {"name": "python", "arguments": json.dumps({"code": c})}}
                 for i, c in enumerate(codes)]
        return ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop",
                         "message": {"role": "assistant", "content": content, "tool_calls": calls or None}}]})

    class Policy:  # answers the agent's requests in order, keeping what it was sent
        def __init__(self, replies):
            self.replies, self.sent = list(replies), []
            self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

        async def create(self, **kw):
            self.sent.append(json.loads(json.dumps(kw["messages"], default=str)))
            return self.replies.pop(0)

    def episode(agent, policy, label=5):
        ctx = SimpleNamespace(openai=lambda: policy, messages=[{"role": "user", "content": "2+3?"}], tools=[],
                              model="m", label=label)
        return asyncio.run(agent.run(ctx))

    agent = CodeAgent()
    agent.timeout_s, agent.sandbox_budget_s = 0.5, 1.2
    loops = completion(["while True: pass"] * 4)
    started = time.monotonic()
    reward, info = episode(agent, Policy([loops, loops, completion([], "The answer is 5")]))
    assert reward == 0.0 and info["sandbox_budget_spent"] and info["answer"] is None
    # 0.5 + 0.5 + the 0.2 left (2 where a loaded machine's sandbox start pushed a run past 0.6 s)
    assert 2 <= len(info["runs"]) <= 3 and all(r["timed_out"] for r in info["runs"])
    assert time.monotonic() - started < 1.2 + 3.0

    policy = Policy([completion(["print(5)"] * 6), completion([], "The answer is 5")])
    reward, info = episode(CodeAgent(), policy)
    assert reward == 1.0 and len(info["runs"]) == 4
    results = [m["content"] for m in policy.sent[1] if m["role"] == "tool"]
    assert results[:4] == ["5"] * 4 and results[4:] == ["[not run: at most 4 calls a reply]"] * 2
    # a run that printed, then failed: its traceback too (after any output it was left out)
    policy = Policy([completion(["print('partial')\n1 / 0"]), completion([], "The answer is 5")])
    episode(CodeAgent(), policy)
    [said] = [m["content"] for m in policy.sent[1] if m["role"] == "tool"]
    assert said.startswith("partial\n") and "ZeroDivisionError" in said and said.endswith("[exit code 1]")
    # an output past the cap: its head, not the middle of the program's output
    policy = Policy([completion(["for i in range(200): print('step', i)\nprint('RESULT 5')"]), completion([], "5")])
    episode(CodeAgent(), policy)
    [said] = [m["content"] for m in policy.sent[1] if m["role"] == "tool"]
    assert said.startswith("step 0\nstep 1\n") and said.endswith("[output truncated]"), said
    # the runs have threads of their own: on the event loop's default executor (6 threads on 2 cores,
    # shared with the runner's other blocking work) they queued behind the other episodes' runs, the
    # wait counting against the episode's timeout, not its sandbox budget: looping episodes timed out
    # and were dropped, not scored 0. Here every default thread is held, and the episode still runs
    import os
    import threading

    async def with_default_executor_held():
        loop, release = asyncio.get_running_loop(), threading.Event()
        held = [loop.run_in_executor(None, release.wait) for _ in range(min(32, (os.cpu_count() or 1) + 4))]
        try:
            ctx = SimpleNamespace(openai=lambda: Policy([completion(["print(5)"]), completion([], "The answer is 5")]),
                                  messages=[{"role": "user", "content": "2+3?"}], tools=[], model="m", label=5)
            return await asyncio.wait_for(CodeAgent().run(ctx), 60)
        finally:
            release.set()
            await asyncio.gather(*held)

    reward, info = asyncio.run(with_default_executor_held())
    assert reward == 1.0 and [r["exit_code"] for r in info["runs"]] == [0]


def test_the_search_recipes_own_call_renders_in_every_real_template():
    """The search recipes open a document task with the agent's own search call. Its id was
    'search0' ('toolu_search0'): Mistral's template refuses any id but 9 letters and digits, so on
    a Mistral model every document task was a 400, failed and dropped (half the recipe's tasks)."""
    import importlib
    import sys

    from workbench import real_models
    from workbench.examples.tools import document_tasks, search
    from workbench.tokens import Accumulator, ChatFormat

    sys.path.insert(0, str(RECIPES / "agents"))
    task = document_tasks(1)[0]
    query = task.info["query"]
    for module in ("search_calc_openai", "search_calc_anthropic"):
        call_id = importlib.import_module(module).SEARCH_CALL_ID
        opening = [dict(m) for m in task.messages] + [
            {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function",
             "function": {"name": "search", "arguments": json.dumps({"query": query})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": search(query)}]
        for name in real_models.FAMILIES:
            family = real_models.load_family(name)
            plan = Accumulator(ChatFormat.for_profile(family.tokenizer, family.profile())).plan(opening, task.tools)
            assert plan.prompt_ids, (module, name)


def test_run_notebook_keeps_a_resumed_runs_first_notebook_and_restores_ray_address(monkeypatch, tmp_path):
    """A resumed run into its directory had papermill write its notebook over the first run's (the
    first run's outputs lost); a `ray_address` given for the kernel stayed set in this process
    after the run (a later connect() here joined that Ray, and left it running at shutdown)."""
    import os

    import papermill

    import workbench.notebooks as nb

    seen = []

    def execute(src, out, **kw):
        seen.append((Path(out).name, os.environ.get("RAY_ADDRESS"), kw["execution_timeout"]))
        Path(out).write_text("{}")

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    monkeypatch.setattr(nb, "ensure_kernel", lambda kernel: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    outs = [nb.run_notebook("recipes/math_grpo", tmp_path, ray_address="127.0.0.1:6379") for _ in range(3)]
    assert [o.name for o in outs] == ["math_grpo.ipynb", "math_grpo.2.ipynb", "math_grpo.3.ipynb"]
    assert seen[0] == ("math_grpo.ipynb", "127.0.0.1:6379", None) and "RAY_ADDRESS" not in os.environ
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    nb.run_notebook("recipes/math_grpo", tmp_path / "b", ray_address="127.0.0.1:6379")
    assert os.environ["RAY_ADDRESS"] == "10.0.0.1:6379"
    with pytest.raises(FileNotFoundError, match="recipes/math_grpo"):  # the known names include the recipes
        nb.run_notebook("nope", tmp_path)
