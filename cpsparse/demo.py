"""``python -m cpsparse``: a small DeepSeek-V3.2 attention stack, end to end.

Builds a stack of attention layers (every second one index-sharing) and an MTP
layer on the best backend available (CuPy with a GPU, else NumPy), then runs:

1. a prefill that fills the caches of a few requests;
2. a mixed batch: those requests decode while a new long request (longer than
   index_topk) prefills over the sparse top-k route;
3. a short prefill (no longer than index_topk) that takes the skip;
4. an MTP draft round: step 0 scores, steps 1+ reuse its top-k.

and prints what ran: indexer calls, scored and skipped calls, attention
routes, tokens and time.

Sizes follow the config and the backend: ``--config v32`` on NumPy (the
float64 reference on the CPU) runs 2 layers and short requests, except the
one long prefill of step 2, in a few minutes (``--config glm5``: 4 layers, as
GLM-5.2's index sharing first skips the indexer at layer 3); on CuPy it runs
the full-size batches. Every size flag overrides its default; ``--num-blocks`` defaults to
the cache pages the run needs.
"""

import argparse
import dataclasses
import os
import sys
import time

import numpy

import cpsparse
from cpsparse import _backend, _cli
from cpsparse.metadata import DEFAULT_LOGITS_BUDGET_BYTES, ForwardContext, build_batch
from cpsparse.mla import DeepseekV32AttentionStack, DeepseekV32MLA, MLAConfig
from cpsparse.mtp import MTPDrafter
from cpsparse.platform import StaticPlatform, current_platform
from cpsparse.reference import attention as _attention_ref
from cpsparse.reference import cache as _cache_ref

__all__ = ["main", "run", "plan_run", "RunPlan", "default_sizes", "estimate_host_bytes",
           "pick_backend", "PagePool", "SIZE_FIELDS"]

# The size flags, in the order of the demo's steps (dest names of the parser).
SIZE_FIELDS = ("layers", "decodes", "context", "prefill_len", "short_len", "mtp_requests",
               "mtp_len", "mtp_steps")

GiB = 1 << 30


class DemoError(Exception):
    """A user error found before (or while) running: reported as one line."""


CONFIGS = ("small", "v32", "glm5")


def _config(name):
    """The layer shapes of a demo config. small and v32 share every other layer's
    top-k (index_topk_freq 2, to show index sharing); glm5 runs GLM-5.2's own
    schedule (freq 4, offset 3: layer 3 of 4 shares) and its interleaved
    indexer RoPE."""
    if name == "glm5":
        return MLAConfig.glm5()
    return MLAConfig.small(index_topk_freq=2) if name == "small" else MLAConfig(
        index_topk_freq=2)


def resolve_backend(name):
    """The array module for --backend; DemoError (one line) when it cannot be used."""
    if name == "numpy":
        return numpy
    if name == "cupy" and not _backend.gpu_available():
        raise DemoError("--backend cupy needs CuPy and a CUDA device "
                        + ("(CuPy imports, but sees no device)" if _backend.cupy_module()
                           else "(CuPy does not import)") + "; use --backend numpy")
    try:
        return _backend.backend_module(name, "backend")
    except ValueError as exc:
        raise DemoError(str(exc)) from None


def pick_backend(name):
    """The array module for --backend (auto: CuPy when a GPU is there).

    Exits with one ``error:`` line when the backend cannot be used (also used by
    ``python -m cpsparse.bench``).
    """
    try:
        return resolve_backend(name)
    except DemoError as exc:
        raise SystemExit(f"error: {exc}") from None


def default_sizes(config_name, backend):
    """Default sizes (dict over SIZE_FIELDS) of a config on a backend ("numpy"/"cupy").

    The small config, and any config on CuPy, run the full demo batches (several
    requests longer than index_topk). The DeepSeek-V3.2 shapes on NumPy run the
    float64 reference on the CPU, where one token of sparse attention costs
    about 25 ms per layer: 2 layers, short requests, and one prefill just
    longer than index_topk (step 2 must take the sparse top-k route).
    """
    topk = _config(config_name).index_topk
    if config_name == "v32" and backend == "numpy":
        return dict(layers=2, decodes=2, context=256, prefill_len=topk + 64, short_len=256,
                    mtp_requests=2, mtp_len=128, mtp_steps=3)
    if config_name == "glm5" and backend == "numpy":     # 4 layers: the 4th shares
        return dict(layers=4, decodes=2, context=256, prefill_len=topk + 64, short_len=256,
                    mtp_requests=2, mtp_len=128, mtp_steps=3)
    return dict(layers=4, decodes=4, context=3 * topk, prefill_len=2 * topk + 22,
                short_len=topk - 16, mtp_requests=2, mtp_len=topk + 8, mtp_steps=3)


