"""The errors a user can cause, and the checks the config dataclasses' __post_init__ and the loaders share."""

from __future__ import annotations

import math


class UserError(Exception):
    """Something the user gave is wrong: a config value, a data row, a path, a size, a world size. The message
    names the field, file, line or rank at fault, and the CLI prints it as one line (exit 2, no traceback). Any
    other exception is a bug in this package and keeps its traceback.

    `detail` (optional) is printed before that line: the frames of a user's own code that failed (a reward
    function), never this package's."""

    def __init__(self, message: str = "", detail: str | None = None):
        super().__init__(message)
        self.detail = detail


def error_line(command: str, message: str, rank: int | None = None) -> str:
    """The line an error a user can cause ends in: `moe-gspo <command>: error: [rank N: ]<message>`."""
    return f"moe-gspo {command}: error: {'' if rank is None else f'rank {rank}: '}{message}"


def exception_chain(e: BaseException) -> list[BaseException]:
    """`e`, the exceptions it was raised from or while handling, and the per-rank failures a torch DCP
    CheckpointException carries (its `failures`: rank -> (exception, traceback)), with theirs."""
    out, todo = [], [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        failures = getattr(x, "failures", None)
        failures = failures if isinstance(failures, dict) else {}
        todo += [x.__cause__, x.__context__,
                 *(f[0] for f in failures.values() if isinstance(f, tuple) and isinstance(f[0], BaseException))]
    return out


class ConfigError(UserError, ValueError):
    """A configuration value is unknown, of the wrong type or out of range (the message names the field)."""


def _section(obj) -> str:
    return getattr(type(obj), "SECTION", type(obj).__name__)


def positive(obj, *names):
    """Raise ConfigError naming section.field for the first of `names` that is not > 0."""
    for n in names:
        v = getattr(obj, n)
        if v <= 0:
            raise ConfigError(f"{_section(obj)}.{n}={v!r} must be > 0")


def choice(obj, name, choices):
    """Raise ConfigError naming section.field when its value is not one of `choices`."""
    v = getattr(obj, name)
    if v not in choices:
        raise ConfigError(f"{_section(obj)}.{name}={v!r} is not one of {list(choices)}")


def names_a_module(file: str) -> bool:
    """Whether the part of a reward spec before ':' reads as a module name (`trl.rewards`) rather than a file: no .py
    suffix, no such file, and dotted identifiers."""
    from pathlib import Path

    return not file.endswith(".py") and not Path(file).exists() and all(p.isidentifier() for p in file.split("."))


def check_reward_spec(reward: str, where: str) -> None:
    """A reward of one's own ('file.py:function' or 'package.module:function') names a file that exists or an
    installed module, checked without importing it; a built-in name is checked when the reward is loaded."""
    import importlib.util
    from pathlib import Path

    if ":" not in reward or reward.startswith(":"):
        return
    file = reward.rsplit(":", 1)[0]
    module = names_a_module(file) and importlib.util.find_spec(file.split(".")[0]) is not None
    if not file.endswith(".py") and not module:
        raise ConfigError(f"{where}={reward!r}: a reward of your own is 'path/to/file.py:function' "
                          "(or 'package.module:function' of an installed module)")
    if not module and not Path(file).is_file():
        raise ConfigError(f"{where}={reward!r}: no such file {file} (relative to {Path.cwd()})")


def check_rollout_data(rc) -> None:
    """A RolloutConfig's data fields that contradict its task, and a reward file that cannot exist, fail at config
    load (the reward's code itself is imported when the task is built)."""
    from pathlib import Path

    if rc.task in rc.DATASET_TASKS:
        if not rc.dataset_path:
            raise ConfigError(f"rollout.task={rc.task!r} needs rollout.dataset_path")
        if rc.task_args:
            raise ConfigError(f"rollout.task_args={rc.task_args!r} holds a built-in task's knobs; a data set's "
                              "columns are rollout.prompt_field, rollout.answer_field and "
                              "rollout.demonstration_field")
    else:
        stray = [f"rollout.{k}" for k, default in (("dataset_path", None), ("prompt_field", "prompt"),
                                                   ("answer_field", "answer"), ("demonstration_field", None),
                                                   ("eval_dataset_path", None)) if getattr(rc, k) != default]
        if stray:
            raise ConfigError(f"{', '.join(stray)} read a data set, but rollout.task={rc.task!r} is a built-in "
                              "task; set rollout.task=dataset")
    rewards = [rc.reward] if isinstance(rc.reward, str) else list(rc.reward or [])
    if isinstance(rc.reward, list) and not rewards:
        raise ConfigError("rollout.reward=[] names no reward function; leave it unset for the task's own")
    if rc.reward_weights is not None:
        if len(rc.reward_weights) != len(rewards):
            raise ConfigError(f"rollout.reward_weights={rc.reward_weights} has {len(rc.reward_weights)} "
                              f"weights for {len(rewards)} reward functions in rollout.reward")
        if not all(math.isfinite(w) for w in rc.reward_weights):
            raise ConfigError(f"rollout.reward_weights={rc.reward_weights} must be finite numbers")
    builtin = [r for r in rewards or [None] if r is None or ":" not in r]
    if rc.answer_field is None and rc.task in rc.DATASET_TASKS and builtin:
        raise ConfigError(f"rollout.answer_field=null (prompts only) needs rewards of your own that read no "
                          f"answer; the built-in reward {builtin[0] or 'math'!r} compares with one")
    for name in ("prompt_field", "answer_field"):
        if name == "answer_field" and rc.answer_field is None:
            continue
        if not getattr(rc, name) or any(not p for p in getattr(rc, name).split(".")):
            raise ConfigError(f"rollout.{name}={getattr(rc, name)!r} must name a column (a.b for a field "
                              "inside one)")
    for i, reward in enumerate(rewards):
        check_reward_spec(reward, "rollout.reward" + (f"[{i}]" if isinstance(rc.reward, list) else ""))
