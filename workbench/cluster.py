"""Ray connection. The embedded default is a local Ray on this host; a cluster address
("ray://head:10001" or "auto") attaches to a running cluster instead.

A Ray cluster runs whatever code its clients send, so joining one over the network needs Ray's
token authentication (Ray >= 2.52): `check_ray_address` refuses a non-local address unless this
process has the cluster's token (RAY_AUTH_TOKEN, a file named by RAY_AUTH_TOKEN_PATH, or
~/.ray/auth_token) and token mode is not switched off (RAY_AUTH_MODE=disabled). With a token and
RAY_AUTH_MODE unset it turns token mode on for this process (Ray itself does that only for a
cluster it finds on its own, address "auto"). See cluster/README.md, "Security".
"""

from __future__ import annotations

import ipaddress
import os
import socket

TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
AUTH_MODE_ENV = "RAY_AUTH_MODE"


class InsecureRayAddress(ValueError):
    """A non-local Ray address without the cluster's authentication token."""


def ray_address_host(address: str) -> str | None:
    """The host of a Ray address ("ray://h:10001", "h:6379", "[::1]:6379"); None for the
    addresses that name no host ("local", "auto")."""
    a = address.strip()
    if a in ("local", "auto", ""):
        return None
    if "://" in a:
        a = a.split("://", 1)[1]
    a = a.split("/", 1)[0]
    if a.startswith("["):  # [v6]:port
        return a[1:].split("]", 1)[0]
    if a.count(":") > 1:  # a bare IPv6 address
        return a
    return a.rsplit(":", 1)[0] if ":" in a else a


def is_local_address(address: str | None) -> bool:
    """True for the embedded default (None, "local"), "auto" (a cluster `ray start` left on this
    host), loopback hosts (localhost, 127.0.0.0/8, ::1; e.g. an SSH tunnel to a head node) and
    this host's own IP addresses (a local Ray's GCS address is the node's IP)."""
    if address is None:
        return True
    host = ray_address_host(address)
    if host is None:
        return True
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a hostname: not resolved here (a name may resolve anywhere)
    if ip.is_loopback:
        return True
    if ip.is_unspecified or ip.is_multicast:
        return False
    # one of this host's addresses: only those can be bound to
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host, 0))
            return True
        except OSError:
            return False


def _has_token() -> bool:
    """Whether Ray would find an authentication token (its own loader: RAY_AUTH_TOKEN, the file
    at RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)."""
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:  # an older Ray: the same three places, checked here
        path = os.environ.get(TOKEN_PATH_ENV) or os.path.expanduser("~/.ray/auth_token")
        return bool(os.environ.get(TOKEN_ENV)) or (os.path.isfile(path) and os.path.getsize(path) > 0)
    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    try:
        return bool(loader.has_token(ignore_auth_mode=True))
    except Exception:  # e.g. RAY_AUTH_TOKEN_PATH names a missing or empty file
        return False


def check_ray_address(address: str | None) -> None:
    """Refuse a non-local Ray address without token authentication, before connecting. With a
    token and RAY_AUTH_MODE unset, switch this process to token mode so that Ray sends it: for a
    local address given explicitly too (an SSH tunnel's ray://127.0.0.1:10001, the head node's own
    IP after `ray attach`), whose cluster refused a client that had its token but did not send it."""
    mode = os.environ.get(AUTH_MODE_ENV, "").strip().lower()
    if is_local_address(address):
        if ray_address_host(address or "") is not None and mode == "" and _has_token():
            _token_mode_on()
        return
    if mode == "disabled":
        raise InsecureRayAddress(
            f"refusing to join the Ray cluster at {address!r} with {AUTH_MODE_ENV}=disabled: a non-local Ray address needs "
            f"token authentication. Unset {AUTH_MODE_ENV} (or set it to 'token') and set {TOKEN_ENV} to the cluster's token "
            f"(see cluster/README.md, 'Security')")
    if not _has_token():
        path = os.environ.get(TOKEN_PATH_ENV)
        where = f" ({TOKEN_PATH_ENV}={path!r} names no readable, non-empty file)" if path else ""
        raise InsecureRayAddress(
            f"refusing to join the Ray cluster at {address!r} without an authentication token{where}: set {TOKEN_ENV} to "
            f"the cluster's token (or {TOKEN_PATH_ENV} to a file holding it; `ray get-auth-token` on the head node prints "
            f"it). The Ray client, GCS and dashboard ports run any code sent to them and are for the cluster's internal "
            f"network only (see cluster/README.md, 'Security')")
    if mode != "token":
        _token_mode_on()


