"""Where a module's heads attend: the one protocol every kind of cache implements.

`MultiHeadAttention.forward` reads project → attend → merge: it asks the attender
for the positions of its new rows (RoPE), projects, and hands q, k, v to
`attend_heads`. The attender is the plain call (`PLAIN`: `attention` on the keys
given), a `KVCache` (append, then attend over the cache), a paged cache's layer
(`PagedLayer`: each packed token against its own sequence) or a `ContextParallel`
(rows of a sequence sharded across processes). Each checks first what it cannot
serve (`check`), naming the fix.

The protocol: `check(query, key, value, dropout_p)` (what it cannot serve, with the
fix), `positions(rows, device)` (an offset, or the (L,) positions RoPE rotates by) and
`attend_heads(q, k, v, mask, *, dropout_p, backend)` on (B, H, L, hd) heads. The module
branches only on whether it was parallelized (a context takes no cache).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.call.functional import attention
from attnkit.masks import Mask

__all__ = ["PLAIN", "Attender"]


class Attender:
    """The protocol, and its plain case: attention over exactly the keys given (no
    cache). Every other attender subclasses it and overrides what it does otherwise."""

    def check(
        self, query: Tensor, key: Tensor | None, value: Tensor | None, dropout_p: float
    ) -> None:
        """Raise (naming the fix) for inputs this attender cannot serve; query (B, L, E)."""

    def positions(self, rows: int, device: torch.device) -> int | Tensor:
        """The positions of `rows` new query rows: an offset, or an (L,) tensor."""
        return 0

    def attend_heads(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask | Tensor | None,
        *,
        dropout_p: float,
        backend: str,
    ) -> Tensor:
        """q (B, H, L, hd), the new k, v (B, Hkv, S, hd) -> out (B, H, L, hd)."""
        return attention(q, k, v, mask, dropout_p=dropout_p, backend=backend)


PLAIN = Attender()
