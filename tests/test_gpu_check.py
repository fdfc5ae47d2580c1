"""scripts/gpu_check.sh's stage commands, checked on the CPU before a GPU lease spends minutes on them: every
`moe-gspo train` / `compare` command's config and overrides validate, every benchmark's arguments parse with that
script's own argument parser, and every test file named exists. `DRY=1` makes the script print its commands."""
from __future__ import annotations

import argparse
import os
import runpy
import shlex
import subprocess
import sys

import pytest
from helpers import ROOT

# the lease plans in docs/gpu.md set these; the defaults are checked too
PLANS = [{}, {"ENGINE_ARGS": "--repeats 1 --prompts 8 --max-new-tokens 128",
              "RL_ARGS": "--algos gspo --steps 3 --warmup 1 --trl-generation generate", "ENGINE_SIZES": "gpu_2b",
              "RL_SIZES": "gpu_2b", "STEP_ARGS": "--profile 15"}]


def stage_commands(tmp_path, env_extra) -> dict[str, list[str]]:
    env = {**os.environ, "DRY": "1", "OUT": str(tmp_path), "PYTHON": sys.executable, **env_extra}
    out = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    commands = {}
    for line in out.stdout.splitlines():
        if line.startswith("== ") and ": exit" not in line:
            name, cmd = line[3:].split(": ", 1)
            commands[name] = shlex.split(cmd)[1:]  # without the interpreter
    return commands


class _Parsed(Exception):
    pass


def parse_only(script: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """The script's own argparse over args, stopped right after parsing (nothing else of main runs)."""
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, a=None, namespace=None):
        raise _Parsed(real(self, a, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.syspath_prepend(str((ROOT / script).parent))  # as running the script has it: its own folder first
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    return parsed.value.args[0]


@pytest.mark.parametrize("plan", range(len(PLANS)))
def test_every_stage_command_is_valid_before_a_lease(tmp_path, monkeypatch, plan):
    from moe_gspo.config import load_config
    from moe_gspo.experiments.compare import read_compare_config

    commands = stage_commands(tmp_path, PLANS[plan])
    expected = ({"tests", "bench", "step_gpu_single", "train_float32", "rl_gpu_2b", "engine_gpu_2b"} if plan == 0
                else {"rl_gpu_2b", "engine_gpu_2b"})
    assert expected <= set(commands), sorted(commands)
    monkeypatch.chdir(ROOT)
    for name, args in commands.items():
        if args == ["-"]:  # the env stage: a heredoc
            continue
        if args[:2] == ["-m", "moe_gspo.cli"]:
            command, rest = args[2], args[3:]
            config = rest[rest.index("--config") + 1]
            overrides = [a for a in rest if "=" in a and not a.startswith("-")]
            if command == "train":
                load_config(config, overrides)
            else:
                assert command == "compare", name
                read_compare_config(config, overrides)
        elif args[:2] == ["-m", "pytest"]:
            tests = [a for a in args if a.startswith("tests/")]
            assert tests and all((ROOT / t).is_file() for t in tests), (name, tests)
        else:
            assert args[0].startswith("scripts/") and (ROOT / args[0]).is_file(), (name, args)
            ns = parse_only(args[0], args[1:], monkeypatch)
            if getattr(ns, "config", None):
                assert (ROOT / ns.config).is_file(), (name, ns.config)


def test_a_bad_argument_in_a_stage_command_is_caught(monkeypatch):
    # what the check above relies on: a misspelt flag or a bad choice fails the script's own parser
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        parse_only("scripts/bench_step.py", ["--device", "cuda", "--dtpye", "bfloat16"], monkeypatch)
    with pytest.raises(SystemExit):
        parse_only("scripts/bench_rl.py", ["--device", "tpu"], monkeypatch)


def test_stage_logs_name_paths_relative_to_the_checkout():
    """What a stage prints goes through relative_paths before its log: the output folder reads $OUT, the checkout's
    own files read relative, so committed logs carry no machine's paths."""
    script = (ROOT / "scripts/gpu_check.sh").read_text()
    body = script[script.index("relative_paths() {"):]
    body = body[:body.index("\n}\n") + 3]
    line = f"report: /tmp/sci/report.html, config {ROOT}/configs/gpu_single.yaml, /opt/other"
    out = subprocess.run(["bash", "-c", f'{body}\nOUT=/tmp/sci\necho "$LINE" | relative_paths'], cwd=ROOT,
                         env={**os.environ, "LINE": line}, capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "report: $OUT/report.html, config configs/gpu_single.yaml, /opt/other"
    assert "| relative_paths | tee" in script  # every stage's output goes through it
