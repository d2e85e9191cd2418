"""Placement on a GPU cluster: which node and GPUs each trainer rank and rollout engine gets.

A plan is computed from the session's shape (trainer ranks, engines, their tensor-parallel
size, the mode) and a cluster description (nodes and their GPUs), without Ray: so
`python -m workbench.cluster plan --nodes 2 --gpus-per-node 8` can print it on a laptop, and
refuse a shape that cannot fit before anything starts. `Placement.create` then reserves it as
Ray placement groups, one per role, each bundle pinned to the node the plan names (Ray's
`ray.io/node-id` label), and hands out the actor options that put each actor in its bundle.

Modes:
- "split" (the 2x8 H100 default): the FSDP2 trainer and the vLLM engines on separate GPUs.
  Trainer ranks, one GPU each, are packed on as few nodes as possible (all on one node when
  they fit: NCCL inside a node runs over NVLink, across nodes over the network); engines, one
  bundle of `tensor_parallel_size` GPUs each (vLLM's tensor-parallel workers run inside the
  engine's actor, so they must share a node), fill the nodes the trainer does not use first.
- "colocated": trainer rank i and engine i share GPU i (half of it each, in Ray's accounting);
  engines must then have tensor_parallel_size 1, and vLLM's gpu_memory_utilization must leave
  the trainer its share (docs/cluster.md).

Ray places bundles of one placement group by strategy only; it has no anti-affinity between
groups. Pinning every bundle to a node is what keeps the trainer and the engines apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODES = ("split", "colocated")
NODE_LABEL = "workbench/node"  # an optional node label naming the node in plans (ray start --labels)
NODE_ID_LABEL = "ray.io/node-id"  # Ray's own label on every node: what bundles are pinned by


class PlacementError(ValueError):
    """The session's shape does not fit the cluster, or Ray could not reserve it."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: int
    node_id: str | None = None  # Ray's node id (None: a description, as the CLI's)
    ip: str | None = None


@dataclass(frozen=True)
class ClusterSpec:
    nodes: tuple[NodeSpec, ...]

    @classmethod
    def uniform(cls, nodes: int, gpus_per_node: int) -> "ClusterSpec":
        if nodes < 1 or gpus_per_node < 1:
            raise PlacementError(f"a cluster needs at least one node with at least one GPU, got {nodes} node(s) x "
                                 f"{gpus_per_node} GPU(s)")
        return cls(tuple(NodeSpec(f"node{i}", gpus_per_node) for i in range(nodes)))

    @classmethod
    def from_ray(cls) -> "ClusterSpec":
        """The alive nodes of the connected Ray cluster that have GPUs (a CPU-only head node
        drives but hosts no trainer rank or engine). Named by their `workbench/node` label
        where they have one, else node0, node1, ... (head node first, then by address)."""
        import ray

        alive = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1]
        alive.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n.get("NodeManagerAddress", ""),
                                  n["NodeID"]))
        nodes = []
        for i, n in enumerate(alive):
            name = (n.get("Labels") or {}).get(NODE_LABEL) or f"node{i}"
            nodes.append(NodeSpec(name, int(n["Resources"]["GPU"]), n["NodeID"], n.get("NodeManagerAddress")))
        if not nodes:
            raise PlacementError("the Ray cluster has no node with a GPU: nothing to place (on CPU, no placement is needed)")
        names = [n.name for n in nodes]
        if len(set(names)) < len(names):  # (one node's label, another's default name: a plan merged the two)
            twice = sorted({x for x in names if names.count(x) > 1})
            raise PlacementError(f"two GPU nodes are named {twice}: label every node with a name of its own "
                                 f"(ray start --labels {NODE_LABEL}=nodeN) or none of them")
        return cls(tuple(nodes))

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def describe(self) -> str:
        sizes = {n.gpus for n in self.nodes}
        if len(sizes) == 1:
            return f"{len(self.nodes)} node(s) x {sizes.pop()} GPUs = {self.total_gpus} GPUs"
        return ", ".join(f"{n.name}: {n.gpus} GPUs" for n in self.nodes) + f" = {self.total_gpus} GPUs"


@dataclass(frozen=True)
class Slot:
    """One actor's place: its role ("trainer" / "engine"), index (rank / engine number), the
    node, the bundle of its role's placement group, and the GPUs it asks Ray for."""

    role: str
    index: int
    node: str
    bundle: int
    gpus: float


