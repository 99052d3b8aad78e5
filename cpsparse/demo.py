"""``python -m cpsparse``: a small DeepSeek-V3.2 attention stack, end to end.

Builds a stack of attention layers (every second one index-sharing) and an MTP
layer on the best backend available (CuPy with a GPU, else NumPy), then runs:

1. a prefill that fills the caches of a few requests;
2. a mixed batch: those requests decode while a new long request prefills;
3. a short prefill (no longer than index_topk) that takes the skip;
4. an MTP draft round: step 0 scores, steps 1+ reuse its top-k.

and prints what ran: indexer calls, scored and skipped calls, attention
routes, tokens and time.
"""

import argparse
import time

import numpy

import cpsparse
from cpsparse import _backend
from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.mla import DeepseekV32AttentionStack, DeepseekV32MLA, MLAConfig
from cpsparse.mtp import MTPDrafter
from cpsparse.platform import StaticPlatform, current_platform


def pick_backend(name):
    """The array module for --backend (auto: CuPy when a GPU is there)."""
    xp = _backend.backend_module(name, "backend")
    if xp is not numpy and not _backend.gpu_available():
        raise SystemExit("error: --backend cupy needs CuPy and a CUDA device")
    return xp


class PagePool:
    """Hands out pages to requests and keeps their block tables."""

    def __init__(self, num_blocks, block_size, max_blocks):
        self.free = list(range(num_blocks))[::-1]
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.pages = {}

    def reserve(self, request, length):
        pages = self.pages.setdefault(request, [])
        while len(pages) * self.block_size < length:
            if not self.free:
                raise RuntimeError("out of cache pages: raise --num-blocks")
            pages.append(self.free.pop())

    def table(self, requests, xp):
        t = numpy.zeros((len(requests), self.max_blocks), numpy.int32)
        for i, r in enumerate(requests):
            t[i, :len(self.pages[r])] = self.pages[r]
        return xp.asarray(t)


