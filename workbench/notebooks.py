"""Run the notebooks headless with papermill: `python -m workbench.notebooks 00_quickstart`
(a recipe: `recipes/math_grpo`); `--list` shows every notebook with its parameters and the run
time its metadata states (`workbench.cpu_minutes`: the CPU default on 2 cores).

The executed notebook lands in its run directory, next to what the notebook itself writes
there (metrics, trajectories, plots, results.json). `make demo` and the tests use this.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"


def ensure_kernel(name: str = "workbench-local") -> None:
    """Install the workbench kernelspecs into this environment if `name` is not found."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        from .kernels import install

        install()


@contextmanager
def _local_env(ray_address: str | None = None):
    """The local kernel starts its own Ray: hide a RAY_ADDRESS this process may carry (or name
    the one it joins)."""
    saved = os.environ.pop("RAY_ADDRESS", None)
    if ray_address:
        os.environ["RAY_ADDRESS"] = ray_address
    try:
        yield
    finally:  # (the one named here was left set: a later connect() in this process joined that Ray)
        os.environ.pop("RAY_ADDRESS", None)
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


def run_notebook(name: str, run_dir: str | Path, kernel: str = "workbench-local", progress: bool = True,
                 timeout_s: int | None = None, ray_address: str | None = None, **parameters) -> Path:
    """Execute notebooks/<name>.ipynb with `run_dir` and `parameters`; returns the executed
    notebook's path (<run_dir>/<name>.ipynb; <name>.2.ipynb and on where one is there already, a
    resumed run's: the first run's record is kept). A failing cell raises papermill's error, and the
    partly executed notebook is still written for a look. `timeout_s`: a limit per cell (None:
    none; a cell training a run takes as long as the run). `ray_address`: a local Ray instance
    the kernel joins instead of starting its own (the tests share theirs: a Ray start is a
    large part of a short notebook's time on 2 cores; the kernel's actors end with it)."""
    import papermill

    src = NOTEBOOK_DIR / f"{name}.ipynb"
    if not src.is_file():
        raise FileNotFoundError(f"no notebook {name!r} in {NOTEBOOK_DIR}; known: {notebooks()}")
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / f"{Path(name).name}.ipynb"  # a recipe ("recipes/math_grpo") lands as math_grpo.ipynb
    n = 1
    while out.exists():  # (papermill wrote a resumed run's notebook over the first run's)
        n += 1
        out = run_dir / f"{Path(name).name}.{n}.ipynb"
    ensure_kernel(kernel)
    with (_local_env(ray_address) if kernel == "workbench-local" else nullcontext()):
        papermill.execute_notebook(str(src), str(out), parameters={"run_dir": str(run_dir), **parameters},
                                   kernel_name=kernel, cwd=str(NOTEBOOK_DIR.parent), progress_bar=progress,
                                   execution_timeout=timeout_s)
    return out


def notebooks() -> list[str]:
    """Every notebook's name (notebooks/*.ipynb, then notebooks/recipes/*.ipynb), as run_notebook takes it."""
    return [str(p.relative_to(NOTEBOOK_DIR).with_suffix("")) for p in
            sorted(NOTEBOOK_DIR.glob("*.ipynb")) + sorted(NOTEBOOK_DIR.glob("recipes/*.ipynb"))]


def describe(name: str) -> dict:
    """A notebook's parameters (name -> default, as written in its `parameters` cell), and its
    expected minutes on 2 CPU cores from its metadata (None when it states none)."""
    import nbformat
    import papermill

    path = NOTEBOOK_DIR / f"{name}.ipynb"
    meta = nbformat.read(path, as_version=4).metadata.get("workbench", {})
    params = {k: v["default"] for k, v in papermill.inspect_notebook(str(path)).items()}
    return {"name": name, "cpu_minutes": meta.get("cpu_minutes"), "parameters": params}


EXERCISE_VARIANTS = ("yours", "solution")  # what a workshop notebook's exercise check runs


def exercise_variants(exercise, known=EXERCISE_VARIANTS) -> list[str]:
    """A workshop notebook's `exercise` parameter as the variants its check runs: one of `known`,
    a list of them, or "yours,solution" (the CLI's -p gives text: that string reached the check
    cell, which failed with a KeyError after every other cell had run)."""
    variants = [v.strip() for v in exercise.split(",")] if isinstance(exercise, str) else list(exercise)
    if not variants or any(v not in known for v in variants):
        raise ValueError(f"exercise={exercise!r}: give one of {list(known)}, a list of them or the names joined by commas")
    return variants


