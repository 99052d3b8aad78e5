"""``python -m cpsparse.bench``: the seed scenarios and the decode step, end to end.

Scenarios (each prints a progress line per case, then a table; all results go
to one JSON file in the ``--out`` folder, by default a new ``cpsparse-bench-*``
folder in the temp directory, printed first; PNG plots beside it with the
``plots`` extra (matplotlib), else a line says they were skipped). The JSON
records the host and the library versions. Every figure is
a median with its p10-p90 beside it (:mod:`cpsparse.timing`: warm-up, fresh
rotating inputs, CUDA events on CuPy, ``perf_counter`` on NumPy).

* ``short_prefill``: one request of L tokens through a real
  :class:`cpsparse.mla.DeepseekV32MLA` layer forward, built twice from the same
  weights: gate enabled by construction (``StaticPlatform(cuda=True)``, not
  MTP, not index-sharing, no PCP) and disabled (``StaticPlatform(cuda=False)``):
  the layer decides, the indexer only obeys. Timed: the indexer call inside the
  forward (``sparse_attn_indexer``, a :class:`cpsparse.timing.Probe`; the layer's
  key step has cached the keys before it, as the seed's fused norm / RoPE / insert
  kernel does, and passes ``skip_k_cache_insert=True``) and the whole forward. The
  reduction is reported where the gate fires (L <= index_topk); the rows past
  ``index_topk`` say the gate cannot fire.
* ``mtp``: a real :class:`cpsparse.mtp.MTPDrafter` round of 3 steps (step 0
  scores, steps 1+ reuse its top-k) against a round where every step scores
  again (a ``num_steps=1`` drafter called per step); the time of steps 1+, twice:
  their indexer steps and attention calls (probed inside the forwards: what the
  reuse removes and what it keeps, the seed's "kernel time on draft steps 1+") and
  their whole layer forwards.
* ``decode_step``: one decode step of a layer, split into projections /
  indexer scoring / top-k / slots / sparse attention (public ops), the eager
  step, and the scoring + top-k + slots + attention chain captured as a CUDA
  graph and replayed, against the sum of their rooflines.

On CuPy (a GPU) the sizes are DeepSeek-V3.2's (``MLAConfig()``); on NumPy the
same scenarios run at ``MLAConfig.small()`` sizes so the command works on any
machine.
"""

import argparse
import datetime
import importlib
import json
import os
import pathlib
import platform as _host
import sys
import tempfile

import numpy

import cpsparse
from cpsparse import _cli
from cpsparse import mla as _mla
from cpsparse import timing
from cpsparse.attention import local_to_global_slots, sparse_mla_attention
from cpsparse.cache import IndexerKCache, MLAKVCache
from cpsparse.demo import pick_backend
from cpsparse.indexer import paged_mqa_logits, topk_per_row_decode
from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.mla import DeepseekV32MLA, MLAConfig, init_weights
from cpsparse.mtp import MTPDrafter
from cpsparse.platform import StaticPlatform
from cpsparse.reference import cache as cache_ref

SCENARIOS = ("short_prefill", "mtp", "decode_step")

METHOD = ("cpsparse.timing: warm-up, then every call timed alone over rotating input sets "
          "(CUDA events on CuPy, perf_counter on NumPy); median with p10/p90 "
          "(*_p10_p90_ms = [p10, p90]); graph replay = calls captured once in a CUDA "
          "graph, per call; *_gpu_*: the same probed intervals' GPU time alone, as the "
          "seeds measure (CuPy: each interval behind a stream hold, so that its two "
          "events bound its kernels and the GPU's gaps between them, no host time, less "
          "gpu_floor_ms, what an empty held interval reads; gpu_unheld: timed intervals "
          "the host took over half the hold to enqueue, whose figure may hold host time; "
          "None on NumPy)")

WHAT = {
    "short_prefill": "indexer call (sparse_attn_indexer, skip_k_cache_insert=True: the "
                     "layer's key step caches the keys, outside the call, inside forward_*) "
                     "inside a real DeepseekV32MLA forward, gate on "
                     "(StaticPlatform(cuda=True)) vs off "
                     "(StaticPlatform(cuda=False)); forward_*: the whole layer forward; "
                     "reduction_pct only where the gate fires (None where L > index_topk: "
                     "it cannot); *_gpu_*: the indexer call's GPU time alone (as the seed "
                     "measures its kernel-level latency), gpu_reduction_pct from those",
    "mtp": "steps 1+ of a real MTPDrafter round (reuse: step 0's top-k) vs the same steps "
           "scoring again (MTPDrafter(num_steps=1) per step); path_*: their indexer steps "
           "(the layer's _score: the indexer's queries and keys, its cache insert, "
           "scoring and top-k: all that the reuse skips) and attention calls (_sparse: "
           "slots + sparse_mla_attention), probed inside the forwards and summed per "
           "round; path_gpu_*: the same intervals' GPU time alone, the seed's measure "
           "(kernel time on draft steps 1+); forward_*: their whole layer forwards; "
           "*_effect_clear: both "
           "p10-p90 spreads narrower than the gap between the medians; round_*: the whole "
           "round; *_indexer_calls: indexer calls per round",
    "decode_step": "public ops of one decode step; attention_ms: sparse_mla_attention "
                   "alone (slots_ms: local_to_global_slots); sparse_path_ms: sum of the "
                   "four op medians; eager_step_ms: the four chained, eager; "
                   "graph_replay_ms: that chain in a CUDA graph, per step",
}


# ---- sizes -------------------------------------------------------------------

