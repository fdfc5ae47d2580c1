"""Prompts from a JSONL or parquet file with a declared schema (which field is the prompt, which the answer).

    task = DatasetTask("data/math.jsonl", prompt_field="problem", answer_field="answer", reward="math")
    rows = load_examples("data/math.jsonl", prompt_field="problem", answer_field="answer")

Each row must be an object whose prompt field is a non-empty string and whose answer field is a string or a
number; optional `demonstration_field` gives the cold-start completion. Any other shape raises DatasetError
naming the file and the line (JSONL, 1-based) or row (parquet, 1-based). Blank JSONL lines are skipped.
Parquet needs `pyarrow` (imported only when a parquet file is read).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from moe_gspo.config import UserError
from moe_gspo.tasks.base import Example, Task


class DatasetError(UserError, ValueError):
    """A dataset file is missing or a row does not match the declared schema (message names file and line)."""


def _row_to_example(row, where: str, prompt_field: str, answer_field: str, demo_field: str | None) -> Example:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    schema = f"(declared schema: prompt_field={prompt_field!r}, answer_field={answer_field!r})"
    for name in (prompt_field, answer_field):
        if name not in row or row[name] is None:
            raise DatasetError(f"{where}: missing field {name!r} {schema}; row has {sorted(row)}")
    prompt, answer = row[prompt_field], row[answer_field]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{where}: field {prompt_field!r} must be a non-empty string, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: field {answer_field!r} must be a string or a number, got "
                           f"{type(answer).__name__}")
    demo = None
    if demo_field is not None:
        demo = row.get(demo_field)
        if demo is not None and not isinstance(demo, str):
            raise DatasetError(f"{where}: field {demo_field!r} must be a string, got {type(demo).__name__}")
    meta = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
    return Example(prompt, str(answer), meta, demo)


def _read_jsonl(path: Path):
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None


def _read_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading parquet needs `pyarrow` (pip install pyarrow), or use JSONL") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a broken file
        raise DatasetError(f"{path}: cannot read parquet: {e}") from None
    for i, row in enumerate(rows, start=1):
        yield f"{path}: row {i}", row


def load_examples(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                  demonstration_field: str | None = None, fmt: str | None = None) -> list[Example]:
    """Read every row of a .jsonl/.json-lines or .parquet file into Examples; fmt overrides the suffix."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    fmt = fmt or ("parquet" if path.suffix == ".parquet" else "jsonl")
    if fmt not in ("jsonl", "parquet"):
        raise DatasetError(f"{path}: format {fmt!r} is not one of ['jsonl', 'parquet']")
    reader = _read_parquet if fmt == "parquet" else _read_jsonl
    out = [_row_to_example(row, where, prompt_field, answer_field, demonstration_field) for where, row in reader(path)]
    if not out:
        raise DatasetError(f"{path}: no rows")
    return out


class DatasetTask(Task):
    """A task whose prompts come from a file; reward by name ('math' by default, or 'exact')."""

    name = "dataset"

    def __init__(self, path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                 demonstration_field: str | None = None, reward: str = "math", fmt: str | None = None,
                 heldout_fraction: float = 0.0):
        from moe_gspo.rewards import get_reward_fn

        self.rows = load_examples(path, prompt_field, answer_field, demonstration_field, fmt)
        self.reward_fn = get_reward_fn(reward)
        self.heldout_fraction = heldout_fraction

    def _draw(self, rng: random.Random) -> Example:
        return self.rows[rng.randrange(len(self.rows))]
