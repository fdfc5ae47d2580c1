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
         "column_addition": ColumnAdditionTask, "jsonl": DatasetTask, "parquet": DatasetTask}


def get_task(name: str, **knobs) -> Task:
    """Task registered under `name` built with its difficulty knobs; an unknown name lists the valid ones."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; valid: {sorted(TASKS)}")
    if name in ("jsonl", "parquet"):
        knobs.setdefault("fmt", name)
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
    """The task a `RolloutConfig` names: a built-in task with its rollout.task_args knobs, or a dataset file."""
    from moe_gspo.config import ConfigError

    if rollout_cfg.task in ("jsonl", "parquet"):
        if not rollout_cfg.dataset_path:
            raise ConfigError(f"rollout.task={rollout_cfg.task!r} needs rollout.dataset_path")
        return get_task(rollout_cfg.task, path=rollout_cfg.dataset_path)
    kwargs = parse_task_args(rollout_cfg.task_args) if rollout_cfg.task_args else {}
    try:
        return get_task(rollout_cfg.task, **kwargs)
    except TypeError as e:
        raise ConfigError(f"rollout.task_args={rollout_cfg.task_args!r} for task {rollout_cfg.task!r}: {e}") from None
    except KeyError as e:
        raise ConfigError(f"rollout.task: {e.args[0] if e.args else e}") from None


__all__ = ["AdditionTask", "CharTokenizer", "ColumnAdditionTask", "CountdownTask", "DatasetError", "DatasetTask",
           "Example", "MultiplicationTask", "TASKS", "Task", "get_task", "load_examples", "parse_task_args",
           "task_from_config"]
