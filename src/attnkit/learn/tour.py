"""`attnkit tour`: the attention mechanism, step by step, checked live against PyTorch.

Each section computes one step with attnkit on small example tensors, prints the shapes
and values, and checks the result against an independent computation (✓ / ✗).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit as ak

Printer = Callable[[str], None]


class Tour:
    """Prints sections and records checks; `failed` counts the ✗."""

    def __init__(self, echo: Printer = print) -> None:
        self.echo = echo
        self.passed = 0
        self.failed = 0

    def section(self, number: int, title: str) -> None:
        self.echo(f"\n{number}. {title}\n" + "─" * (len(title) + 3))

    def check(self, ok: bool, what: str) -> None:
        self.passed += ok
        self.failed += not ok
        self.echo(f"   {'✓' if ok else '✗'} {what}")

    def show(self, name: str, t: torch.Tensor) -> None:
        rows = t.tolist() if t.dim() == 2 else [t.tolist()]
        body = "\n".join("      " + "  ".join(f"{x:8.4f}" for x in row) for row in rows)
        self.echo(f"   {name} {tuple(t.shape)}\n{body}")


def _indent(text: str, pad: str = "      ") -> str:
    return "\n".join(pad + line for line in text.splitlines())


def closed_loop(t: Tour) -> None:
    t.section(1, "The closed loop: scores → mask → softmax → weighted sum of V")
    # small enough to check by hand: one batch, L = S = 2, D = 2, Dv = 2
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (B, L, D)
    k = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])  # (B, S, D)
    v = torch.tensor([[[10.0, 0.0], [0.0, 20.0]]])  # (B, S, Dv)
    for name, x in (("Q", q), ("K", k), ("V", v)):
        t.show(name, x[0])
    t.show("scores = QKᵀ/√D", (q @ k.mT / math.sqrt(2))[0])
    mask = ak.build_causal_mask(2).unsqueeze(0)  # (1, L, S)
    t.echo(f"   causal mask (L, S) = (2, 2), True = may attend\n{_indent(ak.causal().draw(2))}")
    out, weights = ak.scaled_dot_product_attention(q, k, v, mask=mask)
    t.show("weights = softmax(masked scores)", weights[0])
    t.show("output = weights · V", out[0])
    t.echo(
        "   by hand: row 0 sees key 0 alone, so its weights are [1, 0];\n"
        "   row 1 scores [2, 4]/√2 = [1.414, 2.828], softmax → [1, e^1.414] / (1 + e^1.414)"
        " = [0.1956, 0.8044]"
    )
    expected = torch.tensor([[[1.0, 0.0], [0.19557033, 0.80442965]]])
    t.check(
        torch.allclose(weights, expected, atol=1e-5, rtol=1e-5),
        "weights are [[1, 0], [0.1956, 0.8044]]: query 0 reads only value 0",
    )
    t.check(
        torch.allclose(out, expected @ v, atol=1e-5, rtol=1e-5), "output = expected weights · V"
    )
    torch_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t.check(
        torch.allclose(out, torch_out, atol=1e-6),
        "output equals F.scaled_dot_product_attention(is_causal=True)",
    )


def masks(t: Tour) -> None:
    t.section(2, "Masks: True = may attend")
    t.echo(f"   causal(), L = S = 4\n{_indent(ak.causal().draw(4))}")
    lengths = torch.tensor([4, 2])
    padding = ak.key_padding(lengths)
    t.echo(f"   key_padding(lengths=[4, 2]), batch row 1\n{_indent(padding.draw(4, batch=1))}")
    both = ak.causal() & padding
    dense = both.dense(2, 1, 4, 4)
    t.echo(
        f"   causal() & key_padding → {tuple(dense.shape)} (B, 1, L, S), batch row 1\n"
        f"{_indent(both.draw(4, batch=1))}"
    )
    seed = ak.build_attention_mask(torch.arange(4) < lengths[:, None], 4, causal=True)
    t.check(bool((seed == dense).all()), "build_attention_mask gives the same (B, 1, L, S) mask")
    t.echo(
        "   L != S in causal attention: 2 new queries against 5 keys (3 cached tokens and the\n"
        "   2 new ones, as in decoding with a KV cache). Where does query 0 sit? `align` says"
    )
    t.echo(
        f"   causal(align='top_left'), L=2, S=5\n{_indent(ak.causal(align='top_left').draw(2, 5))}"
    )
    t.echo(
        f"   causal(align='bottom_right'), L=2, S=5  (the last query sees every key)\n"
        f"{_indent(ak.causal(align='bottom_right').draw(2, 5))}"
    )
    try:
        ak.causal().draw(2, 5)
        t.check(False, "causal() with L != S refuses to guess")
    except ak.ShapeContractError as err:
        said = textwrap.fill(
            str(err), 84, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False
        )
        t.check(True, f"causal() with L != S refuses to guess, and says why:\n{said}")
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    empty = ak.key_padding(torch.tensor([0]))
    naive = torch.softmax((q @ k.mT).masked_fill(~empty.materialize(1, 1, 3, 3), -math.inf), -1)
    out = ak.attention(q, k, v, empty)
    t.echo(
        f"   a row that sees nothing: plain softmax gives {naive[0, 0, 0, 0].item()}, "
        f"attnkit gives {out[0, 0, 0].tolist()}"
    )
    t.check(bool((out == 0).all()), "an empty row gives zeros, not NaN")


def order_and_scale(t: Tour) -> None:
    t.section(3, "Why mask before softmax, and why scale by 1/√D")
    torch.manual_seed(0)
    scores = torch.randn(4, 4)
    causal = ak.build_causal_mask(4)
    after = torch.softmax(scores, -1) * causal  # mask after: rows no longer sum to 1
    before = ak.masked_softmax(scores, causal)
    t.echo(f"   mask after softmax, row sums:  {[round(x, 3) for x in after.sum(-1).tolist()]}")
    t.echo(f"   mask before softmax, row sums: {[round(x, 3) for x in before.sum(-1).tolist()]}")
    t.check(torch.allclose(before.sum(-1), torch.ones(4)), "masking first renormalises every row")
    t.echo("   D     score std (raw → scaled)   mean max weight (raw → scaled), S=64")
    saturated = True
    for D in (16, 32, 64, 128):
        q, k = torch.randn(256, D), torch.randn(64, D)
        raw, scaled = q @ k.T, q @ k.T / math.sqrt(D)
        w_raw, w_scaled = (
            torch.softmax(raw, -1).amax(-1).mean(),
            torch.softmax(scaled, -1).amax(-1).mean(),
        )
        saturated &= bool(w_raw > w_scaled)
        t.echo(
            f"   {D:<5} {raw.std():6.2f} → {scaled.std():4.2f}              "
            f"{w_raw:5.3f} → {w_scaled:5.3f}"
        )
    t.check(saturated, "without scaling, softmax saturates as D grows (std ≈ √D)")


def contracts(t: Tour) -> None:
    t.section(4, "Shape contracts: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)")
    t.check(
        ak.attention_contract_ok((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), "self"),
        "self: q, k, v all (2, 4, 8, 16)",
    )
    t.check(
        ak.attention_contract_ok((2, 4, 8, 16), (2, 4, 12, 16), (2, 4, 12, 32), "cross"),
        "cross: q (2, 4, 8, 16), k (2, 4, 12, 16), v (2, 4, 12, 32)",
    )
    for q_shape, k_shape in (((2, 4, 8, 16), (2, 4, 8, 32)), ((2, 6, 8, 16), (2, 4, 8, 16))):
        try:
            ak.check_attention_contract(q_shape, k_shape, k_shape, "self")
            t.check(False, f"broken call q {q_shape}, k {k_shape} is refused")
        except ak.ShapeContractError as err:
            t.check(True, f"q {q_shape}, k {k_shape} refused:\n      {err}")


def heads(t: Tour) -> None:
    t.section(5, "Heads: split, attend per head, merge; GQA shares K/V heads")
    x = torch.randn(2, 5, 32)  # (B, L, E)
    split = ak.split_heads(x, 4)
    t.echo(f"   x {tuple(x.shape)} → split_heads(x, 4) {tuple(split.shape)} → merge_heads back")
    t.check(torch.equal(ak.merge_heads(split), x), "split/merge round trip is exact")
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    ours = ak.attention(q, k, v, ak.causal())
    t.check(
        torch.allclose(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6),
        "multi-head attention equals F.scaled_dot_product_attention",
    )
    q8, k2, v2 = torch.randn(1, 8, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    t.echo("   GQA with H=8, Hkv=2: query heads 0-3 read K/V head 0, heads 4-7 read K/V head 1")
    gqa = ak.attention(q8, k2, v2)
    mha = ak.attention(q8, k2.repeat_interleave(4, 1), v2.repeat_interleave(4, 1))
    t.check(torch.allclose(gqa, mha, atol=1e-6), "GQA equals MHA with K/V heads repeated")


def cost(t: Tour) -> None:
    t.section(6, "Cost: the score matrix grows with L²")
    t.echo("   L       score elements (B=1, H=8)   ×     float32 scores per head")
    last = None
    for L in (1024, 2048, 4096, 8192, 16384, 32768):
        n = ak.attention_score_elements(1, 8, L)
        ratio = "" if last is None else f"×{n // last}"
        t.echo(f"   {L:<7} {n:>14,}                {ratio:<5} {L * L * 4 / 2**20:8,.0f} MiB")
        last = n
    t.check(
        ak.attention_score_elements(1, 8, 2048) == 4 * ak.attention_score_elements(1, 8, 1024),
        "doubling L multiplies the score elements by 4",
    )
    q = torch.empty(1, 8, 8192, 64)
    plan = ak.explain(q, q, q, ak.sliding_window(255))
    t.echo("   explain(q, k, v, sliding_window(255)) with L = S = 8192, H = 8, D = 64:")
    dense = 2 * 8 * 8192 * 8192 * (64 + 64)
    t.echo(
        f"      mask {plan.mask}: {plan.density:.1%} of the L×S pairs, "
        f"{plan.flops / 1e9:.1f} GFLOP of {dense / 1e9:.0f} dense; runs on '{plan.backend}'"
    )
    t.check(plan.density < 0.05, f"a 256-key window keeps {plan.density:.1%} of the L×S pairs")


def position_blindness(t: Tour) -> None:
    t.section(7, "Position blindness: attention alone ignores token order")
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    perm = torch.randperm(6)
    out = ak.attention(q, k, v)
    permuted = ak.attention(q[:, :, perm], k[:, :, perm], v[:, :, perm])
    t.echo(f"   permute the 6 tokens by {perm.tolist()}")
    t.check(
        torch.allclose(permuted, out[:, :, perm], atol=1e-6),
        "permuting the tokens permutes the output (so models add positions: RoPE, ALiBi)",
    )


SECTIONS = (closed_loop, masks, order_and_scale, contracts, heads, cost, position_blindness)


def run_tour(echo: Printer = print) -> int:
    """Run every section; returns the number of failed checks."""
    torch.manual_seed(0)
    t = Tour(echo)
    echo("attnkit tour: the attention mechanism, step by step, checked live against PyTorch")
    for section in SECTIONS:
        section(t)
    echo(f"\n{t.passed} checks passed, {t.failed} failed.")
    echo(
        "Next: the docs' pages 'Getting started', 'Masks' and 'API reference'; at the "
        "command line `attnkit mask sliding --window 3` draws a mask, `attnkit explain "
        "documents` shows the plan of a call and `attnkit bench` times attention() here."
    )
    return t.failed
