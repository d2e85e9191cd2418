"""Invariant 3, forward consistency for MoE: routing capture and routing replay (R3).

HF transformers 5.x routes through small router modules (`Qwen3MoeTopKRouter`,
`MixtralTopKRouter`, ...) whose forward returns `(router_logits, routing_weights, expert_ids)`.
Forward hooks on those modules are all this file needs, no fork of the model code:

- `RouterCapture` records the expert ids each router chose (the reference sampler uses it to
  return `routed_experts` like vLLM does on GPU).
- `routing_replay` substitutes recorded ids for the live top-k. The router logits and softmax
  are still computed, so the router keeps receiving gradients; only the *choice* is replayed,
  and the gate weights are gathered at the recorded ids and renormalized as the model does.
  Positions recorded as -1 keep live routing and are counted.

Layout of recorded experts for a forward over input_ids [B, S]: [B, S, moe_layers, top_k]
(or [S, moe_layers, top_k] for B == 1), int, -1 = not captured. vLLM's per-decoder-layer
record (dense layers included) is read at the router layers (`router_layers`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def latest_version_routing(experts, versions: list[int], loss_mask: list[int]):
    """The recorded experts ([T, layers, k]) of one segment that the trainer replays: where the
    segment's trainable tokens were sampled at several policy versions, only the routing recorded
    at the latest one; where a request spanned the sync, earlier positions become -1 (live).

    Why: a token sampled after a weight sync saw every earlier position computed by the new
    weights, their routing included (the engine recomputes an in-flight request's context at a
    sync; a later turn's prefill computes the whole conversation again). A later turn's request
    reports that routing for its whole context, and Accumulator keeps it (_merge_experts). But
    vLLM reports a request resumed after a sync with its earlier positions as first routed, under
    the old weights: replaying those makes the newest tokens' forward differ from the engine's
    wherever the two versions route differently, so they route live; the older tokens, stale and
    importance-corrected, cannot be matched in the same forward anyway."""
    import numpy as np

    sampled = [v for v, m in zip(versions, loss_mask) if m]
    if experts is None or len(set(sampled)) < 2:
        return experts
    latest = max(sampled)
    first = next(i for i, (v, m) in enumerate(zip(versions, loss_mask)) if m and v == latest)
    # a turn begins at the latest version (its first token's position holds no sampled token): its
    # request's prefill recorded every earlier position under that version, and _merge_experts kept
    # that recording there (an earlier turn straddling the sync included)
    if any(m and v == latest and not loss_mask[i - 1] for i, (v, m) in enumerate(zip(versions, loss_mask)) if i >= first):
        return experts
    out = np.array(experts, copy=True)
    out[: max(first - 1, 0)] = -1  # position first - 1 produced the first latest-version token: recorded then
    return out


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k router modules, in layer order."""
    # (any case: transformers spells DeepSeek-V3's, GLM-4.5 MoE's and others' "TopkRouter")
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def router_layers(model: torch.nn.Module) -> list[int]:
    """The decoder layer each router sits in (moe_routers' order), read from its module path
    (`model.layers.3.mlp.gate` is layer 3).

    Why: vLLM records routing per decoder layer ([T, num_hidden_layers, k], a dense layer's rows
    left 0), our reference sampler per router. The two agree where every layer is MoE; DeepSeek-V3,
    Kimi K2, GLM-4.5 (their first layers dense) and Qwen3-MoE with `mlp_only_layers` need the
    MoE layers picked out, or each router would replay another layer's experts."""
    import re

    found = [(name, m) for name, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]
    layers = []
    for name, _ in found:
        match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if match is None:
            raise ValueError(f"routing replay: router {name!r} is in no `layers.<i>` module; cannot tell which "
                             f"decoder layer's recorded experts it replays")
        layers.append(int(match.group(1)))
    return layers


def _per_router(model: torch.nn.Module, experts: torch.Tensor, routers: int) -> torch.Tensor:
    """Recorded experts [..., layers, k] -> [..., routers, k]: as recorded when every layer has a
    router, else the router layers' rows of a per-decoder-layer record (vLLM's)."""
    if experts.shape[-2] == routers:
        return experts
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "num_hidden_layers", None)
    if experts.shape[-2] != hidden:
        raise ValueError(f"recorded experts have {experts.shape[-2]} layers; the model has {routers} MoE layers "
                         f"of {hidden} decoder layers")
    return experts.index_select(-2, torch.tensor(router_layers(model), device=experts.device))


# How each router class turns logits into gate weights for its chosen ids, mirrored exactly so
# that a replayed forward equals the recorded one (dtype included). Add a rule per new router.
REPLAY_RULES = {}


def register_replay_rule(router_class_name: str):
    def deco(fn):
        REPLAY_RULES[router_class_name] = fn
        return fn

    return deco


