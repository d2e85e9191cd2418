"""Jupyter kernelspecs for workbench (`make kernels`):

- `workbench-local`: this Python (the project's .venv); Ray starts locally in the kernel.
- `workbench-cluster`: the same Python with `RAY_ADDRESS` in the kernel's environment, so Ray
  in that kernel (and `workbench.connect()`) joins the cluster. The address is fixed at install
  time (`--ray-address`, default ray://127.0.0.1:10001, e.g. an SSH tunnel to the head node).

By default they go into this environment's prefix (`ipykernel install --sys-prefix`): the
JupyterLab of the same venv finds them and nothing is written to the user's home.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

DEFAULT_RAY_ADDRESS = "ray://127.0.0.1:10001"


def install(prefix: str | None = None, ray_address: str = DEFAULT_RAY_ADDRESS, user: bool = False) -> dict[str, str]:
    """Install both kernelspecs; returns {name: directory}. `prefix` None (and not `user`): sys.prefix."""
    from ipykernel.kernelspec import install as install_kernelspec

    if prefix is None and not user:
        prefix = sys.prefix
    specs = {
        "workbench-local": ("workbench (local)", None),
        "workbench-cluster": (f"workbench (cluster {ray_address})", {"RAY_ADDRESS": ray_address}),
    }
    # ipykernel writes argv = [sys.executable, "-m", "ipykernel_launcher", ...]: run under the
    # venv's python, the kernels run the venv's python. It stages each spec in a fresh
    # mkdtemp() and removes only the spec inside it, so the staging dirs go in one of ours.
    with tempfile.TemporaryDirectory(prefix="workbench-kernelspec-") as staging:
        default, tempfile.tempdir = tempfile.tempdir, staging
        try:
            return {name: install_kernelspec(kernel_name=name, display_name=display, prefix=prefix, user=user, env=env)
                    for name, (display, env) in specs.items()}
        finally:
            tempfile.tempdir = default


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m workbench.kernels", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--sys-prefix", action="store_true", help="into this environment (the default)")
    where.add_argument("--prefix", help="into PREFIX/share/jupyter/kernels")
    where.add_argument("--user", action="store_true", help="into the user's Jupyter data directory")
    p.add_argument("--ray-address", default=DEFAULT_RAY_ADDRESS, help="RAY_ADDRESS of the cluster kernel (default %(default)s)")
    a = p.parse_args(argv)
    for name, path in install(a.prefix, a.ray_address, a.user).items():
        print(f"installed kernelspec {name} in {path}")


if __name__ == "__main__":
    main()