def _token_mode_on() -> None:
    os.environ[AUTH_MODE_ENV] = "token"
    try:  # Ray caches its config; refresh it as ray's own _enable_token_auth does
        from ray._raylet import Config

        Config.initialize("")
    except Exception:
        pass


def init_ray(address: str | None = None, num_cpus: int | None = None, quiet: bool = True):
    """Start (address None) or join a Ray instance; a no-op when this process already has one.
    A non-local address without the cluster's token is refused (check_ray_address)."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context()
    address = address or os.environ.get("RAY_ADDRESS")  # e.g. the cluster kernel's env
    check_ray_address(address)
    import logging

    # quiet: no INFO lines from Ray ("Started a local Ray instance", ...) in a notebook's output;
    # its warnings still show
    kwargs = dict(include_dashboard=False, log_to_driver=not quiet, logging_level=logging.WARNING if quiet else logging.INFO)
    if address is None:
        # "local": always a new instance here. (With no address, ray.init would join a cluster a
        # `ray start` left on this machine, and refuse num_cpus.)
        address = "local"
        kwargs["num_cpus"] = num_cpus or os.cpu_count()
    # a new local instance: Ray's notice that it turned token authentication on (a warning, shown
    # as a red box in a notebook) says nothing to act on; a cluster's messages all stay
    notice = _LocalTokenNotice() if address == "local" else None
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    for attempt in range(3):
        try:
            if notice:
                auth_log.addFilter(notice)
            ray.init(address=address, **kwargs)
            break
        except Exception as e:
            # Ray waits a fixed 30 s for a new local raylet to register; on a loaded machine it can
            # miss that, and a second start (the first one's processes gone) usually makes it
            if address != "local" or "timed out during startup" not in str(e) or attempt == 2:
                raise
            logging.getLogger(__name__).warning("local Ray did not start within its 30 s (%s); starting it again", e)
            ray.shutdown()
            _kill_failed_local_ray()
        finally:
            auth_log.removeFilter(notice)
    return ray.get_runtime_context()


class _LocalTokenNotice:
    """A logging filter dropping only "Token authentication is enabled for this Ray cluster ..."."""

    def filter(self, record) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def _kill_failed_local_ray() -> None:
    """The processes a failed local start left (its GCS server outlives the crashed raylet, and
    ray.shutdown() does not know them): this process's children that run Ray's binaries."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if any("/ray/" in part for part in child.cmdline()[:3]):
                child.kill()
        except psutil.Error:
            pass


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def cluster_gpus() -> int:
    """GPUs in the Ray cluster this process is connected to. Actors ask for GPUs by this, not by
    `torch.cuda.is_available()` here: a notebook on a CPU-only head node still drives GPU workers."""
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


class SharedPathError(RuntimeError):
    """A path that some node of the cluster cannot write, or that the driver does not see as
    the nodes do."""


