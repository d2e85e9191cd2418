"""The notebook widgets, headless: ipywidgets run outside a kernel on a dummy comm, so these
check the logic each widget shows (spans, drift marks, trace data, journey values) without a
browser, Ray or an engine. Segments and trajectories are built by hand."""

import math
import os
import re

import numpy as np
import pytest
import torch

from workbench.tokens import ChatFormat, Segment, Trajectory
from workbench.widgets import (
    GateMonitor,
    ReplayMonitor,
    RewardMonitor,
    RolloutStepper,
    SegmentInspector,
    TokenJourney,
    Views,
    drift_positions,
    journey,
    spans_html,
    token_spans,
    trajectory_html,
)

SYS = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": "What is 6+6?"}


def seg(ids, mask, lps=None, versions=None, seal="episode_end", experts=None, messages=()):
    n = len(ids)
    return Segment(list(ids), list(mask), list(lps or [0.0] * n), list(versions or [-1] * n), experts,
                   list(messages), seal)


def tokens(spans):
    return [s for s in spans if s["kind"] == "token"]


# ------------------------------------------------------------------ rollout stepper
def test_stepper_keeps_and_shows_episodes_and_groups():
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 6, "b": 6}'}}]}
    msgs = [SYS, USER, call, {"role": "tool", "content": "12"}, {"role": "assistant", "content": "It is 12."}]
    one = Trajectory([seg([1, 2], [0, 1], seal="history_rewritten"), seg([3, 4], [0, 1], messages=msgs)], reward=1.0,
                     group_id="g0", episode_id="e0")
    group = [Trajectory([seg([5], [1], messages=[USER])], reward=0.25, group_id="g1", episode_id="e1"),
             Trajectory([], reward=0.0, group_id="g1", episode_id="e2", error="TimeoutError: episode took 30 s")]
    st = RolloutStepper(lambda: one, lambda: group)
    assert st.episode() is one and st.trajectories == [one]
    v = st.view.value
    # the last segment's messages are the conversation: roles, contents, the tool call with its arguments
    for text in ("system", "What is 6+6?", "add", "{&quot;a&quot;: 6, &quot;b&quot;: 6}", "tool", "It is 12.", "history_rewritten"):
        assert text in v, text
    assert "reward <b>1</b>" in v and "episode e0" in v
    st.buttons[1].click()  # the button calls .group()
    assert st.trajectories == [one, *group]
    assert "episode e2" in st.view.value and "TimeoutError: episode took 30 s" in st.view.value
    assert "episode e0" not in st.view.value  # the view shows the last step
    assert "1 failed" in st.status.value
    # an episode that talked to a summarizer beside its own conversation shows both conversations
    two = Trajectory([seg([1], [1], seal="episode_end", messages=[SYS, USER]),
                      seg([2], [1], seal="episode_end", messages=[{"role": "user", "content": "Summarize it."}])])
    html = trajectory_html(two)
    assert html.index("conversation 1 of 2") < html.index("What is 6+6?") < html.index("conversation 2 of 2") < html.index("Summarize it.")
    # an agent's rewrite: the conversation the policy was trained on before it is shown, labelled (it was
    # left out: a window agent's earlier turns were nowhere, an edited reply read as the model's)
    before = [USER, {"role": "assistant", "content": "13"}]
    after = [USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "and 7+7?"}, {"role": "assistant", "content": "14"}]
    html = trajectory_html(Trajectory([seg([1], [1], seal="assistant_changed", messages=before),
                                       seg([2], [1], seal="episode_end", messages=after)]))
    assert html.index("conversation 1 of 2 (then rewritten by the agent: assistant_changed)") < html.index(">13<") < \
        html.index("conversation 2 of 2") < html.index(">12<") < html.index(">14<")
    # the template's own seal repeats the conversation in the next segment: shown once
    html = trajectory_html(Trajectory([seg([1], [1], seal="template_rewrite", messages=before),
                                       seg([2], [1], seal="episode_end", messages=after)]))
    assert "conversation 1 of" not in html and ">13<" not in html
    # the reasoning a record keeps is shown (folded, escaped): it was dropped, a reader saw only the answer
    thinking = {"role": "assistant", "content": "5", "reasoning_content": "2 plus 3 is 5, and <b>I</b> will lie"}
    html = trajectory_html(Trajectory([seg([1], [1], seal="episode_end", messages=[USER, thinking])]))
    assert "<summary>reasoning</summary>" in html and "2 plus 3 is 5, and &lt;b&gt;I&lt;/b&gt; will lie" in html


def test_stepper_button_shows_a_failing_step():
    def boom():
        raise RuntimeError("no engine")

    st = RolloutStepper(boom, boom)
    st.buttons[0].click()
    assert "RuntimeError: no engine" in st.status.value and st.trajectories == []
    assert not st.buttons[0].disabled
    with pytest.raises(RuntimeError):  # called directly, the error reaches the caller
        st.episode()


