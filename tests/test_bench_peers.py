"""benchmarks/bench_peers.py on the CPU: the workload names of DESIGN section 12, the
--only selection, the results rows and their merge, and the cross-checks (NumPy stands in
for CuPy: they use only the array functions both share). No torch, no GPU."""

import json
import subprocess
import sys

import numpy as np

from benchmarks import bench_peers as bp

DESIGN_NAMES = (
    [f"mla_decode_B{b}_sq1_H128" for b in (1, 8, 128)]
    + ["mla_decode_B128_sq2_H128", "mla_decode_B64_sq2_H64",
       "mla_prefill_T4096_H128", "mla_prefill_T4096_H64",
       # issue 19: DeepSeek-V4's MODEL1 cache with a 128-token window
       "mla_model1_decode_B128_H64_topk512_w128", "mla_model1_decode_B128_H64_topk1024_w128",
       "mla_model1_decode_B128_H128_topk512_w128",
       "mla_model1_decode_B128_H128_topk1024_w128",
       "indexer_prefill_T8192_S8192", "indexer_prefill_T2048_S65536",
       "indexer_prefill_T4096_S4096", "indexer_decode_B64_ctx32768_n1",
       "indexer_decode_B64_ctx32768_n2", "indexer_decode_B256_ctx4096_n1",
       "indexer_decode_B4_ctx131072_n1", "indexer_decode_B1_ctx32768_n1"]
    # issue 20: MXFP4 keys against DeepGEMM's fp8 on the same contexts
    + [f"indexer_decode_{w}_mxfp4" for w in ("B64_ctx32768_n1", "B64_ctx32768_n2",
                                             "B4_ctx131072_n1")]
    # FlashMLA's dtypes on cpsparse's side too: bfloat16 in, bfloat16 out
    + [f"mla_decode_{w}_bf16io" for w in ("B1_sq1_H128", "B8_sq1_H128", "B128_sq1_H128",
                                          "B128_sq2_H128", "B64_sq2_H64")]
    + [f"mla_prefill_T4096_H{h}_bf16io" for h in (128, 64)]
    # issue 16: a batch of mixed context lengths (the decode schedule balanced over them)
    + [f"indexer_decode_B64_ctx65536_n{n}_mixed" for n in (1, 2)]
    + [base + suffix for suffix in ("", "_shift100", "_scale1e-8", "_low10bits")
       for base in ("topk_prefill_8192x8192_causal", "topk_decode_64x32768",
                    "topk_decode_64x131072", "topk_decode_4x131072", "topk_decode_1x131072")]
    + [n + e for n in ("decode_step_B1_ctx32768", "decode_step_B8_ctx32768",
                       "decode_step_B64_ctx32768", "decode_step_B128_ctx32768_n2")
       for e in ("", "_eager")])

PEERS = {"mla": "flashmla", "indexer": "deepgemm", "topk": "torch.topk",
         "decode": "vllm-stack"}


def _t(ms):
    return {"median_ms": ms, "p10_ms": ms * 0.9, "p90_ms": ms * 1.1, "iters": 30}


def test_row_names_are_design_section_12():
    assert sorted(bp.row_names()) == sorted(DESIGN_NAMES)
    assert len(set(bp.row_names())) == len(DESIGN_NAMES) == 59
    for w in bp.workloads():
        assert w["peer"] == PEERS[w["name"].split("_")[0]], w
        assert w["kind"] in bp.RUNNERS and w["kind"] in bp.KERNEL_MODULES


def test_only_selects_by_prefix():
    names = lambda prefixes: [w["name"] for w in bp.select(prefixes)]  # noqa: E731
    assert len(names(None)) == 55
    assert names(["mla_decode"]) == DESIGN_NAMES[:5] + [
        n for n in DESIGN_NAMES if n.startswith("mla_decode") and n.endswith("_bf16io")]
    assert names(["indexer_decode_B64_ctx32768_n2"]) == ["indexer_decode_B64_ctx32768_n2",
                                                         "indexer_decode_B64_ctx32768_n2_mxfp4"]
    got = names(["topk_decode_64x32768", "indexer_decode_B1"])
    assert got == ["indexer_decode_B1_ctx32768_n1", "topk_decode_64x32768",
                   "topk_decode_64x32768_shift100", "topk_decode_64x32768_scale1e-8",
                   "topk_decode_64x32768_low10bits"]
    assert names(["decode_step_B8_ctx32768_eager"]) == ["decode_step_B8_ctx32768"]
    assert names(["nothing"]) == []


