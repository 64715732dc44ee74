"""Layers in one direction: no import cycle among the modules of ``nemo_rl`` and
``megatron_bridge``, ``megatron_bridge`` (a standalone converter) never imports ``nemo_rl``,
``nemo_rl.launch`` never imports ``nemo_rl.cli``, and what every rollout-trained run shares
(``algorithms.rollout_run``, ``rollout_config``), distillation and PPO import nothing of GRPO's
run or config (see :data:`FORBIDDEN_IMPORTS`).

The graph is read statically: every ``.py`` file of the two packages is parsed with :mod:`ast`
and every ``import x`` / ``from x import y`` / relative import, at module level or inside a
function, class or ``try``, becomes an edge to the module of the two packages it names. How
names resolve:

* ``import a.b.c`` and ``from a.b.c import name`` are edges to ``a.b.c``; ``from a.b import c``
  is an edge to ``a.b.c`` when that is a module. Parent packages that Python initialises on the
  way (``a``, ``a.b``) get no edge: counting them would make every package whose ``__init__``
  imports its submodules a cycle with each of them.
* ``from pkg import Name`` where ``pkg/__init__.py`` only re-exports ``Name`` from a submodule
  (``from pkg.sub import Name``) is an edge to that submodule, the module that really defines
  ``Name``. A submodule reaching its sibling through the package facade is the usual false
  cycle (``pkg`` -> ``pkg.sub`` -> ``pkg``); resolving the name to its home keeps the true
  dependency, so a real cycle between the defining modules is still found. A name that
  ``pkg/__init__.py`` defines itself stays an edge to ``pkg``.
* Imports under ``if TYPE_CHECKING:`` never run, so they are left out of the cycle check (that
  is what such blocks are for); they still count for :data:`FORBIDDEN_IMPORTS`, since a type
  reference is a dependency too.
* Imports made from strings at run time (``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("nemo_rl", "megatron_bridge")

ROLLOUT_RUN_FIX = (
    "what every rollout-trained run shares (bring-up, resume, shutdown; the rollout loop, data "
    "and shared sections of the config) lives in nemo_rl.algorithms.rollout_run and "
    "rollout_config; GRPO's modules build on them, not the other way round"
)

# (importer, imported, the fix): a module in or below `importer` must not import one in or below
# `imported`, not even under TYPE_CHECKING.
FORBIDDEN_IMPORTS = [
    (
        "megatron_bridge",
        "nemo_rl",
        "megatron_bridge is a standalone converter: move what both need into megatron_bridge (or "
        "a module below both)",
    ),
    (
        "nemo_rl.launch",
        "nemo_rl.cli",
        "what the launchers need from the command line (the registry of recipe commands, the "
        "parser) lives in nemo_rl.commands",
    ),
    *(
        (importer, imported, ROLLOUT_RUN_FIX)
        for importer, imported in (
            ("nemo_rl.algorithms.rollout_run", "nemo_rl.algorithms.grpo"),
            ("nemo_rl.algorithms.rollout_run", "nemo_rl.algorithms.grpo_config"),
            ("nemo_rl.algorithms.rollout_config", "nemo_rl.algorithms.grpo_config"),
            ("nemo_rl.algorithms.distillation", "nemo_rl.algorithms.grpo"),
            ("nemo_rl.algorithms.distillation_config", "nemo_rl.algorithms.grpo_config"),
            ("nemo_rl.algorithms.ppo", "nemo_rl.algorithms.grpo"),
            ("nemo_rl.algorithms.ppo_config", "nemo_rl.algorithms.grpo_config"),
        )
    ),
]

@dataclass(frozen=True)
class Edge:
    """One import statement resolved to a module of the two packages.

    Attributes:
        importer, imported: dotted module names (a package is named by its ``__init__``).
        line: line of the import statement in the importer's file.
        type_checking_only: the import sits under ``if TYPE_CHECKING:``.
    """

    importer: str
    imported: str
    line: int
    type_checking_only: bool


def repo_modules() -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (source, is a package ``__init__``) for every ``.py`` file of
    :data:`PACKAGES`."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path.read_text(), is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


ImportNode = ast.Import | ast.ImportFrom


def _imports(tree: ast.AST) -> Iterator[tuple[ImportNode, bool]]:
    """Every import statement anywhere in ``tree``, with whether it is under TYPE_CHECKING."""

    def walk(node: ast.AST, type_checking: bool) -> Iterator[tuple[ImportNode, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_checking
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from walk(child, True)
            for child in node.orelse:
                yield from walk(child, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, type_checking)

    yield from walk(tree, False)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module named by ``from <node.module> import ...`` inside ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    # In a package's __init__, `.` is the package itself; in a plain module, its package.
    drop = node.level - 1 if is_package else node.level
    base = base[: len(base) - drop]
    return ".".join(base + ([node.module] if node.module else []))


class ImportGraph:
    """The import edges among ``modules``, resolved as the module docstring says.

    Args:
        modules: dotted name -> (source, is a package ``__init__``); imports of modules outside
            the top-level packages these names belong to are ignored.
    """

    def __init__(self, modules: dict[str, tuple[str, bool]]) -> None:
        self.modules = sorted(modules)
        self.packages = {m.split(".")[0] for m in modules}
        self._is_package = {m: is_package for m, (_, is_package) in modules.items()}
        self._trees = {m: ast.parse(source, m) for m, (source, _) in modules.items()}
        # Per package: name -> submodule that defines it, from `from pkg.sub import name` at the
        # top level of the package's __init__.
        self._reexports = {m: self._reexported(m) for m in modules if self._is_package[m]}
        # One edge per statement and target (`from x import a, b` names x once).
        self.edges = list(dict.fromkeys(e for module in self.modules for e in self._edges(module)))

    def _reexported(self, package: str) -> dict[str, str]:
        names: dict[str, str] = {}
        for node in self._trees[package].body:
            if isinstance(node, ast.ImportFrom):
                source = _absolute(package, True, node)
                if source.startswith(package + ".") and source in self._is_package:
                    for alias in node.names:
                        names[alias.asname or alias.name] = source
        return names

    def _target(self, name: str) -> str | None:
        """The module that dotted ``name`` is, or that holds it; None outside the packages."""
        while name and name not in self._is_package:
            name = name.rpartition(".")[0]
        return name or None

    def _resolve_from(self, source: str, name: str) -> str | None:
        """The module ``from source import name`` depends on."""
        if f"{source}.{name}" in self._is_package:
            return f"{source}.{name}"
        seen = set()
        # Follow re-exports: pkg re-exports from pkg.sub, which may itself be a package.
        while name in self._reexports.get(source, {}) and source not in seen:
            seen.add(source)
            source = self._reexports[source][name]
        return self._target(source)

    def _edges(self, module: str) -> Iterator[Edge]:
        for node, type_checking in _imports(self._trees[module]):
            if isinstance(node, ast.Import):
                targets = [self._target(alias.name) for alias in node.names]
            else:
                source = _absolute(module, self._is_package[module], node)
                if source.split(".")[0] not in self.packages:
                    continue
                targets = [self._resolve_from(source, alias.name) for alias in node.names]
            for target in targets:
                if target is not None and target != module:
                    yield Edge(module, target, node.lineno, type_checking)


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph(repo_modules())


def strongly_connected(nodes: list[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
                        components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(succ[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def a_cycle(component: list[str], succ: dict[str, set[str]]) -> list[str]:
    """One cycle through the first module of ``component`` (shortest, by breadth-first search)."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(succ[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def runtime_successors(graph: ImportGraph) -> dict[str, set[str]]:
    succ: dict[str, set[str]] = {m: set() for m in graph.modules}
    for edge in graph.edges:
        if not edge.type_checking_only:
            succ[edge.importer].add(edge.imported)
    return succ


