"""Every error a user can cause through the CLI ends in one line naming the culprit, exit code 2, no traceback.

Each row of CASES is one such input (a config, an override, a data file, a checkpoint, a world size, a report
path) run through `moe_gspo.cli.main` in this process; two rows also run as a subprocess to show that nothing but
that line reaches stderr.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, TINY

from moe_gspo.cli import main

TRAIN = ["train", "--config", "configs/train_tiny_cpu.yaml"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_errors")
    (d / "bad.yaml").write_text("model: [1, 2\n")
    (d / "list.yaml").write_text("- 1\n- 2\n")
    (d / "unknown_section.yaml").write_text("modle:\n  hidden_size: 8\n")
    (d / "bad_value.yaml").write_text("train:\n  steps: many\n")
    (d / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    (d / "no_answer.jsonl").write_text('{"prompt": "1+1="}\n')
    (d / "empty_run").mkdir()
    (d / "run_no_ckpt").mkdir()
    (d / "run_no_ckpt" / "config.yaml").write_text((ROOT / "configs/tiny_cpu.yaml").read_text())
    (d / "hf_garbled").mkdir()
    (d / "hf_garbled" / "config.json").write_text("{not json")
    (d / "previous_run").mkdir()
    (d / "previous_run" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (d / "a_file").write_text("")
    (d / "long.jsonl").write_text(json.dumps({"prompt": "1+" * 30 + "1=", "answer": "31"}) + "\n")
    (d / "compare_done").mkdir()
    (d / "compare_done" / "compare.json").write_text(json.dumps({"variants": {"gspo": []}}))
    return d


# (id, argv with {d} for the fixture's directory, text the one line must contain)
CASES = [
    ("missing config", ["train", "--config", "{d}/missing.yaml"], "config file not found: {d}/missing.yaml"),
    ("invalid yaml", ["train", "--config", "{d}/bad.yaml"], "{d}/bad.yaml:2: invalid YAML"),
    ("yaml not a mapping", ["train", "--config", "{d}/list.yaml"], "top level must be a mapping"),
    ("unknown section in yaml", ["train", "--config", "{d}/unknown_section.yaml"], "{d}/unknown_section.yaml: unknown config key 'modle'"),
    ("bad value in yaml", ["train", "--config", "{d}/bad_value.yaml"], "{d}/bad_value.yaml: train.steps='many' must be an int"),
    ("override without =", TRAIN + ["train.steps"], "override 'train.steps' is not of the form section.key=value"),
    ("unknown override key", TRAIN + ["train.stepz=3"], "command-line override train.stepz=3: unknown config key 'train.stepz'"),
    ("override of the wrong type", TRAIN + ["train.steps=abc"], "command-line override train.steps=abc: train.steps='abc' must be an int"),
    ("unknown loss", TRAIN + ["algorithm.loss=ppo", "--out", "{d}/r"], "algorithm.loss='ppo': unknown policy loss; valid names: cispo, gmpo, grpo, gspo"),
    ("unknown advantage", TRAIN + ["algorithm.advantage=ppo", "--out", "{d}/r"], "algorithm.advantage='ppo' is not one of"),
    ("unknown engine", TRAIN + ["rollout.engine=tgi", "--out", "{d}/r"], "rollout.engine='tgi' is not one of"),
    ("unknown task", TRAIN + ["rollout.task=nope", "--out", "{d}/r"], "rollout.task: unknown task 'nope'"),
    ("task_args not key=value", TRAIN + ["rollout.task_args=max_digits", "--out", "{d}/r"], "rollout.task_args: 'max_digits' is not key=value"),
    ("task_args unknown knob", TRAIN + ["rollout.task_args=bogus=1", "--out", "{d}/r"], "rollout.task_args='bogus=1' for task 'addition'"),
    ("group of one", TRAIN + ["rollout.group_size=1", "train.minibatches=1", "--out", "{d}/r"], "rollout.group_size=1"),
    ("tp larger than the world", TRAIN + ["parallel.tp=3", "--out", "{d}/r"], "parallel.tp=3 does not divide the world size 1"),
    ("ep larger than the world", TRAIN + ["parallel.ep=2", "--out", "{d}/r"], "parallel.ep=2 does not divide the world size 1"),
    ("unknown loss implementation", TRAIN + ["train.loss_impl=triton", "--out", "{d}/r"], "train.loss_impl='triton' is not one of ['fused', 'eager']"),
    ("minibatches do not divide", TRAIN + ["train.minibatches=3", "--out", "{d}/r"], "train.minibatches=3 does not divide"),
    ("dataset without path", TRAIN + ["rollout.task=jsonl", "--out", "{d}/r"], "rollout.task='jsonl' needs rollout.dataset_path"),
    ("dataset file missing", TRAIN + ["rollout.task=jsonl", "rollout.task_args=", "rollout.dataset_path={d}/none.jsonl", "--out", "{d}/r"], "dataset file not found: {d}/none.jsonl"),
    ("relative dataset path missing", TRAIN + ["rollout.task=jsonl", "rollout.dataset_path=no/such.jsonl", "--out", "{d}/r"], "dataset file not found: no/such.jsonl (a relative path: looked for " + str(ROOT) + "/no/such.jsonl, from the working directory)"),
    ("dataset line not json, the task replaced on the command line", TRAIN + ["rollout.task=jsonl", "rollout.dataset_path={d}/bad.jsonl", "--out", "{d}/r"], "{d}/bad.jsonl:2: invalid JSON"),
    ("a task knob given for a data set", TRAIN + ["rollout.task=jsonl", "rollout.dataset_path={d}/bad.jsonl", "rollout.task_args=max_digits=1", "--out", "{d}/r"], "rollout.task_args='max_digits=1' holds a built-in task's knobs"),
    ("dataset line not json", TRAIN + ["rollout.task=jsonl", "rollout.task_args=", "rollout.dataset_path={d}/bad.jsonl", "--out", "{d}/r"], "{d}/bad.jsonl:2: invalid JSON"),
    ("dataset row without answer", TRAIN + ["rollout.task=jsonl", "rollout.task_args=", "rollout.dataset_path={d}/no_answer.jsonl", "--out", "{d}/r"], "{d}/no_answer.jsonl:1"),
    ("checkpoint dir missing", TRAIN + ["model.init_from={d}/nothing", "--out", "{d}/r"], "{d}/nothing: no config.json"),
    ("checkpoint config garbled", TRAIN + ["model.init_from={d}/hf_garbled", "--out", "{d}/r"], "{d}/hf_garbled"),
    ("run dir holds a run", TRAIN + ["--out", "{d}/previous_run"], "run directory {d}/previous_run holds a previous run"),
    ("run dir under a file", TRAIN + ["--out", "{d}/a_file/run"], "run directory {d}/a_file/run cannot be created: {d}/a_file is not a directory"),
    ("demonstration longer than the context", TRAIN + ["rollout.task=jsonl", "rollout.task_args=", "rollout.dataset_path={d}/long.jsonl", "rollout.demonstration_field=answer", "model.max_position_embeddings=64", "rollout.max_new_tokens=1", "--out", "{d}/r"], "cold start: demonstration '1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+1+'... has 66 tokens (bos + prompt + completion + eos), more than the context model.max_position_embeddings=64"),
    ("prompt longer than the context, found at load", TRAIN + ["rollout.task=jsonl", "rollout.task_args=", "rollout.dataset_path={d}/long.jsonl", "model.max_position_embeddings=32", "--out", "{d}/r"], "{d}/long.jsonl:1: the prompt has 63 tokens; with rollout.max_new_tokens=3 it exceeds the context model.max_position_embeddings=32 (rollout.overlong_prompts=drop leaves such rows out)"),
    ("every prompt dropped as overlong", TRAIN + ["rollout.task=jsonl", "rollout.task_args=", "rollout.dataset_path={d}/long.jsonl", "model.max_position_embeddings=32", "rollout.overlong_prompts=drop", "--out", "{d}/r"], "rollout.overlong_prompts=drop left no train rows: every prompt is longer than 29 tokens"),
    ("resume and overwrite", TRAIN + ["--resume", "--overwrite", "--out", "{d}/r"], "--resume and --overwrite exclude each other"),
    ("te spec without TE", TRAIN + ["model.spec=te", "--out", "{d}/r"], "model.spec='te' needs Transformer Engine on CUDA"),
    ("vocabulary smaller than the tokenizer", TRAIN + ["model.vocab_size=16", "--out", "{d}/r"], "model.vocab_size=16 is smaller than the character tokenizer's"),
    ("rollout vocabulary smaller than the tokenizer", ["rollout", "--config", "configs/tiny_cpu.yaml", "--out", "{d}/x.jsonl", "model.vocab_size=16"], "model.vocab_size=16 is smaller than the character tokenizer's"),
    ("negative prompt count", ["rollout", "--config", "configs/tiny_cpu.yaml", "--out", "{d}/x.jsonl", "--num-prompts", "-1"], "--num-prompts=-1 must be >= 1"),
    ("rollout from a non-run", ["rollout", "--from", "{d}/empty_run", "--out", "{d}/x.jsonl"], "--from {d}/empty_run: no config.yaml"),
    ("rollout from a run without checkpoints", ["rollout", "--from", "{d}/run_no_ckpt", "--out", "{d}/x.jsonl"], "no complete checkpoint"),
    ("volatility of a non-run", ["report", "volatility", "{d}/empty_run"], "no metrics file {d}/empty_run/metrics.jsonl"),
    ("compare report of a non-compare", ["report", "compare", "{d}/empty_run"], "{d}/empty_run/compare.json: not found"),
    ("compare unknown variant", ["compare", "--config", "configs/compare_tiny_cpu.yaml", "--out", "{d}/c", "--only", "nope"], "--only ['nope']: not among the variants"),
    ("compare over a comparison", ["compare", "--config", "configs/compare_tiny_cpu.yaml", "--out", "{d}/compare_done", "--only", "gspo"], "{d}/compare_done holds a previous comparison"),
    ("compare config missing", ["compare", "--config", "{d}/missing.yaml", "--out", "{d}/c"], "{d}/missing.yaml"),
]


@pytest.mark.parametrize("argv,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_user_error_is_one_line(files, capsys, monkeypatch, argv, expect):
    monkeypatch.chdir(ROOT)
    argv = [a.format(d=files) for a in argv]
    if argv[0] == "train" and "--config" in argv and argv[2].startswith("configs/"):
        argv = argv[:3] + TINY + argv[3:]  # a tiny model: the cases that get as far as building it stay fast
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if line.startswith("moe-gspo ")]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err
    assert lines[0].startswith(f"moe-gspo {argv[0]}: error: "), lines[0]
    assert expect.format(d=files) in lines[0], lines[0]


@pytest.mark.parametrize("argv,what", [(TRAIN + ["--out", "{out}"], "run directory"),
                                       (["train-lm", "--config", "configs/tiny_cpu.yaml", "train.out_dir={out}"],
                                        "train.out_dir"),
                                       (["compare", "--config", "configs/compare_tiny_cpu.yaml", "--out", "{out}"],
                                        "--out directory")],
                         ids=["train", "train-lm", "compare"])
def test_an_output_directory_that_cannot_be_written_is_one_line(tmp_path, capsys, monkeypatch, argv, what):
    """--out (train.out_dir) under a read-only directory is refused in one line naming it, before anything is built
    (building would fail the test). Root writes into a read-only directory anyway, so as root the directory is asked
    for under a regular file instead, which nobody can create."""
    import moe_gspo.model.load

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the output directory was checked")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(moe_gspo.model.load, "init_parallel", built)
    if os.geteuid() == 0:
        (tmp_path / "file").write_text("")
        out, why = tmp_path / "file" / "run", f"cannot be created: {tmp_path / 'file'} is not a directory"
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        out, why = tmp_path / "ro" / "run", f"cannot be written: {tmp_path / 'ro'}: Permission denied"
    try:
        rc = main([a.format(out=out) for a in argv])
    finally:
        (tmp_path / "ro").exists() and (tmp_path / "ro").chmod(0o755)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"moe-gspo {argv[0]}: error: {what} {out} {why}"], err
    assert not out.exists()


@pytest.mark.parametrize("argv", [["train", "--config", "configs/train_tiny_cpu.yaml", "parallel.tp=3"],
                                  ["rollout", "--config", "configs/tiny_cpu.yaml", "--out", "x.jsonl", "--num-prompts", "0"]],
                         ids=["train", "rollout"])
def test_only_the_line_reaches_stderr(argv):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "moe_gspo.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith(f"moe-gspo {argv[0]}: error: "), r.stderr


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    """A ValueError or KeyError raised by this package's own code is a bug, not a user error: it propagates with its
    traceback instead of becoming one line."""
    from moe_gspo.commands import sample

    def broken(*args, **kwargs):
        raise KeyError("an internal table lacks a key")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sample, "rollout_command", broken)
    with pytest.raises(KeyError, match="internal table"):
        main(["rollout", "--config", "configs/tiny_cpu.yaml", "--out", "x.jsonl"])
    assert "error:" not in capsys.readouterr().err
