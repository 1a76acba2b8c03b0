"""The import graph keeps the layout's rules: each layer imports only layers below it or its own, no two modules
import each other (directly or round a longer circle), generic layers never import the task, and no product module
imports the instruments (benchmarks/) or the tests. Imports inside functions count: they are dependencies too."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("slime_search", "megatron_bridge", "local_dense_retriever", "benchmarks", "tools")

# Lowest first. A module may import its own layer and the ones below; the composition roots (the CLI, the driver,
# the run folder, the report, evaluation, the miniature) sit above every stage; instruments and tools above all.
LAYERS = (
    ("slime_search.utils", "slime_search.types", "slime_search.plugins", "slime_search.compat", "slime_search.algo",
     "slime_search.config",
     "slime_search.models", "slime_search.metrics", "slime_search.evaluation", "megatron_bridge",
     "local_dense_retriever"),
    ("slime_search.engines", "slime_search.backends"),
    ("slime_search.weight_sync", "slime_search.rollout"),
    ("slime_search.ray",),
    ("slime_search.search_r1", "slime_search.health"),
    ("slime_search.arguments", "slime_search.run", "slime_search.report",
     "slime_search.eval", "slime_search.miniature", "slime_search.train", "slime_search"),
    ("benchmarks.harness",),
    ("benchmarks", "tools"),
)  # fmt: skip
TASK = ("slime_search.search_r1",)
GENERIC = LAYERS[0] + LAYERS[1] + LAYERS[2] + LAYERS[3] + ("slime_search.health",)
INSTRUMENTS = ("benchmarks", "tools", "tests")
# Each module (or package) directly under these is one instrument: it may import the product and the harness, and
# not another instrument (what two share goes to benchmarks/harness/).
INSTRUMENT_ROOMS = ("benchmarks.perf", "benchmarks.studies", "tools")


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolves to its longest module prefix)."""
    modules = module_files()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        targets = {resolve(name) for name in imported_names(path)} - {None, module}
        # `from package import name` also names the package itself: not an import of it when a submodule resolved
        graph[module] = {t for t in targets if not any(o.startswith(t + ".") for o in targets if o != t)}
    return graph


def owner(module: str, groups) -> str | None:
    """The longest group name that `module` is or lies under."""
    matches = [g for g in groups if module == g or module.startswith(g + ".")]
    return max(matches, key=len, default=None)


def layer_of(module: str) -> int:
    all_groups = [g for layer in LAYERS for g in layer]
    group = owner(module, all_groups)
    assert group is not None, f"{module} is in no layer: add its package to LAYERS"
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def upward_imports(graph) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def circles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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


def test_every_project_module_is_in_a_layer_and_none_imports_upward():
    graph = import_graph()
    assert len(graph) > 100  # the walk found the project, not an empty folder
    assert upward_imports(graph) == []


def test_no_modules_import_each_other_round_a_circle():
    assert circles(import_graph()) == []


def test_generic_layers_never_import_the_task():
    graph = import_graph()
    leaks = [f"{a} -> {b}" for a, ts in graph.items() for b in ts if owner(a, GENERIC) and owner(b, TASK)]
    assert leaks == []


def test_no_product_module_imports_an_instrument_or_a_test():
    product = {m: ts for m, ts in import_graph().items() if not owner(m, INSTRUMENTS)}
    names = {m: imported_names(module_files()[m]) for m in product}
    leaks = sorted(f"{m} -> {n}" for m, ns in names.items() for n in ns if n.split(".")[0] in INSTRUMENTS)
    assert leaks == []


def instrument_of(module: str) -> str | None:
    """The instrument `module` belongs to: its room and the next name (`benchmarks.studies.guard_week`)."""
    room = owner(module, INSTRUMENT_ROOMS)
    if room is None or module == room:
        return None
    return ".".join(module.split(".")[: room.count(".") + 2])


def imports_between_instruments(graph) -> list[str]:
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if instrument_of(a) and instrument_of(b) and instrument_of(a) != instrument_of(b)
    )


def test_no_instrument_imports_another_except_through_the_harness():
    graph = import_graph()
    assert sum(1 for m in graph if instrument_of(m)) > 40  # the rooms were found
    assert imports_between_instruments(graph) == []


def test_the_checks_see_what_they_are_meant_to_catch():
    """The checks on small made-up graphs: an upward import, a circle of three, and none where there is none."""
    assert upward_imports({"slime_search.rollout.x": {"slime_search.train"}}) == ["slime_search.rollout.x -> slime_search.train"]  # fmt: skip
    assert upward_imports({"slime_search.train": {"slime_search.rollout.x"}}) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert imported_names(Path(__file__)) >= {"ast", "pathlib.Path", "pathlib"}
    sideways = {
        "benchmarks.perf.a": {"benchmarks.perf.b", "benchmarks.harness.c"},
        "tools.gpu_check.x": {"tools.gpu_check.y"},
    }
    assert imports_between_instruments(sideways) == ["benchmarks.perf.a -> benchmarks.perf.b"]
    assert instrument_of("benchmarks.studies.guard_week.world") == "benchmarks.studies.guard_week"
