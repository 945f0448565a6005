"""Context parallelism: exact attention over a sequence split across processes.

Every rank holds its rows of q, k and v (`shard`), the same global mask over global
positions, and calls `attention` with the others; the result is its rows of the output
(`unshard` gathers them). Built on `torch.distributed` (gloo on CPU, nccl on GPU).

    import attnkit.distributed as akd
    q_local = akd.shard(q, layout="zigzag")                     # (B, H, L/P, D)
    out_local = akd.attention(q_local, k_local, v_local, ak.causal())
    out = akd.unshard(out_local, layout="zigzag")               # (B, H, L, Dv)

The mask's key spans decide which ranks exchange anything (a narrow sliding window
talks to neighbours only, shard-aligned documents not at all); partial results merge
exactly through their log-sum-exp, and the backward pass sends key/value gradients
back to the ranks that own them.
"""

from attnkit.distributed.api import attention, attention_with_lse, explain, shard, unshard
from attnkit.distributed.context import ContextParallel, parallelize
from attnkit.distributed.layout import LAYOUTS
from attnkit.distributed.plan import ContextPlan
from attnkit.distributed.strategies import STRATEGIES
from attnkit.errors import RanksDisagreeError

__all__ = [
    "LAYOUTS",
    "STRATEGIES",
    "ContextParallel",
    "ContextPlan",
    "RanksDisagreeError",
    "attention",
    "attention_with_lse",
    "explain",
    "parallelize",
    "shard",
    "unshard",
]
