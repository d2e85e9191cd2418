"""The segment inspector in JupyterLab in Chromium, on a recorded trajectory (a parquet file as a
run writes, and a training step's per-token report saved beside it; no Ray, no engine): switch
the colour mode, hover a token for its card, click a token for its journey."""

from __future__ import annotations

import time

import nbformat
import numpy as np
import torch

from workbench.tokens import Segment, Trajectory, training_tensors, write_trajectories

from .lab import cell_index, cells, open_notebook, run_all

CELLS = [
    "import torch\nfrom workbench.tokens import read_trajectories\nfrom workbench.widgets import SegmentInspector\n"
    "traj = read_trajectories('trajectories.parquet')[0]\nreport = torch.load('report.pt')",
    "ins = SegmentInspector(traj, report=report)\nins",
]


def recorded(root):
    """A two-segment episode with routed experts, and the report of a step that trained on it."""
    ex = np.array([[[-1, -1]]] * 3 + [[[1, 2]], [[3, 4]], [[5, 6]]], dtype=np.int16)
    first = Segment([101, 102, 103, 104, 105, 106], [0, 0, 0, 1, 1, 1], [0.0] * 3 + [-0.25, -1.5, -3.0],
                    [-1, -1, -1, 2, 2, 3], ex, [{"role": "user", "content": "hi"}], "history_rewritten")
    second = Segment([201, 202, 203], [0, 1, 1], [0.0, -0.5, -0.125], [-1, 3, 3], None, [], "episode_end")
    traj = Trajectory([first, second], reward=1.0, group_id="g0", episode_id="ep-browser")
    write_trajectories([traj], root / "trajectories.parquet")
    batch = training_tensors([first, second])
    m = batch["loss_mask"]
    trainer = batch["behaviour_logprobs"] - 0.01 * m
    report = {k: batch[k] for k in ("input_ids", "loss_mask", "behaviour_logprobs", "versions")}
    report.update(trainer_logprobs=trainer, is_weight=torch.exp(trainer - batch["behaviour_logprobs"]) * m,
                  gate_keep=torch.tensor([True, True]), advantages=0.5 * m, loss_contribution=-0.1 * m)
    torch.save(report, root / "report.pt")


# the inspector's output in its cell: the colour dropdown, the token boxes, the card, the journey
Q = "() => window.jupyterapp.shell.currentWidget.content.widgets[%d].node"


def test_inspector_colour_modes_hover_card_and_click_to_journey(lab, browser, capsys):
    t0 = time.time()
    recorded(lab.root)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    nb.metadata["kernelspec"] = {"name": "workbench-local", "display_name": "workbench (local)", "language": "python"}
    nbformat.write(nb, lab.root / "inspector.ipynb")
    lab.shutdown_kernels()
    page = open_notebook(browser(), lab, "inspector.ipynb")
    run_all(page)
    deadline = time.time() + 60
    while not all(c["count"] is not None for c in cells(page)):
        assert not [c["errors"] for c in cells(page) if c["errors"]]
        assert time.time() < deadline, "the inspector notebook did not run in 60 s"
        time.sleep(0.5)
    out = page.evaluate_handle(Q % cell_index(page, "SegmentInspector(traj"))
    token = out.as_element().wait_for_selector("[data-i='4']", timeout=30_000)  # segment 0, token 4: sampled
    boxes = out.as_element().query_selector_all("[data-i]")
    assert len(boxes) == 9  # every token its own box
    assert "sealed: history_rewritten" in out.as_element().inner_text()

    # colour modes: the box of a sampled token changes colour with the mode
    colours = {}
    select = out.as_element().query_selector(".widget-dropdown select")
    for mode in ("loss_mask", "logprob", "version"):
        select.select_option(mode)
        page.wait_for_function("([el, mode]) => el.innerText.includes(mode)",
                               arg=[out, {"loss_mask": "green: sampled", "logprob": "log-prob 0",
                                          "version": "one colour per policy version"}[mode]])
        page.wait_for_timeout(300)
        colours[mode] = out.as_element().query_selector("[data-i='4']").evaluate("s => getComputedStyle(s).backgroundColor")
    assert len(set(colours.values())) == 3, colours

    # hover: the card with the token's id, log-prob, version and experts
    token = out.as_element().query_selector("[data-i='4']")
    token.hover()
    card = out.as_element().wait_for_selector(".wb-token-card", state="visible", timeout=5_000)
    text = card.inner_text()
    for want in ("id 105", "logprob -1.5000", "version 2", "L0[3, 4]"):
        assert want in text, (want, text)

    # click: that token's journey (episode, segment, token; the report's row and the sampled columns)
    token.click()
    page.wait_for_function("el => el.innerText.includes('trainer log-prob')", arg=out, timeout=10_000)
    journey = out.as_element().inner_text()
    assert "episode ep-browser, segment 0, token 4" in journey and "sampled columns of row 0: 3-5" in journey
    assert "-1.51" in journey and "105" in journey  # trainer log-prob, token id
    # a token of the second segment: its own row of the report
    out.as_element().query_selector("[data-i='8']").click()
    page.wait_for_function("el => el.innerText.includes('segment 1, token 2')", arg=out, timeout=10_000)
    assert "sampled columns of row 1: 1-2" in out.as_element().inner_text()
    with capsys.disabled():
        print(f"\n[measured] inspector in Chromium: {time.time() - t0:.0f} s")
