"""Smoke test of scripts/bench_engine.py on the CPU (configs/tiny_cpu.yaml): the engines generate and agree with the
hf engine under greedy decoding, a bucketed sync reports bit-equal weights, and the vllm engine's update is timed.
The GPU figures come from scripts/gpu_check.sh."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from helpers import ROOT


def test_bench_engine_runs_on_the_cpu(tmp_path):
    from moe_gspo.config import load_config
    from moe_gspo.model.hf_io import hf_sources

    out = tmp_path / "bench_engine.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_engine.py"), "--config", "configs/tiny_cpu.yaml",
                        "--prompts", "2", "--group", "2", "--max-new-tokens", "4", "--repeats", "1",
                        "--buckets", "0,4096", "--engines", "hf,hf_static,vllm", "--json", str(out)],
                       cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    gen = res["generate"]
    assert [r["engine"] for r in gen["rows"]] == ["hf", "hf_static", "vllm"]
    # 2 prompts x 2 samples of at most 4 tokens each, and the rate is the tokens over the measured time
    assert all(0 < r["runs"][0]["response_tokens"] <= 2 * 2 * 4 for r in gen["rows"])
    assert all(r["response_tokens_per_s"] == pytest.approx(r["runs"][0]["response_tokens"] / r["runs"][0]["seconds"])
               for r in gen["rows"])
    assert [r["greedy_identical_to_hf"] for r in gen["rows"][1:]] == [1.0, 1.0] and gen["compiled"] is False
    # the update writes every tensor of the policy's export once
    assert res["sync_vllm"]["tensors"] == len(hf_sources(load_config(ROOT / "configs/tiny_cpu.yaml").model))
    assert res["sync_vllm"]["median_s"] == pytest.approx(statistics.median(res["sync_vllm"]["seconds"]))
    rows = res["sync"]["rows"]
    assert [r["bucket_bytes"] for r in rows] == [0, 4096] and all(r["bit_equal"] for r in rows)
    assert rows[1]["copies"] < rows[0]["copies"]  # small tensors share buckets