# ------------------------------------------------------------------ segment inspector
def test_spans_colour_by_mask_logprob_version_and_experts():
    ex = np.array([[[-1, -1], [-1, -1]], [[0, 1], [2, 3]], [[5, 1], [2, 3]]], dtype=np.int16)
    s = seg([7, 8, 9], [0, 1, 1], [0.0, -0.25, -4.5], [-1, 3, 4], experts=ex)
    by_mask = tokens(token_spans(s, "loss_mask"))
    assert by_mask[0]["color"] != by_mask[1]["color"] == by_mask[2]["color"]
    by_lp = tokens(token_spans(s, "logprob"))
    assert len({t["color"] for t in by_lp}) == 3  # grey prompt, two different log-probs
    assert "logprob -0.2500" in by_lp[1]["title"] and "version 3" in by_lp[1]["title"] and "id 8" in by_lp[1]["title"]
    by_v = tokens(token_spans(s, "version"))
    assert by_v[1]["color"] != by_v[2]["color"]
    l0, l1 = tokens(token_spans(s, "experts", layer=0)), tokens(token_spans(s, "experts", layer=1))
    assert l0[1]["experts"] == [0, 1] and l0[2]["experts"] == [5, 1] and l0[1]["color"] != l0[2]["color"]
    assert l1[1]["experts"] == l1[2]["experts"] == [2, 3] and l1[1]["color"] == l1[2]["color"]
    assert "L0[0, 1] L1[2, 3]" in l0[1]["title"] and "not captured" in l0[0]["title"]
    with pytest.raises(ValueError, match="color_by"):
        token_spans(s, "entropy")


def test_seal_markers_with_reasons_between_segments():
    t = Trajectory([seg([1, 2], [0, 1], seal="history_rewritten"), seg([3], [1], seal="episode_end")])
    spans = token_spans(t)
    assert [(s["kind"], s.get("reason")) for s in spans] == [
        ("token", None), ("token", None), ("seal", "history_rewritten"), ("token", None), ("seal", "episode_end")]
    html = spans_html(spans)
    assert html.index("sealed: history_rewritten") < html.index(">3 <") < html.index("sealed: episode_end")
    assert "a compaction that kept the task" in html  # the reason's explanation is the marker's hover


@pytest.fixture(scope="module")
def fmt(moe_path):
    from workbench.toy.models import load_tokenizer

    return ChatFormat(load_tokenizer(moe_path))


def test_a_token_is_shown_by_its_own_bytes(fmt):
    """Each token decoded alone: a character split over byte tokens read U+FFFD in every view (the
    audit page, the segment inspector, the token journey), a SentencePiece piece lost its space.
    Shown by its vocabulary bytes (ChatFormat.token_bytes): a part of a character as its bytes."""
    from workbench.widgets import token_spans, token_texts

    ids = fmt.encode("Hi \U0001F600 ok")
    s = Segment(ids, [1] * len(ids), [-0.1] * len(ids), [0] * len(ids))
    texts = [x["text"] for x in token_spans(s, "loss_mask", fmt) if x["kind"] == "token"]
    assert "\ufffd" not in "".join(texts) and "\\xf0" in "".join(texts) and texts == token_texts(fmt, ids)
    assert b"".join(fmt.token_bytes(ids)).decode() == "Hi \U0001F600 ok"


def sampled_reply(fmt, digits_one_by_one: bool):
    """A one-turn segment whose reply "12" was sampled digit by digit (drift) or canonically."""
    prompt = fmt.encode(fmt.render([SYS, USER], None, True))
    reply = [fmt.tokenizer.convert_tokens_to_ids(c) for c in "12"] if digits_one_by_one else fmt.encode("12")
    s = Segment(messages=[SYS, USER, {"role": "assistant", "content": "12"}], seal_reason="episode_end")
    s.append(prompt, trainable=False)
    s.append(reply + [fmt.end_of_turn_id], trainable=True, logprobs=[-0.1] * (len(reply) + 1), versions=[0] * (len(reply) + 1))
    s.stats["retokenization_drift"] = 2 if digits_one_by_one else 0
    return s, len(prompt)


def test_drift_positions_marked_where_ids_do_not_round_trip(fmt):
    s, p = sampled_reply(fmt, digits_one_by_one=True)
    assert drift_positions(s, fmt) == [p, p + 1]  # "1","2" where the template text gives "12"
    spans = tokens(token_spans(s, tokenizer=fmt.tokenizer))  # a plain HF tokenizer works too
    assert [t["index"] for t in spans if t["drift"]] == [p, p + 1]
    assert spans[p]["text"] == "1" and "retokenization drift" in spans[p]["title"]
    assert spans_html(spans).count("outline:2px solid") == 2
    clean, _ = sampled_reply(fmt, digits_one_by_one=False)
    assert drift_positions(clean, fmt) == []
    ins = SegmentInspector(s, tokenizer=fmt)
    assert f"[{p}, {p + 1}]" in ins.summary.value and "outline:2px solid" in ins.tokens.value


