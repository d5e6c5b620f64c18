"""The package's import graph has no cycle.

Every ``.py`` file under ``src/zerodp`` is parsed with ``ast`` and every import of a zerodp
module becomes an edge: module-level imports, imports inside functions, and imports under
``if TYPE_CHECKING:`` alike (an annotation-only import still says that one module depends on
the other). Relative imports are resolved against the importing module's package. Importing a
package (``import zerodp.checkpoint``, ``from zerodp import checkpoint`` where ``checkpoint`` is
a package) is an edge to its ``__init__.py``; ``from pkg import name`` where ``pkg.name`` is a
module is an edge to that module, otherwise to ``pkg/__init__.py``. The parent packages Python
initializes on the way to a module are not edges (every module would otherwise depend on
``zerodp/__init__.py``).

No edge is excluded: the top-level ``zerodp/__init__.py`` takes part like any other module.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "zerodp"


def module_files(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module and package under ``src/package``."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(importer: str, is_package: bool, level: int, module: Optional[str]) -> str:
    """The absolute name a (possibly relative) ``from ... import`` refers to."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_edges(modules: dict[str, Path], package: str = PACKAGE) -> dict[str, dict[str, int]]:
    """Importer -> {imported module: line of the first such import}, within ``package``."""
    edges: dict[str, dict[str, int]] = {name: {} for name in modules}

    def add(importer: str, target: str, line: int) -> None:
        if target == importer or target not in modules:
            return
        edges[importer].setdefault(target, line)

    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        add(name, alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                if base != package and not base.startswith(package + "."):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(name, sub if sub in modules else base, node.lineno)
    return edges


def find_cycle(edges: dict[str, dict[str, int]]) -> Optional[list[str]]:
    """A cycle ``[a, b, ..., a]`` of the graph, or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(edges, WHITE)
    for start in sorted(edges):
        if color[start] != WHITE:
            continue
        color[start] = GREY
        stack = [(start, iter(sorted(edges[start])))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                color[node] = BLACK
                stack.pop()
            elif color[child] == GREY:
                path = [n for n, _ in stack]
                return path[path.index(child):] + [child]
            elif color[child] == WHITE:
                color[child] = GREY
                stack.append((child, iter(sorted(edges[child]))))
    return None


def describe(cycle: list[str], edges: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    lines = [f"import cycle of {len(cycle) - 1} modules:"]
    for a, b in zip(cycle, cycle[1:]):
        where = modules[a].relative_to(SRC)
        lines.append(f"  {a} imports {b}  ({where}:{edges[a][b]})")
    return "\n".join(lines)


def test_the_import_graph_has_no_cycle():
    modules = module_files()
    assert f"{PACKAGE}.engine.engine" in modules and f"{PACKAGE}.checkpoint.save" in modules
    edges = import_edges(modules)
    assert sum(map(len, edges.values())) > 50, "too few import edges found: the parser misses imports"
    cycle = find_cycle(edges)
    assert cycle is None, describe(cycle, edges, modules)


def test_checkpoints_see_the_engine_only_through_its_view():
    """``checkpoint/`` and ``core/view.py`` import nothing of ``engine/``, not even for
    annotations: a checkpoint is given a ``CheckpointView``."""
    modules = module_files()
    edges = import_edges(modules)
    engine = {m for m in modules if m == f"{PACKAGE}.engine" or m.startswith(f"{PACKAGE}.engine.")}
    assert len(engine) >= 3
    importers = [m for m in modules if m == f"{PACKAGE}.checkpoint" or m.startswith(f"{PACKAGE}.checkpoint.")]
    importers.append(f"{PACKAGE}.core.view")
    found = [f"{m} imports {t} ({modules[m].relative_to(SRC)}:{edges[m][t]})"
             for m in importers for t in sorted(engine & edges[m].keys())]
    assert not found, "\n".join(found)


def test_the_checker_finds_cycles_of_every_import_form(tmp_path):
    """Module-level, function-level and TYPE_CHECKING imports, absolute and relative, and
    package imports each close a cycle the checker reports."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from .sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n",
        "d.py": "from . import sub\n",
        "sub/e.py": "",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text, encoding="utf-8")
    modules = module_files(tmp_path, "pkg")
    edges = import_edges(modules, "pkg")
    assert edges["pkg.a"] == {"pkg.b": 1}
    assert edges["pkg.b"] == {"pkg.sub.c": 2}
    assert edges["pkg.sub.c"] == {"pkg.d": 3}
    assert edges["pkg.d"] == {"pkg.sub": 1}
    assert find_cycle(edges) is None
    (pkg / "sub/__init__.py").write_text("from ..a import f\n", encoding="utf-8")
    edges = import_edges(module_files(tmp_path, "pkg"), "pkg")
    cycle = find_cycle(edges)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"pkg.a", "pkg.b", "pkg.sub.c", "pkg.d", "pkg.sub"}


