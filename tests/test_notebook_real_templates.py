"""notebooks/04_real_templates.ipynb under papermill: it lints Qwen3's and Llama 3.1's real templates
offline and records the verdicts in results.json; its exercise check runs both ways (the committed
extend-or-seal rule always extends: extends*; the solution seals; a rule that always seals fails too)."""

from __future__ import annotations

import json
import subprocess
import sys

from workbench.notebooks import run_notebook


def test_04_real_templates_shows_the_think_seal_and_llama_extending(tmp_path):
    subprocess.run([sys.executable, "-m", "workbench.kernels", "--sys-prefix"], check=True, capture_output=True)
    run_notebook("04_real_templates", tmp_path, progress=False, timeout_s=600, exercise=["yours", "solution", "always_seals"])
    r = json.loads((tmp_path / "results.json").read_text())
    q, llama = r["qwen3"], r["llama3.1"]
    assert q["verdicts"]["reasoning_on"] == "seal:template_rewrite" and "recorded '<think>" in q["first_diff"]["reasoning_on"]
    assert q["verdicts"]["system_changed"] == "seal:history_rewritten"
    assert llama["verdicts"]["plain"] == llama["verdicts"]["tool_one"] == "extends"
    assert llama["verdicts"]["tool_many"] == "error" and llama["traps"]["bos_doubling"]
    assert (tmp_path / "lint.html").read_text().count("<table") == 4
    yours, solution = r["exercise"]["yours"], r["exercise"]["solution"]
    assert not yours["holds"] and yours["verdict"] == "extends*" and yours["segments"] == 1 and "FAILS" in yours["line"]
    assert solution["holds"] and solution["verdict"] == "seal:template_rewrite" and solution["segments"] == 2
    assert solution["verdict"] == q["verdicts"]["reasoning_on"]  # the solution is the accumulator's own rule
    # sealing at every turn keeps each segment exact but cuts where nothing was rewritten: no answer (it passed)
    seals = r["exercise"]["always_seals"]
    assert not seals["holds"] and seals["segments"] == 3 and "seals where the render extends" in seals["line"]
