"""The docs site builds with warnings as errors, its API reference has every public name,
and the README is a landing page that describes the project as it is."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.native import unavailable

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = (
    "attnkit",
    "attnkit.masks",
    "attnkit.dropins",
    "attnkit.flash_attn",
    "attnkit.plot",
    "attnkit.distributed",
    "attnkit.integrations.transformers",
    "attnkit.call.calibrate",
    "attnkit.runtime",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_every_page_of_the_nav_is_built(site: Path):
    pages = re.findall(r":\s*([\w/-]+)\.md$", (ROOT / "mkdocs.yml").read_text(), re.M)
    wanted = {"getting-started", "reference/index", "reference/calls", "gpu", "benchmarks"}
    assert wanted <= set(pages)
    for page in pages:
        folder = page.removesuffix("index").rstrip("/")
        built = site / folder / "index.html" if folder else site / "index.html"
        assert built.exists(), page
    masks = (site / "masks/index.html").read_text()
    assert masks.count('src="../images/generated/') == 6  # the pictures, drawn at build
    assert (site / "images/generated/causal.png").stat().st_size > 1000


def test_the_api_reference_has_every_public_name(site: Path):
    html = "".join(page.read_text() for page in (site / "reference").glob("*/index.html"))
    anchors = set(re.findall(r'id="(attnkit[\w.]*)"', html))
    top = set(importlib.import_module("attnkit").__all__)
    for module in PUBLIC:
        for name in importlib.import_module(module).__all__:
            shown = f"{module}.{name}" in anchors or (name in top and f"attnkit.{name}" in anchors)
            assert shown, f"{module}.{name} has no entry in the API reference"


def test_benchmarks_page_names_the_command_and_cpu_of_each_table(site: Path):
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    included = re.findall(r'--8<-- "(benchmarks/results/[\w.]+\.md)"', page)
    assert len(included) >= 8
    for path in included:
        assert (ROOT / path).exists(), path
    for command in (
        "make bench",
        "benchmarks/small_calls.py",
        "benchmarks/dropins.py",
        "benchmarks/masked_values.py",
        "benchmarks/block_mask.py",
        "benchmarks/paged.py",
        "benchmarks/context_parallel.py",
    ):
        assert command in page, command
    assert "AVX2 yes" in (site / "benchmarks/index.html").read_text()  # a table's CPU line


def test_readme_is_a_short_landing_page_about_the_project_as_it_is():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for section in ("## Install", "## Two commands", "## One example", "## Documentation"):
        assert section in readme
    for words in ("issue", "session", "../shared", "seeds/"):
        assert words not in readme.lower(), words
    for link in re.findall(r"\]\(([^)#]+)\)", readme):
        assert (ROOT / link).exists(), link


@pytest.mark.parametrize(
    ("page", "section"),
    [("README.md", "## One example"), ("docs/getting-started.md", "## A first call")],
)
@pytest.mark.skipif(
    unavailable() is not None,
    reason="the page shows the plan with the native kernels built (it prices them)",
)
def test_the_first_example_prints_the_plan_its_page_shows(page, section):
    """The first example, run on the pinned cost table of the tests (`conftest`: the avx2
    table the page names), prints exactly the plan shown under it."""
    example = (ROOT / page).read_text().split(section, 1)[1]
    code, rest = example.split("```python\n", 1)[1].split("```\n", 1)
    shown = rest.split("```\n", 1)[1].split("```", 1)[0]
    assert "table built in for avx2" in example
    env = {**os.environ, "ATTNKIT_CALIBRATION": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout == shown


def test_a_page_named_in_the_text_is_a_link():
    """ "the Benchmarks page" and its kind link to the page they name."""
    titles = ("Benchmarks", "Conventions", "Design", "Backends")
    for page in (ROOT / "docs").glob("*.md"):
        text = page.read_text()
        for title in titles:
            bare = re.findall(rf"(?<!\[)\b[Tt]he {title} page", text)
            assert not bare, f"{page.name}: 'the {title} page' is no link"