class Demo:
    def __init__(self, xp, config, platform, num_layers, num_blocks, max_num_tokens, seed=0):
        self.xp, self.config = xp, config
        self.rng = numpy.random.default_rng(seed)
        self.stack = DeepseekV32AttentionStack(
            config, num_layers, index_share_every=2, num_blocks=num_blocks,
            max_num_tokens=max_num_tokens, platform=platform, seed=seed, xp=xp)
        self.mtp = DeepseekV32MLA(config, "mtp.0.attn", is_mtp_layer=True, platform=platform,
                                  seed=seed + 100, xp=xp)
        self.mtp.allocate_kv_cache(num_blocks, max_num_tokens=max_num_tokens)
        max_blocks = -(-max_num_tokens * 4 // config.block_size)
        self.pool = PagePool(num_blocks, config.block_size, max_blocks)
        self.mtp_pool = PagePool(num_blocks, config.block_size, max_blocks)
        self.lengths = {}

    def hidden(self, tokens):
        x = self.rng.standard_normal((tokens, self.config.hidden_size)).astype(numpy.float32)
        return self.xp.asarray(x)

    def batch(self, pool, requests, query_lens, next_n=1):
        ctx = [self.lengths.get((pool is self.mtp_pool, r), 0) for r in requests]
        for r, c, q in zip(requests, ctx, query_lens):
            pool.reserve(r, c + q)
            self.lengths[(pool is self.mtp_pool, r)] = c + q
        return build_batch(query_lens, ctx, pool.table(requests, self.xp), next_n=next_n,
                           block_size=self.config.block_size,
                           index_topk=self.config.index_topk)

    def reset_stats(self):
        for layer in self.stack.layers + [self.mtp]:
            layer.attention_stats.reset()
            if layer.indexer is not None:
                layer.indexer.stats.reset()

    def run_stack(self, meta):
        ctx = ForwardContext.for_layers(meta, self.stack.layer_names)
        self.reset_stats()
        t0 = time.perf_counter()
        out = self.stack(self.hidden(meta.num_tokens), forward_context=ctx)
        _sync(self.xp)
        return out, time.perf_counter() - t0

    def describe(self, layers):
        lines = []
        for layer in layers:
            a = layer.attention_stats
            if layer.indexer is None:
                idx = "indexer: shares the rows of the layer before"
            else:
                s = layer.indexer.stats
                idx = (f"indexer: {s.calls} call(s), {s.scored_calls} scored, "
                       f"{s.skipped} skipped")
            lines.append(f"    {layer.layer_name:<14} {idx:<46} attention: "
                         f"{a.sparse_tokens} sparse / {a.dense_tokens} dense tokens")
        return lines


def _sync(xp):
    if xp is not numpy:
        xp.cuda.get_current_stream().synchronize()


def run(args):
    xp = pick_backend(args.backend)
    config = MLAConfig.small() if args.config == "small" else MLAConfig()
    if args.platform == "detected":
        platform = current_platform()
    else:
        platform = StaticPlatform(cuda=args.platform == "cuda")
    topk = config.index_topk
    prefill_len = args.prefill_len or 2 * topk + 22
    short_len = args.short_len or topk - 16
    context = args.context or 3 * topk
    max_tokens = max(prefill_len + args.decodes, short_len, args.mtp_requests * (topk + 8),
                     args.decodes * context)
    demo = Demo(xp, config, platform, args.layers, args.num_blocks, max_tokens, args.seed)
    print(f"cpsparse {cpsparse.__version__}: backend {xp.__name__}, config {args.config} "
          f"(hidden {config.hidden_size}, {config.num_heads} MLA heads, "
          f"{config.index_n_heads} index heads, index_topk {topk}), {args.layers} layers + "
          f"1 MTP layer, platform {platform!r}")
    gate = demo.stack.layers[0]._dense_mha_metadata_layer_name
    print(f"  construction gate: short-prefill skip "
          f"{'enabled' if gate else 'disabled'} on indexer layers, always off on the MTP "
          f"layer and on index-sharing layers")

    decoders = list(range(args.decodes))
    meta = demo.batch(demo.pool, decoders, [context] * args.decodes)
    _, seconds = demo.run_stack(meta)
    print(f"\n[1] prefill of {args.decodes} requests x {context} tokens: {meta.num_tokens} "
          f"tokens in {seconds * 1e3:.1f} ms")
    print("\n".join(demo.describe(demo.stack.layers)))

    meta = demo.batch(demo.pool, decoders + ["long"], [1] * args.decodes + [prefill_len])
    _, seconds = demo.run_stack(meta)
    print(f"\n[2] mixed batch: {meta.num_decode_tokens} decode + {meta.num_prefill_tokens} "
          f"prefill tokens ({len(meta.prefill.chunks)} prefill chunk(s)) in "
          f"{seconds * 1e3:.1f} ms")
    print("\n".join(demo.describe(demo.stack.layers)))

    meta = demo.batch(demo.pool, ["short"], [short_len])
    _, seconds = demo.run_stack(meta)
    skipped = sum(layer.indexer.stats.skipped for layer in demo.stack.layers if layer.indexer)
    print(f"\n[3] short prefill of {short_len} tokens (<= index_topk {topk}, use_dense_mha="
          f"{meta.mla.prefill.use_dense_mha}): {skipped} indexer call(s) skipped, "
          f"{seconds * 1e3:.1f} ms")
    print("\n".join(demo.describe(demo.stack.layers)))

    requests = list(range(args.mtp_requests))
    step0 = demo.batch(demo.mtp_pool, requests, [topk + 8] * args.mtp_requests)
    names = [demo.mtp.layer_name]

    def next_step(step, _previous):
        m = demo.batch(demo.mtp_pool, requests, [1] * args.mtp_requests)
        return demo.hidden(m.num_tokens), ForwardContext.for_layers(m, names)

    demo.reset_stats()
    t0 = time.perf_counter()
    outs = MTPDrafter(demo.mtp, args.mtp_steps).run_round(
        demo.hidden(step0.num_tokens), ForwardContext.for_layers(step0, names), next_step)
    _sync(xp)
    seconds = time.perf_counter() - t0
    s = demo.mtp.indexer.stats
    print(f"\n[4] MTP round of {args.mtp_steps} steps over {args.mtp_requests} requests: "
          f"{sum(o.shape[0] for o in outs)} tokens, indexer ran {s.scored_calls} time(s) "
          f"(step 0), steps 1..{args.mtp_steps - 1} reused its top-k; "
          f"{seconds * 1e3:.1f} ms")
    print("\n".join(demo.describe([demo.mtp])))
    finite = all(bool(xp.isfinite(o).all()) for o in outs)
    print("\nok" if finite else "\nnon-finite output!")
    return 0 if finite else 1


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cpsparse", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto",
                        help="array backend (auto: CuPy when a GPU is there)")
    parser.add_argument("--config", choices=("small", "v32"), default="small",
                        help="layer shapes: small preset or DeepSeek-V3.2 (slow on the CPU)")
    parser.add_argument("--platform", choices=("cuda", "detected", "cpu"), default="cuda",
                        help="what the construction gate is told (default: CUDA, so that "
                             "the short-prefill skip is exercised on any backend)")
    parser.add_argument("--layers", type=int, default=4, help="attention layers in the stack")
    parser.add_argument("--decodes", type=int, default=4, help="decode requests in step 2")
    parser.add_argument("--context", type=int, default=0,
                        help="their context length (default 3 * index_topk)")
    parser.add_argument("--prefill-len", type=int, default=0,
                        help="long prefill in step 2 (default 2 * index_topk + 22)")
    parser.add_argument("--short-len", type=int, default=0,
                        help="short prefill in step 3 (default index_topk - 16)")
    parser.add_argument("--mtp-requests", type=int, default=2)
    parser.add_argument("--mtp-steps", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=256, help="cache pages per layer")
    parser.add_argument("--seed", type=int, default=0)
    return run(parser.parse_args(argv))
