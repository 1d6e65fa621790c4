"""The import graph of the package and of the light CLI entry `kvbridge_cli` (module- and function-level imports,
read with `ast`): no cycles, the core never imports the tooling on top of it (`tools/`, `integrations/`, `cli/`), not
even inside a function, the package never imports `kvbridge_cli`, every `hf_kvbridge` import anywhere in the
repository (package, light entry, tests, scripts, studies) names a module and a name that exist, and no private name
crosses a package.

An import-linter of our own: what `/tmp/cycles.py` printed during the restructure, as a test that fails.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_kvbridge"
LIGHT_ENTRY = ROOT / "kvbridge_cli"  # the `kvbridge` console script: imports hf_kvbridge, never the other way
# folders of the repository whose Python files may import hf_kvbridge
SCANNED = ("hf_kvbridge", "kvbridge_cli", "tests", "scripts", "studies")
TOOLING = ("hf_kvbridge.tools", "hf_kvbridge.integrations", "hf_kvbridge.cli")


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph(*roots: Path) -> dict[str, set[str]]:
    """`{module: modules of the graph it imports}`, every `import`/`from ... import` anywhere in its body; the graph's
    modules are those of the packages `roots` (default: `hf_kvbridge` and `kvbridge_cli`).

    `from pkg import name` counts as an import of `pkg.name` when that is a module, else of `pkg`.
    """
    mods = {name: path for root in roots or (PACKAGE, LIGHT_ENTRY) for name, path in _modules(root).items()}
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


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain of an acyclic `graph`, as its modules in order (a module counts once)."""
    best: dict[str, list[str]] = {}
    for root in sorted(graph):
        if root in best:
            continue
        work, on_path = [(root, iter(sorted(graph[root])))], {root}
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child in on_path:
                    raise ValueError(f"import cycle through {child}: no longest chain")
                if child in graph and child not in best:
                    work.append((child, iter(sorted(graph[child]))))
                    on_path.add(child)
                continue
            work.pop()
            on_path.discard(node)
            below = [best[c] for c in graph[node] if c in best]
            best[node] = [node, *max(below, key=len, default=[])]
    return max(best.values(), key=len, default=[])