def describe(cycle: list[str], graph: ImportGraph) -> str:
    lines = {(e.importer, e.imported): e.line for e in graph.edges if not e.type_checking_only}
    hops = [
        f"    {a} (line {lines[a, b]}) -> {b}" for a, b in zip(cycle[:-1], cycle[1:])
    ]
    return "\n".join(hops)


# ---------------------------------------------------------------------- the rules


def test_no_import_cycles(graph: ImportGraph) -> None:
    succ = runtime_successors(graph)
    components = strongly_connected(graph.modules, succ)
    report = [
        f"  modules {c} import each other, e.g.:\n{describe(a_cycle(c, succ), graph)}"
        for c in components
    ]
    assert not report, (
        "import cycles (move what both sides need into a module below both, or import the "
        "defining module instead of its package):\n" + "\n".join(report)
    )


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize(
    ("importer", "imported", "fix"),
    FORBIDDEN_IMPORTS,
    ids=[f"{a}->{b}" for a, b, _ in FORBIDDEN_IMPORTS],
)
def test_layers_import_in_one_direction(
    graph: ImportGraph, importer: str, imported: str, fix: str
) -> None:
    found = sorted(
        f"  {e.importer} (line {e.line}) imports {e.imported}"
        for e in graph.edges
        if _within(e.importer, importer)
        and _within(e.imported, imported)
    )
    assert not found, f"{importer} must not import {imported}; {fix}:\n" + "\n".join(found)


