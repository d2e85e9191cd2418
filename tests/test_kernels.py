"""`make kernels`: both kernelspecs install (into a temp prefix here) and Jupyter finds them with
the right python and environment; the cluster kernel really starts with RAY_ADDRESS set."""

import subprocess
import sys
import tempfile
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager

from workbench.kernels import DEFAULT_RAY_ADDRESS, install


def found(prefix, monkeypatch):
    # what a JupyterLab with this data path would see
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    ksm = KernelSpecManager()
    assert {"workbench-local", "workbench-cluster"} <= set(ksm.find_kernel_specs())
    return ksm.get_kernel_spec("workbench-local"), ksm.get_kernel_spec("workbench-cluster")


def test_cli_installs_both_kernelspecs_with_the_ray_address(tmp_path, monkeypatch):
    subprocess.run([sys.executable, "-m", "workbench.kernels", "--prefix", str(tmp_path), "--ray-address", "ray://head:10001"],
                   check=True, capture_output=True)
    local, cluster = found(tmp_path, monkeypatch)
    assert cluster.env == {"RAY_ADDRESS": "ray://head:10001"} and "RAY_ADDRESS" not in local.env
    for spec in (local, cluster):
        assert spec.argv[0] == sys.executable and spec.language == "python"
        assert spec.argv[spec.argv.index("-m") + 1] == "ipykernel_launcher"
    assert local.display_name == "workbench (local)" and "ray://head:10001" in cluster.display_name

    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="workbench-cluster")  # found through JUPYTER_PATH
    try:
        out = []
        hook = lambda msg: out.append(msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None  # noqa: E731
        reply = kc.execute_interactive("import os, sys; print(os.environ['RAY_ADDRESS'], sys.executable)",
                                       timeout=30, output_hook=hook)
        assert reply["content"]["status"] == "ok"
        assert "".join(out).split() == ["ray://head:10001", sys.executable]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_default_ray_address(tmp_path, monkeypatch):
    staged = lambda: set(Path(tempfile.gettempdir()).glob("*_kernels"))  # noqa: E731  ipykernel's staging dirs
    before = staged()
    install(prefix=str(tmp_path))
    assert staged() == before, "the install left its staging dirs in the temp dir"
    _, cluster = found(tmp_path, monkeypatch)
    assert cluster.env == {"RAY_ADDRESS": DEFAULT_RAY_ADDRESS}
