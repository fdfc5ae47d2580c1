"""The golden curves: per-step metrics of short tiny RL runs, stored so that a later commit that changes what
training computes fails tests/test_golden.py instead of drifting unnoticed.

    python tests/golden/make.py                 # rewrite every tests/golden/train_tiny_*.json from today's code
    python tests/golden/make.py grpo_r3_tis     # rewrite one of them (names: GOLDENS below)

Each golden is configs/train_tiny_cpu.yaml with the shared OVERRIDES and its own:
    gspo          10 GSPO steps, row micro-batches (the default path)
    grpo_r3_tis   GRPO with R3 (the engine's routing replayed) and token-level truncated IS against a bf16 engine,
                  so that the rollout correction's weights differ from 1
    packed        GSPO with packed micro-batches of at most 48 tokens: several forwards per minibatch and per
                  old-log-prob pass
    gspo_bypass_rs  GSPO with the bf16 engine's log-probs as pi_old (bypass) and rejection by seq_mean_k1, which
                  compares the engine's log-probs with the current policy's inside the loss

The curves are specific to the CPU that computed them (environment()): each is stored per environment as
train_tiny_<name>.<vendor>-<vector width>.json, and this script writes the current machine's. Refresh only on
purpose (a change meant to alter training), on every environment stored, and say why in the commit message.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CONFIG = ROOT / "configs" / "train_tiny_cpu.yaml"
OVERRIDES = ["train.steps=10", "train.cold_start_steps=60", "train.checkpoint_every=0", "logging.progress=false",
             "logging.tensorboard=false"]
GOLDENS: dict[str, list[str]] = {
    "gspo": [],
    "grpo_r3_tis": ["train.steps=6", "algorithm.loss=grpo", "algorithm.routing_replay=r3", "algorithm.rollout_is=token",
                    "algorithm.rollout_is_threshold=1.01", "rollout.engine_dtype=bfloat16"],
    "packed": ["train.steps=6", "train.max_tokens_per_micro_batch=48", "model.attention=sdpa"],
    "gspo_bypass_rs": ["train.steps=6", "algorithm.use_engine_logprobs=true", "algorithm.rollout_rs=seq_mean_k1",
                       "algorithm.rollout_rs_threshold=[0.99,1.01]", "rollout.engine_dtype=bfloat16"],
}
# timings vary run to run; the expert-load metrics are not stored: the curves check the same routing through the
# flip and churn metrics
SKIP_PREFIXES = ("time/", "perf/", "moe/load")


def environment() -> str:
    """The CPU the curves were computed on, as far as it changes them: the vendor's and the vector width's kernels
    (oneDNN and MKL take other code paths on them, and sampling amplifies the round-off within a step or two)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vendor = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("vendor_id")),
                  "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    width = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return f"{vendor}-{width}"


def path(name: str, env: str | None = None) -> Path:
    return HERE / f"train_tiny_{name}.{env or environment()}.json"


def golden_run(name: str = "gspo") -> list[dict[str, float]]:
    """Per-step metrics (timings left out) of golden run `name`."""
    from moe_gspo.config import load_config
    from moe_gspo.train.loop import train

    cfg = load_config(CONFIG, [*OVERRIDES, *GOLDENS[name]])
    with tempfile.TemporaryDirectory() as d:
        train(cfg, run_dir=d)
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(SKIP_PREFIXES)} for r in rows]


if __name__ == "__main__":
    for name in sys.argv[1:] or list(GOLDENS):
        rows = golden_run(name)
        path(name).write_text(json.dumps({"config": str(CONFIG.relative_to(ROOT)),
                                          "overrides": [*OVERRIDES, *GOLDENS[name]], "steps": rows},
                                         indent=1, sort_keys=True) + "\n")
        print(f"wrote {path(name)}: {len(rows)} steps ({environment()})")
