"""The CPU cost model of the planner, in one place.

Unit: the time SDPA's dense fused kernel spends on one query-key pair of one head. The
factors were estimated from timing runs on the 2-core CI machines (PyTorch 2.13, float32,
D=64, S=1024-4096) before the first full `make bench`; they only need to rank the
backends, not predict seconds. Recalibrate them from `benchmarks/results/bench.json`.
"""

from __future__ import annotations

SDPA_DENSE = 1.0  # F.scaled_dot_product_attention, no mask
SDPA_CAUSAL = 1.1  # is_causal=True, per pair it computes (about half of L×S)
SDPA_MASKED = 1.6  # with a mask tensor: the kernel reads it and skips no block
TILED_PAIR = 1.9  # tiled, per pair inside its blocks (tile-local masks, gathers)
TILED_CALL = 700_000.0  # tiled, per kernel call and per gather (about 1 ms)
FLEX_PAIR = 2.4  # compiled FlexAttention, per pair inside its 128×128 blocks (warm)
REFERENCE = 6.0  # the readable loop materializes (B, H, L, S) scores several times
