#!/usr/bin/env bash
# Every GPU check in one command: installs the GPU extras, runs the CUDA tests and benchmarks, writes one JSON.
#
#   bash scripts/gpu_check.sh [STAGE ...]      stages: env tests bench step configstep engine rl compare
#                                              (default: all eight)
#
# Environment:
#   OUT=DIR          where results go (default gpu_check_out/): gpu_check.json (everything), records.jsonl (the
#                    figures each test measured), junit.xml, bench_logprob.json, bench_engine_gpu_single.json and
#                    bench_engine_gpu_2b.json (hf_static vs hf generation; weight sync by bucket size at gpu_2b),
#                    bench_step_gpu_single.json and bench_step_gpu_2b.json (bf16 forward+backward against
#                    transformers), bench_rl_gpu_single.json and bench_rl_gpu_2b.json (the RL step against TRL),
#                    bench_step_fp32.json, bench_step_fp32_tf32.json and train_float32/, train_bfloat16/ (the
#                    configstep stage), compare/ (the comparison run)
#   WHEELS=DIR       install the wheels in DIR first, without an index (for machines with no network; see
#                    docs/gpu.md for the list and the pip download command); default .whl if it exists
#   PYTHON=python3   the interpreter that holds a CUDA torch
#   CONFIGSTEP_STEPS=N  RL steps of each whole-step run in the configstep stage (default 7; medians leave out
#                    the first two and the profiled fourth)
#   COMPARE_STEPS=N  RL steps per variant in the comparison stage (default 20)
#   STEP_ARGS        extra arguments of bench_step.py at gpu_single (default: --profile 15, the 15 costliest
#                    kernels of a step of each side)
#   RL_ARGS          arguments of bench_rl.py in the rl stage (default: --algos gspo --steps 3 --warmup 1)
#   ENGINE_ARGS      extra arguments of bench_engine.py in the engine stage (default: none)
#   ENGINE_SIZES, RL_SIZES  the sizes the engine and rl stages run (default "gpu_2b gpu_single" and
#                    "gpu_single gpu_2b")
#   STAGE_TIMEOUT=S  stop any stage after S seconds (default: no limit); TIMEOUT_<name>=S for one stage, by the
#                    name its log has (TIMEOUT_rl_gpu_2b=150)
#   DRY=1            print every stage's command without running anything (nor installing)
#   SUMMARY=FILE     the per-goal summary the run updates (default docs/results/gpu_summary.json, scripts/
#                    gpu_summary.py), copied to OUT/gpu_summary.json for a machine whose checkout does not come back
#   COMPARE_ARGS     extra overrides for the comparison (default: the HF engine on the GPU, since SGLang is
#                    checked by its own tests when importable)
# Exits non-zero when a stage fails; every stage runs regardless, and gpu_check.json says which failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT
WHEELS=${WHEELS:-.whl}
SUMMARY=${SUMMARY:-docs/results/gpu_summary.json}
STAGES=${*:-env tests bench step configstep engine rl compare}
export PYTHONUNBUFFERED=1
status=0
declare -A RESULT

if [ -z "${DRY:-}" ]; then  # DRY prints each stage's command without installing or running (tests/test_gpu_check.py)
    if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl ||
            { echo "wheel install failed"; exit 1; }
    fi
    # the package itself, editable, without touching its dependencies
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
        { echo "pip install -e . failed"; exit 1; }
fi

relative_paths() {  # the logs name files relative to the checkout ($OUT for the output folder): no machine's paths
    sed -u -e "s#$OUT/#\$OUT/#g" -e "s#$PWD/##g"
}

stage() {  # stage NAME COMMAND...: run, log to OUT/NAME.log, remember the exit code
    local name=$1; shift
    local t0=$SECONDS limit="TIMEOUT_$name"
    echo "== $name: $*"
    if [ -n "${DRY:-}" ]; then
        RESULT[$name]="0 0"
        return
    fi
    timeout "${!limit:-${STAGE_TIMEOUT:-0}}" "$@" 2>&1 | relative_paths | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    RESULT[$name]="$rc $((SECONDS - t0))"
    [ "$rc" = 0 ] || status=1
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
}

for s in $STAGES; do
    case $s in
    env)
        stage env "$PY" - <<'EOF'
