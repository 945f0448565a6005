"""The `native` backend's cost factors: what `auto` prices attnkit's own kernel with, per
kind of CPU, and where each was measured (`NativeBackend.cost` reads them; `attnkit
calibrate` times `pair`, `piece`, `call` and `bf16` on this machine)."""

from __future__ import annotations

import math

from attnkit.call import cost

__all__ = ["FACTORS"]

BF16_AVX512 = 0.67  # the kernel's bfloat16 factor on AVX512-BF16 (see `bf16` below)
NEVER = math.inf  # a step threshold no step reaches
# the AVX512 kinds price with AMX's factors (`cost.NEAREST`) but those of AMX's tiles: their
# half steps and half backward as measured on AVX512-BF16
WITHOUT_TILES = {"backward_half": 4.5, "step_keys_half": 1.0, "step_keys_half_padded": 1.0}

# against dense SDPA's per pair: `pair` per pair computed (every block's or group's
# rows by its keys, masked corners included), `piece` per whole block or cut group,
# `call` per call (the spans' checks, the threads' start, the op's dispatch). Fitted
# on a 2-core AVX2 CPU by `python benchmarks/native_fit.py` (windows, causal, chunks,
# prefix-LM and no mask at L = 256..4096, all within ±10%), and by the same command on
# a 2-core AVX512-BF16 CPU, where brgemm's micro-kernels multiply float32 faster than
# SDPA's BLAS (within ±13%); `attnkit calibrate` times them on this machine
FACTORS = cost.Factors(
    {
        "pair": 1.05,
        "piece": 300.0,
        "call": 68_000.0,
        "kv": 0.36,
        "head": 0.57,
        "step": 5_000.0,
        "backward": 3.6,
        "backward_half": 3.8,
        "bf16": 1.0,
        "step_keys": 8192.0,
        "step_keys_mha": 65536.0,
        "step_keys_half": 1.0,
        "step_keys_half_padded": 1.0,
    },
    {
        "amx": {
            "bf16": 1.6,
            "backward_half": 2.7,
            "step_keys_half": NEVER,
            "step_keys_half_padded": 262144.0,
        },
        "avx512_bf16": {
            "pair": 0.86,
            "piece": 350.0,
            "bf16": BF16_AVX512,
            "step_keys_mha": 8192.0,
        }
        | WITHOUT_TILES,
        "avx512": WITHOUT_TILES,
    },
)
# A decoding call (at most DECODE_ROWS queries) reads keys, not multiplies: `kv` per
# key of each K/V head (read once for its G query heads), `head` per key of each query
# head, `step` per call, in units of SDPA's decoding pair (its cost counts B·H·L·S);
# fitted by hand on the same CPU to float32 steps of B = 1..32, S = 512..8192, GQA
# (`python benchmarks/native.py`'s decoding grid) and MHA alike; the planner prices no
# step with them but where no rule decides (`step_keys*` below: the rule).
# `backward`, `backward_half`: forward+backward over forward (`training_factor`), the
# medians over every pattern at S = 1024 and 4096 on a 2-core AVX512-BF16 CPU (float32
# 2.2-4.8; bfloat16 on the half units 2.9-5.7, median 4.45, as the converting kernel's:
# the AVX512 kinds' `backward_half`); the default `backward_half` 3.8 is fitted to the
# bfloat16 forward+backward rows of the AVX2 table (native at 0.81-1.06 of tiled's
# time at S = 1024 and 4096), where bfloat16's forward is priced high against tiled's
# and this factor carries the correction
# `bf16`: the kernel's work on bfloat16 inputs that run on the half units (`half_units`)
# over its float32 work, each against SDPA's in the same dtype; 1 where blocks convert
# to float32 (AVX2). On AVX512-BF16 `BF16_AVX512`, the forward's per-pair times over
# float32's (`python benchmarks/native.py`: 0.61-0.75 at S = 1024 and 4096, packed
# documents aside). On AMX, where SDPA multiplies bfloat16 on the tiles and so does
# the kernel by default, `bf16` 1.6 and `backward_half` 2.7 come from the amx table
# (`benchmarks/results/native_amx.json`): the kernel's dense forward took 1.50-1.60×
# SDPA's time, its forward+backward 2.4-3.4× its forward (median 2.7); both price the
# tiles, so the half mode `native` (the pair dots) on AMX is priced too low
# `step_keys*`: a decoding step's B·G·bucket(S) from which the kernel takes it
# (`takes_step`), read off each kind's decoding grid: float32 GQA steps (`step_keys`),
# float32 MHA steps (`step_keys_mha`: 8,192 on AVX512-BF16, 65,536 on AVX2 and AMX,
# where SDPA is within 5% below), half steps (`step_keys_half`: every one on AVX2 and
# AVX512-BF16, where SDPA's takes 2-14× the kernel's time; none on AMX, where SDPA
# decodes on the tiles at 1.0-2.5× the kernel's speed) and half padded steps
# (`step_keys_half_padded`: on AMX from 262,144, 1.09-1.31× SDPA there)
