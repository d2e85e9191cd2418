"""The run audit page (`wb.audit()`, `python -m workbench.audit RUN_DIR`) and the revisit view.

The page is one HTML file with no script and no network (inline SVG and CSS only), built from
the run directory alone (config.json, metrics.jsonl, trajectories/step_*.parquet), so it works
on a run copied from a cluster. Every step's invariant statistics are held to `Thresholds`;
a step over one is flagged in the summary, the table and the plot, and linked to the token
views of the trajectories that caused it (for per-token trainer statistics, which the run
directory does not keep per token: the step's trajectories, and `wb.revisit(run_dir, step)`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, fields
from html import escape
from pathlib import Path

from ..tokens import UNEXPECTED_SEALS, Trajectory, read_trajectories
from . import finite_runs, spans_html, token_spans, trajectory_html


@dataclass
class Thresholds:
    """What each step's statistics are held to (None: shown, never flagged). max_staleness and
    sync_max_abs_diff default to the run's own CorrectionConfig.max_staleness and loop.sync_tol,
    and max_staleness then to each step's own loop bound (step_limits: 0 sync, async_lag async)."""
    identity_mismatch: float | None = 0  # trainable ids differing from the sampled ones: invariant 1 says 0
    retokenization_drift: float | None = None  # what a text pipeline would have changed: informative
    unexpected_seals: float | None = 0  # segments sealed because the agent changed what the model was shown
    max_staleness: float | None = None
    gate_pass_ratio: float | None = 0.9  # a minimum
    token_keep_ratio: float | None = 0.9  # a minimum
    # share of the kept tokens of the trainer's own version whose IS weight is outside [0.8, 1.25) (a stale
    # token's weight corrects its staleness: kl_k3_stale judges those; runs before it: every kept token)
    is_weight_outside: float | None = 0.1
    replay_disagree_rate: float | None = 0.05
    # one layer's share: precision flips spread over layers, a record read at the wrong layer is
    # ~all of its positions (averaged over 24 layers it read 0.04, under the rate's 0.05)
    replay_disagree_worst_layer: float | None = 0.5
    replay_unreplayed: float | None = 0  # recorded routings the forward did not use: invariant 3 says 0
    kl_k3: float | None = 1e-3
    kl_k3_live: float | None = None
    # the stale tokens' KL: above it importance weights no longer correct them (loop.STALE_KL_LIMIT,
    # which the loop warns at; an async run past it tends to collapse)
    kl_k3_stale: float | None = 1.0
    sync_max_abs_diff: float | None = None
    sync_probe_outlier: float | None = None  # shown: a router near-tie, or one corrupted row
    sync_failed: float | None = 0  # a step whose weight sync raised
    nonfinite_gradient: float | None = 0  # a step whose gradient was NaN or inf: no update, the weights stood still
    failed_rate: float | None = 0.0
    truncated_rate: float | None = 0.25


