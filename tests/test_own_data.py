"""A user's own data from the config: data set formats and fields, chat templates, the checkpoint's architecture,
the cold start's rules, and config errors in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_gspo.config import ConfigError, load_config
from moe_gspo.tasks import CharTokenizer, DatasetError, load_examples, task_from_config
from moe_gspo.tasks.prompts import encode_prompt
from moe_gspo.tasks.tokenizer import HFTokenizer
from moe_gspo.train.data import cold_start_plan, encode_prompts
from hf_fixtures import user_checkpoint

DATA = Path(__file__).parent / "data"
VERL = DATA / "gsm8k_verl_sample"
TRL = DATA / "trl_sample.jsonl"
RAW = DATA / "gsm8k_raw_sample.jsonl"
TINY = "configs/train_tiny_cpu.yaml"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return user_checkpoint(tmp_path_factory.mktemp("user_ckpt") / "ckpt")


def _raw():
    return [json.loads(line) for line in RAW.read_text().splitlines()]


def test_verl_parquet_read_unchanged():
    """verl's rows: chat-message prompts, the answer inside reward_model, every other column in meta."""
    rows = load_examples(VERL / "train.parquet", answer_field="reward_model.ground_truth")
    raw = _raw()
    assert len(rows) == 20
    for ex, r in zip(rows, raw):
        assert ex.messages[0]["role"] == "user" and ex.messages[0]["content"].startswith(r["question"])
        assert ex.answer == r["answer"].rsplit("####", 1)[1].strip()
        assert ex.meta["data_source"] == "openai/gsm8k" and ex.meta["extra_info"]["question"] == r["question"]
        assert "prompt" not in ex.meta and ex.meta["reward_model"]["ground_truth"] == ex.answer
    demo = load_examples(VERL / "train.parquet", answer_field="reward_model.ground_truth",
                         demonstration_field="extra_info.answer")
    assert demo[3].completion == raw[3]["answer"]