def test_drift_positions_of_a_long_repetitive_segment_align_by_characters(fmt, monkeypatch):
    """difflib's exact match is quadratic on repetitive ids (a policy looping one sentence): the
    inspector and each audit view of a 4.9k-token segment took 5.8 s, 9.8k tokens 50 s. Past
    EXACT_DIFF_PAIRS the tokens align by their character spans (linear): the same positions here."""
    import workbench.widgets as widgets

    reply = "The answer is 12. " * 40
    msgs = [USER, {"role": "assistant", "content": reply}]
    ids = fmt.encode(fmt.render(msgs, None, add_generation_prompt=False))
    twelve = [i for i, t in enumerate(ids) if fmt.decode([t]) in ("12", " 12")][::7]
    sampled = []
    for i, t in enumerate(ids):  # some "12"s sampled digit by digit
        sampled += [fmt.tokenizer.convert_tokens_to_ids(c) for c in fmt.decode([t]).replace(" ", "Ġ")] if i in twelve else [t]
    seg = Segment(sampled, [1] * len(sampled), [-0.1] * len(sampled), [0] * len(sampled), None, msgs, "episode_end")
    exact = drift_positions(seg, fmt)
    monkeypatch.setattr(widgets, "EXACT_DIFF_PAIRS", 0)
    assert drift_positions(seg, fmt) == exact and len(exact) >= 2 * len(twelve) > 0


def test_inspector_without_tokenizer_shows_recorded_drift_and_switches_colour():
    s = seg([5, 6, 7], [0, 1, 1], [0.0, -0.1, -3.0], [-1, 0, 1])
    s.stats = {"retokenization_drift": 4}
    ins = SegmentInspector(Trajectory([s]))
    assert "retokenization drift (recorded): 4" in ins.summary.value and "give a tokenizer" in ins.summary.value
    assert not any(t["drift"] for t in tokens(ins.spans))
    before = ins.tokens.value
    assert tokens(ins.spans)[1]["color"] == tokens(ins.spans)[2]["color"]  # both sampled
    ins.color_by.value = "logprob"  # the dropdown redraws
    assert tokens(ins.spans)[1]["color"] != tokens(ins.spans)[2]["color"] and ins.tokens.value != before
    assert "log-prob" in ins.summary.value


# ------------------------------------------------------------------ monitors
HISTORY = [
    {"step": 0, "gate_pass_ratio": 1.0, "kl_k1": 0.01, "kl_k3": 0.02, "kl_k3_current": 0.02, "max_abs_delta_p": 0.1,
     "replay_disagree_rate": 0.0, "kl_k3_live": 0.05},
    {"step": 1, "gate_pass_ratio": 0.75, "kl_k3": 0.03, "kl_k3_current": 0.03, "max_abs_delta_p": 0.2, "replay_disagree_rate": 0.125},
    {"step": 2, "gate_pass_ratio": 0.5, "kl_k1": 0.02, "kl_k3": 0.04, "kl_k3_current": 0.035, "max_abs_delta_p": 0.3,
     "replay_disagree_rate": 0.25,
     "kl_k3_live": 0.5, "staleness_hist": {"1": 10, "0": 30}, "tokens_per_version": {3: 10, 4: 30},
     "replay_disagree_per_layer": [0.5, 0.0, 0.25], "is_weight_hist": {"edges": [0.0, 1.0, 2.0], "counts": [3, 4]}},
]


def test_gate_monitor_traces_equal_the_history():
    mon = GateMonitor()
    mon.update(HISTORY)
    for key in ("gate_pass_ratio", "kl_k3", "max_abs_delta_p"):
        assert list(mon.trace(key).x) == [0, 1, 2] and list(mon.trace(key).y) == [m[key] for m in HISTORY]
    assert list(mon.trace("kl_k1").y) == [0.01, None, 0.02]  # a missing value is a gap
    assert list(mon.trace("staleness_hist").x) == [0, 1] and list(mon.trace("staleness_hist").y) == [30, 10]
    assert list(mon.trace("tokens_per_version").x) == [3, 4] and list(mon.trace("tokens_per_version").y) == [10, 30]
    assert list(mon.trace("is_weight_hist").y) == [3, 4]
    mon.on_step({"step": 3, "token_keep_ratio": 0.6})  # a token-level mask's rejections: on the gate's panel
    assert list(mon.trace("token_keep_ratio").y) == [None, None, None, 0.6]
    # a run after wb.restore() to step 2: its steps replace the abandoned branch's (the line ran back over them)
    mon.on_step({"step": 2, "token_keep_ratio": 0.5})
    assert list(mon.trace("token_keep_ratio").x) == [0, 1, 2] and list(mon.trace("token_keep_ratio").y) == [None, None, 0.5]
    mon.update([{"step": 0, "loss": 1.0}])  # an older history without these keys
    assert list(mon.trace("kl_k3").y) == [None] and list(mon.trace("staleness_hist").y) == []


