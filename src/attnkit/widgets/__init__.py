"""Interactive pictures for learners in Jupyter: the mask explorer and the attention
explorer.

They draw with ipywidgets (`pip install '.[widgets]' from a checkout`), imported when an explorer
is made, so importing this module needs nothing beyond attnkit. Each explorer holds its
controls as attributes and what it draws as data (`explorer.view`), so code and tests
can set a control and read the picture without a browser. In a notebook, a cell whose
last line is the explorer shows it.
"""

from attnkit.widgets.attention_explorer import AttentionExplorer, AttentionView, attention_explorer
from attnkit.widgets.mask_explorer import MaskExplorer, MaskView, mask_explorer

__all__ = [
    "AttentionExplorer",
    "AttentionView",
    "MaskExplorer",
    "MaskView",
    "attention_explorer",
    "mask_explorer",
]
