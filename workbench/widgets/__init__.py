"""Notebook widgets: rollout stepper, segment inspector, gate and replay monitors, token journey.

Every widget takes plain data or plain callables, never a session object, so the session API
wires them up and tests drive them headless (ipywidgets run outside a kernel on a dummy comm).
What a widget shows is computed by a pure function (`trajectory_html`, `token_spans`,
`drift_positions`, `journey`) or kept in plain attributes (`.trajectories`, `.spans`,
`.history`, the figures' trace data), so tests assert on the logic, not on pixels.
"""

from __future__ import annotations

import difflib
import json
import math
import threading
from html import escape
from pathlib import Path
from typing import Callable

import anywidget
import ipywidgets as W
import traitlets

from ..tokens import REASONING_KEYS, SEAL_REASONS, ChatFormat, Segment, Trajectory, canonical_message, text_units

GREY = "#e6e6e6"
PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
           "#b3de69", "#fccde5", "#bc80bd", "#ccebc5", "#ffed6f", "#a6cee3")
COLOR_BY = ("loss_mask", "logprob", "version", "experts")
LEGEND = {
    "loss_mask": "green: sampled by the policy (trained on); grey: prompt, template and tool tokens",
    "logprob": "sampled tokens from green (log-prob 0) to red (log-prob <= -5); grey: not sampled",
    "version": "one colour per policy version that sampled the token; grey: not sampled",
    "experts": "colour of the first routed expert at the chosen MoE layer; grey: not captured",
}
ROLE_COLOR = {"system": "#777", "user": "#1f6feb", "assistant": "#1a7f37", "tool": "#9a6700"}


def _fmt(tokenizer) -> ChatFormat | None:
    """A ChatFormat from a ChatFormat or a fast HF tokenizer (None stays None)."""
    return tokenizer if tokenizer is None or isinstance(tokenizer, ChatFormat) else ChatFormat(tokenizer)


def token_texts(fmt: ChatFormat, ids: list[int]) -> list[str]:
    """Each token's own text, from its vocabulary bytes (ChatFormat.token_bytes): decoded alone, a
    SentencePiece piece lost its leading space (words ran together) and a character split over
    byte tokens read U+FFFD; such a part is shown as its bytes (\\xf0\\x9f), the whole character
    once its bytes are joined."""
    try:
        return [b.decode("utf-8", "backslashreplace") for b in fmt.token_bytes(list(ids))]
    except Exception:  # (a tokenizer whose pieces cannot be read so: decoded one by one)
        return [fmt.decode([i]) for i in ids]


def _segments(obj) -> list[Segment]:
    return obj.segments if isinstance(obj, Trajectory) else [obj]


# ------------------------------------------------------------------ rollout stepper
AGENT_REWRITES = ("history_rewritten", "assistant_changed")  # seals after which the next segment is another conversation


def trajectory_html(t: Trajectory) -> str:
    """One trajectory as HTML: header (ids, reward, seals, error) and its conversations. The
    messages of a conversation's last segment are the whole conversation (the template's seals
    and a stop string's repeat it in the next segment); a segment the agent's rewrite sealed
    (history_rewritten, assistant_changed) is shown too, as what the policy was trained on before
    the agent changed it (left out, a window agent's earlier turns were nowhere, and an edited
    reply read as the model's); an episode that talked to several conversations (a summarizer beside
    the agent: Accumulator.open_conversations) shows each."""
    seals = ", ".join(s.seal_reason or "open" for s in t.segments)
    sampled = sum(sum(s.loss_mask) for s in t.segments)
    out = [f"<div style='border-left:3px solid #ccc;padding-left:6px;margin:6px 0'><b>episode {escape(t.episode_id)}</b> "
           f"group {escape(t.group_id)} · reward <b>{t.reward:.4g}</b> · {len(t.segments)} segment(s) ({escape(seals)}) "
           f"· {sampled} sampled tokens"]
    if t.error:
        out.append(f"<pre style='color:#c00;white-space:pre-wrap'>error: {escape(t.error)}</pre>")
    # each conversation's last segment (a record that never closed shows its last segment)
    ends = [s for s in t.segments if s.seal_reason in (None, "episode_end", "evicted") + AGENT_REWRITES] or t.segments[-1:]
    for k, seg in enumerate(ends):
        if len(ends) > 1:
            then = (f" (then rewritten by the agent: {seg.seal_reason})" if seg.seal_reason in AGENT_REWRITES else "")
            out.append(f"<div style='margin:4px 0;color:#666'>conversation {k + 1} of {len(ends)}{escape(then)}</div>")
        for raw, m in zip(seg.messages, map(canonical_message, seg.messages)):
            # the reasoning the record keeps (canonical_message's default form drops it: a reader checking a
            # reward hack saw only the final answer), folded
            thought = next((raw[k] for k in REASONING_KEYS if isinstance(raw.get(k), str) and raw[k]), None)
            thought = (f"<details style='color:#666'><summary>reasoning</summary><span style='white-space:pre-wrap'>"
                       f"{escape(thought)}</span></details>" if thought else "")
            calls = "".join(f"<div>&rarr; tool call <code>{escape(tc['function']['name'])}"
                            f"({escape(json.dumps(tc['function']['arguments']))})</code></div>" for tc in m.get("tool_calls", []))
            out.append(f"<div style='margin:2px 0 2px 8px'><b style='color:{ROLE_COLOR.get(m['role'], '#000')}'>{escape(m['role'])}</b> "
                       f"{thought}<span style='white-space:pre-wrap'>{escape(m['content'])}</span>{calls}</div>")
    return "".join(out) + "</div>"


class RolloutStepper(W.VBox):
    """Buttons "one episode" / "one group". `.trajectories` keeps everything stepped; the view
    shows the last step. `.episode()` / `.group()` are what the buttons call."""

    def __init__(self, step_episode: Callable[[], Trajectory], step_group: Callable[[], list[Trajectory]]):
        super().__init__()
        self._step_episode, self._step_group = step_episode, step_group
        self.trajectories: list[Trajectory] = []
        self.buttons = (W.Button(description="one episode"), W.Button(description="one group"))
        self.buttons[0].on_click(lambda _: self._click(self.episode))
        self.buttons[1].on_click(lambda _: self._click(self.group))
        self.status, self.view = W.HTML(), W.HTML()
        self.children = [W.HBox(list(self.buttons)), self.status, self.view]

    def episode(self) -> Trajectory:
        return self._show([self._step_episode()])[0]

    def group(self) -> list[Trajectory]:
        return self._show(list(self._step_group()))

    def _click(self, step):
        # An exception in a button callback only reaches the kernel log: show it where the user looks.
        self.status.value, self.buttons[0].disabled, self.buttons[1].disabled = "<i>running...</i>", True, True
        try:
            step()
        except Exception as e:
            self.status.value = f"<b style='color:#c00'>{escape(type(e).__name__)}: {escape(str(e))}</b>"
        finally:
            self.buttons[0].disabled = self.buttons[1].disabled = False

    def _show(self, trajs: list[Trajectory]) -> list[Trajectory]:
        self.trajectories += trajs
        rewards = ", ".join(f"{t.reward:.3g}" for t in trajs)
        failed = sum(t.error is not None for t in trajs)
        self.status.value = (f"stepped {len(trajs)} (rewards {rewards}; {failed} failed); "
                             f"{len(self.trajectories)} trajectories in total")
        self.view.value = "".join(trajectory_html(t) for t in trajs)
        return trajs


