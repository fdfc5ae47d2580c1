"""Prompts from a data set file with a declared schema: which column is the prompt, which the gold answer.

    task = DatasetTask("data/gsm8k/train.parquet", answer_field="reward_model.ground_truth", reward="gsm8k")
    rows = load_examples("data/math.jsonl", prompt_field="problem", answer_field="answer")

Files: .jsonl (JSON lines), .json (an array of rows, or JSON lines as `datasets.Dataset.to_json` writes them),
.parquet, or a folder of .parquet shards (read in name order). Each row is an object whose prompt column is a
non-empty string or a list of chat messages ({"role": str, "content": str}), and whose answer (a column, or a
dotted path into one: verl's `reward_model.ground_truth`) is a string or a number. The optional demonstration
column gives the cold start's completion: a string, or for episodes with tools a list of assistant and tool
messages (the assistant's call, the tool's answer, the assistant's reply). Every other column reaches the reward in
`Example.meta` (verl's `data_source` and `extra_info`, TRL's extra columns). Any other shape raises DatasetError
naming the file and the line (JSON lines, 1-based) or row (parquet and JSON arrays, 1-based). Parquet needs
`pyarrow`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from moe_gspo.config import UserError
from moe_gspo.tasks.base import Example, Task, in_heldout

FORMATS = ("jsonl", "json", "parquet")


class DatasetError(UserError, ValueError):
    """A dataset file is missing or a row does not match the declared schema (message names file and line)."""


def _lookup(row: dict, path: str):
    """row['a']['b'] for path 'a.b'; None where any part is missing."""
    node = row
    for part in path.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return None
        node = node[part]
    return node


def _messages(prompt, where: str, field: str) -> list[dict] | None:
    """The prompt as chat messages when it is a list of {role, content} strings; None for a string prompt."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DatasetError(f"{where}: field {field!r} must be a non-empty string or a list of chat messages, got "
                           f"{type(prompt).__name__}")
    out = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: field {field!r} message {j} must be {{'role': str, 'content': str}}, got "
                               f"{str(m)[:80]}")
        out.append({k: v for k, v in m.items() if v is not None})  # parquet fills absent struct fields with None
    return out


def _demo_messages(demo, where: str, field: str) -> list[dict]:
    """A multi-message demonstration: assistant turns with the tool messages between them (an assistant message,
    then one or more tool messages and an assistant message, any number of times); DatasetError otherwise."""
    if not isinstance(demo, (list, tuple)) or not demo:
        raise DatasetError(f"{where}: field {field!r} must be a string or a list of chat messages, got "
                           f"{type(demo).__name__}")
    messages = _messages(demo, where, field)
    roles = [m["role"] for m in messages]
    for j, role in enumerate(roles):
        if role not in ("assistant", "tool"):
            raise DatasetError(f"{where}: field {field!r} message {j} has role {role!r}; a demonstration holds "
                               "assistant and tool messages only (the prompt holds the rest)")
        if role == "assistant" and j and roles[j - 1] == "assistant":
            raise DatasetError(f"{where}: field {field!r} messages {j - 1} and {j} are both assistant turns; "
                               "a tool message must answer a turn before the next one")
    if roles[0] != "assistant" or roles[-1] != "assistant":
        which = 0 if roles[0] != "assistant" else len(roles) - 1
        raise DatasetError(f"{where}: field {field!r} message {which} is a {roles[which]} message; a "
                           "demonstration starts and ends with an assistant turn")
    return messages


def _row_to_example(row, where: str, prompt_field: str, answer_field: str | None, demo_field: str | None
                    ) -> Example:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
    schema = f"(declared schema: rollout.prompt_field={prompt_field!r}, rollout.answer_field={answer_field!r})"
    for name in (prompt_field, answer_field):
        if name is not None and _lookup(row, name) is None:
            raise DatasetError(f"{where}: missing field {name!r} {schema}; row has {sorted(row)}")
    prompt = _lookup(row, prompt_field)
    answer = "" if answer_field is None else _lookup(row, answer_field)  # prompts only: no gold answer
    messages = _messages(prompt, where, prompt_field)
    if messages is None and not prompt.strip():
        raise DatasetError(f"{where}: field {prompt_field!r} must be a non-empty string or a list of chat messages; "
                           "it is empty")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: field {answer_field!r} must be a string or a number, got "
                           f"{type(answer).__name__}")
    demo = None
    if demo_field is not None:
        demo = _lookup(row, demo_field)
        if demo is not None and not isinstance(demo, str):
            demo = _demo_messages(demo, where, demo_field)
    text = prompt if messages is None else "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    meta = {k: v for k, v in row.items() if k != prompt_field}
    return Example(text, str(answer), meta, demo, messages)


def _read_json_lines(path: Path, lines):
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None


def _read_jsonl(path: Path):
    with path.open(encoding="utf-8") as f:
        yield from _read_json_lines(path, f)


def _read_json(path: Path):
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):  # JSON lines under a .json name
        yield from _read_json_lines(path, text.splitlines())
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    for i, row in enumerate(rows, start=1):
        yield f"{path}: row {i}", row


