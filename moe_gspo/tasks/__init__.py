"""Verifiable tasks: a character tokenizer, synthetic tasks with difficulty knobs, file datasets, SFT cold start.

    tok = CharTokenizer()
    task = get_task("addition", max_digits=3)
    ex = task.sample(random.Random(0))          # Example(prompt="37+5=", answer="42", ...)
    task.reward("42", ex)                       # 1.0
"""

from __future__ import annotations

from moe_gspo.tasks.base import Example, Task
from moe_gspo.tasks.datasets import DatasetError, DatasetTask, load_examples
from moe_gspo.tasks.synthetic import AdditionTask, ColumnAdditionTask, CountdownTask, MultiplicationTask
from moe_gspo.tasks.tokenizer import CharTokenizer

TASKS = {"addition": AdditionTask, "multiplication": MultiplicationTask, "countdown": CountdownTask,
         "column_addition": ColumnAdditionTask, "dataset": DatasetTask, "jsonl": DatasetTask,
         "parquet": DatasetTask}


def get_task(name: str, **knobs) -> Task:
    """Task registered under `name` built with its difficulty knobs; an unknown name lists the valid ones."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; valid: {sorted(TASKS)}")
    return TASKS[name](**knobs)


def parse_task_args(text: str) -> dict:
    """'max_digits=1,num_operands=3' -> {'max_digits': 1, 'num_operands': 3} (ints, floats or strings)."""
    from moe_gspo.config import ConfigError

    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ConfigError(f"rollout.task_args: {part!r} is not key=value")
        k, v = (x.strip() for x in part.split("=", 1))
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        out[k] = v
    return out


def task_from_config(rollout_cfg) -> Task:
    """The task a `RolloutConfig` names: a built-in task with its rollout.task_args knobs, or a data set with its
    columns; its reward is rollout.reward when set (a built-in name or a user's file.py:function)."""
    from moe_gspo.config import ConfigError, RolloutConfig
    from moe_gspo.rewards import load_rewards

    rc = rollout_cfg
    if rc.task in RolloutConfig.DATASET_TASKS:  # RolloutConfig has checked that dataset_path is set
        return get_task(rc.task, path=rc.dataset_path, prompt_field=rc.prompt_field, answer_field=rc.answer_field,
                        demonstration_field=rc.demonstration_field, reward=rc.reward or "math",
                        reward_weights=rc.reward_weights, eval_path=rc.eval_dataset_path)
    kwargs = parse_task_args(rc.task_args) if rc.task_args else {}
    try:
        task = get_task(rc.task, **kwargs)
    except TypeError as e:
        raise ConfigError(f"rollout.task_args={rc.task_args!r} for task {rc.task!r}: {e}") from None
    except KeyError as e:
        raise ConfigError(f"rollout.task: {e.args[0] if e.args else e}") from None
    if rc.reward is not None:
        task.reward_fn = load_rewards(rc.reward, rc.reward_weights)
    return task


__all__ = ["AdditionTask", "CharTokenizer", "ColumnAdditionTask", "CountdownTask", "DatasetError", "DatasetTask",
           "Example", "MultiplicationTask", "TASKS", "Task", "get_task", "load_examples", "parse_task_args",
           "task_from_config"]
