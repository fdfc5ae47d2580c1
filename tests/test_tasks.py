"""Tasks: tokenizer, synthetic tasks and their knobs, dataset files with bad rows, the SFT cold start."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch

from moe_gspo.tasks import (AdditionTask, CharTokenizer, ColumnAdditionTask, CountdownTask, DatasetError, DatasetTask,
                            Example, MultiplicationTask, get_task, load_examples)

TOK = CharTokenizer()


def test_tokenizer_roundtrip_and_ids_fit_vocab():
    text = "Compute 12+34=? {x}\n ~!"
    ids = TOK.encode(text, bos=True, eos=True)
    assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
    assert max(ids) < TOK.vocab_size == 128 and TOK.num_tokens <= 128
    assert TOK.decode(ids) == text
    assert TOK.decode([TOK.pad_id, 120, 127]) == ""
    assert TOK.encode("é") == [TOK.unk_id]
    with pytest.raises(ValueError, match="position 1"):
        TOK.encode("aé", strict=True)
    # every printable ASCII character has its own id
    chars = "".join(chr(c) for c in range(32, 127)) + "\n"
    assert len(set(TOK.encode(chars))) == len(chars)


@pytest.mark.parametrize("task", [AdditionTask(1, 3, num_operands=3), MultiplicationTask(1, 2),
                                  CountdownTask(num_numbers=4, max_number=12, max_target=200),
                                  ColumnAdditionTask(4, 12)])
def test_tasks_are_seeded_split_and_solvable(task):
    a, b = task.examples(30, seed=3), task.examples(30, seed=3)
    assert a == b and a != task.examples(30, seed=4)
    train = {e.prompt for e in task.examples(200, seed=0)}
    test = {e.prompt for e in task.examples(50, seed=0, split="test")}
    assert not train & test
    for ex in a:
        assert task.reward(ex.completion, ex) == 1.0  # demonstrations are correct
        assert task.reward(ex.completion + "1", ex) == 0.0
        assert max(TOK.encode(ex.prompt + ex.completion, strict=True)) < TOK.vocab_size


def test_difficulty_knobs():
    easy = AdditionTask(1, 1).examples(50, seed=0)
    hard = AdditionTask(4, 4, num_operands=3).examples(50, seed=0)
    assert all(len(op) == 1 for e in easy for op in e.prompt[:-1].split("+"))
    assert all(len(e.prompt[:-1].split("+")) == 3 and all(len(op) == 4 for op in e.prompt[:-1].split("+"))
               for e in hard)
    cd = CountdownTask(num_numbers=5, max_number=20).examples(20, seed=0)
    assert all(len(e.meta["numbers"]) == 5 and max(e.meta["numbers"]) <= 20 for e in cd)
    assert all(e.prompt.endswith(f"->{e.meta['target']}:") for e in cd)
    with pytest.raises(ValueError, match="min_digits"):
        AdditionTask(3, 2)
    with pytest.raises(KeyError, match="valid"):
        get_task("sudoku")


COLUMN = Example("4738+2951=", "8+1+0=9,3+5+0=8,7+9+0=16,4+2+1=7;7689")


@pytest.mark.parametrize("response,reward", [
    ("8+1+0=9,3+5+0=8,7+9+0=16,4+2+1=7;7689", 1.0),
    ("  8+1+0=9,3+5+0=8,7+9+0=16,4+2+1=7;7689\n", 1.0),   # surrounding whitespace is not part of the answer
    ("8+1+0=9,3+5+0=8,7+9+0=16,4+2+1=7;7688", 0.0),        # wrong sum
    ("8+1+0=9,3+5+0=8,7+9+0=15,4+2+1=7;7689", 0.0),        # right sum after a wrong column
    ("8+1+0=9,3+5+0=8,7+9+0=16,4+2+0=6;7689", 0.0),        # carry dropped
    ("7689", 0.0),                                          # the sum without the work
    (";7689", 0.0),
    ("8+1+0=9,3+5+0=8,7+9+0=16,4+2+1=7", 0.0),             # work without the sum
    ("8+1+0=9,3+5+0=8,7+9+0=16,4+2+1=7;7689;7689", 0.0),   # trailing text
    ("", 0.0), ("8+1+0=9 3+5+0=8 7+9+0=16 4+2+1=7 7689", 0.0),
])
def test_column_addition_reward_table(response, reward):
    task = get_task("column_addition")
    assert ColumnAdditionTask.solution(4738, 2951) == COLUMN.answer
    assert task.reward(response, COLUMN) == reward


def test_column_addition_checks_scale_the_length_at_the_same_problem():
    """checks = c: the same prompts and sums (the same seed draws the same problems), the solution then c checks of
    b + a, so the length is (c + 1) solutions + c separators; only the whole text scores 1."""
    plain = ColumnAdditionTask(2, 2).examples(100, seed=5)
    for c in (0, 2, 7):
        task = ColumnAdditionTask(2, 2, checks=c)
        long = task.examples(100, seed=5)
        assert [e.prompt for e in long] == [e.prompt for e in plain]
        for e, p in zip(long, plain):
            a, b = e.meta["operands"]
            parts = e.answer.split("|")
            assert parts == [p.answer] + [ColumnAdditionTask.solution(b, a)] * c
            assert all(x.endswith(f";{a + b}") for x in parts)
            assert len(e.answer) == len(p.answer) * (c + 1) + c  # b + a writes as many characters as a + b
            assert task.reward(e.answer, e) == 1.0 and task.reward(p.answer, e) == (1.0 if c == 0 else 0.0)
    lengths = {c: [len(e.answer) for e in ColumnAdditionTask(2, 2, checks=c).examples(200)] for c in (0, 2, 7)}
    assert 18 <= min(lengths[0]) and max(lengths[0]) <= 21 and 151 <= min(lengths[7]) and max(lengths[7]) <= 175
    for bad in (-1, 16, 1.5):
        with pytest.raises(ValueError, match="checks"):
            ColumnAdditionTask(2, 2, checks=bad)


def test_column_addition_lengths_follow_the_digits_knob():
    """Solutions of d-digit operands are 9d..10d+1 characters (one token each), 9..121 over the knob's range."""
    lengths = {}
    for d in range(ColumnAdditionTask.MIN_DIGITS, ColumnAdditionTask.MAX_DIGITS + 1):
        for ex in ColumnAdditionTask(d, d).examples(200, seed=d):
            a, b = ex.meta["operands"]
            assert ex.prompt == f"{a}+{b}=" and len(str(a)) == len(str(b)) == d
            assert ex.answer.endswith(f";{a + b}") and ex.answer.count(",") == d - 1
            n = len(TOK.encode(ex.completion, strict=True))
            assert 9 * d <= n <= 10 * d + 1 <= 121
            lengths.setdefault(d, []).append(n)
    assert min(lengths[4]) < 41 and max(lengths[12]) > 110  # the knob spans the range
    mixed = {ex.meta["digits"] for ex in ColumnAdditionTask(4, 6).examples(100)}
    assert mixed == {4, 5, 6}
    for bad in ((0, 5), (4, 13), (6, 5)):
        with pytest.raises(ValueError, match="digits"):
            ColumnAdditionTask(*bad)
    with pytest.raises(Exception, match="max_digits=13"):
        from moe_gspo.config import load_config
        from moe_gspo.tasks import task_from_config

        task_from_config(load_config(None, ["rollout.task=column_addition",
                                            "rollout.task_args=max_digits=13"]).rollout)


