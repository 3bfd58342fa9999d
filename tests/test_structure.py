"""The import graph reads one way: profiler -> strategies -> planner -> executor, with the
report and the command line on top of the planner: nothing below imports them.

Every module of the four packages is parsed with `ast`; every import counts, at module level
or inside a function (a function-local import hides a dependency, it does not remove it),
except those under `if TYPE_CHECKING:`. A package's `__init__` re-exporting its own modules
is not an edge of the flow, so package `__init__`s are left out of the cycle search; the
layer rules still read them, with one exception named below.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("profiler", "strategies", "planner", "executor")
LAYER = {name: i for i, name in enumerate(PACKAGES)}  # lower number: lower layer


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that `name` (a module, or a name inside one) lives in."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            target = _resolve(name)
            # `from planner import ilp` names the package first: that is not an edge to it
            if target and target != module and not (target == package and name == package
                                                    and path.name != "__init__.py"):
                out.add(target)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _tier(module: str) -> int:
    """0 profiler, 1 strategies, 2 the planner's core, 3 executor, 4 the report, 5 the CLI
    (which runs the executor for `hyplan train`)."""
    for tier, prefix in ((5, "planner.cli"), (4, "planner.report")):
        if module == prefix or module.startswith(prefix + "."):
            return tier
    return LAYER[module.split(".")[0]]


def test_every_module_is_parsed():
    assert len(MODULES) > 60 and {"planner.plan", "executor.parallelize", "profiler.trace",
                                  "strategies.catalog", "planner.report.explain",
                                  "planner.cli.command"} <= set(MODULES)


def test_no_import_cycles():
    flow = {m: set() if _is_package(m) else {t for t in targets if not _is_package(t)}
            for m, targets in GRAPH.items()}
    cycles = _cycles(flow)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_layer_imports_one_above_it():
    """profiler imports none of strategies/planner/executor, strategies none of
    planner/executor, the planner not the executor; nothing below the report and the CLI
    imports them (the planner's core, the executor), and the report never the CLI. One
    exception: `planner/__init__.py`
    imports the report, which installs Plan.explain()'s renderer (planner.plan)."""
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            if module == "planner" and target == "planner.report":
                continue
            if _tier(target) > _tier(module):
                upward.append(f"{module} imports {target}")
    assert not upward, "a lower layer imports a higher one: " + "; ".join(sorted(upward))


def test_the_cycle_search_names_a_cycle():
    """The check itself: a made-up graph with one cycle and one chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert (_tier("planner.cli.train") > _tier("planner.report.plot") > _tier("executor.step")
            > _tier("planner.plan") > _tier("strategies.catalog") > _tier("profiler.trace"))
