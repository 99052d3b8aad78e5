"""python -m cpsparse.bench runs on the NumPy backend (structure, not speed)."""

import json

from cpsparse import bench


def test_bench_runs_on_numpy(tmp_path, capsys):
    results = bench.run("numpy", ["short_prefill", "mtp", "decode_step"], out_dir=tmp_path)
    saved = json.loads((tmp_path / "bench_numpy.json").read_text())
    assert saved["backend"] == "numpy"
    rows = saved["scenarios"]["short_prefill"]
    topk = saved["sizes"]["topk"]
    # the skip fires exactly up to index_topk (use_dense_mha) and stops at topk + 1
    assert [r["skip_fired"] for r in rows] == [r["tokens"] <= topk for r in rows]
    assert any(r["tokens"] == topk for r in rows) and any(r["tokens"] == topk + 1 for r in rows)
    assert len(saved["scenarios"]["mtp"]) == len(saved["sizes"]["mtp_batches"]) * len(
        saved["sizes"]["mtp_contexts"])
    for r in saved["scenarios"]["decode_step"]:
        assert r["indexer_ms"] > 0 and r["topk_ms"] > 0 and r["attention_ms"] > 0
        assert r["graph_replay_ms"] is None and "NumPy" in r["graph_note"]
    out = capsys.readouterr().out
    assert "short_prefill" in out and "decode_step" in out and "results:" in out
    assert results["scenarios"].keys() == saved["scenarios"].keys()


def test_bench_cli_rejects_unknown_scenario(capsys):
    try:
        bench.main(["--backend", "numpy", "--scenarios", "nope"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("unknown scenario accepted")
    assert "unknown scenario" in capsys.readouterr().err
