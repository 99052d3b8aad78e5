"""A DeepSeek-V3.2 attention stack on the CPU: prefill, decode, short prefill, MTP.

Uses the small preset (MLAConfig.small()); pass MLAConfig() for the real shapes
(slow on the CPU). The construction gate is shown with an injected CUDA
platform so that the short-prefill skip fires on NumPy too.
"""

import numpy as np

from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.mla import DeepseekV32AttentionStack, DeepseekV32MLA, MLAConfig
from cpsparse.mtp import MTPDrafter
from cpsparse.platform import StaticPlatform

cfg = MLAConfig.small(index_topk_freq=2)          # layer 1 shares layer 0's top-k
rng = np.random.default_rng(0)
cuda = StaticPlatform(cuda=True)
stack = DeepseekV32AttentionStack(cfg, num_layers=2, num_blocks=32, max_num_tokens=512,
                                  platform=cuda)
table = np.arange(16, dtype=np.int32).reshape(2, 8)


def run(query_lens, context_lens):
    meta = build_batch(query_lens, context_lens, table, block_size=cfg.block_size,
                       index_topk=cfg.index_topk)
    x = rng.standard_normal((meta.num_tokens, cfg.hidden_size)).astype(np.float32)
    y = stack(x, forward_context=ForwardContext.for_layers(meta, stack.layer_names))
    stats = stack.layers[0].indexer.stats
    print(f"{meta.num_tokens:4d} tokens: scored {stats.scored_calls}, skipped {stats.skipped}, "
          f"dense {stack.layers[0].attention_stats.dense_tokens} tokens")
    stats.reset()
    stack.layers[0].attention_stats.reset()
    return y


run([100, 90], [0, 0])        # long prefill: scored, sparse
run([1, 1], [100, 90])        # decode: scored, sparse
meta_short = [[30, 20], [0, 0]]
table[:] = np.arange(16, 32, dtype=np.int32).reshape(2, 8)   # fresh requests, fresh pages
run(*meta_short)              # short prefill: skipped, dense

mtp = DeepseekV32MLA(cfg, "mtp.0", is_mtp_layer=True, platform=cuda)
mtp.allocate_kv_cache(num_blocks=16, max_num_tokens=256)
mtp_table = np.arange(16, dtype=np.int32).reshape(2, 8)
step0 = build_batch([70, 80], [0, 0], mtp_table, block_size=cfg.block_size,
                    index_topk=cfg.index_topk)


def next_step(step, _):
    meta = build_batch([1, 1], [70 + step - 1, 80 + step - 1], mtp_table,
                       block_size=cfg.block_size, index_topk=cfg.index_topk)
    return (rng.standard_normal((2, cfg.hidden_size)).astype(np.float32),
            ForwardContext.for_layers(meta, ["mtp.0"]))


outs = MTPDrafter(mtp, num_steps=3).run_round(
    rng.standard_normal((150, cfg.hidden_size)).astype(np.float32),
    ForwardContext.for_layers(step0, ["mtp.0"]), next_step)
print("MTP round:", [o.shape for o in outs], "indexer calls:", mtp.indexer.stats.calls)
assert mtp.indexer.stats.calls == 1 and not mtp.skip_topk
