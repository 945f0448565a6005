"""mkdocs hook: the notebooks of `examples/notebooks/` as pages, run at every build.

Each notebook is stored without outputs; here it is executed with nbclient (a `python3`
kernel on the interpreter that runs mkdocs, in the notebook's folder) and written as a
markdown page, `notebooks/<name>.md`, with its figures beside it and the stored notebook
for download. Nothing is written into `docs/`: the pages are mkdocs' generated files.
A notebook that raises fails the build. Results are kept per notebook text for the life
of the process, so `mkdocs serve` runs again only the notebooks that changed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "examples" / "notebooks"
FOLDER = "notebooks"  # the pages' folder on the site
CELL_TIMEOUT = 300  # seconds
ANSI = re.compile(r"\x1b\[[0-9;]*m")
_done: dict[str, tuple[str, dict[str, bytes]]] = {}  # notebook text's hash -> page, files


def _execute(path: Path) -> Any:
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as home:
        spec = Path(home) / "kernels" / "python3"
        spec.mkdir(parents=True)
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        kernel = {"argv": argv, "display_name": "Python 3", "language": "python"}
        (spec / "kernel.json").write_text(json.dumps(kernel))
        before = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = home  # this interpreter, whatever kernels are installed
        try:
            nbclient.NotebookClient(
                notebook,
                kernel_name="python3",
                timeout=CELL_TIMEOUT,
                resources={"metadata": {"path": str(path.parent)}},
            ).execute(stderr=subprocess.DEVNULL)  # the kernel's own warnings hidden
        finally:
            if before is None:
                del os.environ["JUPYTER_PATH"]
            else:
                os.environ["JUPYTER_PATH"] = before
    return notebook


FENCE = re.compile(r"^(\s*```+)(\w+)[ \t]*$", re.MULTILINE)  # a fence that names its language


def _fence(text: str, language: str = "text") -> str:
    """A fenced block of class `notebook`: the site wraps its long lines (extra.css), as
    a notebook's cells and outputs are written for a notebook's width, not a page's."""
    text = ANSI.sub("", text).rstrip("\n")
    ticks = "````" if "```" in text else "```"
    return f"{ticks}{{.{language} .notebook}}\n{text}\n{ticks}"


def _output(output: Any, name: str, files: dict[str, bytes]) -> str | None:
    kind = output.output_type
    if kind == "stream":
        return _fence(output.text)
    if kind == "error":
        raise RuntimeError(f"{name}: {output.ename}: {output.evalue}")
    data = output.get("data", {})
    if "image/png" in data:
        image = f"{name}/{len(files):02d}.png"
        files[image] = base64.b64decode(data["image/png"])
        return f"![output]({image})"
    html = data.get("text/html", "")
    if "<svg" in html or "<table" in html:  # a Mask's drawing, a Plan's table
        lines = [line for line in html.splitlines() if line.strip()]
        return '<div class="notebook-output">\n' + "\n".join(lines) + "\n</div>"
    if "text/plain" in data:
        return _fence(data["text/plain"])
    return None


def _markdown(notebook: Any, name: str) -> tuple[str, dict[str, bytes]]:
    """The page: markdown cells as they are, code in fences, outputs after their cell."""
    files: dict[str, bytes] = {}
    parts = []
    for n, cell in enumerate(notebook.cells):
        if cell.cell_type == "markdown":  # its code blocks wrap as the cells' do
            parts.append(FENCE.sub(r"\1{.\2 .notebook}", cell.source))
        elif cell.cell_type == "code":
            parts.append(_fence(cell.source, "python"))
            shown = (_output(o, name, files) for o in cell.outputs)
            parts.extend(part for part in shown if part)
        if n == 0:
            parts.append(
                f'!!! note "Run it yourself"\n    This page is `examples/notebooks/{name}.ipynb`,'
                f" run when the site was built. [Download the notebook]({name}.ipynb), or open"
                " them all from a checkout: `pip install '.[notebooks]'`, then"
                " `jupyter lab examples/notebooks`."
            )
    return "\n\n".join(parts) + "\n", files


def page(path: Path) -> tuple[str, dict[str, bytes]]:
    """The markdown page of the notebook at `path` and its files (figures by name)."""
    key = hashlib.sha256(path.read_bytes()).hexdigest()
    if key not in _done:
        _done[key] = _markdown(_execute(path), path.stem)
    return _done[key]


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    from mkdocs.structure.files import File

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        text, extra = page(path)
        files.append(File.generated(config, f"{FOLDER}/{path.stem}.md", content=text))
        files.append(File.generated(config, f"{FOLDER}/{path.name}", content=path.read_bytes()))
        for name, data in extra.items():
            files.append(File.generated(config, f"{FOLDER}/{name}", content=data))
    return files