def test_make_row_schema():
    row = bp.make_row("mla_decode_B1_sq1_H128", "flashmla", {"B": 1}, _t(0.2), _t(0.15),
                      _t(0.05), _t(0.03), err=1e-3, check={"ok": True},
                      notes=[None, "x"], flops=2e9)
    for key in ("workload", "peer", "cpsparse_ms", "cpsparse_kernel_ms", "peer_ms",
                "speedup", "kernel_speedup", "max_rel_err_vs_peer", "cpsparse_p10_ms",
                "cpsparse_p90_ms", "peer_kernel_p90_ms", "shapes"):
        assert key in row, key
    assert abs(row["speedup"] - 0.25) < 1e-12 and abs(row["kernel_speedup"] - 0.2) < 1e-12
    assert row["notes"] == ["x"]
    assert abs(row["cpsparse_kernel_tflops"] - 2e9 / 0.15e-3 / 1e12) < 1e-9
    moved = bp.make_row("indexer_decode_B1_ctx32768_n1", "deepgemm", {}, _t(2.0), _t(1.0),
                        _t(2.0), _t(0.5), nbytes=4e9)            # 4 GB in 1 ms: 4 TB/s
    assert abs(moved["cpsparse_kernel_tbs"] - 4.0) < 1e-12
    assert abs(moved["peer_kernel_tbs"] - 8.0) < 1e-12
    bare = bp.make_row("topk_decode_1x131072", "torch.topk", {}, _t(0.05), None,
                       peer_unavailable="no torch")
    assert bare["peer_ms"] is None and bare["speedup"] is None
    assert bare["kernel_speedup"] is None and bare["peer_unavailable"] == "no torch"


def test_merge_keeps_other_workloads_of_the_same_device():
    old = {"device": "H200", "rows": [bp.make_row(n, "x", {}) for n in
                                      ("decode_step_B1_ctx32768", "mla_decode_B1_sq1_H128")]}
    new = {"device": "H200", "date": "d", "command": "c",
           "rows": [bp.make_row("topk_decode_64x32768", "torch.topk", {}),
                    bp.make_row("mla_decode_B1_sq1_H128", "flashmla", {}, _t(1.0))]}
    out = bp.merge_payload(old, new)
    assert [r["workload"] for r in out["rows"]] == [
        "mla_decode_B1_sq1_H128", "topk_decode_64x32768", "decode_step_B1_ctx32768"]
    assert out["rows"][0]["cpsparse_ms"] == 1.0 and out["runs"][-1]["command"] == "c"
    other = bp.merge_payload(dict(old, device="B200"), new)
    assert len(other["rows"]) == 2


def test_topk_check_allows_ties_and_catches_errors():
    rng = np.random.default_rng(0)
    logits = np.floor(rng.random((3, 64)) * 8).astype(np.float32)        # many ties
    lens = np.array([64, 64, 64], np.int32)
    k = 8
    peer = -np.sort(-logits, axis=1)[:, :k]
    ours = np.argsort(-logits, axis=1, kind="stable")[:, ::1][:, :k].astype(np.int32)
    err, check = bp._topk_check(np, logits, lens, ours, peer)
    assert err == 0.0 and check["ok"], check
    bad = ours.copy()
    bad[1, 0] = np.argmin(logits[1])
    err, check = bp._topk_check(np, logits, lens, bad, peer)
    assert check["rows_value_mismatch"] == 1 and not check["ok"]
    dup = ours.copy()
    dup[2, 1] = dup[2, 0]
    assert bp._topk_check(np, logits, lens, dup, peer)[1]["rows_duplicate"] == 1
    # a short causal row: 0..len-1 then -1; the peer's top-k holds -inf past the window
    short = np.where(np.arange(64)[None, :] < 3, logits[:1], -np.inf).astype(np.float32)
    mine = np.array([[0, 1, 2] + [-1] * (k - 3)], np.int32)
    err, check = bp._topk_check(np, short, np.array([3], np.int32), mine,
                                -np.sort(-short, axis=1)[:, :k])
    assert check["ok"], check
    poisoned = mine.copy()
    poisoned[0, 5] = 1 << 30
    assert not bp._topk_check(np, short, np.array([3], np.int32), poisoned,
                              -np.sort(-short, axis=1)[:, :k])[1]["ok"]
    # one past the window (position len) is outside it, though within the row's width
    past = np.array([[0, 1, 3] + [-1] * (k - 3)], np.int32)
    check = bp._topk_check(np, short, np.array([3], np.int32), past,
                           -np.sort(-short, axis=1)[:, :k])[1]
    assert check["rows_out_of_window"] == 1 and not check["ok"]