def _pages(tokens, block_size):
    return -(-int(tokens) // block_size)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What one demo run allocates and runs (see :func:`plan_run`)."""
    config_name: str
    backend: str
    config: MLAConfig
    layers: int
    decodes: int
    context: int
    prefill_len: int
    short_len: int
    mtp_requests: int
    mtp_len: int
    mtp_steps: int
    num_blocks: int            # cache pages per layer (explicit or pages_needed)

    # ---- what the steps need -------------------------------------------------

    @property
    def request_tokens(self):
        """Final length of each request, by pool: (stack lengths, MTP lengths)."""
        stack = [self.context + 1] * self.decodes + [self.prefill_len, self.short_len]
        mtp = [self.mtp_len + self.mtp_steps - 1] * self.mtp_requests
        return stack, mtp

    @property
    def stack_pages(self):
        """Pages the stack's pool hands out (every stack layer has this many in use)."""
        return sum(_pages(n, self.config.block_size) for n in self.request_tokens[0])

    @property
    def mtp_pages(self):
        """Pages the MTP layer's pool hands out."""
        return sum(_pages(n, self.config.block_size) for n in self.request_tokens[1])

    @property
    def pages_needed(self):
        """The least --num-blocks that runs: each layer holds num_blocks pages."""
        return max(self.stack_pages, self.mtp_pages)

    @property
    def max_blocks(self):
        """Width of the block tables: the pages of the longest request."""
        stack, mtp = self.request_tokens
        return max(_pages(n, self.config.block_size) for n in stack + mtp)

    @property
    def stack_rows(self):
        """Rows of the stack's top-k buffer: tokens of its largest forward."""
        return max(self.decodes * self.context, self.decodes + self.prefill_len,
                   self.short_len)

    @property
    def mtp_rows(self):
        return self.mtp_requests * self.mtp_len


def _weight_elems(c, with_indexer):
    h = c.num_heads
    n = (c.hidden_size * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim
         + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
         + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
         + h * c.v_head_dim * c.hidden_size)
    if with_indexer:
        n += (c.q_lora_rank * c.index_n_heads * c.index_head_dim
              + c.hidden_size * c.index_head_dim + 2 * c.index_head_dim
              + c.hidden_size * c.index_n_heads)
    return n


def _token_bytes(c):
    """Host bytes alive per token of one forward on the NumPy reference (upper bound).

    The activations of the layer in flight: the query [H, qk_head_dim], the
    absorbed query and its float64 copy [H, L + R], the latent output [H, L]
    with its temporaries, the indexer's query with its float64 Hadamard stages,
    and the residual stream of the stack.
    """
    h, d = c.num_heads, c.kv_lora_rank + c.qk_rope_head_dim
    attn = (4 * h * c.qk_head_dim            # q
            + 3 * 4 * h * d                  # q_abs / q_pe, concatenation, q_full
            + 8 * h * d                      # float64 q in the attention reference
            + 3 * 4 * h * c.kv_lora_rank     # latent out, w_uv product, transposes
            + 2 * 4 * h * c.v_head_dim)
    index = 4 * 4 * c.index_n_heads * c.index_head_dim + 8 * c.index_n_heads
    return attn + index + 6 * 4 * c.hidden_size


# Reference workspaces alive at once (each op chunks to 256 MiB blocks; softmax,
# score blocks and top-k keys hold a few of them), plus the indexer's logits
# chunk, plus the interpreter with NumPy and CuPy imported.
_WORKSPACE_BYTES = 4 * _attention_ref.WORKSPACE_BYTES + DEFAULT_LOGITS_BUDGET_BYTES
_BASELINE_BYTES = 256 << 20


def estimate_host_bytes(plan):
    """Upper estimate of the peak host memory (bytes) of a NumPy-backend run.

    Weights of every layer (float32), the largest weight's float64 draws while
    a layer is built, the paged caches (``num_blocks`` pages per layer), both
    top-k buffers, the activations of the largest forward and the reference
    workspaces.
    """
    c = plan.config
    shared = sum(not c.layer_scores(i) for i in range(plan.layers))   # own no indexer
    weights = 4 * (_weight_elems(c, True) * (plan.layers - shared + 1)
                   + _weight_elems(c, False) * shared)
    largest = max(c.num_heads * c.v_head_dim * c.hidden_size,
                  c.q_lora_rank * c.num_heads * c.qk_head_dim)
    build = 2 * 8 * largest + 4 * c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim
                                                                  + c.v_head_dim)
    mla_page = c.block_size * _cache_ref.mla_token_bytes(c.kv_lora_rank, c.qk_rope_head_dim)
    index_page = c.block_size * (c.index_head_dim + 4)
    owners = plan.layers - shared + 1
    caches = plan.num_blocks * (mla_page * (plan.layers + 1) + index_page * owners)
    buffers = 4 * c.index_topk * (plan.stack_rows + plan.mtp_rows)
    tokens = max(plan.stack_rows, plan.mtp_rows)
    activations = tokens * _token_bytes(c)
    return (_BASELINE_BYTES + weights + max(build, activations + _WORKSPACE_BYTES)
            + caches + buffers)


