"""requires: gpu. Top-k of torch tensors through cpsparse, zero-copy via DLPack.

cpsparse has no torch dependency: a torch user hands CuPy views of the tensors
(``cupy.from_dlpack``) and gets results written into torch memory.
"""

import cupy as cp
import numpy as np

import cpsparse

try:
    import torch
except ImportError:                  # plain CuPy works the same way
    torch = None

rows, width, k = 8, 8192, 2048
if torch is not None:
    logits_t = torch.randn(rows, width, device="cuda")
    out_t = torch.full((rows, k), -7, dtype=torch.int32, device="cuda")
    logits, out = cp.from_dlpack(logits_t), cp.from_dlpack(out_t)
else:
    logits = cp.random.standard_normal((rows, width), dtype=cp.float32)
    out = cp.full((rows, k), -7, dtype=cp.int32)
starts = cp.zeros(rows, dtype=cp.int32)
ends = cp.full(rows, width, dtype=cp.int32)
cpsparse.topk_per_row(logits, starts, ends, k, out=out)      # writes into the torch tensor
want = cpsparse.topk_per_row(logits.get(), starts.get(), ends.get(), k)
assert np.array_equal(np.sort(out.get(), axis=1), np.sort(want, axis=1))
print("top-k via DLPack ok:", tuple(out.shape))