def test_replay_monitor_tolerates_missing_keys_and_writes_html(tmp_path):
    mon = ReplayMonitor(HISTORY[:2])
    assert list(mon.trace("replay_disagree_rate").y) == [0.0, 0.125]
    assert list(mon.trace("kl_k3_live").y) == [0.05, None] and list(mon.trace("replay_disagree_per_layer").y) == []
    mon.on_step(HISTORY[2])
    # replayed vs live k3, both on the trained version's own tokens (kl_k3 adds the stale ones' drift)
    assert mon.history == HISTORY and list(mon.trace("kl_k3_current").y) == [0.02, 0.03, 0.035]
    assert list(mon.trace("replay_disagree_per_layer").x) == [0, 1, 2]
    assert list(mon.trace("replay_disagree_per_layer").y) == [0.5, 0.0, 0.25]
    page = mon.write_html(tmp_path / "out" / "replay.html").read_text()
    assert "replay_disagree_rate" in page and "0.125" in page
    assert len(page) > 1_000_000  # plotly.js inlined: opens offline



def test_monitor_view_is_the_whole_figure_for_views_made_at_any_time():
    # the displayed output is replaced whole at every step, so a view made late (Run All: the
    # browser builds it while the kernel is busy with the run) or reopened draws every point
    gate = GateMonitor()
    for m in HISTORY:
        gate.on_step(m)
    (out,) = gate.view.outputs
    fig = out["data"]["application/vnd.plotly.v1+json"]
    state = {t["meta"]: t for t in fig["data"]}
    assert list(state["gate_pass_ratio"]["y"]) == [1.0, 0.75, 0.5] and list(state["kl_k1"]["y"]) == [0.01, None, 0.02]
    assert list(state["staleness_hist"]["x"]) == [0, 1] and list(state["is_weight_hist"]["y"]) == [3, 4]
    assert fig["layout"]["xaxis4"]["dtick"] == 1 and fig["layout"]["xaxis6"]["tickangle"] == -45
    assert out["data"]["text/plain"] == "GateMonitor: 3 step(s), last step 2"
    replay = ReplayMonitor(HISTORY)
    state = {t["meta"]: t for t in replay.view.outputs[0]["data"]["application/vnd.plotly.v1+json"]["data"]}
    assert list(state["replay_disagree_rate"]["y"]) == [0.0, 0.125, 0.25]
    assert list(state["replay_disagree_per_layer"]["y"]) == [0.5, 0.0, 0.25]
    # no anywidget (plotly's 5 MB JS bundle) among the widgets a saved notebook would store
    assert not any(type(w).__name__ == "FigureWidget" for w in (gate.view, *gate.children))


def test_static_rendering_and_titled_pages(tmp_path):
    gate = GateMonitor(HISTORY)
    bundle = gate.static()._repr_mimebundle_()
    svg = bundle["image/svg+xml"]
    # an SVG with every subplot title and one marker per recorded point of each line series
    assert svg.startswith("<svg") and all(t.replace("|", "|") in svg for t in ("gate pass ratio", "IS weights (last step)"))
    assert svg.count("<circle") == 3 + 2 + 3 + 3 + 3  # gate_pass_ratio, kl_k1 (one gap), kl_k3, kl_k3_current, max_abs_delta_p
    assert "step 2: 0.5" in svg and "tokens per version" in svg and bundle["text/plain"] == "GateMonitor: 3 step(s)"
    assert "<circle" not in GateMonitor().static().svg and "no data" in GateMonitor().static().svg
    # a step where no episode finished (reward_mean NaN) is a gap: the range and every point stay numbers
    # (NaN in a points list cut the line there in a browser, or hid it whole when first)
    reward = RewardMonitor([{"step": 0, "reward_mean": math.nan}, {"step": 1, "reward_mean": 0.4},
                            {"step": 2, "reward_mean": math.nan}, {"step": 3, "reward_mean": 0.6},
                            {"step": 4, "reward_mean": 0.7}])
    svg = reward.static().svg
    lines = re.findall(r"<polyline [^>]*points='([^']*)'", svg)
    assert len(lines) == 2 and all("nan" not in p for p in lines) and [len(p.split()) for p in lines] == [1, 2]
    assert svg.count("<circle") == 3 and "step 2: nan" in svg
    # wb.eval()'s records (before training: step -1, and after the last step) on the evaluation plot: a run
    # evaluated only so drew it empty
    evaluated = RewardMonitor([{"step": 0, "reward_mean": 0.2}, {"step": 1, "reward_mean": 0.4}],
                              evals=[{"step": -1, "eval_pass@1": 0.25}, {"step": 1, "eval_pass@1": 0.5}])
    assert list(evaluated.trace("eval_pass@1").x) == [-1, 0, 1] and list(evaluated.trace("eval_pass@1").y) == [0.25, None, 0.5]
    assert list(evaluated.trace("reward_mean").y) == [None, 0.2, 0.4] and len(evaluated.history) == 2
    # every value NaN (a diverged run): its markers and a note, not "no data" as if unmeasured
    diverged = RewardMonitor([{"step": s, "reward_mean": math.nan} for s in range(3)]).static().svg
    assert "not finite: nan" in diverged and diverged.count("step 1: nan") == 1
    # the step axis in whole steps (read 1.23e+03 for step 1234)
    long_run = RewardMonitor([{"step": s, "reward_mean": 0.5} for s in (0, 1005, 1234)]).static().svg
    assert ">1234</text>" in long_run and "e+03" not in long_run
    fig = reward.view.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert {t["meta"]: t.get("connectgaps") for t in fig["data"]}["reward_mean"] is not True
    page = gate.write_html(tmp_path / "plots" / "gate.html", include_plotlyjs="directory", title="IS gate <per step>")
    text = page.read_text()
    assert "<title>IS gate &lt;per step&gt;</title>" in text and (tmp_path / "plots" / "plotly.min.js").is_file()
    assert "<title>GateMonitor: gate pass ratio" in gate.write_html(tmp_path / "g2.html", include_plotlyjs=False).read_text()