# ------------------------------------------------------------------ segment inspector
def drift_positions(segment: Segment, tokenizer, tools: list | None = None) -> list[int]:
    """Positions of `segment.token_ids` that re-rendering `segment.messages` (with `tools`, else the
    tools the segment's requests declared) through the chat template and re-tokenizing does not
    reproduce: where a text-based pipeline would train on other ids than the ones sampled
    (tokens.retokenization_drift counts the sampled part). Without the tools a tool agent's whole
    system prompt showed as drift."""
    if not segment.messages:
        return []
    fmt = _fmt(tokenizer)
    # (a run recorded before render refused a system message its template drops still displays)
    again = fmt.encode(fmt.render(segment.messages, tools if tools is not None else segment.tools, add_generation_prompt=False,
                                  refuse_dropped=False))
    return _unmatched(fmt, list(segment.token_ids), again)


# difflib's exact matching is quadratic on repetitive ids (a policy looping "The answer is 12."): 5.8 s
# at 4.9k tokens, 50 s at 9.8k, in the inspector's constructor, each of its refreshes and every
# episode view of the audit page. Past this many id pairs (after the common ends), tokens align by
# their character spans instead (tokens.text_units: linear)
EXACT_DIFF_PAIRS = 1 << 22


def _unmatched(fmt, ids: list[int], again: list[int]) -> list[int]:
    """Positions of `ids` that `again` does not reproduce."""
    n, m = len(ids), len(again)
    head = next((k for k in range(min(n, m)) if ids[k] != again[k]), min(n, m))
    tail = next((k for k in range(min(n, m) - head) if ids[n - 1 - k] != again[m - 1 - k]), min(n, m) - head)
    mid, mid_again = ids[head:n - tail], again[head:m - tail]
    if len(mid) * len(mid_again) <= EXACT_DIFF_PAIRS:
        same = set()
        for a, _, k in difflib.SequenceMatcher(None, mid, mid_again, autojunk=False).get_matching_blocks():
            same.update(range(a, a + k))
        return [head + i for i in range(len(mid)) if i not in same]
    units, theirs = text_units(fmt, mid), text_units(fmt, mid_again)
    if units is None or theirs is None:
        return list(range(head, n - tail))
    theirs, out, i = set(theirs), [], head  # (a unit: its character span and ids; a shifted text drifts from the shift on)
    for unit in units:
        if unit not in theirs:
            out += range(i, i + len(unit[2]))
        i += len(unit[2])
    return out


def _color(color_by: str, mask: int, lp: float, version: int, experts: list[int] | None) -> str:
    if color_by == "loss_mask":
        return "#b7e4c7" if mask else GREY
    if color_by == "logprob":  # 0 (certain) green .. -5 and below red: the surprising tokens stand out
        return f"hsl({120 * max(0.0, 1 + lp / 5):.0f},70%,75%)" if mask else GREY
    if color_by == "version":
        return PALETTE[version % len(PALETTE)] if version >= 0 else GREY
    return PALETTE[experts[0] % len(PALETTE)] if experts and experts[0] >= 0 else GREY


def token_spans(segment_or_trajectory, color_by: str = "loss_mask", tokenizer=None, layer: int = 0,
                tools: list | None = None) -> list[dict]:
    """One dict per token (kind "token": index, id, text, loss_mask, logprob, version, experts of
    `layer`, drift, color, title) and one seal marker after each segment (kind "seal": reason)."""
    if color_by not in COLOR_BY:
        raise ValueError(f"color_by {color_by!r} unknown; choose one of {COLOR_BY}")
    fmt, out = _fmt(tokenizer), []
    for si, seg in enumerate(_segments(segment_or_trajectory)):
        drift = set(drift_positions(seg, fmt, tools)) if fmt else set()
        texts = token_texts(fmt, seg.token_ids) if fmt else None
        ex = seg.routed_experts
        for i, tid in enumerate(seg.token_ids):
            m, lp, v = seg.loss_mask[i], seg.logprobs[i], seg.versions[i]
            e = [int(x) for x in ex[i, layer]] if ex is not None and layer < ex.shape[1] else None
            text = texts[i] if fmt else f"{tid} "
            title = f"#{i} id {tid}" + (f" {text!r}" if fmt else "") + f"\nloss_mask {m}  logprob {lp:.4f}  version {v}"
            if ex is not None:
                title += "\nexperts " + (" ".join(f"L{j}{ex[i, j].tolist()}" for j in range(ex.shape[1]))
                                         if (ex[i] >= 0).all() else "not captured")
            if i in drift:
                title += "\nretokenization drift: re-rendering the messages gives other ids here"
            out.append({"kind": "token", "segment": si, "index": i, "id": tid, "text": text, "loss_mask": m,
                        "logprob": lp, "version": v, "experts": e, "drift": i in drift,
                        "color": _color(color_by, m, lp, v, e), "title": title})
        out.append({"kind": "seal", "segment": si, "reason": seg.seal_reason or "open",
                    "why": SEAL_REASONS.get(seg.seal_reason, "the segment is still open")})
    return out


# each token its own box (adjacent tokens of one colour stay apart), a whitespace token visible
TOKEN_BOX = "border:1px solid rgba(0,0,0,.22);border-radius:3px;margin:0 1px;padding:0 1px"


def spans_html(spans: list[dict]) -> str:
    """Tokens as boxed spans (`data-i`: the token's place among the token spans; `title`: its
    details, a tooltip where no script runs) and seal markers as lines."""
    parts, i = [], 0
    for s in spans:
        if s["kind"] == "seal":
            parts.append(f"<div style='border-top:2px dashed #c00;margin:4px 0;color:#c00;font-size:11px' "
                         f"title='{escape(s['why'])}'>segment {s['segment']} sealed: {escape(s['reason'])}</div>")
        else:
            drift = ";outline:2px solid #d00;text-decoration:underline wavy #d00" if s["drift"] else ""
            parts.append(f"<span data-i='{i}' style='background:{s['color']};{TOKEN_BOX}{drift}' "
                         f"title='{escape(s['title'])}'>{escape(s['text'])}</span>")
            i += 1
    return f"<div style='font-family:monospace;white-space:pre-wrap;line-height:1.9'>{''.join(parts)}</div>"