import importlib, json, os, platform, subprocess
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": torch.cuda.get_device_capability() if torch.cuda.is_available() else None}
for name in ("triton", "megatron.core", "transformers", "transformer_engine", "sglang", "liger_kernel",
             "cut_cross_entropy", "safetensors"):
    try:
        m = importlib.import_module(name)
        info[name] = getattr(m, "__version__", "present")
    except Exception as e:  # noqa: BLE001 - record why an optional package is missing
        info[name] = f"unavailable: {type(e).__name__}: {str(e)[:160]}"
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                         "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except OSError as e:
    info["nvidia_smi"] = str(e)
json.dump(info, open(os.environ["OUT"] + "/env.json", "w"), indent=1)
print(json.dumps(info, indent=1))
EOF
        ;;
    tests)
        rm -f "$OUT/records.jsonl"
        GPU_CHECK_RECORDS="$OUT/records.jsonl" stage tests "$PY" -m pytest -q -p no:cacheprovider -rs \
            --junitxml "$OUT/junit.xml" tests/test_gpu.py tests/test_kernels_triton.py tests/test_rollout_sglang.py \
            tests/test_rollout_static.py
        ;;
    bench)
        stage bench "$PY" scripts/bench_logprob.py --json "$OUT/bench_logprob.json" --dtype bf16 \
            --sizes 16384,4096,151936 4096,4096,151936 --repeats 5 --warmup 2 --seq-len 512
        ;;
    step)  # the training phase in bf16: forward+backward against transformers, each expert implementation
        # shellcheck disable=SC2086
        stage step_gpu_single "$PY" scripts/bench_step.py --device cuda --dtype bfloat16 \
            --config configs/gpu_single.yaml --batch 32 --seq 256 --json "$OUT/bench_step_gpu_single.json" \
            ${STEP_ARGS:---profile 15}
        stage step_gpu_2b "$PY" scripts/bench_step.py --device cuda --dtype bfloat16 \
            --config configs/gpu_2b.yaml --batch 4 --seq 2048 --variants sdpa,megatron_dispatch --json "$OUT/bench_step_gpu_2b.json"
        # last and on its own: compiling can take minutes, and a stage cut off by its timeout writes no JSON
        stage step_compile_gpu_single "$PY" scripts/bench_step.py --device cuda --dtype bfloat16 \
            --config configs/gpu_single.yaml --batch 32 --seq 256 --variants sdpa --compile \
            --json "$OUT/bench_step_compile_gpu_single.json"
        ;;
    engine)  # gpu_2b first: its weight sync by bucket size is the figure no other stage gives
        for size in ${ENGINE_SIZES:-gpu_2b gpu_single}; do
            what=generate
            [ "$size" = gpu_2b ] && what=generate,sync
            # shellcheck disable=SC2086
            stage "engine_$size" "$PY" scripts/bench_engine.py --device cuda --config "configs/$size.yaml" \
                --what "$what" --json "$OUT/bench_engine_$size.json" ${ENGINE_ARGS:-}
        done
        ;;
    rl)  # one size per stage, so that a stage cut off by its timeout leaves the other's results
        for size in ${RL_SIZES:-gpu_single gpu_2b}; do
            # shellcheck disable=SC2086
            stage "rl_$size" "$PY" scripts/bench_rl.py --device cuda --sizes "$size" --max-new-tokens 256 \
                --json "$OUT/bench_rl_$size.json" ${RL_ARGS:---algos gspo --steps 3 --warmup 1}
        done
        ;;
    configstep)  # gpu_single.yaml's own step: where its fp32 training time goes, and the levers on it
        # forward+backward at the config's micro-batch (128 rows of about 64 tokens): the default experts (on CUDA
        # in fp32, torch._grouped_mm's fallback) against the same experts forced onto their per-expert loop, and
        # transformers, without and with TF32
        for tf in "" "--tf32"; do
            stage "configstep_fp32${tf:+_tf32}" "$PY" scripts/bench_step.py --device cuda --dtype float32 \
                --config configs/gpu_single.yaml --batch 128 --seq 64 --variants sdpa,expert_loop --profile 12 \
                $tf --json "$OUT/bench_step_fp32${tf:+_tf32}.json"
        done
        # whole RL steps at the config's batch, the run alone on the GPU: fp32 parameters (the config) against
        # bf16 parameters with fp32 main params; step 4 profiled (profile_step_4.txt, .json.gz in the run dir)
        for prec in float32 bfloat16; do
            rm -rf "$OUT/train_$prec"
            stage "train_$prec" "$PY" -m moe_gspo.cli train --config configs/gpu_single.yaml \
                rollout.engine=hf_static rollout.engine_dtype=bfloat16 model.params_dtype="$prec" \
                train.cold_start_steps=0 train.steps="${CONFIGSTEP_STEPS:-7}" train.checkpoint_every=0 \
                logging.progress=false logging.profile_step=4 train.out_dir="$OUT/train_$prec"
        done
        ;;
    compare)
        rm -rf "$OUT/compare"
        # shellcheck disable=SC2086
        stage compare "$PY" -m moe_gspo.cli compare --config configs/gpu_single.yaml --out "$OUT/compare" \
            ${COMPARE_ARGS:-rollout.engine=hf rollout.engine_dtype=bfloat16} train.steps="${COMPARE_STEPS:-20}"
        ;;
    *) echo "unknown stage $s (env tests bench step configstep engine rl compare)"; status=1 ;;
    esac
