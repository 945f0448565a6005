"""The drop-ins' surface of the differential harness: random `attnkit.sdpa` calls against
torch's SDPA in float64, random `attnkit.varlen_attn` calls (packed, windowed, GQA,
`seqused_k`) against the float64 formula of torch's documented convention, random
`flash_attn_func` and `flash_attn_varlen_func` calls (causal, windows, softcap, ALiBi),
each also in a packed form drawn at random (`flash_attn_qkvpacked_func`,
`flash_attn_kvpacked_func`, `flash_attn_varlen_qkvpacked_func`,
`flash_attn_varlen_kvpacked_func`: gradients checked in the packed tensor), against
flash-attention's.

`check(draw)` runs one call drawn through a `fuzz_cases.Draw` and raises AssertionError
on a wrong output, log-sum-exp or gradient.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import bias as torch_bias

from attnkit.dropins import AuxRequest, sdpa, varlen_attn
from attnkit.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from fuzz_cases import Draw

TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-4}, torch.float64: {}}
FORMS = ("split", "kvpacked", "qkvpacked")  # flash-attention's q, k, v; q, kv; qkv
FLASH = {
    "split": flash_attn_func,
    "kvpacked": flash_attn_kvpacked_func,
    "qkvpacked": flash_attn_qkvpacked_func,
}


def flash_formula(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None):
    """flash-attention's documented convention, one sequence: q (L, H, D), k and v
    (S, Hkv, D) -> out (L, H, Dv), lse (H, L), float64."""
    L, H, D = q.shape
    S, G = k.shape[0], H // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("lhd,shd->hls", q, k) * (D**-0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(L)[:, None] + S - L  # the aligned position
    j = torch.arange(S)[None]
    if slopes is not None:
        s = s - slopes.double()[:, None, None] * (i - j).abs()
    left, right = window[0], 0 if causal else window[1]
    ok = torch.ones(L, S, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    s = s.masked_fill(~ok, -torch.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(ok, torch.exp(s - torch.where(lse.isfinite(), lse, 0)[..., None]), 0)
    return torch.einsum("hls,shd->lhd", p, v), lse


def varlen_formula(q, k, v, cu_q, cu_k, window, scale=None, used=None):
    """torch's documented varlen convention: each sequence as flash-attention's formula
    (the same window around i' = i + len_k - len_q), its first len_k (or used) keys.
    Returns out (T_q, H, Dv) and lse (T_q, H), float64."""
    outs, lses = [], []
    for n in range(len(cu_q) - 1):
        len_k = int(cu_k[n + 1] - cu_k[n]) if used is None else int(used[n])
        keys = slice(int(cu_k[n]), int(cu_k[n]) + len_k)
        out, lse = flash_formula(
            q[cu_q[n] : cu_q[n + 1]], k[keys], v[keys], window=window, scale=scale
        )
        outs.append(out)
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def check(draw: Draw) -> str:
    run = {"sdpa": _sdpa, "varlen": _varlen, "flash": _flash, "flash varlen": _flash_varlen}
    return run[draw.choice(tuple(run))](draw)


def _packed(form: str, q, k, v, dim: int) -> list:
    """The leaves (requiring grad) a call of `form` takes, packed along `dim`."""
    if form == "qkvpacked":
        leaves = [torch.stack((q, k, v), dim)]
    else:
        leaves = [q, torch.stack((k, v), dim)] if form == "kvpacked" else [q, k, v]
    return [t.requires_grad_() for t in leaves]


def _grads_close(got, inputs, want, truth_inputs, dtype, form="split", dim=0) -> None:
    """d(q, k, v) of `got` against those of the float64 `want`, for one random dout;
    `inputs` packed as `form` (their gradients unpacked along `dim` to compare)."""
    dout = torch.randn_like(want)
    grads = torch.autograd.grad(got, inputs, dout.to(got.dtype))
    if form != "split":
        grads = (*grads[:-1], *grads[-1].unbind(dim))
    expected = torch.autograd.grad(want, truth_inputs, dout)
    for name, a, b in zip("qkv", grads, expected, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), **TOLERANCE[dtype], msg=f"d{name}")


def _sdpa(draw: Draw) -> str:
    dtype = draw.choice((torch.float32, torch.float64))
    rank, L, S = draw.int(2, 5), draw.int(1, 9), draw.int(1, 9)
    D, Dv = draw.int(0, 8), draw.int(1, 8)  # D = 0: every score 0, as torch has it
    Hkv = draw.int(1, 3)
    H = Hkv * (draw.int(1, 3) if rank >= 3 else 1)
    lead = [draw.int(1, 3) for _ in range(max(rank - 3, 0))]
    heads = [H] if rank >= 3 else []
    kv_heads = [Hkv] if rank >= 3 else []
    shapes = ([*lead, *heads, L, D], [*lead, *kv_heads, S, D], [*lead, *kv_heads, S, Dv])
    g = torch.Generator().manual_seed(draw.int(0, 10**6))
    inputs = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    kind = draw.choice(
        ("none", "causal", "bool", "float", "keep_float", "upper_left", "lower_right")
    )
    mask = None
    if kind in ("bool", "float", "keep_float"):
        shape = [*[draw.choice((1, n)) for n in (*lead, *heads)], draw.choice((1, L)), S]
        mask = torch.rand(shape, generator=g) > 0.3
        if kind == "float":
            mask = torch.where(
                mask, torch.randn(shape, generator=g, dtype=torch.float64), -torch.inf
            )
        if kind == "keep_float":  # 0s and 1s added as a bias: sdpa keeps torch's meaning
            mask = mask.double()
    if kind in ("upper_left", "lower_right"):  # torch's CausalBias
        with warnings.catch_warnings():  # torch warns of NaN rows at L > S: ours are 0
            warnings.simplefilter("ignore", UserWarning)
            mask = getattr(torch_bias, f"causal_{kind}")(L, S)
    scale = draw.choice((None, 0.5))
    kwargs = {"is_causal": kind == "causal", "scale": scale, "enable_gqa": H != Hkv}
    q, k, v = (t.to(dtype).requires_grad_() for t in inputs)
    given = mask.to(dtype) if kind in ("float", "keep_float") else mask
    got = sdpa(q, k, v, given, **kwargs)
    truth_in = [t.requires_grad_() for t in inputs]
    want = F.scaled_dot_product_attention(*truth_in, mask, **kwargs)
    text = f"sdpa {dtype} {[list(s) for s in shapes]} mask {kind} " + (
        f"{list(mask.shape)} scale {scale}" if isinstance(mask, torch.Tensor) else f"scale {scale}"
    )
    assert got.shape == want.shape, f"{text}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    want = torch.nan_to_num(want, nan=0.0)  # torch's empty rows: NaN on some paths; attnkit 0
    torch.testing.assert_close(got, want.to(dtype), **TOLERANCE[dtype], msg=text)
    if not torch.isnan(torch.autograd.grad(want.sum(), truth_in, retain_graph=True)[0]).any():
        _grads_close(got, (q, k, v), want, truth_in, dtype)
    return text


def _varlen(draw: Draw) -> str:
    dtype = draw.choice((torch.float32, torch.float64))
    N, Hkv, D = draw.int(1, 4), draw.int(1, 3), draw.int(1, 8)
    H = Hkv * draw.int(1, 3)
    len_q = [draw.int(0, 7) for _ in range(N)]
    len_k = [draw.int(0, 9) for _ in range(N)]
    left, right = draw.choice((-1, 0, 1, 3)), draw.choice((-1, 0, 0, 2))
    used = None
    if draw.choice((False, True)):  # a cache slot longer than its keys
        used = [draw.int(0, n) for n in len_k]
    g = torch.Generator().manual_seed(draw.int(0, 10**6))
    q = torch.randn(sum(len_q), H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(len_k), Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32)
    text = f"varlen {dtype} H={H} Hkv={Hkv} q {len_q} k {len_k} used {used} window {(left, right)}"
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = varlen_attn(
        *inputs,
        cu_q,
        cu_k,
        max(len_q),
        max(len_k),
        return_aux=AuxRequest(lse=True),
        window_size=(left, right),
        enable_gqa=H != Hkv,
        seqused_k=seqused,
    )
    truth_in = [t.requires_grad_() for t in (q, k, v)]
    want, want_lse = varlen_formula(*truth_in, cu_q, cu_k, (left, right), used=used)
    torch.testing.assert_close(out, want.to(dtype), **TOLERANCE[dtype], msg=text)
    torch.testing.assert_close(lse, want_lse.to(lse.dtype), **TOLERANCE[dtype], msg=text)
    if out.numel():
        _grads_close(out, inputs, want, truth_in, dtype)
    with torch.no_grad():  # the same kind of call both ways (grad may pick another kernel)
        _same_bits_reversed(inputs, len_q, len_k, used, (left, right), H != Hkv, text)
    return text


def _same_bits_reversed(inputs, len_q, len_k, used, window, gqa, text) -> None:
    """The pack in reverse order gives each sequence the same bits (order invariance)."""

    def pieces(t, lengths):
        return list(torch.split(t, lengths))

    def run(q, k, v, len_q, len_k, used):
        seqused = None if used is None else torch.tensor(used, dtype=torch.int32)
        return varlen_attn(
            q,
            k,
            v,
            cumulative(len_q),
            cumulative(len_k),
            1,
            1,
            window_size=window,
            enable_gqa=gqa,
            seqused_k=seqused,
        )

    out = run(*inputs, len_q, len_k, used)
    q, k, v = (pieces(t, n) for t, n in zip(inputs, (len_q, len_k, len_k), strict=True))
    flipped = [torch.cat(p[::-1]) for p in (q, k, v)]
    again = run(*flipped, len_q[::-1], len_k[::-1], None if used is None else used[::-1])
    mirrored = pieces(again, len_q[::-1])[::-1]
    for n, (a, b) in enumerate(zip(pieces(out, len_q), mirrored, strict=True)):
        assert torch.equal(a, b), f"{text}: sequence {n} changed with the packing order"


def _flash(draw: Draw) -> str:
    """flash_attn_func: random sizes, causal, windows, softcap, ALiBi per head or per batch."""
    dtype, form = draw.choice((torch.float32, torch.float64)), draw.choice(FORMS)
    B, L, S, Hkv, D = draw.int(1, 3), draw.int(1, 9), draw.int(1, 9), draw.int(1, 3), draw.int(1, 8)
    H = Hkv * draw.int(1, 3)
    if form == "qkvpacked":  # self-attention: as many keys and key heads as queries
        S, H = L, Hkv
    causal = draw.choice((False, True))
    window = (draw.choice((-1, 0, 2, 5)), draw.choice((-1, 0, 1, 3)))
    softcap = draw.choice((0.0, 0.0, 1.5))
    g = torch.Generator().manual_seed(draw.int(0, 10**6))
    slopes = draw.choice((None, (H,), (B, H)))
    alibi = None if slopes is None else torch.rand(slopes, generator=g)
    q = torch.randn(B, L, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    text = (
        f"flash_attn_func ({form}) {dtype} B={B} L={L} S={S} H={H} Hkv={Hkv} D={D} "
        f"causal={causal} window={window} softcap={softcap} alibi={slopes}"
    )
    inputs = _packed(form, *(t.to(dtype) for t in (q, k, v)), dim=2)
    out, lse, _ = FLASH[form](
        *inputs,
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=alibi,
        return_attn_probs=True,
    )
    truth_in = [t.requires_grad_() for t in (q, k, v)]
    batch_slopes = [alibi if alibi is None or alibi.dim() == 1 else alibi[b] for b in range(B)]
    per_row = [
        flash_formula(
            truth_in[0][b],
            truth_in[1][b],
            truth_in[2][b],
            causal=causal,
            window=window,
            softcap=softcap,
            slopes=batch_slopes[b],
        )
        for b in range(B)
    ]
    want, want_lse = torch.stack([o for o, _ in per_row]), torch.stack([m for _, m in per_row])
    torch.testing.assert_close(out, want.to(dtype), **TOLERANCE[dtype], msg=text)
    torch.testing.assert_close(lse, want_lse.to(lse.dtype), **TOLERANCE[dtype], msg=text)
    _grads_close(out, inputs, want, truth_in, dtype, form, dim=2)
    return text


def _flash_varlen(draw: Draw) -> str:
    """flash_attn_varlen_func or a packed form: random packed sequences (empty ones too),
    causal, windows, softcap, ALiBi per head or per sequence."""
    dtype, form = draw.choice((torch.float32, torch.float64)), draw.choice(FORMS)
    N, Hkv, D = draw.int(1, 4), draw.int(1, 3), draw.int(1, 8)
    H = Hkv * draw.int(1, 3)
    len_q, len_k = [draw.int(0, 7) for _ in range(N)], [draw.int(0, 9) for _ in range(N)]
    if form == "qkvpacked":  # one cu_seqlens for queries and keys
        len_k, H = len_q, Hkv
    causal, window = draw.choice((False, True)), (draw.choice((-1, 0, 3)), draw.choice((-1, 0, 2)))
    softcap, slopes = draw.choice((0.0, 0.0, 1.5)), draw.choice((None, (H,), (N, H)))
    g = torch.Generator().manual_seed(draw.int(0, 10**6))
    alibi = None if slopes is None else torch.rand(slopes, generator=g)
    q = torch.randn(sum(len_q), H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(len_k), Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    text = (
        f"flash_attn_varlen_func ({form}) {dtype} H={H} Hkv={Hkv} D={D} q {len_q} k {len_k} "
        f"causal={causal} window={window} softcap={softcap} alibi={slopes}"
    )
    inputs = _packed(form, *(t.to(dtype) for t in (q, k, v)), dim=1)
    cu_q, cu_k = cumulative(len_q), cumulative(len_k)
    opts = {
        "causal": causal,
        "window_size": window,
        "softcap": softcap,
        "alibi_slopes": alibi,
        "return_attn_probs": True,
    }
    if form == "qkvpacked":
        out, lse, _ = flash_attn_varlen_qkvpacked_func(*inputs, cu_q, max(len_q), **opts)
    else:
        call = flash_attn_varlen_kvpacked_func if form == "kvpacked" else flash_attn_varlen_func
        out, lse, _ = call(*inputs, cu_q, cu_k, max(len_q), max(len_k), **opts)
    truth_in = [t.requires_grad_() for t in (q, k, v)]
    per_seq = [
        flash_formula(
            truth_in[0][cu_q[n] : cu_q[n + 1]],
            truth_in[1][cu_k[n] : cu_k[n + 1]],
            truth_in[2][cu_k[n] : cu_k[n + 1]],
            causal=causal,
            window=window,
            softcap=softcap,
            slopes=alibi if alibi is None or alibi.dim() == 1 else alibi[n],
        )
        for n in range(N)
    ]
    want, want_lse = torch.cat([o for o, _ in per_seq]), torch.cat([m for _, m in per_seq], 1)
    torch.testing.assert_close(out, want.to(dtype), **TOLERANCE[dtype], msg=text)
    torch.testing.assert_close(lse, want_lse.to(lse.dtype), **TOLERANCE[dtype], msg=text)
    if out.numel():
        _grads_close(out, inputs, want, truth_in, dtype, form, dim=1)
    return text
