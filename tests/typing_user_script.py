"""A user's script on the NumPy backend, type-checked with ``mypy --strict``.

tests/test_typing.py runs it and checks it with mypy (as .ci/run does against the
installed wheel): every public call below must have real parameter and return
types (under ``--strict`` an unannotated function is an error to call, and a
function declared to return ``int`` may not return ``Any``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

import cpsparse
from cpsparse import reference
from cpsparse.raw_kernels import supported_modules, supported_ops

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


def fill_cache(keys: F32, block_size: int) -> cpsparse.IndexerKCache:
    """Write keys [N, D] to consecutive slots of a fresh indexer cache."""
    n, d = keys.shape
    cache = cpsparse.IndexerKCache(num_blocks=-(-n // block_size), block_size=block_size,
                                   head_dim=d)
    cache.insert(keys, np.arange(n, dtype=np.int32))
    return cache


def pages(cache: cpsparse.IndexerKCache) -> int:
    return cache.num_blocks


def prefill_topk(q: F32, cache: cpsparse.IndexerKCache, n_keys: int, topk: int) -> I32:
    """Causal prefill of one request: logits over its keys, then the top-k of each row."""
    t, h, _ = q.shape
    rng = np.random.default_rng(1)
    q8, q_scales = cpsparse.quantize_fp8(cpsparse.hadamard_rotate(q), eps=1e-10)
    weights = cpsparse.fold_weights(rng.standard_normal((t, h)).astype(np.float32), q_scales,
                                    head_dim=cache.head_dim)
    k8, k_scales = cache.gather(np.zeros((1, pages(cache)), np.int32),
                                np.array([0, n_keys], np.int32))
    ks = np.zeros(t, np.int32)
    ke = np.arange(n_keys - t + 1, n_keys + 1, dtype=np.int32)
    logits = cpsparse.mqa_logits(q8, k8, k_scales, weights, ks, ke)
    top: I32 = cpsparse.topk_per_row(logits, ks, ke, topk)
    return top


def attend(q: F32, latents: F32, kv_lora_rank: int, indices: I32) -> tuple[F32, F32]:
    """Sparse MLA attention of q [T, H, D] over the selected rows of a paged latent cache."""
    cache = cpsparse.MLAKVCache(num_blocks=1, block_size=64, kv_lora_rank=kv_lora_rank)
    n = latents.shape[0]
    cache.insert(np.ascontiguousarray(latents[:, :kv_lora_rank]),
                 np.ascontiguousarray(latents[:, kv_lora_rank:]), np.arange(n, dtype=np.int32))
    slots = cpsparse.local_to_global_slots(indices, np.zeros(len(indices), np.int32),
                                           np.zeros((1, 1), np.int32), block_size=64)
    scale: float = cpsparse.softmax_scale(128, 64)
    out, lse = cpsparse.sparse_mla_attention(q, cache, slots, scale)
    dense_out, _ = cpsparse.dense_mla_attention(q, cache.gather(np.arange(n, dtype=np.int32)),
                                                scale)
    assert out.shape == dense_out.shape
    return out, lse


def main() -> None:
    rng = np.random.default_rng(0)
    n_keys, tokens, topk = 48, 8, 16
    keys: F32 = rng.standard_normal((n_keys, 128)).astype(np.float32)
    cache = fill_cache(keys, block_size=64)
    assert pages(cache) == 1 and cache.num_slots == 64
    top = prefill_topk(rng.standard_normal((tokens, 4, 128)).astype(np.float32), cache,
                       n_keys, topk)
    assert top.shape == (tokens, topk) and top.dtype == np.int32

    codes, scales = cpsparse.quantize_fp8(keys)
    back = cpsparse.dequantize_fp8(codes, scales)
    assert float(np.abs(back - keys).max()) <= 0.07 * float(np.abs(keys).max())
    ref_codes, _ = reference.fp8.quantize_groups(keys, 128, "ue8m0", 1e-4)
    assert np.array_equal(ref_codes, codes)

    latents: F32 = rng.standard_normal((n_keys, 128 + 64)).astype(np.float32)
    q: F32 = rng.standard_normal((tokens, 2, 128 + 64)).astype(np.float32)
    out, lse = attend(q, latents, 128, top)
    assert out.shape == (tokens, 2, 128) and lse.shape == (tokens, 2)

    xp = cpsparse.get_array_module(keys)
    assert xp is np
    on_gpu: bool = cpsparse.gpu_available()
    previous: bool = cpsparse.set_device_value_checks(True)
    cpsparse.set_device_value_checks(previous)
    ops: list[str] = supported_ops((9, 0))
    assert "topk_per_row" in ops and supported_modules("8.0") == ["quant"]
    print(f"typing user script ok (gpu available: {on_gpu})")


if __name__ == "__main__":
    main()