def test_formats_agree(tmp_path):
    """The same rows as JSON lines, a JSON array, JSON lines under .json, one parquet file and a folder of shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in TRL.read_text().splitlines()]
    (tmp_path / "array.json").write_text(json.dumps(rows))
    (tmp_path / "lines.json").write_text(TRL.read_text())
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "one.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:7]), shards / "part-00000.parquet")
    pq.write_table(pa.Table.from_pylist(rows[7:]), shards / "part-00001.parquet")
    want = [(e.prompt, e.answer, e.meta) for e in load_examples(TRL)]
    for p in (tmp_path / "array.json", tmp_path / "lines.json", tmp_path / "one.parquet", shards):
        assert [(e.prompt, e.answer, e.meta) for e in load_examples(p)] == want, p


@pytest.mark.parametrize("row,message", [
    ({"prompt": [{"role": "user"}], "answer": "1"}, "message 0 must be"),
    ({"prompt": [], "answer": "1"}, "non-empty string or a list of chat messages"),
    ({"prompt": 5, "answer": "1"}, "non-empty string or a list of chat messages"),
    ({"prompt": "q", "reward_model": {"style": "rule"}}, "missing field 'reward_model.ground_truth'"),
])
def test_bad_rows_name_file_and_line(tmp_path, row, message):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "ok", "reward_model": {"ground_truth": "1"}, "answer": "1"}) + "\n"
                 + json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=message) as e:
        load_examples(p, answer_field="reward_model.ground_truth" if "reward_model" in row else "answer")
    assert f"{p}:2:" in str(e.value)


def test_empty_shard_folder(tmp_path):
    with pytest.raises(DatasetError, match="must hold .parquet shards"):
        load_examples(tmp_path)


def test_chat_template_modes(ckpt):
    tok = HFTokenizer(str(ckpt))
    ex = load_examples(TRL)[0]
    want = tok.tok.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
    assert tok.tok.decode(encode_prompt(tok, ex, "auto")) == want
    assert tok.tok.decode(encode_prompt(tok, ex, "auto", {"enable_thinking": False})).endswith(
        "<|im_start|>assistant\n<think></think>")
    with pytest.raises(ConfigError, match="rollout.chat_template='none'"):
        encode_prompt(tok, ex, "none")
    plain = load_examples(VERL / "train.parquet", answer_field="reward_model.ground_truth")[0]
    text = plain.messages[0]["content"]
    string_ex = type(plain)(text, plain.answer)
    assert tok.tok.decode(encode_prompt(tok, string_ex, "auto")) == text  # no bos: the tokenizer has none
    wrapped = tok.tok.decode(encode_prompt(tok, string_ex, "always"))
    assert wrapped == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    # the character tokenizer: strings unchanged, messages by its own plain template
    ct = CharTokenizer()
    assert encode_prompt(ct, string_ex, "auto") == ct.encode(text, bos=True)
    assert ct.decode(encode_prompt(ct, ex, "auto")) == f"user: {ex.messages[0]['content']}\nassistant: "


def test_stop_ids_from_generation_config(ckpt):
    tok = HFTokenizer(str(ckpt))
    im_end, eot = tok.tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.eos_id == im_end and tok.stop_ids == (im_end, eot) and tok.pad_id == eot and not tok.has_bos


def test_checkpoint_defines_architecture(ckpt):
    cfg = load_config(TINY, [f"model.init_from={ckpt}"])
    assert (cfg.model.num_hidden_layers, cfg.model.num_experts, cfg.model.vocab_size) == (2, 16, 112)
    assert "num_hidden_layers 4 -> 2" in cfg.checkpoint_overrides and "num_experts 8 -> 16" in cfg.checkpoint_overrides
    assert cfg.model.params_dtype == "float32" and cfg.model.experts == "grouped"  # how to run it: the config's
    same = load_config(TINY, [f"model.init_from={ckpt}", "model.num_hidden_layers=2", "model.num_experts=16"])
    assert "num_experts 8 -> 16" not in same.checkpoint_overrides


def test_cold_start_plan(ckpt):
    task = task_from_config(load_config(TINY).rollout)
    assert cold_start_plan(load_config(TINY), task, False) == (150, None)
    assert cold_start_plan(load_config(TINY), task, True) == (0, None)
    pre = load_config(TINY, [f"model.init_from={ckpt}"])
    steps, why = cold_start_plan(pre, task, False)
    assert steps == 0 and "is pretrained" in why and "train.cold_start_pretrained=true" in why
    asked = load_config(TINY, [f"model.init_from={ckpt}", "train.cold_start_pretrained=true"])
    assert cold_start_plan(asked, task, False) == (150, None)
    data = ["rollout.task=dataset", "rollout.task_args=", f"rollout.dataset_path={TRL}"]
    no_demo = load_config(TINY, data)
    steps, why = cold_start_plan(no_demo, task_from_config(no_demo.rollout), False)
    assert steps == 0 and "no demonstrations" in why
    demo = load_config(TINY, data[:2] + [f"rollout.dataset_path={VERL / 'train.parquet'}",
                                         "rollout.answer_field=reward_model.ground_truth",
                                         "rollout.demonstration_field=extra_info.answer"])
    assert cold_start_plan(demo, task_from_config(demo.rollout), False) == (150, None)


def test_prompt_longer_than_context_names_it(ckpt):
    cfg = load_config(TINY, ["rollout.task=dataset", "rollout.task_args=", f"rollout.dataset_path={TRL}"])
    ex = load_examples(TRL)[:2]
    with pytest.raises(ConfigError, match="exceeds the context model.max_position_embeddings=64"):
        encode_prompts(ex, CharTokenizer(), cfg.rollout, cfg.model.max_position_embeddings)


def test_overlong_rows_are_dropped_at_load_when_asked(tmp_path, capsys):
    """rollout.overlong_prompts=drop: the rows too long for the context leave the train and eval sets before any
    step, one line counts them; the rest stay in order."""
    from moe_gspo.train.data import check_prompts

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+" * 40 + "1=", "answer": "41"},
            {"prompt": "2+2=", "answer": "4"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(TINY, ["rollout.task=dataset", "rollout.task_args=", f"rollout.dataset_path={data}",
                             f"rollout.eval_dataset_path={data}", "rollout.overlong_prompts=drop"])
    task = task_from_config(cfg.rollout)
    check_prompts(cfg, task, CharTokenizer())
    assert [ex.prompt for ex in task.rows] == ["1+1=", "2+2="] == [ex.prompt for ex in task.eval_rows]
    assert task.wheres == [f"{data}:1", f"{data}:3"]
    err = capsys.readouterr().err
    assert "train data: 1 of 3 rows dropped, their prompts longer than 60 tokens" in err and "eval data: 1 of 3" in err
    with pytest.raises(ConfigError, match=f"{data}:2: the prompt has 83 tokens"):
        check_prompts(load_config(TINY, ["rollout.task=dataset", "rollout.task_args=", f"rollout.dataset_path={data}"]),
                      task_from_config(cfg.rollout), CharTokenizer())


@pytest.mark.parametrize("overrides,message", [
    (["rollout.task=dataset"], "rollout.task='dataset' needs rollout.dataset_path"),
    (["rollout.task=dataset", f"rollout.dataset_path={TRL}", "rollout.task_args=max_digits=2"],
     "rollout.task_args='max_digits=2' holds"),
    (["rollout.prompt_field=question"], "rollout.prompt_field read a data set, but rollout.task='addition'"),
    (["rollout.answer_field=a..b"], "rollout.answer_field"),
    (["rollout.reward=nope.py:f"], "no such file nope.py"),
    (["rollout.reward=rewards.txt:f"], "'path/to/file.py:function'"),
    (["rollout.reward=[exact, nope.py:f]"], "rollout.reward[1]='nope.py:f': no such file nope.py"),
    (["rollout.reward=[]"], "rollout.reward=[] names no reward function"),
    (["rollout.reward=[exact, exact]", "rollout.reward_weights=[1.0]"],
     "rollout.reward_weights=[1.0] has 1 weights for 2 reward functions"),
    (["rollout.reward=exact", "rollout.reward_weights=[.nan]"], "rollout.reward_weights=[nan] must be finite"),
    (["rollout.task=dataset", f"rollout.dataset_path={TRL}", "rollout.answer_field=null",
      "rollout.reward=[examples/rewards/trl_length_reward.py:reward, gsm8k]"],
     "the built-in reward 'gsm8k' compares with one"),
    (["rollout.chat_template=never"], "rollout.chat_template='never' is not one of"),
    (["rollout.eval_samples=0"], "rollout.eval_samples=0 must be > 0"),
    (["train.eval_every=2", "rollout.task=dataset", "rollout.task_args=", f"rollout.dataset_path={TRL}"],
     "needs rollout.eval_dataset_path"),
    (["rollout.chat_template_kwargs=5"], "rollout.chat_template_kwargs=5 must be a mapping"),
    (["rollout.eval_prompts=-1"], "rollout.eval_prompts=-1 must be >= 0"),
    (["train.eval_every=-1"], "train.eval_every=-1 must be >= 0"),
    (["rollout.eval_dataset_path=x.jsonl"], "rollout.eval_dataset_path read a data set"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.").replace("[", r"\[")):
        load_config(TINY, overrides)


def test_the_files_task_knobs_go_with_the_task_the_command_line_replaced():
    cfg = load_config(TINY, ["rollout.task=dataset", f"rollout.dataset_path={TRL}"])
    assert (cfg.rollout.task, cfg.rollout.task_args) == ("dataset", "")
    assert load_config(TINY, ["rollout.task=addition"]).rollout.task_args == "max_digits=1,num_operands=3"


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(TINY, [f"model.init_from={tmp_path}"])


def test_prepare_gsm8k_writes_verl_rows(tmp_path):
    """scripts/prepare_gsm8k.py turns GSM8K's own rows into the verl rows the shipped sample holds."""
    import subprocess
    import sys

    import pyarrow.parquet as pq

    out = tmp_path / "gsm8k"
    subprocess.run([sys.executable, "scripts/prepare_gsm8k.py", "--out", str(out), "--train", str(RAW), "--test",
                    str(DATA / "gsm8k_raw_sample_test.jsonl")], check=True, capture_output=True)
    for split in ("train", "test"):
        assert pq.read_table(out / f"{split}.parquet").to_pylist() == \
            pq.read_table(VERL / f"{split}.parquet").to_pylist()
    row = pq.read_table(out / "train.parquet").to_pylist()[0]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "27"} and row["data_source"] == "openai/gsm8k"
    assert row["prompt"][0]["content"].endswith('output the final answer after "####".')
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final answer"}) + "\n")
    r = subprocess.run([sys.executable, "scripts/prepare_gsm8k.py", "--out", str(out), "--train", str(bad), "--test",
                        str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "prepare_gsm8k: error: train row 1: ValueError: no '####' in the solution 'no final answer'"]


def test_cold_start_demonstrations_use_the_rollout_prompt(ckpt):
    """A demonstration is the prompt exactly as the engine is given it (chat template included), then the
    completion and eos, with the loss on those."""
    from moe_gspo.tasks.sft import demonstration_batch
    from moe_gspo.train.data import PromptIds, build_tokenizer

    cfg = load_config("configs/gsm8k_tiny_cpu.yaml", [f"model.init_from={ckpt}",
                                                      "rollout.chat_template_kwargs={enable_thinking: false}"])
    tok, task = build_tokenizer(cfg), task_from_config(cfg.rollout)
    ex = task.rows[0]
    prompt = encode_prompts([ex], tok, cfg.rollout, cfg.model.max_position_embeddings)[0]
    ids, mask = demonstration_batch([ex], tok, prompt_ids=PromptIds(cfg, tok))
    completion = tok.encode(ex.completion, eos=True)
    assert ids[0].tolist() == prompt + completion and tok.tok.decode(prompt).endswith("<think></think>")
    assert mask[0].tolist() == [False] * len(prompt) + [True] * len(completion)


def test_missing_eval_file_names_it(tmp_path):
    cfg = load_config(TINY, ["rollout.task=dataset", "rollout.task_args=", f"rollout.dataset_path={TRL}",
                             f"rollout.eval_dataset_path={tmp_path / 'held_out.jsonl'}"])
    with pytest.raises(DatasetError, match=f"dataset file not found: {tmp_path / 'held_out.jsonl'}"):
        task_from_config(cfg.rollout)


def test_chat_prompts_need_a_template(ckpt):
    tok = HFTokenizer(str(ckpt))
    tok.chat_template = None  # a base model's tokenizer ships none
    ex = load_examples(TRL)[0]
    with pytest.raises(ConfigError, match="the tokenizer \\(HFTokenizer\\) has no chat template"):
        encode_prompt(tok, ex, "auto")
    string_ex = type(ex)(ex.messages[0]["content"], ex.answer)
    assert encode_prompt(tok, string_ex, "auto") == tok.encode(string_ex.prompt)  # strings need none
    with pytest.raises(ConfigError, match="rollout.chat_template='always' wraps as a user message"):
        encode_prompt(tok, string_ex, "always")


def test_data_set_rows_come_by_epochs_the_same_over_any_number_of_ranks(tmp_path):
    """Each row once per epoch, in an order drawn per epoch from the seed; data-parallel ranks split each step's
    rows of that stream; the same seed and step give the same rows (a resume draws what the run would have)."""
    from moe_gspo.train.data import step_examples

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+0=", "answer": str(i)}) + "\n" for i in range(10)))
    cfg = load_config(TINY, ["rollout.task=dataset", "rollout.task_args=", f"rollout.dataset_path={data}"])
    task = task_from_config(cfg.rollout)
    one = [ex.answer for s in range(5) for ex in step_examples(task, 3, s, 0, 4)]
    assert sorted(one[:10]) == sorted(one[10:20]) == [str(i) for i in range(10)]  # every row once per epoch
    assert one[:10] != one[10:20]  # each epoch in an order of its own
    two = [ex.answer for s in range(5) for r in range(2) for ex in step_examples(task, 3, s, r, 2, dp=2)]
    assert two == one
    assert [ex.answer for ex in step_examples(task_from_config(cfg.rollout), 3, 2, 0, 4)] == one[8:12]
    assert [ex.answer for ex in step_examples(task, 4, 0, 0, 10)] != one[:10]  # another seed, another order


def test_prompts_only_data_with_a_reward_that_needs_no_answer(tmp_path):
    """rollout.answer_field=null: rows with a prompt and nothing else train with a reward of one's own (TRL's
    length reward here); the built-in rewards, which compare with an answer, are refused at config load."""
    from moe_gspo.train.loop import train

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(8)))
    over = ["rollout.task=dataset", f"rollout.dataset_path={data}", "rollout.answer_field=null",
            "model.hidden_size=32", "train.steps=1", "train.cold_start_steps=0", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "train.minibatches=1", "logging.progress=false", "logging.tensorboard=false"]
    with pytest.raises(ConfigError, match="the built-in reward 'math' compares with one"):
        load_config(TINY, over)
    m = train(load_config(TINY, over + ["rollout.reward=examples/rewards/trl_length_reward.py:reward"]),
              run_dir=tmp_path / "run")
    assert m["reward/std"] > 0  # the lengths differ: the reward read the completions and nothing else