def module_lines(*roots: Path) -> dict[str, int]:
    """Lines of every `.py` file under `roots`, by module name."""
    return {
        name: len(path.read_text(encoding="utf-8").splitlines())
        for root in roots
        for name, path in _modules(root).items()
    }


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Core modules that import tooling. The package `__init__` may register the lm-eval model at import; the light
    entry `kvbridge_cli` sits above everything."""
    bad = {}
    for module, deps in graph.items():
        if module.startswith(TOOLING) or module == "hf_kvbridge" or module.split(".")[0] == "kvbridge_cli":
            continue
        up = sorted(d for d in deps if d.startswith(TOOLING))
        if up:
            bad[module] = up
    return bad


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_package_never_imports_the_light_entry():
    """`kvbridge_cli` parses and hands the arguments to `hf_kvbridge.cli`; nothing in `hf_kvbridge` imports it back
    (it once did, for the settings' option names: the one cycle of the repository)."""
    graph = import_graph()
    back = {m: sorted(d for d in deps if d.split(".")[0] == "kvbridge_cli") for m, deps in graph.items()}
    assert {m: deps for m, deps in back.items() if deps and m.startswith("hf_kvbridge")} == {}
    assert "hf_kvbridge.cli.main" in graph["kvbridge_cli"]  # the graph sees the light entry's own imports


def test_core_never_imports_tooling():
    assert upward_imports(import_graph()) == {}


FITTING_PACKAGE = "hf_kvbridge.fitting"


def runtime_imports_of_fitting(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules of the runtime side (everything but `fitting/` and the tooling above: tools, integrations, cli) that
    import a fitting module, anywhere in their body."""
    bad = {}
    for module, deps in graph.items():
        if (
            module == "hf_kvbridge"
            or module.startswith((FITTING_PACKAGE, *TOOLING))
            or not module.startswith("hf_kvbridge")
        ):
            continue
        up = sorted(d for d in deps if d == FITTING_PACKAGE or d.startswith(FITTING_PACKAGE + "."))
        if up:
            bad[module] = up
    return bad


def test_the_runtime_never_imports_the_fitting_side():
    """Model, config, persistence, mappers, transfer and the helpers import nothing of `hf_kvbridge.fitting`, not even
    inside a function: the fitting side attaches its fits to the runtime classes, never the reverse."""
    assert runtime_imports_of_fitting(import_graph()) == {}


def test_the_runtime_check_sees_a_function_level_import_of_fitting(tmp_path):
    pkg = tmp_path / "hf_kvbridge"
    (pkg / "fitting").mkdir(parents=True)
    (pkg / "mappers").mkdir()
    for init in (pkg, pkg / "fitting", pkg / "mappers"):
        (init / "__init__.py").write_text("")
    (pkg / "fitting" / "solve.py").write_text("from ..mappers import base\n")
    (pkg / "mappers" / "base.py").write_text("def f():\n    from ..fitting.solve import g\n")
    assert runtime_imports_of_fitting(import_graph(pkg)) == {"hf_kvbridge.mappers.base": ["hf_kvbridge.fitting.solve"]}


def test_an_old_import_path_resolves_to_the_moved_module():
    assert _module_file("hf_kvbridge.calibration.refit", ROOT) == PACKAGE / "fitting" / "calibration" / "refit.py"
    assert _module_file("hf_kvbridge.solve", ROOT) == PACKAGE / "fitting" / "solve.py"
    assert unresolved_imports(Path(__file__)) == []  # this file names old paths below, as other code may


def test_mappers_never_import_calibration_or_modeling():
    graph = import_graph()
    forbidden = {"hf_kvbridge.fitting.calibration", "hf_kvbridge.modeling"}
    bad = {m: sorted(deps & forbidden) for m, deps in graph.items() if m.startswith("hf_kvbridge.mappers")}
    assert {m: d for m, d in bad.items() if d} == {}


# -- the shape of the house (issue 39): the package and the light command-line entry, read together ----------------
HOUSE = (PACKAGE, LIGHT_ENTRY)
MAX_CHAIN = 12  # modules on the longest import chain (21 before the redesign, 14 before #46 cut it)
MAX_MODULE_LINES = 600


def test_the_house_has_no_cycle_no_long_chain_and_no_long_module():
    """No import cycle in `hf_kvbridge/` and `kvbridge_cli/` together (function-level imports included), a longest
    import chain of at most `MAX_CHAIN` modules, and no module over `MAX_MODULE_LINES` lines."""
    graph = import_graph(*HOUSE)
    assert cycles(graph) == []
    chain = longest_chain(graph)
    assert len(chain) <= MAX_CHAIN, f"{len(chain)} modules: " + " -> ".join(chain)
    long = {name: lines for name, lines in module_lines(*HOUSE).items() if lines > MAX_MODULE_LINES}
    assert long == {}


def test_the_house_figures_see_a_long_chain_a_cycle_across_packages_and_a_long_module(tmp_path):
    """The figures above, on a planted tree: a chain of four modules through a function-level import, a cycle between
    the package and a second one, and a module of 601 lines."""
    pkg, cli = tmp_path / "hf_kvbridge", tmp_path / "kvbridge_cli"
    pkg.mkdir()
    cli.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import x\n")
    (pkg / "c.py").write_text("x = 1\n" + "# filler\n" * 600)
    (pkg / "main.py").write_text("def g():\n    import kvbridge_cli\n")
    (cli / "__init__.py").write_text("from hf_kvbridge import main\n")
    graph = import_graph(pkg, cli)
    assert longest_chain({m: d for m, d in graph.items() if m.startswith("hf_kvbridge.")}) == [
        "hf_kvbridge.a",
        "hf_kvbridge.b",
        "hf_kvbridge.c",
    ]
    assert cycles(graph) == [["hf_kvbridge.main", "kvbridge_cli"]]
    assert {n: k for n, k in module_lines(pkg, cli).items() if k > MAX_MODULE_LINES} == {"hf_kvbridge.c": 601}


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

    optional = "hf_kvbridge.integrations.vllm"  # needs the vllm extra
    have_vllm = importlib.util.find_spec("vllm") is not None
    modules = {**_modules(), **{m: p for m, p in _modules(LIGHT_ENTRY).items() if p.name != "__main__.py"}}
    names = sorted(m for m in modules if have_vllm or not (m == optional or m.startswith(optional + ".")))
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    result = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_package_imports_without_lm_eval():
    """`import hf_kvbridge` never touches lm-eval (its model "kvbridge" comes with the integration's own import), so
    the package imports where lm-eval is not installed."""
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


# -- every hf_kvbridge import resolves ---------------------------------------------------------------------------


def _module_file(module: str, root: Path) -> Path | None:
    """The source file of `module` (`hf_kvbridge.x.y`) under `root` (the folder holding `hf_kvbridge/`), or `None`.

    Read from the tree rather than `importlib.util.find_spec`, which would import every parent package (torch,
    transformers) and look at whichever hf_kvbridge is installed instead of this checkout.
    """
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    moved = _moved_module(module, root)
    return None if moved is None else _module_file(moved, root)


def _moved_module(module: str, root: Path) -> str | None:
    """The new name of a moved module (`hf_kvbridge.MOVED_MODULES`, read from the tree), else `None`."""
    if not (root / "hf_kvbridge" / "__init__.py").is_file():
        return None
    init = ast.parse((root / "hf_kvbridge" / "__init__.py").read_text(encoding="utf-8"))
    for node in init.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "MOVED_MODULES":
            for old, new in ast.literal_eval(node.value).items():
                if module == old or module.startswith(old + "."):
                    return new + module[len(old) :]
    return None


def _bound_names(statements: list[ast.stmt]) -> tuple[set[str], list[str], bool]:
    """Names a module body binds at top level (also inside top-level `if`/`try`/`with`), the modules it
    star-imports (`from m import *`, as written: level dots + name) and whether it has a module `__getattr__`."""
    names: set[str] = set()
    stars: list[str] = []
    lazy = False
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                if isinstance(node.value, (ast.List, ast.Tuple)):
                    names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    stars.append("." * node.level + (node.module or ""))
                else:
                    names.add(alias.asname or alias.name)
        else:
            for body in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, body, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.AST):
                    if body == "handlers":
                        inner = [stmt for handler in inner for stmt in handler.body]
                    more, more_stars, more_lazy = _bound_names(inner)
                    names |= more
                    stars += more_stars
                    lazy = lazy or more_lazy
    return names, stars, lazy or "__getattr__" in names  # a `def` or `__getattr__ = moved_names(...)`


def _module_names(module: str, root: Path, seen: frozenset[str] = frozenset()) -> set[str] | None:
    """The names `from module import name` can take: top-level bindings and submodules; `None` means any name (a
    module `__getattr__`, or a star import from outside the package)."""
    path = _module_file(module, root)
    names, stars, lazy = _bound_names(ast.parse(path.read_text(encoding="utf-8")).body)
    if lazy:
        return None
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py") if p.stem != "__init__"}
        names |= {p.parent.name for p in path.parent.glob("*/__init__.py")}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for star in stars:
        target = _absolute(star.lstrip("."), len(star) - len(star.lstrip(".")), package)
        if not target.startswith("hf_kvbridge") or _module_file(target, root) is None or target in seen:
            return None
        more = _module_names(target, root, seen | {module})
        if more is None:
            return None
        names |= more
    return names


def _absolute(module: str, level: int, package: str) -> str:
    """`from {'.' * level}{module} import ...` written in `package`, as an absolute module name."""
    if not level:
        return module
    parts = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def unresolved_imports(path: Path, root: Path = ROOT) -> list[str]:
    """Every `import hf_kvbridge...` / `from hf_kvbridge... import name` / relative import inside the package in
    `path` (module level or inside a function) whose module or name does not exist, as `line: what`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    relative = path.relative_to(root)
    in_package = relative.parts[0] == "hf_kvbridge"
    module = ".".join(relative.with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    problems: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_kvbridge" and _module_file(alias.name, root) is None:
                    problems.append((node.lineno, f"import {alias.name}: no such module"))
        elif isinstance(node, ast.ImportFrom):
            if node.level and not in_package:
                continue  # a relative import outside the package (tests/) is not about hf_kvbridge
            base = _absolute(node.module or "", node.level, package)
            if base.split(".")[0] != "hf_kvbridge":
                continue
            written = "." * node.level + (node.module or "")
            if _module_file(base, root) is None:
                problems.append((node.lineno, f"from {written} import ...: no module {base}"))
                continue
            names = _module_names(base, root)
            for alias in node.names:
                if alias.name != "*" and names is not None and alias.name not in names:
                    problems.append((node.lineno, f"from {written} import {alias.name}: {base} has no {alias.name}"))
    return [f"{line}: {what}" for line, what in sorted(problems)]


def _importing_files(root: Path = ROOT) -> list[Path]:
    files = []
    for folder in SCANNED:
        if (root / folder).is_dir():
            files += sorted(p for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)
    files += sorted(root.glob("*.py"))
    return [
        p for p in files if "hf_kvbridge" in p.read_text(encoding="utf-8") or p.is_relative_to(root / "hf_kvbridge")
    ]


def _import_params():
    return [pytest.param(path, id=path.relative_to(ROOT).as_posix()) for path in _importing_files()]


@pytest.mark.parametrize("path", _import_params())
def test_every_hf_kvbridge_import_resolves(path):
    """`import hf_kvbridge.x` and `from hf_kvbridge.x import y` name a module and a name that exist, in every file
    of the repository, function-level imports included (a lazily imported tool is not run by every test)."""
    assert unresolved_imports(path) == []


# -- no private name crosses a package ----------------------------------------------------------------------------
PRIVATE_CHECKED = ("hf_kvbridge", "kvbridge_cli", "scripts", "studies")


# the names another project documents only under a private module: PyTorch's dispatch modes live in
# `torch.utils._python_dispatch` ("Extending PyTorch": `from torch.utils._python_dispatch import TorchDispatchMode`)
DOCUMENTED_PRIVATE = {"torch.utils._python_dispatch.TorchDispatchMode"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """Every import in `path` (module level or inside a function) of a private name (`_name`, a function, class or
    module) from a module of another package, as `line: what`. A module's package is the folder it sits in
    (`hf_kvbridge.tools.tune` for `hf_kvbridge/tools/tune/search.py`, `scripts` for a script): modules of one package
    may share private helpers; anything outside it imports public names only."""
    relative = path.relative_to(root)
    module = ".".join(relative.with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    problems: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, package)
            written = "." * node.level + (node.module or "")
            imported = [(f"{base}.{a.name}", a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            written, imported = "", [(a.name, a.name) for a in node.names]
        else:
            continue
        for full, name in imported:
            if full in DOCUMENTED_PRIVATE:
                continue
            parts = full.split(".")
            owner = ".".join(parts[:-1])  # the module (or package) the last name is taken from
            owner_package = owner if root.joinpath(*parts[:-1]).is_dir() else owner.rpartition(".")[0]
            if owner_package == package:
                continue  # within the importer's own package
            if any(_private(part) for part in parts):
                what = f"from {written} import {name}" if written else f"import {full}"
                problems.append((node.lineno, f"{what}: a private name of {owner or full}"))
    return [f"{line}: {what}" for line, what in sorted(problems)]


def _private_params():
    files = []
    for folder in PRIVATE_CHECKED:
        files += sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return [pytest.param(path, id=path.relative_to(ROOT).as_posix()) for path in files]


@pytest.mark.parametrize("path", _private_params())
def test_no_private_name_is_imported_from_another_package(path):
    """The package, the light CLI entry, the scripts and the studies import only public names of other packages (a
    private helper is free to change; what another package needs is made public where it lives)."""
    assert private_imports(path) == []


def test_the_private_import_checker_sees_a_private_name_of_another_package(tmp_path):
    """The check above would pass on files it cannot read: here it must flag each planted private import from another
    package, function-level ones too, and none of the public or same-package ones."""
    (tmp_path / "hf_kvbridge" / "tools").mkdir(parents=True)
    (tmp_path / "hf_kvbridge" / "statistics").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "hf_kvbridge" / "tools" / "bench.py").write_text(
        "from ._shared import helper\nfrom .timing import _sync\nfrom ..solve import _block, strip_rows\n"
        "from ..statistics import _head_index\nfrom ..statistics.blocks import _gram\n"
    )
    (tmp_path / "scripts" / "measure.py").write_text(
        "from scripts.common import _load\n"
        "def main():\n"
        "    from hf_kvbridge.tools.diagnostics import _pyplot, pyplot\n"
        "    import hf_kvbridge._light\n"
    )
    assert private_imports(tmp_path / "hf_kvbridge" / "tools" / "bench.py", tmp_path) == [
        "3: from ..solve import _block: a private name of hf_kvbridge.solve",
        "4: from ..statistics import _head_index: a private name of hf_kvbridge.statistics",
        "5: from ..statistics.blocks import _gram: a private name of hf_kvbridge.statistics.blocks",
    ]
    assert private_imports(tmp_path / "scripts" / "measure.py", tmp_path) == [
        "3: from hf_kvbridge.tools.diagnostics import _pyplot: a private name of hf_kvbridge.tools.diagnostics",
        "4: import hf_kvbridge._light: a private name of hf_kvbridge",
    ]


def test_the_import_checker_sees_missing_modules_and_names(tmp_path):
    """The check above would pass on files it cannot read: here it must flag each planted bad import, and none of
    the good ones."""
    pkg = tmp_path / "hf_kvbridge"
    (pkg / "tools").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .layout import KVLayout\n__all__ = ['KVLayout', 'later']\n")
    (pkg / "layout.py").write_text("import os\nif os:\n    KVLayout = 1\nclass Other:\n    pass\n")
    (pkg / "lazy.py").write_text("def __getattr__(name):\n    return name\n")
    (pkg / "moved.py").write_text("__getattr__ = str\n")  # as `moved_names` builds one
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "tools" / "bench.py").write_text(
        "from .. import layout, tools, later\n"
        "from ..layout import Other, Missing\n"
        "from ..lazy import anything\n"
        "from ..moved import anything_else\n"
        "def f():\n"
        "    from hf_kvbridge.bench import run\n"
        "    import hf_kvbridge.tools.bench, hf_kvbridge.nope\n"
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from hf_kvbridge import KVLayout, Gone\nfrom .conftest import x\n")
    assert unresolved_imports(pkg / "tools" / "bench.py", tmp_path) == [
        "2: from ..layout import Missing: hf_kvbridge.layout has no Missing",
        "6: from hf_kvbridge.bench import ...: no module hf_kvbridge.bench",
        "7: import hf_kvbridge.nope: no such module",
    ]
    assert unresolved_imports(tmp_path / "tests" / "test_x.py", tmp_path) == [
        "1: from hf_kvbridge import Gone: hf_kvbridge has no Gone"
    ]


SERVING = ("hf_kvbridge.modeling", "hf_kvbridge.transfer", "hf_kvbridge.integrations.vllm")
FITTING = ("hf_kvbridge.fitting",)


def _reached(graph: dict[str, set[str]], roots) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += sorted(graph.get(module, ()))
    return seen


def test_serving_never_imports_fitting_code():
    """The bridge class, the transfers and the vLLM integration reach no module of `hf_kvbridge.fitting` (calibration,
    statistics, solves, selection, the mappers' fits)."""
    graph = import_graph(*HOUSE)
    roots = [m for m in graph if m.startswith(SERVING)]
    assert sorted(m for m in _reached(graph, roots) if m.startswith(FITTING)) == []
    planted = {
        "hf_kvbridge.modeling": {"hf_kvbridge.transfer.x"},
        "hf_kvbridge.transfer.x": {"hf_kvbridge.fitting.layer_selection"},
    }
    assert "hf_kvbridge.fitting.layer_selection" in _reached(
        planted, ["hf_kvbridge.modeling"]
    )  # the walk follows chains


MAX_ROOT_MODULES = 12  # modules directly in hf_kvbridge/, besides __init__.py (30 before fitting/ and utils/)


def root_modules(package: Path = PACKAGE) -> list[str]:
    """The modules directly in `package`, leaving out `__init__.py` and modules that only keep an old import path
    (under 16 lines)."""
    return sorted(
        p.stem
        for p in package.glob("*.py")
        if p.name != "__init__.py" and len(p.read_text(encoding="utf-8").splitlines()) >= 16
    )


def test_the_root_holds_at_most_twelve_modules(tmp_path):
    assert len(root_modules()) <= MAX_ROOT_MODULES, root_modules()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "alias.py").write_text("from .x import *\n")
    (tmp_path / "real.py").write_text("x = 1\n" * 16)
    assert root_modules(tmp_path) == ["real"]
