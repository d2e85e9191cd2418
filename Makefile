# The two commands of README.md. Each first installs what is missing into .venv (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup demo test bench bench-loopback bench-rollout clean-cache

setup:
	@bash scripts/setup.sh

# The main job on the embedded default (local Ray, CPU, tiny model).
demo: setup
	$(PY) -m workbench.demo

# The whole test suite (real vLLM, Ray and torch on CPU).
test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(PY) bench/engines.py

bench-loopback: setup
	$(PY) bench/loopback.py

bench-rollout: setup
	$(PY) bench/rollout.py

clean-cache:
	rm -rf $${WORKBENCH_CACHE:-$$HOME/.cache/workbench}/toy