# ---------------------------------------------------------------------- the reader itself


def test_reader_sees_imports_everywhere_and_resolves_them(graph: ImportGraph) -> None:
    edges = {(e.importer, e.imported): e for e in graph.edges}
    # Module level, `from package import module`.
    assert ("nemo_rl.launch.cli", "nemo_rl.launch.exit_codes") in edges
    # Inside a function.
    assert ("nemo_rl.algorithms.grpo", "nemo_rl.data.dataloader") in edges
    # Under TYPE_CHECKING: an edge, marked as never run.
    annotation_only = edges["nemo_rl.models.policy.lm_policy", "nemo_rl.distributed.virtual_cluster"]
    assert annotation_only.type_checking_only
    # A package __init__ importing its submodules.
    assert ("nemo_rl.data_plane", "nemo_rl.data_plane.preshard") in edges


def test_reexported_names_resolve_to_their_defining_module() -> None:
    """On made-up packages: the facade import is no cycle, a name of the __init__ itself is."""
    facade = ImportGraph(
        {
            "pkg": ("from pkg.a import A\nfrom pkg.b import B\n", True),
            # B lives in pkg.b: an edge a -> b, not a -> pkg.
            "pkg.a": ("import os\ndef f():\n    from pkg import B\n", False),
            "pkg.b": ("X = 1\n", False),
            "pkg.c": ("from . import a\nfrom .a import A\nimport pkg.b.nothing\n", False),
        }
    )
    assert {(e.importer, e.imported) for e in facade.edges} == {
        ("pkg", "pkg.a"), ("pkg", "pkg.b"), ("pkg.a", "pkg.b"), ("pkg.c", "pkg.a"),
        ("pkg.c", "pkg.b"),
    }
    assert strongly_connected(facade.modules, runtime_successors(facade)) == []

    real = ImportGraph(
        {
            "pkg": ("from pkg.b import B\nX = 1\n", True),
            "pkg.b": ("B = 2\nif TYPE_CHECKING:\n    import pkg.c\nfrom pkg import X\n", False),
            "pkg.c": ("import pkg.b\n", False),
        }
    )
    succ = runtime_successors(real)
    assert strongly_connected(real.modules, succ) == [["pkg", "pkg.b"]]  # pkg.c: TYPE_CHECKING
    assert a_cycle(["pkg", "pkg.b"], succ) == ["pkg", "pkg.b", "pkg"]