class TokenView(anywidget.AnyWidget):
    """The token boxes of `spans_html` in the browser: hovering a token shows a card with its
    details (the span's title), clicking one sets `.selected` (its place among the token spans),
    which Python observes. A small ES module (anywidget): a plain ipywidgets HTML sends no
    clicks back to the kernel."""

    _esm = r"""
function render({ model, el }) {
  el.style.position = "relative";
  const box = document.createElement("div"), card = document.createElement("div");
  card.className = "wb-token-card";
  card.style.cssText = "position:absolute;display:none;z-index:10;background:#fff;border:1px solid #888;" +
    "border-radius:4px;padding:4px 6px;font:12px monospace;white-space:pre;box-shadow:0 2px 6px rgba(0,0,0,.25);pointer-events:none";
  const mark = () => box.querySelectorAll("[data-i]").forEach(s => {
    s.style.boxShadow = +s.dataset.i === model.get("selected") ? "0 0 0 2px #000" : ""; });
  const draw = () => {
    box.innerHTML = model.get("value");
    // the card replaces the browser's tooltip
    box.querySelectorAll("[data-i]").forEach(s => {
      s.dataset.card = s.title; s.removeAttribute("title"); s.style.cursor = "pointer"; });
    mark();
  };
  box.addEventListener("mouseover", e => {
    const s = e.target.closest("[data-i]");
    if (!s) return;
    const r = s.getBoundingClientRect(), o = el.getBoundingClientRect();
    card.textContent = s.dataset.card + "\nclick: this token's journey";
    card.style.left = (r.left - o.left) + "px"; card.style.top = (r.bottom - o.top + 4) + "px";
    card.style.display = "block";
  });
  box.addEventListener("mouseout", e => { if (e.target.closest("[data-i]")) card.style.display = "none"; });
  box.addEventListener("click", e => {
    const s = e.target.closest("[data-i]");
    if (!s) return;
    model.set("selected", +s.dataset.i);
    model.save_changes();
  });
  model.on("change:value", draw);
  model.on("change:selected", mark);
  el.append(box, card);
  draw();
}
export default { render };
"""
    value = traitlets.Unicode("").tag(sync=True)
    selected = traitlets.Int(-1).tag(sync=True)


class SegmentInspector(W.VBox):
    """Tokens of a segment (or every segment of a trajectory, with seal markers) as coloured
    boxes; hover a token for its card (id, log-prob, version, experts), click it for its journey.
    `.spans` holds what is shown (see `token_spans`). With `report` (a training step's per-token
    record, wb.trainer.last_report) a sampled token that step trained on shows its whole journey
    (TokenJourney); otherwise the journey shows what was recorded at sampling time."""

    def __init__(self, segment_or_trajectory, tokenizer=None, color_by: str = "loss_mask", layer: int = 0,
                 tools: list | None = None, report: dict | None = None):
        super().__init__()
        self.source, self.tokenizer, self.tools, self.report = segment_or_trajectory, _fmt(tokenizer), tools, report
        segs = _segments(segment_or_trajectory)
        layers = max((s.routed_experts.shape[1] for s in segs if s.routed_experts is not None), default=0)
        # without recorded experts (vLLM on CPU, dense models) there is nothing to colour by expert
        options = COLOR_BY if layers else tuple(c for c in COLOR_BY if c != "experts")
        self.color_by = W.Dropdown(options=options, value=color_by if color_by in options else "loss_mask",
                                   description="colour by")
        self.moe_layer = W.Dropdown(options=list(range(max(layers, 1))), value=min(layer, max(layers - 1, 0)),
                                    description="MoE layer", layout=W.Layout(display=None if layers else "none"))
        self.summary, self.tokens, self.journey = W.HTML(), TokenView(), W.VBox()
        self.children = [W.HBox([self.color_by, self.moe_layer]), self.summary, self.tokens, self.journey]
        self.color_by.observe(lambda _: self.refresh(), "value")
        self.moe_layer.observe(lambda _: self.refresh(), "value")
        self.tokens.observe(lambda ch: ch["new"] >= 0 and self.open_token(ch["new"]), "selected")
        self.refresh()

    def refresh(self):
        self.spans = token_spans(self.source, self.color_by.value, self.tokenizer, self.moe_layer.value, self.tools)
        lines = [f"<i>{LEGEND[self.color_by.value]}</i> {_key(self.spans, self.color_by.value)}",
                 "<i>hover a token for its id, log-prob, version and experts; click it for its journey</i>"]
        for si, seg in enumerate(_segments(self.source)):
            marked = [s["index"] for s in self.spans if s["kind"] == "token" and s["segment"] == si and s["drift"]]
            where = ((f"{len(marked)} position(s) differ when the messages are re-rendered: {marked[:50]}" if marked
                      else "re-rendering the messages reproduces every id") if self.tokenizer else "give a tokenizer to locate them")
            lines.append(f"segment {si}: {len(seg)} tokens, {sum(seg.loss_mask)} sampled, seal: {seg.seal_reason or 'open'}; "
                         f"retokenization drift (recorded): {seg.stats.get('retokenization_drift', 'n/a')} sampled ids; {where}")
        self.summary.value = "<br>".join(lines)
        self.tokens.value = spans_html(self.spans)

    def open_token(self, i: int) -> W.Widget:
        """The journey of the i-th token shown (what a click on it opens), below the tokens."""
        tok = [s for s in self.spans if s["kind"] == "token"][i]
        seg = _segments(self.source)[tok["segment"]]
        episode = getattr(self.source, "episode_id", None)
        where = (f"episode {episode}, " if episode else "") + f"segment {tok['segment']}, token {tok['index']}"
        key = (episode, tok["segment"]) if episode else None
        row = find_row(self.report, seg, key) if self.report is not None else None
        if row is not None and tok["loss_mask"]:
            view = TokenJourney(self.report, row, tok["index"], self.tokenizer, label=where)
        else:
            why = ("not sampled by the policy (prompt, template or tool token): it has no IS weight or gradient"
                   if not tok["loss_mask"] else "recorded at sampling time; the trainer's columns come from a training step "
                   "on this trajectory (wb.trainer.step(), then wb.inspect())")
            view = W.HTML(f"<b>{escape(where)}</b> <i>({escape(why)})</i>"
                          + journey_table(recorded_journey(seg, tok["index"], self.tokenizer)))
        self.journey.children = [view]
        self.tokens.selected = i
        return view