def _resumes(params: dict) -> bool:
    """Whether a run's parameters continue the run in its directory: a `resume` parameter, or a
    session config file (`config`) saying resume (the session then takes the directory's run on)."""
    if params.get("resume"):
        return True
    if isinstance(params.get("config"), str):
        from .cluster import load_config_file

        try:
            return bool(load_config_file(params["config"]).get("resume"))
        except (OSError, ValueError):
            return False
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workbench.notebooks", description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", help="notebook name without .ipynb, e.g. 00_quickstart or recipes/math_grpo")
    p.add_argument("--list", action="store_true", help="every notebook with its parameters and expected run time")
    p.add_argument("--run-dir", default=None, help="default: runs/<name>/<date-time> (a new one each run)")
    p.add_argument("--kernel", default="workbench-local")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="a limit per cell (default: none; a cell training a run takes as long as the run)")
    p.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="a notebook parameter (VALUE is parsed as a Python literal when it is one)")
    # a VALUE starting with "-" that is no plain number ("-1e-3") read as an option: argparse refused it
    # ("expected 2 arguments"); marked here, unmarked below
    argv = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(argv) - 2):
        if argv[i] in ("-p", "--param") and argv[i + 2].startswith("-"):
            argv[i + 2] = "\0" + argv[i + 2]
    a = p.parse_args(argv)
    a.param = [(k, v.removeprefix("\0")) for k, v in a.param]
    if a.list:
        for name in notebooks():
            d = describe(name)
            minutes = f"~{d['cpu_minutes']:g} min on 2 CPU cores" if d["cpu_minutes"] else "run time not stated"
            print(f"{name}  ({minutes})")
            print("    " + "  ".join(f"{k}={v}" for k, v in d["parameters"].items() if k != "run_dir"))
        return 0
    if a.name is None:
        p.error("a notebook name, or --list")
    if not (NOTEBOOK_DIR / f"{a.name}.ipynb").is_file():  # (before a run directory is made for it: an empty one
        # was left behind, with a traceback)
        p.error(f"no notebook {a.name!r}; the notebooks: {', '.join(notebooks())}")
    import ast

    params = {}
    for k, v in a.param:
        try:
            params[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            params[k] = v
    known = describe(a.name)["parameters"]
    unknown = sorted(set(params) - set(known))
    if unknown:  # papermill only warns, and the notebook ran on its defaults
        p.error(f"{a.name} has no parameter(s) {unknown}; its parameters: {sorted(k for k in known if k != 'run_dir')}")
    if "run_dir" in params:  # (given twice to papermill: a TypeError after an empty run directory was made)
        p.error("give the run directory as --run-dir, not -p run_dir")
    for k, v in params.items():  # a bool parameter given as text: "false" (no Python literal) was a true value
        try:
            default = ast.literal_eval(str(known[k]))
        except (ValueError, SyntaxError):
            continue
        if isinstance(default, (list, tuple)) and isinstance(v, str):  # "-p families qwen3": a list of one
            # (the string reached the notebook, which walked it letter by letter); "a,b", "a b" and "[a, b]"
            # a list of two ("[a, b]" read as '[a' and 'b]')
            v = v.strip().removeprefix("[").removesuffix("]")
            params[k] = [x for x in re.split(r"[,\s]+" if "," not in v else r"\s*,\s*", v.strip()) if x]
        elif isinstance(default, (list, tuple)) and isinstance(v, (tuple, set)):  # (papermill passes a tuple
            params[k] = list(v)  # on as its text: the notebook walked "('a', 'b')" letter by letter)
        if isinstance(default, bool) and isinstance(v, str):
            from .session import BOOL_TEXT

            if v.strip().lower() not in BOOL_TEXT:
                p.error(f"{a.name}: parameter {k} is true or false, got {v!r}")
            params[k] = BOOL_TEXT[v.strip().lower()]
    # a new directory each run (a session refuses one that holds a run: a second run of the same
    # notebook failed at connect(), after its kernel had started)
    if a.run_dir is None:
        from .session import new_run_dir  # (made now: two runs started in one second shared one)

        run_dir = new_run_dir(Path("runs") / a.name)
    else:
        from .session import RUN_MARKS

        run_dir = Path(a.run_dir)
        # papermill writes the executed notebook there before its first cell: a second run into one
        # directory replaced the first run's notebook with one that failed at connect() (the session
        # refuses a directory holding a run)
        held = [n for n in (*RUN_MARKS, f"{Path(a.name).name}.ipynb") if (run_dir / n).exists()]
        if held and not _resumes(params):
            p.error(f"--run-dir {str(run_dir)!r} holds a run already ({', '.join(held)}): give a new directory, or "
                    f"leave --run-dir out (runs/{a.name}/<date-time>)")
    out = run_notebook(a.name, run_dir, a.kernel, timeout_s=a.timeout, **params)
    print(f"executed notebook: {out}\nrun directory:     {out.parent}")
    for f in sorted(out.parent.iterdir()):
        print(f"  {f.name}{'/' if f.is_dir() else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