MINIMA = {"gate_pass_ratio", "token_keep_ratio"}
# (key, title, what it measures); the order of the page's sections
CHECKS = (
    ("identity_mismatch", "identity mismatch", "trainable token ids that differ from the ids the engine sampled"),
    ("retokenization_drift", "retokenization drift", "sampled ids that decoding and re-encoding the text would change"),
    ("unexpected_seals", "seals by reason", "segments sealed because the agent changed what the model was shown "
     "(history_rewritten, assistant_changed, tools_changed; every reason in the table: a template's rewrite and eviction are by design)"),
    ("max_staleness", "staleness", "versions between the trainer and the oldest token the step trained on (after the gate); "
                                   "a sync step is held to 0 and an async one to its async_lag where no threshold is given"),
    ("gate_pass_ratio", "gate pass ratio", "share of sequences the correction gate kept (staleness, band, veto)"),
    ("token_keep_ratio", "tokens kept", "share of trainable tokens the correction kept (a token-level mask drops tokens, not sequences)"),
    ("is_weight_outside", "IS-weight distribution", "share of the tokens of the trainer's own version the correction kept "
     "whose IS weight is outside [0.8, 1.25) (a stale token's weight corrects its staleness: the stale tokens' KL judges "
     "those; under a mask every kept weight is inside its band: the gate pass ratio and tokens kept show what it dropped)"),
    ("replay_disagree_rate", "replay disagreement", "share of routed-expert choices where live routing differs from the recorded, "
     "over the rows the trained version sampled (not measured: no routing was captured, or, async, every row was "
     "sampled a version behind: replay_compared 0; a stale row's record is an older router's)"),
    ("replay_disagree_worst_layer", "replay disagreement, worst layer", "the largest one MoE layer's disagreement "
     "(a layer whose record does not match its router differs at most positions; the mean over layers hides it)"),
    ("replay_unreplayed", "routing not replayed", "recorded (token, layer) routings the trainer's forward did not use although "
     "replay applied: 0 unless the replay rule is broken"),
    ("kl_k3", "k3 with replay", "KL(behaviour || trainer) k3 estimate, routing replayed, on the tokens the trained version "
     "sampled (a stale token's KL is its staleness, not the forward; not measured on a step with none)"),
    ("kl_k3_live", "k3 without replay", "the same KL with live routing (what replay removes)"),
    ("kl_k3_stale", "k3 on stale tokens", "KL(behaviour || trainer) k3 on the tokens older versions sampled (async): past "
     "1.0 nat a token importance weights no longer correct them, and a run tends to collapse"),
    ("sync_max_abs_diff", "sync probe difference", "max |engine - trainer| probe log-prob after the step's weight sync"),
    ("sync_probe_outlier", "excused probe position", "the gap at the one probe position a sync excused as a router "
     "near-tie (left out of the probe difference; a weight row the sync corrupted looks the same)"),
    ("sync_failed", "failed weight sync", "the step trained, then its weight sync raised (a probe mismatch, an engine lost), "
     "or its training was interrupted (train_interrupted: Ctrl-C, a rank failed after an update) before any sync: "
     "the engines may not serve the trained weights"),
    ("nonfinite_gradient", "non-finite gradient", "the step's gradient norm was NaN or infinite (an inf log-prob, a NaN "
     "advantage): its update was skipped and the weights did not move; a run of such steps trains nothing"),
    ("failed_rate", "failed episodes", "share of the step's episodes that failed (agent error, timeout, dead engine)"),
    ("truncated_rate", "truncated episodes", "share of the step's episodes cut by the context, the policy's max_tokens or an Env's truncation (its step, max_turns)"),
)
PER_EPISODE = {"identity_mismatch", "retokenization_drift", "unexpected_seals", "max_staleness", "failed_rate",
               "truncated_rate"}


def read_metrics(run_dir) -> list[dict]:
    """metrics.jsonl's steps (a torn last line, from a killed run, is skipped)."""
    out = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _hist_outside(h: dict | None) -> float | None:
    nonfinite = (h or {}).get("nonfinite", 0)  # (a NaN weight is in no bin: outside any band)
    if not h or not sum(h["counts"]) + nonfinite:
        return None
    out = sum(c for a, b, c in zip(h["edges"], h["edges"][1:], h["counts"]) if a < 0.8 or b > 1.25)
    return (out + nonfinite) / (sum(h["counts"]) + nonfinite)


def _trains(t: Trajectory, rules: dict) -> bool:
    """Whether the batch trained on the episode's tokens: the episode rules (the run's on_failed /
    on_truncated, loop.EPISODE_RULES) neither dropped nor masked it."""
    failed = t.error is not None
    rule = rules.get("on_failed", "drop") if failed else rules.get("on_truncated", "keep") if t.truncated else "keep"
    return rule not in ("drop", "mask")


def _episode(t: Trajectory, trainer_version: int, rules: dict | None = None, trained: bool = True) -> dict:
    """Per episode: the statistics the per-episode checks count. Staleness is blamed on the
    episodes the batch trained on (`rules`: the run's episode rules; `trained` False: a group the
    step rolled out and did not train, untrained/): a failed episode the step dropped was listed
    beside the stale tokens that trained."""
    sampled = [v for s in t.segments for v, m in zip(s.versions, s.loss_mask) if m and v >= 0]
    if not trained or not _trains(t, rules or {}):
        sampled = []
    return {"identity_mismatch": sum(s.stats.get("identity_mismatch", 0) for s in t.segments),
            "retokenization_drift": sum(s.stats.get("retokenization_drift", 0) for s in t.segments),
            "unexpected_seals": sum(s.seal_reason in UNEXPECTED_SEALS for s in t.segments),
            "seals": [s.seal_reason or "open" for s in t.segments],
            "max_staleness": trainer_version - min(sampled) if sampled else 0,
            "failed_rate": t.error is not None, "truncated_rate": bool(t.truncated) and t.error is None}


