"""Keywords of the calls people know (SDPA, nn.MultiheadAttention), pointed to the attnkit way.

`attention(q, k, v, is_causal=True)` would otherwise fail with Python's bare "unexpected
keyword argument"; `points_habits` makes such a call raise a `TypeError` that names what
attnkit takes instead. The check runs before the call (a set intersection of the
keywords), so it costs nothing a call notices and traces under `torch.compile`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["HABITS", "habit_error", "points_habits"]

P = ParamSpec("P")
R = TypeVar("R")

_SDPA = "attnkit.sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, ...)"

HABITS: dict[str, str] = {
    "is_causal": (
        "attnkit takes causality as a mask: mask=ak.causal() (top-left, as SDPA's "
        "is_causal), or ak.causal(align='bottom_right') for queries at the end of the keys "
        f"(a KV cache). For SDPA's own keywords use {_SDPA}"
    ),
    "attn_mask": (
        "pass it as mask=: a bool tensor (True = may attend, as SDPA's; nn.MultiheadAttention's "
        "bool attn_mask is the opposite, True = ignore: pass ~attn_mask), a float tensor "
        "added to the scores, or a Mask (ak.causal() & ak.key_padding(lengths)). For SDPA's "
        f"own keywords use {_SDPA}"
    ),
    "key_padding_mask": (
        "pass mask=ak.from_key_padding_mask(key_padding_mask) (nn.MultiheadAttention's "
        "convention, True = ignore), or mask=ak.key_padding(valid) with True = real token "
        "or (B,) lengths; combine with & (ak.causal() & ak.key_padding(lengths))"
    ),
    "need_weights": (
        "attnkit's attention returns the output only; the weights are "
        "ak.attention_probs(q, k, mask) (exact; rows= picks query rows of a long sequence)"
    ),
    "average_attn_weights": (
        "the weights are ak.attention_probs(q, k, mask), (B, H, L, S) per head; average "
        "them with .mean(1)"
    ),
    "enable_gqa": (
        "attnkit reads GQA from the head counts: k and v with Hkv heads, Hkv dividing H, "
        f"need no flag. For SDPA's own keywords use {_SDPA}"
    ),
    "softmax_scale": "attnkit calls it scale= (default 1/sqrt(D))",
    "causal": "attnkit takes causality as a mask: mask=ak.causal(align='bottom_right') "
    "(flash-attention's causal), or attnkit.flash_attn for flash-attention's keywords",
}


def habit_error(name: str, keywords: set[str]) -> TypeError:
    """The TypeError for keywords of another library given to attnkit's `name`."""
    lines = [f"{name}() got keyword(s) attnkit does not take: {', '.join(sorted(keywords))}."]
    lines += [f"  {word}: {HABITS[word]}." for word in sorted(keywords)]
    return TypeError("\n".join(lines))


def points_habits(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, raising `habit_error` when given a keyword of `HABITS` it does not take."""
    known = set(HABITS) - set(inspect.signature(fn).parameters)  # what fn takes is no habit
    name = fn.__qualname__

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if kwargs and (used := known & kwargs.keys()):
            raise habit_error(name, used)
        return fn(*args, **kwargs)

    return wrapper