def _key(spans: list[dict], color_by: str) -> str:
    """Swatches naming the colours in use: versions or experts present; a log-prob scale."""
    def swatch(color, label):
        return f"<span style='background:{color};padding:0 4px;margin-right:2px;font-family:monospace'>{label}</span>"

    if color_by == "logprob":
        return " ".join(swatch(_color("logprob", 1, lp, 0, None), f"{lp:g}") for lp in (0, -1, -2, -3, -4, -5))
    if color_by == "version":
        values = sorted({s["version"] for s in spans if s.get("kind") == "token" and s["version"] >= 0})
        return " ".join(swatch(PALETTE[v % len(PALETTE)], f"v{v}") for v in values)
    if color_by == "experts":
        values = sorted({s["experts"][0] for s in spans  # a span's experts are those of the chosen layer
                         if s.get("kind") == "token" and s.get("experts") and s["experts"][0] >= 0})
        note = f" (colours repeat every {len(PALETTE)})" if values and max(values) >= len(PALETTE) else ""
        return " ".join(swatch(PALETTE[e % len(PALETTE)], f"E{e}") for e in values) + note
    return ""


# ------------------------------------------------------------------ gate and replay monitors
# NaN there means no episode of the step finished (loop.reward_statistics; agents' rewards are checked finite)
NAN_WHEN_NOTHING_FINISHED = ("reward_mean", "correct_rate", "ds_reward_mean_sampled", "ds_correct_rate_sampled")


def _num(v):
    return None if v is None else float(v)


def _bars(v) -> tuple[list, list]:
    """x, y of a last-step distribution: {key: count}, a list per index, or {"edges", "counts"}."""
    if not v:
        return [], []
    if isinstance(v, dict) and "counts" in v:
        e = v["edges"]
        return [f"[{a:g}, {b:g})" for a, b in zip(e, e[1:])], list(v["counts"])
    if isinstance(v, dict):  # keys may be strings after a JSON round trip
        items = sorted(v.items(), key=lambda kv: float(kv[0]))
        return [int(float(k)) for k, _ in items], [c for _, c in items]
    return list(range(len(v))), [_num(c) for c in v]


