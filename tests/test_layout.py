"""The package's shape: no import cycles (lazy imports included), packages that import each other only downward in
one layer order, one command-line entry, a small public root, test modules that do not import each other, and a
repository that names no file outside itself."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import ROOT


def _module_name(f: Path) -> str:
    rel = f.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(f): f for f in (ROOT / "moe_gspo").rglob("*.py")}
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


# Lowest first: a package may import only packages before it (and itself). The losses are pure math and the bottom
# layer: the config reads each loss's own checks from them. The model families (moe_gspo.model.families, one file
# each) are declarations the config checks a ModelConfig against, so they form a layer of their own below it,
# though they live beside the model that builds from them. The root package's public API (moe_gspo.load_policy) and
# the CLI are the top two: no package below imports either.
LAYERS = ["losses", "families", "config", "kernels", "rewards", "tasks", "parallel", "model", "routing", "rollout", "checkpoint",
          "train", "commands", "report", "experiments", "moe_gspo", "cli"]


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[1:3] == ["model", "families"]:
        return "families"
    return parts[1] if len(parts) > 1 else "moe_gspo"


def layer_violations(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    """'a.b imports c.d' for every import of a package at or above the importer's layer (same package excepted)."""
    rank = {p: i for i, p in enumerate(layers)}
    out = []
    for mod, deps in sorted(graph.items()):
        src = _package(mod)
        for dep in sorted(deps):
            dst = _package(dep)
            if src == dst:
                continue
            if dst not in rank or src not in rank or rank[dst] >= rank[src]:
                out.append(f"{mod} imports {dep}")
    return out


def test_packages_import_only_downward():
    graph = _import_graph()
    packages = {_package(m) for m in graph}
    assert packages == set(LAYERS), f"packages not in the layer order: {packages ^ set(LAYERS)}"
    assert layer_violations(graph, LAYERS) == []


def test_layer_check_finds_an_upward_import():
    graph = {"moe_gspo.model.policy": {"moe_gspo.parallel.state"}, "moe_gspo.parallel.state": {"moe_gspo.model.x"},
             "moe_gspo.train.loop": {"moe_gspo"}}
    assert layer_violations(graph, LAYERS) == ["moe_gspo.parallel.state imports moe_gspo.model.x",
                                               "moe_gspo.train.loop imports moe_gspo"]


def _text_files():
    globs = ["*.md", "pyproject.toml", "docs/*.md", "docs/guide/*.md", "moe_gspo/**/*.py", "tests/**/*.py",
             "scripts/*", "configs/**/*.yaml", ".ci/*"]
    return [f for g in globs for f in ROOT.glob(g) if f.is_file()]


def test_the_repository_names_no_file_outside_itself():
    """Every repository path a file names exists in the repository, none climbs out of it (../), and every
    Markdown file named is one of the repository's own."""
    path_re = re.compile(r"(?<![\w./-])((?:\.\./)*(?:docs|tests|scripts|configs|moe_gspo|\.ci)/[\w./-]*\w"
                         r"\.(?:md|py|yaml|sh|json|toml))(?!\w)")
    md_re = re.compile(r"(?<![\w.-])([\w-]+\.md)\b")
    own_md = {f.name for f in ROOT.rglob("*.md") if ".venv" not in f.parts}
    bad = []
    for f in _text_files():
        text = f.read_text()
        rel = f.relative_to(ROOT)
        bad += [f"{rel}: {p}" for p in path_re.findall(text)
                if p.startswith("../") or not (ROOT / p).exists()]
        bad += [f"{rel}: {m}" for m in md_re.findall(text) if m not in own_md]
    assert bad == []


def test_no_package_file_over_500_lines():
    long = {str(f.relative_to(ROOT)): n for f in (ROOT / "moe_gspo").rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 500}
    assert long == {}


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_one_entry_point_and_a_small_root():
    root = sorted(p.name for p in (ROOT / "moe_gspo").glob("*.py"))
    assert root == ["__init__.py", "cli.py"]
    mains = [str(f.relative_to(ROOT)) for f in (ROOT / "moe_gspo").rglob("*.py")
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


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages explicitly, so a new subpackage left out of the list would be missing from
    a built wheel while an editable install still finds it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(f.parent.relative_to(ROOT).parts) for f in (ROOT / "moe_gspo").rglob("__init__.py")}
    assert found == listed, f"package folders not installed: {sorted(found - listed)}; listed without a folder: " \
                            f"{sorted(listed - found)}"
