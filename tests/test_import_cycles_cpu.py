"""No import circles in the kernel packages: every import of every module (inside functions too,
where circles used to be closed) read with ast, and the graph of modules searched for a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cute_kernels", "ikbo_gemm", "ikbo_fa")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known) -> set[str]:
    """The known modules that importing ``name`` may import: each import statement's module, the
    names it takes from a package where they are submodules, and the packages above an imported
    module that the importer is not already inside."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [(base, tuple(a.name for a in node.names))]
        else:
            continue
        for module, names in targets:
            parts = module.split(".")
            for i in range(1, len(parts)):  # the packages above it, unless the importer is inside them
                above = ".".join(parts[:i])
                if not (name == above or name.startswith(above + ".")):
                    found.add(above)
            found.add(module)
            found.update(f"{module}.{n}" for n in names)
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_cycle_search_finds_a_circle_closed_inside_a_function(tmp_path):
    a = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert _cycles(a) == [["p.a", "p.b", "p.c"]]
    assert _cycles({"p.a": {"p.b"}, "p.b": set()}) == []
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from .config import x\n\nimport ikbo_gemm.lce\n")
    assert _imports("ikbo_gemm.m", source, {"ikbo_gemm.config", "ikbo_gemm.lce", "ikbo_gemm"}) == {
        "ikbo_gemm.config", "ikbo_gemm.lce"}


@pytest.mark.parametrize("package", [
    "cute_kernels",
    "ikbo_gemm",
    "ikbo_fa",
])
def test_no_import_cycle(package):
    graph = _graph()
    cycles = [c for c in _cycles(graph) if any(m == package or m.startswith(package + ".") for m in c)]
    assert not cycles, f"import cycles through {package}: {cycles}"
