"""Drop-ins: the attention calls code already makes, with their exact signatures, run by
attnkit: PyTorch's `sdpa` and `varlen_attn` (`pytorch`), flash-attention's functions
(`attnkit.flash_attn`, with its KV cache in `flash_cache`), and the packing of
sequences they share (`packed`).
"""

from attnkit._compat import AuxRequest
from attnkit.dropins.pytorch import sdpa, varlen_attn

__all__ = ["AuxRequest", "sdpa", "varlen_attn"]
