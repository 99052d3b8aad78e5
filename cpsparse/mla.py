"""The DeepSeek-V3.2 MLA layer driver and its construction-time gate.

:class:`DeepseekV32MLA` is a plain-Python layer on NumPy or CuPy arrays: the
MLA projections (q_a/q_b with RMSNorm, kv_a with RMSNorm, kv_b absorbed into
the query and the output, o_proj), the lightning indexer (wq_b, wk with its
LayerNorm, weights_proj, RoPE on the first 64 dims, Hadamard rotation, FP8),
and the attention routes: dense causal MHA for short prefills, sparse MLA over
the shared top-k buffer otherwise.

The gate (``docs/contract.md``, "The indexer of a layer and the construction-time
gate") is decided once, at construction::

    enable_short_prefill_scoring_skip = (not is_mtp_layer and not skip_topk
                                         and not use_pcp and platform.is_cuda())
    _dense_mha_metadata_layer_name = layer_name if enabled else ""

and the indexer only obeys that name. MTP layers never enable it (their rows
are reused by later draft steps), nor do index-sharing layers (they own no
indexer) or PCP layers.
"""

import dataclasses
import math
from typing import Any, Optional

import numpy

from cpsparse import _backend
from cpsparse.attention import (dense_mla_attention_core, local_to_global_slots_core,
                                softmax_scale, sparse_mla_attention_core)
from cpsparse.cache import IndexerKCache, MLAKVCache
from cpsparse.fp8 import quantize_fp8
from cpsparse.indexer import fold_weights, hadamard_rotate, paged_mqa_logits_core
from cpsparse.sparse_attn_indexer import IndexerStats, sparse_attn_indexer_core
from cpsparse import _validation as V
from cpsparse.metadata import ForwardContext, check_batch, dense_metadata, get_forward_context
from cpsparse.parallel import (DcpDecodeView, check_group, dcp_local_indices,
                               dcp_merge_attention, dcp_topk_per_row_core, pcp_all_gather)
from cpsparse.platform import current_platform

__all__ = ["MLAConfig", "DeepseekV32MLA", "DeepseekV32AttentionStack", "init_weights",
           "AttentionStats"]

INDEX_Q_EPS = 1e-10


