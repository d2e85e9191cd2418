# The two commands of README.md. Each first installs what is missing into .venv (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup demo demo-script recipes test test-long bench bench-loopback bench-loopback-capacity bench-rollout bench-rollout-floor bench-trainer bench-vs-trl bench-async bench-sync-inflight clean-cache kernels lab

setup:
	@bash scripts/setup.sh

# The main job on the embedded default (local Ray, CPU, tiny model).
# It runs notebooks/00_quickstart.ipynb through papermill and leaves the executed notebook and
# the run directory (metrics.jsonl, trajectories/, plots/, checkpoint/, results.json) in runs/quickstart.
demo: setup
	rm -rf runs/quickstart  # a fresh record each time (a session refuses a run_dir that holds a run)
	$(PY) -m workbench.notebooks 00_quickstart --run-dir runs/quickstart

# Every recipe (notebooks/recipes/) headless on its CPU default, each into runs/recipes/<name>/
# (the executed notebook, results.json, metrics, trajectories, plots where it draws them). `python -m workbench.notebooks
# --list` shows each one's parameters and expected time; RECIPES="math_grpo distillation" runs some.
RECIPES ?= $(basename $(notdir $(wildcard notebooks/recipes/*.ipynb)))
recipes: setup
	@for r in $(RECIPES); do \
		rm -rf runs/recipes/$$r; \
		echo "== recipes/$$r"; \
		$(PY) -m workbench.notebooks recipes/$$r --run-dir runs/recipes/$$r || exit 1; \
	done

# The same pieces as a plain script, step by step (python -m workbench.demo --help: --agent FILE, ...).
demo-script: setup
	$(PY) -m workbench.demo

# The test suite (real vLLM, Ray and torch on CPU): CI runs this. Tests marked `long` (recipe
# notebooks whose mechanism a faster test already checks) are left to `make test-long`, so
# that `make test` stays within its time budget on 2 cores.
test: setup
	$(PY) -m pytest -q -m "not long" $(PYTEST_ARGS)

test-long: setup
	$(PY) -m pytest -q -m long $(PYTEST_ARGS)

bench: setup
	$(PY) bench/engines.py $(BENCH_ARGS)

bench-loopback: setup
	$(PY) bench/loopback.py $(BENCH_ARGS)

# The largest number of concurrent sessions one runner's loopback server sustains with p99 added
# latency <= 50 ms (ramps 16..512 sessions; BENCH_ARGS="--bound-ms 20 --agents subprocess ...").
bench-loopback-capacity: setup
	$(PY) bench/loopback_capacity.py $(BENCH_ARGS)

bench-rollout: setup
	$(PY) bench/rollout.py $(BENCH_ARGS)

# The quickstart's rollout batch four ways, each in a fresh process: transformers' generate (TRL's
# path), vLLM's own LLM.generate, workbench's engine in-process, and as the Ray actor a loop uses
bench-rollout-floor: setup
	$(PY) bench/rollout_floor.py $(BENCH_ARGS)

bench-trainer: setup
	$(PY) bench/trainer.py $(BENCH_ARGS)

# workbench vs TRL's GRPOTrainer on the quickstart task, same wall-clock budget incl. start-up;
# TRL goes into bench/.venv-trl on first use (BENCH_ARGS="--budget 180 --backend reference")
bench-vs-trl: setup
	$(PY) bench/vs_trl.py $(BENCH_ARGS)

# continuous async (lag 1, 2) vs sync in one session: s/step ratio, gate pass and admitted ratios
bench-async: setup
	$(PY) bench/async_loop.py $(BENCH_ARGS)

# a batch of in-flight requests with and without one weight sync halfway (their K/V recompute)
bench-sync-inflight: setup
	$(PY) bench/sync_inflight.py $(BENCH_ARGS)

clean-cache:
	rm -rf $${WORKBENCH_CACHE:-$$HOME/.cache/workbench}/toy

# Jupyter kernelspecs in .venv: workbench-local, and workbench-cluster with RAY_ADDRESS in its
# env (make kernels RAY_ADDRESS=ray://head:10001). See kernels_config/README.md.
RAY_ADDRESS ?= ray://127.0.0.1:10001
kernels: setup
	$(PY) -m workbench.kernels --sys-prefix --ray-address $(RAY_ADDRESS)

# JupyterLab on 127.0.0.1:$(LAB_PORT), notebooks/ as root, no browser (open the printed URL).
# RAY_ADDRESS is removed from the server's env so that the local kernel stays local.
# Locked down: loopback only (LAB_IP to change it; prefer an SSH tunnel) and Jupyter's token on
# (never pass an empty --ServerApp.token: a Jupyter server runs any code). tests/test_lockdown.py.
LAB_PORT ?= 8888
LAB_IP ?= 127.0.0.1
lab: kernels
	env -u RAY_ADDRESS $(PY) -m jupyterlab --no-browser --ServerApp.ip=$(LAB_IP) --ServerApp.port=$(LAB_PORT) \
		--ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)