def test_logits_check_prefill_and_decode():
    x = np.arange(12, dtype=np.float32).reshape(3, 4) + 1
    ours = np.where(np.tril(np.ones((3, 4), bool)), x, -np.inf).astype(np.float32)
    err, check = bp._logits_check(np, ours, ours.copy())
    assert err == 0.0 and check["ok"]
    other = ours.copy()
    other[0, 0] += 1
    err, check = bp._logits_check(np, ours, other)
    assert err > 0 and check["unequal_entries"] == 1 and not check["ok"]
    garbage = np.where(np.isinf(ours), 7.0, ours).astype(np.float32)   # clean_logits=False
    visible = np.tril(np.ones((3, 4), bool))
    assert bp._logits_check(np, ours, garbage, visible)[1]["ok"]
    leak = ours.copy()
    leak[0, 3] = 1.0                                   # cpsparse wrote past the window
    assert bp._logits_check(np, leak, garbage, visible)[1]["mask_mismatches"] == 1
    nan = ours.copy()
    nan[2, 1] = np.nan                # a NaN logit: no finite difference to see, still bad
    err, check = bp._logits_check(np, nan, ours, visible)
    assert check["nan_ours"] == 1 and not check["ok"]
    # cpsparse with clean_logits=False too: only the windows are compared
    unwritten = np.where(visible, ours, np.nan).astype(np.float32)
    assert bp._logits_check(np, unwritten, garbage, visible, ours_clean=False)[1]["ok"]
    assert not bp._logits_check(np, unwritten, garbage, visible)[1]["ok"]
    bad = unwritten.copy()
    bad[2, 1] = np.nan                                 # inside a window: still caught
    check = bp._logits_check(np, bad, garbage, visible, ours_clean=False)[1]
    assert check["nan_ours"] == 1 and not check["ok"]
    bad = unwritten.copy()
    bad[1, 0] = -np.inf                                # a -inf inside a window
    check = bp._logits_check(np, bad, garbage, visible, ours_clean=False)[1]
    assert check["mask_mismatches"] == 1 and not check["ok"]


def test_relative_error_compares_where_both_sides_are_finite():
    """_rel: max |ours - theirs| / max |theirs| over the entries both sides hold finite
    (a peer's -inf outside a window is not a difference); 0 for empty arrays."""
    ours = np.array([1.0, 2.0, 5.0], np.float32)
    theirs = np.array([1.0, 2.5, np.inf], np.float32)
    assert bp._rel(np, ours, theirs) == 0.5 / 2.5
    assert bp._rel(np, ours[:0], theirs[:0]) == 0.0


def test_mla_check():
    out = np.ones((2, 3, 4), np.float32)
    lse = np.full((2, 3), 2.0, np.float32)
    err, check = bp._mla_check(np, out, lse, out * (1 + 1e-3), lse)
    assert abs(err - 1e-3 / (1 + 1e-3)) < 1e-6 and check["ok"]
    nan = out.copy()
    nan[0, 0, 0] = np.nan
    assert bp._mla_check(np, nan, lse, out, lse)[1]["nonfinite_ours"] == 1
    off = lse.copy()
    off[1, 2] += 0.1                     # lse off by 0.1 (a 10% weight error in a merge)
    err, check = bp._mla_check(np, out, off, out, lse)
    assert check["lse_max_abs_err"] > 0.09 and not check["ok"]


