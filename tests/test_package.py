"""The package as a user gets it: the wheel's files, installed outside the checkout, its
command, one version everywhere, and an import that loads no compiler."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import attnkit as ak

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
        check=True,
    )
    (path,) = out.glob("attnkit-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed into an empty folder (its own site), away from the checkout."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--quiet",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
    )
    return site


def test_wheel_holds_the_package_its_types_and_its_command(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "attnkit/py.typed" in names  # so a user's mypy reads attnkit's annotations
    assert {"attnkit/__init__.py", "attnkit/cli.py", "attnkit/masks/__init__.py"} <= names
    assert not any(name.startswith(("tests/", "benchmarks/")) for name in names)
    dist_info = f"attnkit-{ak.__version__}.dist-info"
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "attnkit = attnkit.cli:main" in entry_points


def _outside(site: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """`command` run from an empty folder with the installed wheel first on the path."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(command, capture_output=True, text=True, cwd=site.parent, env=env)


def test_installed_wheel_imports_and_agrees_on_its_version(installed: Path):
    code = (
        "import importlib.metadata, attnkit; "
        "print(attnkit.__file__); print(importlib.metadata.version('attnkit'), attnkit.__version__)"
    )
    done = _outside(installed, sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    where, versions = done.stdout.splitlines()
    assert Path(where).is_relative_to(installed)  # not the checkout's
    assert versions == f"{ak.__version__} {ak.__version__}"


def test_installed_command_answers_version_and_tours(installed: Path):
    command = str(installed / "bin" / "attnkit")
    version = _outside(installed, command, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith(f"attnkit {ak.__version__} ")
    tour = _outside(installed, command, "tour")
    assert tour.returncode == 0, tour.stderr
    assert "checks passed, 0 failed" in tour.stdout


def test_one_version_in_the_metadata_and_the_changelog():
    assert importlib.metadata.version("attnkit") == ak.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    top = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M)
    assert top is not None and top.group(1) == ak.__version__
    assert '__version__ = "' in (ROOT / "src/attnkit/__init__.py").read_text()
    assert "version =" not in (ROOT / "pyproject.toml").read_text().split("[tool.setuptools")[0]


def test_import_loads_no_compiler():
    code = (
        "import sys, attnkit; "
        "print([m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))])"
    )
    assert _python(code) == "[]"


def test_compile_in_a_fresh_process_loads_the_op_when_it_first_traces():
    code = """
import torch, attnkit as ak
q = torch.randn(1, 2, 8, 4)
out = torch.compile(lambda q: ak.attention(q, q, q, ak.causal()), fullgraph=True,
                    backend="aot_eager")(q)
probs = torch.compile(lambda q: ak.attention_probs(q, q, ak.causal()), backend="eager")(q)
print(torch.allclose(out, ak.attention(q, q, q, ak.causal()), atol=1e-6),
      torch.equal(probs, ak.attention_probs(q, q, ak.causal())))
"""
    assert _python(code) == "True True"


def test_varlen_takes_torch_aux_request_too():
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    q = torch.randn(6, 2, 4)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out, lse = ak.varlen_attn(q, q, q, cu, cu, 4, 4, return_aux=varlen.AuxRequest(lse=True))
    mine, my_lse = ak.varlen_attn(q, q, q, cu, cu, 4, 4, return_aux=ak.dropins.AuxRequest(lse=True))
    assert torch.equal(out, mine) and torch.equal(lse, my_lse)