done

for k in "${!RESULT[@]}"; do echo "$k ${RESULT[$k]}"; done > "$OUT/stages.txt"
OUT="$OUT" "$PY" - <<'EOF'
import json, os, pathlib
out = pathlib.Path(os.environ["OUT"])
res = {"stages": {l.split()[0]: {"exit": int(l.split()[1]), "seconds": int(l.split()[2])}
                  for l in (out / "stages.txt").read_text().splitlines()}}
for name in ("env.json", "bench_logprob.json", "bench_step_gpu_single.json", "bench_step_gpu_2b.json",
             "bench_step_compile_gpu_single.json",
             "bench_engine_gpu_single.json", "bench_engine_gpu_2b.json", "bench_rl_gpu_single.json",
             "bench_rl_gpu_2b.json", "bench_step_fp32.json", "bench_step_fp32_tf32.json"):
    if (out / name).exists():
        res[name.split(".")[0]] = json.loads((out / name).read_text())
if (out / "records.jsonl").exists():
    res["records"] = [json.loads(l) for l in (out / "records.jsonl").read_text().splitlines()]
if (out / "junit.xml").exists():
    import xml.etree.ElementTree as ET
    cases = []
    for c in ET.parse(out / "junit.xml").iter("testcase"):
        state = "passed"
        for tag in ("failure", "error", "skipped"):
            e = c.find(tag)
            if e is not None:
                state = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (e.get("message") or "")[:300]
                break
        cases.append({"test": f"{c.get('classname')}::{c.get('name')}", "state": state,
                      "seconds": float(c.get("time", 0)), **({"message": msg} if state != "passed" else {})})
    res["tests"] = cases
for prec in ("float32", "bfloat16"):  # the configstep stage's whole steps
    metrics = sorted((out / f"train_{prec}").glob("**/metrics.jsonl"))
    if metrics:
        rows = [json.loads(l) for l in metrics[0].read_text().splitlines()]
        rows = [r for r in rows if "time/step" in r]
        timed = [r for i, r in enumerate(rows) if i >= 2 and i != 3] or rows  # step 4 is the profiled one
        med = lambda k: sorted(r.get(k, 0.0) for r in timed)[len(timed) // 2]  # noqa: E731
        res[f"train_{prec}"] = {"steps": len(rows), "per_step": [r["time/step"] for r in rows],
                                **{k: med(k) for k in ("time/step", "time/rollout", "time/logprob", "time/train",
                                                       "time/sync", "perf/tokens_per_s")}}
cmp = out / "compare"
if (cmp / "compare.json").exists():
    res["compare"] = json.loads((cmp / "compare.json").read_text())
    per = {}
    for name in res["compare"].get("variants", {}):
        metrics = sorted((cmp / name).glob("seed_*/metrics.jsonl")) or [cmp / name / "metrics.jsonl"]
        rows = [json.loads(l) for l in metrics[0].read_text().splitlines()]  # the first seed
        mean = lambda k: sum(r.get(k, 0.0) for r in rows) / max(len(rows), 1)  # noqa: E731
        per[name] = {"steps": len(rows), "reward_last": rows[-1].get("reward/mean") if rows else None,
                     **{k: mean(k) for k in ("time/step", "time/rollout", "time/logprob", "time/train",
                                             "time/sync", "perf/tokens_per_s")}}
    res["compare"]["per_variant"] = per
(out / "gpu_check.json").write_text(json.dumps(res, indent=1))
print(f"wrote {out / 'gpu_check.json'}")
EOF
if [ -z "${DRY:-}" ]; then  # one key per goal, each from the newest run that measured it; a copy beside the results
    "$PY" scripts/gpu_summary.py "$OUT" --summary "$SUMMARY" && cp "$SUMMARY" "$OUT/gpu_summary.json" || status=1
fi
exit $status
