"""Every code name the docs cite exists: backticked dotted names and file paths in docs/*.md and docs/guide/*.md.

    .venv/bin/python tests/test_docs_names.py        # lists what does not resolve, file:line

What is checked, from the source (parsed, not imported, so no engine is loaded):
- config fields `section.field` (model, parallel, algorithm, rollout, train, logging, compare), against the
  config dataclasses; a dict field (loss_options) ends the check;
- `moe_gspo.pkg.module.Name.attr`, and `module.Name` by a module's own file name (`sharded_io.SafeReader`);
- `Class.attr` for a class defined in moe_gspo: a method, class attribute, dataclass field or `self.attr` of it or
  of a base defined in moe_gspo (a class with a base from elsewhere, e.g. nn.Module, is given the benefit of the
  doubt for names it does not define); a list that follows, as in (`StepContext.update_batches`,
  `logprob_batches`), names attributes of the same class;
- paths with a slash (`moe_gspo/train/step.py`, `configs/qwen3_30b_a3b_ep8.yaml`) and bare `*.py` file names.
Names rooted elsewhere (torch, megatron, vllm, a local variable) are not checked.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "moe_gspo"
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
LIST_TAIL = re.compile(r"\s*,\s*`([A-Za-z_]\w*)`")
# names rooted at a config section that are not config fields, each with what it is
NOT_FIELDS = {
    "model.generate": "a transformers or vLLM model's method",
    "model.load_weights": "vLLM's model's weight loader",
    "compare.variants": "the variants beside the compare section, read by moe_gspo.experiments.compare",
    "compare.x": "a placeholder for any compare field (compare.x=v)",
}


def _modules() -> dict[str, ast.Module]:
    """'moe_gspo.train.step' -> its parsed source ('moe_gspo.losses' for losses/__init__.py)."""
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(f.read_text())
    return out


def _top_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _classes(mods: dict[str, ast.Module]) -> dict[str, list[tuple[set[str], list[str]]]]:
    """class name -> [(its own attribute names, its base names)] over every moe_gspo module."""
    out: dict[str, list] = {}
    for tree in mods.values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            attrs = _top_names(ast.Module(body=node.body, type_ignores=[]))
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in (
                        "self", "cls") and isinstance(sub.ctx, ast.Store):
                    attrs.add(sub.attr)
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "?") for b in node.bases]
            out.setdefault(node.name, []).append((attrs, bases))
    return out


class Resolver:
    def __init__(self):
        sys.path.insert(0, str(ROOT))
        from moe_gspo import config

        self.mods = _modules()
        self.classes = _classes(self.mods)
        self.by_file = {}
        for name in self.mods:
            self.by_file.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        self.sections = {c.SECTION: c for c in vars(config).values()
                         if isinstance(c, type) and dataclasses.is_dataclass(c) and hasattr(c, "SECTION")}

    def has_attr(self, cls: str, attr: str, seen=()) -> bool:
        for attrs, bases in self.classes.get(cls, []):
            if attr in attrs:
                return True
            for b in bases:
                if b not in self.classes and b not in ("object", "Exception", "ValueError", "Protocol"):
                    return True  # a base from elsewhere may define it
                if b not in seen and self.has_attr(b, attr, (*seen, cls)):
                    return True
        return False

    def in_module(self, mod: str, rest: list[str]) -> bool:
        if not rest:
            return True
        if rest[0] not in _top_names(self.mods[mod]):
            return f"{mod}.{rest[0]}" in self.mods and self.in_module(f"{mod}.{rest[0]}", rest[1:])
        return len(rest) == 1 or rest[0] not in self.classes or self.has_attr(rest[0], rest[1])

    def config_field(self, section: str, rest: list[str]) -> bool:
        fields = {f.name: f for f in dataclasses.fields(self.sections[section])}
        return rest[0] in fields

    def resolves(self, name: str) -> bool | None:
        """True / False for a name this checker knows how to look up, None for a name rooted elsewhere."""
        head, *rest = name.split(".")
        if name in NOT_FIELDS:
            return None
        if head in self.sections:
            if self.config_field(head, rest):
                return True
            return f"moe_gspo.{head}" in self.mods and self.in_module(f"moe_gspo.{head}", rest)
        if head == "moe_gspo":
            for k in range(len(rest), -1, -1):
                mod = ".".join(["moe_gspo", *rest[:k]])
                if mod in self.mods:
                    return self.in_module(mod, rest[k:])
            return False
        if head in self.classes:
            return self.has_attr(head, rest[0])
        if len(self.by_file.get(head, [])) == 1 and head not in ("policy", "tracker", "model"):
            return self.in_module(self.by_file[head][0], rest)
        return None


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def unresolved() -> list[str]:
    r = Resolver()
    tracked = _tracked()
    bad = []
    for doc in sorted([*(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "guide").glob("*.md")]):
        for i, line in enumerate(doc.read_text().splitlines(), start=1):
            for m in SPAN.finditer(line):
                span = m.group(1).strip()
                where = f"{doc.relative_to(ROOT)}:{i}: `{span}`"
                if "/" in span and re.fullmatch(r"[\w./-]+\.(py|yaml|md|sh|toml|txt)", span):
                    if not any((base / span).exists() for base in (ROOT, doc.parent, PKG)):
                        bad.append(where)
                    continue
                if re.fullmatch(r"\w+\.py", span):
                    if not any(t == span or t.endswith("/" + span) for t in tracked):
                        bad.append(where)
                    continue
                d = DOTTED.match(span)
                if d is None or re.fullmatch(r"\w+\.(py|yaml|json|jsonl|md|png|csv|pt|safetensors)", d.group(0)):
                    continue
                name = d.group(0)
                if r.resolves(name) is False:
                    bad.append(where)
                head = name.split(".")[0]
                if head in r.classes and name == span:  # (`Class.a`, `b`, `c`): b and c are Class's too
                    tail = line[m.end():]
                    while (t := LIST_TAIL.match(tail)) is not None:
                        if not r.has_attr(head, t.group(1)):
                            bad.append(f"{doc.relative_to(ROOT)}:{i}: `{t.group(1)}` (of {head})")
                        tail = tail[t.end():]
    return bad


def test_every_code_name_the_docs_cite_exists():
    bad = unresolved()
    assert not bad, "names in the docs that do not exist:\n" + "\n".join(bad)


def test_the_checker_finds_a_missing_name():
    r = Resolver()
    assert r.resolves("StepContext.update_batches") and not r.resolves("StepContext.no_such_thing")
    assert r.resolves("train.max_tokens_per_micro_batch") and not r.resolves("train.no_such_field")
    assert r.resolves("moe_gspo.losses.rollout_is_weights") and not r.resolves("moe_gspo.losses.no_such_name")
    assert r.resolves("sharded_io.SafeReader") and r.resolves("torch.where") is None


if __name__ == "__main__":
    print("\n".join(unresolved()) or "every name resolves")