def step_values(m: dict, trajs: list[Trajectory], rules: dict | None = None,
                untrained: list[Trajectory] = ()) -> tuple[dict, dict]:
    """One step's statistics (CHECKS keys) and, per key, each episode's value (per-episode checks;
    `rules`: the run's on_failed / on_truncated, for which episodes trained; `untrained`: the
    episodes of the groups it rolled out and did not train, untrained/step_*.parquet: their
    failures and token-identity breaks count with the step's)."""
    # the version the step trained from (logged since a skipped update left the version; before, version - 1)
    trained = m.get("trained_version", m.get("version", 1) - 1)
    eps = {t.episode_id: _episode(t, trained, rules) for t in trajs}
    eps.update({t.episode_id: _episode(t, trained, trained=False) for t in untrained})
    # the untrained groups' counts from their file where it is there: it holds the run's leftovers too
    # (the finished groups no step took when a run stops, written with its last step after that step's
    # line: _record_untaken), whose failures the line never counted while the episodes diluted the rates
    if untrained:
        u_n, u_failed = len(untrained), sum(t.error is not None for t in untrained)
        u_truncated = sum(bool(t.truncated) and t.error is None for t in untrained)
    else:
        u_n, u_failed, u_truncated = (m.get(k, 0) for k in ("untrained_episodes", "untrained_failed_episodes",
                                                             "untrained_truncated_episodes"))
    # every episode, dropped and untrained ones too
    n = max(m.get("episodes", 0) + m.get("dropped_episodes", 0), len(trajs), 1) + u_n
    # invariant 1 from the trajectories (each episode's share), else from the step's line (logged
    # since batch_from_groups counts them), else not recorded (None): a run directory copied without
    # its trajectories/ audited 0, clean
    # (the larger of the two where both are there: a copy with trajectories/ but without untrained/ lost
    # the breaks of the filtered or stale groups, which the logged count holds, and audited clean)
    identity = {k: (max(sum(e[k] for e in eps.values()), m.get(k) or 0) if trajs else m.get(k))
                for k in ("identity_mismatch", "retokenization_drift", "unexpected_seals")}
    v = {**identity,
         # the oldest token trained on (the gate's bound); runs before it logged only the histogram (before the gate)
         "max_staleness": (m["max_staleness_kept"] if "max_staleness_kept" in m else
                           max((int(k) for k, c in (m.get("staleness_hist") or {}).items() if c), default=None)),
         "is_weight_outside": _hist_outside(m["is_weight_hist_current"] if "is_weight_hist_current" in m
                                            else m.get("is_weight_hist")),
         "failed_rate": (m["failed_episodes"] + u_failed if "failed_episodes" in m
                         else sum(e["failed_rate"] for e in eps.values())) / n,
         # (the untrained groups' too: the denominator holds their episodes, and filtering half the groups
         # hid a batch half truncated under the 0.25 limit)
         "truncated_rate": (m["truncated_episodes"] + u_truncated if "truncated_episodes" in m
                            else sum(e["truncated_rate"] for e in eps.values())) / n}
    for k in ("gate_pass_ratio", "token_keep_ratio", "replay_disagree_rate", "kl_k3", "kl_k3_live", "sync_max_abs_diff",
              "sync_probe_outlier", "replay_unreplayed", "kl_k3_stale"):
        v[k] = m.get(k)
    layers = [x for x in (m.get("replay_disagree_per_layer") or []) if x is not None]
    v["replay_disagree_worst_layer"] = max(layers) if layers else None
    if m.get("replay_positions") == 0:  # nothing captured: the rate 0 measured nothing
        v["replay_disagree_rate"] = v["replay_disagree_worst_layer"] = None
    # on the trained version's own tokens (None: the step had none). A sync step has nothing else:
    # None there means its tokens were stale, which the check on all of them then shows
    if "kl_k3_current" in m and (m["kl_k3_current"] is not None or m.get("mode") != "sync"):
        v["kl_k3"] = m["kl_k3_current"]
    # (an interrupted step's record, train_interrupted, has no sync at all: the weights moved, the engines
    # were not synced, and the page read it clean)
    v["sync_failed"] = int(bool(m.get("sync_error") or m.get("train_interrupted")))
    norm = m.get("grad_norm")
    v["nonfinite_gradient"] = int(isinstance(norm, (int, float)) and not math.isfinite(norm))
    return v, {k: {ep: e[k] for ep, e in eps.items()} for k in PER_EPISODE} | {"seals": {ep: e["seals"] for ep, e in eps.items()}}


def step_limits(m: dict, limits: dict, staleness_given: bool = False) -> dict:
    """A step's thresholds: `limits`, with the staleness its loop guarantees unless the caller gave
    one (`staleness_given`): 0 for a sync step (its rollout waits for the last sync), the
    async_lag for an async one (the admission bound), never above the trainer's max_staleness.
    Held to max_staleness alone (4 by default), a sync loop whose rollout no longer waited for
    the sync trained every token one version stale, and the page read clean."""
    bound = 0 if m.get("mode") == "sync" else m.get("async_lag")
    if staleness_given or bound is None:
        return limits
    # the step's own gate where it logged it (a session resumed with another max_staleness writes it to
    # config.resume-*.json, which the page does not read: its steps were held to the first session's)
    cap = m["max_staleness_gate"] if "max_staleness_gate" in m else limits["max_staleness"]
    return {**limits, "max_staleness": bound if cap is None else min(cap, bound)}


