"""A call, from its arguments to its result: the functions people call (`functional`:
`attention`, `attention_with_lse`, `prepare`, `explain`; `probs`: `attention_probs`), the
prepared call kept for a repeated one (`dispatch`, `prepared`, `plan_values`, `by_mask`,
`bounded`), the choice of a backend and why (`planner`, priced by `cost`, measured by
`calibrate`; decoding steps by `steps`), the dtype each step computes in (`precision`),
the rows and keys zeroed before a kernel (`visibility`), running the plan (`execute`,
`threads`), packed documents (`documents`), the kernel boundary inside `torch.compile`
(`compiled`) and gradients from the output and log-sum-exp (`gradients`); `habits` points
the keywords of other libraries to attnkit's.
"""
