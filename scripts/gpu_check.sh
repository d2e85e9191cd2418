#!/bin/bash
# GPU checks for the cluster path (issue 12 item 7), for a single-GPU machine with torch and
# transformers but no vLLM or Ray (../shared/FACTS.md): FSDP2 on NCCL with bf16 mixed precision,
# the bf16-vs-fp32 routing flip rate with and without routing replay, chunked log-probs memory,
# the rank-0 and per-rank sharded loads, routing replay's cost, and the trainer's own train_step
# against a plain HF loop. About 8 minutes on one H200 (replay and trainer alone:
# --only replay trainer, about 4); one JSON line per figure, also written to
# $OUT/gpu_check.jsonl (or ./gpu_check.jsonl), the profiles of one step of each to $OUT/profile_*.txt.
#
#   scripts/gpu_check.sh          # on the GPU machine
#   scripts/gpu_check.sh --cpu    # the same code on CPU with gloo, small sizes: a smoke test
#   scripts/gpu_check.sh --only replay trainer --ab _ab   # A/B in one process against another
#       checkout's code: mkdir _ab && git archive BRANCH workbench | tar -x -C _ab (untracked, so
#       it travels to the device machine with the working tree)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-.}/gpu_check.jsonl
: >"$LOG"
# one rank: every check
timeout 480 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 scripts/gpu_check.py "$@" | tee -a "$LOG"
if [ "${1:-}" != "--cpu" ] && [[ " $* " != *" --only "* ]]; then
    # two FSDP2 ranks on the one GPU: NCCL may refuse two ranks on one device; that is reported
    timeout 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 scripts/gpu_check.py --only fsdp \
        | tee -a "$LOG" || echo '{"check": "fsdp_2ranks", "error": "two NCCL ranks on one GPU failed (see above)"}' | tee -a "$LOG"
fi