# ------------------------------------------------------------------ a run is independent of its views
class FailingView:
    """A view whose comm fails, as ipykernel's did after an interrupt (a fault we cannot cause)."""

    def __init__(self, after: int = 0):
        self.calls, self.after = 0, after

    def on_step(self, metrics):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("Socket operation on non-socket")


def test_views_catch_count_report_once_and_detach_a_failing_view():
    said, bad, gate = [], FailingView(after=1), GateMonitor()
    views = Views([bad, gate], report=said.append)
    for m in HISTORY:
        views.on_step(m)
    views.on_end()
    assert views.errors == 1 and bad.calls == 2  # failed on its 2nd step, never called again
    assert views.views == [gate] and views.detached[0][0] is bad
    assert len(said) == 1 and "FailingView" in said[0] and "Socket operation on non-socket" in said[0]
    assert gate.history == HISTORY  # the other views go on


def test_a_run_survives_a_failing_view_and_an_interrupted_wait(ray_local, moe_path, tmp_path, capfd):
    """A real session (reference engine, one trainer rank): a view that raises in on_step is
    detached and the run trains every step; an interrupt during wait() (a real SIGINT, as JupyterLab
    sends it) interrupts the wait only (the run goes on on its trainer rank, the message names wb.stop(),
    a later wait() waits for the end); re-running wb.run() before the interrupted run
    is collected is refused; after wb.shutdown() the stepper says the session is shut down."""
    import signal
    import threading

    import psutil

    import workbench

    wb = workbench.connect(backend="reference", trainer_ranks=1, run_dir=str(tmp_path / "run"),
                           loop={"prompts_per_step": 2, "group_size": 2})
    try:
        gate, bad = GateMonitor(), FailingView()
        release = threading.Event()  # holds the run at step 0 until the interrupt has been handled

        class Hold:
            def on_step(self, metrics):
                release.wait(60)

        run = wb.run(3, monitors=[bad, gate, Hold()])
        # the notebook's stop button while the cell waits: JupyterLab's interrupt is a real SIGINT to the
        # kernel's process group (jupyter_client's LocalProvisioner.send_signal: os.killpg). Here the
        # group holds this test's runner too, so the signal goes to the members a kernel's group holds:
        # this process and the Ray processes it started in it (Ray's workers run in their own groups).
        def interrupt():
            group = [p.pid for p in psutil.Process().children(recursive=True) if _pgid(p.pid) == os.getpgid(0)]
            for pid in [*group, os.getpid()]:
                os.kill(pid, signal.SIGINT)

        # Python's own handler, as a kernel has one: a shell that starts pytest in the background
        # (`cmd &`) leaves SIGINT ignored, and Python then keeps it ignored
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            threading.Timer(1.0, interrupt).start()  # the run is held at step 0 until release
            with pytest.raises(KeyboardInterrupt):
                run.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
        assert run.interrupted and not run.done
        release.set()
        with pytest.raises(RuntimeError, match=r"interrupted while waiting .*wb.wait\(\) collects it"):
            wb.run(3)  # re-running the run cell does not silently train again
        hist = wb.wait(600)
        assert [h["step"] for h in hist] == [0, 1, 2] and run.error is None and run.collected
        assert run.views.errors == 1 and bad.calls == 1 and gate.history == hist
        err = capfd.readouterr()
        assert err.out.count("interrupted the wait, not the run") == 1 and "wb.stop()" in err.out
        assert err.err.count("FailingView") == 1  # reported once
        assert "RunHandle(done, 3/3 steps)" == repr(run)
        again = wb.run(1, progress=False)  # collected: a new run may start, and counts its own steps
        assert again.wait(600)[0]["step"] == 3 and repr(again) == "RunHandle(done, 1/1 steps, from step 3)"
        stepper = wb.stepper()
    finally:
        wb.shutdown()
    stepper.buttons[0].click()
    assert "shut down" in stepper.status.value and "workbench.connect" in stepper.status.value
    with pytest.raises(RuntimeError, match="shut down"):
        wb.run(1)


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


