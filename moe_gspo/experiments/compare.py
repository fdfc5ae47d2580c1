"""`moe-gspo compare`: GRPO, GRPO + R2, GRPO + R3, GSPO and GSPO-token on the same model, data and seed.

    moe-gspo compare --config configs/compare_tiny_cpu.yaml --out DIR [--only grpo,gspo] [a.b=v ...]

The config is an ordinary run config plus a `compare:` section:

    compare:
      variants:                      # name -> overrides applied on top of the shared config (default: below)
        grpo: [algorithm.loss=grpo]                 # routing_replay defaults to off
        ...

The cold-start stage runs once; every variant starts from the same fine-tuned weights, samples the same prompts with
the same seeds (so step 1's rollouts are identical), and writes DIR/<name>/ (metrics.jsonl, tensorboard,
checkpoints, wall_time.json). Then DIR/report.html compares them (moe_gspo/report/compare.py).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import yaml

from moe_gspo.config import ConfigError, apply_overrides, config_from_dict
from moe_gspo.train.data import check_names

DEFAULT_VARIANTS = {
    "grpo": ["algorithm.loss=grpo"],
    "grpo_r2": ["algorithm.loss=grpo", "algorithm.routing_replay=r2"],
    "grpo_r3": ["algorithm.loss=grpo", "algorithm.routing_replay=r3"],
    "gspo": ["algorithm.loss=gspo"],
    "gspo_token": ["algorithm.loss=gspo_token"],
}


def read_compare_config(path, overrides=None) -> tuple[dict, dict[str, list[str]]]:
    """(shared config dict with overrides applied, {variant name: its overrides})."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    section = raw.pop("compare", None) or {}
    unknown = set(section) - {"variants"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys under 'compare': {sorted(unknown)}; valid: ['variants']")
    variants = section.get("variants") or DEFAULT_VARIANTS
    if not isinstance(variants, dict) or not all(isinstance(v, list) for v in variants.values()):
        raise ConfigError(f"{path}: compare.variants must map names to lists of 'a.b=value' overrides")
    base = apply_overrides(raw, list(overrides or []))
    for name, ovs in variants.items():  # validate every variant before spending any compute
        try:
            check_names(config_from_dict(apply_overrides(copy.deepcopy(base), ovs)))
        except ConfigError as e:
            raise ConfigError(f"{path}: variant {name!r}: {e}") from None
    return base, {k: [str(x) for x in v] for k, v in variants.items()}


def cold_start_state(cfg) -> dict:
    """Run the cold-start stage once on a fresh policy; return its full (unsharded) weights."""

    from moe_gspo import load_policy
    from moe_gspo.parallel.state import current_info
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.data import build_tokenizer
    from moe_gspo.train.optim import wrap_ddp
    from moe_gspo.train.step import cold_start

    policy = load_policy(cfg)
    info = current_info()
    if cfg.train.cold_start_steps:
        ddp = wrap_ddp(policy, cfg.train.distributed_optimizer)
        cold_start(policy, ddp, cfg.train, task_from_config(cfg.rollout), build_tokenizer(cfg), info.dp, info.dp_rank)
    return {k: v.detach().clone() for k, v in policy.full_megatron_state().items()}


def run_comparison(config_path, out_dir, overrides=None, only=None, overwrite: bool = False) -> Path:
    """Run every variant into out_dir/<name>/ and write out_dir/report.html; returns the report's path.
    A directory that already holds a comparison is refused unless overwrite=True."""
    import torch.distributed as dist

    from moe_gspo.report.compare import write_compare_report
    from moe_gspo.train.loop import train

    base, variants = read_compare_config(config_path, overrides)
    if only:
        missing = [n for n in only if n not in variants]
        if missing:
            raise ConfigError(f"--only {missing}: not among the variants {list(variants)}")
        variants = {n: variants[n] for n in only}
    out = Path(out_dir)
    if (out / "compare.json").exists() and not overwrite:
        raise ConfigError(f"{out} holds a previous comparison (compare.json): pass --overwrite to replace it or "
                          f"choose another --out")
    shared = config_from_dict(copy.deepcopy(base))
    t0 = time.perf_counter()
    _say(f"cold start: {shared.train.cold_start_steps} supervised steps on {shared.rollout.task}")
    init = cold_start_state(shared)
    cold_s = time.perf_counter() - t0
    walls = {}
    for name, ovs in variants.items():
        cfg = config_from_dict(apply_overrides(copy.deepcopy(base), ovs))
        t1 = time.perf_counter()
        train(cfg, run_dir=out / name, init_state=init, label=name, overwrite=True)
        walls[name] = time.perf_counter() - t1
        if not dist.is_initialized() or dist.get_rank() == 0:
            (out / name / "wall_time.json").write_text(json.dumps({"seconds": walls[name], "overrides": ovs}))
    if dist.is_initialized() and dist.get_rank() != 0:
        return out / "report.html"
    (out / "compare.json").write_text(json.dumps({"variants": variants, "wall_seconds": walls,
                                                  "cold_start_seconds": cold_s,
                                                  "total_seconds": time.perf_counter() - t0}, indent=1))
    return write_compare_report(out, list(variants), walls, cold_start_seconds=cold_s)


def _say(msg: str) -> None:
    import os

    if os.environ.get("RANK", "0") == "0":  # torchrun's global rank (before the process group exists)
        print(msg, file=sys.stderr, flush=True)