def plan_run(config_name="small", backend="numpy", num_blocks=None, **sizes):
    """The sizes of a run: defaults of (config, backend), overridden by ``sizes``.

    ``num_blocks=None`` means the pages the run needs (:attr:`RunPlan.pages_needed`).
    Values are not validated here (:func:`main` does that).

    Examples
    --------
    >>> from cpsparse.demo import plan_run
    >>> plan = plan_run("v32", "numpy")
    >>> plan.layers, plan.prefill_len > plan.config.index_topk, plan.num_blocks
    (2, True, 47)
    >>> plan_run("small", "numpy", layers=1).layers
    1
    """
    unknown = set(sizes) - set(SIZE_FIELDS)
    if unknown:
        raise TypeError(f"unknown size(s) {sorted(unknown)}; expected {SIZE_FIELDS}")
    chosen = default_sizes(config_name, backend)
    chosen.update({k: v for k, v in sizes.items() if v is not None})
    plan = RunPlan(config_name=config_name, backend=backend, config=_config(config_name),
                   num_blocks=0, **chosen)
    return dataclasses.replace(plan, num_blocks=plan.pages_needed if num_blocks is None
                               else num_blocks)


def _host_memory():
    """(total, available) host bytes from /proc/meminfo; None where unknown."""
    found = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if "MemTotal" not in found:
        try:
            found["MemTotal"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    return found.get("MemTotal"), found.get("MemAvailable")


def check_plan(plan):
    """Refuse sizes that cannot run the demo's steps: DemoError with one line."""
    topk = plan.config.index_topk
    rules = [
        ("layers", 1, "the stack needs a layer"),
        ("decodes", 1, "step 2 decodes these requests"),
        ("context", 2, "step 1 prefills it; 1 token would be a decode"),
        ("prefill_len", topk + 1, f"step 2's long prefill must be longer than index_topk="
                                  f"{topk} to take the sparse top-k route"),
        ("short_len", 2, "step 3's short prefill; 1 token would be a decode"),
        ("mtp_requests", 1, "step 4 drafts for these requests"),
        ("mtp_len", 1, "step 0 of the MTP round needs a token per request"),
        ("mtp_steps", 1, "an MTP round has a step 0"),
    ]
    for name, least, why in rules:
        value = getattr(plan, name)
        if value < least:
            raise DemoError(f"argument --{name.replace('_', '-')}: expected an int >= {least} "
                            f"({why}), got {value}")
    if plan.short_len > topk:
        raise DemoError(f"argument --short-len: expected at most index_topk={topk} (step 3's "
                        f"short prefill takes the skip), got {plan.short_len}")
    if plan.num_blocks < plan.pages_needed:
        raise DemoError(f"argument --num-blocks: this run needs at least {plan.pages_needed} "
                        f"cache pages per layer ({plan.stack_pages} for the stack, "
                        f"{plan.mtp_pages} for the MTP layer, block_size "
                        f"{plan.config.block_size}), got {plan.num_blocks}")


def check_memory(plan, total=None, available=None):
    """On NumPy, refuse a run whose estimated peak exceeds the host's memory.

    Returns a warning line (or None) when the estimate exceeds the memory
    available right now but not the total (other programs may free theirs).
    """
    if plan.backend != "numpy":
        return None
    if total is None and available is None:
        total, available = _host_memory()
    need = estimate_host_bytes(plan)
    if total is not None and need > total:
        raise DemoError(f"this run would need up to {need / GiB:.1f} GiB of host memory, "
                        f"more than the {total / GiB:.1f} GiB this machine has; lower --layers, "
                        f"--decodes, --context, --prefill-len, --mtp-len or --num-blocks")
    if available is not None and need > available:
        return (f"warning: this run may need up to {need / GiB:.1f} GiB of host memory, "
                f"{available / GiB:.1f} GiB are available now")
    return None


class PagePool:
    """Hands out pages to requests and keeps their block tables."""

    def __init__(self, num_blocks, block_size, max_blocks):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))[::-1]
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.pages = {}

    @property
    def used(self):
        return self.num_blocks - len(self.free)

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
    def __init__(self, xp, plan, platform, seed=0):
        config = plan.config
        self.xp, self.config = xp, config
        self.rng = numpy.random.default_rng(seed)
        self.stack = DeepseekV32AttentionStack(
            config, plan.layers, num_blocks=plan.num_blocks,
            max_num_tokens=plan.stack_rows, platform=platform, seed=seed, xp=xp)
        self.mtp = DeepseekV32MLA(config, "mtp.0.attn", is_mtp_layer=True, platform=platform,
                                  seed=seed + 100, xp=xp)
        self.mtp.allocate_kv_cache(plan.num_blocks, max_num_tokens=plan.mtp_rows)
        self.pool = PagePool(plan.num_blocks, config.block_size, plan.max_blocks)
        self.mtp_pool = PagePool(plan.num_blocks, config.block_size, plan.max_blocks)
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
                idx = "indexer: shares the last scoring layer's rows"
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