@dataclasses.dataclass
class MLAConfig:
    """Shapes of one DeepSeek-V3.2 attention layer (defaults: the released model).

    Every field is a constructor keyword; the sizes must be positive ints
    (checked at construction, ``ValueError`` naming the field).

    Parameters
    ----------
    hidden_size : int
        Model width, the last dim of the layer's input and output (7168).
    num_heads : int
        MLA attention heads of this layer on this rank (128; 16, 32 or 64 per
        rank under tensor parallelism).
    q_lora_rank : int
        Width of the compressed query ``q_c = RMSNorm(x @ q_a_proj)`` (1536);
        the indexer's ``wq_b`` reads the same ``q_c``.
    kv_lora_rank : int
        Width L of the latent ``kv_c`` (512), a multiple of 128: the
        fp8_ds_mla cache keeps one float32 scale per 128 latent values, and the
        attention's value width is L.
    qk_nope_head_dim : int
        Per-head query/key dims without RoPE (128), absorbed into the latent
        through ``W_UK`` (from ``kv_b_proj``).
    qk_rope_head_dim : int
        RoPE dims R (64): the per-head ``q_pe``, the shared ``k_pe`` (bf16 in
        the cache), and the rotated leading dims of the indexer's q and k. Even,
        and at most ``index_head_dim``.
    v_head_dim : int
        Per-head value dims after ``W_UV`` (128); ``o_proj`` reads
        ``num_heads * v_head_dim``.
    index_n_heads : int
        Indexer heads H (64).
    index_head_dim : int
        Indexer head dim D (128): the FP8 group of its queries and keys and the
        ``head_dim`` of its key cache; a power of two when ``index_hadamard``.
    index_topk : int
        Keys each query keeps (2048; 512 and 1024 work too): the width of the
        top-k buffer, and the dense-route threshold
        (``prefill.use_dense_mha = prefill.max_seq_len <= index_topk``).
    block_size : int
        Tokens per page of both paged caches (64).
    rope_theta : float
        RoPE base (10000.0) of the MLA (interleaved pairs) and the indexer
        (NeoX halves). Plain RoPE: no YaRN frequency scaling.
    rms_norm_eps : float
        Epsilon of the RMSNorms of ``q_c`` and ``kv_c`` (1e-6).
    softmax_mscale : float or None
        YaRN attention factor: ``sm_scale`` is multiplied by its square (see
        :func:`cpsparse.softmax_scale`). None (the default): no factor, so
        ``sm_scale = 192 ** -0.5``. DeepSeek-V3.2's checkpoint config (rope
        factor 40, ``mscale_all_dim`` 1.0) corresponds to
        ``0.1 * ln 40 + 1 = 1.368888``.
    index_scale_fmt : {"ue8m0", None}
        Scale format of the indexer's FP8 queries and keys ("ue8m0": powers
        of two, as in DeepSeek-V3.2; None: plain float32 scales).
    index_hadamard : bool
        Rotate the indexer's q and k by the normalised Hadamard matrix before
        FP8 quantization (True in DeepSeek-V3.2).
    index_cache_dtype : {"fp8", "mxfp4"}
        Key format of the indexer cache (:class:`cpsparse.IndexerKCache`'s
        ``dtype``): FP8 (132 bytes a key at D = 128) or MXFP4 (68 bytes; the
        queries stay FP8).
    indexer_rope_interleave : bool
        RoPE layout of the indexer's q and k: False, NeoX halves (dims i and
        i + R/2 rotate together; DeepSeek-V3.2), or True, interleaved pairs
        (2i, 2i + 1; GLM-5.x). The MLA's own RoPE is interleaved in both.
    index_topk_freq, index_skip_topk_offset : int
        The index-sharing schedule of a stack of layers (IndexCache, vLLM's
        names): layer ``i`` runs its own indexer when
        ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` and
        otherwise reads the rows of the last layer that did (see
        :meth:`layer_scores`). The defaults (1, 1): every layer scores; freq n
        with offset 1: layers 0, n, 2n, ...; GLM-5.2: freq 4, offset 3 (layers
        0, 1, 2, 6, 10, ...).
    index_topk_pattern : str or None
        An explicit schedule instead: one letter a layer, ``"F"`` (scores) or
        ``"S"`` (shares); it starts with ``"F"`` and covers every layer of a
        stack.

    Attributes
    ----------
    qk_head_dim : int
        ``qk_nope_head_dim + qk_rope_head_dim`` (192), the head dim that sets
        the softmax scale.
    sm_scale : float
        ``softmax_scale(qk_nope_head_dim, qk_rope_head_dim, softmax_mscale)``.

    Examples
    --------
    >>> from cpsparse.mla import MLAConfig
    >>> cfg = MLAConfig()
    >>> cfg.qk_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.index_topk
    (192, 576, 2048)
    >>> MLAConfig.small().index_topk
    64
    >>> round(cfg.sm_scale, 6), round(MLAConfig(softmax_mscale=1.368888).sm_scale, 6)
    (0.072169, 0.135234)
    >>> glm = MLAConfig.glm5()
    >>> [glm.layer_scores(i) for i in range(8)]
    [True, True, True, False, False, False, True, False]
    >>> [MLAConfig(index_topk_pattern="FSSF").layer_scores(i) for i in range(4)]
    [True, False, False, True]
    """
    hidden_size: int = 7168
    num_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    block_size: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    softmax_mscale: Optional[float] = None     # YaRN mscale; sm_scale *= mscale ** 2
    index_scale_fmt: Optional[str] = "ue8m0"
    index_hadamard: bool = True
    index_cache_dtype: str = "fp8"
    indexer_rope_interleave: bool = False
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 1
    index_topk_pattern: Optional[str] = None

    @classmethod
    def glm5(cls, **overrides):
        """GLM-5.2's attention shapes on one rank (its Hugging Face config as vLLM
        reads it): 64 MLA heads, ``qk_nope_head_dim`` 192, ``v_head_dim`` 256,
        ``q_lora_rank`` 2048, 32 indexer heads with interleaved RoPE, top-k 2048,
        and index sharing with freq 4, offset 3 (21 of its 78 layers score)."""
        base: dict[str, Any] = dict(hidden_size=6144, num_heads=64, q_lora_rank=2048,
                                    kv_lora_rank=512, qk_nope_head_dim=192,
                                    qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32,
                                    index_head_dim=128, index_topk=2048, rms_norm_eps=1e-5,
                                    indexer_rope_interleave=True, index_topk_freq=4,
                                    index_skip_topk_offset=3)
        base.update(overrides)
        return cls(**base)

    def layer_scores(self, layer_id: int) -> bool:
        """True when layer ``layer_id`` of a stack runs its own indexer; False when it
        shares the rows of the last layer that scored (the schedule of
        ``index_topk_pattern``, else of ``index_topk_freq`` and
        ``index_skip_topk_offset``)."""
        layer_id = V.check_nonnegative_int("layer_id", layer_id)
        if self.index_topk_pattern is not None:
            if layer_id >= len(self.index_topk_pattern):
                raise ValueError(f"Invalid layer_id: index_topk_pattern has "
                                 f"{len(self.index_topk_pattern)} layers, got {layer_id}")
            return self.index_topk_pattern[layer_id] == "F"
        return max(layer_id - self.index_skip_topk_offset + 1, 0) % self.index_topk_freq == 0

    @classmethod
    def small(cls, **overrides):
        """A preset that runs a whole layer in milliseconds on the CPU."""
        base: dict[str, Any] = dict(hidden_size=256, num_heads=4, q_lora_rank=96, kv_lora_rank=128,
                    qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                    index_n_heads=8, index_head_dim=128, index_topk=64, block_size=16)
        base.update(overrides)
        return cls(**base)

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self):
        return softmax_scale(self.qk_nope_head_dim, self.qk_rope_head_dim, self.softmax_mscale)

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                     "index_head_dim", "index_topk", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Invalid MLAConfig.{name}: expected a positive int, "
                                 f"got {value!r}")
        if self.kv_lora_rank % 128:
            raise ValueError(f"Invalid MLAConfig.kv_lora_rank: expected a multiple of 128 "
                             f"(fp8_ds_mla scale groups), got {self.kv_lora_rank}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"Invalid MLAConfig.qk_rope_head_dim: expected an even number "
                             f"<= index_head_dim={self.index_head_dim}, "
                             f"got {self.qk_rope_head_dim}")
        if self.index_hadamard and self.index_head_dim & (self.index_head_dim - 1):
            raise ValueError(f"Invalid MLAConfig.index_head_dim: the Hadamard rotation needs "
                             f"a power of two, got {self.index_head_dim}")
        if self.index_cache_dtype not in ("fp8", "mxfp4"):
            raise ValueError(f"Invalid MLAConfig.index_cache_dtype: expected 'fp8' or "
                             f"'mxfp4', got {self.index_cache_dtype!r}")
        if not isinstance(self.index_topk_freq, int) or isinstance(self.index_topk_freq, bool) \
                or self.index_topk_freq <= 0:
            raise ValueError(f"Invalid MLAConfig.index_topk_freq: expected a positive int, "
                             f"got {self.index_topk_freq!r}")
        if not isinstance(self.index_skip_topk_offset, int) or \
                isinstance(self.index_skip_topk_offset, bool) or self.index_skip_topk_offset < 0:
            raise ValueError(f"Invalid MLAConfig.index_skip_topk_offset: expected a "
                             f"non-negative int, got {self.index_skip_topk_offset!r}")
        pattern = self.index_topk_pattern
        if pattern is not None and (not isinstance(pattern, str) or not pattern
                                    or set(pattern) - {"F", "S"} or pattern[0] != "F"):
            raise ValueError(f"Invalid MLAConfig.index_topk_pattern: expected a string of 'F' "
                             f"(scores) and 'S' (shares) starting with 'F', got {pattern!r}")
        if not self.layer_scores(0):
            raise ValueError(f"Invalid MLAConfig.index_skip_topk_offset: layer 0 must score "
                             f"(no earlier layer wrote rows to share), but freq "
                             f"{self.index_topk_freq} with offset "
                             f"{self.index_skip_topk_offset} makes it share")


