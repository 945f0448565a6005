"""The CPU cost model of the planner, in one place.

Unit: the time SDPA's dense fused kernel spends on one query-key pair of one head. The
SDPA factors come from the first full `make bench` (benchmarks/results/bench.json of
2026-11-30: per-pair time against dense SDPA at the same S, S = 4096 and 16384); the
tiled factors from kernel timings of (n, 8, R, K) blocks on the same 2-core machine
(PyTorch 2.13, float32, D=64). They only need to rank the backends, not predict seconds.
"""

from __future__ import annotations

SDPA_DENSE = 1.0  # F.scaled_dot_product_attention, no mask
SDPA_CAUSAL = 1.0  # is_causal=True, per pair it computes (about half of L×S)
SDPA_MASKED = 1.25  # with a mask tensor: the kernel reads it and skips no block
TILED_PAIR = 1.2  # tiled, per pair inside blocks of 256+ rows (short blocks: tiled_pair)
TILED_CAUSAL = 1.15  # tiled, per pair of a long causal run (is_causal, 768+ rows)
TILED_PREDICATE = 2.2  # tiled, factor on masks holding an L×S tensor (`has_dense_tensor`):
# gathering each block's mask costs more than the pairs it skips (a (2, 1, 2048, 2048)
# bool mask, fp32, H=4: tiled 276 ms, sdpa 134 ms, plain SDPA 130 ms; 2026-11-30)
TILED_CALL = 50_000.0  # tiled, per group of blocks (masks, copies, Python)
FLEX_PAIR = 2.4  # compiled FlexAttention, per pair inside its 128×128 blocks (warm)
BLOCKWISE = 4.0  # the reference's math in row blocks over key spans (checkpointed)
REFERENCE = 6.0  # the readable loop materializes (B, H, L, S) scores several times


def tiled_pair(rows: int) -> float:
    """Tiled's per-pair cost on blocks of `rows` query rows: short blocks use the op less well."""
    return float(TILED_PAIR * (256 / min(max(rows, 1), 256)) ** 0.1)
