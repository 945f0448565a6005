"""The package's shape: no import cycle, short files, a small Mask protocol.

The import graph counts every import statement, the ones inside functions too (a lazy
import is still a dependency) and the ones under `if TYPE_CHECKING:` (a type named is a
dependency a reader follows; a helper below a module takes a Protocol instead).
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


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports (`from attnkit import cost` is attnkit.cost)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(tree):
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


def test_the_cycle_finder_sees_lazy_and_type_checking_imports(tmp_path):
    """The check can fail: a function-level or type-checking import back is a cycle."""
    source = tmp_path / "x.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from attnkit.masks import base\n"
        "def f():\n    from attnkit import cost\n    from .y import g\n"
    )
    modules = {name: Path() for name in ("attnkit.x", "attnkit.y", "attnkit.cost", "attnkit.masks")}
    assert _imports("attnkit.x", source, modules) == {"attnkit.cost", "attnkit.masks", "attnkit.y"}
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


def _private_imports(name: str, tree: ast.AST, package: str) -> list[str]:
    """`from attnkit.<package>... import _Name` outside the package: its private kinds."""
    return [
        f"{name}:{node.lineno} {alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith(f"attnkit.{package}")
        and not name.startswith(f"attnkit.{package}")
        for alias in node.names
        if alias.name.startswith("_")
    ]


def test_no_private_mask_kind_is_imported_outside_masks():
    """Callers read a mask's make-up through `masks.structure` (`packed_documents`,
    `key_paddings`, `trailing_window`, ...), never by switching on a private kind."""
    found = [
        line
        for name, path in _modules().items()
        for line in _private_imports(name, ast.parse(path.read_text(encoding="utf-8")), "masks")
    ]
    assert not found, f"private mask kinds imported outside attnkit/masks: {found}"
    sample = ast.parse("from attnkit.masks.base import _Combine, as_mask\n")
    assert _private_imports("attnkit.call.x", sample, "masks") == ["attnkit.call.x:1 _Combine"]


def test_the_kernels_are_reached_through_the_registry():
    """attnkit's native kernels are a backend's: a call, a paged decoding step or a
    flash-attention cache asks the registry (`Backend.run`, `Backend.paged_decode`); only
    `backends/` imports them, and the runtime, which loads them."""
    modules = _modules()
    found = [
        name
        for name, path in modules.items()
        if not name.startswith(("attnkit.backends", "attnkit.native"))
        and name != STATE_HOLDER
        and any(target.startswith("attnkit.native") for target in _imports(name, path, modules))
    ]
    assert not found, f"modules outside attnkit/backends reaching the kernels: {found}"


TYPE_IGNORES = 10  # torch's untyped doors (`_compat`), version-dependent stubs, the fit


def test_the_type_checker_is_silenced_rarely():
    """Types say what flows: `# type: ignore` only where torch's stubs or an optional
    dependency leave no other way."""
    marker = "type: " + "ignore"
    found = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in PACKAGE.rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if marker in line
    ]
    assert len(found) <= TYPE_IGNORES, f"{len(found)} type: ignore comments: {found}"


def test_no_source_file_is_long():
    """Python and the kernels' C++ alike."""
    sources = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.h")]
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in sources
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by concept): {long}"


BACKEND_NAMES = {"sdpa", "native", "tiled", "flex", "blockwise", "reference"}


def _names_a_backend(node: ast.AST) -> bool:
    """`backend == "sdpa"`, `b.name != "flex"`, `backends.get("tiled")`: a literal
    backend name tested against, or looked up in, something that holds backends."""
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        literal = any(isinstance(x, ast.Constant) and x.value in BACKEND_NAMES for x in sides)
        held = [ast.unparse(x) for x in sides if not isinstance(x, ast.Constant)]
        return literal and any("backend" in h or h.endswith(".name") for h in held)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        literal = bool(node.args) and isinstance(node.args[0], ast.Constant)
        holder = ast.unparse(node.func.value)
        return literal and node.func.attr == "get" and holder.endswith("backends")
    return False


def _literal_backend_lookups(tree: ast.AST) -> list[int]:
    """Lines of `BACKENDS["name"]` and `get_backend("name")` with a literal name, and of
    a backend's name tested or looked up (`_names_a_backend`)."""
    found = []
    for node in ast.walk(tree):
        literal = isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
        if literal and ast.unparse(node.value).endswith("BACKENDS"):
            found.append(node.lineno)
        called = isinstance(node, ast.Call) and ast.unparse(node.func).endswith("get_backend")
        if called and node.args and isinstance(node.args[0], ast.Constant):
            found.append(node.lineno)
        if _names_a_backend(node):
            found.append(node.lineno)
    return found