def test_compare_runs_pairs_workloads_of_two_runs(tmp_path, capsys):
    """--compare BASE NEW (gpu_check.sh's ab step): the workloads both runs hold, the
    kernel medians' ratio (> 1: NEW faster) and each run's speedup over its own peer."""
    def payload(rows):
        return {"rows": [bp.make_row(n, "deepgemm", {}, None, {"median_ms": ms, "p10_ms": ms,
                                                               "p90_ms": ms, "iters": 3},
                                     None, {"median_ms": peer, "p10_ms": peer,
                                            "p90_ms": peer, "iters": 3})
                         for n, ms, peer in rows]}
    base = payload([("a", 2.0, 1.0), ("b", 1.0, 1.0), ("only_base", 1.0, 1.0)])
    new = payload([("b", 0.5, 1.2), ("a", 4.0, 1.0), ("only_new", 1.0, 1.0)])
    rows = {r["workload"]: r for r in bp.compare_runs(base, new)}
    assert sorted(rows) == ["a", "b"]
    assert rows["a"]["speedup"] == 0.5 and rows["b"]["speedup"] == 2.0
    assert (rows["b"]["base_vs_peer"], rows["b"]["new_vs_peer"]) == (1.0, 2.4)
    files = []
    for name, p in (("base", base), ("new", new)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(p))
    assert bp.main(["--compare"] + [str(f) for f in files]) == 0
    out = capsys.readouterr().out
    assert "only_base" not in out and "new_vs_peer" in out and "2.4" in out