# -- sizes and private names ----------------------------------------------------------------

MAX_LINES = 600


def test_no_source_file_is_over_the_size_line():
    """A file past ~600 lines holds more than one idea: split it along them."""
    sizes = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in module_files().values()}
    assert len(sizes) > 40
    over = [f"{p.relative_to(SRC)}: {n} lines" for p, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not over, "\n".join(over)


#: the classes whose private members stay inside core/ and engine/: the engine and the gradient reducer
PRIVATE_OWNERS = {"engine/engine.py": ("ZeroEngine",), "engine/engine_api.py": ("EngineAPI",),
                  "engine/checkpoint_api.py": ("CheckpointAPI",), "core/reduce.py": ("GradReducer",)}


def private_members(path: Path, classes: tuple[str, ...], methods: bool = True) -> set[str]:
    """The ``_name`` attributes ``classes`` in ``path`` define: methods (unless ``methods`` is
    False) and ``self._name = ...``."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if not (isinstance(node, ast.ClassDef) and node.name in classes):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and methods:
                names.add(sub.name)
            elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                    and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                names.add(sub.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reads(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """``(line, text)`` for each ``x._name`` in ``path`` with ``_name`` in ``names`` and ``x`` not
    ``self`` (a class's own private members are its business)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_nothing_outside_core_and_engine_reads_the_engines_or_reducers_private_members():
    pkg = SRC / PACKAGE
    names = set()
    for rel, classes in PRIVATE_OWNERS.items():
        names |= private_members(pkg / rel, classes)
    assert {"_checkpointer", "_apply_update"} <= names, "the collector misses the engine's private members"
    found = findings(lambda path: private_reads(path, names), lambda rel: rel.split("/")[0] in ("core", "engine"))
    assert not found, "\n".join(found)


def findings(check, skip) -> list[str]:
    """``file:line: text`` of ``check(path)`` over the package's files whose path relative to the
    package (``core/engine.py``) ``skip`` does not exclude."""
    pkg = SRC / PACKAGE
    return [f"{path.relative_to(SRC)}:{line}: {text}" for path in sorted(pkg.rglob("*.py"))
            if not skip(path.relative_to(pkg).as_posix()) for line, text in check(path)]


def test_the_private_read_checker_sees_reads_and_not_own_members(tmp_path):
    owner = tmp_path / "owner.py"
    owner.write_text("class E:\n    def __init__(self):\n        self._state = 1\n"
                     "    def _step(self):\n        return self._state\n", encoding="utf-8")
    names = private_members(owner, ("E",))
    assert names == {"_state", "_step"}
    reader = tmp_path / "reader.py"
    reader.write_text("def f(engine):\n    engine._step()\n    return self._state, engine.public\n",
                      encoding="utf-8")
    assert private_reads(reader, names) == [(2, "engine._step")]


#: A stage-3 unit's state and its prefetch plan's, which only the unit's and the plan's own methods
#: change (``core/gather.py``); ``ShardedParams`` and the rest call those methods.
UNIT_STATE = {"pins", "pending_backward", "state", "plan", "held", "in_backward", "suspended"}
UNIT_STATE_OWNERS = {"core/gather.py"}


def state_writes(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """``(line, text)`` for each assignment (plain or augmented) to ``x.name`` with ``name`` in
    ``names`` and ``x`` not ``self``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in names \
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                found.append((node.lineno, ast.unparse(t)))
    return found


def test_only_the_stage3_object_changes_unit_state():
    found = findings(lambda path: state_writes(path, UNIT_STATE), lambda rel: rel in UNIT_STATE_OWNERS)
    assert not found, "\n".join(found)


def test_the_unit_state_checker_sees_writes(tmp_path):
    f = tmp_path / "w.py"
    f.write_text("def f(engine, unit):\n    unit.pins = 0\n    unit.pending_backward += 1\n"
                 "    self.held = True\n    x = unit.held\n", encoding="utf-8")
    assert state_writes(f, UNIT_STATE) == [(2, "unit.pins"), (3, "unit.pending_backward")]


#: Library modules that still import ``zerodp.tools``: two entry points that hand over to the command
#: line. No other module outside ``tools/`` may; none may import ``examples/``.
IMPORTS_TOOLS_FOR_NOW = {"zerodp.launcher.runner", "zerodp.utils.zero_to_fp32"}


def test_the_library_does_not_import_the_tools_or_the_examples():
    modules = module_files()
    edges = import_edges(modules)
    outside = [m for m in edges if not m.startswith(("zerodp.tools", "zerodp.examples"))]
    examples = sorted(f"{m} imports {t}" for m in outside for t in edges[m] if t.startswith("zerodp.examples"))
    assert not examples, "\n".join(examples)
    tools = {m for m in outside for t in edges[m] if t.startswith("zerodp.tools")}
    assert tools <= IMPORTS_TOOLS_FOR_NOW, sorted(tools - IMPORTS_TOOLS_FOR_NOW)
    assert tools == IMPORTS_TOOLS_FOR_NOW, f"no longer importing tools/: {sorted(IMPORTS_TOOLS_FOR_NOW - tools)}"


def package_of(module: str, package: str = PACKAGE) -> str:
    """The node of ``module`` in the package graph: its first level under ``package``
    (``zerodp.core.engine`` -> ``zerodp.core``; a top-level module such as ``zerodp.comm`` is
    its own node; ``zerodp`` itself is the root)."""
    return ".".join(module.split(".")[:2])


def package_edges(edges: dict[str, dict[str, int]], package: str = PACKAGE) -> dict[str, dict[str, tuple]]:
    """Package -> {package it imports: (one importing module, the module imported, line)}.

    The root (``zerodp/__init__.py``) is left out of this graph: it gathers the public API and
    imports from every package by design, and every module already runs it first (Python
    initializes parent packages), so edges into or out of it say nothing about layering. The
    module-level check above still sees them."""
    out: dict[str, dict[str, tuple]] = {}
    for importer, targets in edges.items():
        a = package_of(importer, package)
        for target, line in targets.items():
            b = package_of(target, package)
            if a != b and package not in (a, b):
                out.setdefault(a, {}).setdefault(b, (importer, target, line))
    for targets in list(out.values()):
        for b in targets:
            out.setdefault(b, {})
    return out


def test_no_package_imports_one_that_imports_it_back():
    """The packages form layers: ``engine/`` over ``checkpoint/``, ``offload/`` and ``parallel/``,
    those over ``core/``; a package cycle (core imports offload, which imports core) means neither
    can be read, changed or tested without the other."""
    modules = module_files()
    graph = package_edges(import_edges(modules))
    assert {f"{PACKAGE}.core", f"{PACKAGE}.engine", f"{PACKAGE}.checkpoint"} <= graph.keys()
    cycle = find_cycle({a: dict.fromkeys(bs, 0) for a, bs in graph.items()})
    if cycle is not None:
        lines = [f"package cycle: {' -> '.join(cycle)}"]
        for a, b in zip(cycle, cycle[1:]):
            importer, target, line = graph[a][b]
            lines.append(f"  {importer} imports {target}  ({modules[importer].relative_to(SRC)}:{line})")
        raise AssertionError("\n".join(lines))


def test_the_package_checker_finds_a_cycle_through_submodules(tmp_path):
    pkg = tmp_path / "pkg"
    for d in ("a", "b", "c"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "__init__.py").write_text("from .a import x\n", encoding="utf-8")
    (pkg / "a" / "x.py").write_text("from ..b import y\n", encoding="utf-8")
    (pkg / "b" / "y.py").write_text("def f():\n    from pkg.a import z\n", encoding="utf-8")
    (pkg / "a" / "z.py").write_text("from ..c import w\n", encoding="utf-8")
    (pkg / "c" / "w.py").write_text("", encoding="utf-8")
    modules = module_files(tmp_path, "pkg")
    graph = package_edges(import_edges(modules, "pkg"), "pkg")
    assert graph["pkg.a"].keys() == {"pkg.b", "pkg.c"} and graph["pkg.b"].keys() == {"pkg.a"}
    assert "pkg" not in graph  # the root's own imports are not package edges
    cycle = find_cycle({a: dict.fromkeys(bs, 0) for a, bs in graph.items()})
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.b"}


def _imported_names(path: Path, modules: dict[str, Path]) -> dict[str, str]:
    """Local name -> the package module it is imported from, for ``path``'s ``from ... import``s."""
    name = next(m for m, p in modules.items() if p == path)
    imported = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(name, path.name == "__init__.py", node.level, node.module)
            imported.update({a.asname or a.name: base for a in node.names if base in modules})
    return imported


def base_private_reads(path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, text)`` for each ``self._name`` in a class of ``path`` whose base class is defined in
    another module of the package (found through the file's ``from ... import`` of it), where
    ``_name`` is private state of that base (``self._name = ...`` there) the subclass does not
    assign itself: a subclass reaching into its base's state, which the base may change without
    knowing. (A base's private methods are left to it and its subclasses: hooks and helpers
    meant for them.)"""
    imported = _imported_names(path, modules)
    found = []
    for cls in (n for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.ClassDef)):
        inherited: set[str] = set()
        for b in cls.bases:
            if isinstance(b, ast.Name) and b.id in imported:
                inherited |= _privates_up(modules[imported[b.id]], b.id, modules)
        own = private_members(path, (cls.name,))
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr in inherited - own:
                found.append((node.lineno, f"self.{node.attr}"))
    return found


def _privates_up(path: Path, cls: str, modules: dict[str, Path]) -> set[str]:
    """``cls``'s private state and that of its bases defined in the package, transitively."""
    names = private_members(path, (cls,), methods=False)
    local = {n.name: n for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.ClassDef)}
    imported = _imported_names(path, modules)
    for b in local[cls].bases if cls in local else []:
        if isinstance(b, ast.Name) and b.id in local:
            names |= _privates_up(path, b.id, modules)
        elif isinstance(b, ast.Name) and b.id in imported:
            names |= _privates_up(modules[imported[b.id]], b.id, modules)
    return names


def test_no_subclass_reads_its_base_classes_private_members():
    modules = module_files()
    found = findings(lambda path: base_private_reads(path, modules), lambda rel: False)
    assert not found, "\n".join(found)


def test_the_subclass_checker_sees_inherited_private_reads(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "base.py").write_text(
        "class Root:\n    def __init__(self):\n        self._deep = 0\n"
        "class Base(Root):\n    def __init__(self):\n        self._gas = 1\n    def _step(self):\n        pass\n",
        encoding="utf-8")
    (pkg / "sub.py").write_text(
        "from .base import Base\n"
        "class Sub(Base):\n    def __init__(self):\n        self._mine = 2\n"
        "    def run(self):\n        return self._gas, self._mine, self._deep, self.public, self._step()\n",
        encoding="utf-8")
    modules = module_files(tmp_path, "pkg")
    assert base_private_reads(pkg / "sub.py", modules) == [(6, "self._gas"), (6, "self._deep")]


#: torch.distributed's collectives (and the group-wide object and barrier forms)
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
               "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv"}
#: The files that may call them directly: the module every collective goes through; DeepSpeed's
#: ``deepspeed.comm``, whose functions are torch's own, passed through by design; and the cluster
#: probe, which times torch's collectives themselves.
COLLECTIVE_OWNERS = {"core/collectives.py", "comm.py", "estimator/cluster.py"}


def collective_calls(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` for each call ``dist.<collective>(...)`` or ``torch.distributed.<collective>(...)``
    (also ``_dist.``, the alias ``comm.py`` uses)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "_dist", "torch.distributed"):
                found.append((node.lineno, ast.unparse(node.func)))
    return found


def test_every_collective_goes_through_the_collectives_module():
    """Collectives are explicit and counted in one place (``core/collectives.py``'s ``Comm``): no other
    module calls ``torch.distributed``'s collectives itself."""
    found = findings(collective_calls, lambda rel: rel in COLLECTIVE_OWNERS)
    assert not found, "\n".join(found)


def test_the_collective_checker_sees_calls(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import torch.distributed as dist\nimport torch\n"
                 "def f(t, comm):\n    dist.all_reduce(t)\n    torch.distributed.broadcast(t, 0)\n"
                 "    comm.all_reduce(t)\n    dist.new_group([0])\n", encoding="utf-8")
    assert collective_calls(f) == [(4, "dist.all_reduce"), (5, "torch.distributed.broadcast")]


#: The most methods a class may have; a class that needs more is two ideas.
MAX_METHODS = 30


def test_no_internal_class_has_more_than_thirty_methods():
    over = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        rel = path.relative_to(SRC / PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in node.body)
                if n > MAX_METHODS:
                    over.append(f"{rel}: {node.name} has {n} methods")
    assert not over, "\n".join(over)


#: A flat group's parts (layout, parameter storage, gradients) set their own fields; others call methods.
FLAT_GROUP_FILES = ("core/flat.py", "core/group_layout.py", "core/grads.py")


def own_fields(paths: list[Path]) -> set[str]:
    """Attributes the classes in ``paths`` assign on ``self`` or declare in their body (dataclass fields)."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names |= {x.target.id for x in node.body if isinstance(x, ast.AnnAssign)
                          and isinstance(x.target, ast.Name)}
    return names


def test_no_module_sets_a_flat_groups_fields():
    pkg = SRC / PACKAGE
    mine = own_fields([pkg / rel for rel in FLAT_GROUP_FILES])
    others = own_fields([p for p in pkg.rglob("*.py") if p.relative_to(pkg).as_posix() not in FLAT_GROUP_FILES])
    fields = mine - others  # names other classes also use for their own fields say nothing
    assert {"holds", "optim", "counted_here", "shard_page", "full"} <= fields
    found = findings(lambda path: state_writes(path, fields), lambda rel: rel in FLAT_GROUP_FILES)
    assert not found, "\n".join(found)