def test_several_weighted_rewards_train_and_log_each_function(tmp_path):
    """rollout.reward as a list with rollout.reward_weights (TRL's reward_funcs/reward_weights) trains; the step
    logs each function's mean and its count of Nones beside the weighted reward."""
    from moe_gspo.train.loop import train

    rm = tmp_path / "rm.py"
    rm.write_text("def short(prompts, completions, **kwargs):\n"
                  "    return [None if len(c) % 2 else -0.1 * len(c) for c in completions]\n")
    over = ["model.hidden_size=32", "train.steps=1", "train.cold_start_steps=0", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "train.minibatches=1", "logging.progress=false", "logging.tensorboard=false",
            f"rollout.reward=[exact, {rm}:short]", "rollout.reward_weights=[1.0, 0.5]"]
    m = train(load_config(TINY, over), run_dir=tmp_path / "run")
    assert {"reward/exact/mean", "reward/short/mean", "reward/short/none"} <= set(m)
    assert m["reward/exact/none"] == 0 and m["reward/skipped"] == 0  # exact scores every sample
    scored = 8 - m["reward/short/none"]  # 2 prompts x 4 responses, every one scored by exact
    short = m["reward/short/mean"] * scored / 8 if scored else 0.0
    assert m["reward/mean"] == pytest.approx(m["reward/exact/mean"] + 0.5 * short, abs=1e-6)
