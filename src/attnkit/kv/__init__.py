"""Keys and values kept across calls: the KV cache of incremental decoding (`cache`), the
paged cache of many sequences (`pool`, `paged`), where a module's heads attend
(`attender`), and the positions models add (`positional`: rotary embeddings).

The paged cache is vLLM's PagedAttention layout: the pool holds `num_blocks` blocks of
`block_size` token slots, and one block id holds those tokens' keys and values for every
layer. Each sequence has a block table (its blocks in order) and a length; blocks are
reference counted, so `fork` shares a sequence's blocks without copying and the first
write into a shared, partly filled block copies it (copy on write). `step` makes room
for the next tokens of several sequences at once (continuous batching: sequences join
and leave between steps) and `paged_attention` writes a layer's new keys and values and
attends each new token to its own sequence's history.

    pages = PagedKVCache(num_layers, num_kv_heads, head_dim, num_blocks=1024)
    s = pages.add()
    step = pages.step([s], [len(prompt)])
    for layer in range(num_layers):
        out = paged_attention(q, k, v, pages, step, layer)     # (T, H, Dv)
"""