def _softmax_gather(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    w = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    return w / w.sum(dim=-1, keepdim=True) if renormalize else w


@register_replay_rule("Qwen3MoeTopKRouter")
def _qwen3_moe(router, logits, ids):
    # fp32 softmax over all experts, gather, renormalize when norm_topk_prob, back to logits dtype
    return _softmax_gather(logits, ids, router.norm_topk_prob).to(logits.dtype)


@register_replay_rule("MixtralTopKRouter")
def _mixtral(router, logits, ids):
    # fp32 softmax, gather, always renormalized over the top-k; the weights stay fp32
    return _softmax_gather(logits, ids, True)


def _gate_weights(router: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gate weights at the given expert ids, computed exactly as `router` does for its own top-k."""
    return REPLAY_RULES[type(router).__name__](router, logits, ids)


class RouterCapture:
    """Records each router's expert ids on every forward while `active`."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self.active = False
        self.calls: list[list[torch.Tensor]] = []  # per forward: per layer [N, top_k]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self.active:
                if layer == 0:
                    self.calls.append([])
                self.calls[-1].append(output[2].detach().to(torch.int16).clone())

        return hook

    def pop(self) -> torch.Tensor | None:
        """Expert ids of the last forward: [N, layers, top_k] (N = B * S flattened), or None."""
        if not self.calls:
            return None
        layers = self.calls.pop()
        self.calls.clear()
        return torch.stack(layers, dim=1)

    def remove(self):
        for h in self._handles:
            h.remove()


def recorded_experts(live_ids: torch.Tensor, recorded_ids: torch.Tensor) -> torch.Tensor:
    """The experts a replayed forward routes with ([N, top_k] each): the recorded ids, and the
    router's live top-k where none were recorded (-1)."""
    captured = (recorded_ids >= 0).all(dim=-1, keepdim=True)
    return torch.where(captured, recorded_ids, live_ids)


_choice = [recorded_experts]


def register_expert_choice(fn=None) -> None:
    """Make `fn(live_ids, recorded_ids) -> ids` the rule routing_replay routes with in this
    process (None: recorded_experts again). The extension point of workshop notebook 03's
    exercise; a trainer rank is another process and keeps its own."""
    _choice[0] = fn or recorded_experts


@dataclass(eq=False)
class ReplayStats:
    """Per MoE layer: positions replayed, positions that fell back to live routing (-1),
    positions where the live top-k set differs from the recorded one (router disagreement), and
    recorded positions the forward did not route as recorded while replay applied (`unreplayed`:
    0 unless the replay rule is broken; the disagreement cannot show that, it is about the router),
    and the replayed positions the disagreement was compared over (`compared`: routing_replay's
    `compare`; every replayed one by default).

    The forwards' counts stay tensors on the model's device (`pending`) until one of the three
    lists is first read: then all of them in one transfer. On a GPU each read waits for the
    device to drain its queue: an int() per layer and forward cost replay on vs off 1.08x on an
    H200, and the trainer reads a step's counts once, after its last micro-batch."""

    layers: int = 0
    pending: list = field(default_factory=list)  # (layer, tensor [replayed, fallback, disagree, unreplayed, compared])
    _counts: list | None = None  # [replayed, fallback, disagree, unreplayed, compared], each a list per layer

    def _read(self) -> list:
        if self._counts is None:
            self._counts = [[0] * self.layers for _ in range(5)]
        if self.pending:
            for (layer, _), values in zip(self.pending, torch.stack([c for _, c in self.pending]).tolist()):
                for counts, v in zip(self._counts, values):
                    counts[layer] += v
            self.pending = []
        return self._counts

    def __eq__(self, other) -> bool:  # equal counts (the pending tensors read first)
        return isinstance(other, ReplayStats) and self._read() == other._read()

    replayed = property(lambda self: self._read()[0])
    fallback = property(lambda self: self._read()[1])
    disagree = property(lambda self: self._read()[2])
    unreplayed = property(lambda self: self._read()[3])
    compared = property(lambda self: self._read()[4])

    @property
    def disagreement_rate(self) -> float:
        n = sum(self.compared)
        return sum(self.disagree) / n if n else 0.0


def _in_backward() -> bool:
    # autograd's current graph task is -1 outside a backward pass (torch.utils.checkpoint
    # uses the same test to tell a recompute from a forward)
    return torch._C._current_graph_task_id() != -1


@contextmanager
def routing_replay(model: torch.nn.Module, experts: torch.Tensor | None, apply: bool = True,
                  positions: torch.Tensor | None = None, compare: torch.Tensor | None = None):
    """Within this context, every forward of `model` routes with the recorded `experts`.

    `experts`: [B, S, layers, top_k] or [S, layers, top_k] matching the next forward's
    input_ids. Yields a ReplayStats filled in as forwards run. With `experts=None` nothing is
    replayed (live routing) and nothing is counted. `apply=False` observes only: live routing
    runs, and the statistics count where it disagrees with `experts` (what replay would have
    changed). `positions` ([B, S] or [S], e.g. the attention mask): count only these positions
    (padding is neither a replay nor a fallback). `compare` (the same shape): where the
    disagreement is counted, among those (default: all of them); the trainer leaves out rows whose
    tokens an older version sampled, whose recorded routing differs from the trained weights' by
    the optimizer's moves, not by replay. With activation checkpointing, run the
    backward inside the context too: its recompute forwards must replay the same experts.
    The statistics are read when first used (ReplayStats): each layer's counts stay tensors on
    the model's device until then.
    """
    routers = moe_routers(model)
    stats = ReplayStats(len(routers))
    if experts is not None and not routers and (torch.as_tensor(experts) >= 0).any():
        # recorded routing and no router found to replay it into: replay did nothing, and its
        # statistics were empty ("not measured"), for a model whose routers have another class name
        raise ValueError(f"the batch carries recorded experts but {type(model).__name__} has no router module "
                         f"routing replay knows (a class named *TopKRouter); name its router class in "
                         f"workbench.replay.moe_routers and register a rule (register_replay_rule)")
    if experts is None or not routers:
        yield stats
        return
    unknown = sorted({type(r).__name__ for r in routers} - set(REPLAY_RULES))
    if unknown:
        raise NotImplementedError(f"no routing-replay rule for router class(es) {unknown}; "
                                  f"register one with workbench.replay.register_replay_rule (known: {sorted(REPLAY_RULES)})")
    experts = _per_router(model, torch.as_tensor(experts), len(routers))
    flat = experts.reshape(-1, experts.shape[-2], experts.shape[-1]).long()
    counted = None if positions is None else torch.as_tensor(positions).reshape(-1).bool()
    compared_at = None if compare is None else torch.as_tensor(compare).reshape(-1).bool()
    on_device = {}  # device -> what every layer's hook reads there, made once per context

    def prepared(device):
        # What depends only on the record, not on the forward: which positions were captured and
        # each layer's replayed / fallback counts, computed once for all layers. Why: the hook's
        # small kernels run per layer and forward, and on an H200 replay on vs off was 1.12x.
        if device not in on_device:
            rec_all = flat.to(device)
            captured = (rec_all >= 0).all(dim=-1)  # [N, layers]
            real = torch.ones_like(captured[:, 0]) if counted is None else counted.to(device)
            counted_captured = captured & real[:, None]
            replayed = counted_captured.sum(0)
            base = torch.stack([replayed, real.sum() - replayed], dim=1)  # [layers, 2]
            comparing = counted_captured if compared_at is None else counted_captured & compared_at.to(device)[:, None]
            on_device[device] = (rec_all, captured, counted_captured, base, comparing, comparing.sum(0))
        return on_device[device]

    def hook_for(layer: int):
        def hook(module, args, output):
            logits, _, live_ids = output
            if logits.shape[0] != flat.shape[0]:
                raise ValueError(
                    f"routing replay: forward routes {logits.shape[0]} positions, "
                    f"recorded experts cover {flat.shape[0]}"
                )
            rec_all, captured, counted_captured, base, comparing, compared = prepared(live_ids.device)
            rec = rec_all[:, layer, :]
            if _choice[0] is recorded_experts:  # its where, with the captured mask already made
                ids = torch.where(captured[:, layer, None], rec, live_ids)
            else:
                ids = _choice[0](live_ids, rec).to(live_ids.device)
            # Activation checkpointing re-runs this forward inside backward: the replay must
            # apply there too (hence the context must stay open across backward), but the
            # positions are counted once, on the real forward.
            if not _in_backward():
                # the live top-k set differs from the recorded one (sets of k distinct ids: some live
                # id is not among them; a pairwise compare, not two sorts). Against the record, not
                # the ids routed: a rule that routes live would make those agree with live routing
                here = counted_captured[:, layer]
                differs = ~(live_ids[:, :, None] == rec[:, None, :]).any(-1).all(-1) & comparing[:, layer]
                # the routed set is not the recorded one where replay applies: the rule is broken
                unreplayed = ~(ids[:, :, None] == rec[:, None, :]).any(-1).all(-1) & here if apply else torch.zeros_like(here)
                stats.pending.append((layer, torch.cat([base[layer], differs.sum()[None], unreplayed.sum()[None],
                                                        compared[layer, None]])))
            if not apply:
                return None  # keep the router's own output
            return logits, _gate_weights(module, logits, ids), ids.to(live_ids.dtype)

        return hook

    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(routers)]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