def _ranges(steps: list[int]) -> str:
    """1, 2, 3, 7 -> '1..3, 7'."""
    out, start = [], None
    for i, st in enumerate(steps):
        if start is None:
            start = st
        if i + 1 == len(steps) or steps[i + 1] != st + 1:
            out.append(f"{start}..{st}" if st != start else str(st))
            start = None
    return ", ".join(out)


def _over(key: str, value, limit) -> bool:
    if value is None or limit is None:
        return False
    if isinstance(value, float) and not math.isfinite(value):  # a NaN compares False with anything
        return True
    return value < limit if key in MINIMA else value > limit


def _id(*parts) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9_]", "_", str(p)) for p in parts)


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if v == 0 or abs(v) >= 1e-3 else f"{v:.2e}"
    return str(v)


def _plot(key: str, steps: list[int], values: list, limit, bad: set[int], width=580, height=140) -> str:
    """One statistic over steps as inline SVG: line and points, the limit dashed, flagged steps red
    and linked to their entry in the violation list."""
    pts = [(s, float(v)) for s, v in zip(steps, values) if v is not None]
    if not pts:
        return "<p class='na'>not recorded in this run (no step had one)</p>"
    l, r, t, b = 60, 10, 10, 24
    w, h = width - l - r, height - t - b
    ys = [y for _, y in pts if math.isfinite(y)] + ([float(limit)] if limit is not None else [])
    ys = ys or [0.0]
    lo, hi = min(0.0, min(ys)), max(ys)
    hi = hi if hi > lo else lo + 1.0
    x0, x1 = steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1
    X = lambda s: l + (s - x0) / (x1 - x0) * w  # noqa: E731
    Y = lambda y: t + h - (y - lo) / (hi - lo) * h  # noqa: E731
    out = [f"<svg width='{width}' height='{height}' font-size='10' font-family='sans-serif'>",
           f"<rect x='{l}' y='{t}' width='{w}' height='{h}' fill='#fafafa' stroke='#ccc'/>",
           f"<text x='{l - 4}' y='{Y(hi) + 4:.0f}' text-anchor='end'>{_fmt(hi)}</text>",
           f"<text x='{l - 4}' y='{Y(lo):.0f}' text-anchor='end'>{_fmt(lo)}</text>",
           f"<text x='{l}' y='{height - 6}'>step {x0}</text><text x='{l + w}' y='{height - 6}' text-anchor='end'>step {steps[-1]}</text>"]
    if limit is not None:
        out.append(f"<line x1='{l}' x2='{l + w}' y1='{Y(limit):.1f}' y2='{Y(limit):.1f}' stroke='#d00' stroke-dasharray='4 3'/>"
                   f"<text x='{l + w - 2}' y='{Y(limit) - 3:.0f}' text-anchor='end' fill='#d00'>"
                   f"{'min' if key in MINIMA else 'max'} {_fmt(limit)}</text>")
    for run in finite_runs(pts):  # a gap at each NaN/inf (browsers stop a points list at its first bad number)
        out.append("<polyline fill='none' stroke='#1f77b4' stroke-width='1.5' points='"
                   + " ".join(f"{X(s):.1f},{Y(y):.1f}" for s, y in run) + "'/>")
    for s, y in pts:
        # a non-finite value is drawn at the top edge (it is flagged: the red, linked dot)
        cy = Y(y) if math.isfinite(y) else t
        dot = f"<circle cx='{X(s):.1f}' cy='{cy:.1f}' r='{4 if s in bad else 2.5}' fill='{'#d00' if s in bad else '#1f77b4'}'>" \
              f"<title>step {s}: {_fmt(y)}</title></circle>"
        out.append(f"<a href='#{_id('v', s, key)}'>{dot}</a>" if s in bad else dot)
    return "".join(out) + "</svg>"


CSS = ("body{font-family:sans-serif;margin:16px;max-width:1200px}table{border-collapse:collapse;font-size:12px}"
       "td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}th{background:#f3f3f3}td.bad{background:#fdd}"
       "td.bad a{color:#a00;font-weight:bold}section{margin:18px 0}.na{color:#999}li.v{margin:3px 0}"
       ":target{outline:3px solid #f90}.traj{border:1px solid #ddd;padding:6px;margin:8px 0}"
       ".stat{display:inline-block;vertical-align:top;width:590px;margin:6px 8px 6px 0}.stat h2{font-size:16px;margin:4px 0}"
       ".stat p{font-size:12px;margin:2px 0 4px}")


