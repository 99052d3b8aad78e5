"""Score a ragged prefill batch with the FP8 indexer and keep the top-k (NumPy).

Two requests share a paged key cache: request 0 has 300 tokens of context and
40 new tokens, request 1 has 50 new tokens. Keys go into the cache, are
gathered back per request, scored, and the top-64 positions kept per token.
"""

import numpy as np

import cpsparse

rng = np.random.default_rng(0)
H, D, BLOCK, TOPK = 16, 128, 64, 64
context, new = np.array([300, 0]), np.array([40, 50])
total = context + new

cache = cpsparse.IndexerKCache(num_blocks=16, block_size=BLOCK, head_dim=D)
table = np.array([[3, 9, 1, 12, 7, 0], [5, 2, 0, 0, 0, 0]], np.int32)   # shuffled pages
for r in range(2):                                   # write every key of each request
    pos = np.arange(total[r])
    slots = (table[r, pos // BLOCK] * BLOCK + pos % BLOCK).astype(np.int32)
    cache.insert(rng.standard_normal((total[r], D)).astype(np.float32), slots)

cu = np.concatenate([[0], np.cumsum(total)]).astype(np.int32)
k_codes, k_scales = cache.gather(table, cu)          # [390, 128], [390]

q = rng.standard_normal((new.sum(), H, D)).astype(np.float32)
q8, q_scales = cpsparse.quantize_fp8(cpsparse.hadamard_rotate(q), eps=1e-10)
w = cpsparse.fold_weights(rng.standard_normal((new.sum(), H)).astype(np.float32), q_scales)

# causal windows in the gathered keys: query i of request r sees [cu[r], cu[r] + ctx + i + 1)
ks = np.concatenate([np.full(n, cu[r]) for r, n in enumerate(new)]).astype(np.int32)
ke = np.concatenate([cu[r] + context[r] + np.arange(n) + 1
                     for r, n in enumerate(new)]).astype(np.int32)
logits = cpsparse.mqa_logits(q8, k_codes, k_scales, w, ks, ke)
top = cpsparse.topk_per_row(logits, ks, ke, TOPK)

assert top.shape == (90, TOPK)
assert (top[40:] == -1).sum() > 0                    # request 1's early rows are short
print("logits", logits.shape, "top-k", top.shape)
print("request 0, last token keeps positions", np.sort(top[39])[:8], "...")
print("request 1, token 3 (4 keys visible):", top[43][:6])
