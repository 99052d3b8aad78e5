"""How the warp-specialized decode kernels' CTAs share a batch: a model (no device).

``indexer.cu``'s ``cps_wsd_share`` gives each persistent CTA an equal share of the
batch's weight, where a stage (256 keys of an output row) holding keys weighs
``WSD_KEY_WEIGHT`` and one past every row's context 1. :func:`shares` finds the cuts as
the kernel does. :func:`busiest` models a CTA's cost as its key stages, one more for each
item that has keys (a query block and page ids to load), and its fill-only stages / 16.
It compares the shares with the round-robin pieces the kernels used before (cut for
``max_context_len``).

Run from the repository root::

    python3 -m benchmarks.model_wsd_shares

It prints a table of the busiest and the mean CTA cost on uniform and mixed batches
(132 SMs). It is a cost model, not a measurement: ``benchmarks.bench_peers``'s
``indexer_decode_*_mixed`` rows time the kernels.
"""

import numpy as np

KEYS = 256                      # a stage: 4 pages of 64 keys (CPS_IDX_WS_KEYS)
ITEM_STAGES = 64                # an item's most stages (BT_CAP pages)


def shares(row_lens, width, ctas, key_weight):
    """Stage positions where each CTA's share starts (``ctas + 1`` cuts, the last
    ``batch * U``), found from the requests' weights as ``cps_wsd_share`` finds them.

    ``row_lens``: each request's longest row (clamped to [0, width] as the kernel clamps
    it).
    """
    stages_w = -(-width // KEYS)
    nk = -(-np.clip(np.asarray(row_lens, np.int64), 0, width) // KEYS)
    weight = stages_w + (key_weight - 1) * nk
    before = np.concatenate([[0], np.cumsum(weight)])
    cuts = []
    for c in range(ctas + 1):
        x = c * int(before[-1]) // ctas
        if x == 0:
            cuts.append(0)
            continue
        b = int(np.searchsorted(before, x, side="left")) - 1   # before[b] < x <= before[b+1]
        r = x - int(before[b])
        kw = key_weight * int(nk[b])
        s = -(-r // key_weight) if r <= kw else int(nk[b]) + r - kw
        cuts.append(b * stages_w + s)
    return np.asarray(cuts)


def _item_cost(key_stages, s0, s1):
    k = max(0, min(s1, key_stages) - s0)
    return k + (1 if k else 0) + (s1 - s0 - k) / 16


def round_robin_plan(batch, width, sms):
    """(piece stages, pieces a request) of the round-robin schedule before the shares:
    the piece length that minimized the busiest CTA's stages plus one a piece."""
    stages_w = -(-width // KEYS)
    best = None
    for p in range(-(-stages_w // ITEM_STAGES), stages_w + 1):
        ps = -(-stages_w // p)
        pieces = -(-stages_w // ps)
        items = batch * pieces
        cost = -(-items // min(items, sms)) * (ps + 1)
        if best is None or cost < best[0]:
            best = (cost, ps, pieces)
    return best[1], best[2]


def busiest(row_lens, width, sms=132, key_weight=16, round_robin=False):
    """(busiest, mean) modelled CTA cost of a batch."""
    lens = np.asarray(row_lens, np.int64)
    stages_w = -(-width // KEYS)
    nk = -(-np.clip(lens, 0, width) // KEYS)
    batch = len(lens)
    if round_robin:
        ps, pieces = round_robin_plan(batch, width, sms)
        grid = min(batch * pieces, sms)
        cost = np.zeros(grid)
        for i in range(batch * pieces):
            b, p = divmod(i, pieces)
            cost[i % grid] += _item_cost(nk[b], p * ps, min(stages_w, p * ps + ps))
        return cost.max(), cost.mean()
    grid = min(sms, batch * stages_w)
    cuts = shares(lens, width, grid, key_weight)
    cost = np.zeros(grid)
    for c in range(grid):
        p = cuts[c]
        while p < cuts[c + 1]:
            b, s0 = divmod(int(p), stages_w)
            s1 = min(stages_w, s0 + ITEM_STAGES, int(cuts[c + 1]) - b * stages_w)
            cost[c] += _item_cost(nk[b], s0, s1)
            p += s1 - s0
    return cost.max(), cost.mean()


def batches(seed=0):
    """The model's batches: name -> (each request's longest row, width)."""
    rng = np.random.default_rng(seed)
    return {
        "B64 x 32K uniform": ([32768] * 64, 32768), "B4 x 128K": ([131072] * 4, 131072),
        "B256 x 4K": ([4096] * 256, 4096), "B1 x 32K": ([32768], 32768),
        "B128 x 32K": ([32768] * 128, 32768),
        "B64 lens U(1, 32K)": (rng.integers(1, 32769, 64), 32768),
        "B64 lens U(1, 128K)": (rng.integers(1, 131073, 64), 131072),
        "B256 lens U(1, 32K)": (rng.integers(1, 32769, 256), 32768),
        "B32: 1 x 128K + 31 x U(1, 4K)":
            (np.concatenate([[131072], rng.integers(1, 4097, 31)]), 131072),
        "B16 lens U(1, 64K)": (rng.integers(1, 65537, 16), 65536),
    }


def table(sms=132):
    lines = ["| batch | round robin: busiest / mean | shares: busiest / mean | busiest ratio |",
             "| --- | --- | --- | --- |"]
    for name, (lens, width) in batches().items():
        ob, om = busiest(lens, width, sms, round_robin=True)
        nb, nm = busiest(lens, width, sms)
        lines.append(f"| {name} | {ob:.1f} / {om:.1f} | {nb:.1f} / {nm:.1f} | {ob / nb:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