def test_list_runs_without_torch_or_cupy():
    code = ("import sys\nfrom benchmarks import bench_peers\n"
            "assert bench_peers.main(['--list', '--only', 'decode_step']) == 0\n"
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=bp.harness.ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["decode_step_B1_ctx32768", "decode_step_B8_ctx32768",
                                   "decode_step_B64_ctx32768", "decode_step_B128_ctx32768_n2"]


class _OrderSession:
    """The parts of bench_peers.Session that _side_by_side uses, recording the order."""

    def __init__(self, peer_first, rounds=1):
        self.peer_first, self.log, self.cp, self.why = peer_first, [], np, {}
        self.rounds, self._n = rounds, 0

    def peer(self, name):
        return object()

    def time(self, fn, inputs, reps, torch_clock=False):
        self.log.append("time peer" if torch_clock else "time cpsparse")
        self._n += 1               # later rounds read slower: the pooled figure is a median
        return _t((2.0 if torch_clock else 1.0) * self._n), _t(1.0 * self._n), None

    def sync(self):
        pass


def _order_run(peer_first, rounds=1, compare_fails=False):
    s = _OrderSession(peer_first, rounds)

    def call(x):
        s.log.append("call cpsparse")
        return x

    def make_peer(_mod):
        s.log.append("make peer")

        def pcall(x):
            s.log.append("call peer")
            return x
        def compare(ours, theirs):
            if compare_fails:
                raise ValueError("outputs differ")
            return 0.0, {"ok": True}
        return pcall, [(np.ones(3),)], compare
    got = bp._side_by_side(s, call, [(np.ones(3),)], 4, lambda: s.log.append("poison"),
                           ["deep_gemm"], make_peer)
    return s.log, got


def test_peer_first_times_the_peer_before_cpsparse_and_still_cross_checks():
    log, got = _order_run(False)
    assert log == ["time cpsparse", "poison", "call cpsparse", "make peer", "call peer",
                   "time peer"]
    log2, got2 = _order_run(True)
    assert log2 == ["make peer", "time peer", "time cpsparse", "poison", "call cpsparse",
                    "call peer"]
    for g in (got, got2):
        assert g["check"] == {"ok": True} and g["err"] == 0.0
    assert got["ours"]["median_ms"] == 1.0 and got["theirs"]["median_ms"] == 4.0
    assert got2["theirs"]["median_ms"] == 2.0 and got2["ours"]["median_ms"] == 2.0
    assert got["notes"] == [] or all(n is None for n in got["notes"])


def test_rounds_alternate_the_order_and_pool_each_side():
    log, got = _order_run(False, rounds=2)
    assert log == ["make peer", "time cpsparse", "time peer", "time peer", "time cpsparse",
                   "poison", "call cpsparse", "call peer"]
    # cpsparse timed 1st and 4th (1.0, 4.0), the peer 2nd and 3rd (2 x 2.0, 2 x 3.0)
    assert got["ours"]["median_ms"] == 2.5 and got["theirs"]["median_ms"] == 5.0
    assert got["ours"]["p10_ms"] == 0.9 and got["ours"]["p90_ms"] == 4.0 * 1.1
    assert got["ours"]["iters"] == 60 and got["ours_kernel"]["median_ms"] == 2.5
    assert any("2 rounds" in n and "[1.0, 4.0]" in n and "[2.0, 3.0]" in n
               for n in got["notes"] if n)
    log3, _ = _order_run(True, rounds=3)
    assert [x for x in log3 if x.startswith("time")] == [
        "time peer", "time cpsparse", "time cpsparse", "time peer", "time peer",
        "time cpsparse"]


def test_a_peer_failing_its_cross_check_reports_no_time_in_any_order():
    for peer_first, rounds in ((False, 1), (True, 1), (False, 2), (True, 3)):
        _, got = _order_run(peer_first, rounds, compare_fails=True)
        assert got["theirs"] is None and got["theirs_kernel"] is None, (peer_first, rounds)
        assert got["ours"] is not None and got["check"] is None
        assert any(n and "outputs differ" in n for n in got["notes"])


def test_rounds_note_names_the_side_timed_first_in_each_round():
    _, got = _order_run(True, rounds=3)
    note = next(n for n in got["notes"] if n and "rounds" in n)
    assert "timed first by round: peer, cpsparse, peer" in note, note
    _, got = _order_run(False, rounds=2)
    note = next(n for n in got["notes"] if n and "rounds" in n)
    assert "timed first by round: cpsparse, peer" in note, note


def test_mixed_decode_lens_are_one_fixed_batch_within_the_width():
    """The mixed workloads' lengths: the same batch every run (seeded), every request's
    longest row within [next_n, ctx], its rows one position apart, and mixed indeed."""
    a = bp._mixed_decode_lens(np, 64, 65536, 2)
    assert a.shape == (64, 2) and a.dtype == np.int32
    assert np.array_equal(a, bp._mixed_decode_lens(np, 64, 65536, 2))
    assert (a[:, 1] - a[:, 0] == 1).all() and a.min() >= 1 and a.max() <= 65536
    assert a[:, 1].max() > 4 * a[:, 1].min()


def test_bf16io_rows_hand_cpsparse_bfloat16_and_ask_for_a_bfloat16_out():
    """The _bf16io workloads give cpsparse the same values as bfloat16 arrays (indices
    untouched) and ask for a bfloat16 out; the plain ones pass float16 sets as they are."""
    import ml_dtypes

    class S:
        cp = np
    sets = [(np.array([[1.5, -2.0]], np.float16), np.array([[3, -1]], np.int32))]
    names = {w["name"]: w for w in bp.workloads()}
    for name in ("mla_decode_B1_sq1_H128_bf16io", "mla_prefill_T4096_H64_bf16io"):
        got, out_dtype, out_bytes, note = bp._io(S, names[name], sets)
        assert (out_dtype, out_bytes) == ("bfloat16", 2) and "bfloat16" in note, name
        assert got[0][0].dtype == ml_dtypes.bfloat16 and got[0][1] is sets[0][1]
        assert (got[0][0].astype(np.float32) == sets[0][0].astype(np.float32)).all()
    got, out_dtype, out_bytes, _ = bp._io(S, names["mla_decode_B1_sq1_H128"], sets)
    assert got is sets and (out_dtype, out_bytes) == (None, 4)