class _Monitor(W.VBox):
    GRID, HEIGHT = (1, 1), 480
    TITLES: tuple = ()
    LINES: tuple = ()  # (metric key, row, col): one value per step
    BARS: tuple = ()  # (metric key, row, col): a distribution of the last step
    LABELS: dict = {}  # metric key -> its legend entry, in plain words (default: the key)
    AXES: dict = {}  # (row, col) -> (x title, y title, y range or None)

    def __init__(self, history: list[dict] | None = None, height: int | None = None):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        super().__init__()
        fig = make_subplots(rows=self.GRID[0], cols=self.GRID[1], subplot_titles=self.TITLES,
                            horizontal_spacing=0.09, vertical_spacing=0.3 if self.GRID[0] > 1 else 0.1)
        # name: the legend's plain words; meta: the metric key (trace(key) finds it)
        for key, r, c in self.LINES:
            fig.add_trace(go.Scatter(name=self.LABELS.get(key, key), meta=key, x=[], y=[], mode="lines+markers",
                                     textposition="top center"), row=r, col=c)
        for key, r, c in self.BARS:
            fig.add_trace(go.Bar(name=self.LABELS.get(key, key), meta=key, x=[], y=[]), row=r, col=c)
        for (r, c), (xt, yt, yrange) in self.AXES.items():
            fig.update_xaxes(title_text=xt, title_font_size=11, row=r, col=c)
            fig.update_yaxes(title_text=yt, title_font_size=11, range=yrange, row=r, col=c)
        # legend under the plots (full width for them), small titles, 1e-7 rather than "100n"
        fig.update_layout(height=height or self.HEIGHT, margin=dict(l=60, r=10, t=40, b=30),
                          legend=dict(orientation="h", yanchor="top", y=-0.2 if self.GRID[0] == 1 else -0.12))
        fig.update_annotations(font_size=12)
        # one tick format everywhere: 3 significant digits, 1e-7 rather than "100n"
        fig.update_yaxes(tickformat=".3~g", exponentformat="e", rangemode="tozero")
        for _, r, c in self.LINES:  # steps are integers
            fig.update_xaxes(tickformat="d", row=r, col=c)
        self._style(fig)
        # A plain figure, drawn whole into an Output widget at every step, not a plotly
        # FigureWidget. A FigureWidget's view draws once from the widget state it finds and then
        # only patches itself with restyle messages; under Run All (the kernel busy with the run
        # cell while the browser builds the view) its views drew from an empty layout and stayed
        # blank, the patches landing on a plot with no traces (reproduced in tests/browser). A
        # view of this Output is a full render of the current figure, whenever it is made, and
        # every step replaces it whole. It also keeps plotly's 5 MB JS bundle (an anywidget ESM)
        # out of a saved notebook: the mime renderer of jupyterlab-plotly draws the JSON.
        self.fig = fig
        self.history: list[dict] = []
        self._drawn_at, self._stale = 0.0, False  # when on_step last redrew; steps since left undrawn
        self._lock = threading.Lock()  # on_step may come from a training loop's thread
        self.view = W.Output(layout=W.Layout(min_height=f"{height or self.HEIGHT}px"))
        self.children = [self.view]
        self.update(history or [])

    def _style(self, fig):
        """Per-monitor axis settings."""

    def _rows(self, history: list[dict]) -> list[dict]:
        """The per-step rows drawn from a history (default: the history itself)."""
        return history

    def trace(self, key: str):
        """The trace of a metric key."""
        return next(t for t in self.fig.data if t.meta == key)

    def update(self, history: list[dict]):
        """Redraw from a whole history (one metrics dict per step); missing keys leave gaps."""
        with self._lock:
            self._draw(list(history))

    def _draw(self, history: list[dict]):
        self.history = history
        rows = self._rows(history)  # what is drawn: the history (the reward monitor adds wb.eval()'s records)
        steps = [m.get("step", i) for i, m in enumerate(rows)]
        last = history[-1] if history else {}
        one = len(steps) == 1  # a single step: its value as a number over the point, not a lone dot
        for key, *_ in self.LINES:
            y = [_num(m.get(key)) for m in rows]
            self.trace(key).update(x=steps, y=y, mode="markers+text" if one else "lines+markers",
                                   text=[_tick(v) if v is not None else "" for v in y] if one else None,
                                   marker_size=10 if one else 6)
        for _, r, c in self.LINES:  # a tick per step while there are few (not 0.5-steps)
            self.fig.update_xaxes(dtick=1 if len(steps) <= 10 else None, row=r, col=c)
        # NaN / inf reach the browser as null, a gap like a step not measured: name them in the title.
        # (A reward NaN where no episode finished is that: loop.reward_statistics' "measured nothing",
        # said as such, not in red as a divergence)
        def unmeasured(key: str, m: dict) -> bool:
            return key in NAN_WHEN_NOTHING_FINISHED and math.isnan(m[key])

        bad = [f"{self.LABELS.get(key, key).split(':')[0].split(' (')[0]} at step {s}" for key, *_ in self.LINES
               for s, m in zip(steps, rows)
               if isinstance(m.get(key), float) and not math.isfinite(m[key]) and not unmeasured(key, m)]
        idle = sorted({s for key, *_ in self.LINES for s, m in zip(steps, rows)
                       if isinstance(m.get(key), float) and unmeasured(key, m)})
        # (in no bin of the histogram; on the monitor that draws it: the reward and replay ones said it too)
        bad += [f"{(m.get('is_weight_hist') or {}).get('nonfinite')} IS weight(s) at step {s}" for s, m in zip(steps, rows)
                if (m.get("is_weight_hist") or {}).get("nonfinite") and any(k == "is_weight_hist" for k, *_ in self.BARS)]
        title = [("<span style='color:#c00'>not finite: " + "; ".join(bad[:4])
                  + (f" (+{len(bad) - 4})" if len(bad) > 4 else "") + "</span>")] if bad else []
        if idle:
            title.append(f"no episode finished at step{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle[:4]))}"
                         + (f" (+{len(idle) - 4})" if len(idle) > 4 else "") + " (failed_episodes says why)")
        self.fig.update_layout(title=dict(text="; ".join(title) or None, font_size=12, x=0.01))
        for key, *_ in self.BARS:
            x, y = _bars(last.get(key))
            self.trace(key).update(x=x, y=y)
        # one assignment of the whole output: a view made at any time draws all of it
        self.view.outputs = (self.output(),)

    def output(self) -> dict:
        """The figure as one display_data output (plotly's JSON and a plain-text summary)."""
        n = len(self.history)
        text = f"{type(self).__name__}: {n} step(s)" + (f", last step {self.history[-1].get('step', n - 1)}" if n else "")
        return {"output_type": "display_data", "metadata": {},
                "data": {"application/vnd.plotly.v1+json": json.loads(self.fig.to_json()), "text/plain": text}}

    # A redraw sends the whole figure (every step's points) to the browser: every step of a long run
    # made that O(steps) per step on the training thread (25 ms and 188 kB at 1,000 steps, 111 ms and
    # 924 kB at 5,000, per monitor). Past the first REDRAW_ALWAYS steps, at most one redraw every
    # REDRAW_S seconds; the run's end (on_end) draws the last steps.
    REDRAW_ALWAYS, REDRAW_S = 200, 2.0

    def on_step(self, metrics: dict):
        """Append one step's metrics and redraw, throttled past REDRAW_ALWAYS steps (safe to call
        from a training loop's thread)."""
        import time

        with self._lock:
            # a step again (a run after wb.restore(), which set the abandoned branch's steps aside): it
            # replaces the steps from it on, as in metrics.jsonl (appended, the lines ran back and over)
            while self.history and metrics.get("step") is not None and self.history[-1].get("step", -1) >= metrics["step"]:
                self.history.pop()
            self.history.append(metrics)
            now = time.monotonic()
            if len(self.history) <= self.REDRAW_ALWAYS or now - self._drawn_at >= self.REDRAW_S:
                self._draw(self.history)
                self._drawn_at, self._stale = now, False
            else:
                self._stale = True

    def on_end(self):
        """The run ended: draw the steps a throttled redraw left out."""
        with self._lock:
            if self._stale:
                self._draw(self.history)
                self._stale = False

    def write_html(self, path, include_plotlyjs=True, title: str | None = None) -> Path:
        """A standalone page with plotly.js inlined: updates made after display are not in a
        saved notebook's widget state, so a papermill run should leave this file as its record.
        `include_plotlyjs="directory"`: one plotly.min.js beside several pages (offline too).
        The page carries `title` (default: the monitor's name and its plots) in <title> and <h3>."""
        self.on_end()  # (the steps a throttled redraw left out, for a monitor fed without a run's end)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        title = title or f"{type(self).__name__}: {', '.join(self.TITLES)}"
        self.fig.write_html(str(path), include_plotlyjs=include_plotlyjs)  # ("directory" also writes plotly.min.js)
        page = path.read_text()
        page = page.replace("<head>", f"<head><title>{escape(title)}</title>", 1).replace(
            "<body>", f"<body><h3 style='font-family:sans-serif'>{escape(title)}</h3>", 1)
        path.write_text(page)
        return path

    def static(self) -> "StaticFigure":
        """The monitor now as an SVG image, for a saved notebook: an executed notebook and its
        nbconvert HTML show it with no JavaScript and no network (the live view is a widget,
        which neither keeps). `display(gate.static())` after a run."""
        self.on_end()  # (as write_html)
        return StaticFigure(svg(self), f"{type(self).__name__}: {len(self.history)} step(s)")


class GateMonitor(_Monitor):
    GRID, HEIGHT = (2, 3), 560
    TITLES = ("gate pass ratio, tokens kept, IS weights", "KL(behaviour||trainer) k1, k3", "max |delta p|",
              "staleness (last step)", "tokens per version", "IS weights (last step)")

    LINES = (("gate_pass_ratio", 1, 1), ("token_keep_ratio", 1, 1), ("is_ess", 1, 1), ("is_bounded_fraction", 1, 1), ("kl_k1", 1, 2), ("kl_k3", 1, 2), ("kl_k3_current", 1, 2), ("kl_k3_stale", 1, 2),
             ("max_abs_delta_p", 1, 3))
    BARS = (("staleness_hist", 2, 1), ("tokens_per_version", 2, 2), ("is_weight_hist", 2, 3))
    LABELS = {"gate_pass_ratio": "gate pass ratio: share of sequences the IS gate kept (0..1)",
              "token_keep_ratio": "tokens kept: share of trainable tokens the correction kept (a token-level mask drops tokens)",
              "is_ess": "effective sample size of the kept weights, (sum w)^2 / (n sum w^2) (1: all equal)",
              "is_bounded_fraction": "share of kept tokens whose weight the clip or cap bounded",
              "kl_k1": "k1 = mean log(p_behaviour / p_trainer) (can be < 0)",
              "kl_k3": "k3 = mean(r - 1 - log r) (never < 0)",
              "kl_k3_current": "k3 on the tokens of the trainer's version (staleness excluded: the engine's forward vs the trainer's)",
              "kl_k3_stale": "k3 on the stale tokens (the policy's move since they were sampled; over 1: too far to correct)",
              "max_abs_delta_p": "largest |p_trainer - p_behaviour| of a sampled token",
              "staleness_hist": "sampled tokens by versions behind", "tokens_per_version": "sampled tokens by policy version",
              "is_weight_hist": "kept tokens by IS weight"}
    AXES = {(1, 1): ("step", "pass ratio", [0, 1.05]), (1, 2): ("step", "KL (nats)", None),
            (1, 3): ("step", "|delta p|", None), (2, 1): ("versions behind", "tokens", None),
            (2, 2): ("policy version", "tokens", None), (2, 3): ("IS weight", "tokens", None)}

    def _style(self, fig):
        fig.update_xaxes(tickangle=-45, row=2, col=3)  # interval labels
        fig.update_xaxes(dtick=1, row=2, col=1)  # staleness and versions are integers
        fig.update_xaxes(dtick=1, row=2, col=2)


