"""A new user's run from config to exported model: their own tiny Qwen3-MoE checkpoint (another shape than the
YAML, its own tokenizer and chat template), verl-format parquet data, a reward file of theirs (verl's signature,
then TRL's), two RL steps with evaluation, and an export that transformers loads with the trained policy's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from moe_gspo.config import load_config
from hf_fixtures import user_checkpoint
from helpers import ROOT

DATA = Path(__file__).parent / "data"
VERL = DATA / "gsm8k_verl_sample"

VERL_REWARD = '''
import json

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info,
                            "response": solution_str}}) + "\\n")
    return {{"score": (ord(solution_str[0]) % 5) / 4 if solution_str else 0.0}}  # varied: the groups learn
'''

TRL_REWARD = '''
import json

def reward(prompts, completions, answer, difficulty, **kwargs):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompts": prompts, "completions": completions, "answer": answer,
                            "difficulty": difficulty, "other": sorted(kwargs)}}) + "\\n")
    return [len(c[0]["content"]) % 3 / 2 for c in completions]
'''


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return user_checkpoint(tmp_path_factory.mktemp("user") / "ckpt")


def _overrides(ckpt, reward, data):
    return [f"model.init_from={ckpt}", "rollout.task=dataset", "rollout.task_args=", *data,
            f"rollout.reward={reward}", "rollout.chat_template_kwargs={enable_thinking: false}",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=2",
            "train.minibatches=2", "train.micro_batch_size=8", "train.checkpoint_every=1", "train.eval_every=2",
            "rollout.eval_prompts=4", "logging.progress=false", "logging.tensorboard=false"]


def _train(overrides, run_dir, capfd):
    from moe_gspo.train.loop import train

    train(load_config("configs/train_tiny_cpu.yaml", overrides), run_dir=run_dir)
    return capfd.readouterr().err


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_verl_data_and_reward_to_export(ckpt, tmp_path, capfd):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_gspo.model.load import init_parallel, load_policy
    from moe_gspo.checkpoint.store import Checkpoints
    from moe_gspo.checkpoint.export import export_run

    log = tmp_path / "calls.jsonl"
    reward = tmp_path / "my_reward.py"
    reward.write_text(VERL_REWARD.format(log=str(log)))
    run = tmp_path / "run"
    data = [f"rollout.dataset_path={VERL / 'train.parquet'}", "rollout.answer_field=reward_model.ground_truth",
            f"rollout.eval_dataset_path={VERL / 'test.parquet'}"]
    err = _train(_overrides(ckpt, f"{reward}:compute_score", data), run, capfd)

    # the checkpoint's shape everywhere: the line that says so, config.yaml, the per-layer and per-expert metrics
    assert "replaces the config's" in err and "num_hidden_layers 4 -> 2" in err and "num_experts 8 -> 16" in err
    assert "cold start skipped: model.init_from=" in err  # train_tiny_cpu.yaml asks for 150 steps
    model = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert (model["num_hidden_layers"], model["num_experts"], model["vocab_size"]) == (2, 16, 112)
    metrics = _rows(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert {k for k in metrics[0] if k.startswith("moe/flip_rate/layer_")} == {"moe/flip_rate/layer_0",
                                                                               "moe/flip_rate/layer_1"}
    assert "moe/churn_in/expert_15" in metrics[0]
    assert "eval/accuracy" in metrics[1] and metrics[1]["eval/prompts"] == 4 and "eval/accuracy" not in metrics[0]
    assert metrics[0]["grad_norm"] > 0  # the varied rewards moved the policy

    # the reward saw each response's own row: ground truth, data_source and extra_info of the same problem
    raw = {r["question"]: r["answer"].rsplit("####", 1)[1].strip()
           for f in ("gsm8k_raw_sample.jsonl", "gsm8k_raw_sample_test.jsonl") for r in _rows(DATA / f)}
    calls = _rows(log)
    assert len(calls) == 2 * 2 * 4 + 4  # 2 steps x 2 prompts x 4 responses, then 4 greedy eval responses
    for c in calls:
        assert c["data_source"] == "openai/gsm8k" and c["ground_truth"] == raw[c["extra_info"]["question"]]
    assert {c["extra_info"]["split"] for c in calls[:16]} == {"train"} and {c["extra_info"]["split"]
                                                                             for c in calls[16:]} == {"test"}

    # export: transformers loads it, with the trained policy's logits and the tokenizer's ids
    out = export_run(run, tmp_path / "hf")
    cfg = load_config(run / "config.yaml")
    policy = load_policy(cfg, init_parallel(cfg))
    Checkpoints(run / "checkpoints").load_weights(2, policy)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = policy(ids), hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    initial = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (initial(ids).logits - theirs).abs().max() > 1e-4  # the export holds the trained weights
    tok = AutoTokenizer.from_pretrained(str(out))
    gen = json.loads((out / "generation_config.json").read_text())
    assert tok.chat_template and gen["eos_token_id"][0] == tok.convert_tokens_to_ids("<|im_end|>")
    # the tokenizer has no bos (as Qwen's): none is named, and config.json keeps eos and pad as generation does
    assert "bos_token_id" not in gen and tok.bos_token_id is None
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (gen["eos_token_id"], gen["pad_token_id"])
    assert config.get("bos_token_id") is None


def test_trl_data_and_reward(ckpt, tmp_path, capfd):
    """TRL's format and signature: chat prompts, completions as assistant messages, every other column as lists;
    and `moe-gspo rollout` writes the templated prompt ids the engine saw."""
    from transformers import AutoTokenizer

    from moe_gspo.commands.sample import rollout_command

    log = tmp_path / "calls.jsonl"
    reward = tmp_path / "trl_reward.py"
    reward.write_text(TRL_REWARD.format(log=str(log)))
    data = [f"rollout.dataset_path={DATA / 'trl_sample.jsonl'}"]
    overrides = [o for o in _overrides(ckpt, f"{reward}:reward", data) if not o.startswith("train.eval_every")]
    _train(overrides, tmp_path / "run", capfd)
    rows = {json.dumps(r["prompt"]): r for r in _rows(DATA / "trl_sample.jsonl")}
    calls = _rows(log)
    assert len(calls) == 2  # once per step, batched
    for c in calls:
        assert len(c["prompts"]) == len(c["completions"]) == len(c["answer"]) == 8
        for p, comp, ans, diff in zip(c["prompts"], c["completions"], c["answer"], c["difficulty"]):
            row = rows[json.dumps(p)]  # the prompt as the data set holds it: chat messages
            assert (ans, diff) == (row["answer"], row["difficulty"])
            assert len(comp) == 1 and comp[0]["role"] == "assistant" and isinstance(comp[0]["content"], str)

    out = tmp_path / "rollouts.jsonl"
    rollout_command(None, str(tmp_path / "run"), [], 2, out)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    for line in _rows(out):
        text = tok.apply_chat_template(line["messages"], tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
        assert tok.decode(line["prompt_ids"]) == text and text.endswith("<|im_start|>assistant\n<think></think>")
        assert line["prompt_text"] == text  # the text the model saw, template markers included


EVAL_REWARD = '''
import json

def reward(response, example):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompt": example.prompt, "response": response}}) + "\\n")
    return 1.0 if response[:1] in "aeiou0123" else 0.25
'''


def test_eval_pass_at_k(ckpt, tmp_path, capfd):
    """eval/ figures with rollout.eval_samples = 4: recomputed from the responses the reward was given."""
    log = tmp_path / "calls.jsonl"
    reward = tmp_path / "r.py"
    reward.write_text(EVAL_REWARD.format(log=str(log)))
    data = [f"rollout.dataset_path={VERL / 'train.parquet'}", "rollout.answer_field=reward_model.ground_truth",
            f"rollout.eval_dataset_path={VERL / 'test.parquet'}"]
    run = tmp_path / "run"
    _train(_overrides(ckpt, f"{reward}:reward", data) + ["rollout.eval_samples=4", "rollout.eval_prompts=0",
                                                         "train.steps=1", "train.eval_every=1"], run, capfd)
    (m,) = _rows(run / "metrics.jsonl")
    calls = _rows(log)[2 * 4:]  # after the step's 2 prompts x 4 responses: 8 held-out prompts x 4 samples
    assert len(calls) == 8 * 4 and m["eval/prompts"] == 8
    scores = [1.0 if c["response"][:1] in "aeiou0123" else 0.25 for c in calls]
    assert m["eval/reward_mean"] == pytest.approx(sum(scores) / 32)
    assert m["eval/accuracy"] == pytest.approx(sum(s == 1.0 for s in scores) / 32)
    passed = [any(s == 1.0 for s in scores[4 * i:4 * i + 4]) for i in range(8)]
    assert m["eval/pass@4"] == pytest.approx(sum(passed) / 8)
    assert 0 < m["eval/accuracy"] < m["eval/pass@4"]  # the sampled responses differ within a prompt
    assert {c["prompt"] for c in calls[:4]} == {calls[0]["prompt"]}  # a prompt's 4 samples are adjacent


def test_eval_before_training_is_the_starting_policy(ckpt, tmp_path, capfd):
    """train.eval_before: a step-0 row of eval/ figures only, from the policy before any update; with lr 0 the policy
    after step 1 is that policy, and its greedy evaluation gives the same figures."""
    reward = tmp_path / "r.py"  # a score that tells greedy responses apart
    reward.write_text("def reward(response, example):\n    return 1.0 if sum(map(ord, response)) % 3 == 0 else 0.5\n")
    data = [f"rollout.dataset_path={VERL / 'train.parquet'}", "rollout.answer_field=reward_model.ground_truth",
            f"rollout.eval_dataset_path={VERL / 'test.parquet'}"]
    err = _train(_overrides(ckpt, f"{reward}:reward", data) + ["train.steps=1", "train.eval_every=1",
                                                                "train.eval_before=true", "train.lr=0"],
                 tmp_path / "run", capfd)
    before, after = _rows(tmp_path / "run" / "metrics.jsonl")
    assert (before["step"], after["step"]) == (0, 1)
    assert set(before) == {"step", "eval/reward_mean", "eval/accuracy", "eval/reward_errors", "eval/prompts"}
    assert 0.5 < before["eval/reward_mean"] < 1.0  # the reward varies over the responses, so equality says much
    assert {k: after[k] for k in before if k != "step"} == {k: v for k, v in before.items() if k != "step"}
    assert f"before training: eval/accuracy {before['eval/accuracy']:.4f} on 4 held-out prompts" in err


def test_a_resume_that_does_not_fit_changes_nothing_in_the_run(ckpt, tmp_path, capsys, monkeypatch):
    """A run trained from model.init_from, resumed without it: one line naming the fields that differ, exit 2, and
    config.yaml, metrics.jsonl and the checkpoints as they were (export still reads the run)."""
    from moe_gspo.cli import main

    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    base = ["train", "--config", "configs/train_tiny_cpu.yaml", "--out", str(run), "train.steps=1",
            "train.checkpoint_every=1", "logging.progress=false", "logging.tensorboard=false",
            "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=4", "train.minibatches=1"]
    assert main(base + [f"model.init_from={ckpt}", "train.cold_start_steps=0"]) == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(base[:-4] + ["train.steps=2", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-gspo train: error: --resume: "), err
    assert "model.num_hidden_layers=2 in the run, 4 now" in err[0] and f"model.init_from={ckpt}" in err[0]
    assert "nothing in the run directory was changed" in err[0]
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0


QWEN_LIKE = ("{% for m in messages %}{% if m.role == 'system' %}<|im_start|>system\n{{ m.content }}<|im_end|>\n"
             "{% elif m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
             "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_role_the_template_drops_is_named_at_load(ckpt, tmp_path, capsys, monkeypatch):
    """A template that renders system, user and assistant only (as Qwen's do) would show the model nothing of a
    'human' message: refused before anything is built, naming the file, line and role; the roles it renders run."""
    import shutil

    from moe_gspo.cli import main

    monkeypatch.chdir(ROOT)
    own = tmp_path / "ckpt"
    shutil.copytree(ckpt, own)
    (own / "chat_template.jinja").write_text(QWEN_LIKE)
    data = tmp_path / "chat.jsonl"
    rows = [[{"role": "user", "content": "1+1="}], [{"role": "system", "content": "Be brief."},
                                                   {"role": "human", "content": "2+2="}]]
    data.write_text("".join(json.dumps({"prompt": r, "answer": "2"}) + "\n" for r in rows))
    argv = ["train", "--config", "configs/train_tiny_cpu.yaml", f"model.init_from={own}", "rollout.task=dataset",
            "rollout.task_args=", f"rollout.dataset_path={data}", "rollout.reward=exact", "train.steps=1",
            "train.cold_start_steps=0", "rollout.prompts_per_step=2", "rollout.group_size=2", "train.minibatches=1",
            "rollout.max_new_tokens=2", "logging.progress=false", "logging.tensorboard=false", "--out",
            str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"moe-gspo train: error: {data}:2: message 1 has role 'human', which the chat template drops: the "
                   "template renders nothing of its messages (roles in the data: human, system, user); use the roles "
                   "the template renders (system, user, assistant)"], err
    assert not (tmp_path / "run").exists()
    data.write_text("".join(json.dumps({"prompt": r, "answer": "2"}) + "\n" for r in rows[:1] * 2))
    assert main(argv) == 0
