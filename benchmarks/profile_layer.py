"""Where a layer forward's time goes, stage by stage (a diagnostic, not a benchmark).

The scenarios of :mod:`cpsparse.bench` time whole :class:`cpsparse.mla.DeepseekV32MLA`
forwards, and there the forwards cost far more than their ops: an MTP draft step
took ~2.2 ms at every batch from 1 to 64 (reuse), ~4.4 ms when it scored again,
where the public ops of a decode step sum to 0.1-0.3 ms and the projections to
0.2-0.7 ms (``docs/performance_scenarios.md``); a prefill forward ~12 us a token.
This splits one forward into its stages, each timed as its own interval
(:class:`cpsparse.timing.Probe` on the function the layer calls; CUDA events on
CuPy), beside the whole forward on the same clock and its host time on an idle
device (:func:`cpsparse.timing.time_host`); on CuPy also each stage's and the
forward's GPU busy span alone (a held probe: no host time); then lists the functions
with the most own host time (:mod:`cProfile`), so that a fix can be aimed at what
costs.

Run on a GPU machine from the repository root (DeepSeek-V3.2 sizes)::

    PYTHONPATH=$PWD python3 -m benchmarks.profile_layer

Output goes to stdout, and to ``$OUT/profile_layer.txt`` / ``.json`` when set.
On NumPy (``--numpy``) the same cases run at ``MLAConfig.small()`` sizes.
"""

import argparse
import itertools
import json
import os
import sys

import numpy

from benchmarks import profile_host
from cpsparse import bench as _bench
from cpsparse import mla as _mla
from cpsparse import timing
from cpsparse.cache import IndexerKCache, MLAKVCache
from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.mla import DeepseekV32MLA, init_weights
from cpsparse.platform import StaticPlatform

# (stage, owner, attribute): what a forward calls, looked up at call time, so a
# Probe patched on it sees every call (a class attribute patched is every instance's)
STAGES = (
    ("project", DeepseekV32MLA, "_project"),
    ("mla_cache_insert", MLAKVCache, "insert_core"),
    ("indexer_queries_keys", _mla._Indexer, "queries_keys"),
    ("indexer_cache_insert", IndexerKCache, "insert_core"),
    ("indexer_call", _mla, "sparse_attn_indexer_core"),
    ("sparse_attention", DeepseekV32MLA, "_sparse"),
    ("dense_attention", DeepseekV32MLA, "_dense"),
    ("output", DeepseekV32MLA, "_output"),
)

LAYER = "layers.0.attn"