@dataclass(frozen=True)
class GroupPlan:
    """One placement group: bundles (Ray resource dicts) and the node each is pinned to."""

    role: str
    bundles: tuple[dict, ...]
    nodes: tuple[str, ...]

    @property
    def strategy(self) -> str:
        # one node: STRICT_PACK, which is also what Ray checks against the pins; several: PACK
        return "STRICT_PACK" if len(set(self.nodes)) == 1 else "PACK"


@dataclass(frozen=True)
class PlacementPlan:
    cluster: ClusterSpec
    mode: str
    trainer_ranks: int
    num_engines: int
    tensor_parallel_size: int
    groups: tuple[GroupPlan, ...]
    slots: tuple[Slot, ...]

    def slot(self, role: str, index: int) -> Slot:
        for s in self.slots:
            if s.role == role and s.index == index:
                return s
        raise KeyError(f"the plan has no {role} {index}")

    def group(self, role: str) -> GroupPlan:
        return next(g for g in self.groups if g.role == role)

    def render(self) -> str:
        """The plan as a table: per node, which actor holds which of its GPUs."""
        lines = [f"cluster: {self.cluster.describe()}; mode: {self.mode}"]
        for g in self.groups:
            where = ", ".join(dict.fromkeys(g.nodes))
            lines.append(f"placement group {g.role!r}: {len(g.bundles)} bundle(s) {dict(g.bundles[0])}, "
                         f"{g.strategy} on {where}")
        used = {n.name: 0.0 for n in self.cluster.nodes}
        lines.append(f"{'node':<10} {'GPUs':<7} actor")
        for node in self.cluster.nodes:
            gpu = 0
            here = [s for s in self.slots if s.node == node.name]
            if self.mode == "colocated":  # two actors per GPU: list them by bundle
                for b in sorted({s.bundle for s in here}):
                    names = " + ".join(self._name(s) for s in here if s.bundle == b)
                    lines.append(f"{node.name:<10} {b:<7} {names}")
                used[node.name] = len({s.bundle for s in here})
            else:
                for s in sorted(here, key=lambda s: (s.role != "trainer", s.index)):
                    n = int(s.gpus)
                    gpus = f"{gpu}" if n == 1 else f"{gpu}-{gpu + n - 1}"
                    lines.append(f"{node.name:<10} {gpus:<7} {self._name(s)}")
                    gpu += n
                used[node.name] = gpu
            if used[node.name] < node.gpus:
                lines.append(f"{node.name:<10} {'-':<7} {node.gpus - int(used[node.name])} GPU(s) free")
        lines.append("(GPU numbers are slots within a node; Ray chooses the devices)")
        return "\n".join(lines)

    def _name(self, s: Slot) -> str:
        if s.role == "trainer":
            return f"trainer rank {s.index}"
        return f"engine {s.index}" + (f" (tensor_parallel_size {self.tensor_parallel_size})"
                                      if self.tensor_parallel_size > 1 else "")


def _shape(trainer_ranks: int, num_engines: int, tensor_parallel_size: int) -> str:
    return f"{trainer_ranks} trainer rank(s) x 1 GPU + {num_engines} engine(s) x tensor_parallel_size {tensor_parallel_size}"


def check_fits(cluster: ClusterSpec, trainer_ranks: int, num_engines: int, tensor_parallel_size: int = 1) -> None:
    """PlacementError where a GPU each rank and `tensor_parallel_size` on one node each engine cannot
    fit on `cluster` at all, whatever places them (split's plan, or Ray alone under placement
    "none": there the actors waited for GPUs for ever, and connect() with them)."""
    biggest = max(n.gpus for n in cluster.nodes)
    need = trainer_ranks + num_engines * tensor_parallel_size
    shape = f"{_shape(trainer_ranks, num_engines, tensor_parallel_size)} = {need} GPUs"
    if tensor_parallel_size > biggest:
        raise PlacementError(f"cannot place an engine with tensor_parallel_size {tensor_parallel_size}: its GPUs must be "
                             f"on one node (vLLM's workers run inside the engine's actor), and the largest node has "
                             f"{biggest} GPUs ({cluster.describe()})")
    if need > cluster.total_gpus:
        raise PlacementError(f"cannot place {shape} on {cluster.describe()}: {need - cluster.total_gpus} GPU(s) short. "
                             f"Use fewer trainer_ranks or num_engines, a smaller tensor_parallel_size, or "
                             f"placement='colocated' (trainer and engines share GPUs)")


