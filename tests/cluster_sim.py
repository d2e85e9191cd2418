"""The simulated two-node cluster check (tests/test_cluster.py runs it in a subprocess: a
`ray.cluster_utils.Cluster` needs a process where Ray is not initialised, and the test session
already holds its shared local Ray).

Two nodes with 2 fake GPUs each, labelled by `workbench/node`. It checks, with real Ray:
1. placement: the split plan for 2 trainer ranks + 2 engines, reserved as placement groups;
   small actors started with the plan's options land on the nodes the plan names;
2. the multi-node trainer: the real FSDP2 Trainer, one rank per node (gloo), rendezvous at rank
   0's node, trains one step on the dense toy model.
Prints one JSON line of what it saw; the caller asserts on it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time


def start_cluster(tries: int = 3):
    """Two nodes, 2 fake GPUs each. Ray gives a node 30 s (fixed) to register; on a loaded
    2-core machine a start can miss that, so a failed start is retried (a half-started node's
    processes are ended by Ray's exit hook when this process ends)."""
    from ray.cluster_utils import Cluster

    common = {"num_cpus": 1, "num_gpus": 2, "include_dashboard": False, "include_log_monitor": False}
    for attempt in range(tries):
        cluster = Cluster()
        try:
            cluster.add_node(**common, labels={"workbench/node": "sim0"})
            cluster.add_node(**common, labels={"workbench/node": "sim1"})
            return cluster, attempt + 1
        except Exception as e:
            print(f"cluster start {attempt + 1} failed: {e}", file=sys.stderr)
            try:
                cluster.shutdown()
            except Exception:
                pass
            if attempt + 1 == tries:
                raise


def main(model_path: str) -> dict:
    import ray
    import torch

    from workbench.placement import ClusterSpec, Placement, plan_placement

    out: dict = {}
    t0 = time.time()
    cluster, out["start_attempts"] = start_cluster()
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        out["start_s"] = time.time() - t0
        spec = ClusterSpec.from_ray()
        out["nodes"] = {n.name: n.node_id for n in spec.nodes}

        # every node sees the run directory (connect()'s check on a cluster)
        import tempfile

        from workbench.cluster import check_shared_path

        with tempfile.TemporaryDirectory() as d:
            out["shared_checked"] = len(check_shared_path(d))
        # ... and the checkpoints connect() hands to actors on other nodes (a missing one named)
        from workbench.cluster import SharedPathError, check_checkpoints_everywhere

        check_checkpoints_everywhere({"model": model_path})
        try:
            check_checkpoints_everywhere({"model": model_path, "judge": "/nonexistent/judge"})
        except SharedPathError as e:
            out["checkpoint_missing"] = str(e)

        # 1. placement: 2 trainer ranks + 2 engines on 2 x 2 GPUs
        plan = plan_placement(spec, trainer_ranks=2, num_engines=2, tensor_parallel_size=1)
        out["plan"] = [dataclasses.asdict(s) for s in plan.slots]
        placement = Placement.create(plan, timeout=60)

        @ray.remote(num_cpus=0)
        class Where:
            def node(self):
                import os
                return ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES")

        actors = {(s.role, s.index): Where.options(**placement.options(s.role, s.index)).remote() for s in plan.slots}
        seen = {f"{role} {i}": ray.get(a.node.remote(), timeout=60) for (role, i), a in actors.items()}
        out["landed"] = {k: v[0] for k, v in seen.items()}
        out["visible_gpus"] = {k: v[1] for k, v in seen.items()}
        for a in actors.values():
            ray.kill(a)
        placement.remove()

        # 2. the trainer across both nodes: one GPU bundle per node, ranks pinned there
        one_each = ClusterSpec(tuple(dataclasses.replace(n, gpus=1) for n in spec.nodes))
        tplan = plan_placement(one_each, trainer_ranks=2, num_engines=0)
        out["trainer_plan"] = [s.node for s in tplan.slots]
        tplace = Placement.create(tplan, timeout=60)
        from workbench.tokens import Segment, training_tensors
        from workbench.trainer.fsdp import Trainer, TrainerConfig

        t1 = time.time()
        trainer = Trainer(model_path, world_size=2, cfg=TrainerConfig(lr=1e-2, micro_batch_size=4),
                          actor_options=[tplace.options("trainer", r) for r in range(2)])
        try:
            out["trainer_start_s"] = time.time() - t1
            out["rendezvous"] = list(trainer.rendezvous)
            out["ranks"] = trainer.nodes()
            g = torch.Generator().manual_seed(0)
            segs = []
            for i in range(4):
                ids = torch.randint(3, 200, (12,), generator=g).tolist()
                segs.append(Segment(ids, [0] * 4 + [1] * 8, [0.0] * 12, [-1] * 4 + [0] * 8, None))
            batch = training_tensors(segs)
            batch["behaviour_logprobs"] = trainer.logprobs(batch)  # on-policy: the correction weights are 1
            batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * batch["loss_mask"]
            before = trainer.state_dict()
            stats = trainer.train_step(batch)
            after = trainer.state_dict()
            out["step"] = {"loss": stats["loss"], "grad_norm": stats["grad_norm"], "version": stats["version"]}
            out["max_weight_change"] = max(float((after[k] - before[k]).abs().max()) for k in before)
            out["train_s"] = time.time() - t1
        finally:
            trainer.shutdown()
            tplace.remove()
    finally:
        ray.shutdown()
        cluster.shutdown()
    out["total_s"] = time.time() - t0
    return out


if __name__ == "__main__":
    result: dict = {}
    try:
        result = main(sys.argv[1])
    except BaseException as e:  # what was seen up to the failure, for the test's message
        import traceback

        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(1 if "error" in result else 0)