def test_column_addition_cold_start_learns_the_demonstrations():
    """A short cold start of a tiny policy (60 steps, about 5 s on one core) more than halves the held-out
    demonstration loss of the long task (mostly its format at this length of training; configs/compare_seeds_cpu.yaml
    trains longer, to held-out accuracy)."""
    import moe_gspo
    from moe_gspo.config import load_config
    from moe_gspo.tasks.sft import demonstration_batch, sft_loss
    from moe_gspo.train.optim import wrap_ddp
    from moe_gspo.train.step import cold_start

    cfg = load_config(None, ["model.vocab_size=128", "model.hidden_size=64", "model.num_hidden_layers=2",
                             "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16",
                             "model.num_experts=4", "model.moe_intermediate_size=128",
                             "model.max_position_embeddings=64", "train.cold_start_steps=60",
                             "train.cold_start_lr=0.003", "train.cold_start_batch_size=16"])
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    task = ColumnAdditionTask(4, 4)
    heldout = demonstration_batch(task.examples(32, seed=5, split="test"), TOK)
    with torch.no_grad():
        before = float(sft_loss(policy, *heldout))
    losses = cold_start(policy, wrap_ddp(policy, False), cfg.train, task, TOK, dp=1, dp_rank=0)
    with torch.no_grad():
        after = float(sft_loss(policy, *heldout))
    assert losses[-1] < losses[0] / 2
    assert after < before / 2, (before, after)


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_dataset_with_declared_schema(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"problem": "1+1?", "sol": 2, "src": "x"}), "",
                                            json.dumps({"problem": "half of 1?", "sol": "\\frac{1}{2}"})])
    rows = load_examples(p, prompt_field="problem", answer_field="sol")
    assert [r.prompt for r in rows] == ["1+1?", "half of 1?"] and rows[0].answer == "2"
    assert rows[0].meta == {"sol": 2, "src": "x"}  # every column but the prompt reaches the reward
    task = get_task("jsonl", path=p, prompt_field="problem", answer_field="sol")
    ex = task.sample(random.Random(0))
    assert task.reward("\\boxed{" + ex.answer + "}", ex) == 1.0


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a", "answer": 1', "invalid JSON"),
    ('{"prompt": "a"}', "missing field 'answer'"),
    ('{"prompt": "", "answer": "1"}', "non-empty string"),
    ('{"prompt": "a", "answer": [1, 2]}', "string or a number"),
    ('[1, 2]', "expected an object"),
])
def test_malformed_row_names_file_and_line(tmp_path, line, message):
    good = json.dumps({"prompt": "q", "answer": "1"})
    p = _write_jsonl(tmp_path / "bad.jsonl", [good, good, line, good])
    with pytest.raises(DatasetError, match=message) as e:
        load_examples(p)
    assert f"{p}:3:" in str(e.value)


