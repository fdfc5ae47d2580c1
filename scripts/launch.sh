#!/usr/bin/env bash
# torchrun launcher for one node or many.
#
#   one node:   NPROC_PER_NODE=4 scripts/launch.sh train-lm --config configs/tiny_cpu.yaml parallel.tp=2 parallel.ep=2
#   two nodes:  on node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=8 scripts/launch.sh train --config C
#               on node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC_PER_NODE=8 scripts/launch.sh train --config C
#
# Arguments after the script name are a moe-gspo subcommand and its arguments; relative paths in them are read
# from the directory the script is called from. MAX_RESTARTS (default 0) is passed to torchrun's --max-restarts so
# that a killed rank restarts the job (which then resumes from its newest checkpoint when the command was given
# --resume). It runs `moe-gspo launch` (moe_gspo/parallel/launch.py: torchrun in-process), which ends an error a
# user can cause on any rank in one line and exit code 2.
#
# The interpreter: $PYTHON when set, else the active virtual environment's ($VIRTUAL_ENV), else this repository's
# .venv when it has one, else python3; moe-gspo must be installed in it (scripts/setup.sh installs it into .venv).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PY=$VIRTUAL_ENV/bin/python
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY=$ROOT/.venv/bin/python
else
  PY=python3
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  export OMP_NUM_THREADS=$(( $(nproc) / NPROC_PER_NODE > 0 ? $(nproc) / NPROC_PER_NODE : 1 ))
fi
exec "$PY" -m moe_gspo.cli launch \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts "$MAX_RESTARTS" \
  -- "$@"