def cases(xp, s, rng, quick=False):
    """``[(name, forward, inputs)]``: decode steps (B x 32K, one token a request) through
    an MTP layer scoring and reusing step 0's top-k, and prefills with the gate on.
    ``forward(j)`` runs one layer forward on input set ``j`` of ``inputs``."""
    cfg = _bench.layer_config(s)
    weights = init_weights(cfg, seed=0)
    small = s["config"] == "small"
    context = 256 if small else 32768
    batches = [1, 4] if small else ([8] if quick else [1, 8, 64])
    prefill_lens = [s["topk"], s["topk"] + 1] if small else [1024, 2049]
    out = []
    for batch in batches:
        layer = DeepseekV32MLA(cfg, LAYER, is_mtp_layer=True, weights=weights, xp=xp,
                               platform=StaticPlatform(cuda=True))
        table, blocks = _bench._tables(xp, batch, context, cfg.block_size, extra=2)
        layer.allocate_kv_cache(blocks, max_num_tokens=batch)
        _bench._fill_indexer_cache(xp, rng, layer.indexer_cache, blocks * cfg.block_size)
        _bench._fill_mla_cache(xp, rng, layer.mla_cache, blocks * cfg.block_size)
        step = [ForwardContext.for_layers(
            build_batch([1] * batch, [context + i] * batch, table, block_size=cfg.block_size,
                        index_topk=cfg.index_topk), [LAYER]) for i in range(2)]
        xs = [(_bench._rng_array(xp, rng, (batch, cfg.hidden_size)),) for _ in range(s["sets"])]

        def scoring(x, layer=layer, ctx=step[0]):
            layer.end_topk_reuse()
            return layer.forward(x, forward_context=ctx)

        def reusing(x, layer=layer, ctx=step[1]):
            return layer.forward(x, forward_context=ctx)

        def begin_reuse(layer=layer, x=xs[0][0], ctx=step[0]):
            layer.end_topk_reuse()
            layer.forward(x, forward_context=ctx)
            layer.begin_topk_reuse(ctx.batch)

        out.append((f"decode B={batch} ctx={context}, scoring", scoring, xs, None))
        out.append((f"decode B={batch} ctx={context}, reusing step 0's top-k", reusing, xs,
                    begin_reuse))
    longest = max(prefill_lens)
    layer = DeepseekV32MLA(cfg, LAYER, weights=weights, xp=xp,
                           platform=StaticPlatform(cuda=True))
    blocks = -(-longest // cfg.block_size)
    table = xp.asarray(numpy.arange(blocks, dtype=numpy.int32)[None])
    layer.allocate_kv_cache(blocks, max_num_tokens=longest)
    for length in prefill_lens:
        ctx = ForwardContext.for_layers(build_batch([length], [0], table,
                                                    block_size=cfg.block_size,
                                                    index_topk=cfg.index_topk), [LAYER])
        xs = [(_bench._rng_array(xp, rng, (length, cfg.hidden_size)),)
              for _ in range(s["sets"])]
        gate = "gate fires" if length <= cfg.index_topk else "gate cannot fire"
        out.append((f"prefill {length} tokens ({gate})",
                    lambda x, layer=layer, ctx=ctx: layer.forward(x, forward_context=ctx),
                    xs, None))
    return out


def _probed(probe, owner, name, forward, inputs, calls, iters, floor_ms=0.0):
    """Per-forward sums (ms) of ``probe``'s intervals around ``owner.name`` over ``iters``
    forwards that each call it ``calls`` times (less ``floor_ms`` an interval)."""
    with probe.patch(owner, name):
        probe.reset()
        probe.reserve(2 * calls * iters)        # no event made inside an interval
        for i in range(iters):
            forward(*inputs[i % len(inputs)])
    times = numpy.asarray(probe.times_ms(floor_ms))
    if times.size != calls * iters:
        raise RuntimeError(f"{owner.__name__}.{name}: {times.size} calls in {iters} "
                           f"forwards, {calls} in the first")
    return times.reshape(iters, calls).sum(axis=1)


def stage_times(xp, forward, inputs, warmup, iters, floor_ms=None):
    """``{"forward": summary, "host_us": summary, "stages": {stage: summary + "calls"}}``:
    the whole forward, its host time on an idle device, and every stage it called
    (``calls``: calls a forward; a stage not called is left out).

    On CuPy each stage also gets ``gpu_ms`` (median a forward) and ``gpu_unheld``: the
    same calls' GPU busy span alone, each behind a stream hold (:class:`cpsparse.timing.
    Probe` ``hold_ms``, ``floor_ms`` subtracted: by default :func:`cpsparse.timing.
    held_floor_ms`), and the result ``forward_gpu``, the whole forward's."""
    whole = timing.time_op(xp, forward, inputs, warmup=warmup, iters=iters)
    host = timing.time_host(forward, inputs, xp=xp, warmup=warmup, iters=iters)
    gpu = _bench._gpu_time_pass(xp)
    if gpu and floor_ms is None:
        floor_ms = timing.held_floor_ms(xp)
    stages = {}
    for stage, owner, name in STAGES:
        probe = timing.Probe(xp)
        with probe.patch(owner, name):
            forward(*inputs[0])                 # how many calls a forward makes
            calls = len(probe.times_ms())
        if not calls:
            continue
        per_forward = _probed(probe, owner, name, forward, inputs, calls, iters)
        stages[stage] = dict(timing.summarize(per_forward.tolist()), calls=calls)
        if gpu:
            held = timing.Probe(xp, hold_ms=timing.hold_for(probe.host_times_ms()))
            held_per_forward = _probed(held, owner, name, forward, inputs, calls, iters,
                                       floor_ms)
            stages[stage].update(gpu_ms=float(numpy.median(held_per_forward)),
                                 gpu_unheld=held.unheld())
    out = dict(forward=whole, host_us=host, stages=stages)
    if gpu:
        # the whole forward behind one hold (its host time measured on an idle device)
        held = timing.Probe(xp, hold_ms=timing.hold_for(host["p90_us"] / 1e3))
        timed = held.wrap(forward)
        held.reserve(2 * iters)
        for i in range(iters):
            timed(*inputs[i % len(inputs)])
        out["forward_gpu"] = dict(held.summary(expected=iters, floor_ms=floor_ms))
    return out


def host_profile(forward, inputs, xp, calls, top=15):
    """cProfile of ``calls`` forwards over the rotating ``inputs``: (Python function calls
    a forward, the report of the ``top`` functions by own time)."""
    turn = itertools.count()

    def one():
        forward(*inputs[next(turn) % len(inputs)])
    return profile_host.cprofile_report(one, calls, xp, warmup=len(inputs), top=top)


def report(name, t, calls_per_forward=None):
    """Text lines of one case: the stages, their share of the forward, the rest."""
    f = t["forward"]
    lines = [f"==== {name}: forward {f['median_ms']:.4f} ms (p10-p90 {f['p10_ms']:.4f}-"
             f"{f['p90_ms']:.4f}); host {t['host_us']['median_us']:.1f} us on an idle device"
             + (f"; {calls_per_forward:.0f} Python calls a forward"
                if calls_per_forward is not None else "")]
    if "forward_gpu" in t:
        g = t["forward_gpu"]
        lines.append(f"  GPU busy span of the forward {g['median_ms']:.4f} ms (p10-p90 "
                     f"{g['p10_ms']:.4f}-{g['p90_ms']:.4f}; held, {g['unheld']} unheld); "
                     "each stage's after its share")
    covered = 0.0
    for stage, st in t["stages"].items():
        covered += st["median_ms"]
        lines.append(f"  {stage:22s} {st['median_ms']:9.4f} ms  ({st['p10_ms']:.4f}-"
                     f"{st['p90_ms']:.4f})  {100 * st['median_ms'] / f['median_ms']:5.1f}%"
                     f"  x{st['calls']}"
                     + (f"  GPU {st['gpu_ms']:.4f} ms" + (f" ({st['gpu_unheld']} unheld)"
                                                          if st["gpu_unheld"] else "")
                        if "gpu_ms" in st else ""))
    lines.append(f"  {'rest of the forward':22s} {f['median_ms'] - covered:9.4f} ms"
                 "  (forward median minus the stage medians)")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numpy", action="store_true", help="NumPy backend, small sizes")
    p.add_argument("--quick", action="store_true", help="one decode batch (8)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--profile-calls", type=int, default=50,
                   help="forwards under cProfile per case (0: none)")
    args = p.parse_args(argv)
    if args.numpy:
        xp = numpy
    else:
        from benchmarks import harness
        xp = harness.cupy()
    import cpsparse
    s = _bench.sizes(xp)
    rng = numpy.random.default_rng(0)
    text, results = [], {}
    previous = cpsparse.set_device_value_checks(False)
    try:
        floor = timing.held_floor_ms(xp)        # an empty held interval (0.0 on NumPy)
        for name, forward, inputs, setup in cases(xp, s, rng, args.quick):
            if setup is not None:
                setup()
            t = stage_times(xp, forward, inputs, warmup=2, iters=args.iters, floor_ms=floor)
            calls, prof = (host_profile(forward, inputs, xp, args.profile_calls)
                           if args.profile_calls else (None, ""))
            results[name] = dict(t, python_calls_per_forward=calls)
            lines = report(name, t, calls) + ([prof] if prof else [])
            print("\n".join(lines), flush=True)
            text.extend(lines)
    finally:
        cpsparse.set_device_value_checks(previous)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_layer.txt"), "w") as f:
            f.write("\n".join(text) + "\n")
        with open(os.path.join(os.environ["OUT"], "profile_layer.json"), "w") as f:
            json.dump(dict(sizes=s, cases=results), f, indent=1, default=str)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
