"""Run the notebooks headless with papermill: `python -m workbench.notebooks 00_quickstart`.

The executed notebook lands in its run directory, next to what the notebook itself writes
there (metrics, trajectories, plots, results.json). `make demo` and the tests use this.
"""

from __future__ import annotations

import argparse
import os
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
def _local_env():
    """The local kernel starts its own Ray: hide a RAY_ADDRESS this process may carry."""
    saved = os.environ.pop("RAY_ADDRESS", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


def run_notebook(name: str, run_dir: str | Path, kernel: str = "workbench-local", progress: bool = True,
                 timeout_s: int = 1800, **parameters) -> Path:
    """Execute notebooks/<name>.ipynb with `run_dir` and `parameters`; returns the executed
    notebook's path (<run_dir>/<name>.ipynb). A failing cell raises papermill's error, and the
    partly executed notebook is still written for a look."""
    import papermill

    src = NOTEBOOK_DIR / f"{name}.ipynb"
    if not src.is_file():
        known = sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb"))
        raise FileNotFoundError(f"no notebook {name!r} in {NOTEBOOK_DIR}; known: {known}")
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / f"{Path(name).name}.ipynb"  # a recipe ("recipes/math_grpo") lands as math_grpo.ipynb
    ensure_kernel(kernel)
    with (_local_env() if kernel == "workbench-local" else nullcontext()):
        papermill.execute_notebook(str(src), str(out), parameters={"run_dir": str(run_dir), **parameters},
                                   kernel_name=kernel, cwd=str(NOTEBOOK_DIR.parent), progress_bar=progress,
                                   execution_timeout=timeout_s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workbench.notebooks", description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="notebook name without .ipynb, e.g. 00_quickstart")
    p.add_argument("--run-dir", default=None, help="default: runs/<name>")
    p.add_argument("--kernel", default="workbench-local")
    p.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="a notebook parameter (VALUE is parsed as a Python literal when it is one)")
    a = p.parse_args(argv)
    import ast

    params = {}
    for k, v in a.param:
        try:
            params[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            params[k] = v
    out = run_notebook(a.name, a.run_dir or Path("runs") / a.name, a.kernel, **params)
    print(f"executed notebook: {out}\nrun directory:     {out.parent}")
    for f in sorted(out.parent.iterdir()):
        print(f"  {f.name}{'/' if f.is_dir() else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
