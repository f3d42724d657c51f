"""The import layering DESIGN states, read from the source (function-level imports count;
``if TYPE_CHECKING:`` ones never run): no import cycle among the project's modules;
``placement``, ``cpu_kernels`` and ``gpu`` never import ``offload``; the library never
imports its CLI (``offload.commands``, which only ``offload.cli`` dispatches to)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("offload", "placement", "cpu_kernels", "gpu")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            rel = f.relative_to(ROOT).with_suffix("")
            out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return out


def _targets(mods, mod: str, node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = mod.split(".") if mods[mod].name == "__init__.py" else mod.split(".")[:-1]
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
    subs = [f"{base}.{a.name}" for a in node.names]
    # "from pkg import mod" needs the module, not pkg's own namespace
    return [t for t in subs if t in mods] + ([base] if any(t not in mods for t in subs) else [])


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text())
        typing_only = {id(x) for n in ast.walk(tree)
                       if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test) for x in ast.walk(n)}
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in typing_only:
                graph[m] |= {t for t in _targets(mods, m, n) if t in mods and t != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
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


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    mods = _modules()
    assert "offload.compiled_block" in mods and "cpu_kernels" in mods
    graph = import_graph()
    assert "offload.moe" in graph["offload.compiled_block"]       # a known edge is found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_lower_packages_never_import_offload_and_the_library_never_its_cli():
    graph = import_graph()
    up = sorted((m, t) for m, ts in graph.items() for t in ts
                if m.split(".")[0] != "offload" and t.split(".")[0] == "offload")
    cli = sorted((m, t) for m, ts in graph.items() for t in ts
                 if t.startswith("offload.commands") and not m.startswith("offload.commands") and m != "offload.cli")
    assert up == [] and cli == []