def on_every_node(fn, args_of, timeout: float = 120.0) -> dict:
    """`fn(*args_of(node_id))` as a task pinned to each alive node of the connected cluster:
    {node id: its result, or the exception it (or its scheduling, or the timeout) raised}."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(fn)
    refs = {nid: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(*args_of(nid))
            for nid in (n["NodeID"] for n in ray.nodes() if n.get("Alive"))}
    out = {}
    for nid, ref in refs.items():
        try:
            out[nid] = ray.get(ref, timeout=timeout)
        except Exception as e:
            out[nid] = e
    return out


def check_checkpoints_everywhere(paths: dict[str, str], timeout: float = 120.0) -> None:
    """Each checkpoint directory ({what: path}, as the driver resolved it) holds a config.json on
    every alive node of the connected cluster: actors on other nodes are handed the path. A named
    model built into the driver's node-local cache (WORKBENCH_CACHE, ~/.cache/workbench) failed
    late on another node (vLLM read the missing path as a Hugging Face hub id). SharedPathError
    names each node and checkpoint it lacks."""
    def missing(paths: dict) -> tuple[str, list[str]]:
        return socket.gethostname(), [w for w, p in paths.items() if not os.path.isfile(os.path.join(p, "config.json"))]

    problems = []
    for nid, got in on_every_node(missing, lambda nid: (paths,), timeout).items():
        if isinstance(got, Exception):  # (a node that cannot run the check in time: named)
            problems.append(f"node {nid[:8]} could not check the checkpoints: {type(got).__name__}: {str(got)[-300:]}")
            continue
        host, lacking = got
        problems += [f"node {nid[:8]} ({host}) has no {paths[w]}/config.json ({w})" for w in lacking]
    if problems:
        raise SharedPathError("; ".join(problems) + ": every node must see the checkpoints at the driver's paths (a "
                              "shared filesystem; for named models set WORKBENCH_CACHE to a directory on it)")


def check_shared_path(path: str, timeout: float = 120.0) -> list[str]:
    """Check that every alive node of the connected Ray cluster sees `path` as this driver does:
    a task on each node writes a file with a random word under it, and the driver reads it back.
    Checkpoints and run directories must live on such a path (trainer ranks write their shards on
    their own nodes; the driver and a resumed session read them). Returns the node ids checked;
    SharedPathError names each node that failed and how."""
    import secrets
    import shutil

    def write(directory: str, name: str, word: str) -> str:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, name), "w") as f:
            f.write(word)
        return socket.gethostname()

    probe = os.path.join(os.path.abspath(path), f".workbench-shared-check-{secrets.token_hex(4)}")
    words: dict[str, str] = {}
    problems = []
    try:
        written = on_every_node(write, lambda nid: (probe, nid, words.setdefault(nid, secrets.token_hex(8))), timeout)
        for nid, host in written.items():
            if isinstance(host, Exception):  # the node cannot create or write the path
                problems.append(f"node {nid[:8]} could not write under {path!r}: {type(host).__name__}: {str(host)[-300:]}")
                continue
            try:
                with open(os.path.join(probe, nid)) as f:
                    seen = f.read()
            except OSError:
                seen = None
            if seen != words[nid]:
                problems.append(f"node {nid[:8]} ({host}) wrote {path!r}, but this driver does not see what it wrote "
                                f"(a node-local directory?)")
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    if problems:
        raise SharedPathError(f"{path!r} is not shared by every node of the cluster: " + "; ".join(problems)
                              + ". Put run_dir (checkpoints, records) on a filesystem every node mounts (docs/cluster.md)")
    return list(written)


def wait_for_gpus(gpus: int, timeout: float = 600.0, poll: float = 5.0) -> dict:
    """Block until the connected cluster has at least `gpus` GPUs (its nodes have joined);
    TimeoutError says how many it has. Returns ray.cluster_resources()."""
    import time

    import ray

    deadline = time.monotonic() + timeout
    while True:
        res = ray.cluster_resources()
        if res.get("GPU", 0) >= gpus:
            return res
        if time.monotonic() > deadline:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            raise TimeoutError(f"the cluster has {res.get('GPU', 0):g} of {gpus} GPUs after {timeout:.0f} s "
                               f"({len(alive)} node(s) alive): has every node run `ray start --address=...`?")
        time.sleep(poll)


def load_config_file(path: str) -> dict:
    """A session config file: JSON, or YAML (.yaml/.yml), holding WorkbenchConfig fields."""
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        import json

        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file holds a mapping of WorkbenchConfig fields, got {type(data).__name__}")
    return data


def main(argv: list[str] | None = None) -> int:
    """`python -m workbench.cluster plan --nodes 2 --gpus-per-node 8 [--config FILE]`: which
    actor goes where (workbench.placement), or why the shape cannot fit (exit status 2)."""
    import argparse
    import sys

    from .placement import ClusterSpec, PlacementError, check_frozen_room, frozen_engines, plan_inputs, plan_placement

    parser = argparse.ArgumentParser(prog="python -m workbench.cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the placement of trainer ranks and engines on a cluster of this shape")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--config", help="a session config file (JSON or YAML of WorkbenchConfig fields)")
    p.add_argument("--trainer-ranks", type=int, help="overrides the config's trainer_ranks")
    p.add_argument("--engines", type=int, help="overrides the config's num_engines")
    p.add_argument("--tensor-parallel-size", type=int, help="overrides the config's engine_kwargs.tensor_parallel_size")
    p.add_argument("--mode", choices=("split", "colocated"), help="overrides the config's placement")
    w = sub.add_parser("wait", help="wait until the Ray cluster at --address has --gpus GPUs")
    w.add_argument("--address", default=None, help="the cluster (default: RAY_ADDRESS)")
    w.add_argument("--gpus", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    c = sub.add_parser("check-shared", help="check that every node of the cluster at --address sees --path")
    c.add_argument("--address", default=None, help="the cluster (default: RAY_ADDRESS)")
    c.add_argument("--path", required=True)
    args = parser.parse_args(argv)
    if args.command in ("wait", "check-shared"):
        if not (args.address or os.environ.get("RAY_ADDRESS")):
            # (with neither, init_ray starts a new local instance: check-shared passed on its one node,
            # "written on each of 1 node(s)", and wait blamed the worker for a node it never asked)
            print(f"error: {args.command} needs the cluster: --address (e.g. auto on a node of it) or RAY_ADDRESS",
                  file=sys.stderr)
            return 2
        try:
            init_ray(args.address)
            if args.command == "wait":
                res = wait_for_gpus(args.gpus, args.timeout)
                print(f"the cluster has {res.get('GPU', 0):g} GPUs")
            else:
                nodes = check_shared_path(args.path)
                print(f"{args.path}: written on each of {len(nodes)} node(s) and read back here")
        except (TimeoutError, SharedPathError, InsecureRayAddress) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            shutdown_ray()
        return 0
    try:
        config = load_config_file(args.config) if args.config else {}
        inputs = plan_inputs(config)
        for key, value in (("trainer_ranks", args.trainer_ranks), ("num_engines", args.engines),
                           ("tensor_parallel_size", args.tensor_parallel_size), ("mode", args.mode)):
            if value is not None:
                inputs[key] = value
        if inputs["mode"] == "none":
            print("placement 'none': Ray schedules each actor where it fits; there is no plan to print")
            return 0
        if not isinstance(inputs["num_engines"], int) or inputs["num_engines"] < 1:  # (as a session: num_engines >= 1)
            raise PlacementError(f"num_engines must be an integer >= 1 (a session has a rollout engine), got {inputs['num_engines']!r}")
        if config and args.tensor_parallel_size is not None:  # the config as it runs: a judge's or teacher's
            # engine takes the policy engines' tensor_parallel_size (the file's was checked: a plan it refuses passed)
            config = {**config, "engine_kwargs": {**(config.get("engine_kwargs") or {}),
                                                  "tensor_parallel_size": args.tensor_parallel_size}}
        if config:  # what connect() refuses of it, refused here (a colocated NCCL sync, an unsaid memory share)
            from .session import WorkbenchConfig, check_colocated_memory

            ek = dict(config.get("engine_kwargs") or {})
            # (its checkpoints stand in by a named model: the paths are the cluster's, not this machine's)
            checked = {k: v for k, v in config.items() if k != "model"}
            checked.update(engine_kwargs=ek, placement=inputs["mode"], trainer_ranks=inputs["trainer_ranks"],
                           num_engines=inputs["num_engines"], **({"judge": "dense"} if config.get("judge") else {}))
            if isinstance(config.get("loop"), dict) and config["loop"].get("teacher"):
                checked["loop"] = {**config["loop"], "teacher": "dense"}
            if isinstance(config.get("trainer"), dict) and config["trainer"].get("ref_model_path"):  # (the KL reference's)
                checked["trainer"] = {**config["trainer"], "ref_model_path": "dense"}
            check_colocated_memory(WorkbenchConfig.from_dict(checked))
        plan = plan_placement(ClusterSpec.uniform(args.nodes, args.gpus_per_node), **inputs)
        check_frozen_room(plan, config)
    except (PlacementError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.render())
    for name, gpus in frozen_engines(config):
        print(f"{name}: its frozen engine takes {gpus} of the GPUs the plan leaves free")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
