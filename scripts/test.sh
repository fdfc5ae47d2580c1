#!/usr/bin/env bash
# The test suite (CPU, about 12-13 minutes on 2 quiet cores). Multi-process tests launch torchrun with gloo themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TRITON_INTERPRET=1
python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
