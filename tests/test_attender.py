"""The one protocol a module's heads attend through (`attnkit.kv.attender`)."""

from __future__ import annotations

import torch

import attnkit as ak
from attnkit.kv.attender import PLAIN


class Recording:
    """An attender of our own: the module must call it, and only it, the same way."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], float, str]] = []

    def check(self, query, key, value, dropout_p):
        pass

    def positions(self, rows, device):
        return 0

    def attend_heads(self, q, k, v, mask, *, dropout_p, backend):
        self.calls.append((tuple(q.shape), dropout_p, backend))
        return PLAIN.attend_heads(q, k, v, mask, dropout_p=dropout_p, backend=backend)


def test_a_module_attends_through_whatever_attender_it_is_given():
    torch.manual_seed(0)
    module = ak.MultiHeadAttention(16, 4, num_kv_heads=2, rope=True, backend="sdpa").eval()
    x = torch.randn(2, 5, 16)
    recording = Recording()
    got = module(x, mask=ak.causal(), cache=recording)  # type: ignore[arg-type]
    torch.testing.assert_close(got, module(x, mask=ak.causal()))
    assert recording.calls == [((2, 4, 5, 4), 0.0, "sdpa")]


def test_a_kv_cache_is_an_attender_whose_positions_follow_the_cached_rows():
    torch.manual_seed(0)
    module = ak.MultiHeadAttention(16, 4, rope=True).eval()
    x = torch.randn(1, 6, 16)
    cache = ak.KVCache()
    assert cache.positions(4, x.device) == 0
    first = module(x[:, :4], mask=ak.causal(), cache=cache)
    assert cache.positions(2, x.device) == 4
    rest = module(x[:, 4:], mask=ak.causal(align="bottom_right"), cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), module(x, mask=ak.causal()))