def init_weights(config, seed=0, with_indexer=True):
    """Random float32 weights (NumPy) for one layer, scaled by 1/sqrt(fan_in).

    Keys follow the checkpoint names (``q_a_proj``, ``kv_b_proj``,
    ``indexer.wq_b`` ...); matrices are stored [in, out] so that ``x @ W``.

    Parameters
    ----------
    config : MLAConfig
        The layer's shapes.
    seed : int
        Seed of ``numpy.random.default_rng``.
    with_indexer : bool
        Include the ``indexer.*`` weights (False for an index-sharing layer).

    Returns
    -------
    dict of str to numpy.ndarray
        float32 weights by checkpoint name.
    """
    c = config
    rng = numpy.random.default_rng(seed)

    def mat(n_in, n_out):
        return (rng.standard_normal((n_in, n_out)) / math.sqrt(n_in)).astype(numpy.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(numpy.float32)

    h = c.num_heads
    w = {
        "q_a_proj": mat(c.hidden_size, c.q_lora_rank),
        "q_a_layernorm": norm(c.q_lora_rank),
        "q_b_proj": mat(c.q_lora_rank, h * c.qk_head_dim),
        "kv_a_proj_with_mqa": mat(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim),
        "kv_a_layernorm": norm(c.kv_lora_rank),
        "kv_b_proj": mat(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim)),
        "o_proj": mat(h * c.v_head_dim, c.hidden_size),
    }
    if with_indexer:
        w.update({
            "indexer.wq_b": mat(c.q_lora_rank, c.index_n_heads * c.index_head_dim),
            "indexer.wk": mat(c.hidden_size, c.index_head_dim),
            "indexer.k_norm.weight": norm(c.index_head_dim),
            "indexer.k_norm.bias": (0.1 * rng.standard_normal(c.index_head_dim)).astype(
                numpy.float32),
            "indexer.weights_proj": mat(c.hidden_size, c.index_n_heads),
        })
    return w


# ---- small array helpers (backend-generic) ----------------------------------

def _matmul(xp, a, b):
    """``a @ b`` of the layer's projections (float32; the one place they multiply, so
    that tests can make them exact: tests/test_parallel.py substitutes float64
    accumulation to check that context-parallel ranks, each projecting only its own
    tokens, reproduce one rank's top-k rows bit for bit. With float32 BLAS a token's
    result depends in its last bits on how many tokens share the call: OpenBLAS picks
    its kernels by shape)."""
    return xp.matmul(a, b)


def _rms_norm(xp, x, weight, eps):
    var = (x * x).mean(axis=-1, keepdims=True)
    return (x / xp.sqrt(var + eps) * weight).astype(xp.float32)


