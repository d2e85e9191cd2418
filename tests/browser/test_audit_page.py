"""The run audit page in Chromium: a file opened with no network, its sections drawn, and a
violation's link landing on the offending episode's token view."""

from __future__ import annotations

import shutil

from workbench.tokens import read_trajectories, write_trajectories
from workbench.widgets.audit import CHECKS


def test_audit_page_renders_and_links_a_violation_to_its_token_view(short_run, browser, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(short_run.run_dir, run, ignore=shutil.ignore_patterns("policies", "checkpoint"))
    step2 = run / "trajectories" / "step_00002.parquet"
    trajs = read_trajectories(step2)
    trajs[1].segments[0].stats["identity_mismatch"] = 3  # a breach of invariant 1 in one episode
    write_trajectories(trajs, step2)
    page_file = short_run.audit(tmp_path / "audit.html", run_dir=run)
    target = "t-2-" + trajs[1].episode_id.replace("-", "_")

    ctx = browser()
    ctx.route("http*://**", lambda route: route.abort())  # offline: any fetch would fail
    page = ctx.new_page()
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(page_file.as_uri())
    assert page.title().startswith("Audit of run")
    # every statistic's section is drawn: its heading and a plot, or, for what a sync run never has
    # (stale tokens, a probe position excused), the note that no step had one
    for key, _, _ in CHECKS:
        section = page.locator(f"#stat-{key}")
        drawn = section.locator("svg polyline").count() == 1
        absent = key in ("kl_k3_stale", "sync_probe_outlier") and section.locator("p.na").count() == 1
        assert section.is_visible() and (drawn or absent), key
    assert page.locator("#steps tr").count() == 1 + 3  # header and one row per step
    link = page.locator(f"#v-2-identity_mismatch a[href='#{target}']")
    assert page.locator("#violations li").count() == 1 and link.is_visible()
    link.click()
    assert page.evaluate("location.hash") == f"#{target}"
    view = page.locator(f"#{target}")
    box, viewport = view.bounding_box(), page.viewport_size
    assert -5 <= box["y"] < viewport["height"]  # scrolled to it (its top at the window's, give or take a pixel)
    assert view.locator("span[title*='logprob']").count() > 0  # its tokens, each with its details
    assert view.evaluate("e => e.matches(':target')")
    assert [u for u in requests if not u.startswith("file:")] == []
