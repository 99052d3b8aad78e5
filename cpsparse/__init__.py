"""cpsparse: DeepSeek-V3.2-style sparse attention (DSA) on CuPy and NumPy.

The lightning indexer scores every earlier key in FP8
(:func:`cpsparse.indexer.mqa_logits`, :func:`cpsparse.indexer.paged_mqa_logits`),
a per-row top-k keeps the best ``index_topk`` (:func:`cpsparse.indexer.topk_per_row`),
and sparse MLA attention reads only those rows
(:func:`cpsparse.attention.sparse_mla_attention`).

NumPy inputs run the float64 reference (:mod:`cpsparse.reference`), which is
also the oracle the CUDA kernels are tested against; CuPy inputs stay on the
GPU. Mixing the two is an error.
"""

__version__ = "0.1.0"

from cpsparse import attention, indexer, reference  # noqa: F401
from cpsparse._backend import get_array_module, gpu_available, set_kernels_enabled
from cpsparse._validation import set_device_value_checks
from cpsparse.attention import (dense_mla_attention, local_to_global_slots,
                                softmax_scale, sparse_mla_attention)
from cpsparse.cache import IndexerKCache, MLAKVCache, Model1KVCache
from cpsparse.fp8 import dequantize_fp8, quantize_fp8
from cpsparse.raw_kernels import precompile, set_pdl
from cpsparse.indexer import (fold_weights, hadamard_rotate, mqa_logits, paged_mqa_logits,
                              topk_per_row, topk_per_row_decode)

__all__ = [
    "quantize_fp8", "dequantize_fp8", "IndexerKCache", "MLAKVCache", "Model1KVCache",
    "mqa_logits", "paged_mqa_logits", "topk_per_row", "topk_per_row_decode",
    "fold_weights", "hadamard_rotate",
    "sparse_mla_attention", "dense_mla_attention", "local_to_global_slots", "softmax_scale",
    "get_array_module", "gpu_available", "set_device_value_checks", "set_kernels_enabled",
    "precompile", "set_pdl",
    "attention", "indexer", "reference",
]