class ReplayMonitor(_Monitor):
    GRID, HEIGHT = (1, 3), 380
    TITLES = ("routing disagreement", "per layer (last step)", "k3: replayed vs live")
    # both k3 on the trained version's own tokens (kl_k3 would add a stale token's policy movement,
    # which replay does not remove)
    LINES = (("replay_disagree_rate", 1, 1), ("kl_k3_current", 1, 3), ("kl_k3_live", 1, 3))
    BARS = (("replay_disagree_per_layer", 1, 2),)
    LABELS = {"replay_disagree_rate": "routing disagreement (from 0): share of (token, layer) routings where the "
                                      "trainer's own top-k differs from the sampler's",
              "replay_disagree_per_layer": "disagreement per MoE layer (last step)",
              "kl_k3_current": "k3 with the sampler's routing replayed", "kl_k3_live": "k3 with the trainer's own routing"}
    AXES = {(1, 1): ("step", "share disagreeing", None), (1, 2): ("MoE layer", "share disagreeing", None),
            (1, 3): ("step", "KL k3 (nats)", None)}

    def _style(self, fig):
        fig.update_xaxes(dtick=1, row=1, col=2)  # MoE layer indices
        fig.update_traces(connectgaps=True, selector={"meta": "kl_k3_live"})  # measured every N-th step only


class RewardMonitor(_Monitor):
    """Training reward beside held-out evaluation (LoopConfig.eval_every, workbench.evaluation):
    the evaluated steps' points are joined across the steps without one. `evals`: records of
    wb.eval() (eval.jsonl: a step's, -1 before any training) drawn on the evaluation plot too (a
    run evaluated only before and after training drew it empty)."""

    def __init__(self, history: list[dict] | None = None, height: int | None = None, evals: list[dict] | None = None):
        super().__init__(history, height)
        self.evals = [e for e in evals or () if isinstance(e, dict) and e.get("step") is not None]
        if self.evals:
            self.update(self.history)

    def _rows(self, history: list[dict]) -> list[dict]:
        if not getattr(self, "evals", None):  # (a redraw at every step: no copy of the history without them)
            return history
        rows = {m.get("step", i): dict(m) for i, m in enumerate(history)}
        for e in getattr(self, "evals", ()):  # (the steps' own eval_* win: the loop's evaluation of that step)
            row = rows.setdefault(e["step"], {"step": e["step"]})
            for key, *_ in self.LINES:
                if key.startswith("eval_") and key in e:
                    row.setdefault(key, e[key])
        return [rows[s] for s in sorted(rows)]

    GRID, HEIGHT = (1, 2), 380
    TITLES = ("training reward", "held-out evaluation")
    LINES = (("reward_mean", 1, 1), ("correct_rate", 1, 1), ("ds_reward_mean_sampled", 1, 1), ("ds_correct_rate_sampled", 1, 1),
             ("eval_pass@1", 1, 2), ("eval_greedy_pass@1", 1, 2), ("eval_reward_mean", 1, 2))
    LABELS = {"reward_mean": "mean reward", "correct_rate": "share correct",
              "ds_reward_mean_sampled": "mean reward of the sampled groups (dynamic sampling)",
              "ds_correct_rate_sampled": "share correct of the sampled groups (dynamic sampling)",
              "eval_pass@1": "pass@1 (sampled)", "eval_greedy_pass@1": "pass@1 (greedy)", "eval_reward_mean": "mean reward"}
    AXES = {(1, 1): ("step", "reward", None), (1, 2): ("step", "held-out score", None)}

    def _style(self, fig):
        for key, _, col in self.LINES:  # evaluation runs every eval_every steps only; a training step
            if col == 2:  # where no episode finished (reward NaN) stays a gap
                fig.update_traces(connectgaps=True, selector={"meta": key})


class StaticFigure:
    """An SVG (image/svg+xml) with a plain-text fallback; IPython displays it inline."""

    def __init__(self, svg_text: str, text: str):
        self.svg, self.text = svg_text, text

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"image/svg+xml": self.svg, "text/plain": self.text}


def _tick(v: float) -> str:
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def _finite(v) -> bool:
    return v is not None and math.isfinite(float(v))