def sizes(xp, quick=False):
    """Workload sizes: DeepSeek-V3.2 on the GPU, ``MLAConfig.small()`` on the CPU.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.bench import sizes
    >>> s = sizes(np)
    >>> s["config"], s["topk"], s["topk"] in s["short_lens"], s["topk"] + 1 in s["short_lens"]
    ('small', 64, True, True)
    """
    if xp is numpy:
        s = dict(config="small", short_lens=[16, 32, 64, 65, 128], mtp_batches=[1, 4],
                 mtp_contexts=[256, 512], mtp_steps=3, decode_batches=[1, 4],
                 decode_contexts=[256, 1024], iters=21, warmup=2, sets=2)
    else:
        s = dict(config="v32", short_lens=[256, 1024, 2048, 2049, 4096],
                 mtp_batches=[1, 8, 64], mtp_contexts=[4096, 32768], mtp_steps=3,
                 decode_batches=[1, 8, 32, 64, 128], decode_contexts=[4096, 32768, 131072],
                 iters=20, warmup=3, sets=3)
        if quick:
            s.update(mtp_batches=[8, 64], decode_batches=[64], decode_contexts=[32768],
                     iters=10)
    c = layer_config(s)
    s.update(topk=c.index_topk, index_heads=c.index_n_heads, head_dim=c.index_head_dim,
             mla_heads=c.num_heads, block=c.block_size, kv_lora_rank=c.kv_lora_rank,
             rope_dim=c.qk_rope_head_dim)
    return s


def layer_config(s):
    """The :class:`MLAConfig` of the sizes ``s`` (``small`` or ``v32``)."""
    return MLAConfig.small() if s["config"] == "small" else MLAConfig()


# ---- inputs ------------------------------------------------------------------

def _rng_array(xp, rng, shape, dtype=numpy.float32, scale=1.0):
    return xp.asarray((rng.standard_normal(shape) * scale).astype(dtype))


def _indexer_inputs(xp, rng, tokens, heads, dim):
    q = _rng_array(xp, rng, (tokens, heads, dim))
    q8, qs = cpsparse.quantize_fp8(q, block_size=dim, eps=1e-10)
    w = cpsparse.fold_weights(_rng_array(xp, rng, (tokens, heads)), qs[..., 0], dim)
    return q8, w, _rng_array(xp, rng, (tokens, dim))


