#!/usr/bin/env bash
# DiLoCo variants against DeMo and full-sync AdamW on the ~10.9M GPT, 2 replicas (2 ranks),
# same steps and data. Prints a table; JSON in benchmarks/results/diloco.json.
#   bash benchmarks/diloco.sh [--steps N] [...more train_gpt.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${FLEXDEMO_VENV:-.venv}/bin"
OMP_NUM_THREADS=1 "$PY/torchrun" --nproc-per-node 2 examples/train_gpt.py \
  --model small --batch 4 --steps 300 --replicate 2 --shard 1 --log-every 50 \
  --strategies diloco,diloco-h100,streaming-diloco,demo-diloco,demo-defaults,hsdp-adamw \
  --out benchmarks/results/diloco.json "$@"
