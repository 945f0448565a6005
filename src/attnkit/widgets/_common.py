"""What both explorers share: ipywidgets, loaded at first use, and small HTML pieces.

ipywidgets is an optional extra, so it is imported by name when an explorer is made:
`import attnkit.widgets` (and the API reference built from it) works without it.
"""

from __future__ import annotations

import html
import importlib
from typing import Any

INSTALL = "pip install 'ipywidgets>=8' (from a checkout of attnkit: pip install '.[widgets]')"
BLUE = "31,119,180"  # matplotlib's tab:blue, as attnkit.plot draws
PANEL = "font: 11px monospace; line-height: 1.1"


def ipywidgets() -> Any:
    """The ipywidgets module, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("ipywidgets")
    except ImportError as err:
        raise ImportError(
            f"attnkit.widgets draws its explorers with ipywidgets (>= 8): {INSTALL}"
        ) from err


def error_html(message: str) -> str:
    """An error shown where the picture would be, in the library's own words."""
    return (
        "<pre style='color: #b00020; white-space: pre-wrap; max-width: 720px'>"
        f"{html.escape(message)}</pre>"
    )


def show(widget: Any, visible: bool) -> None:
    """Show or hide a control (hidden ones keep their values)."""
    widget.layout.display = None if visible else "none"


def slider(description: str, value: int, low: int, high: int) -> Any:
    """An int slider that updates the picture when let go (large L×S redraw at once)."""
    return ipywidgets().IntSlider(
        value=value,
        min=low,
        max=high,
        description=description,
        continuous_update=False,
        style={"description_width": "initial"},
    )
