#!/usr/bin/env bash
# Create .venv and install moe-gspo with its pinned dependencies (CPU). torch 2.13.0 is installed first, alone,
# so that no other requirement pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
t0=$SECONDS
# pip's own output (build-backend notices included) is shown only when a step fails
quiet() { local log; log=$(mktemp); if ! "$@" >"$log" 2>&1; then cat "$log"; echo "setup: failed: $*"; exit 1; fi; rm -f "$log"; }
if [ ! -d .venv ]; then echo "setup: creating .venv with $("$PY" --version)"; "$PY" -m venv .venv; fi
. .venv/bin/activate
echo "setup: pip, setuptools, wheel"
quiet python -m pip install -q --upgrade pip "setuptools==84.2.1" wheel
echo "setup: torch==2.13.0 (CPU)"
quiet python -m pip install -q "torch==2.13.0"
echo "setup: moe-gspo and its pinned dependencies (megatron-core, transformers, triton, test tools, trl for bench_rl)"
quiet python -m pip install -q -e ".[test,triton,bench]"
python -W ignore -c "import torch, megatron.core, transformers, moe_gspo; assert torch.__version__.startswith('2.13.0')"
echo "setup: ready in $((SECONDS - t0)) s: .venv/bin/moe-gspo ($(python -W ignore -c 'import torch; print("torch", torch.__version__)'))"
