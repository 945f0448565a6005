"""Attention over a paged KV cache: each new token against its own sequence only.

`paged_attention` writes a layer's new keys and values into the step's slots and
attends each sequence's new tokens to its history (causal, bottom-right; or a sliding
window): one unmasked fused call for a decoding token, `attention` for a prefill
(prepared by the step's first layer, run by the others: `Step.calls`).
`PagedLayer` is one layer's view of a step, what a module's `cache=` takes.

`paged_attention` checks shapes and dtype (the cache's), writes k/v with `index_copy_`
at the step's slots, runs every decoding token of the step on the registry's paged
kernel where one serves and autograd does not record (`Backend.paged_decode`: native's,
where it is built, reads the pages in place, no gather; float32, bfloat16, float16),
and otherwise per sequence
gathers the history from the first key any new
query's window reaches (`history`: whole blocks, keys and values at once, a block's
slots being one row of block_size·Hkv·(D + Dv) numbers, into buffers the cache reuses
sequence after sequence, so the keys are still in cache when attended; fresh tensors
when autograd records the call). A decoding token (one new token, no softcap) runs one
unmasked SDPA call with the G query heads as rows of their K/V head (each K/V head read
once), in the kernel dtype (half gathered as half, widened in cache); a prefill runs
`attention` with `causal(offset=start - lo)` or `sliding_window(left, offset=...)`: the
ordinary backends, GQA unexpanded. A call whose causal reach or window starts below the
first kept position (`release`) is refused.

Measured, not assumed (`benchmarks/paged.py`, 2-core AVX2): the gather runs near the
machine's copy bandwidth (about 7 of 17 ms a float32 step; gathering keys and values
apart cost 2-3 ms more, building the flat block list from Python ints another 0.5 ms). A
gather-free kernel of block-sized products over the pool in place (scores and P·V as
batched (G×D)·(D×16) products, segmented softmax) costs about 9 ms per product in call
overhead, as do `embedding_bag` formulations and the CPU flash op per block;
per-sequence chunks with a log-sum-exp merge were slower still.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit import runtime
from attnkit._compat import TORCH_SDPA
from attnkit.backends.protocol import PagedDecode
from attnkit.call.dispatch import StepCalls
from attnkit.errors import MaskError, ShapeContractError
from attnkit.kv.attender import Attender
from attnkit.kv.pool import PagePool, Step
from attnkit.masks import Mask, causal, sliding_window
from attnkit.masks.structure import trailing_window

__all__ = ["PagedKVCache", "PagedLayer", "paged_attention"]


class PagedKVCache(PagePool):
    """Keys and values of many sequences of different lengths in one pool of blocks.

    vLLM's layout: one block id holds `block_size` tokens' keys and values for every
    layer, so a sequence of n tokens holds ceil(n / block_size) blocks (shared ones
    counted once). `add` and `fork` take no block until a write needs one; `fork` shares
    blocks (copy on write); `step(ids, counts)` makes room for a forward pass's new
    tokens, or raises `OutOfBlocksError` (a `RuntimeError`) before any change;
    `release` frees blocks a sliding window no longer reaches; `remove` frees a finished
    sequence. `paged_attention` (or `MultiHeadAttention(x, cache=pages.layer(step, i))`)
    writes and reads them.

    Args:
        num_layers: layers of the model, each with its keys and values in every block.
        num_kv_heads: Hkv, key/value heads.
        head_dim: D, the key head dim.
        num_blocks: blocks in the pool.
        block_size: token slots a block holds (default 16).
        value_dim: Dv, the value head dim (default None: D).
        dtype: the dtype of keys and values, and of the q, k, v `paged_attention` takes
            (default torch.float32).
        device: where the pool lives (default "cpu").

    Raises:
        ValueError: a size that is not a positive int.

    Examples:
        >>> pages = ak.PagedKVCache(2, num_kv_heads=2, head_dim=8, num_blocks=6, block_size=4)
        >>> a = pages.add()
        >>> step = pages.step([a], [6])  # a prompt of 6 tokens: 2 blocks
        >>> pages.length(a), pages.block_table(a), pages.free_blocks
        (6, [0, 1], 4)
        >>> b = pages.fork(a)  # shares both blocks, no copy
        >>> step = pages.step([a, b], [1, 1])  # each writes into the shared, partly filled block
        >>> pages.block_table(a), pages.block_table(b)  # a, writing first, copied it
        ([0, 2], [0, 1])
        >>> pages.remove(a)  # frees block 2; block 0 is still b's
        >>> pages.free_blocks
        4
    """

    def layer(self, step: Step, layer: int) -> PagedLayer:
        """What a `MultiHeadAttention` of `layer` takes as `cache=` to run this step."""
        return PagedLayer(self, step, layer)


@dataclass(frozen=True)
class PagedLayer(Attender):
    """One layer's view of a step, what a module's `cache=` takes: `pages.layer(step, i)`.

    `MultiHeadAttention(x, cache=pages.layer(step, i))` takes the step's new tokens of
    every sequence packed as x (1, T, E), in step order; it rotates them (RoPE) by their
    positions in their own sequences and runs `paged_attention` on its heads.

    Args:
        pages: the `PagedKVCache`.
        step: the `Step` made by `pages.step(...)` for this forward pass.
        layer: the layer index, in 0..num_layers-1.

    Examples:
        >>> mha = ak.MultiHeadAttention(16, 4, num_kv_heads=2, rope=True)  # head_dim 4
        >>> pages = ak.PagedKVCache(1, num_kv_heads=2, head_dim=4, num_blocks=8, block_size=4)
        >>> a, b = pages.add(), pages.add()
        >>> x = torch.randn(1, 7, 16)  # a's 4 tokens, then b's 3, packed as (1, T, E)
        >>> step = pages.step([a, b], [4, 3])
        >>> out = mha(x, cache=pages.layer(step, 0))
        >>> out.shape
        torch.Size([1, 7, 16])
        >>> torch.allclose(out[:, 4:], mha(x[:, 4:], mask=ak.causal()), atol=1e-5)  # b alone
        True
    """

    pages: PagePool
    step: Step
    layer: int

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask | None) -> Tensor:
        """`paged_attention` of (T, H, D), (T, Hkv, D), (T, Hkv, Dv): (T, H, Dv)."""
        return paged_attention(q, k, v, self.pages, self.step, self.layer, mask)

    # a module's attender (`attnkit.kv.attender`): the step's tokens packed as (1, T, E)
    def check(
        self, query: Tensor, key: Tensor | None, value: Tensor | None, dropout_p: float
    ) -> None:
        if key is not None or value is not None:
            raise ValueError("a paged cache serves self-attention: call with the query only.")
        if query.dim() == 3 and query.shape[0] != 1:
            raise ShapeContractError(
                f"with a paged cache, query holds the step's tokens packed as (1, T, E); "
                f"got {tuple(query.shape)}."
            )

    def positions(self, rows: int, device: torch.device) -> int | Tensor:
        return self.step.positions().to(device)  # (T,): RoPE by position in its sequence

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
        """(1, H, T, hd) heads of the packed tokens -> (1, H, T, Dv)."""
        if mask is not None and not isinstance(mask, Mask):
            raise MaskError("with a paged cache, mask is None or sliding_window(left).")
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (T, heads, hd)
        return self.attend(q, k, v, mask).transpose(0, 1)[None]


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pages: PagePool,
    step: Step,
    layer: int,
    mask: Mask | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Write a step's new keys and values into `layer` and attend each new token to its
    own sequence's tokens up to itself (causal, bottom-right), never to another's.

    Call it once per layer with the same step: a prefill (several tokens of a sequence)
    and decoding (one token each) mix freely in one step (continuous batching).

    Args:
        q: (T, H, D) queries: the step's new tokens packed in step order (sequence
            `step.ids[0]`'s first, T = sum of the step's counts), in the cache's dtype.
        k: (T, Hkv, D) their keys, written into the cache; H % Hkv == 0.
        v: (T, Hkv, Dv) their values, written into the cache.
        pages: the `PagedKVCache`.
        step: the `Step` made by `pages.step(ids, counts)` for this forward pass.
        layer: the layer index, in 0..num_layers-1.
        mask: None (causal within each sequence) or `sliding_window(left)`: each token
            sees the `left` tokens of its sequence before it and itself (default None).
        scale: multiplies q·kᵀ (default None: 1/√D).
        softcap: if set, scores become `c·tanh(s/c)` (default None).

    Returns:
        (T, H, Dv) in q's dtype.

    Raises:
        ShapeContractError: q, k, v not (T, H|Hkv, D|Dv) for the step and the cache.
        TypeError: q, k or v not in the cache's dtype.
        MaskError: a mask other than None or `sliding_window(left)`.
        ValueError: a stale step (the cache changed since), or attention reaching
            keys `release` freed.
        IndexError: a layer outside the cache.

    Examples:
        >>> pages = ak.PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=8)
        >>> a, b = pages.add(), pages.add()
        >>> step = pages.step([a, b], [5, 3])  # T = 8 tokens: a's 5, then b's 3
        >>> q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
        >>> out = ak.paged_attention(q, k, v, pages, step, layer=0)
        >>> out.shape  # (T, H, Dv)
        torch.Size([8, 4, 8])
        >>> heads = lambda t: t.transpose(0, 1)[None]  # (n, H, D) -> (1, H, n, D)
        >>> alone = ak.attention(heads(q[5:]), heads(k[5:]), heads(v[5:]), ak.causal())
        >>> torch.allclose(out[5:], alone[0].transpose(0, 1), atol=1e-5)  # b as if alone
        True
    """
    left = _window_of(mask)
    _check_paged(q, k, v, pages, step, layer)
    _check_released(step, left)
    pages.keys[layer].index_copy_(0, step.slots, k)
    pages.values[layer].index_copy_(0, step.slots, v)
    recorded = torch.is_grad_enabled() and (
        q.requires_grad or pages.pool.requires_grad
    )  # autograd keeps what attention read: no buffer may be reused then
    # decode gathers in it: one cast, in cache
    gather_dtype = runtime.current().half.kernel_dtype(q.dtype, q.device)
    Hkv = pages.num_kv_heads
    grouped = q.to(gather_dtype).reshape(q.shape[0], Hkv, q.shape[1] // Hkv, q.shape[2])
    # (T, Hkv, G, D)
    in_place = {} if recorded else _in_place_decodes(q, pages, step, layer, left, scale, softcap)
    outs = []
    for i, (t, n, start) in enumerate(zip(step.firsts(), step.counts, step.starts, strict=True)):
        if n == 0:
            continue
        if i in in_place:
            outs.append(in_place[i])
            continue
        lo = 0 if left is None else max(0, start - left)  # keys no new query's window reaches
        decode = n == 1 and softcap is None  # sees every key gathered: no mask to plan
        dtype = gather_dtype if decode else pages.dtype
        keys, values = pages.history(step, i, layer, lo, start + n, dtype, scratch=not recorded)
        if decode:
            outs.append(_decode(grouped[t : t + 1], keys, values, scale))
        else:
            prefill = (q[t : t + n], keys, values, start - lo, left, scale, softcap)
            outs.append(_prefill(step.calls, i, *prefill))
    if not outs:
        return q.new_zeros(0, q.shape[1], pages.value_dim)
    return torch.cat(outs).to(q.dtype)  # (T, H, Dv)


def _in_place_decodes(
    q: Tensor,
    pages: PagePool,
    step: Step,
    layer: int,
    left: int | None,
    scale: float | None,
    softcap: float | None,
) -> dict[int, Tensor]:
    """Each decoding sequence's output (1, H, Dv), read in place on the pool (no gather)
    by the registry's paged kernel (`Backend.paged_decode`: `native`), by the step's
    place of the sequence; {} where no backend has one for this step."""
    if 1 not in step.counts:
        return {}
    decoding = step.decoding
    lo = decoding.hi - 1 - left if left is not None else torch.zeros_like(decoding.hi)
    problem = PagedDecode(
        q.index_select(0, decoding.rows),
        pages.pool[layer][..., : q.shape[-1]],  # keys and values side by side
        pages.pool[layer][..., q.shape[-1] :],
        step.blocks,
        decoding.table_at,
        lo.clamp(min=0),
        decoding.hi,
        pages.block_size,
        q.shape[-1] ** -0.5 if scale is None else scale,
        softcap or 0.0,
    )
    result = runtime.current().backends.paged_decode(problem)
    if result is None:
        return {}
    out = result[0]  # (N, H, Dv)
    return {i: out[j : j + 1] for j, i in enumerate(decoding.places)}


def _decode(q: Tensor, keys: Tensor, values: Tensor, scale: float | None) -> Tensor:
    """One new token's heads grouped (1, Hkv, G, D) over all of keys (1, Hkv, S, D):
    (1, H, Dv). One fused call without a mask, the G query heads as G rows against their
    shared K/V head (GQA reads each K/V head once)."""
    out = TORCH_SDPA(q, keys, values, scale=scale)  # (1, Hkv, G, Dv)
    return out.flatten(1, 2)


def _prefill(
    calls: StepCalls,
    place: int,
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    offset: int,
    left: int | None,
    scale: float | None,
    softcap: float | None,
) -> Tensor:
    """n new queries (n, H, D) of one sequence, query j at key position j + offset of
    keys (1, Hkv, S, D): `attention` (its planner and fused paths), prepared by the
    step's first layer for the sequence at `place` and run by the others, (n, H, Dv)."""
    mask = causal(offset=offset) if left is None else sliding_window(left, offset=offset)
    out = calls.run(
        place,
        q.transpose(0, 1)[None],
        keys,
        values,
        mask,
        scale=scale,
        softcap=softcap,
        dropout_p=0.0,
    )
    return out[0].transpose(0, 1)


def _window_of(mask: Mask | None) -> int | None:
    if mask is None:
        return None
    left = trailing_window(mask)
    if left is not None:
        return left
    raise MaskError(
        f"paged_attention takes mask=None (causal within each sequence) or "
        f"sliding_window(left) (a window over each sequence's positions); got {mask}."
    )


def _check_released(step: Step, left: int | None) -> None:
    """No query may reach keys `release` freed."""
    for seq, start, released in zip(step.ids, step.starts, step.released, strict=True):
        lo = 0 if left is None else max(0, start - left)
        if lo < released:
            reach = "causal attention" if left is None else f"a window of {left}"
            raise ValueError(
                f"paged_attention: sequence {seq} released its keys before position "
                f"{released}, but {reach} reaches position {lo}; release only keys no later "
                f"query sees (before length - left under sliding_window(left))."
            )


def _check_paged(q: Tensor, k: Tensor, v: Tensor, pages: PagePool, step: Step, layer: int) -> None:
    if step.version != pages.version:
        raise ValueError(
            "paged_attention: this step is stale (the cache changed after it was made: add, "
            "fork, remove or another step); make the step right before its layers run."
        )
    if not 0 <= layer < pages.num_layers:
        raise IndexError(f"layer {layer} is outside 0..{pages.num_layers - 1}.")
    T, Hkv, D, Dv = step.num_tokens, pages.num_kv_heads, pages.head_dim, pages.value_dim
    want = {"q": (T, None, D), "k": (T, Hkv, D), "v": (T, Hkv, Dv)}
    for name, t in (("q", q), ("k", k), ("v", v)):
        shape = want[name]
        if t.dim() != 3 or any(
            w is not None and w != g for w, g in zip(shape, t.shape, strict=True)
        ):
            expected = ", ".join("H" if w is None else str(w) for w in shape)
            raise ShapeContractError(
                f"paged_attention: {name} must be ({expected}) = (tokens of the step, heads, "
                f"dim), got {tuple(t.shape)}."
            )
        if t.dtype != pages.dtype:
            raise TypeError(
                f"paged_attention: {name} is {t.dtype} but the cache holds {pages.dtype}."
            )
    if q.shape[1] % Hkv:
        raise ShapeContractError(
            f"paged_attention: H={q.shape[1]} query heads do not share Hkv={Hkv} K/V heads evenly."
        )
