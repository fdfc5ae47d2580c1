"""GSM8K as verl's parquet rows, ready for `rollout.task=dataset`.

    python scripts/prepare_gsm8k.py --out data/gsm8k                       # from the Hub (needs `datasets`)
    python scripts/prepare_gsm8k.py --out data/gsm8k --train raw_train.jsonl --test raw_test.jsonl   # local files

Reads GSM8K's own rows ({"question": ..., "answer": "<worked solution>\\n#### <number>"}), from openai/gsm8k on the
Hugging Face Hub when no files are given, or from JSON-lines files of those rows. Writes OUT/train.parquet and
OUT/test.parquet, one row per problem, in verl's layout:

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + the instruction to answer after "####"}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "<the number after ####, commas removed>"}
    extra_info    {"split", "index", "question", "answer": the worked solution}

Train on it with rollout.answer_field=reward_model.ground_truth and rollout.reward=gsm8k (docs/guide/training.md);
rollout.demonstration_field=extra_info.answer gives the cold start the worked solutions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def final_answer(solution: str) -> str:
    """The number after the last '####' of a GSM8K solution, without thousands separators."""
    if "####" not in solution:
        raise ValueError(f"no '####' in the solution {solution[:60]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def verl_row(raw: dict, split: str, index: int) -> dict:
    """One GSM8K row in verl's layout."""
    question, solution = raw["question"], raw["answer"]
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": final_answer(solution)},
            "extra_info": {"split": split, "index": index, "question": question, "answer": solution}}


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"prepare_gsm8k: error: {path}:{n}: invalid JSON: {e.msg}") from None
    return rows


def from_hub() -> dict[str, list[dict]]:
    try:
        from datasets import load_dataset
    except ImportError:
        raise SystemExit("prepare_gsm8k: error: reading openai/gsm8k from the Hub needs `datasets` (pip install "
                         "datasets); or give --train and --test JSON-lines files of GSM8K's rows") from None
    ds = load_dataset("openai/gsm8k", "main")
    return {split: [dict(r) for r in ds[split]] for split in ("train", "test")}


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    p.add_argument("--train", type=Path, help="GSM8K train rows as JSON lines (default: openai/gsm8k on the Hub)")
    p.add_argument("--test", type=Path, help="GSM8K test rows as JSON lines")
    args = p.parse_args(argv)
    if (args.train is None) != (args.test is None):
        p.error("give both --train and --test, or neither (the Hub)")
    if args.train is not None:
        for f in (args.train, args.test):
            if not f.is_file():
                raise SystemExit(f"prepare_gsm8k: error: {f}: no such file")
        raw = {"train": read_jsonl(args.train), "test": read_jsonl(args.test)}
    else:
        raw = from_hub()
    out = Path(args.out)
    for split, rows in raw.items():
        converted = []
        for i, r in enumerate(rows):
            try:
                converted.append(verl_row(r, split, i))
            except (KeyError, ValueError) as e:
                raise SystemExit(f"prepare_gsm8k: error: {split} row {i + 1}: {type(e).__name__}: {e}") from None
        write_parquet(converted, out / f"{split}.parquet")
        print(f"{out / f'{split}.parquet'}: {len(converted)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