def test_no_module_outside_backends_looks_a_backend_up_by_its_name():
    """A backend owns what it does; callers ask the interface (`fastest_on_dense`,
    `serves_backward`, `version`, `work`, `intermediates`), never test its name, so
    adding one touches `backends/` alone."""
    found = [
        f"{name}:{line}"
        for name, path in _modules().items()
        if not name.startswith("attnkit.backends")
        for line in _literal_backend_lookups(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not found, f"backends looked up by a literal name outside attnkit/backends: {found}"
    sample = ast.parse(
        'BACKENDS["sdpa"].run()\nget_backend("tiled")\nget_backend(name)\n'
        'if backend.name == "reference": pass\nrt.backends.get("flex")\n'
        'if backend == "flex" and choice == "native": pass\nif choice == "native": pass\n'
    )
    assert sorted(_literal_backend_lookups(sample)) == [1, 2, 4, 5, 6]  # the check can fail


CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Recent", "ByMask"}
CONTAINERS |= {"WeakKeyDictionary", "WeakValueDictionary"}
MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "update", "add", "discard"}
MUTATORS |= {"setdefault", "put", "popitem", "__setitem__"}
# the one module that holds the process's state (`Runtime`)
STATE_HOLDER = "attnkit.runtime"


def _containers(tree: ast.Module) -> set[str]:
    """Names bound at module level to a mutable container."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            value, targets = node.value, node.targets
        elif isinstance(node, ast.AnnAssign):
            value, targets = node.value, [node.target]
        else:
            continue
        literal = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp))
        made = isinstance(value, ast.Call) and _last_name(value.func) in CONTAINERS
        if literal or made:
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _last_name(node: ast.expr) -> str:
    return ast.unparse(node).rpartition(".")[2]


def _changed(node: ast.AST) -> str | None:
    """The name a statement or call changes in place (`X[k] = v`, `X.append(v)`, `X += v`)."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for target in targets:
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                return target.value.id
            if isinstance(node, ast.AugAssign) and isinstance(target, ast.Name):
                return target.id
    method = _mutator(node)
    return method.value.id if method is not None and isinstance(method.value, ast.Name) else None


def _mutator(node: ast.AST) -> ast.Attribute | None:
    """`X.append` of a call `X.append(v)` (any method in `MUTATORS`), else None."""
    func = node.func if isinstance(node, ast.Call) else None
    return func if isinstance(func, ast.Attribute) and func.attr in MUTATORS else None


def _class_attributes_set(tree: ast.Module, classes: set[str]) -> set[str]:
    """`Cls.attr = v`, `Cls.attr[k] = v` or `Cls.attr.update(...)` outside the class's
    body: a class used as a registry (filled at import or at run time)."""
    changed: list[ast.expr] = []
    for node in ast.walk(tree):
        method = _mutator(node)
        if method is not None:
            changed.append(method.value)
        for target in node.targets if isinstance(node, ast.Assign) else []:
            while isinstance(target, ast.Subscript):
                target = target.value
            changed.append(target)
    return {
        f"{target.value.id}.{target.attr} set at run time"
        for target in changed
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id in classes
    }


def _state(tree: ast.Module, classes: set[str]) -> set[str]:
    """What a module keeps across calls: module-level containers it changes, `global`,
    memoizing decorators, class attributes set at run time."""
    containers = _containers(tree)
    found = {
        f"{name} changed in place" for n in ast.walk(tree) if (name := _changed(n)) in containers
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(f"global {name}" for name in node.names)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                text = ast.unparse(decorator)
                if text.rpartition(".")[2] in {"cache", "lru_cache"} or "lru_cache(" in text:
                    found.add(f"@{text} {node.name}")
    return found | _class_attributes_set(tree, classes)


def _package_state() -> set[str]:
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in _modules().items()}
    classes = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    return {
        f"{name}: {what}"
        for name, tree in trees.items()
        if name != STATE_HOLDER
        for what in _state(tree, classes)
    }


def test_the_process_state_lives_in_the_runtime():
    """What the process remembers lives in one object (`attnkit.runtime.Runtime`): no
    other module keeps a container it changes, a `global`, a memo or a class used as a
    registry."""
    found = _package_state()
    assert not found, f"state outside attnkit.runtime: {sorted(found)}"
    sample = ast.parse(
        "import functools\n_SEEN = {}\n_N = 0\nclass K:\n    memo = {}\n    kinds = {}\n"
        "def f(x):\n    global _N\n    _SEEN[x] = 1\n    K.memo = {}\n"
        "@functools.cache\ndef g():\n    return 1\nK.kinds.update(a=1)\n"
    )
    assert _state(sample, {"K"}) == {  # the check can fail
        "_SEEN changed in place",
        "global _N",
        "@functools.cache g",
        "K.memo set at run time",
        "K.kinds set at run time",
    }


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