def _took(seconds):
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _say(*lines):
    print("\n".join(lines), flush=True)


def run(plan, xp, platform, seed=0):
    """Run the four steps of the demo for ``plan``; 0 when every output is finite."""
    config, p = plan.config, plan
    topk = config.index_topk
    _say(f"cpsparse {cpsparse.__version__}: backend {xp.__name__}, config {p.config_name} "
         f"(hidden {config.hidden_size}, {config.num_heads} MLA heads, "
         f"{config.index_n_heads} index heads, index_topk {topk}), {p.layers} layers + "
         f"1 MTP layer, platform {platform!r}")
    memory = (f"; estimated peak host memory {estimate_host_bytes(p) / GiB:.1f} GiB"
              if p.backend == "numpy" else "")
    _say(f"  sizes: {p.decodes} requests x {p.context} tokens, then {p.decodes} decodes + a "
         f"{p.prefill_len}-token prefill, a {p.short_len}-token short prefill, MTP "
         f"{p.mtp_requests} requests x {p.mtp_len} tokens + {p.mtp_steps - 1} draft step(s); "
         f"{p.num_blocks} cache pages per layer (needs {p.pages_needed}){memory}")
    print(f"  building {p.layers} layers + 1 MTP layer ...", end=" ", flush=True)
    t0 = time.perf_counter()
    demo = Demo(xp, p, platform, seed)
    _say(f"{_took(time.perf_counter() - t0)}")
    gate = demo.stack.layers[0]._dense_mha_metadata_layer_name
    _say(f"  construction gate: short-prefill skip "
         f"{'enabled' if gate else 'disabled'} on indexer layers, always off on the MTP "
         f"layer and on index-sharing layers")

    decoders = list(range(p.decodes))
    _say("", f"[1/4] prefill of {p.decodes} requests x {p.context} tokens ...")
    meta = demo.batch(demo.pool, decoders, [p.context] * p.decodes)
    _, seconds = demo.run_stack(meta)
    _say(f"      {meta.num_tokens} tokens in {_took(seconds)}", *demo.describe(demo.stack.layers))

    _say("", f"[2/4] mixed batch: {p.decodes} decodes while a new request prefills "
             f"{p.prefill_len} tokens (> index_topk {topk}: sparse top-k) ...")
    meta = demo.batch(demo.pool, decoders + ["long"], [1] * p.decodes + [p.prefill_len])
    _, seconds = demo.run_stack(meta)
    _say(f"      {meta.num_decode_tokens} decode + {meta.num_prefill_tokens} prefill tokens "
         f"({len(meta.prefill.chunks)} prefill chunk(s), use_dense_mha="
         f"{meta.mla.prefill.use_dense_mha}) in {_took(seconds)}",
         *demo.describe(demo.stack.layers))

    _say("", f"[3/4] short prefill of {p.short_len} tokens (<= index_topk {topk}) ...")
    meta = demo.batch(demo.pool, ["short"], [p.short_len])
    _, seconds = demo.run_stack(meta)
    skipped = sum(layer.indexer.stats.skipped for layer in demo.stack.layers if layer.indexer)
    _say(f"      use_dense_mha={meta.mla.prefill.use_dense_mha}: {skipped} indexer call(s) "
         f"skipped, {_took(seconds)}", *demo.describe(demo.stack.layers))

    _say("", f"[4/4] MTP round of {p.mtp_steps} step(s) over {p.mtp_requests} requests "
             f"(step 0: {p.mtp_len} tokens each) ...")
    requests = list(range(p.mtp_requests))
    step0 = demo.batch(demo.mtp_pool, requests, [p.mtp_len] * p.mtp_requests)
    names = [demo.mtp.layer_name]

    def next_step(step, _previous):
        m = demo.batch(demo.mtp_pool, requests, [1] * p.mtp_requests)
        return demo.hidden(m.num_tokens), ForwardContext.for_layers(m, names)

    demo.reset_stats()
    t0 = time.perf_counter()
    outs = MTPDrafter(demo.mtp, p.mtp_steps).run_round(
        demo.hidden(step0.num_tokens), ForwardContext.for_layers(step0, names), next_step)
    _sync(xp)
    seconds = time.perf_counter() - t0
    s = demo.mtp.indexer.stats
    reuse = (f"steps 1..{p.mtp_steps - 1} reused its top-k" if p.mtp_steps > 1
             else "no draft step to reuse it")
    _say(f"      {sum(o.shape[0] for o in outs)} tokens, indexer ran {s.scored_calls} "
         f"time(s) (step 0), {reuse}; {_took(seconds)}", *demo.describe([demo.mtp]))
    _say("", f"cache pages used: {demo.pool.used} by the stack, {demo.mtp_pool.used} by "
             f"the MTP layer, of {p.num_blocks} per layer")
    finite = all(bool(xp.isfinite(o).all()) for o in outs)
    _say("", "ok" if finite else "non-finite output!")
    return 0 if finite else 1


