"""A mask as a notebook shows it: an SVG drawing with its description, no plotting library;
and as text too large to draw pair by pair (`block_text`: one character a block).

`Mask._repr_html_` draws the mask at `PREVIEW`×`PREVIEW` (masks that hold tensors of a
fixed length at that length, at most `LARGEST` a side), one square a pair, runs of
visible keys as one rectangle, so even a 64×64 drawing stays small.
"""

from __future__ import annotations

import html

import torch
import torch.nn.functional as F

from attnkit.errors import MaskError, ShapeContractError
from attnkit.masks.protocol import ReadableMask  # the mask's own methods only

__all__ = ["LARGEST", "PREVIEW", "block_text", "mask_html", "preview_size"]

ALL, SOME, NONE = "■", "▪", "·"  # a block whose pairs may all attend, some, none

PREVIEW = 16  # L = S of a mask that fits any size
LARGEST = 64  # the largest side drawn; a mask bound to more keys shows its corner


def _fits(mask: ReadableMask, L: int, S: int) -> bool:
    try:
        mask.check(mask.batch_size or 1, mask.num_heads or 1, L, S)
    except (MaskError, ShapeContractError):
        return False
    return True


def preview_size(mask: ReadableMask) -> tuple[int, int] | None:
    """The (L, S) a picture of `mask` shows: `PREVIEW` a side where it fits any size,
    else the sizes its tensors fix (a (L, S) tensor, S document ids), or None."""
    candidates = [(PREVIEW, PREVIEW)]
    for t in mask.tensors():
        if t.dim() >= 2:
            candidates += [(t.shape[-2], t.shape[-1]), (t.shape[-1], t.shape[-1])]
        if t.dim() >= 1:
            candidates.append((t.shape[-1], t.shape[-1]))
    return next(((L, S) for L, S in candidates if L and S and _fits(mask, L, S)), None)


def mask_html(mask: ReadableMask) -> str:
    """An HTML block: the description, the size drawn and an SVG of batch row 0, head 0."""
    title = html.escape(str(mask))
    size = preview_size(mask)
    if size is None:
        return f"<div><code>{title}</code> (no size to draw it at: see Mask.draw)</div>"
    L, S = size
    R, C = min(L, LARGEST), min(S, LARGEST)
    B, H = mask.batch_size or 1, mask.num_heads or 1
    dense = mask.dense(B, H, L, S, rows=torch.arange(R), cols=torch.arange(C))
    grid: list[list[bool]] = dense.expand(B, H, R, C)[0, 0].tolist()  # (R, C)
    cell = max(4, min(14, 320 // max(R, C)))
    shapes = []
    for i, row in enumerate(grid):
        j = 0
        while j < C:
            if not row[j]:
                j += 1
                continue
            end = j
            while end < C and row[end]:
                end += 1
            shapes.append(
                f'<rect x="{j * cell}" y="{i * cell}" width="{(end - j) * cell}" '
                f'height="{cell}" fill="#2b6cb0"/>'
            )
            j = end
    shown = (
        f"L={L}, S={S}"
        if (R, C) == (L, S)
        else f"rows 0..{R - 1} of L={L}, keys 0..{C - 1} of S={S}"
    )
    where = ", batch row 0" + (", head 0" if H > 1 else "") if B > 1 or H > 1 else ""
    return (
        f'<div class="attnkit-mask"><div><code>{title}</code></div>'
        f"<div><small>{shown}{where}; blue = may attend</small></div>"
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{C * cell}" height="{R * cell}" '
        f'viewBox="0 0 {C * cell} {R * cell}"><rect width="100%" height="100%" fill="#edf2f7"/>'
        f"{''.join(shapes)}</svg></div>"
    )


def block_text(mask: ReadableMask, L: int, S: int, *, batch: int, head: int, cells: int) -> str:
    """The L×S matrix of one batch row and head as at most `cells` characters a side,
    each a block of ceil(L / cells) rows by ceil(S / cells) keys: ■ every pair may attend,
    ▪ some, · none. Evaluated one block row at a time (memory rows·S, never L·S)."""
    R, C = -(-L // cells), -(-S // cells)  # pairs a character stands for
    B, H = mask.batch_size or 1, mask.num_heads or head + 1
    lines = []
    for r0 in range(0, L, R):
        rows = torch.arange(r0, min(r0 + R, L))
        band = mask.dense(B, H, L, S, rows=rows).expand(B, H, len(rows), S)[batch, head]
        pad = (0, -S % C)  # the last block's keys past S: neither hide nor show a pair
        full = F.pad(band, pad, value=True).view(len(rows), -1, C).all(2).all(0)  # (blocks,)
        some = F.pad(band, pad, value=False).view(len(rows), -1, C).any(2).any(0)
        marks = (ALL if f else SOME if s else NONE for f, s in zip(full, some, strict=True))
        lines.append(" ".join(marks))
    return "\n".join(lines)