def plan_placement(cluster: ClusterSpec, trainer_ranks: int, num_engines: int, tensor_parallel_size: int = 1,
                   mode: str = "split") -> PlacementPlan:
    """The placement of `trainer_ranks` FSDP2 ranks and `num_engines` engines of
    `tensor_parallel_size` GPUs on `cluster`; PlacementError says why a shape cannot fit."""
    if mode not in MODES:
        raise PlacementError(f"placement mode {mode!r} unknown: {' or '.join(MODES)}")
    # num_engines 0: a trainer alone (its engines elsewhere, or none)
    for name, v, least in (("trainer_ranks", trainer_ranks, 1), ("num_engines", num_engines, 0),
                           ("tensor_parallel_size", tensor_parallel_size, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise PlacementError(f"{name} must be an integer >= {least}, got {v!r}")
    if mode == "colocated":
        return _colocated(cluster, trainer_ranks, num_engines, tensor_parallel_size)
    check_fits(cluster, trainer_ranks, num_engines, tensor_parallel_size)
    try:
        trainer_nodes, engine_nodes = _split(cluster, trainer_ranks, num_engines, tensor_parallel_size, engines_first=False)
    except PlacementError as trainer_first:
        # on unequal nodes the trainer's best fit can take the only node a tensor-parallel engine fits
        # (8 + 2 GPUs, 5 ranks and an engine of 4 was refused: the engine fits node0 beside 4 ranks)
        try:
            trainer_nodes, engine_nodes = _split(cluster, trainer_ranks, num_engines, tensor_parallel_size, engines_first=True)
        except PlacementError:
            raise trainer_first from None  # (its reason: the plan the docs describe)
    groups = (GroupPlan("trainer", tuple({"GPU": 1.0} for _ in trainer_nodes), tuple(trainer_nodes)),) + \
        ((GroupPlan("engine", tuple({"GPU": float(tensor_parallel_size)} for _ in engine_nodes), tuple(engine_nodes)),)
         if engine_nodes else ())
    slots = tuple(Slot("trainer", r, n, r, 1.0) for r, n in enumerate(trainer_nodes)) + \
        tuple(Slot("engine", e, n, e, float(tensor_parallel_size)) for e, n in enumerate(engine_nodes))
    return PlacementPlan(cluster, "split", trainer_ranks, num_engines, tensor_parallel_size, groups, slots)


def _split(cluster: ClusterSpec, trainer_ranks: int, num_engines: int, tp: int, engines_first: bool) -> tuple[list, list]:
    """(the trainer ranks' nodes, the engines' nodes) of a split placement. The trainer first: on
    one node when a node holds them all (the fewest GPUs left over beside it), else whole nodes in
    order, ranks contiguous per node (rank 0's node hosts the rendezvous); then each engine on the
    first node with `tp` GPUs free, nodes without trainer ranks first. `engines_first`: the
    engines take their nodes before the trainer (its ranks then fill what is left, in order)."""
    free = {n.name: n.gpus for n in cluster.nodes}
    order = [n.name for n in cluster.nodes]

    def place_trainer() -> list[str]:
        fits = [n for n in order if free[n] >= trainer_ranks]
        if fits:
            home = min(fits, key=lambda n: (free[n] - trainer_ranks, order.index(n)))
            nodes = [home] * trainer_ranks
        else:
            nodes = []
            for n in order:
                nodes += [n] * min(free[n], trainer_ranks - len(nodes))
        for n in nodes:
            free[n] -= 1
        return nodes

    trainer_nodes = [] if engines_first else place_trainer()
    # engines: nodes without trainer ranks first, then what is left beside the trainer
    engine_order = [n for n in order if n not in trainer_nodes] + [n for n in order if n in trainer_nodes]
    engine_nodes: list[str] = []
    for e in range(num_engines):
        node = next((n for n in engine_order if free[n] >= tp), None)
        if node is None:
            left = ", ".join(f"{n}: {free[n]}" for n in order)
            placed = f" and engines 0-{e - 1}" if e > 1 else " and engine 0" if e == 1 else ""
            raise PlacementError(f"cannot place {_shape(trainer_ranks, num_engines, tp)} on {cluster.describe()}: engine {e} needs "
                                 f"{tp} GPUs on one node, and the GPUs left after the trainer{placed} are split "
                                 f"({left}). Use a tensor_parallel_size that divides the nodes' GPUs, or fewer engines")
        free[node] -= tp
        engine_nodes.append(node)
    if engines_first:
        trainer_nodes = place_trainer()
        if len(trainer_nodes) < trainer_ranks:
            raise PlacementError(f"cannot place {_shape(trainer_ranks, num_engines, tp)} on {cluster.describe()}")
    return trainer_nodes, engine_nodes


def _colocated(cluster: ClusterSpec, trainer_ranks: int, num_engines: int, tp: int) -> PlacementPlan:
    if tp != 1:
        raise PlacementError(f"placement='colocated' puts one engine on each trainer GPU, so engines need "
                             f"tensor_parallel_size 1, got {tp}; use placement='split' for tensor-parallel engines")
    n = max(trainer_ranks, num_engines)
    if n > cluster.total_gpus:
        raise PlacementError(f"cannot colocate {trainer_ranks} trainer rank(s) and {num_engines} engine(s) (one GPU per "
                             f"pair, {n} GPUs) on {cluster.describe()}")
    nodes = [node.name for node in cluster.nodes for _ in range(node.gpus)][:n]
    group = GroupPlan("colocated", tuple({"GPU": 1.0} for _ in nodes), tuple(nodes))
    # half a GPU each in Ray's accounting: both actors see the bundle's one device
    slots = tuple(Slot("trainer", r, nodes[r], r, 0.5) for r in range(trainer_ranks)) + \
        tuple(Slot("engine", e, nodes[e], e, 0.5) for e in range(num_engines))
    return PlacementPlan(cluster, "colocated", trainer_ranks, num_engines, 1, (group,), slots)


# the session fields a plan reads, with WorkbenchConfig's defaults (read without building a
# WorkbenchConfig: that checks the model directory, which need not exist where a plan is printed)
def plan_inputs(config: dict | None) -> dict:
    """trainer_ranks, num_engines, tensor_parallel_size and mode from a session config (a dict,
    as a config file holds it, or a WorkbenchConfig)."""
    config = _as_dict(config)
    from .session import WorkbenchConfig

    known = {f.name for f in dataclasses.fields(WorkbenchConfig)}
    if set(config) - known:  # (a misspelt num_engines printed the default plan, where connect() refuses the file)
        raise PlacementError(f"unknown config field(s) {sorted(set(config) - known)}; known: {sorted(known)}")
    defaults = {f.name: f.default for f in dataclasses.fields(WorkbenchConfig) if f.name in
                ("trainer_ranks", "num_engines", "placement")}
    ek = config.get("engine_kwargs") or {}
    if not isinstance(ek, dict):
        raise PlacementError(f"engine_kwargs must be a dict, got {type(ek).__name__}")
    return {"trainer_ranks": config.get("trainer_ranks", defaults["trainer_ranks"]),
            "num_engines": config.get("num_engines", defaults["num_engines"]),
            "tensor_parallel_size": ek.get("tensor_parallel_size", 1),
            "mode": config.get("placement", defaults["placement"])}


def frozen_engine_kwargs(config) -> dict:
    """The engine kwargs of the judge's and the teacher's engines: the session's engine_kwargs
    (never synced: no weight_transfer) under its frozen_engine_kwargs."""
    config = _as_dict(config)
    ek = {k: v for k, v in (config.get("engine_kwargs") or {}).items() if k != "weight_transfer"}
    return {**ek, **(config.get("frozen_engine_kwargs") or {})}


def frozen_engines(config) -> list[tuple[str, int]]:
    """(field, GPUs) of each frozen engine the session config asks for: the judge, the
    distillation teacher (loop.teacher). They start outside the placement plan."""
    config = _as_dict(config)
    loop = _as_dict(config.get("loop"))
    tp = frozen_engine_kwargs(config).get("tensor_parallel_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:  # ("2" from a YAML string: a traceback in plan)
        raise PlacementError(f"frozen_engine_kwargs tensor_parallel_size must be an integer >= 1, got {tp!r}")
    return [(name, tp) for name, value in (("judge", config.get("judge")), ("loop.teacher", loop.get("teacher"))) if value]


def check_frozen_room(plan: PlacementPlan, config, placed: dict | None = None) -> dict[str, NodeSpec]:
    """The node each frozen engine (judge, teacher) goes to ({field: node}; the session pins it
    there), from the GPUs the plan leaves free, each on one node (a tensor-parallel engine is one
    actor); PlacementError where they do not fit. A plan that takes every GPU left the judge's
    engine without one (connect() failed after reserving everything) and the teacher's (the first
    distillation step failed); unpinned, a judge Ray put on the node the teacher's two GPUs were
    counted on left the teacher waiting for ever. Largest first, each on the fullest node it fits.
    Free is what the plan's bundles do not reserve: colocated slots ask for half a GPU each, but
    their bundle holds the whole one. `placed`: frozen engines already pinned ({field: node}, a
    session's), their GPUs taken too (a teacher first named in wb.run(teacher=...) was left unpinned,
    and with free GPUs on two nodes but not enough on either its engine waited for ever)."""
    free = {n.name: n.gpus for n in plan.cluster.nodes}
    for g in plan.groups:
        for bundle, node in zip(g.bundles, g.nodes):
            free[node] -= bundle.get("GPU", 0)
    for node in (placed or {}).values():
        free[node.name] -= frozen_engine_kwargs(config).get("tensor_parallel_size", 1)
    by_name, where = {n.name: n for n in plan.cluster.nodes}, {}
    for name, gpus in sorted(frozen_engines(config), key=lambda x: -x[1]):
        node = min((n for n in free if free[n] >= gpus), key=lambda n: free[n], default=None)
        if node is None:
            left = ", ".join(f"{n}: {free[n]:g}" for n in free)
            raise PlacementError(f"{name}'s engine needs {gpus:g} GPU(s) on one node outside the placement plan, which "
                                 f"leaves {left} free: lower num_engines or trainer_ranks")
        free[node] -= gpus
        where[name] = by_name[node]
    return where


def _as_dict(config) -> dict:
    """A config as a dict: a dataclass (WorkbenchConfig, LoopConfig) field by field, a dict as it is."""
    if config is not None and dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return dict(config or {})


@dataclass
class Placement:
    """A plan reserved on the connected Ray cluster: its placement groups, and the options that
    put each actor in its bundle. `remove()` gives the reservations back."""

    plan: PlacementPlan
    pgs: dict = field(default_factory=dict)  # role -> PlacementGroup

    @classmethod
    def create(cls, plan: PlacementPlan, timeout: float = 120.0) -> "Placement":
        """Reserve the plan's groups, each bundle pinned to its node's id; PlacementError when
        Ray cannot within `timeout` s (GPUs held by something else, a node gone)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        ids = {n.name: n.node_id for n in plan.cluster.nodes}
        if None in ids.values():
            raise PlacementError("Placement.create needs a plan for the connected cluster (ClusterSpec.from_ray())")
        self = cls(plan)
        try:
            for g in plan.groups:
                pg = placement_group(list(g.bundles), strategy=g.strategy, name=f"workbench-{g.role}",
                                     bundle_label_selector=[{NODE_ID_LABEL: ids[n]} for n in g.nodes])
                self.pgs[g.role] = pg
            for role, pg in self.pgs.items():
                try:
                    ray.get(pg.ready(), timeout=timeout)
                except ray.exceptions.GetTimeoutError:
                    free = {n["NodeID"][:8]: n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")}
                    raise PlacementError(
                        f"Ray could not reserve the {role!r} placement group ({plan.group(role).bundles[0]} x "
                        f"{len(plan.group(role).bundles)} on {', '.join(dict.fromkeys(plan.group(role).nodes))}) within "
                        f"{timeout:.0f} s: are its GPUs held by other actors or jobs? ray.available_resources(): "
                        f"{ray.available_resources()}; GPUs per node: {free}") from None
        except BaseException:
            for pg in self.pgs.values():
                remove_placement_group(pg)
            raise
        return self

    def options(self, role: str, index: int) -> dict:
        """Ray actor options for `role` ("trainer" / "engine") number `index`: its GPUs and its
        bundle. Child tasks are not captured: vLLM's own processes are not Ray tasks here."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        s = self.plan.slot(role, index)
        pg = self.pgs["colocated" if self.plan.mode == "colocated" else role]
        return {"num_gpus": s.gpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=s.bundle, placement_group_capture_child_tasks=False)}

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # Ray already gone
                pass
        self.pgs = {}
