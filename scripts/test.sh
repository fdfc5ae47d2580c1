#!/usr/bin/env bash
# The test suite (CPU, about 17-19 minutes on 2 quiet cores). Multi-process tests start their ranks (directly, or through torchrun) with gloo themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TRITON_INTERPRET=1
# the package's and the tests' bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as on the machine the
# suite was timed on), every rank and subprocess the tests start would otherwise compile the sources again
python -m compileall -q -j 0 moe_gspo tests scripts > /dev/null
# tests marked `extended` (more families for a check the suite already runs) are left out; `-m extended` after
# this script's name runs them instead (the last -m wins)
python -m pytest -q -p no:cacheprovider --durations=15 -m "not extended" tests "$@"
