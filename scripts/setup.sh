#!/usr/bin/env bash
# Create .venv and install moe-gspo with its pinned dependencies (CPU). torch 2.13.0 is installed first, alone,
# so that no other requirement pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip "setuptools==84.2.1" wheel 2>&1 | grep -v "^WARNING: Location" || true
python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
python -m pip install -q -e ".[test,triton]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import torch, megatron.core, transformers, moe_gspo; assert torch.__version__.startswith('2.13.0')"
