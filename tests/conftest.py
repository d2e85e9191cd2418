"""Session-wide real components, started once and shared: one local Ray instance, one vLLM
engine (tiny MoE, inside a Ray actor), the tiny checkpoints. Each is shut down by the handle
that started it."""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _pin_host_reaps() -> None:
    """This test process is taken to be under a PID 1 that reaps: a sandbox call here would otherwise
    watch whether it does and, under one that does not, adopt every orphan of the processes the suite
    starts (Ray's, vLLM's), each then a zombie here. tests/test_sandbox.py checks both verdicts in
    processes of their own."""
    from workbench import sandbox

    sandbox._host_reaps = True


_pin_host_reaps()


@pytest.fixture(scope="session")
def moe_path():
    from workbench.toy.models import toy_model_path

    return toy_model_path("moe")


@pytest.fixture(scope="session")
def dense_path():
    from workbench.toy.models import toy_model_path

    return toy_model_path("dense")


@pytest.fixture(scope="session")
def tokenizer(moe_path):
    """The toy tokenizer (the MoE's), for loopback servers built in tests."""
    from workbench.toy.models import load_tokenizer

    return load_tokenizer(moe_path)


@pytest.fixture(scope="session")
def ray_local():
    from workbench.cluster import init_ray, shutdown_ray

    init_ray(num_cpus=2)
    yield
    shutdown_ray()


@pytest.fixture(scope="session")
def ray_address(ray_local):
    """The session's Ray, for notebook kernels to join (run_notebook(ray_address=...)) rather
    than each starting its own."""
    import ray

    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def vllm_moe(ray_local, moe_path):
    """The session's vLLM engine on the tiny MoE, hosted in a Ray actor."""
    from workbench.rollout.actor import launch_engine, stop_engine

    actor = launch_engine("vllm", model_path=str(moe_path), env={"VLLM_LOGGING_LEVEL": "WARNING"}, keep_log=True)
    yield actor
    stop_engine(actor)


@pytest.fixture(scope="session")
def reference_engines(ray_local, moe_path):
    """Two pure-PyTorch engines on the tiny MoE (cheap to start): for routing, failover and
    routed-expert capture tests."""
    from workbench.rollout.actor import launch_engine, stop_engine

    actors = [launch_engine("reference", model_path=str(moe_path), keep_log=True, seed=i) for i in range(2)]
    yield actors
    for a in actors:
        try:
            stop_engine(a)
        except Exception:
            pass  # a test may have killed it on purpose


@pytest.fixture
def run():
    """Run a coroutine to completion from a sync test."""
    return lambda coro: asyncio.run(coro)


@pytest.fixture(scope="session")
def short_run(ray_local, moe_path, tmp_path_factory):
    """One short real run, shared by the audit and revisit tests (the page's browser test too):
    reference engine (it records MoE experts), one trainer rank, 3 steps of 2 x 2 episodes, the
    policy kept every 2 steps, the KL without replay measured every step (revisit compares it),
    at lr 1e-4: a healthy run, which its audit flags nothing of (at the default 1e-3, 2 steps of
    4 episodes collapsed the toy on some machines' builds: reward 0, 3 of step 2's 4 episodes
    run out to max_tokens, a truncation breach).
    Yields the live session (wb.run_dir holds the run)."""
    import workbench

    wb = workbench.connect(backend="reference", trainer_ranks=1, run_dir=str(tmp_path_factory.mktemp("short") / "run"),
                           loop={"prompts_per_step": 2, "group_size": 2}, trainer={"measure_live_routing": True, "lr": 1e-4},
                           episode_timeout_s=120, request_timeout_s=90)  # (test_session.py: they reach the runners)
    try:
        wb.run(3, background=False, progress=False, keep_policy_every=2)
        yield wb
    finally:
        wb.shutdown()
