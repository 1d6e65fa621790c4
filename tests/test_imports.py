"""The package's import graph (module- and function-level imports, read with `ast`): no cycles, and the core never
imports the tooling on top of it (`tools/`, `integrations/`, `cli/`), not even inside a function.

An import-linter of our own: what `/tmp/cycles.py` printed during the restructure, as a test that fails.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_kvbridge"
TOOLING = ("hf_kvbridge.tools", "hf_kvbridge.integrations", "hf_kvbridge.cli")


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """`{module: modules of the package it imports}`, every `import`/`from ... import` anywhere in its body.

    `from pkg import name` counts as an import of `pkg.name` when that is a module, else of `pkg`.
    """
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative: `from ..x import y` climbs level - 1 packages
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [f"{base}.{alias.name}" for alias in node.names]
                found = [n for n in names if n in mods]
                candidates = found if len(found) == len(names) else [base, *found]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            graph[module].update(c for c in candidates if c in mods and c != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Core modules that import tooling. The package `__init__` may register the lm-eval model at import."""
    bad = {}
    for module, deps in graph.items():
        if module.startswith(TOOLING) or module == "hf_kvbridge":
            continue
        up = sorted(d for d in deps if d.startswith(TOOLING))
        if up:
            bad[module] = up
    return bad


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_core_never_imports_tooling():
    assert upward_imports(import_graph()) == {}


def test_mappers_never_import_calibration_or_modeling():
    graph = import_graph()
    forbidden = {"hf_kvbridge.calibration", "hf_kvbridge.modeling"}
    bad = {m: sorted(deps & forbidden) for m, deps in graph.items() if m.startswith("hf_kvbridge.mappers")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_checker_sees_function_level_cycles_and_upward_imports(tmp_path):
    """The checks above would pass on a graph they cannot read: here they must flag a planted cycle hidden inside a
    function, and a core module importing a tool inside a function."""
    pkg = tmp_path / "hf_kvbridge"
    (pkg / "tools").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "tools" / "bench.py").write_text("from .. import layout\n")
    (pkg / "modeling.py").write_text("def f():\n    from .session import S\n")
    (pkg / "session.py").write_text("from . import modeling\n\ndef g():\n    from .tools.bench import run\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["hf_kvbridge.modeling", "hf_kvbridge.session"]]
    assert upward_imports(graph) == {"hf_kvbridge.session": ["hf_kvbridge.tools.bench"]}


def test_every_module_imports_on_its_own():
    """Each module imports in a fresh interpreter by itself (an order-dependent cycle would fail here)."""
    import importlib.util

    have_vllm = importlib.util.find_spec("vllm") is not None

    def optional(module: str) -> bool:  # needs the vllm extra
        return ".integrations.vllm" in module

    names = sorted(m for m in _modules() if not m.endswith("pocket.train") and (have_vllm or not optional(m)))
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    result = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_import_surfaces_errors_inside_the_lm_eval_integration():
    """`import hf_kvbridge` tolerates a missing lm-eval, but not an error inside its own lm-eval module."""
    pytest.importorskip("lm_eval")
    code = (
        "import sys, importlib.abc\n"
        "class Finder(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'hf_kvbridge.integrations.lm_eval':\n"
        "            raise ImportError('boom inside the integration')\n"
        "sys.meta_path.insert(0, Finder())\n"
        "import hf_kvbridge\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "boom inside the integration" in result.stderr
    # without lm-eval installed, the package still imports
    hide = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'lm_eval' or name.startswith('lm_eval.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "import importlib.util\n"
        "importlib.util.find_spec = (lambda f: (lambda n, *a: None if n == 'lm_eval' else f(n, *a)))"
        "(importlib.util.find_spec)\n"
        "import hf_kvbridge\n"
        "print('ok', 'hf_kvbridge.integrations.lm_eval' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.split() == ["ok", "False"], result.stderr[-2000:]
    assert importlib.util.find_spec("hf_kvbridge") is not None
