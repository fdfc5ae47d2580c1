"""The console entry point: `moe-gspo info` and a short `train-lm` run whose loss falls."""

import json
import subprocess
import sys


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "moe_gspo.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_info_lists_backends():
    r = run("info")
    assert r.returncode == 0, r.stderr
    for name in ("torch", "megatron-core", "CUDA", "Transformer Engine", "Triton", "SGLang"):
        assert name in r.stdout


def test_train_lm_learns(tmp_path):
    out = tmp_path / "run"
    r = run("train-lm", "--config", "configs/tiny_cpu.yaml", "train.steps=12", "train.seq_len=32",
            "train.batch_size=8", "train.lr=3e-3", f"train.out_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.3
    assert (out / "hf" / "config.json").is_file()


def test_bad_override_is_one_clear_error():
    r = run("train-lm", "--config", "configs/tiny_cpu.yaml", "train.nope=1")
    assert r.returncode == 2
    assert "unknown config key 'train.nope'" in r.stderr
    assert "Traceback" not in r.stderr