def finite_runs(points: list[tuple]) -> list[list[tuple]]:
    """(x, y) points cut into the runs of finite y between non-finite ones (each run a polyline)."""
    runs: list[list[tuple]] = [[]]
    for p in points:
        if _finite(p[1]):
            runs[-1].append(p)
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def svg(monitor: _Monitor, width: int = 900) -> str:
    """A monitor's plots as one SVG: per subplot its title, y range, the step axis, and for each
    line series a polyline with point markers (bars for the last-step distributions)."""
    rows, cols = monitor.GRID
    cw, ch, pad = width / cols, 220, dict(l=52, r=12, t=26, b=34)
    colours = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{rows * ch + 24}' "
           f"font-family='sans-serif' font-size='11'>"]
    series: dict[tuple, list] = {}
    for i, (key, r, c) in enumerate(monitor.LINES):
        t = monitor.trace(key)
        series.setdefault((r, c), []).append(("line", key, list(t.x), list(t.y), colours[i % len(colours)]))
    for key, r, c in monitor.BARS:
        t = monitor.trace(key)
        series.setdefault((r, c), []).append(("bar", key, list(t.x), list(t.y), "#7f7f7f"))
    for idx in range(rows * cols):
        r, c = idx // cols + 1, idx % cols + 1
        x0, y0 = (c - 1) * cw + pad["l"], (r - 1) * ch + pad["t"]
        w, h = cw - pad["l"] - pad["r"], ch - pad["t"] - pad["b"]
        title = monitor.TITLES[idx] if idx < len(monitor.TITLES) else ""
        out.append(f"<text x='{x0 + w / 2:.0f}' y='{y0 - 8:.0f}' text-anchor='middle' font-size='12'>{escape(title)}</text>")
        out.append(f"<rect x='{x0:.0f}' y='{y0:.0f}' width='{w:.0f}' height='{h:.0f}' fill='#f7f7f7' stroke='#ccc'/>")
        items = series.get((r, c), [])
        # finite values set the range (a NaN step, e.g. reward_mean where no episode finished, made
        # the range NaN and cut the polyline: browsers stop a points list at its first bad number)
        ys = [float(v) for _, _, _, yy, _ in items for v in yy if _finite(v)]
        if not ys and not any(v is not None for _, _, _, yy, _ in items for v in yy):
            out.append(f"<text x='{x0 + w / 2:.0f}' y='{y0 + h / 2:.0f}' text-anchor='middle' fill='#999'>no data</text>")
            continue
        # values, none finite (a run that diverged: every KL NaN): marked on a default range, and said;
        # it read "no data", as if unmeasured
        bad = sorted({str(v) for _, _, _, yy, _ in items for v in yy if v is not None and not _finite(v)})
        if bad:
            out.append(f"<text x='{x0 + w - 4:.0f}' y='{y0 + 12:.0f}' text-anchor='end' fill='#d62728'>"
                       f"not finite: {escape(', '.join(bad))}</text>")
        ys = ys or [0.0]
        lo, hi = min(0.0, min(ys)), max(ys)
        hi = hi if hi > lo else lo + 1.0
        Y = lambda v: y0 + h - (float(v) - lo) / (hi - lo) * h  # noqa: E731
        out.append(f"<text x='{x0 - 4:.0f}' y='{Y(hi) + 4:.0f}' text-anchor='end'>{_tick(hi)}</text>"
                   f"<text x='{x0 - 4:.0f}' y='{Y(lo):.0f}' text-anchor='end'>{_tick(lo)}</text>")
        for j, (kind, key, xs, yy, colour) in enumerate(items):
            n = len(xs)
            if kind == "bar":
                bw = w / max(n, 1)
                for k, (xv, yv) in enumerate(zip(xs, yy)):
                    if _finite(yv):
                        out.append(f"<rect x='{x0 + k * bw + 1:.1f}' y='{Y(yv):.1f}' width='{max(bw - 2, 1):.1f}' "
                                   f"height='{Y(lo) - Y(yv):.1f}' fill='{colour}'><title>{escape(str(xv))}: {yv}</title></rect>")
                if n:
                    out.append(f"<text x='{x0:.0f}' y='{y0 + h + 14:.0f}'>{escape(str(xs[0]))}</text>"
                               f"<text x='{x0 + w:.0f}' y='{y0 + h + 14:.0f}' text-anchor='end'>{escape(str(xs[-1]))}</text>")
                continue
            pts = [(xv, yv) for xv, yv in zip(xs, yy) if yv is not None]
            sx = [float(v) for v in xs] or [0.0]
            xlo, xhi = min(sx), max(sx) if max(sx) > min(sx) else min(sx) + 1
            X = lambda v: x0 + (float(v) - xlo) / (xhi - xlo) * w  # noqa: E731
            for run in finite_runs(pts):  # a gap at each non-finite value
                out.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='"
                           + " ".join(f"{X(a):.1f},{Y(b):.1f}" for a, b in run) + "'/>")
            out += [f"<circle cx='{X(a):.1f}' cy='{Y(b):.1f}' r='2.2' fill='{colour}'><title>step {a}: {b}</title></circle>"
                    if _finite(b) else f"<text x='{X(a):.1f}' y='{y0 + h - 3:.1f}' text-anchor='middle' fill='{colour}' "
                    f"font-size='9'>{b}<title>step {a}: {b}</title></text>" for a, b in pts]
            out.append(f"<text x='{x0 + 4:.0f}' y='{y0 + 12 + 12 * j:.0f}' fill='{colour}'>{escape(key)}</text>")
            # (steps as integers: the y ticks' 3 significant digits read step 1234 as 1.23e+03)
            out.append(f"<text x='{x0:.0f}' y='{y0 + h + 14:.0f}'>step {int(xlo)}</text>"
                       f"<text x='{x0 + w:.0f}' y='{y0 + h + 14:.0f}' text-anchor='end'>{int(max(sx))}</text>")
    return "".join(out) + "</svg>"


# ------------------------------------------------------------------ views kept apart from a run
class Views:
    """The views a run feeds (monitors, its progress bar), kept apart from the training thread.

    A view talks to the browser through the kernel's comm; that can fail in ways the run cannot
    prevent (after a kernel interrupt, ipykernel's socket raised "Socket operation on non-socket"
    from a monitor's on_step and ended the run). A display failure must never end training, so
    each call is guarded: an exception in a view is caught and counted (`.errors`), reported once
    (`report`, stderr by default), and that view is detached (`.detached`); the others go on.
    `views` are objects with `on_step(metrics)` and optionally `on_end()` (called once when the
    run ends, guarded the same way)."""

    def __init__(self, views, report: Callable[[str], None] | None = None):
        self.views = list(views)
        self.errors = 0
        self.detached: list[tuple[object, BaseException]] = []
        self._report = report or _stderr

    def _call(self, view, what: str, *args) -> None:
        fn = getattr(view, what, None)
        if fn is None:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 -- any view failure; never KeyboardInterrupt/SystemExit
            self.errors += 1
            if view in self.views:
                self.views.remove(view)
            self.detached.append((view, e))
            self._report(f"workbench: a view ({type(view).__name__}) failed in {what}: {type(e).__name__}: {e}. "
                         f"It is detached; the run keeps training (its metrics still reach wb.history and metrics.jsonl).")

    def on_step(self, metrics: dict) -> None:
        for v in list(self.views):
            self._call(v, "on_step", metrics)

    def on_end(self) -> None:
        for v in list(self.views):
            self._call(v, "on_end")


def _stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


class RunProgress:
    """The progress bar of one run, as a view (so a failing bar cannot end the run): counts this
    run's steps (0..steps), not every step the session ever trained."""

    def __init__(self, steps: int, first_step: int, desc: str = "RL steps"):
        from tqdm.auto import tqdm

        self.first_step = first_step
        self.bar = tqdm(total=steps, desc=desc, unit="step")

    def on_step(self, metrics: dict) -> None:
        self.bar.update(1)
        self.bar.set_postfix_str(f"step {metrics.get('step')}, reward {metrics.get('reward_mean', float('nan')):.3g}",
                                 refresh=False)
        self.bar.refresh()

    def on_end(self) -> None:
        self.bar.close()


# ------------------------------------------------------------------ token journey
# (journey key, report column or None when derived, label), in the order a token travels
JOURNEY = (("token_id", "input_ids", "token id"), ("text", None, "decoded"),
           ("behaviour_logprob", "behaviour_logprobs", "behaviour log-prob (engine)"),
           ("version", "versions", "policy version that sampled it"), ("experts", None, "routed experts per layer"),
           ("trainer_logprob", "trainer_logprobs", "trainer log-prob"), ("ratio", None, "ratio exp(trainer - behaviour)"),
           ("is_weight", "is_weight", "IS weight (a constant in the loss)"), ("gate_keep", "gate_keep", "gate decision (kept)"),
           ("advantage", "advantages", "advantage"), ("loss_contribution", "loss_contribution", "loss contribution"))