def _layer_norm(xp, x, weight, bias, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return ((x - mean) / xp.sqrt(var + eps) * weight + bias).astype(xp.float32)


_INV_FREQ: dict[Any, Any] = {}


def _rope_inv_freq(xp, d, theta):
    """``theta ** (-2i / d)``, made once per (backend, device, d, theta): the layer's hot
    path uploads nothing."""
    dev = xp.cuda.runtime.getDevice() if xp is not numpy else None
    key = (xp.__name__, dev, d, theta)
    inv = _INV_FREQ.get(key)
    if inv is None:
        inv = _INV_FREQ[key] = xp.asarray(
            1.0 / theta ** (numpy.arange(0, d, 2, dtype=numpy.float64) / d))
    return inv


def _rope(xp, x, positions, theta, interleaved):
    """Rotate the last axis of x [T, ..., d] by position (d even).

    ``interleaved``: pairs (0, 1), (2, 3), ... (the MLA's layout);
    otherwise halves (i, i + d/2) (NeoX, the indexer's layout).
    """
    d = x.shape[-1]
    ang = positions.astype(xp.float64)[:, None] * _rope_inv_freq(xp, d, theta)[None, :]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (d // 2,)
    cos, sin = xp.cos(ang).reshape(shape), xp.sin(ang).reshape(shape)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = xp.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
    else:
        a, b = x[..., :d // 2], x[..., d // 2:]
        out = xp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.astype(xp.float32)


class AttentionStats:
    """How a layer routed its tokens (for tests, demos and benchmarks)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.forwards = 0
        self.dense_tokens = 0        # tokens attended by dense causal MHA
        self.sparse_tokens = 0       # tokens attended by sparse MLA
        self.buffer_rows_read = 0    # rows of the top-k buffer read
        self.indexer_keys_inserted = 0   # indexer keys the key step wrote to its cache

    def __repr__(self):
        return ("AttentionStats(" + ", ".join(f"{k}={v}" for k, v in vars(self).items()) + ")")


class _Indexer:
    """The lightning indexer of one layer: projections, RoPE, rotation, FP8, scoring."""

    def __init__(self, config, weights, xp):
        self.config = config
        self.wq_b = xp.asarray(weights["indexer.wq_b"])
        self.wk = xp.asarray(weights["indexer.wk"])
        self.k_norm_w = xp.asarray(weights["indexer.k_norm.weight"])
        self.k_norm_b = xp.asarray(weights["indexer.k_norm.bias"])
        self.weights_proj = xp.asarray(weights["indexer.weights_proj"])
        self.stats = IndexerStats()

    def queries_keys(self, xp, x, q_c, positions):
        """(q codes [T, H, D], folded weights [T, H], keys [T, D] float32)."""
        c = self.config
        t, r = x.shape[0], c.qk_rope_head_dim
        q = _matmul(xp, q_c, self.wq_b).reshape(t, c.index_n_heads, c.index_head_dim)
        k = _layer_norm(xp, _matmul(xp, x, self.wk), self.k_norm_w, self.k_norm_b, 1e-6)
        # RoPE on the first qk_rope_head_dim dims, in the configured layout (NeoX
        # halves for DeepSeek-V3.2, interleaved pairs for GLM).
        inter = c.indexer_rope_interleave
        q = xp.concatenate([_rope(xp, q[..., :r], positions, c.rope_theta, inter),
                            q[..., r:]], axis=-1)
        k = xp.concatenate([_rope(xp, k[:, :r], positions, c.rope_theta, inter), k[:, r:]],
                           axis=-1)
        if c.index_hadamard:
            q, k = hadamard_rotate(q), hadamard_rotate(k)
        q = xp.ascontiguousarray(q, dtype=xp.float32)
        q_codes, q_scales = quantize_fp8(q, block_size=c.index_head_dim,
                                         scale_fmt=c.index_scale_fmt, eps=INDEX_Q_EPS)
        w = fold_weights(xp.ascontiguousarray(_matmul(xp, x, self.weights_proj), dtype=xp.float32),
                         q_scales[..., 0], c.index_head_dim)
        return q_codes, w, xp.ascontiguousarray(k, dtype=xp.float32)


class DeepseekV32MLA:
    """One DeepSeek-V3.2 attention layer with its indexer, on NumPy or CuPy.

    Parameters
    ----------
    config : MLAConfig
    layer_name : str
        The key of this layer's MLA metadata in the forward context.
    is_mtp_layer : bool
        An MTP draft layer: its top-k rows are reused by later draft steps, so
        it never enables the short-prefill skip.
    skip_topk : bool
        Index sharing: the layer owns no indexer and reads the rows an earlier
        layer of the same forward pass wrote. (The runtime flag
        :attr:`skip_topk` still starts False.)
    use_pcp : bool
        Prefill context parallelism (disables the skip).
    pcp_group : process group, optional
        With ``use_pcp``: the ranks a prompt is split across (a
        :class:`cpsparse.parallel.NcclGroup` or ``ThreadGroup``). Each rank then
        calls :meth:`forward` with the same (prefill-only) batch, its share of the
        tokens (``pcp_tokens``) and their hidden states; the latents and indexer keys
        are gathered so every rank's caches hold the whole prompt, each rank scores and
        attends its own tokens only, and its rows and outputs are one GPU's.
    dcp_group : process group, optional
        Decode context parallelism: this rank's caches hold its shard of every request
        (token ``t`` on rank ``(t // dcp_interleave) % world``). Each rank calls
        :meth:`forward` on decode steps with the same hidden states and its
        :func:`cpsparse.parallel.dcp_decode_view` (``dcp_view``); the layer inserts the
        tokens it holds, scores its shard, merges the exact global top-k from every
        rank's candidates (:func:`cpsparse.parallel.dcp_topk_per_row`: the top-k
        buffer holds global positions, as on one GPU), attends the selected keys it
        holds and merges the partial outputs by lse: every rank's rows and output are
        one GPU's. Not with PCP or on an MTP layer.
    dcp_interleave : int
        vLLM's ``cp_kv_cache_interleave_size`` (the views must agree).
    platform : object with ``is_cuda()``, optional
        Default: detected (CUDA when CuPy sees a device).
    weights : dict, optional
        Layer weights as from :func:`init_weights` (NumPy or CuPy arrays).
    seed : int
        Seed of the random weights when ``weights`` is None.
    xp : module
        ``numpy`` or ``cupy``: the backend of the weights, caches and inputs.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.mla import DeepseekV32MLA, MLAConfig
    >>> from cpsparse.metadata import ForwardContext, build_batch, set_forward_context
    >>> from cpsparse.platform import StaticPlatform
    >>> cfg = MLAConfig.small()
    >>> layer = DeepseekV32MLA(cfg, "layers.0", platform=StaticPlatform(cuda=True))
    >>> layer._dense_mha_metadata_layer_name
    'layers.0'
    >>> layer.allocate_kv_cache(num_blocks=8, max_num_tokens=64)
    >>> meta = build_batch([40], [0], np.arange(8, dtype=np.int32)[None],
    ...                    block_size=cfg.block_size, index_topk=cfg.index_topk)
    >>> x = np.random.default_rng(0).standard_normal((40, cfg.hidden_size)).astype(np.float32)
    >>> with set_forward_context(ForwardContext.for_layers(meta, ["layers.0"])):
    ...     y = layer.forward(x)
    >>> y.shape, layer.indexer.stats.skipped       # 40 <= topk 64: scoring skipped
    ((40, 256), 1)
    """

    def __init__(self, config, layer_name, *, is_mtp_layer=False, skip_topk=False,
                 use_pcp=False, pcp_group=None, dcp_group=None, dcp_interleave=1,
                 platform=None, weights=None, seed=0, xp=numpy):
        if not isinstance(config, MLAConfig):
            raise TypeError(f"Invalid config: expected MLAConfig, got {type(config).__qualname__}")
        if pcp_group is not None and not use_pcp:
            raise ValueError("Invalid pcp_group: a process group needs use_pcp=True")
        if pcp_group is not None and is_mtp_layer:
            raise ValueError("Invalid pcp_group: MTP layers reuse their top-k rows across "
                             "draft steps, which prefill context parallelism does not keep")
        if dcp_group is not None:
            check_group(dcp_group)
            if use_pcp or is_mtp_layer:
                raise ValueError("Invalid dcp_group: decode context parallelism is not "
                                 "supported with use_pcp or on an MTP layer")
        self.pcp_group = pcp_group
        self.dcp_group = dcp_group
        self.dcp_interleave = V.check_positive_int("dcp_interleave", dcp_interleave)
        self.config = config
        self.layer_name = str(layer_name)
        self.is_mtp_layer = bool(is_mtp_layer)
        self.shares_topk = bool(skip_topk)
        self.use_pcp = bool(use_pcp)
        self.platform = current_platform() if platform is None else platform
        self.xp = xp
        # The gate: decided here, once. The indexer only ever sees the name.
        self.enable_short_prefill_scoring_skip = (
            not self.is_mtp_layer and not self.shares_topk and not self.use_pcp
            and bool(self.platform.is_cuda()))
        self._dense_mha_metadata_layer_name = (
            self.layer_name if self.enable_short_prefill_scoring_skip else "")
        # The runtime flag (MTP reuse) starts False whatever the argument was.
        self._skip_topk = False
        # Rows [0, n) of the buffer this layer's indexer wrote in its last call (None:
        # no call yet, or the last call skipped scoring or raised), and the rows declared
        # reusable since (never more than were written).
        self._rows_written = None
        self._reusable_topk_rows: Any = None

        if weights is None:
            weights = init_weights(config, seed, with_indexer=not self.shares_topk)
        c = config
        self.q_a_proj = xp.asarray(weights["q_a_proj"])
        self.q_a_layernorm = xp.asarray(weights["q_a_layernorm"])
        self.q_b_proj = xp.asarray(weights["q_b_proj"])
        self.kv_a_proj = xp.asarray(weights["kv_a_proj_with_mqa"])
        self.kv_a_layernorm = xp.asarray(weights["kv_a_layernorm"])
        kv_b = xp.asarray(weights["kv_b_proj"]).reshape(
            c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        # Weight absorption: W_UK folds into the query, W_UV into the output.
        self.w_uk = xp.ascontiguousarray(kv_b[:, :, :c.qk_nope_head_dim].transpose(1, 2, 0))
        self.w_uv = xp.ascontiguousarray(kv_b[:, :, c.qk_nope_head_dim:].transpose(1, 0, 2))
        self.o_proj = xp.asarray(weights["o_proj"])
        # (None where the top-k is shared; callers know which layer they hold)
        self.indexer: Any = None if self.shares_topk else _Indexer(c, weights, xp)
        self.attention_stats = AttentionStats()
        # Set by allocate_kv_cache (None until then; forward checks it first).
        self.mla_cache: Any = None
        self.indexer_cache: Any = None
        self.topk_indices_buffer: Any = None

    def __repr__(self):
        return (f"DeepseekV32MLA({self.layer_name!r}, is_mtp_layer={self.is_mtp_layer}, "
                f"shares_topk={self.shares_topk}, use_pcp={self.use_pcp}, "
                f"skip={'on' if self._dense_mha_metadata_layer_name else 'off'})")

    # ---- caches and the shared buffer ---------------------------------------

    def allocate_kv_cache(self, num_blocks, max_num_tokens=None, topk_indices_buffer=None):
        """Allocate this layer's paged caches and bind the shared top-k buffer.

        Pass the same ``topk_indices_buffer`` to every layer of a model
        (index sharing reads it); by default a private one of
        ``max_num_tokens`` rows is made.
        """
        c, xp = self.config, self.xp
        self.mla_cache = MLAKVCache(num_blocks, c.block_size, c.kv_lora_rank,
                                    c.qk_rope_head_dim, xp=xp)
        if self.indexer is not None:
            self.indexer_cache = IndexerKCache(num_blocks, c.block_size, c.index_head_dim,
                                               xp=xp, scale_fmt=c.index_scale_fmt,
                                               dtype=c.index_cache_dtype)
        if topk_indices_buffer is None:
            if max_num_tokens is None:
                raise ValueError("Invalid arguments: give max_num_tokens or a shared "
                                 "topk_indices_buffer")
            topk_indices_buffer = xp.full((max_num_tokens, c.index_topk), -1, dtype=xp.int32)
        if topk_indices_buffer.shape[1:] != (c.index_topk,):
            raise ValueError(f"Invalid shape of topk_indices_buffer: expected [max_num_tokens, "
                             f"{c.index_topk}], got {tuple(topk_indices_buffer.shape)}")
        self.topk_indices_buffer = topk_indices_buffer

    # ---- MTP reuse -----------------------------------------------------------

    @property
    def skip_topk(self):
        """The runtime top-k reuse flag (MTP draft steps 1+); set it with
        :meth:`set_skip_topk` (assigning goes through the same checks)."""
        return self._skip_topk

    @skip_topk.setter
    def skip_topk(self, skip):
        self.set_skip_topk(skip)

    def set_skip_topk(self, skip):
        """Switch the runtime top-k reuse (MTP draft steps 1+) on or off.

        Turning it on requires that this layer's indexer wrote the rows in its
        last call (step 0 scored: not an early return, not a failed call);
        reusing anything else is an error, not silent garbage. Turning it off
        always works and ends the reuse: a new reuse needs a new scoring call.
        """
        skip = bool(skip)
        if skip and self._reusable_topk_rows is None:
            raise RuntimeError(f"{self.layer_name}: set_skip_topk(True) before a step 0 "
                               "wrote top-k rows to reuse (this layer's last indexer call "
                               "did not score)")
        self._skip_topk = skip
        if not skip:
            self._reusable_topk_rows = None

    def begin_topk_reuse(self, batch):
        """Start reusing the top-k rows of step-0 ``batch`` (MTP draft steps 1+).

        Refuses unless this layer's last indexer call scored ``batch`` (all its
        rows were written); then compacts the buffer to one row per request,
        ``buf[:R] = buf[last token row of each request]``, and turns the runtime
        reuse on: until :meth:`end_topk_reuse`, forward() runs attention over rows
        [0, R) without the indexer. Returns R.
        """
        if (batch.query_lens < 1).any():
            r = int((batch.query_lens < 1).argmax())
            raise ValueError(f"Invalid step-0 batch: request {r} has no step-0 token, so it "
                             "has no top-k row to reuse")
        if self._rows_written is None or self._rows_written != batch.num_tokens:
            raise RuntimeError(f"{self.layer_name}: the last indexer call did not score this "
                               f"step-0 batch ({batch.num_tokens} tokens; rows written: "
                               f"{self._rows_written})")
        buf = self.topk_indices_buffer
        buf[:batch.num_reqs] = buf[self.xp.asarray(batch.last_token_rows)]   # a copy: safe
        self._rows_written = batch.num_reqs
        self.mark_reusable_topk_rows(batch.num_reqs)
        self.set_skip_topk(True)
        return batch.num_reqs

    def end_topk_reuse(self):
        """End the reuse (always allowed): the next forward scores again."""
        self.set_skip_topk(False)

    def mark_reusable_topk_rows(self, num_rows):
        """Declare buffer rows [0, num_rows) valid for reuse (after compaction).

        Only rows this layer's indexer wrote in its last call can be declared:
        ``0 < num_rows <=`` the rows it wrote, else RuntimeError.
        """
        if isinstance(num_rows, bool) or not isinstance(num_rows, (int, numpy.integer)):
            raise TypeError(f"Invalid num_rows: expected an int, got {num_rows!r}")
        if self._rows_written is None:
            raise RuntimeError(f"{self.layer_name}: no top-k rows to reuse: this layer's "
                               "last indexer call did not score (early return, failure, or "
                               "no call yet)")
        if not 0 < num_rows <= self._rows_written:
            raise RuntimeError(f"{self.layer_name}: cannot reuse {num_rows} rows, the last "
                               f"indexer call wrote {self._rows_written}")
        self._reusable_topk_rows = int(num_rows)

    # ---- forward -------------------------------------------------------------

    def _check_forward(self, hidden_states, ctx, rows=None):
        """Everything forward() needs, before it writes a cache page or a buffer row
        (``rows``: the hidden-state rows expected, default the batch's tokens)."""
        c = self.config
        if self.mla_cache is None:
            raise RuntimeError(f"{self.layer_name}: call allocate_kv_cache() before forward()")
        if not isinstance(ctx, ForwardContext):
            raise TypeError(f"Invalid forward_context: expected ForwardContext, got "
                            f"{type(ctx).__qualname__}")
        batch = ctx.batch
        _backend.get_array_module(hidden_states=hidden_states, cache=self.mla_cache.data)
        for cache in (self.mla_cache, self.indexer_cache):
            if cache is not None:
                check_batch(batch, block_size=c.block_size, index_topk=c.index_topk,
                            num_blocks=cache.num_blocks, xp=self.xp,
                            owner=f"the caches of layer {self.layer_name!r}")
        tokens = batch.num_tokens
        self._check_rows(hidden_states, tokens if rows is None else rows, tokens)
        name = self._dense_mha_metadata_layer_name
        if name and name not in ctx.attn_metadata:
            raise ValueError(f"Invalid forward_context: it has no MLA metadata for layer "
                             f"{name!r} (its layers: {sorted(ctx.attn_metadata)})")
        if self._skip_topk and tokens > self._reusable_topk_rows:
            raise RuntimeError(f"{self.layer_name}: reusing top-k rows for {tokens} tokens, "
                               f"but only {self._reusable_topk_rows} rows were kept")

    def forward(self, hidden_states, *, forward_context=None, pcp_tokens=None,
                dcp_view=None):
        """Attention output [T, hidden] for the batch of the forward context.

        Every argument is checked first (the batch against this layer's caches:
        block_size, index_topk, page ids in range): a call that raises has
        written no cache page and no buffer row.

        With a ``pcp_group`` (prefill context parallelism), ``pcp_tokens`` are the
        batch tokens of this rank (sorted; the ranks' shares cover the batch once),
        ``hidden_states`` their rows, and the result their rows of the output.

        With a ``dcp_group`` (decode context parallelism), ``dcp_view`` is this rank's
        :class:`cpsparse.parallel.DcpDecodeView` of the decode step (no forward
        context is read); the result is every token's output, on every rank.
        """
        if self.dcp_group is not None:
            return self._forward_dcp(hidden_states, dcp_view)
        if dcp_view is not None:
            raise ValueError("Invalid dcp_view: this layer has no dcp_group")
        ctx = get_forward_context() if forward_context is None else forward_context
        if self.pcp_group is not None:
            return self._forward_pcp(hidden_states, ctx, pcp_tokens)
        if pcp_tokens is not None:
            raise ValueError("Invalid pcp_tokens: this layer has no pcp_group")
        self._check_forward(hidden_states, ctx)
        batch = ctx.batch
        xp = self.xp
        tokens = batch.num_tokens
        x = xp.asarray(hidden_states[:tokens], dtype=xp.float32)
        q_c, q_full, kv_c, k_pe = self._project(x, batch.positions)
        self.mla_cache.insert_core(kv_c, k_pe, batch.slot_mapping)
        latent = self._fused_attention(x, q_c, q_full, batch, ctx)
        return self._output(latent)

    def _project(self, x, positions):
        """(q_c, absorbed queries [T, H, L + R], kv_c, k_pe) of the tokens ``x``."""
        xp, c = self.xp, self.config
        tokens = x.shape[0]
        h, lora = c.num_heads, c.kv_lora_rank
        q_c = _rms_norm(xp, _matmul(xp, x, self.q_a_proj), self.q_a_layernorm, c.rms_norm_eps)
        q = _matmul(xp, q_c, self.q_b_proj).reshape(tokens, h, c.qk_head_dim)
        kv = _matmul(xp, x, self.kv_a_proj)
        kv_c = _rms_norm(xp, kv[:, :lora], self.kv_a_layernorm, c.rms_norm_eps)
        k_pe = _rope(xp, kv[:, lora:], positions, c.rope_theta, True)
        q_pe = _rope(xp, q[..., c.qk_nope_head_dim:], positions, c.rope_theta, True)
        # [T, H, nope] x [H, nope, L] -> [T, H, L]
        q_abs = _matmul(xp, q[..., :c.qk_nope_head_dim].transpose(1, 0, 2), self.w_uk)
        q_full = xp.ascontiguousarray(
            xp.concatenate([q_abs.transpose(1, 0, 2), q_pe], axis=-1), dtype=xp.float32)
        return q_c, q_full, xp.ascontiguousarray(kv_c), xp.ascontiguousarray(k_pe)

    def _output(self, latent):
        xp, c = self.xp, self.config
        out = _matmul(xp, latent.transpose(1, 0, 2), self.w_uv).transpose(1, 0, 2)
        return _matmul(xp, out.reshape(latent.shape[0], c.num_heads * c.v_head_dim),
                       self.o_proj).astype(xp.float32)

    def _check_pcp_tokens(self, hidden_states, ctx, pcp_tokens):
        if pcp_tokens is None:
            raise ValueError("Invalid pcp_tokens: a layer with a pcp_group needs this "
                             "rank's batch tokens")
        own = pcp_tokens.get() if _backend.is_cupy_array(pcp_tokens) \
            else numpy.asarray(pcp_tokens)
        tokens = ctx.batch.num_tokens
        if own.ndim != 1 or own.dtype.kind not in "iu":
            raise ValueError(f"Invalid pcp_tokens: expected a 1-D integer array, got "
                             f"{own.dtype}{list(own.shape)}")
        own = own.astype(numpy.int64)
        if own.size and (own[0] < 0 or own[-1] >= tokens or (numpy.diff(own) <= 0).any()):
            raise ValueError(f"Invalid pcp_tokens: expected increasing token indices in "
                             f"[0, {tokens}), got {own.tolist()[:8]}...")
        if ctx.batch.num_decode_tokens:
            raise ValueError(f"Invalid batch: prefill context parallelism takes prefill-only "
                             f"batches, got {ctx.batch.num_decode_tokens} decode tokens")
        if self._skip_topk:
            raise RuntimeError(f"{self.layer_name}: top-k reuse under prefill context "
                               f"parallelism is not supported")
        return own

    def _forward_pcp(self, hidden_states, ctx, pcp_tokens):
        """forward() of one rank under prefill context parallelism."""
        if not isinstance(ctx, ForwardContext):
            raise TypeError(f"Invalid forward_context: expected ForwardContext, got "
                            f"{type(ctx).__qualname__}")
        own = self._check_pcp_tokens(hidden_states, ctx, pcp_tokens)
        batch = ctx.batch
        xp, c, group = self.xp, self.config, self.pcp_group
        tokens = batch.num_tokens
        # The batch is checked as one GPU would (caches, buffer); the rows are ours.
        self._check_forward(hidden_states, ctx, rows=own.size)
        own_d = xp.asarray(own)
        x = xp.asarray(hidden_states[:own.size], dtype=xp.float32)
        q_c, q_full, kv_c, k_pe = self._project(x, batch.positions[own_d])
        # Gathered before any write: a bad cover raises on every rank, nothing written.
        kv_c_all = pcp_all_gather(group, kv_c, own_d, tokens)
        k_pe_all = pcp_all_gather(group, k_pe, own_d, tokens)
        self.mla_cache.insert_core(kv_c_all, k_pe_all, batch.slot_mapping)
        if self.indexer is not None:
            self._score(x, q_c, batch.positions[own_d], batch, ctx, query_rows=own)
        mla = ctx.attn_metadata.get(self.layer_name, batch.mla)
        self.attention_stats.forwards += 1
        if mla.dense_prefill:
            # Causal attention over all of each token's request keys (<= index_topk of
            # them on this route), as a sparse call over the causal positions: the same
            # keys and softmax as the dense route, for this rank's tokens only.
            pos = batch.positions[own_d].astype(xp.int64)
            cols = xp.arange(c.index_topk, dtype=xp.int64)[None, :]
            causal = xp.where(cols <= pos[:, None], cols, -1).astype(xp.int32)
            self.attention_stats.dense_tokens += own.size
            latent = self._sparse(q_full, batch, own_d, rows=causal)
        else:
            latent = self._sparse(q_full, batch, own_d)
        return self._output(latent)

    def _check_dcp_view(self, hidden_states, view):
        """Everything the DCP forward needs, before it writes a cache page or a row."""
        c, group = self.config, self.dcp_group
        if self.mla_cache is None:
            raise RuntimeError(f"{self.layer_name}: call allocate_kv_cache() before forward()")
        if not isinstance(view, DcpDecodeView):
            raise TypeError(f"Invalid dcp_view: expected DcpDecodeView (from "
                            f"cpsparse.parallel.dcp_decode_view), got {type(view).__qualname__}")
        want = (group.rank, group.world, self.dcp_interleave, c.block_size)
        got = (view.rank, view.world, view.interleave, view.block_size)
        if got != want:
            raise ValueError(f"Invalid dcp_view: expected (rank, world, interleave, "
                             f"block_size) = {want} of this layer and its group, got {got}")
        _backend.get_array_module(hidden_states=hidden_states, cache=self.mla_cache.data,
                                  dcp_view=view.block_table)
        tokens = view.num_tokens
        for cache in (self.mla_cache, self.indexer_cache):
            if cache is not None:
                V.check_block_table(numpy, view.local_seq_lens, view.block_table_host,
                                    c.block_size, cache.num_blocks, name="dcp_view.block_table",
                                    what=f"the caches of layer {self.layer_name!r}")
        self._check_rows(hidden_states, tokens, tokens)
        if self._skip_topk:
            raise ValueError("Invalid top-k reuse: a DCP layer scores every decode step "
                             "(its buffer rows are global positions of one step)")

    def _check_rows(self, hidden_states, rows, tokens):
        """hidden_states [>= rows, hidden_size] of a float dtype; a top-k buffer of at
        least ``tokens`` rows."""
        c = self.config
        if hidden_states.ndim != 2 or hidden_states.shape[0] < rows or \
                hidden_states.shape[1] != c.hidden_size:
            raise ValueError(f"Invalid shape of hidden_states: expected [>= {rows}, "
                             f"{c.hidden_size}], got {tuple(hidden_states.shape)}")
        V.check_array("hidden_states", hidden_states, dtype=V.FLOAT_DTYPES, contiguous=False)
        if self.topk_indices_buffer.shape[0] < tokens:
            raise ValueError(f"Invalid batch: {tokens} tokens but the top-k buffer has "
                             f"{self.topk_indices_buffer.shape[0]} rows")

    def _forward_dcp(self, hidden_states, view):
        """A decode step under DCP (see the class docstring): checks, then the rank's
        inserts, its shard's scores, the global top-k, partial attention and merge."""
        self._check_dcp_view(hidden_states, view)
        xp, c = self.xp, self.config
        tokens = view.num_tokens
        x = xp.asarray(hidden_states[:tokens], dtype=xp.float32)
        q_c, q_full, kv_c, k_pe = self._project(x, view.positions)
        self.mla_cache.insert_core(kv_c, k_pe, view.slot_mapping)     # -1: another rank's
        if self.indexer is not None:                # (a runtime reuse was refused above)
            q_codes, w, k = self.indexer.queries_keys(xp, x, q_c, view.positions)
            self.indexer_cache.insert_core(xp, k, view.slot_mapping)
            self.attention_stats.indexer_keys_inserted += view.num_local_tokens
            self._rows_written = self._reusable_topk_rows = None
            # Each token scored as its own row (next_n 1) over the keys this rank holds.
            if view.max_local_len:
                logits = paged_mqa_logits_core(
                    xp, xp.ascontiguousarray(q_codes[:, None]), self.indexer_cache, w,
                    view.local_ends, view.token_table, view.max_local_len)
            else:
                logits = xp.zeros((tokens, 0), dtype=xp.float32)
            rows = dcp_topk_per_row_core(self.dcp_group, logits, view.local_ends, view.ends,
                                         c.index_topk, view.interleave)
            self.topk_indices_buffer[:tokens] = rows
            self.indexer.stats.calls += 1
            self.indexer.stats.scored_calls += 1
            self.indexer.stats.decode_rows += tokens
            self._rows_written = self._reusable_topk_rows = tokens
        self.attention_stats.forwards += 1
        self.attention_stats.sparse_tokens += tokens
        self.attention_stats.buffer_rows_read += tokens
        rows = self.topk_indices_buffer[:tokens]
        local = dcp_local_indices(rows, view.rank, view.world, interleave=view.interleave)
        slots = local_to_global_slots_core(xp, local, view.req_ids, view.block_table,
                                           c.block_size)
        out, lse = sparse_mla_attention_core(xp, q_full, self.mla_cache, slots, c.sm_scale,
                                             c.kv_lora_rank)
        out, _ = dcp_merge_attention(self.dcp_group, out, lse)
        return self._output(out)

    __call__ = forward

    def _fused_attention(self, x, q_c, q_full, batch, ctx):
        """Indexer (unless shared or reused), then the attention routes."""
        xp, c = self.xp, self.config
        tokens = batch.num_tokens
        if self.indexer is not None and not self._skip_topk:
            self._score(x, q_c, batch.positions, batch, ctx)
        mla = ctx.attn_metadata.get(self.layer_name, batch.mla)
        nd = mla.num_decode_tokens
        self.attention_stats.forwards += 1
        out = xp.zeros((tokens, c.num_heads, c.kv_lora_rank), dtype=xp.float32)
        if nd:
            out[:nd] = self._sparse(q_full[:nd], batch, slice(0, nd))
        if nd < tokens:
            if mla.dense_prefill:
                # Dense route: the top-k buffer is not read (it may be stale or -1).
                out[nd:] = self._dense(q_full[nd:], batch, mla.num_decodes)
            else:
                out[nd:] = self._sparse(q_full[nd:], batch, slice(nd, tokens))
        return out

    def _score(self, x, q_c, positions, batch, ctx, query_rows=None):
        """The indexer over the batch (forward() validated it: the core runs) with the
        queries and keys of the tokens ``x``. Under PCP (``query_rows``, host indices of
        this rank's tokens) the keys are gathered from every rank first and only this
        rank's rows are scored."""
        xp = self.xp
        q_codes, w, k = self.indexer.queries_keys(xp, x, q_c, positions)
        if query_rows is not None:
            k = pcp_all_gather(self.pcp_group, k, xp.asarray(query_rows), batch.num_tokens)
        # The key step writes the keys to the indexer cache (the seed's layer fuses
        # norm, RoPE, quantization and this insert into one kernel), so the indexer
        # call skips it (skip_k_cache_insert): when the short-prefill gate fires, the
        # call returns having done nothing, and the keys are cached either way.
        self.indexer_cache.insert_core(xp, xp.ascontiguousarray(k[:batch.num_tokens]),
                                       batch.slot_mapping)
        self.attention_stats.indexer_keys_inserted += batch.num_tokens
        skipped_before = self.indexer.stats.skipped
        # Until this call has written its rows, nothing in the buffer is reusable.
        self._rows_written = self._reusable_topk_rows = None
        sparse_attn_indexer_core(
            xp, q_codes, w, None, self.indexer_cache, batch, self.topk_indices_buffer,
            skip_k_cache_insert=True, use_pcp=self.use_pcp,
            dense_mha_metadata_layer_name=self._dense_mha_metadata_layer_name,
            skip_topk_buffer_clear=False, forward_context=ctx, stats=self.indexer.stats,
            query_rows=query_rows)
        # Rows are reusable only if this call wrote all of them (no early return, no PCP).
        if query_rows is None and self.indexer.stats.skipped == skipped_before:
            self._rows_written = self._reusable_topk_rows = batch.num_tokens

    def _sparse(self, q, batch, tokens, rows=None):
        """Sparse attention of the batch ``tokens`` (a slice or indices; their queries
        ``q``) over ``rows`` of request-local positions, by default their top-k rows."""
        xp, c = self.xp, self.config
        if rows is None:
            rows = self.topk_indices_buffer[tokens]
            self.attention_stats.buffer_rows_read += q.shape[0]
            self.attention_stats.sparse_tokens += q.shape[0]
        slots = local_to_global_slots_core(xp, rows, batch.req_ids[tokens],
                                           batch.block_table, c.block_size)
        out, _ = sparse_mla_attention_core(xp, q, self.mla_cache, slots, c.sm_scale,
                                           c.kv_lora_rank)
        return out

    def _dense(self, q, batch, first_request):
        """Causal MHA of the prefill requests over all their cached latents."""
        xp, c = self.xp, self.config
        dense = dense_metadata(batch, first_request)   # slots and offsets: built on the host
        kv = self.mla_cache.gather_core(dense.slots)
        self.attention_stats.dense_tokens += q.shape[0]
        out, _ = dense_mla_attention_core(xp, q, kv, c.sm_scale, c.kv_lora_rank,
                                          dense.cu_seqlens_q, dense.cu_seqlens_k,
                                          (dense.key_start, dense.key_count))
        return out


class DeepseekV32AttentionStack:
    """A stack of attention layers sharing one top-k buffer (what a model holds).

    Each layer is applied with a residual connection, ``x = x + layer(x)``.
    The config's index-sharing schedule (:meth:`MLAConfig.layer_scores`) decides
    which layers own an indexer; the others are index-sharing layers
    (``skip_topk=True``: they read the rows of the last layer that scored).

    Parameters
    ----------
    config : MLAConfig
        Shapes of every layer, and the schedule (``index_topk_freq``,
        ``index_skip_topk_offset`` or ``index_topk_pattern``).
    num_layers : int
        Layers in the stack, named ``f"{prefix}.{i}.attn"``.
    num_blocks : int
        Pages of each layer's caches.
    max_num_tokens : int
        Rows of the shared top-k buffer (the most tokens of one batch).
    platform : object with ``is_cuda()``, optional
        Passed to every layer (the construction-time gate).
    seed : int
        Layer i's random weights use ``seed + i``.
    xp : module
        ``numpy`` or ``cupy``.
    prefix : str
        First part of the layer names.
    use_pcp : bool
        Passed to every layer (prefill context parallelism; :class:`DeepseekV32MLA`).
    pcp_group : process group, optional
        Passed to every layer with ``use_pcp``.
    dcp_group : process group, optional
        Passed to every layer (decode context parallelism; :class:`DeepseekV32MLA`).
    dcp_interleave : int
        Passed to every layer with ``dcp_group``.

    Examples
    --------
    >>> from cpsparse.mla import DeepseekV32AttentionStack, MLAConfig
    >>> stack = DeepseekV32AttentionStack(MLAConfig.small(index_topk_freq=2), num_layers=3,
    ...                                   num_blocks=4, max_num_tokens=32)
    >>> [layer.indexer is None for layer in stack.layers]
    [False, True, False]
    """

    def __init__(self, config, num_layers, *, num_blocks, max_num_tokens, platform=None,
                 seed=0, xp=numpy, prefix="layers", use_pcp=False, pcp_group=None,
                 dcp_group=None, dcp_interleave=1):
        if not isinstance(config, MLAConfig):
            raise TypeError(f"Invalid config: expected MLAConfig, got {type(config).__qualname__}")
        num_layers = V.check_positive_int("num_layers", num_layers)
        pattern = config.index_topk_pattern
        if pattern is not None and len(pattern) < num_layers:
            raise ValueError(f"Invalid num_layers: index_topk_pattern {pattern!r} covers "
                             f"{len(pattern)} layers, got {num_layers}")
        self.config = config
        self.xp = xp
        self.topk_indices_buffer = xp.full((max_num_tokens, config.index_topk), -1,
                                           dtype=xp.int32)
        self.layers = []
        for i in range(num_layers):
            layer = DeepseekV32MLA(config, f"{prefix}.{i}.attn",
                                   skip_topk=not config.layer_scores(i), platform=platform,
                                   seed=seed + i, xp=xp, use_pcp=use_pcp, pcp_group=pcp_group,
                                   dcp_group=dcp_group, dcp_interleave=dcp_interleave)
            layer.allocate_kv_cache(num_blocks, topk_indices_buffer=self.topk_indices_buffer)
            self.layers.append(layer)

    @property
    def layer_names(self):
        return [layer.layer_name for layer in self.layers]

    def forward(self, hidden_states, *, forward_context=None, pcp_tokens=None,
                dcp_view=None):
        """The stack's output rows: the batch's tokens, or with a ``pcp_group`` this
        rank's ``pcp_tokens``, or with a ``dcp_group`` the tokens of ``dcp_view`` (see
        :meth:`DeepseekV32MLA.forward`)."""
        if dcp_view is not None:
            rows, ctx = dcp_view.num_tokens, None
        else:
            ctx = get_forward_context() if forward_context is None else forward_context
            rows = ctx.batch.num_tokens if pcp_tokens is None else len(pcp_tokens)
        x = hidden_states[:rows]
        for layer in self.layers:
            x = x + layer.forward(x, forward_context=ctx, pcp_tokens=pcp_tokens,
                                  dcp_view=dcp_view)
        return x

    __call__ = forward
