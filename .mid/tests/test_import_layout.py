"""The import graph of the product's packages, read from the source (ast), not by importing it.

Rules (README "layout"): no cycle between modules; fp8/ and models/ import nothing of orchestration/ (they run on
the GPU image without the launcher's libraries); orchestration/config.py is a leaf that imports nothing of ours;
only launch.py reaches the driver (orchestration/driver/), the rest of orchestration/ runs inside workers.

Every import counts: module level, inside functions (lazy) and under TYPE_CHECKING, since each of them is an edge
a reader has to follow and a lazy import is how a cycle hides.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestration", "fp8", "models", "optim")


def module_files(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is named by its __init__.py)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module an imported dotted name lives in (a.b.c -> a.b when a/b.py defines c), None when not ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, source: str, modules: Mapping[str, Path], is_package: bool = False) -> set[str]:
    """Our modules that `module` imports anywhere in `source`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(_owner(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                submodule = f"{base}.{alias.name}"  # `from pkg import mod` imports the module pkg.mod
                found.add(submodule if submodule in modules else _owner(base, modules))
    found.discard(None)
    found.discard(module)
    return found


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    return {name: imports_of(name, path.read_text(), modules, path.name == "__init__.py")
            for name, path in modules.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; [] when acyclic."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                lowlink[node] = min(lowlink[node], lowlink[target])
            elif target in on_stack:
                lowlink[node] = min(lowlink[node], index[target])
        if lowlink[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_cycles_and_accepts_a_dag():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []


def test_imports_of_resolves_lazy_type_checking_relative_and_submodule_imports():
    modules = dict.fromkeys(["p", "p.a", "p.b", "p.c", "p.sub", "p.sub.d"], Path())
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from p.a import thing\n"
        "from p import b\n"
        "if TYPE_CHECKING:\n    from p.sub.d import D\n"
        "def f():\n    from . import c\n    import p.sub\n"
    )
    assert imports_of("p.x", source, modules) == {"p.a", "p.b", "p.sub.d", "p.c", "p.sub"}


def test_no_import_cycle_between_modules():
    graph = import_graph()
    assert "orchestration.training.loop" in graph and "orchestration.divergence.guard" in graph  # the walk found them
    assert cycles(graph) == []


def test_fp8_and_models_import_nothing_of_orchestration():
    offenders = {module: sorted(t for t in targets if t.startswith("orchestration"))
                 for module, targets in import_graph().items() if module.startswith(("fp8", "models"))}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_config_is_a_leaf():
    graph = import_graph()
    assert graph["orchestration.config"] == set()


def test_only_launch_imports_the_driver():
    modules = module_files()
    graph = import_graph()
    outside = {module: sorted(t for t in targets if t.startswith("orchestration.driver"))
               for module, targets in graph.items() if not module.startswith("orchestration.driver")}
    assert {m: t for m, t in outside.items() if t} == {}
    launch_imports = imports_of("launch", (REPO / "launch.py").read_text(), modules)
    assert any(t.startswith("orchestration.driver") for t in launch_imports)
