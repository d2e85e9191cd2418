"""Drive JupyterLab in a real browser: Debian's chromium, launched by path through Python
Playwright (no `playwright install`, no browser download), against a `jupyter lab` server this
module starts on a free port with a random token and stops by its handle.

What the tests read off the page is plotly's own state on each plot element (`gd.data`: the
traces it draws) and the SVG it drew (marker paths), not pixels."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# Chromium floods a closed network without these; --no-sandbox: the CI container runs as root
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server rooted at `root` (its own config and workspace dirs, the news popup
    off, the app exposed as window.jupyterapp so commands run by name)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.port, self.token = _free_port(), secrets.token_hex(16)
        cfg = self.root.parent / f"{self.root.name}-jupyter-config"
        (cfg / "labconfig").mkdir(parents=True, exist_ok=True)
        (cfg / "labconfig" / "page_config.json").write_text(json.dumps(
            {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(cfg)}
        env.pop("RAY_ADDRESS", None)  # the local kernel starts its own Ray
        self.log = open(self.root.parent / f"{self.root.name}-lab.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={self.port}",
             f"--ServerApp.token={self.token}", "--ServerApp.ip=127.0.0.1", f"--ServerApp.root_dir={self.root}",
             f"--LabApp.workspaces_dir={cfg / 'workspaces'}", "--LabApp.expose_app_in_browser=True"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        deadline = time.time() + 120
        while True:
            try:
                self.api("GET", "/api/status")
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"jupyter lab did not start; see {self.log.name}")
                time.sleep(0.5)

    def api(self, method: str, path: str):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def kernels(self) -> list[dict]:
        """The server's kernels. A 500 here is jupyter_server listing a kernel it is still starting:
        until the start returns, the kernel has no last_activity to report (isoformat(None)
        raises in kernel_model; jupyter_server 2.21). Ask again."""
        for _ in range(20):
            try:
                return self.api("GET", "/api/kernels") or []
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise
                time.sleep(0.5)
        return self.api("GET", "/api/kernels") or []

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{notebook}?token={self.token}&reset"

    def shutdown_kernels(self) -> None:
        """Delete every session (its kernel too), or a new page would reuse the previous kernel."""
        for s in self.api("GET", "/api/sessions") or []:
            self.api("DELETE", f"/api/sessions/{s['id']}")
        deadline = time.time() + 30  # and wait until their kernels are gone, so none races the next page
        while self.kernels() and time.time() < deadline:
            time.sleep(0.5)

    def stop(self) -> None:
        try:
            self.shutdown_kernels()
        except OSError:
            pass
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# JS run in the page, on the notebook's own model (cells are found by index even when the
# notebook's windowing has not rendered them): per plotly plot in cell i's output, what plotly draws
PLOTS_JS = """(i) => {
  const cell = window.jupyterapp.shell.currentWidget.content.widgets[i];
  if (!cell) return null;
  return [...cell.node.querySelectorAll('.js-plotly-plot')].map(gd => ({
    traces: (gd.data || []).map(t => ({name: t.name || '', n: (t.y || []).length})),
    markers: gd.querySelectorAll('.scatterlayer .trace .points path').length,
  }));
}"""

STATE_JS = """() => window.jupyterapp.shell.currentWidget.content.widgets.map(c => ({
  source: c.model.sharedModel.getSource(), type: c.model.type,
  count: c.model.type === 'code' ? c.model.executionCount : null,
  errors: c.model.type === 'code' ? c.model.outputs.toJSON().filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue) : []}))"""


def open_notebook(context, lab: Lab, notebook: str):
    page = context.new_page()
    page.goto(lab.url(notebook))
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.content"
                           " && window.jupyterapp.shell.currentWidget.content.widgets.length > 0", timeout=120_000)
    deadline = time.time() + 120  # the kernel is up when the server says idle
    while not any(k["execution_state"] == "idle" for k in lab.kernels()):
        if time.time() > deadline:
            raise TimeoutError(f"no idle kernel after 120 s; see {lab.log.name}")
        time.sleep(0.5)
    return page


def run_all(page) -> None:
    # not awaited: the command's promise resolves only when every cell has run
    page.evaluate("() => { window.jupyterapp.commands.execute('runmenu:run-all'); }")


def cells(page) -> list[dict]:
    return page.evaluate(STATE_JS)


def cell_index(page, text: str) -> int:
    """The index of the first cell whose source contains `text`."""
    for i, c in enumerate(cells(page)):
        if text in c["source"]:
            return i
    raise LookupError(f"no cell contains {text!r}")


def plots(page, i: int) -> list[dict]:
    return page.evaluate(PLOTS_JS, i) or []


def run_all_and_watch(page, cell: int, timeout_s: float = 600, every_s: float = 1.0) -> tuple[list, list[dict]]:
    """Run All, then sample the plots of `cell` every `every_s` until every code cell has run
    (or one failed). Returns (samples, final cell states)."""
    run_all(page)
    samples, deadline = [], time.time() + timeout_s
    while True:
        samples.append(plots(page, cell))
        state = cells(page)
        code = [c for c in state if c["type"] == "code"]
        if any(c["errors"] for c in code) or all(c["count"] is not None for c in code):
            time.sleep(every_s)
            samples.append(plots(page, cell))
            return samples, state
        if time.time() > deadline:
            raise TimeoutError(f"Run All did not finish in {timeout_s} s: "
                               f"{sum(c['count'] is not None for c in code)}/{len(code)} cells ran")
        time.sleep(every_s)


def points(sample: list[dict], plot: int = 0, trace: int = 0) -> int:
    """Points plotly draws in one trace of one plot of a sample (0 when the plot is blank)."""
    try:
        return sample[plot]["traces"][trace]["n"]
    except (IndexError, KeyError, TypeError):
        return 0
