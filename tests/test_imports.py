"""No import cycles in planner/, backend/, cli/ and web/, imports inside functions included.

A cycle hidden behind a function-level import works until someone lifts the import or adds one
more edge; then a module reads a name its half-initialised partner has not defined yet. The graph
is read from the source (ast), so a cycle fails here whether or not a test happens to run it.

Imports under ``if TYPE_CHECKING:`` count too, with no exception: they never execute, but a type
two modules both need belongs below both (``AttentionSpec`` in planner/model/attention/spec.py,
``Launch`` beside its ``Launcher``, ``PhasePlan`` in planner/memory/phase_plan.py, ``Finetune`` in
planner/recipes/finetune_fields.py), or the next runtime import makes the cycle real. The mechanisms
the resolved ``Setup`` (planner/setup.py) composes take the Protocol of what they read of it,
``SetupFields`` (planner/setup_fields.py), which the tests below keep equal to Setup.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("planner", "backend", "cli", "web")


def _modules() -> dict[str, Path]:
    found = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    def is_flag(test: ast.expr) -> bool:
        return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
            (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")

    return {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and is_flag(block.test)
            for statement in block.body for node in ast.walk(statement)}


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The modules of this tree an import statement executes."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = package[: len(package) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        # `from planner import memory` imports the module planner.memory.orchestrator; `from x import name` imports x
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    else:
        return []
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_graph(type_checking: bool = True) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}; ``type_checking``: with the
    imports under ``if TYPE_CHECKING:``."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        type_only = _type_checking_only(tree)
        for node in ast.walk(tree):
            for target in _targets(node, module, path.name == "__init__.py", modules):
                if id(node) in type_only and not type_checking:
                    continue
                graph.setdefault(module, {}).setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    described = ["; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in c for b in graph.get(a, {}) if b in c)
                 for c in found]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    # the checker itself: a function-level import and a relative one are edges, TYPE_CHECKING ones too
    graph = import_graph()
    assert "backend.train_experts" in graph["backend.rank"]  # imported inside engine_for
    assert "planner.frameworks.deepspeed.v0_19" in graph["planner.frameworks"]
    assert "planner.setup" in graph["planner.parallel.pipeline"]  # Setup, under TYPE_CHECKING: no cycle there
    # mla.py imports AttentionSpec under TYPE_CHECKING only: an edge, absent without type_checking
    assert "planner.model.attention.spec" in graph["planner.model.attention.mla"]
    assert "planner.model.attention.spec" not in import_graph(type_checking=False)["planner.model.attention.mla"]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_a_cycle_through_a_type_checking_import_fails(tmp_path, monkeypatch):
    # a.py needs b's type for checking only, b imports a: a cycle here, none without type_checking;
    # Setup's module is no exception (a mechanism naming Setup under TYPE_CHECKING while setup.py
    # imports it is the cycle SetupFields is there to avoid)
    (tmp_path / "planner").mkdir()
    (tmp_path / "planner" / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                               "if TYPE_CHECKING:\n    from planner.b import B\n")
    (tmp_path / "planner" / "b.py").write_text("from planner.a import A\n")
    (tmp_path / "planner" / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                               "if TYPE_CHECKING:\n    from planner.setup import Setup\n")
    (tmp_path / "planner" / "setup.py").write_text("from planner.c import C\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "TOPS", ("planner",))
    assert cycles(import_graph()) == [["planner.a", "planner.b"], ["planner.c", "planner.setup"]]
    assert cycles(import_graph(type_checking=False)) == []


def _setup_fields_users() -> dict[str, Path]:
    graph = import_graph()
    return {m: p for m, p in _modules().items() if "planner.setup_fields" in graph.get(m, {})}


def test_setup_provides_every_member_of_setup_fields_with_the_same_type():
    # SetupFields restates Setup's members the mechanisms read; a renamed or retyped field of Setup
    # fails here rather than leaving the Protocol describing a Setup that no longer exists
    import dataclasses

    from planner.setup import Setup
    from planner.setup_fields import SetupFields

    declared = {f.name: f.type for f in dataclasses.fields(Setup)}
    declared |= {name: value.fget.__annotations__["return"] for name, value in vars(Setup).items()
                 if isinstance(value, property)}
    wanted = SetupFields.__annotations__
    assert not set(wanted) - set(declared), f"SetupFields names what Setup lacks: {set(wanted) - set(declared)}"
    differ = {name: (kind, declared[name]) for name, kind in wanted.items() if kind != declared[name] and kind != "Any"}
    assert not differ, f"SetupFields' types differ from Setup's (protocol, Setup): {differ}"


def test_what_the_mechanisms_read_of_a_setup_is_in_setup_fields():
    # each module that takes SetupFields reads only its members off a ``setup``: the Protocol says
    # what they depend on, so a new read is a new line there (and in Setup) rather than a silent one
    from planner.setup_fields import SetupFields

    members = set(SetupFields.__annotations__)
    users = _setup_fields_users()
    assert "planner.frameworks.base" in users and "planner.memory.optimizer" in users
    read = {f"{module}:{node.lineno} setup.{node.attr}" for module, path in users.items()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "setup"
            and node.attr not in members}
    assert not read, f"reads beyond planner/setup_fields.py's SetupFields: {sorted(read)}"


def test_web_imports_no_private_name_of_another_module():
    for path in sorted((ROOT / "web").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in TOPS:
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private, f"{path.relative_to(ROOT)}:{node.lineno} imports {private} from {node.module}"


def test_architecture_doc_names_every_module():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [p.relative_to(ROOT).as_posix() for top in TOPS for p in sorted((ROOT / top).rglob("*.py"))
               if f"`{p.relative_to(ROOT).as_posix()}`" not in doc]
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}: run python bench/architecture_doc.py"


# Framework and strategy names compared outside planner/frameworks/ and the shorthand parser
# (planner/strategies.py): none. The code asks the Framework (planner/frameworks/base.py: its
# defaults, what it supports, what it launches, its config files) or the Strategy (what it shards,
# over which group); a comparison anywhere else fails here (the plan's search asks
# Framework.takes_layout and tp_sequence_parallel since its split: issue 25).
FRAMEWORK_NAMES = {"zero0", "zero1", "zero2", "zero3", "ddp", "fsdp", "fsdp-grad-op", "hsdp", "deepspeed", "torch"}
NAME_COMPARISONS_LEFT: dict[str, int] = {}


def name_comparisons(path: Path) -> int:
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            values = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
            values += [e.value for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set))
                       for e in c.elts if isinstance(e, ast.Constant)]
            count += any(isinstance(v, str) and v in FRAMEWORK_NAMES for v in values)
    return count


def test_no_new_framework_or_strategy_name_compared_outside_the_frameworks():
    found = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("planner/frameworks/") or rel == "planner/strategies.py":
                continue
            count = name_comparisons(path)
            if count > NAME_COMPARISONS_LEFT.get(rel, 0):
                found[rel] = f"{count} (at most {NAME_COMPARISONS_LEFT.get(rel, 0)})"
    assert not found, f"framework/strategy names compared outside planner/frameworks/: {found}; ask the Framework"


def test_the_name_check_counts_each_form_of_comparison(tmp_path):
    path = tmp_path / "x.py"
    path.write_text('a = s == "zero3"\nb = s in ("ddp", "fsdp")\nc = fw.name != "torch"\nd = s == "adamw"\n')
    assert name_comparisons(path) == 3
