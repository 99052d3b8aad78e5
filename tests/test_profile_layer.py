"""The layer-forward profile probes the stages each route really calls (NumPy, small sizes)."""

import numpy as np
import pytest

from benchmarks import profile_layer as P
from conftest import patch_numpy_holds
from cpsparse.bench import sizes


@pytest.fixture(scope="module")
def profiled():
    s = sizes(np)
    out = {}
    for name, forward, inputs, setup in P.cases(np, s, np.random.default_rng(0)):
        if "B=4" in name:
            continue
        if setup is not None:
            setup()
        out[name] = P.stage_times(np, forward, inputs, warmup=1, iters=2)
    return out


def _case(profiled, part):
    (name,) = [n for n in profiled if part in n]
    return profiled[name]


def test_scoring_decode_calls_every_indexer_stage_once(profiled):
    t = _case(profiled, "scoring")
    assert {k: v["calls"] for k, v in t["stages"].items()} == {
        "project": 1, "mla_cache_insert": 1, "indexer_queries_keys": 1,
        "indexer_cache_insert": 1, "indexer_call": 1, "sparse_attention": 1, "output": 1}


def test_reusing_decode_calls_no_indexer_stage(profiled):
    t = _case(profiled, "reusing")
    assert sorted(t["stages"]) == ["mla_cache_insert", "output", "project", "sparse_attention"]


def test_prefill_routes(profiled):
    fires = _case(profiled, "(gate fires)")["stages"]
    cannot = _case(profiled, "(gate cannot fire)")["stages"]
    assert "dense_attention" in fires and "sparse_attention" not in fires
    assert "sparse_attention" in cannot and "dense_attention" not in cannot
    assert fires["indexer_call"]["calls"] == cannot["indexer_call"]["calls"] == 1


def test_report_lists_every_stage_and_the_rest(profiled):
    t = _case(profiled, "scoring")
    lines = P.report("case", t, 100.0)
    assert lines[0].startswith("==== case: forward ") and "100 Python calls" in lines[0]
    assert [ln.split()[0] for ln in lines[1:-1]] == list(t["stages"])
    assert lines[-1].lstrip().startswith("rest of the forward")


def test_host_profile_counts_python_calls():
    def forward(x):
        return sum(abs(v) for v in x)
    calls, text = P.host_profile(forward, [([1, -2],)], np, calls=4)
    assert calls >= 3 and "ncalls" in text


def test_gpu_busy_spans_where_the_backend_has_a_gpu(monkeypatch):
    """On CuPy every stage gets its held (GPU-only) time too, and the report shows it: the
    plumbing on NumPy, with a probe that accepts hold_ms there and a hold that costs
    nothing."""
    holds = []
    patch_numpy_holds(monkeypatch, holds)
    s = sizes(np)
    (name, forward, inputs, setup), = [c for c in P.cases(np, s, np.random.default_rng(0))
                                       if c[0].startswith("decode B=1") and "scoring" in c[0]]
    if setup is not None:
        setup()
    t = P.stage_times(np, forward, inputs, warmup=1, iters=2, floor_ms=0.0)
    assert len(t["stages"]) == 7
    for st in t["stages"].values():
        assert st["gpu_ms"] >= 0 and isinstance(st["gpu_unheld"], int)
    assert t["forward_gpu"]["iters"] == 2
    # a hold before each held interval: every stage's calls of 2 forwards, and 2 forwards
    assert len(holds) == 2 * sum(st["calls"] for st in t["stages"].values()) + 2
    lines = P.report(name, t)
    assert "GPU busy span of the forward" in lines[1]
    assert all(" GPU " in ln for ln in lines[2:-1])