def _fill_mla_cache(xp, rng, cache, num_tokens):
    """Fill the first num_tokens slots with valid records (a random pool, tiled)."""
    pool = min(num_tokens, 4096)
    kv_c = rng.standard_normal((pool, cache.kv_lora_rank)).astype(numpy.float32)
    k_pe = rng.standard_normal((pool, cache.rope_dim)).astype(numpy.float32)
    records = xp.asarray(cache_ref.mla_encode(kv_c, k_pe))
    flat = cache.records()
    reps = -(-num_tokens // pool)
    flat[:num_tokens] = xp.tile(records, (reps, 1))[:num_tokens]


def _fill_indexer_cache(xp, rng, cache, num_tokens):
    pool = min(num_tokens, 4096)
    keys = xp.asarray(rng.standard_normal((pool, cache.head_dim)).astype(numpy.float32))
    reps = -(-num_tokens // pool)
    slots = xp.arange(num_tokens, dtype=xp.int32)
    for r in range(reps):
        chunk = slots[r * pool:(r + 1) * pool]
        cache.insert(keys[:chunk.size], chunk)


def _tables(xp, batch, context, block, extra=1):
    """Contiguous page tables: request b owns pages [b*n, (b+1)*n)."""
    n = -(-(context + extra) // block)
    return xp.asarray(numpy.arange(batch * n, dtype=numpy.int32).reshape(batch, n)), batch * n


class DecodeStep:
    """One decode step of a layer as its public ops, with rotating inputs.

    ``batch`` requests of ``context`` cached tokens, one new token each:
    indexer scoring (:func:`cpsparse.paged_mqa_logits`), top-k
    (:func:`cpsparse.topk_per_row_decode`), request-local positions to cache
    slots (:func:`cpsparse.local_to_global_slots`) and sparse MLA attention over
    the fp8_ds_mla cache (:func:`cpsparse.sparse_mla_attention`). ``sets``
    input sets (queries, weights, and each op's precomputed input) rotate:
    every op takes the set index ``j``; :meth:`step` chains them as a serving
    loop would, the slot mapping fused into the top-k (:meth:`topk_slots`:
    ``block_table=``), so a step is three calls.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.bench import DecodeStep, sizes
    >>> d = DecodeStep(np, np.random.default_rng(0), 2, 100, sizes(np), sets=2)
    >>> out, lse = d.step(1)
    >>> out.shape, d.inputs
    ((2, 4, 128), [(0,), (1,)])
    """

    def __init__(self, xp, rng, batch, context, s, sets=2):
        self.xp, self.batch, self.context, self.sets = xp, batch, context, sets
        self.block, self.k = s["block"], s["topk"]
        self.sm_scale = layer_config(s).sm_scale
        self.table, blocks = _tables(xp, batch, context, s["block"])
        self.icache = IndexerKCache(blocks, s["block"], s["head_dim"], xp=xp)
        self.mcache = MLAKVCache(blocks, s["block"], s["kv_lora_rank"], s["rope_dim"], xp=xp)
        _fill_indexer_cache(xp, rng, self.icache, blocks * s["block"])
        _fill_mla_cache(xp, rng, self.mcache, blocks * s["block"])
        self.lens = xp.full(batch, context, dtype=xp.int32)
        self.req_ids = xp.arange(batch, dtype=xp.int32)
        self.q8, self.w = [], []
        for _ in range(sets):
            q8, w, _ = _indexer_inputs(xp, rng, batch, s["index_heads"], s["head_dim"])
            self.q8.append(q8.reshape(batch, 1, s["index_heads"], s["head_dim"]))
            self.w.append(w)
        dim = s["kv_lora_rank"] + s["rope_dim"]
        self.q = [_rng_array(xp, rng, (batch, s["mla_heads"], dim), scale=0.1)
                  for _ in range(sets)]
        self.buf = xp.full((batch, self.k), -1, dtype=xp.int32)
        # each op's own input, per set, so that every op alone rotates too
        self.logits = [self.scoring(j) for j in range(sets)]
        self.rows = [topk_per_row_decode(lg, self.lens, 1, self.k) for lg in self.logits]
        self.slot_sets = [self.slots(j) for j in range(sets)]

    @property
    def inputs(self):
        """The argument tuples to rotate over: ``[(0,), (1,), ...]``."""
        return [(j,) for j in range(self.sets)]

    def scoring(self, j):
        # as the layer's indexer scores a decode step: its top-k reads only the windows
        return paged_mqa_logits(self.q8[j], self.icache, self.w[j], self.lens, self.table,
                                self.context, clean_logits=False)

    def topk(self, j):
        return topk_per_row_decode(self.logits[j], self.lens, 1, self.k, out=self.buf)

    def slots(self, j):
        return local_to_global_slots(self.rows[j], self.req_ids, self.table, self.block)

    def topk_slots(self, j):
        """Top-k straight to cache slots (the mapping fused into the top-k launch)."""
        return topk_per_row_decode(self.logits[j], self.lens, 1, self.k, out=self.buf,
                                   block_table=self.table, block_size=self.block)

    def attention(self, j):
        return sparse_mla_attention(self.q[j], self.mcache, self.slot_sets[j], self.sm_scale)

    def step(self, j):
        """Scoring + top-k to slots + attention of set ``j``: (out, lse)."""
        logits = self.scoring(j)
        slots = topk_per_row_decode(logits, self.lens, 1, self.k, out=self.buf,
                                    block_table=self.table, block_size=self.block)
        return sparse_mla_attention(self.q[j], self.mcache, slots, self.sm_scale)


def _median(t):
    return None if t is None else t["median_ms"]


def _spread(t):
    """[p10, p90] of a timing dict (ms); None for None (a figure not measured)."""
    return None if t is None else [t["p10_ms"], t["p90_ms"]]


def _gpu_time_pass(xp):
    """Whether the scenarios time their probed intervals' GPU time alone too (a held
    pass, :class:`cpsparse.timing.Probe` ``hold_ms``): on CuPy; NumPy has no GPU."""
    return xp is not numpy


def _held_figures(summaries):
    """``gpu_floor_ms``, ``gpu_hold_ms`` (the largest) and ``gpu_unheld`` (the sum) of
    held probe summaries (all None where nothing was held: NumPy)."""
    summaries = [t for t in summaries if t is not None]
    if not summaries:
        return dict(gpu_floor_ms=None, gpu_hold_ms=None, gpu_unheld=None)
    return dict(gpu_floor_ms=summaries[0]["floor_ms"],
                gpu_hold_ms=max(t["hold_ms"] for t in summaries),
                gpu_unheld=sum(t["unheld"] for t in summaries))


def _pm(t):
    return f"{t['median_ms']:.3f} ms (p10-p90 {t['p10_ms']:.3f}-{t['p90_ms']:.3f})"


# ---- scenario 1: short-prefill skip, decided by the layer --------------------------

def _indexer_entry():
    """The name under which :mod:`cpsparse.mla` calls the indexer orchestration.

    The probe wraps it for the timed forwards; its count check (one interval per
    forward) proves the layer really called it.
    """
    for name in ("sparse_attn_indexer_core", "sparse_attn_indexer"):
        if callable(getattr(_mla, name, None)):
            return name
    raise RuntimeError("cpsparse.mla calls no sparse_attn_indexer[_core]: update "
                       "cpsparse.bench._indexer_entry")


def bench_short_prefill(xp, s, rng, progress, weights):
    """Gate on vs off by construction of two real layers; one row per prefill length."""
    cfg = layer_config(s)
    name = "layers.0.attn"
    longest = max(s["short_lens"])
    blocks = -(-longest // cfg.block_size)
    table = xp.asarray(numpy.arange(blocks, dtype=numpy.int32)[None])
    layers = {True: DeepseekV32MLA(cfg, name, platform=StaticPlatform(cuda=True),
                                   weights=weights, xp=xp),
              False: DeepseekV32MLA(cfg, name, platform=StaticPlatform(cuda=False),
                                    weights=weights, xp=xp)}
    for enabled, layer in layers.items():
        if layer.enable_short_prefill_scoring_skip != enabled:
            raise AssertionError(f"construction gate of {layer!r}: expected "
                                 f"{'enabled' if enabled else 'disabled'}")
        layer.allocate_kv_cache(blocks, max_num_tokens=longest)
    it = dict(warmup=s["warmup"], iters=s["iters"])
    floor = timing.held_floor_ms(xp)        # an empty held interval (0.0 on NumPy)
    rows = []
    for length in s["short_lens"]:
        meta = build_batch([length], [0], table, block_size=cfg.block_size,
                           index_topk=cfg.index_topk)
        ctx = ForwardContext.for_layers(meta, [name])
        xs = [(_rng_array(xp, rng, (length, cfg.hidden_size)),) for _ in range(s["sets"])]
        t, hosts, g = {}, {}, {True: None, False: None}

        def time_indexer(layer, probe):
            """The layer's forwards timed, ``probe`` on the indexer call inside them."""
            with probe.patch(_mla, _indexer_entry()):
                return timing.time_op(
                    xp, lambda x: layer.forward(x, forward_context=ctx), xs, probe=probe,
                    **it)

        for enabled, layer in layers.items():
            layer.indexer.stats.reset()
            layer.attention_stats.reset()
            probe = timing.Probe(xp)
            t[enabled] = time_indexer(layer, probe)
            hosts[enabled] = probe.host_times_ms()
        # the counters of the timed pass (the held pass below runs the calls again)
        on_skipped = layers[True].indexer.stats.skipped
        off_skipped = layers[False].indexer.stats.skipped
        forwards = layers[True].attention_stats.forwards
        if _gpu_time_pass(xp):
            # The same calls' GPU time alone (the GPU's busy span: kernels and the gaps
            # between them on the GPU, no host time): each call behind a hold, in a pass
            # of its own (the holds sit inside the forwards it times).
            for enabled, layer in layers.items():
                held = timing.Probe(xp, hold_ms=timing.hold_for(hosts[enabled]))
                time_indexer(layer, held)
                g[enabled] = held.summary(expected=it["iters"], floor_ms=floor)
        can_fire = bool(meta.mla.prefill.use_dense_mha)
        fired = on_skipped > 0
        idx_on, idx_off = t[True]["inner"], t[False]["inner"]
        if fired:
            gate = "fires (L <= index_topk)"
        elif can_fire:
            gate = "did not fire"
        else:
            gate = "cannot fire (L > index_topk)"
        row = dict(tokens=length, topk=cfg.index_topk, use_dense_mha=can_fire,
                   skip_fired=fired, gate=gate,
                   gate_on_ms=idx_on["median_ms"], gate_on_p10_p90_ms=_spread(idx_on),
                   gate_off_ms=idx_off["median_ms"], gate_off_p10_p90_ms=_spread(idx_off),
                   reduction_pct=(100.0 * (1 - idx_on["median_ms"] / idx_off["median_ms"])
                                  if fired else None),
                   gate_on_gpu_ms=_median(g[True]), gate_on_gpu_p10_p90_ms=_spread(g[True]),
                   gate_off_gpu_ms=_median(g[False]),
                   gate_off_gpu_p10_p90_ms=_spread(g[False]),
                   gpu_reduction_pct=(100.0 * (1 - g[True]["median_ms"] / g[False]["median_ms"])
                                      if fired and g[False] and g[False]["median_ms"] > 0
                                      else None),
                   **_held_figures(g.values()),
                   forward_on_ms=t[True]["median_ms"], forward_on_p10_p90_ms=_spread(t[True]),
                   forward_off_ms=t[False]["median_ms"],
                   forward_off_p10_p90_ms=_spread(t[False]),
                   gate_on_skipped=on_skipped, gate_off_skipped=off_skipped,
                   forwards=forwards, iters=idx_on["iters"])
        rows.append(row)
        tail = (f"reduction {row['reduction_pct']:.1f}%" if fired
                else f"gate {gate}: not a reduction")
        if g[False]:
            tail += (f"; GPU time on {_pm(g[True])}, off {_pm(g[False])}"
                     + (f", reduction {row['gpu_reduction_pct']:.1f}%"
                        if row["gpu_reduction_pct"] is not None else "")
                     + (f" ({row['gpu_unheld']} intervals unheld)" if row["gpu_unheld"]
                        else ""))
        progress(f"short_prefill L={length}: indexer gate on {_pm(idx_on)}, off {_pm(idx_off)}; "
                 f"{tail}; forward on {_pm(t[True])}, off {_pm(t[False])}")
    return rows


# ---- scenario 2: MTP reuse through the real drafter ------------------------------

def _per_round(times, rounds, per_round, iters):
    """Summary of the last ``iters`` rounds' interval sums (``per_round`` intervals a
    round); RuntimeError unless ``rounds`` rounds recorded exactly that many each."""
    if len(times) != rounds * per_round:
        raise RuntimeError(f"probe recorded {len(times)} intervals in {rounds} rounds, "
                           f"expected {per_round} a round")
    sums = numpy.asarray(times, dtype=numpy.float64).reshape(rounds, per_round).sum(axis=1)
    return timing.summarize(sums[-iters:].tolist())


def _effect_clear(a, b):
    """True where both p10-p90 spreads are narrower than the gap between the medians."""
    gap = abs(b["median_ms"] - a["median_ms"])
    return bool(max(a["p90_ms"] - a["p10_ms"], b["p90_ms"] - b["p10_ms"]) < gap)


def bench_mtp(xp, s, rng, progress, weights):
    """Steps 1+ of an MTPDrafter round (reuse) vs the same steps scoring again.

    Two figures of the same rounds: ``path_*`` the indexer and attention work of
    steps 1+ (what the reuse removes and what it keeps: the layer's ``_score``, the
    indexer's queries, keys, cache insert, scoring and top-k, and its ``_sparse``,
    slots + sparse attention, each a probed interval, summed per round), the seed's
    measure (kernel time on draft steps 1+); ``forward_*`` the
    whole layer forwards of steps 1+ (projections, caches, the eager Python of the
    layer: the same in both, so the ratio is smaller)."""
    cfg = layer_config(s)
    steps = s["mtp_steps"]
    name = "mtp.0.attn"
    layer = DeepseekV32MLA(cfg, name, is_mtp_layer=True, platform=StaticPlatform(cuda=True),
                           weights=weights, xp=xp)
    drafter, single = MTPDrafter(layer, steps), MTPDrafter(layer, 1)
    it = dict(warmup=s["warmup"], iters=s["iters"])
    rounds = it["warmup"] + it["iters"]
    floor = timing.held_floor_ms(xp)        # an empty held interval (0.0 on NumPy)
    rows = []
    for batch in s["mtp_batches"]:
        for context in s["mtp_contexts"]:
            table, blocks = _tables(xp, batch, context, cfg.block_size, extra=steps)
            layer.allocate_kv_cache(blocks, max_num_tokens=batch)
            _fill_indexer_cache(xp, rng, layer.indexer_cache, blocks * cfg.block_size)
            _fill_mla_cache(xp, rng, layer.mla_cache, blocks * cfg.block_size)
            # step i: one token per request at position context + i
            ctxs = [ForwardContext.for_layers(
                build_batch([1] * batch, [context + i] * batch, table,
                            block_size=cfg.block_size, index_topk=cfg.index_topk), [name])
                for i in range(steps)]
            xs = [[_rng_array(xp, rng, (batch, cfg.hidden_size)) for _ in range(steps)]
                  for _ in range(s["sets"])]
            span = timing.Probe(xp)             # steps 1+, whole forwards
            path = timing.Probe(xp)             # their indexer steps and attention calls
            path.recording = False
            probes = {"path": path}             # the path probe of the pass being timed

            def steps_begin():
                span.start()
                probes["path"].recording = True

            def steps_end():
                probes["path"].recording = False
                span.stop()

            def reuse(j):
                def next_step(step, _previous):
                    if step == 1:
                        steps_begin()
                    return xs[j][step], ctxs[step]
                drafter.run_round(xs[j][0], ctxs[0], next_step)
                steps_end()

            def recompute(j):
                single.run_round(xs[j][0], ctxs[0], None)
                steps_begin()
                for step in range(1, steps):
                    single.run_round(xs[j][step], ctxs[step], None)
                steps_end()

            inputs = [(j,) for j in range(s["sets"])]
            t, p, calls = {}, {}, {}
            g: dict = {"reuse": None, "recompute": None}
            # reuse: one attention call a step; recompute: the indexer step's and attention's
            modes = (("reuse", reuse, 1), ("recompute", recompute, 2))
            for mode, fn, per_step in modes:
                layer.indexer.stats.reset()
                t[mode] = _time_path(xp, fn, inputs, it, span, path, per_step * (steps - 1))
                p[mode] = _per_round(path.times_ms(), rounds, per_step * (steps - 1),
                                     it["iters"])
                calls[mode] = layer.indexer.stats.calls / rounds
                if _gpu_time_pass(xp):
                    # the same intervals' GPU time alone, each behind a hold (a pass of
                    # its own: the holds sit inside the forwards it times)
                    timed = it["iters"] * per_step * (steps - 1)    # the timed rounds'
                    probes["path"] = held = timing.Probe(
                        xp, hold_ms=timing.hold_for(path.host_times_ms()[-timed:]))
                    held.recording = False
                    _time_path(xp, fn, inputs, it, span, held, per_step * (steps - 1))
                    g[mode] = dict(_per_round(held.times_ms(floor), rounds,
                                              per_step * (steps - 1), it["iters"]),
                                   hold_ms=held.hold_ms, floor_ms=floor,
                                   unheld=held.unheld(last=timed))
                    probes["path"] = path
            fr, fc = t["reuse"]["inner"], t["recompute"]["inner"]
            pr, pc = p["reuse"], p["recompute"]
            gr, gc = g["reuse"], g["recompute"]
            row = dict(batch=batch, context=context, steps=steps,
                       path_reuse_ms=pr["median_ms"], path_reuse_p10_p90_ms=_spread(pr),
                       path_recompute_ms=pc["median_ms"],
                       path_recompute_p10_p90_ms=_spread(pc),
                       path_speedup=pc["median_ms"] / pr["median_ms"],
                       path_effect_clear=_effect_clear(pr, pc),
                       path_gpu_reuse_ms=_median(gr), path_gpu_reuse_p10_p90_ms=_spread(gr),
                       path_gpu_recompute_ms=_median(gc),
                       path_gpu_recompute_p10_p90_ms=_spread(gc),
                       path_gpu_speedup=(gc["median_ms"] / gr["median_ms"]
                                         if gr and gr["median_ms"] > 0 else None),
                       path_gpu_effect_clear=_effect_clear(gr, gc) if gr else None,
                       **_held_figures([gr, gc]),
                       forward_reuse_ms=fr["median_ms"], forward_reuse_p10_p90_ms=_spread(fr),
                       forward_recompute_ms=fc["median_ms"],
                       forward_recompute_p10_p90_ms=_spread(fc),
                       forward_speedup=fc["median_ms"] / fr["median_ms"],
                       forward_effect_clear=_effect_clear(fr, fc),
                       round_reuse_ms=t["reuse"]["median_ms"],
                       round_recompute_ms=t["recompute"]["median_ms"],
                       reuse_indexer_calls=calls["reuse"],
                       recompute_indexer_calls=calls["recompute"], iters=pr["iters"])
            rows.append(row)
            gpu = (f"; their GPU time reuse {_pm(gr)}, recompute {_pm(gc)}, "
                   + (f"{row['path_gpu_speedup']:.2f}x" if row["path_gpu_speedup"] else "-")
                   + (f" ({row['gpu_unheld']} intervals unheld)" if row["gpu_unheld"]
                      else "") if gr else "")
            progress(f"mtp B={batch} ctx={context}: steps 1..{steps - 1} indexer + attention "
                     f"reuse {_pm(pr)}, recompute {_pm(pc)}, {row['path_speedup']:.2f}x{gpu}; "
                     f"whole forwards reuse {_pm(fr)}, recompute {_pm(fc)}, "
                     f"{row['forward_speedup']:.2f}x (indexer calls per round "
                     f"{calls['reuse']:g} vs {calls['recompute']:g})")
            layer.mla_cache = layer.indexer_cache = None
    return rows


def _time_path(xp, fn, inputs, it, span, path, per_round):
    """One timed pass of an MTP mode: ``span`` around steps 1+ (time_op's probe),
    ``path`` (``per_round`` intervals a round, recorded while the round's callbacks
    switch it on) around the layer's ``_score`` and ``_sparse`` calls in them."""
    path.reset()
    path.reserve(2 * (it["warmup"] + it["iters"]) * per_round)    # (not reset by time_op)
    with path.patch(DeepseekV32MLA, "_score"), path.patch(DeepseekV32MLA, "_sparse"):
        return timing.time_op(xp, fn, inputs, probe=span, **it)


# ---- scenario 3: decode step ----------------------------------------------------

def _projection_shapes(mla_heads):
    """(rows of x, in, out) of every matmul of a V3.2 decode step per token."""
    return [(7168, 1536), (1536, mla_heads * 192), (7168, 576), (1536, 64 * 128),
            (7168, 128), (7168, 64), (mla_heads * 128, 7168)]


def bench_decode_step(xp, s, rng, progress, ceilings):
    rows = []
    it = dict(warmup=s["warmup"], iters=s["iters"])
    for batch in s["decode_batches"]:
        for context in s["decode_contexts"]:
            if xp is not numpy and batch * context * (656 + 132 + 8) > 40e9:
                continue                                    # keep well inside 141 GB
            d = DecodeStep(xp, rng, batch, context, s, sets=s["sets"])
            t = {name: timing.time_op(xp, getattr(d, name), d.inputs, **it)
                 for name in ("scoring", "topk", "slots", "attention", "step")}
            t_proj = None
            if xp is not numpy:
                mats = [(xp.asarray(rng.standard_normal((batch, i)).astype(numpy.float32)),
                         xp.asarray((rng.standard_normal((i, o)) * 0.01).astype(numpy.float32)))
                        for i, o in _projection_shapes(s["mla_heads"])]
                t_proj = timing.time_op(xp, lambda: [a @ b for a, b in mats], **it)
            graph, graph_note = timing.try_time_graph(xp, d.step, d.inputs, reps=2 * d.sets,
                                                      iters=s["iters"])
            if graph is not None:
                graph_note = "captured: scoring + top-k to slots + attention, " + \
                    f"{graph['reps']} steps per graph"
            roof = _decode_roofline(batch, context, s, ceilings)
            total = sum(t[k]["median_ms"] for k in ("scoring", "topk", "slots", "attention"))
            graph_ms = graph["median_ms"] if graph else None
            row = dict(batch=batch, context=context,
                       projections_ms=t_proj["median_ms"] if t_proj else None,
                       indexer_ms=t["scoring"]["median_ms"], topk_ms=t["topk"]["median_ms"],
                       slots_ms=t["slots"]["median_ms"],
                       attention_ms=t["attention"]["median_ms"], sparse_path_ms=total,
                       eager_step_ms=t["step"]["median_ms"],
                       eager_step_p10_p90_ms=_spread(t["step"]),
                       graph_replay_ms=graph_ms,
                       graph_replay_p10_p90_ms=_spread(graph) if graph else None,
                       graph_note=graph_note, roofline_ms=roof,
                       vs_roofline=(total / roof) if roof else None,
                       graph_vs_roofline=(graph_ms / roof) if roof and graph_ms else None,
                       iters=t["step"]["iters"])
            for key, name in (("indexer", "scoring"), ("topk", "topk"), ("slots", "slots"),
                              ("attention", "attention")):
                row[f"{key}_p10_p90_ms"] = _spread(t[name])
            rows.append(row)
            progress(f"decode_step B={batch} ctx={context}: indexer "
                     f"{t['scoring']['median_ms']:.3f} + top-k {t['topk']['median_ms']:.3f} + "
                     f"slots {t['slots']['median_ms']:.3f} + attention "
                     f"{t['attention']['median_ms']:.3f} ms; eager step {_pm(t['step'])}"
                     + (f", graph {_pm(graph)}" if graph else "")
                     + (f" = {row['vs_roofline']:.2f}x roofline" if roof else ""))
            del d
    return rows


def _decode_roofline(batch, context, s, ceilings):
    """Sum of the rooflines in ms (bytes / copy rate, FLOPs / bf16 rate)."""
    bw = ceilings.get("copy_tbs")
    mm = ceilings.get("bf16_tflops")
    if not bw:
        return None
    keys = batch * context
    lora, rope = s["kv_lora_rank"], s["rope_dim"]
    record = cache_ref.mla_token_bytes(lora, rope)
    score_bytes = keys * (s["head_dim"] + 4) + keys * 4       # read keys, write logits
    topk_bytes = keys * 4 + batch * s["topk"] * 4
    slots_bytes = 2 * batch * s["topk"] * 4
    attn_bytes = batch * s["topk"] * record
    t = (score_bytes + topk_bytes + slots_bytes + attn_bytes) / (bw * 1e12)
    if mm:
        t += 2 * batch * s["mla_heads"] * s["topk"] * (lora + rope + lora) / (mm * 1e12)
    return t * 1e3


# ---- reporting -------------------------------------------------------------------

COLUMNS = {
    "short_prefill": ["tokens", "topk", "use_dense_mha", "skip_fired", "gate_on_ms",
                      "gate_on_p10_p90_ms", "gate_off_ms", "gate_off_p10_p90_ms",
                      "reduction_pct", "gate_on_gpu_ms", "gate_off_gpu_ms",
                      "gate_off_gpu_p10_p90_ms", "gpu_reduction_pct", "gpu_unheld",
                      "forward_on_ms", "forward_off_ms", "gate"],
    "mtp": ["batch", "context", "path_reuse_ms", "path_reuse_p10_p90_ms",
            "path_recompute_ms", "path_recompute_p10_p90_ms", "path_speedup",
            "path_gpu_reuse_ms", "path_gpu_recompute_ms", "path_gpu_speedup", "gpu_unheld",
            "forward_reuse_ms", "forward_recompute_ms", "forward_speedup",
            "path_effect_clear", "path_gpu_effect_clear", "forward_effect_clear",
            "recompute_indexer_calls"],
    "decode_step": ["batch", "context", "projections_ms", "indexer_ms", "topk_ms", "slots_ms",
                    "attention_ms", "sparse_path_ms", "eager_step_ms",
                    "eager_step_p10_p90_ms", "graph_replay_ms", "graph_replay_p10_p90_ms",
                    "roofline_ms", "vs_roofline", "graph_vs_roofline"],
}


def table_lines(rows, columns):
    """Rows (dicts) as aligned text lines of ``columns`` (header, rule, rows).

    Examples
    --------
    >>> from cpsparse.bench import table_lines
    >>> print("\\n".join(table_lines([{"a": 1.23456, "b": [0.5, 2.0]}], ["a", "b"])))
        a      b
    -----  -----
    1.235  0.5-2
    """
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:]


def print_table(title, rows, columns):
    print(f"\n{title}")
    print("\n".join(table_lines(rows, columns)))


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, (list, tuple)):
        return "-".join(_fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


PLOTS_SKIPPED = ("plots: skipped (matplotlib does not import; "
                 "pip install 'cpsparse[plots]' to get them)")


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib does not import."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - optional dependency (the ``plots`` extra)
        return None
    return plt


def context_label(tokens):
    """A context length as the plots print it: ``32K`` for whole multiples of 1024,
    else the number itself (a 512-token context is not "0K").

    Examples
    --------
    >>> from cpsparse.bench import context_label
    >>> context_label(32768), context_label(512), context_label(1500)
    ('32K', '512', '1500')
    """
    tokens = int(tokens)
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def run_label(results):
    """What ran the figures, for the plots' titles: the GPU's name, or the CPU.

    Examples
    --------
    >>> from cpsparse.bench import run_label
    >>> run_label({"backend": "cupy", "device": "NVIDIA H200"})
    'NVIDIA H200'
    >>> run_label({"backend": "numpy", "host": {"machine": "x86_64"}})
    'NumPy on the CPU (x86_64), small sizes'
    """
    if results.get("device"):
        return str(results["device"])
    machine = (results.get("host") or {}).get("machine")
    return "NumPy on the CPU" + (f" ({machine})" if machine else "") + ", small sizes"


def _legend_outside(ax, top_first=False, **kwargs):
    """The legend right of the axes, never over the bars (``top_first``: entries in the
    order a stacked bar shows them, top down)."""
    handles, labels = ax.get_legend_handles_labels()
    if top_first:
        handles, labels = handles[::-1], labels[::-1]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0),
              borderaxespad=0.0, **kwargs)


def _batch_context_ticks(ax, rows):
    """x ticks ``B=8`` over ``32K`` a bar (the axis label says which is which), the
    figure wide enough that neighbouring labels never overlap."""
    labels = [f"B={r['batch']}\n{context_label(r['context'])}" for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel("batch, context (tokens)", fontsize=8)
    ax.figure.set_figwidth(max(ax.figure.get_figwidth(), 2.5 + 0.5 * len(rows)))


def plot(results, out_dir):
    """PNG plots of each scenario; returns the files written (none without matplotlib).

    Each title names what ran the figures (:func:`run_label`), contexts read as
    :func:`context_label` prints them, and legends sit right of the axes.
    """
    plt = _pyplot()
    if plt is None:
        return []
    files = []
    where = run_label(results)
    rows = results["scenarios"].get("short_prefill")
    if rows:
        fig, ax = plt.subplots(figsize=(7.5, 3.5))
        xs = [str(r["tokens"]) for r in rows]
        bars = [("gate_off", "gate disabled"), ("gate_on", "gate enabled")]
        if all(r.get("gate_off_gpu_ms") is not None for r in rows):
            bars += [("gate_off_gpu", "gate disabled, GPU time"),
                     ("gate_on_gpu", "gate enabled, GPU time")]
        width = 0.8 / len(bars)
        for b, (key, label) in enumerate(bars):
            med = [r[f"{key}_ms"] for r in rows]
            err = [[m - r[f"{key}_p10_p90_ms"][0] for m, r in zip(med, rows)],
                   [r[f"{key}_p10_p90_ms"][1] - m for m, r in zip(med, rows)]]
            ax.bar([i + (b - (len(bars) - 1) / 2) * width for i in range(len(xs))], med,
                   width, yerr=err, label=label)
        ax.set_xticks(range(len(xs)), xs)
        ax.set_xlabel(f"prefill tokens (index_topk {rows[0]['topk']})")
        ax.set_ylabel("indexer time in the layer forward (ms)")
        ax.set_title(f"Short-prefill skip (construction gate), {where}", fontsize=9)
        _legend_outside(ax)
        files.append(_save(fig, out_dir, "short_prefill.png"))
    rows = results["scenarios"].get("mtp")
    if rows:
        fig, ax = plt.subplots(figsize=(7.5, 3.5))
        bars = [("path_speedup", "indexer steps + attention calls"),
                ("forward_speedup", "whole layer forwards")]
        if all(r.get("path_gpu_speedup") is not None for r in rows):
            bars.insert(1, ("path_gpu_speedup", "the same calls, GPU time"))
        width = 0.8 / len(bars)
        for b, (key, label) in enumerate(bars):
            ax.bar([i + (b - (len(bars) - 1) / 2) * width for i in range(len(rows))],
                   [r[key] for r in rows], width, label=label)
        ax.axhline(2.0, color="gray", ls="--", label="target 2.0x")
        _batch_context_ticks(ax, rows)
        ax.set_ylabel("steps 1+: recompute / reuse")
        ax.set_title(f"MTP step-0 top-k reuse (MTPDrafter), {where}", fontsize=9)
        _legend_outside(ax)
        files.append(_save(fig, out_dir, "mtp_reuse.png"))
    rows = results["scenarios"].get("decode_step")
    if rows:
        fig, ax = plt.subplots(figsize=(8.5, 3.5))
        bottom = [0.0] * len(rows)
        for key in ("projections_ms", "indexer_ms", "topk_ms", "slots_ms", "attention_ms"):
            vals = [r.get(key) or 0.0 for r in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=key[:-3])
            bottom = [b + v for b, v in zip(bottom, vals)]
        _batch_context_ticks(ax, rows)
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"Decode step of one layer, {where}", fontsize=9)
        _legend_outside(ax, top_first=True, fontsize=7)
        files.append(_save(fig, out_dir, "decode_step.png"))
    return files


def _save(fig, out_dir, name):
    path = pathlib.Path(out_dir) / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return str(path)


def default_out_dir(backend):
    """A new folder ``cpsparse-bench-<backend>-<date>-<time>-*`` in the temp directory.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from cpsparse.bench import default_out_dir
    >>> d = default_out_dir("numpy")
    >>> d.parent == pathlib.Path(tempfile.gettempdir()), d.name.startswith("cpsparse-bench-numpy-")
    (True, True)
    >>> d.rmdir()
    """
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return pathlib.Path(tempfile.mkdtemp(prefix=f"cpsparse-bench-{backend}-{stamp}-"))


def _version(module_name):
    try:
        return str(importlib.import_module(module_name).__version__)
    except Exception:  # noqa: BLE001 - not installed, or no __version__
        return None


def environment(xp):
    """The host and library versions of a run (recorded in the JSON).

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.bench import environment
    >>> env = environment(np)
    >>> sorted(env), env["libraries"]["numpy"] == np.__version__
    (['host', 'libraries'], True)
    """
    host = dict(python=_host.python_version(), implementation=_host.python_implementation(),
                system=_host.system(), release=_host.release(), machine=_host.machine(),
                processor=_host.processor() or None, cpu_count=os.cpu_count())
    libraries = {name: _version(name) for name in ("numpy", "ml_dtypes")}
    libraries["cpsparse"] = cpsparse.__version__
    if xp is not numpy:
        libraries["cupy"] = xp.__version__
        libraries["cuda_runtime"] = xp.cuda.runtime.runtimeGetVersion()
        libraries["cuda_driver"] = xp.cuda.runtime.driverGetVersion()
    if "matplotlib" in sys.modules:
        libraries["matplotlib"] = _version("matplotlib")
    return dict(host=host, libraries=libraries)


def run(backend="auto", scenarios=SCENARIOS, out_dir=None, quick=False, seed=0,
        progress=print):
    """Run the scenarios; returns the results dict (also written as JSON).

    The JSON (and the plots) go to ``out_dir``, created if needed; by default to
    a new folder from :func:`default_out_dir`. Nothing else is written.
    """
    xp = pick_backend(backend)
    backend = "numpy" if xp is numpy else "cupy"
    s = sizes(xp, quick)
    rng = numpy.random.default_rng(seed)
    # Value checks read device memory (a sync per call): off while timing, as in
    # a production loop. NumPy inputs are always checked.
    previous_checks = cpsparse.set_device_value_checks(False)
    try:
        return _run(xp, backend, scenarios, out_dir, quick, rng, s, progress, seed)
    finally:
        cpsparse.set_device_value_checks(previous_checks)


def _run(xp, backend, scenarios, out_dir, quick, rng, s, progress, seed):
    out = pathlib.Path(out_dir) if out_dir is not None else default_out_dir(backend)
    out.mkdir(parents=True, exist_ok=True)
    progress(f"output folder: {out}")
    ceilings = timing.measure_ceilings(xp)
    results = {"backend": backend, "date": datetime.date.today().isoformat(),
               "cpsparse": cpsparse.__version__, **environment(xp), "sizes": s,
               "ceilings": ceilings, "method": METHOD,
               "what": {k: WHAT[k] for k in scenarios}, "scenarios": {}}
    if xp is not numpy:
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
        results["device"] = props["name"].decode() if isinstance(props["name"], bytes) \
            else props["name"]
    progress(f"cpsparse.bench on {backend}" + (f" ({results.get('device')})"
                                                if xp is not numpy else " (small sizes)")
             + "".join(f", {k} {v:.4g}" for k, v in ceilings.items()))
    weights: dict = {}

    def layer_weights():                 # one set of layer weights, drawn once per run
        if not weights:
            weights.update(init_weights(layer_config(s), seed))
        return weights

    runners = {"short_prefill": lambda: bench_short_prefill(xp, s, rng, progress,
                                                            layer_weights()),
               "mtp": lambda: bench_mtp(xp, s, rng, progress, layer_weights()),
               "decode_step": lambda: bench_decode_step(xp, s, rng, progress, ceilings)}
    for name in scenarios:
        results["scenarios"][name] = runners[name]()
    for name, rows in results["scenarios"].items():
        print_table(name, rows, COLUMNS[name])
    path = out / f"bench_{backend}.json"
    path.write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
    results["plots"] = plot(results, out)
    print(f"\nresults: {path}" + "".join(f"\nplot: {p}" for p in results["plots"]))
    if _pyplot() is None:
        print(PLOTS_SKIPPED)
    return results


def _json_default(v):
    if isinstance(v, (numpy.integer,)):
        return int(v)
    if isinstance(v, (numpy.floating,)):
        return float(v)
    if isinstance(v, numpy.bool_):
        return bool(v)
    raise TypeError(type(v))


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cpsparse.bench", description=_cli.plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_version(parser)
    parser.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    parser.add_argument("--out", default=None, help="folder of the JSON and PNG files, "
                        "created if needed (default: a new cpsparse-bench-* folder in the "
                        "temp directory, printed)")
    parser.add_argument("--quick", action="store_true", help="fewer GPU cases")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    chosen = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    run(args.backend, chosen, args.out, args.quick, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