# ------------------------------------------------------------------ token journey
def report():
    return {
        "input_ids": torch.tensor([[11, 12, 13, 14], [21, 22, 23, 0]]),
        "loss_mask": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.float32),
        "behaviour_logprobs": torch.tensor([[0.0, 0.0, -0.5, -1.0], [0.0, -0.2, -0.3, 0.0]]),
        "versions": torch.tensor([[-1, -1, 3, 4], [-1, 2, 2, -1]]),
        "trainer_logprobs": torch.tensor([[-9.0, -9.0, -0.6, -1.0], [-9.0, -0.2, -0.4, -9.0]]),
        "is_weight": torch.tensor([[0.0, 0.0, 0.905, 1.0], [0.0, 1.0, 0.0, 0.0]]),
        "gate_keep": torch.tensor([[False, False, True, True], [False, True, False, False]]),
        "advantages": torch.tensor([[0.0, 0.0, 0.7, 0.7], [0.0, -0.7, -0.7, 0.0]]),
        "loss_contribution": torch.tensor([[0.0, 0.0, -0.01, -0.02], [0.0, 0.03, 0.0, 0.0]]),
        "routed_experts": torch.arange(2 * 4 * 2 * 2).reshape(2, 4, 2, 2),
    }


def test_journey_values_equal_the_report():
    r = report()
    j = journey(r, 0, 2)
    assert j["token_id"] == 13 and j["version"] == 3 and j["gate_keep"] is True
    for name, key in (("behaviour_logprob", "behaviour_logprobs"), ("trainer_logprob", "trainer_logprobs"),
                      ("is_weight", "is_weight"), ("advantage", "advantages"), ("loss_contribution", "loss_contribution")):
        assert j[name] == pytest.approx(float(r[key][0, 2])), name
    assert j["experts"] == r["routed_experts"][0, 2].tolist()
    assert j["ratio"] == pytest.approx(np.exp(-0.1), rel=1e-5)
    assert journey(r, 1, 2)["gate_keep"] is False
    r["gate_keep"] = torch.tensor([True, False])  # the gate decides per sequence: [B] works too
    r["advantages"] = [0.5, -0.5]
    assert journey(r, 1, 1)["gate_keep"] is False and journey(r, 1, 1)["advantage"] == -0.5
    # a broken engine's token, 800 nats off: shown with an infinite ratio (exp raised OverflowError)
    r["behaviour_logprobs"][0, 2] = -800.0
    assert journey(r, 0, 2)["ratio"] == float("inf")


def test_journey_refuses_prompt_tokens_out_of_range_and_missing_columns():
    r = report()
    with pytest.raises(ValueError, match=r"\(0, 1\) has loss_mask 0"):
        journey(r, 0, 1)
    with pytest.raises(IndexError, match=r"\[B, T\] = \[2, 4\]"):
        journey(r, 0, 4)
    with pytest.raises(IndexError):
        journey(r, -1, 2)
    del r["is_weight"]
    with pytest.raises(KeyError, match="is_weight"):
        journey(r, 0, 2)


def test_token_journey_widget(fmt):
    tj = TokenJourney(report(), 1, 1, tokenizer=fmt)
    assert tj.values["token_id"] == 22 and tj.values["text"] == fmt.decode([22])
    assert "-0.2" in tj.table.value and "policy version that sampled it" in tj.table.value
    tj.col.value = 0  # a prompt token: the widget says why instead of failing
    assert "loss_mask 0" in tj.table.value and tj.values["token_id"] == 22
    tj.col.value = 2
    assert tj.values["token_id"] == 23
    tj.show(0, 3)  # from code: the row/col boxes follow
    assert (tj.row.value, tj.col.value, tj.values["token_id"]) == (0, 3, 14)
    with pytest.raises(ValueError):
        TokenJourney(report(), 0, 0)


def test_inspector_keys_its_colours_and_hides_experts_without_captures():
    from workbench.widgets import SegmentInspector

    seg = Segment([5, 6, 7, 8], [0, 1, 1, 1], [0.0, -0.5, -1.0, -2.0], [-1, 3, 3, 4])
    ins = SegmentInspector(seg, color_by="version")
    assert "experts" not in ins.color_by.options and ins.moe_layer.layout.display == "none"
    assert ">v3<" in ins.summary.value and ">v4<" in ins.summary.value  # a swatch per version present
    seg.routed_experts = np.array([[[1, 2]], [[3, 4]], [[3, 5]], [[13, 0]]], dtype=np.int16)
    ins = SegmentInspector(seg, color_by="experts")
    assert ">E1<" in ins.summary.value and ">E13<" in ins.summary.value and "repeat every" in ins.summary.value