def audit_html(run_dir, tokenizer=None, thresholds: Thresholds | None = None, max_views_per_step: int = 16,
               sample_per_step: int = 4, max_view_bytes: int = 20 << 20) -> str:
    """The audit page of the run in `run_dir` (see the module docstring). `tokenizer` (a fast HF
    tokenizer or ChatFormat) shows tokens as text; without one, token views show ids. Token views
    are rendered for flagged steps only: the offending episodes (at most `max_views_per_step`), or
    where no episode is to blame (a per-token statistic) the step's first `sample_per_step`, until
    they fill `max_view_bytes` of the page (a long run flagged at every step made a page of GBs no
    browser opens); the later flagged steps name their trajectory file instead."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    if not metrics:
        raise ValueError(f"{str(run_dir)!r} has no steps in metrics.jsonl: nothing to audit")
    cfg = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    th = thresholds or Thresholds()
    limits = {f.name: getattr(th, f.name) for f in fields(th)}
    staleness_given = limits["max_staleness"] is not None
    tol_given = limits["sync_max_abs_diff"] is not None
    if limits["max_staleness"] is None:
        limits["max_staleness"] = cfg.get("trainer", {}).get("correction", {}).get("max_staleness")
    if limits["sync_max_abs_diff"] is None:
        limits["sync_max_abs_diff"] = cfg.get("loop", {}).get("sync_tol")
    # One step's trajectories at a time: a step's values, violations and seal counts are taken and its
    # episodes let go (holding every step's made a long run's audit run out of memory: ~0.75 MB a
    # quickstart step, ~180 MB at 1M tokens a step); the flagged steps' are read again for their views.
    def step_file(s: int) -> Path:
        return run_dir / "trajectories" / f"step_{s:05d}.parquet"

    def untrained(s: int) -> list[Trajectory]:  # the groups it rolled out and did not train (filtered, stale)
        path = run_dir / "untrained" / f"step_{s:05d}.parquet"
        return read_trajectories(path) if path.is_file() else []

    steps, rows, counts = [], [], {}
    violations = []  # (step, key, value, offending episode ids, the step's limit)
    for m in metrics:
        s = m["step"]
        trajs = read_trajectories(step_file(s)) if step_file(s).is_file() else []
        steps.append(s)
        counts[s] = len(trajs)
        # the step's own loop settings where it logged them (wb.run's overrides), else config.json's
        rules = {**cfg.get("loop", {}), **{k: m[k] for k in ("on_failed", "on_truncated") if k in m}}
        v, per_ep = step_values(m, trajs, rules, untrained(s))
        lim = step_limits(m, limits, staleness_given)
        if not tol_given and m.get("sync_tol") is not None:  # the tolerance the step's own sync was held to
            lim = {**lim, "sync_max_abs_diff": m["sync_tol"]}
        for key, _, _ in CHECKS:
            if _over(key, v[key], lim[key]):
                eps = [ep for ep, x in per_ep.get(key, {}).items() if (x > 0 if key.endswith("rate") else _over(key, x, lim[key]))]
                violations.append((s, key, v[key], eps, lim[key]))
        seals: dict[str, int] = {}
        for ss in per_ep["seals"].values():
            for r in ss:
                seals[r] = seals.get(r, 0) + 1
        rows.append((m, v, seals))
    flagged = {(s, k) for s, k, _, _, _ in violations}
    title = f"Audit of {run_dir.name}"
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title><style>{CSS}</style></head><body>",
           f"<h1>{escape(title)}</h1><p>{len(steps)} step(s), {steps[0]}..{steps[-1]}; model {escape(str(cfg.get('model', '?')))}, "
           f"backend {escape(str(cfg.get('backend', '?')))}, mode {escape(str(metrics[-1].get('mode', '?')))}; "
           f"{sum(counts.values())} episode(s) in trajectories/. Read from {escape(str(run_dir))}.</p>",
           f"<section id='violations'><h2>Violations: {len(violations)}</h2><ul>"]
    by_step: dict[int, list] = {}
    # which episodes get the step's token views first: invariant 1's breaches, then the others (in a
    # step of many timeouts, the failed episodes took every view: the mismatch's link went nowhere)
    first = ("identity_mismatch", "retokenization_drift", "unexpected_seals")
    rank: dict = {}
    for s, key, value, eps, limit in violations:
        by_step.setdefault(s, []).extend(eps)
        for ep in eps:
            rank[s, ep] = min(rank.get((s, ep), len(first)), first.index(key) if key in first else len(first))
    # the episodes each step's views show (invariant 1's first, then in the violations' order), and the
    # links only to those (links cut in another order went nowhere)
    shown = {}
    for s, eps in by_step.items():
        at = {ep: i for i, ep in reversed(list(enumerate(eps)))}
        shown[s] = set(sorted(at, key=lambda ep: (rank[s, ep], at[ep]))[:max_views_per_step])
    for s, key, value, eps, limit in violations:
        linked = [ep for ep in eps if ep in shown[s]]
        links = (", ".join(f"<a href='#{_id('t', s, ep)}'>{escape(ep)}</a>" for ep in linked)
                 + (f" (and {len(eps) - len(linked)} more without a token view)" if len(linked) < len(eps) else "") if eps else
                 f"<a href='#{_id('step', s)}'>a sample of the step's trajectories</a> (per-token values: wb.revisit(run_dir, {s}))")
        out.append(f"<li class='v' id='{_id('v', s, key)}'>step {s}: <a href='#{_id('stat', key)}'>{escape(dict((k, t) for k, t, _ in CHECKS)[key])}</a> "
                   f"= {_fmt(value)} ({'min' if key in MINIMA else 'max'} {_fmt(limit)}) &rarr; {links}</li>")
    missing = [st for st in steps if not counts[st]]
    # the forward check on a step with no current-version tokens measured nothing (an async run bound by
    # training samples every token a version behind: from step 1 on, every step): said, not read as within
    # (a step that trained nothing, every episode failed or dropped, is said as such: it read as async)
    # (by segments, not episodes: masked episodes count as episodes and train nothing; an interrupted step's
    # statistics were never computed)
    idle = [st for st, (m, v, _) in zip(steps, rows) if v["kl_k3"] is None and (not m.get("segments") or "train_interrupted" in m)]
    unforward = [st for st, (_, v, _) in zip(steps, rows) if v["kl_k3"] is None and st not in idle]
    out.append("</ul>" + ("" if violations else "<p>Every statistic of every step is within its threshold.</p>")
               + (f"<p class='na'>k3 with replay (forward consistency) not measured on {len(unforward)} of {len(steps)} "
                  f"step(s) ({_ranges(unforward)}): no token of the trained version (an async run's tokens were all "
                  f"sampled a version behind); there the sync probe difference is its check.</p>" if unforward else "")
               + (f"<p class='na'>{len(idle)} step(s) measured nothing of the forward ({_ranges(idle)}): no episode of "
                  f"theirs reached the batch (failed, dropped or masked; failure_reasons in metrics.jsonl says why), or "
                  f"their training was interrupted (train_interrupted).</p>" if idle else "")
               + (f"<p class='na'>No trajectories/step_*.parquet for {len(missing)} step(s) ({_ranges(missing)}): their "
                  f"token-identity checks read the step's logged totals, or are not recorded (–) where it has none.</p>"
                  if missing else "") + "</section>")
    # every step's statistics, flagged cells linked to their violation
    out.append("<section id='steps'><h2>Every step</h2><table><tr><th>step</th>"
               + "".join(f"<th><a href='#{_id('stat', k)}'>{escape(t)}</a></th>" for k, t, _ in CHECKS)
               + "<th>seals by reason</th><th>staleness: tokens</th><th>IS weights: counts per bin</th></tr>")
    for (m, v, seals), s in zip(rows, steps):
        cells = "".join(f"<td class='bad'><a href='#{_id('v', s, k)}'>{_fmt(v[k])}</a></td>" if (s, k) in flagged
                        else f"<td>{_fmt(v[k])}</td>" for k, _, _ in CHECKS)
        hist = m.get("is_weight_hist") or {}
        out.append(f"<tr><td>{s}</td>{cells}<td>{escape(', '.join(f'{r} {c}' for r, c in sorted(seals.items())))}</td>"
                   f"<td>{escape(', '.join(f'{k}: {c}' for k, c in (m.get('staleness_hist') or {}).items()))}</td>"
                   f"<td>{escape(' '.join(str(c) for c in hist.get('counts', [])))}</td></tr>")
    edges = next((m["is_weight_hist"]["edges"] for m in metrics if m.get("is_weight_hist")), None)
    out.append("</table>" + (f"<p>IS-weight bins: edges {escape(str(edges))}</p>" if edges else "") + "</section>")
    # the tolerance the steps' syncs were held to (wb.run(sync_tol=...) overrides config.json's): the
    # plot's line and its heading drew config.json's beside steps checked against another
    step_tols = [m["sync_tol"] for m in metrics if m.get("sync_tol") is not None]
    if not tol_given and step_tols:
        limits["sync_max_abs_diff"] = step_tols[-1]
    for key, name, what in CHECKS:
        bad = {s for s, k in flagged if k == key}
        per_step = " (the cap; per step: 0 sync, its async_lag async)" if key == "max_staleness" and not staleness_given else ""
        if key == "sync_max_abs_diff" and not tol_given and len(set(step_tols)) > 1:
            per_step = f" (the last step's; per step {_fmt(min(step_tols))} to {_fmt(max(step_tols))})"
        unmeasured = [s for s, (_, v, _) in zip(steps, rows) if v[key] is None]
        out.append(f"<section class='stat' id='{_id('stat', key)}'><h2>{escape(name)}</h2><p>{escape(what)}; "
                   f"{'min' if key in MINIMA else 'max'} {_fmt(limits[key])}{per_step}; {len(bad)} step(s) flagged"
                   f"{f', {len(unmeasured)} not measured' if unmeasured and len(unmeasured) < len(steps) else ''}.</p>"
                   f"{_plot(key, steps, [v[key] for _, v, _ in rows], limits[key], bad)}</section>")
    # token views of the flagged steps' trajectories, offending ones first
    out.append("<section id='trajectories'><h2>Token views of flagged steps</h2>"
               "<p>Colour: sampled tokens from green (log-prob 0) to red (log-prob &le; -5); grey: not sampled. "
               "Hover a token for its id, log-prob and version.</p>")
    view_bytes = 0
    for s in sorted(by_step):
        if view_bytes >= max_view_bytes:
            # (each linked episode's id on its note: the violation list's links to them went nowhere)
            out.append(f"<div id='{_id('step', s)}'><h3>step {s}</h3><p class='na'>token views left out: the page's "
                       f"{max_view_bytes >> 20} MiB of them are spent (trajectories/step_{s:05d}.parquet; "
                       f"wb.revisit(run_dir, {s}) for its per-token values)</p>"
                       + "".join(f"<p class='na' id='{_id('t', s, ep)}'>{escape(ep)}: token view left out</p>"
                                 for ep in sorted(shown.get(s, ()))) + "</div>")
            continue
        # the offending episodes; for a per-token statistic (no episode to blame) a sample of the step's
        trajs = read_trajectories(step_file(s)) if counts[s] else []
        not_trained = untrained(s)
        skipped = {t.episode_id for t in not_trained}
        order = sorted((t for t in trajs + not_trained if t.episode_id in shown[s]),
                       key=lambda t: rank.get((s, t.episode_id), len(first))) or trajs[:sample_per_step]
        out.append(f"<div id='{_id('step', s)}'><h3>step {s}</h3>")
        for t in order:
            if view_bytes >= max_view_bytes:  # (one step's long views alone could pass it several times)
                out.append(f"<p class='na' id='{_id('t', s, t.episode_id)}'>{escape(t.episode_id)}: token view left out "
                           f"(the page's budget is spent)</p>")
                continue
            out.append(f"<div class='traj' id='{_id('t', s, t.episode_id)}'>"
                       + (("<p class='na'>not trained: the run ended before a step took its group (recorded with "
                           f"the last step: untrained/step_{s:05d}.parquet)</p>" if t.info.get("untaken") else
                           "<p class='na'>not trained: its group was filtered (no reward variance) or stale "
                           f"(untrained/step_{s:05d}.parquet)</p>") if t.episode_id in skipped else "")
                       + f"{trajectory_html(t)}{spans_html(token_spans(t, 'logprob', tokenizer))}</div>")
            view_bytes += len(out[-1])
        out.append("</div>")
    return "".join(out) + "</section></body></html>"


def write_audit(run_dir, path=None, tokenizer=None, thresholds: Thresholds | None = None) -> Path:
    """Write the audit page (default: run_dir/audit.html); returns its path."""
    path = Path(path or Path(run_dir) / "audit.html")
    path.write_text(audit_html(run_dir, tokenizer, thresholds), encoding="utf-8")
    return path


def _tokenizer(run_dir: Path, given: str | None):
    """--tokenizer, else a kept policy's (wb.run(keep_policy_every=N) copies tokenizer files), else None;
    as its profile's ChatFormat where the directory has one (its template kwargs: Llama 3's date_string
    re-rendered as the template's default showed drift that was not there)."""
    from ..profiles import profile_for
    from ..tokens import ChatFormat
    from ..toy.models import load_tokenizer

    for d in ([Path(given)] if given else sorted((run_dir / "policies").glob("step_*"))):
        if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
            tokenizer = load_tokenizer(str(d))
            try:
                return ChatFormat.for_profile(tokenizer, profile_for(d))
            except Exception:  # (no config.json, an unknown family: the bare tokenizer's render)
                return tokenizer
    return None


