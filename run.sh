#!/usr/bin/env bash
# Set up flexdemo in a virtual environment (.venv) and run the main job or the tests.
#   bash run.sh demo    # the main job: FlexDeMo vs full-sync AdamW on 4 CPU ranks (2 x 2 mesh)
#   bash run.sh test    # the test suite
set -euo pipefail
cd "$(dirname "$0")"
VENV="${FLEXDEMO_VENV:-.venv}"
PY="${PYTHON:-python3}"

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  # The CPU build of torch, pinned (an unpinned torch pulls a multi-GB CUDA build).
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[test]"
}

case "${1:-}" in
  demo)
    setup
    shift
    OMP_NUM_THREADS=1 "$VENV/bin/torchrun" --nproc-per-node 4 examples/train_gpt.py "$@"
    ;;
  test)
    setup
    shift
    "$VENV/bin/python" -m pytest -q "$@"
    ;;
  *)
    echo "usage: bash run.sh demo|test [extra arguments]" >&2
    exit 2
    ;;
esac