def test_inspector_boxes_tokens_and_a_click_opens_the_journey():
    from workbench.widgets import find_row, recorded_journey

    ex = np.array([[[-1, -1]], [[-1, -1]], [[4, 5]], [[6, 7]]], dtype=np.int16)
    s = seg([11, 12, 13, 14], [0, 0, 1, 1], [0.0, 0.0, -0.5, -1.0], [-1, -1, 3, 4], experts=ex)
    t = Trajectory([s], episode_id="ep7")
    r = report()
    r["routed_experts"] = torch.tensor(np.stack([ex, ex]))
    ins = SegmentInspector(t, report=r)
    html = ins.tokens.value
    # each token its own box (adjacent tokens of one colour stay apart), addressed by data-i
    assert html.count("border:1px solid") == 4 and [f"data-i='{i}'" in html for i in range(4)] == [True] * 4
    assert "logprob -0.5000" in html and "version 3" in html and "experts L0[4, 5]" in html  # the hover card's text
    assert find_row(r, s) == 0 and find_row(r, seg([21, 22, 23], [0, 1, 1])) == 1 and find_row(r, seg([99], [1])) is None
    # a shorter segment whose turn begins another episode's longer row is not that row (its advantage showed)
    assert find_row(r, seg([11, 12, 13], [0, 0, 1])) is None
    ins.tokens.selected = 2  # what a click in the browser sets
    (view,) = ins.journey.children
    assert isinstance(view, TokenJourney) and (view.row.value, view.col.value) == (0, 2)
    assert view.values["token_id"] == 13 and view.values["trainer_logprob"] == pytest.approx(-0.6)
    assert "episode ep7, segment 0, token 2" in view.heading.value and "sampled columns of row 0: 2-3" in view.heading.value
    ins.open_token(0)  # a prompt token: what was recorded, and why there is no more
    assert "not sampled by the policy" in ins.journey.children[0].value and ins.tokens.selected == 0
    bare = SegmentInspector(t)  # no training step yet: the recorded part of the journey
    bare.open_token(3)
    assert "recorded at sampling time" in bare.journey.children[0].value and "-1" in bare.journey.children[0].value
    rec = recorded_journey(s, 3)
    assert (rec["token_id"], rec["behaviour_logprob"], rec["version"], rec["experts"]) == (14, -1.0, 4, [[6, 7]])
    assert rec["trainer_logprob"] is None and recorded_journey(s, 0)["experts"] is None


def test_the_journey_finds_an_episodes_own_row_when_another_holds_the_same_ids():
    """Two episodes of one task in two groups with the same reply: the same ids and loss mask,
    each its own group's advantage. The row was found by content, the first one's: the journey of
    the second showed the other's advantage (of the other sign here)."""
    from workbench.loop import batch_from_groups
    from workbench.widgets import find_row

    def ep(eid, reply, reward):
        return Trajectory([seg([5, 6] + reply, [0, 0] + [1] * len(reply), versions=[0] * (2 + len(reply)))], reward, episode_id=eid)

    groups = [[ep("a", [9, 2], 1.0), ep("b", [7], 0.0)], [ep("c", [9, 2], 0.0), ep("d", [8], 1.0)]]
    batch, _ = batch_from_groups(groups, "grpo")
    assert batch["row_keys"] == [("a", 0), ("b", 0), ("c", 0), ("d", 0)]
    r = {k: batch[k] for k in ("input_ids", "loss_mask", "advantages")} | {"row_keys": batch["row_keys"]}
    c = groups[1][0]
    row = find_row(r, c.segments[0], ("c", 0))
    assert row == 2 and float(r["advantages"][row, 2]) < 0 < float(r["advantages"][0, 2])
    assert find_row(r, c.segments[0], ("z", 0)) is None and find_row(r, c.segments[0]) == 0  # (by content: the first)
    report_ = {k: batch[k] for k in ("input_ids", "loss_mask", "advantages", "behaviour_logprobs", "versions")}
    zeros = torch.zeros_like(batch["behaviour_logprobs"])
    report_.update(row_keys=batch["row_keys"], trainer_logprobs=batch["behaviour_logprobs"], is_weight=zeros + 1,
                   gate_keep=zeros.bool(), loss_contribution=zeros)
    ins = SegmentInspector(c, report=report_)
    ins.open_token(3)  # c's first sampled token: its own row's journey
    (view,) = ins.journey.children
    assert isinstance(view, TokenJourney) and view.row.value == 2


def test_monitor_legends_axes_and_a_single_step_as_numbers():
    gate = GateMonitor(HISTORY[:1])
    layout = gate.fig.layout
    assert layout.xaxis.title.text == "step" and layout.yaxis.title.text == "pass ratio" and list(layout.yaxis.range) == [0, 1.05]
    assert layout.xaxis4.title.text == "versions behind" and layout.yaxis.tickformat == ".3~g"
    assert gate.trace("gate_pass_ratio").name.startswith("gate pass ratio: share of sequences")
    one = gate.trace("kl_k3")
    assert one.mode == "markers+text" and list(one.text) == ["0.02"]  # one step: its value written, not a lone dot
    gate.on_step(HISTORY[1])
    assert gate.trace("kl_k3").mode == "lines+markers" and gate.trace("kl_k3").text is None
    replay = ReplayMonitor()
    assert "(from 0)" in replay.trace("replay_disagree_rate").name and replay.fig.layout.xaxis2.title.text == "MoE layer"


