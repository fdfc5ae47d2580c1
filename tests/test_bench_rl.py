"""Smoke test of scripts/bench_rl.py: both sides (moe-gspo's loop and TRL's GRPOTrainer) run 2 RL steps of a tiny
policy on the same checkpoint, prompts and batch layout, and the TRL side is configured as the script claims.

CPU only; needs the `bench` extra (trl), which scripts/setup.sh installs. About 12 s on one thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# 4 prompts x 4 responses, 2 minibatches of 8 in micro-batches of 4, 2-layer policy, 3-token responses
TINY = ["rollout.prompts_per_step=4", "rollout.group_size=4", "train.minibatches=2", "train.micro_batch_size=4",
        "model.num_hidden_layers=2", "rollout.max_new_tokens=3"]


def test_bench_rl_runs_both_sides_with_matched_settings(tmp_path):
    try:
        import trl  # noqa: F401
    except ImportError:
        pytest.fail("the bench extra (trl) is not installed: bash scripts/setup.sh installs it")
    out = tmp_path / "bench_rl.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_rl.py"), "--sizes", "default", "--algos", "gspo",
                        "--steps", "2", "--warmup", "1", "--threads", "1", "--json", str(out), "--set", *TINY],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())

    rows = {r["tool"]: r for r in res["rows"]}
    assert set(rows) == {"moe-gspo", "trl"}
    n_seqs = 4 * 4
    for tool, r in rows.items():
        assert r["timed_steps"] == 1, tool
        # every sequence has its prompt (bos + "a+b+c=") and 1..3 response tokens
        assert n_seqs * 8 <= r["tokens"] <= n_seqs * 10, (tool, r["tokens"])
        assert 0 < r["response_tokens"] <= n_seqs * 3, (tool, r["response_tokens"])
        phases = r["generation_s"] + r["old_logprob_s"] + r["training_s"] + r["other_s"]
        assert phases == pytest.approx(r["step_s"], rel=1e-6), tool
        assert min(r["generation_s"], r["old_logprob_s"], r["training_s"]) > 0, tool
    assert rows["trl"]["speedup_vs_trl"] == pytest.approx(1.0)

    # the same weights on both sides (the script also refuses different prompts)
    assert res["max_abs_probe_logprob_diff"]["default/gspo"] < 1e-4
    s = res["settings"]["default/gspo"]
    assert s["optimizer_steps_per_rollout"] == {"moe-gspo": 2, "trl": 2}
    trl = s["trl"]
    assert (trl["loss_type"], trl["importance_sampling_level"]) == ("grpo", "sequence")
    assert (trl["epsilon"], trl["epsilon_high"], trl["beta"]) == (3e-4, 4e-4, 0.0)
    assert (trl["num_generations"], trl["generation_batch_size"], trl["per_device_train_batch_size"]) == (4, 16, 4)
    assert (trl["gradient_accumulation_steps"], trl["steps_per_generation"], trl["num_iterations"]) == (2, 4, 1)
    assert (trl["max_completion_length"], trl["bf16"], trl["gradient_checkpointing"]) == (3, False, False)
    assert "| default | gspo | trl |" in res["table"]


def _bench_rl_parts(monkeypatch):
    """scripts/_rl_bench's comparison and trl_side modules (bench_rl.py's config and TRL settings)."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module("_rl_bench.comparison"), importlib.import_module("_rl_bench.trl_side")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("script", ["bench_rl.py", "bench_engine.py"])
def test_cuda_mode_without_cuda_is_one_line(script):
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--device", "cuda"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"{script}: error: --device cuda: no CUDA device is available on this "
                                             f"machine"], p.stderr
    assert "Traceback" not in p.stdout + p.stderr


def test_cuda_mode_settings_of_both_sides(tmp_path, monkeypatch):
    """What --device cuda runs, without running it: bf16 on both sides, TRL's grouped_mm experts and continuous
    batching, the same response length, the fast engine for moe-gspo and room for 256-token responses."""
    comparison, trl_side = _bench_rl_parts(monkeypatch)
    cfg = comparison.bench_config("gpu_single", "gspo", [], None, 3, "cuda", 256, "hf_static")
    assert (cfg.model.params_dtype, cfg.rollout.engine_dtype, cfg.rollout.engine) == ("bfloat16", "bfloat16",
                                                                                       "hf_static")
    assert cfg.rollout.max_new_tokens == 256 and cfg.model.max_position_embeddings >= 256 + 64
    assert (cfg.parallel.backend, cfg.train.steps, cfg.train.cold_start_steps) == ("nccl", 3, 0)
    big = comparison.bench_config("gpu_2b", "grpo", [], None, 3, "cuda", 256, "hf_static")
    assert big.model.num_experts == 64 and big.model.max_position_embeddings == 2048
    kw = trl_side.trl_kwargs(cfg, "gspo", str(tmp_path), "cuda", "continuous_batching")
    assert (kw["use_cpu"], kw["bf16"], kw["use_transformers_continuous_batching"]) == (False, True, True)
    assert kw["max_completion_length"] == 256 and kw["num_generations"] == cfg.rollout.group_size
    assert trl_side.trl_model_kwargs("cuda")["experts_implementation"] == "grouped_mm"
    cpu = trl_side.trl_kwargs(comparison.bench_config("default", "gspo", [], None, 3), "gspo", str(tmp_path))
    assert (cpu["use_cpu"], cpu["bf16"], cpu["use_transformers_continuous_batching"]) == (True, False, False)
