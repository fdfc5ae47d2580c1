"""The package's shape: no import cycles (lazy imports included), one command-line entry, a small public root,
test modules that do not import each other."""
from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT


def _module_name(f: Path) -> str:
    rel = f.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":  # installed as moe_gspo.kernels
        parts = ["moe_gspo", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(f): f for f in [*(ROOT / "moe_gspo").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]}
    graph = {}
    for name, f in files.items():
        pkg = name if f.stem == "__init__" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):  # every import, also those inside functions
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = _import_graph()
    assert "moe_gspo.train.loop" in graph and "moe_gspo.kernels.api" in graph
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_one_entry_point_and_a_small_root():
    root = sorted(p.name for p in (ROOT / "moe_gspo").glob("*.py"))
    assert root == ["__init__.py", "cli.py"]
    mains = [str(f.relative_to(ROOT)) for f in [*(ROOT / "moe_gspo").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
             if '__name__ == "__main__"' in f.read_text()]
    assert mains == ["moe_gspo/cli.py"]


def test_test_modules_do_not_import_each_other():
    names = {f.stem for f in (ROOT / "tests").glob("test_*.py")}
    offenders = []
    for f in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = [node.module] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{f.name} imports {m}" for m in mods if m and m.split(".")[-1] in names]
    assert offenders == []
