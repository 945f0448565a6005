"""The package's shape: no import cycle, short files, a small Mask protocol.

The import graph counts every import statement, the ones inside functions too (a lazy
import is still a dependency); imports under `if TYPE_CHECKING:` are for the type
checker only and never run, so they do not count.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import attnkit as ak

PACKAGE = Path(ak.__file__).parent
MAX_LINES = 450
MASK_NAMES = 16


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports (`from attnkit import cost` is attnkit.cost)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = _type_checking_nodes(tree)
    named: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                named.add(full if full in modules else base)
    found = set()
    for target in named:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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


def test_no_module_imports_itself_back():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = _cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in cycles]
    assert not cycles, f"import cycles (module -> the members it imports): {detail}"


def test_the_cycle_finder_sees_a_lazy_import_and_skips_type_checking(tmp_path):
    """The check can fail: a function-level import back is a cycle."""
    source = tmp_path / "x.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from attnkit.masks import base\n"
        "def f():\n    from attnkit import cost\n    from .y import g\n"
    )
    modules = {name: Path() for name in ("attnkit.x", "attnkit.y", "attnkit.cost", "attnkit.masks")}
    assert _imports("attnkit.x", source, modules) == {"attnkit.cost", "attnkit.y"}
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


TOP_FLOOR = 12


def test_the_top_floor_is_small_and_each_folder_says_what_lives_there():
    """Concepts live in folders (`call/`, `masks/`, `backends/`, `kv/`, `dropins/`, ...),
    each opening with a docstring; few modules sit directly in the package."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_FLOOR, f"{len(top)} modules directly in attnkit/: {top}"
    for init in PACKAGE.glob("*/__init__.py"):
        tree = ast.parse(init.read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), f"{init.parent.name}/ says nothing of what it holds"


def test_no_line_is_kept_from_the_formatter():
    """The line cap is met by structure: no formatter directive folds lines, in the
    package or its tests."""
    marker = "# fmt" + ": "  # off, on, skip
    roots = (PACKAGE, Path(__file__).parent)
    found = [
        f"{path.name}:{n}"
        for root in roots
        for path in root.rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if marker in line
    ]
    assert not found, f"formatter directives: {found}"


def test_mask_has_a_small_protocol():
    names = sorted(n for n in dir(ak.Mask) if not n.startswith("_"))
    assert len(names) <= MASK_NAMES, f"Mask has {len(names)} public names: {names}"
    for kind in ("predicate", "key_spans", "describe"):
        assert kind in names


CONCRETE_BACKENDS = {
    "ReferenceBackend",
    "SdpaBackend",
    "TiledBackend",
    "FlexBackend",
    "BlockwiseBackend",
}


def test_no_module_outside_backends_names_a_concrete_backend():
    """Callers go through the interface (`backends.protocol.Backend`), never a class."""
    found = []
    for name, path in _modules().items():
        if name.startswith("attnkit.backends"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            named = {
                ast.Name: lambda n: n.id,
                ast.Attribute: lambda n: n.attr,
                ast.alias: lambda n: n.name.rpartition(".")[2],
            }.get(type(node))
            if named is not None and named(node) in CONCRETE_BACKENDS:
                found.append(f"{name}:{getattr(node, 'lineno', '?')} {named(node)}")
    assert not found, f"concrete backends named outside attnkit/backends: {found}"


def test_no_source_file_is_long():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by concept): {long}"


def _literal_backend_lookups(tree: ast.AST) -> list[int]:
    """Lines of `BACKENDS["name"]` and `get_backend("name")` with a literal name."""
    found = []
    for node in ast.walk(tree):
        literal = isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
        if literal and ast.unparse(node.value).endswith("BACKENDS"):
            found.append(node.lineno)
        called = isinstance(node, ast.Call) and ast.unparse(node.func).endswith("get_backend")
        if called and node.args and isinstance(node.args[0], ast.Constant):
            found.append(node.lineno)
    return found


def test_no_module_outside_backends_looks_a_backend_up_by_its_name():
    """A backend owns what it does; callers ask the interface (`dense_fastest`,
    `serves_backward`, `version`), so adding one touches `backends/` alone."""
    found = [
        f"{name}:{line}"
        for name, path in _modules().items()
        if not name.startswith("attnkit.backends")
        for line in _literal_backend_lookups(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not found, f"backends looked up by a literal name outside attnkit/backends: {found}"
    sample = ast.parse('BACKENDS["sdpa"].run()\nget_backend("tiled")\nget_backend(name)\n')
    assert sorted(_literal_backend_lookups(sample)) == [1, 2]  # the check can fail


CACHE_TYPES = {"Bounded", "PerMask", "WeakKeyDictionary", "WeakValueDictionary"}
# the process-wide caches: attention()'s prepared calls (the cost table is `cost`'s
# active table, a value it is given)
CACHES = {"attnkit.call.dispatch._CALLS"}


def _module_caches(name: str, tree: ast.Module) -> set[str]:
    found = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call):
            called = ast.unparse(value.func).rpartition(".")[2]
            if called in CACHE_TYPES:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.update(f"{name}.{ast.unparse(t)}" for t in targets)
    return found


def test_process_wide_caches_are_the_known_few():
    """What a call derives belongs to its prepared call (`attnkit.call.prepared`): no module
    keeps a cache of its own beyond these."""
    found = set()
    for name, path in _modules().items():
        found |= _module_caches(name, ast.parse(path.read_text(encoding="utf-8")))
    assert found <= CACHES, f"new module-level caches: {sorted(found - CACHES)}"
    sample = ast.parse("_X: Bounded[int, int] = Bounded(4)\n_Y = weakref.WeakKeyDictionary()\n")
    assert _module_caches("m", sample) == {"m._X", "m._Y"}  # the check can fail


VAGUE_NAMES = {"found", "held", "lane", "who"}  # names that say nothing of the value


def _vague_names(source: str) -> set[str]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME and t.string in VAGUE_NAMES}


def test_names_say_what_they_hold():
    """A variable is named after what it is (`plan`, `spans`, `entry`), never `found` or
    `held`; the words stay free in comments and docstrings."""
    vague = {
        name: sorted(used)
        for name, path in _modules().items()
        if (used := _vague_names(path.read_text(encoding="utf-8")))
    }
    assert not vague, f"vague names: {vague}"
    assert _vague_names("found = 1  # found\n'''held'''\n") == {"found"}  # the check can fail