def build_parser():
    small, v32_cpu = default_sizes("small", "numpy"), default_sizes("v32", "numpy")

    def defaults(name, formula):
        if small[name] == v32_cpu[name]:
            return f"default {formula}"
        return f"default {formula}; {v32_cpu[name]} for v32 on NumPy"

    parser = argparse.ArgumentParser(
        prog="python -m cpsparse", description=_cli.plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_version(parser)
    parser.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto",
                        help="array backend (auto: CuPy when a GPU is there)")
    parser.add_argument("--config", choices=CONFIGS, default="small",
                        help="layer shapes: small preset, DeepSeek-V3.2 or GLM-5.2 "
                             "(minutes on the CPU)")
    parser.add_argument("--platform", choices=("cuda", "detected", "cpu"), default="cuda",
                        help="what the construction gate is told (default: CUDA, so that "
                             "the short-prefill skip is exercised on any backend)")
    parser.add_argument("--layers", type=int, help="attention layers in the stack ("
                        + defaults("layers", "4") + ")")
    parser.add_argument("--decodes", type=int, help="requests prefilled in step 1 that decode "
                        "in step 2 (" + defaults("decodes", "4") + ")")
    parser.add_argument("--context", type=int, help="their prompt length in step 1 ("
                        + defaults("context", "3 * index_topk") + ")")
    parser.add_argument("--prefill-len", type=int, help="long prefill in step 2, > index_topk "
                        "(" + defaults("prefill_len", "2 * index_topk + 22") + ")")
    parser.add_argument("--short-len", type=int, help="short prefill in step 3, <= index_topk "
                        "(" + defaults("short_len", "index_topk - 16") + ")")
    parser.add_argument("--mtp-requests", type=int, help="requests of the MTP round ("
                        + defaults("mtp_requests", "2") + ")")
    parser.add_argument("--mtp-len", type=int, help="step-0 tokens of each MTP request ("
                        + defaults("mtp_len", "index_topk + 8") + ")")
    parser.add_argument("--mtp-steps", type=int, help="draft steps of the MTP round, step 0 "
                        "included (" + defaults("mtp_steps", "3") + ")")
    parser.add_argument("--num-blocks", type=int,
                        help="cache pages per layer (default: what the run needs)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.seed < 0:
            raise DemoError(f"argument --seed: expected an int >= 0, got {args.seed}")
        if args.num_blocks is not None and args.num_blocks < 1:
            raise DemoError(f"argument --num-blocks: expected an int >= 1, got "
                            f"{args.num_blocks}")
        xp = resolve_backend(args.backend)
        plan = plan_run(args.config, "numpy" if xp is numpy else "cupy", args.num_blocks,
                        **{name: getattr(args, name) for name in SIZE_FIELDS})
        check_plan(plan)
        warning = check_memory(plan)
    except DemoError as exc:
        parser.error(str(exc))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if args.platform == "detected":
        platform = current_platform()
    else:
        platform = StaticPlatform(cuda=args.platform == "cuda")
    try:
        return run(plan, xp, platform, args.seed)
    except MemoryError as exc:
        print(flush=True)
        parser.error(f"out of memory ({type(exc).__name__}); lower --layers, --decodes, "
                     f"--context, --prefill-len or --mtp-len")
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
