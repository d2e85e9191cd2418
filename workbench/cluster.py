"""Ray connection. The embedded default is a local Ray on this host; a cluster address
("ray://head:10001" or "auto") attaches to a running cluster instead."""

from __future__ import annotations

import os


def init_ray(address: str | None = None, num_cpus: int | None = None, quiet: bool = True):
    """Start (address None) or join a Ray instance; a no-op when this process already has one."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context()
    address = address or os.environ.get("RAY_ADDRESS")  # e.g. the cluster kernel's env
    import logging

    # quiet: no INFO lines from Ray ("Started a local Ray instance", ...) in a notebook's output;
    # its warnings still show
    kwargs = dict(include_dashboard=False, log_to_driver=not quiet, logging_level=logging.WARNING if quiet else logging.INFO)
    if address is None:
        # "local": always a new instance here. (With no address, ray.init would join a cluster a
        # `ray start` left on this machine, and refuse num_cpus.)
        address = "local"
        kwargs["num_cpus"] = num_cpus or os.cpu_count()
    ray.init(address=address, **kwargs)
    return ray.get_runtime_context()


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def cluster_gpus() -> int:
    """GPUs in the Ray cluster this process is connected to. Actors ask for GPUs by this, not by
    `torch.cuda.is_available()` here: a notebook on a CPU-only head node still drives GPU workers."""
    import ray

    return int(ray.cluster_resources().get("GPU", 0))
