"""Verifiable tasks: a character tokenizer, synthetic tasks with difficulty knobs, file datasets, SFT cold start.

    tok = CharTokenizer()
    task = get_task("addition", max_digits=3)
    ex = task.sample(random.Random(0))          # Example(prompt="37+5=", answer="42", ...)
    task.reward("42", ex)                       # 1.0
"""

from __future__ import annotations

from moe_gspo.tasks.base import Example, Task
from moe_gspo.tasks.datasets import DatasetError, DatasetTask, load_examples
from moe_gspo.tasks.synthetic import AdditionTask, CountdownTask, MultiplicationTask
from moe_gspo.tasks.tokenizer import CharTokenizer

TASKS = {"addition": AdditionTask, "multiplication": MultiplicationTask, "countdown": CountdownTask,
         "jsonl": DatasetTask, "parquet": DatasetTask}


def get_task(name: str, **knobs) -> Task:
    """Task registered under `name` built with its difficulty knobs; an unknown name lists the valid ones."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; valid: {sorted(TASKS)}")
    if name in ("jsonl", "parquet"):
        knobs.setdefault("fmt", name)
    return TASKS[name](**knobs)


def task_from_config(rollout_cfg) -> Task:
    """Task for a `RolloutConfig` (built-in name with default knobs, or a dataset file)."""
    if rollout_cfg.task in ("jsonl", "parquet"):
        if not rollout_cfg.dataset_path:
            raise ValueError(f"rollout.task={rollout_cfg.task!r} needs rollout.dataset_path")
        return get_task(rollout_cfg.task, path=rollout_cfg.dataset_path)
    return get_task(rollout_cfg.task)


__all__ = ["AdditionTask", "CharTokenizer", "CountdownTask", "DatasetError", "DatasetTask", "Example",
           "MultiplicationTask", "TASKS", "Task", "get_task", "load_examples", "task_from_config"]
