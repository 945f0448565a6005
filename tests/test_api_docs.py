"""The API reference teaches: every public name the reference page lists has its
arguments, what it returns and an example, and every example runs (as a doctest, with
`torch` and `attnkit as ak` imported, as the reference page says)."""

from __future__ import annotations

import doctest
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit as ak

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference"  # a page a topic


def _public() -> list[tuple[str, str, Any]]:
    """(module, name, object) of every name the reference page documents: a module's
    `__all__`, or the members its `::: module` entry lists."""
    found = []
    text = "\n".join(page.read_text() for page in sorted(REFERENCE.glob("*.md")))
    for match in re.finditer(r"^::: ([\w.]+)\n((?:    .*\n)*)", text, re.MULTILINE):
        module = importlib.import_module(match.group(1))
        listed = re.search(r"members: \[([^\]]*)\]", match.group(2))
        names = [n.strip() for n in listed.group(1).split(",")] if listed else module.__all__
        found += [(module.__name__, n, getattr(module, n)) for n in names]
    return found


PUBLIC = _public()
# functions and classes (a type alias such as `masks.Align` documents itself in its line)
DOCUMENTED = [(m, n, o) for m, n, o in PUBLIC if inspect.isroutine(o) or inspect.isclass(o)]


def _takes_arguments(obj: Any) -> bool:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    return any(p not in ("self", "cls") for p in parameters)


def _returns_something(obj: Any) -> bool:
    if inspect.isclass(obj):
        return False  # the instance: the class's own description says what it is
    try:
        annotation = inspect.signature(obj).return_annotation
    except (TypeError, ValueError):
        return True
    return annotation not in (None, "None", inspect.Signature.empty)


def test_the_reference_pages_list_every_public_module_and_name_once():
    modules = {m for m, _, _ in PUBLIC}
    assert {"attnkit", "attnkit.masks", "attnkit.dropins", "attnkit.widgets"} <= modules
    assert len(PUBLIC) >= 90
    top = [n for m, n, _ in PUBLIC if m == "attnkit"]
    assert len(top) == len(set(top))  # a name on one page
    assert set(ak.__all__) - set(top) == {"flash_attn"}  # the module: its own entry


def test_the_calls_page_opens_with_attention():
    calls = (REFERENCE / "calls.md").read_text()
    assert re.search(r"members: \[attention,", calls)


@pytest.mark.parametrize(("module", "name", "obj"), DOCUMENTED, ids=lambda x: str(x)[:40])
def test_every_public_name_says_its_arguments_returns_and_an_example(module, name, obj):
    doc = inspect.getdoc(obj) or ""
    wanted = ["Example"]  # an error: when it is raised, shown
    if not (inspect.isclass(obj) and issubclass(obj, Exception)):
        wanted += ["Args:"] if _takes_arguments(obj) else []
        wanted += ["Returns:"] if _returns_something(obj) else []
    if inspect.isclass(obj) and issubclass(obj, tuple) and "Attributes:" in doc:
        wanted = [w if w != "Args:" else "Attributes:" for w in wanted]  # a NamedTuple's fields
    missing = [w for w in wanted if w not in doc]
    assert not missing, f"{module}.{name}: no {', '.join(missing)} in its docstring"
    assert ">>>" in doc, f"{module}.{name}: its example has no line that runs"


@pytest.mark.parametrize(("module", "name", "obj"), DOCUMENTED, ids=lambda x: str(x)[:40])
def test_every_example_runs(module, name, obj):
    finder = doctest.DocTestFinder(recurse=False)
    globs = {"torch": torch, "ak": ak}
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    torch.manual_seed(0)
    for test in finder.find(obj, f"{module}.{name}", globs=globs):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{module}.{name}: {result.failed} example(s) failed"
