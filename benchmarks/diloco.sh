#!/usr/bin/env bash
# DiLoCo variants (the paper's outer step, and our plain averaging: the "-avg" strategies)
# against DeMo and full-sync AdamW on the ~10.9M GPT, 2 replicas (2 ranks),
# same steps and data. Prints a table; JSON in benchmarks/results/diloco.json.
#   bash benchmarks/diloco.sh [--steps N] [...more train_gpt.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${FLEXDEMO_VENV:-.venv}/bin"
OMP_NUM_THREADS=1 "$PY/torchrun" --nproc-per-node 2 examples/train_gpt.py \
  --model small --batch 4 --steps 300 --replicate 2 --shard 1 --log-every 50 \
  --strategies diloco,diloco-avg,diloco-avg-h100,streaming-diloco-avg,diloco-avg-demo,demo-defaults,hsdp-adamw \
  --out benchmarks/results/diloco.json "$@"