def _read_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading parquet needs `pyarrow` (pip install pyarrow), or use JSONL") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a broken file
        raise DatasetError(f"{path}: cannot read parquet: {' '.join(str(e).split())}") from None
    for i, row in enumerate(rows, start=1):
        yield f"{path}: row {i}", row


def _files(path: Path, fmt: str | None) -> list[tuple[Path, str]]:
    """(file, format) pairs of a file or of a folder of parquet shards."""
    if path.is_dir():
        shards = sorted(path.glob("*.parquet"))
        if not shards:
            raise DatasetError(f"{path}: a folder data set must hold .parquet shards; found none")
        return [(p, "parquet") for p in shards]
    if not path.is_file():
        where = "" if path.is_absolute() else f" (a relative path: looked for {Path.cwd() / path}, from the working " \
                                              "directory)"
        raise DatasetError(f"dataset file not found: {path}{where}")
    if fmt in (None, "dataset"):
        fmt = {".parquet": "parquet", ".json": "json"}.get(path.suffix, "jsonl")
    if fmt not in FORMATS:
        raise DatasetError(f"{path}: format {fmt!r} is not one of {list(FORMATS)}")
    return [(path, fmt)]


def load_examples(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                  demonstration_field: str | None = None, fmt: str | None = None,
                  wheres: list[str] | None = None) -> list[Example]:
    """Every row of a data set file (or folder of parquet shards) as Examples; fmt overrides the suffix. `wheres`,
    when given, receives each row's place (file and line or row), in the same order."""
    path = Path(path)
    readers = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet}
    out = []
    for f, kind in _files(path, fmt):
        for where, row in readers[kind](f):
            out.append(_row_to_example(row, where, prompt_field, answer_field, demonstration_field))
            if wheres is not None:
                wheres.append(where)
    if not out:
        raise DatasetError(f"{path}: no rows")
    return out


class DatasetTask(Task):
    """A task whose prompts come from a file; its reward a built-in name ('math' by default), a user's
    function, or a weighted list of them (moe_gspo.rewards.load_rewards). With an eval file, the "test" split
    draws from it."""

    name = "dataset"

    def __init__(self, path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
                 demonstration_field: str | None = None, reward: str | list[str] = "math", fmt: str | None = None,
                 heldout_fraction: float = 0.0, eval_path: str | Path | None = None,
                 reward_weights: list[float] | None = None):
        from moe_gspo.rewards import load_rewards

        self.wheres: list[str] = []  # each row's file and line (or row), for errors found after loading
        self.eval_wheres: list[str] = []
        self.rows = load_examples(path, prompt_field, answer_field, demonstration_field, fmt, self.wheres)
        self.eval_rows = (load_examples(eval_path, prompt_field, answer_field, demonstration_field,
                                        wheres=self.eval_wheres) if eval_path is not None else [])
        self.reward_fn = load_rewards(reward, reward_weights)
        self.heldout_fraction = heldout_fraction
        self.has_demonstrations = any(ex.demonstration is not None for ex in self.rows)

    def _draw(self, rng: random.Random) -> Example:
        return self.rows[rng.randrange(len(self.rows))]

    def epoch_examples(self, start: int, n: int, seed: int) -> list[Example]:
        """The training rows at positions start .. start+n-1 of the seed's stream of epochs: each epoch is the
        train rows in an order of its own (drawn from the seed and the epoch), so every row is seen once per epoch,
        as a shuffling data loader gives them. Rows held out by heldout_fraction are not in it."""
        pool = self._pool()
        out = []
        for g in range(start, start + n):
            epoch, i = divmod(g, len(pool))
            out.append(pool[self._order(seed, epoch)[i]])
        return out

    def _pool(self) -> list[Example]:
        if getattr(self, "_pool_rows", None) is None or self._pool_of is not self.rows:
            rows = self.rows if not self.heldout_fraction else [
                ex for ex in self.rows if not in_heldout(ex.prompt, self.heldout_fraction)]
            if not rows:
                raise DatasetError(f"every training row is held out (heldout_fraction={self.heldout_fraction})")
            self._pool_rows, self._pool_of, self._orders = rows, self.rows, {}
        return self._pool_rows

    def _order(self, seed: int, epoch: int) -> list[int]:
        key = (seed, epoch)
        if key not in self._orders:
            if len(self._orders) > 4:  # steps walk forward: the newest epochs are the ones asked for
                self._orders.pop(next(iter(self._orders)))
            order = list(range(len(self._pool_rows)))
            random.Random(f"moe-gspo epoch {seed} {epoch}").shuffle(order)
            self._orders[key] = order
        return self._orders[key]

    def sample(self, rng: random.Random, split: str = "train") -> Example:
        if split == "test" and self.eval_rows:
            return self.eval_rows[rng.randrange(len(self.eval_rows))]
        return super().sample(rng, split)

    def eval_examples(self, n: int) -> list[Example]:
        """The first n rows of the eval file (0: all of them)."""
        if not self.eval_rows:
            raise DatasetError("this data set has no held-out prompts: set rollout.eval_dataset_path")
        return self.eval_rows[:n] if n else list(self.eval_rows)