def test_a_monitor_names_a_non_finite_value():
    """NaN and inf reach the browser as null (plotly's JSON), a gap like a step not measured: the
    monitor names them in its title instead; finite again, the title goes."""
    gate = GateMonitor(HISTORY[:1])
    assert not gate.fig.layout.title.text
    gate.on_step({**HISTORY[1], "step": 1, "kl_k3": float("nan")})
    assert "not finite" in gate.fig.layout.title.text and "step 1" in gate.fig.layout.title.text
    assert gate.trace("kl_k3").y[-1] is None or math.isnan(gate.trace("kl_k3").y[-1])
    gate.update(HISTORY[:2])
    assert not gate.fig.layout.title.text
    # a reward NaN is a step where no episode finished (measured nothing): said so, not in red as a divergence
    reward = RewardMonitor([{"step": 0, "reward_mean": 0.5, "correct_rate": 0.5}])
    reward.on_step({"step": 1, "reward_mean": float("nan"), "correct_rate": float("nan"), "failed_episodes": 8})
    assert reward.fig.layout.title.text == "no episode finished at step 1 (failed_episodes says why)"
    # non-finite IS weights are said by the monitor that draws their histogram, not by the reward one
    odd = {"step": 2, "reward_mean": 0.5, "correct_rate": 0.5, "is_weight_hist": {"edges": [0.0, 1.0], "counts": [1], "nonfinite": 2}}
    reward.on_step(odd)
    assert "IS weight" not in (reward.fig.layout.title.text or "")
    gate.on_step({**HISTORY[1], **odd})
    assert "2 IS weight(s) at step 2" in gate.fig.layout.title.text


def test_drift_views_render_the_tools_the_segment_declared(fmt, tmp_path):
    """A tool agent's segment records the tools its requests declared (and keeps them through
    parquet): the drift view re-renders with them. Without, the template's tool block was missing
    from the re-render and the whole system prompt showed as retokenization drift."""
    from workbench.rollout.engine import Sample
    from workbench.tokens import Accumulator, read_trajectories, write_trajectories
    from workbench.toy.tasks import CALC_TOOL
    from workbench.widgets import drift_positions

    acc = Accumulator(fmt)
    msgs = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "2+3?"}]
    plan = acc.plan(msgs, [CALC_TOOL])
    ids = fmt.encode("5") + [fmt.end_of_turn_id]
    seg = acc.record(plan, Sample([], ids, [-0.1] * len(ids), [0] * len(ids), "stop"), {"role": "assistant", "content": "5"})
    assert seg.tools == [CALC_TOOL] and drift_positions(seg, fmt) == []
    assert len(drift_positions(seg, fmt, tools=[])) > 20  # what the view showed before: the tool block as drift
    (back,) = read_trajectories(write_trajectories([Trajectory([seg], episode_id="e")], tmp_path / "t.parquet"))
    assert back.segments[0].tools == [CALC_TOOL] and back.segments[0].copy().tools == [CALC_TOOL]


def test_a_long_runs_monitor_redraws_at_most_every_few_seconds_and_at_the_end():
    """Each redraw sends every step's points to the browser: at every step of a long run that was
    O(steps) on the training thread (111 ms and 924 kB a step at 5,000 steps, per monitor). Past
    REDRAW_ALWAYS steps a monitor redraws at most every REDRAW_S seconds, and the run's end
    (on_end, which the run's views get) draws what was left out."""
    mon = GateMonitor()
    mon.REDRAW_ALWAYS, mon.REDRAW_S = 2, 3600.0
    for step in range(5):
        mon.on_step({"step": step, "gate_pass_ratio": 1.0 - step / 10})
    shown = lambda: mon.view.outputs[0]["data"]["text/plain"]  # noqa: E731
    assert shown() == "GateMonitor: 2 step(s), last step 1" and len(mon.history) == 5
    mon.on_end()
    assert shown() == "GateMonitor: 5 step(s), last step 4" and list(mon.trace("gate_pass_ratio").y)[-1] == 0.6
    mon.on_step({"step": 5, "gate_pass_ratio": 0.5})  # fed without a run's end: a saved view draws it anyway
    mon.static()
    assert list(mon.trace("gate_pass_ratio").y)[-1] == 0.5


def test_token_views_re_render_with_the_profiles_format():
    """The inspector, the audit page and wb.revisit re-rendered a segment's messages with the bare
    tokenizer: Llama 3's date_string (the profile's template kwargs) fell back to the template's own
    date, and every segment's date tokens showed as retokenization drift that was not there. The
    session's views render with its profile's ChatFormat (Workbench._view_format)."""
    from workbench.real_models import load_family
    from workbench.session import Workbench
    from workbench.tokens import ChatFormat, Segment

    fam = load_family("llama3.1")
    profile = fam.profile().replace(chat_template_kwargs={"date_string": "01 Jan 2025"})  # (profiles.py's llama3 sets one)
    server_fmt = ChatFormat.for_profile(fam.tokenizer, profile)  # what the loopback server renders with
    msgs = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]
    ids = server_fmt.encode(server_fmt.render(msgs, None, add_generation_prompt=False))
    seg = Segment(ids, [0] * len(ids), [0.0] * len(ids), [-1] * len(ids), messages=msgs, seal_reason="episode_end")
    assert drift_positions(seg, fam.tokenizer) != []  # (the bare tokenizer's render: the template's own date)
    wb = object.__new__(Workbench)
    wb.tokenizer, wb.profile = fam.tokenizer, profile
    assert drift_positions(seg, wb._view_format()) == []