def test_missing_or_empty_dataset(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_examples(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no rows"):
        DatasetTask(tmp_path / "empty.jsonl")


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="parquet needs pyarrow")
def test_parquet_dataset_and_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "ok.parquet")
    assert [r.answer for r in load_examples(tmp_path / "ok.parquet")] == ["1", "2"]
    pq.write_table(pa.table({"prompt": ["a", None], "answer": ["1", "2"]}), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match="row 2"):
        load_examples(tmp_path / "bad.parquet")


def test_cold_start_raises_heldout_accuracy():
    """The trainer's cold start (megatron's optimizer on the megatron policy) learns the task's demonstrations."""
    import moe_gspo
    from moe_gspo.config import load_config
    from moe_gspo.tasks.sft import demonstration_batch, greedy_accuracy
    from moe_gspo.train.optim import wrap_ddp
    from moe_gspo.train.step import cold_start

    cfg = load_config(None, ["model.vocab_size=128", "model.hidden_size=64", "model.num_hidden_layers=2",
                             "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16",
                             "model.num_experts=4", "model.moe_intermediate_size=128",
                             "model.max_position_embeddings=64", "train.cold_start_steps=150",
                             "train.cold_start_lr=0.003", "train.cold_start_batch_size=32"])
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    task = AdditionTask(1, 1, heldout_fraction=0.2)
    ids, mask = demonstration_batch(task.examples(2), TOK)
    assert TOK.decode(ids[0][mask[0]].tolist()) == task.examples(2)[0].answer  # loss only on answer + eos
    before = greedy_accuracy(policy, task, n=48)
    losses = cold_start(policy, wrap_ddp(policy, False), cfg.train, task, TOK, dp=1, dp_rank=0)
    after = greedy_accuracy(policy, task, n=48)
    assert losses[-1] < losses[0] / 4
    assert after > before and after >= 0.2, (before, after)