def _threshold(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m workbench.audit", description="Write a run's audit page (one offline HTML file).")
    p.add_argument("run_dir")
    p.add_argument("-o", "--out", help="the page's path (default RUN_DIR/audit.html)")
    p.add_argument("--tokenizer", help="a checkpoint directory whose tokenizer shows tokens as text")
    for f in fields(Thresholds):
        # (the two the run bounds itself read "none" as its bound, and still flag: they said "not flagged")
        said = ("none: the run's own bound (its max_staleness, its loop's sync_tol)" if f.name in ("max_staleness", "sync_max_abs_diff")
                else "none: shown, not flagged")
        p.add_argument(f"--{f.name.replace('_', '-')}", type=_threshold, default=f.default,
                       help=f"threshold (default {f.default}; {said})")
    a = p.parse_args(argv)
    th = Thresholds(**{f.name: getattr(a, f.name) for f in fields(Thresholds)})
    path = write_audit(a.run_dir, a.out, _tokenizer(Path(a.run_dir), a.tokenizer), th)
    print(f"{path} ({path.stat().st_size} bytes)")


# ------------------------------------------------------------------ step revisit (wb.revisit)
REVISITED = ("loss", "grad_norm", "gate_pass_ratio", "token_keep_ratio", "stale_dropped", "band_dropped", "veto_dropped", "kl_k1", "kl_k3",
             "kl_k3_current", "tokens_current", "kl_k3_stale", "max_abs_delta_p", "staleness_hist", "tokens_per_version", "is_weight_hist", "is_ess", "is_bounded_fraction", "replay_disagree_rate",
             "replay_disagree_per_layer", "replay_fallback", "kl_k3_live", "kl_ref", "replay_positions", "replay_compared", "replay_unreplayed",
             "max_staleness_kept", "signal_tokens_trained", "updates_skipped", "policy_shift")

# what updates after a step's first move with the optimizer's state: the revisit's trainer is fresh
# (the kept policy holds weights only), so with updates_per_step > 1 these differed on every step,
# however rightly it trained (a real difference then read as the usual noise). Not compared there
OPTIMIZER_DEPENDENT = ("loss", "grad_norm", "policy_shift", "kl_ref", "replay_disagree_rate", "replay_disagree_per_layer",
                       "replay_unreplayed", "updates_skipped")


@dataclass
class Revisit:
    """Step `step` recomputed on the policy it trained from (wb.revisit): `recomputed` holds the
    statistics under metrics.jsonl's keys (REVISITED), `logged` that step's line, `report` the
    per-token tensors (trainer log-probs, IS weights, gate decisions, advantages, loss
    contributions: what the token journey shows), `trajectories` and `batch` what it trained on."""
    step: int
    version: int
    logged: dict
    recomputed: dict
    report: dict
    trajectories: list
    batch: dict
    tokenizer: object = None

    def differences(self, rtol: float = 1e-5, atol: float = 1e-7) -> dict:
        """{key: (logged, recomputed)} for the statistics that differ beyond rtol/atol."""
        def same(a, b):
            if isinstance(a, dict) and isinstance(b, dict):
                return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            if isinstance(a, list) and isinstance(b, list):
                return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):  # (a NaN logged and recomputed: the same)
                return a == b or abs(a - b) <= atol + rtol * abs(a) or (math.isnan(a) and math.isnan(b))
            return a == b
        rec = json.loads(json.dumps(self.recomputed, default=str))  # keys as the JSON log has them
        # a statistic the logged run predates (its metrics.jsonl has no such key), or kl_k3_live on a
        # step off its cadence (None; the recomputing trainer's first step measures it), has
        # nothing to compare
        return {k: (self.logged.get(k), rec.get(k)) for k in REVISITED if k in self.logged and k not in self.not_comparable()
                and not (k == "kl_k3_live" and self.logged[k] is None) and not same(self.logged[k], rec.get(k))}

    def not_comparable(self) -> tuple:
        """The statistics a revisit cannot recompute: with several updates a step, OPTIMIZER_DEPENDENT."""
        return OPTIMIZER_DEPENDENT if (self.logged.get("updates") or 1) > 1 else ()

    def _unlike(self, key: str) -> str:
        return ("not comparable (the updates after the first moved with a fresh optimizer)"
                if key in self.not_comparable() else "equal")

    def journey(self, row: int = 0, col: int | None = None):
        """The token journey widget on the recomputed report (default: row's first sampled token)."""
        from . import TokenJourney

        col = int(self.report["loss_mask"][row].nonzero()[0, 0]) if col is None else col
        return TokenJourney(self.report, row, col, self.tokenizer)

    def _repr_html_(self) -> str:
        diff = self.differences()
        rec = json.loads(json.dumps(self.recomputed, default=str))
        rows = "".join(f"<tr><td>{k}</td><td>{escape(_fmt(self.logged.get(k)))}</td><td>{escape(_fmt(rec.get(k)))}</td>"
                       f"<td>{'<b style=color:#c00>differs</b>' if k in diff else self._unlike(k)}</td></tr>" for k in REVISITED)
        return (f"<b>step {self.step}, policy version {self.version}</b>: {len(self.trajectories)} episode(s), "
                f"{self.batch['input_ids'].shape[0]} row(s); .report holds the per-token values, .journey(row, col) "
                f"follows one token<table><tr><th>statistic</th><th>logged</th><th>recomputed</th><th></th></tr>{rows}</table>")