def _at(x, row: int, col: int):
    v = x[row]
    if hasattr(v, "__len__") and not (hasattr(v, "shape") and len(v.shape) == 0):
        v = v[col]  # per token; otherwise a per-sequence value (e.g. the gate's keep, [B])
    return v.item() if hasattr(v, "item") else v


def journey(report: dict, row: int, col: int, tokenizer=None) -> dict:
    """One token from sample to gradient: its values in each per-token [B, T] column of `report`."""
    missing = [k for k in ("loss_mask", *(k for _, k, _ in JOURNEY if k)) if k not in report]
    if missing:
        raise KeyError(f"the report lacks {missing}")
    ids = report["input_ids"]
    if not (0 <= row < len(ids) and 0 <= col < len(ids[row])):
        raise IndexError(f"token ({row}, {col}) is outside the report's [B, T] = [{len(ids)}, {len(ids[0])}]")
    if not _at(report["loss_mask"], row, col):
        raise ValueError(f"token ({row}, {col}) has loss_mask 0: a prompt, template, tool or padding token the policy did "
                         "not sample, so it has no behaviour log-prob, IS weight or gradient; pick a sampled token")
    out = {"row": row, "col": col}
    out.update({name: _at(report[key], row, col) for name, key, _ in JOURNEY if key})
    out["token_id"], out["version"], out["gate_keep"] = int(out["token_id"]), int(out["version"]), bool(out["gate_keep"])
    out["text"] = token_texts(_fmt(tokenizer), [out["token_id"]])[0] if tokenizer is not None else None
    ex = report.get("routed_experts")
    out["experts"] = None if ex is None else [[int(e) for e in layer] for layer in ex[row][col]]
    # the ratio the IS weight derives from, so a reader can check the weight against it
    # (past ~709 nats exp overflows: a broken engine's tokens, the ones most worth inspecting)
    gap = out["trainer_logprob"] - out["behaviour_logprob"]
    out["ratio"] = math.inf if gap > 709 else math.exp(gap)
    return out


def recorded_journey(segment: Segment, index: int, tokenizer=None) -> dict:
    """What a segment recorded of its token `index` at sampling time, in journey()'s keys (the
    trainer's columns None): the journey of a token no training step has seen yet."""
    out = dict.fromkeys(k for k, _, _ in JOURNEY)
    sampled = bool(segment.loss_mask[index])
    ex = segment.routed_experts
    out.update(token_id=int(segment.token_ids[index]), version=int(segment.versions[index]),
               behaviour_logprob=float(segment.logprobs[index]) if sampled else None,
               text=token_texts(_fmt(tokenizer), [segment.token_ids[index]])[0] if tokenizer is not None else None,
               experts=[[int(e) for e in layer] for layer in ex[index]] if ex is not None and (ex[index] >= 0).all() else None)
    return out


def find_row(report: dict, segment: Segment, key: tuple[str, int] | None = None) -> int | None:
    """The row of a training report ([B, T] columns; rows are trainable segments) holding
    `segment`, `key` = (episode id, segment index): by key where the report names its rows
    (`row_keys`, from loop.batch_from_groups); two episodes of one task in two groups can hold the
    same ids, each its own group's advantage, and by content the first one's was shown for both.
    Else by content: the row whose ids and loss mask start with the segment's and that trains
    nothing after it (padding). None if none does."""
    keys = report.get("row_keys")
    if key is not None and keys is not None:
        return next((r for r, k in enumerate(keys) if tuple(k) == tuple(key)), None)
    n = len(segment)
    ids, mask = report["input_ids"], report["loss_mask"]
    want_ids, want_mask = list(segment.token_ids), [int(m) for m in segment.loss_mask]
    for r in range(len(ids)):
        if (n <= len(ids[r]) and [int(x) for x in ids[r][:n]] == want_ids and [int(x) for x in mask[r][:n]] == want_mask
                and not any(int(x) for x in mask[r][n:])):
            return r
    return None


def _ranges(cols: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cols):
        start = c if start is None else start
        if i + 1 == len(cols) or cols[i + 1] != c + 1:
            out.append(f"{start}" if start == c else f"{start}-{c}")
            start = None
    return ", ".join(out)


def journey_table(values: dict) -> str:
    cell = lambda x: "n/a" if x is None else f"{x:.6g}" if isinstance(x, float) else escape(str(x))  # noqa: E731
    return "<table style='font-family:monospace'>" + "".join(
        f"<tr><td style='padding-right:12px'>{escape(label)}</td><td>{cell(values[k])}</td></tr>"
        for k, _, label in JOURNEY) + "</table>"


class TokenJourney(W.VBox):
    """The journey of the token at (row, col) of a training report as a table; change row/col to
    follow another. `label` says which token it is (episode, segment, token); the row's sampled
    columns (the ones with a journey) are listed under the boxes."""

    def __init__(self, report: dict, row: int, col: int, tokenizer=None, label: str | None = None):
        super().__init__()
        self.report, self.tokenizer, self.label, self._labelled = report, tokenizer, label, (row, col)
        self.row, self.col = W.IntText(row, description="row"), W.IntText(col, description="col")
        self.heading, self.table = W.HTML(), W.HTML()
        self.children = [self.heading, W.HBox([self.row, self.col]), self.table]
        self._moving = False
        self.show(row, col)  # a bad first token raises here, where the caller sees it
        for w in (self.row, self.col):
            w.observe(lambda _: self._moving or self._follow(), "value")

    def show(self, row: int, col: int) -> dict:
        self.values = journey(self.report, row, col, self.tokenizer)
        self._moving = True  # move the boxes without re-entering through their observers
        self.row.value, self.col.value = row, col
        self._moving = False
        sampled = [int(c) for c in range(len(self.report["loss_mask"][row])) if _at(self.report["loss_mask"], row, c)]
        label = self.label if (row, col) == self._labelled else None  # another token than the one labelled
        self.heading.value = (f"<b>{escape(label or f'row {row}, column {col}')}</b> (report row {row}, column {col}); "
                              f"sampled columns of row {row}: {_ranges(sampled)}")
        self.table.value = journey_table(self.values)
        return self.values

    def _follow(self):
        try:
            self.show(self.row.value, self.col.value)
        except (IndexError, ValueError) as e:  # typing a prompt position is normal use: say why, keep going
            self.table.value = f"<b style='color:#c00'>{escape(str(e))}</b>"
