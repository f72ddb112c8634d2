#!/usr/bin/env bash
# Set up flexdemo in a virtual environment (.venv) and run the main job or the tests.
#   bash run.sh demo    # the main job: FlexDeMo and MuLoCo against full-sync Muon and AdamW, 2 emulated nodes x 2 ranks
#   bash run.sh test    # the test suite
#   bash run.sh setup   # only the set-up (then e.g. .venv/bin/ruff, .venv/bin/mypy)
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
  # torchft for elastic runs (the ft extra), pinned to a release that accepts this torch
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" "torchft==0.2.0"
  # (the test extra brings transformers, accelerate and lightning: torch stays pinned)
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" -e ".[test]"
}

case "${1:-}" in
  setup)
    setup
    ;;
  demo)
    setup
    shift
    "$VENV/bin/flexdemo" bench --preset main "$@"
    ;;
  test)
    setup
    shift
    "$VENV/bin/python" -m pytest -q "$@"
    ;;
  *)
    echo "usage: bash run.sh demo|test [extra arguments] | bash run.sh setup" >&2
    exit 2
    ;;
esac
