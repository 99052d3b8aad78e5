"""python -m cpsparse.bench runs on the NumPy backend (structure, not speed), drives the
real layer and drafter, and every benchmarks module imports without a GPU."""

import functools
import importlib
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from conftest import patch_numpy_holds
from cpsparse import bench
from cpsparse import mla as mla_module
from cpsparse.mla import DeepseekV32MLA
from cpsparse.mtp import MTPDrafter

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH_MODULES = sorted(f"benchmarks.{p.stem}" for p in (ROOT / "benchmarks").glob("*.py")
                       if p.stem != "__init__")


@pytest.fixture(scope="module")
def spied_run(tmp_path_factory):
    """One NumPy run of every scenario with spies on the layer, the drafter and the
    indexer entry the layer calls."""
    out_dir = tmp_path_factory.mktemp("bench")
    forwards, rounds, names = Counter(), Counter(), Counter()
    real_forward, real_round = DeepseekV32MLA.forward, MTPDrafter.run_round
    entry = bench._indexer_entry()
    real_entry = getattr(mla_module, entry)

    @functools.wraps(real_forward)
    def forward(self, *args, **kwargs):
        forwards[(self.layer_name, self.enable_short_prefill_scoring_skip)] += 1
        return real_forward(self, *args, **kwargs)

    @functools.wraps(real_round)
    def run_round(self, *args, **kwargs):
        rounds[self.num_steps] += 1
        return real_round(self, *args, **kwargs)

    @functools.wraps(real_entry)
    def indexer(*args, **kwargs):
        names[kwargs.get("dense_mha_metadata_layer_name")] += 1
        return real_entry(*args, **kwargs)

    lines = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DeepseekV32MLA, "forward", forward)
        mp.setattr(MTPDrafter, "run_round", run_round)
        mp.setattr(mla_module, entry, indexer)
        results = bench.run("numpy", ["short_prefill", "mtp", "decode_step"], out_dir=out_dir,
                            progress=lines.append)
    saved = json.loads((out_dir / "bench_numpy.json").read_text())
    return dict(results=results, saved=saved, forwards=forwards, rounds=rounds, names=names,
                lines=lines, out_dir=out_dir)


def _spread_ok(row, key):
    lo, hi = row[f"{key}_p10_p90_ms"]
    return 0 < lo <= row[f"{key}_ms"] <= hi


def test_bench_runs_on_numpy(spied_run, capsys):
    saved, results = spied_run["saved"], spied_run["results"]
    assert saved["backend"] == "numpy"
    assert results["scenarios"].keys() == saved["scenarios"].keys()
    assert set(saved["what"]) == set(bench.SCENARIOS) and "p10" in saved["method"]
    rows = saved["scenarios"]["short_prefill"]
    topk = saved["sizes"]["topk"]
    # the skip fires exactly up to index_topk (use_dense_mha) and stops at topk + 1
    assert [r["skip_fired"] for r in rows] == [r["tokens"] <= topk for r in rows]
    assert any(r["tokens"] == topk for r in rows) and any(r["tokens"] == topk + 1 for r in rows)
    assert len(saved["scenarios"]["mtp"]) == len(saved["sizes"]["mtp_batches"]) * len(
        saved["sizes"]["mtp_contexts"])
    for r in saved["scenarios"]["decode_step"]:
        assert r["indexer_ms"] > 0 and r["topk_ms"] > 0 and r["attention_ms"] > 0
        assert r["slots_ms"] > 0 and _spread_ok(r, "eager_step")
        assert r["graph_replay_ms"] is None and "NumPy" in r["graph_note"]
    assert any(line.startswith("short_prefill L=") for line in spied_run["lines"])


def test_bench_prints_tables_and_writes_json_where_told(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cpsparse.bench", "--backend", "numpy",
                           "--scenarios", "short_prefill", "--out", str(tmp_path / "o")],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    saved = json.loads((tmp_path / "o" / "bench_numpy.json").read_text())
    assert list(saved["scenarios"]) == ["short_prefill"]
    assert "short_prefill" in proc.stdout and "results:" in proc.stdout
    assert "cannot fire" in proc.stdout            # the rows past index_topk say so


def test_bench_writes_nothing_into_the_cwd_by_default(tmp_path):
    """Without --out: a new named folder in the temp directory, printed; cwd untouched."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "cpsparse.bench", "--backend", "numpy",
                           "--scenarios", "short_prefill"],
                          cwd=cwd, env=env, capture_output=True, text=True, check=True)
    assert list(cwd.iterdir()) == []
    (out,) = tmp.iterdir()
    assert out.name.startswith("cpsparse-bench-numpy-")
    assert f"output folder: {out}" in proc.stdout
    assert f"results: {out / 'bench_numpy.json'}" in proc.stdout
    saved = json.loads((out / "bench_numpy.json").read_text())
    assert saved["libraries"]["numpy"] == np.__version__
    assert saved["libraries"]["cpsparse"] == bench.cpsparse.__version__
    assert saved["host"]["python"] == platform.python_version()
    assert saved["host"]["cpu_count"] == os.cpu_count()
    if importlib.util.find_spec("matplotlib") is None:
        assert bench.PLOTS_SKIPPED in proc.stdout            # a line, not silence
        assert sorted(p.name for p in out.iterdir()) == ["bench_numpy.json"]
    else:
        assert "plot: " in proc.stdout and (out / "short_prefill.png").is_file()


def test_bench_version_and_plain_help():
    proc = subprocess.run([sys.executable, "-m", "cpsparse.bench", "--version"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == f"cpsparse {bench.cpsparse.__version__}"
    proc = subprocess.run([sys.executable, "-m", "cpsparse.bench", "--help"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert "``" not in proc.stdout and ":class:" not in proc.stdout
    assert "temp directory" in proc.stdout


def test_short_prefill_gate_is_decided_by_layer_construction(spied_run):
    saved = spied_run["saved"]
    s = saved["sizes"]
    calls = s["warmup"] + s["iters"]
    rows = saved["scenarios"]["short_prefill"]
    for r in rows:
        fired = r["tokens"] <= s["topk"]
        assert r["gate_on_skipped"] == (calls if fired else 0)
        assert r["gate_off_skipped"] == 0
        assert r["forwards"] == calls
        assert (r["reduction_pct"] is not None) == fired
        assert ("cannot fire" in r["gate"]) == (not fired)
        for key in ("gate_on", "gate_off", "forward_on", "forward_off"):
            assert _spread_ok(r, key), (key, r)
        # the indexer call is a part of the forward that contains it
        assert r["gate_on_ms"] < r["forward_on_ms"] and r["gate_off_ms"] < r["forward_off_ms"]
    # real forwards of two layers built alike but for the platform: gate on, gate off
    n = len(rows) * calls
    assert spied_run["forwards"][("layers.0.attn", True)] == n
    assert spied_run["forwards"][("layers.0.attn", False)] == n
    # the indexer only obeys: the gate-on layer passes its name, the other one ""
    assert spied_run["names"]["layers.0.attn"] == n


def test_mtp_drives_the_real_drafter(spied_run):
    saved = spied_run["saved"]
    s = saved["sizes"]
    steps, rounds = s["mtp_steps"], s["warmup"] + s["iters"]
    rows = saved["scenarios"]["mtp"]
    for r in rows:
        assert r["steps"] == steps
        assert r["reuse_indexer_calls"] == 1              # step 0 only: steps 1+ reuse
        assert r["recompute_indexer_calls"] == steps      # every step scores again
        for side in ("path_reuse", "path_recompute", "forward_reuse", "forward_recompute"):
            assert _spread_ok(r, side), side
        # the calls probed are inside the forwards of steps 1+, which are inside the round
        assert r["path_reuse_ms"] < r["forward_reuse_ms"] < r["round_reuse_ms"]
        assert r["path_recompute_ms"] < r["forward_recompute_ms"] < r["round_recompute_ms"]
        assert r["path_speedup"] == pytest.approx(r["path_recompute_ms"] / r["path_reuse_ms"])
        assert r["forward_speedup"] == pytest.approx(
            r["forward_recompute_ms"] / r["forward_reuse_ms"])
        for kind in ("path", "forward"):
            spread = max(r[f"{kind}_{m}_p10_p90_ms"][1] - r[f"{kind}_{m}_p10_p90_ms"][0]
                         for m in ("reuse", "recompute"))
            gap = abs(r[f"{kind}_recompute_ms"] - r[f"{kind}_reuse_ms"])
            assert r[f"{kind}_effect_clear"] == (spread < gap)
    cases = len(rows)
    # reuse: one k-step round per timed call; baseline: k one-step rounds per call
    assert spied_run["rounds"] == {steps: cases * rounds, 1: cases * rounds * steps}
    assert spied_run["forwards"][("mtp.0.attn", False)] == 2 * cases * rounds * steps
    # MTP layers never pass a layer name to the indexer (the gate is off by construction)
    short = len(saved["scenarios"]["short_prefill"]) * rounds
    assert spied_run["names"][""] == short + cases * rounds * (1 + steps)


def test_per_round_sums_the_timed_rounds_and_checks_the_count():
    # 2 warm-up rounds then 3 timed ones, 2 intervals a round
    times = [100.0, 100.0, 50.0, 50.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    t = bench._per_round(times, rounds=5, per_round=2, iters=3)
    assert (t["median_ms"], t["iters"]) == (pytest.approx(7.0), 3)      # sums 3, 7, 11
    with pytest.raises(RuntimeError, match="9 intervals in 5 rounds, expected 2 a round"):
        bench._per_round(times[:9], rounds=5, per_round=2, iters=3)


def test_effect_clear_compares_spreads_with_the_gap():
    a = dict(median_ms=1.0, p10_ms=0.9, p90_ms=1.1)
    assert bench._effect_clear(a, dict(median_ms=2.0, p10_ms=1.9, p90_ms=2.5))
    assert not bench._effect_clear(a, dict(median_ms=2.0, p10_ms=1.0, p90_ms=3.1))
    assert not bench._effect_clear(dict(a, p90_ms=2.2), dict(median_ms=2.0, p10_ms=1.9,
                                                              p90_ms=2.1))


def test_decode_step_ops_rotate_consistently():
    s = bench.sizes(np)
    d = bench.DecodeStep(np, np.random.default_rng(3), 2, 300, s, sets=2)
    assert d.inputs == [(0,), (1,)]
    for j in range(2):
        assert np.array_equal(d.scoring(j), d.logits[j])
        assert np.array_equal(d.topk(j), d.rows[j])
        assert np.array_equal(d.slots(j), d.slot_sets[j])
        out, lse = d.step(j)
        want, want_lse = d.attention(j)
        assert np.array_equal(out, want) and np.array_equal(lse, want_lse)
    assert not np.array_equal(d.logits[0], d.logits[1])       # two different input sets


def test_bench_cli_rejects_unknown_scenario(capsys):
    try:
        bench.main(["--backend", "numpy", "--scenarios", "nope"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("unknown scenario accepted")
    assert "unknown scenario" in capsys.readouterr().err


def test_table_shows_spread_beside_median():
    lines = bench.table_lines([{"a": 1.5, "a_p10_p90_ms": [1.25, 2.0], "b": None}],
                              ["a", "a_p10_p90_ms", "b"])
    assert lines[2].split() == ["1.5", "1.25-2", "-"]


@pytest.mark.parametrize("name", BENCH_MODULES)
def test_benchmark_module_imports_without_gpu(name):
    module = importlib.import_module(name)
    assert module.__name__ == name


def test_benchmark_modules_touch_no_device_at_import():
    """With a cupy whose every attribute raises, every benchmarks module still imports."""
    code = ("import importlib, sys, types\n"
            "class NoDevice(types.ModuleType):\n"
            "    def __getattr__(self, attr):\n"
            "        raise AssertionError(f'cupy.{attr} used at import time')\n"
            "sys.modules['cupy'] = NoDevice('cupy')\n"
            f"for name in {BENCH_MODULES!r}:\n"
            "    importlib.import_module(name)\n"
            "print('imported', len(sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "benchmarks.bench_host" in BENCH_MODULES and "benchmarks.harness" in BENCH_MODULES


def test_plots_name_the_device_label_contexts_and_keep_legends_off_the_bars(tmp_path,
                                                                           monkeypatch):
    pytest.importorskip("matplotlib")
    figures = {}
    real_save = bench._save

    def keep(fig, out_dir, name):
        ax = fig.axes[0]
        fig.canvas.draw()
        legend = ax.get_legend()
        figures[name] = dict(
            title=ax.get_title(), ticks=[t.get_text() for t in ax.get_xticklabels()],
            tick_boxes=[(b.x0, b.x1) for b in (t.get_window_extent()
                                               for t in ax.get_xticklabels())],
            legend_x0=legend.get_window_extent().x0 if legend else None,
            bars=len(ax.patches),
            axes_x1=ax.get_window_extent().x1)
        return real_save(fig, out_dir, name)

    monkeypatch.setattr(bench, "_save", keep)
    band = [0.9, 1.1]
    results = {"backend": "cupy", "device": "NVIDIA H200", "scenarios": {
        "short_prefill": [dict(tokens=t, topk=2048, gate_off_ms=1.0, gate_off_p10_p90_ms=band,
                               gate_on_ms=0.1, gate_on_p10_p90_ms=[0.09, 0.11],
                               gate_off_gpu_ms=0.5, gate_off_gpu_p10_p90_ms=[0.4, 0.6],
                               gate_on_gpu_ms=0.0, gate_on_gpu_p10_p90_ms=[0.0, 0.0])
                          for t in (256, 1024)],
        "mtp": [dict(batch=1, context=512, path_speedup=2.1, forward_speedup=1.4,
                     path_gpu_speedup=2.5),
                dict(batch=8, context=32768, path_speedup=2.0, forward_speedup=1.3,
                     path_gpu_speedup=2.4)],
        # the decode-step table's 15 rows (5 batches x 3 contexts, 128K the widest label)
        "decode_step": [dict(batch=b, context=c, projections_ms=0.1, indexer_ms=0.1,
                             topk_ms=0.1, slots_ms=0.01, attention_ms=0.2)
                        for b in (1, 8, 32, 64, 128) for c in (512, 32768, 131072)]}}
    files = bench.plot(results, tmp_path)
    assert sorted(pathlib.Path(f).name for f in files) == sorted(figures)
    assert len(figures) == 3
    for name, fig in figures.items():
        assert "NVIDIA H200" in fig["title"], name
        assert fig["legend_x0"] is not None and fig["legend_x0"] >= fig["axes_x1"], name
    assert figures["mtp_reuse.png"]["ticks"] == ["B=1\n512", "B=8\n32K"]
    # the GPU-time bars where the rows have them (CuPy): 4 and 3 a group
    assert figures["short_prefill.png"]["bars"] == 4 * 2
    assert figures["mtp_reuse.png"]["bars"] == 3 * 2
    assert figures["decode_step.png"]["ticks"][:3] == ["B=1\n512", "B=1\n32K", "B=1\n128K"]
    for name, fig in figures.items():                  # neighbouring labels never overlap
        boxes = fig["tick_boxes"]
        assert all(a[1] < b[0] for a, b in zip(boxes, boxes[1:])), (name, fig["ticks"])
    results.pop("device")
    results["host"] = {"machine": "x86_64"}
    bench.plot(results, tmp_path)
    assert all("NumPy on the CPU" in f["title"] for f in figures.values())


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    """The short-prefill and MTP scenarios on NumPy with their held (GPU time) pass
    switched on: a probe that accepts ``hold_ms`` on NumPy, a hold that costs nothing and
    a floor of 1 us stand in for the GPU's (the plumbing, not the figures)."""
    from cpsparse import timing

    holds = []
    with pytest.MonkeyPatch.context() as mp:
        patch_numpy_holds(mp, holds)
        mp.setattr(timing, "held_floor_ms", lambda xp, *a, **k: 0.001)
        results = bench.run("numpy", ["short_prefill", "mtp"],
                            out_dir=tmp_path_factory.mktemp("held"), progress=lambda m: None)
    return dict(results=results, holds=holds)


def test_held_pass_adds_gpu_time_figures(held_run):
    s = held_run["results"]["sizes"]
    calls, holds = s["warmup"] + s["iters"], held_run["holds"]
    rows = held_run["results"]["scenarios"]["short_prefill"]
    for r in rows:
        for key in ("gate_on_gpu", "gate_off_gpu"):
            assert r[f"{key}_p10_p90_ms"][0] <= r[f"{key}_ms"] <= r[f"{key}_p10_p90_ms"][1]
        assert r["gpu_floor_ms"] == 0.001 and r["gpu_hold_ms"] in holds
        assert isinstance(r["gpu_unheld"], int)
        fired = r["skip_fired"]
        # the counters are the timed pass's: the held pass runs the calls again
        assert r["gate_on_skipped"] == (calls if fired else 0) and r["gate_off_skipped"] == 0
        assert r["forwards"] == calls
        assert (r["gpu_reduction_pct"] is not None) == fired
        if fired:
            assert r["gpu_reduction_pct"] == pytest.approx(
                100 * (1 - r["gate_on_gpu_ms"] / r["gate_off_gpu_ms"]))
    rows = held_run["results"]["scenarios"]["mtp"]
    steps = s["mtp_steps"]
    for r in rows:
        assert r["path_gpu_speedup"] == pytest.approx(
            r["path_gpu_recompute_ms"] / r["path_gpu_reuse_ms"])
        assert r["path_gpu_recompute_ms"] > r["path_gpu_reuse_ms"] > 0
        spread = max(r[f"path_gpu_{m}_p10_p90_ms"][1] - r[f"path_gpu_{m}_p10_p90_ms"][0]
                     for m in ("reuse", "recompute"))
        gap = r["path_gpu_recompute_ms"] - r["path_gpu_reuse_ms"]
        assert r["path_gpu_effect_clear"] == (spread < gap)
        assert r["gpu_floor_ms"] == 0.001 and r["gpu_hold_ms"] in holds
        assert r["recompute_indexer_calls"] == steps        # counted in the timed pass
    # a hold before every held interval: 2 sides a short-prefill row; an MTP row's reuse
    # rounds hold each of steps 1+'s attention call, its recompute rounds each of their
    # indexer step and attention call
    short = held_run["results"]["scenarios"]["short_prefill"]
    assert len(holds) == len(short) * 2 * calls + len(rows) * calls * 3 * (steps - 1)


def test_numpy_rows_have_no_gpu_figures(spied_run):
    saved = spied_run["saved"]
    for r in saved["scenarios"]["short_prefill"]:
        assert r["gate_on_gpu_ms"] is None and r["gpu_reduction_pct"] is None
        assert r["gpu_unheld"] is None
    for r in saved["scenarios"]["mtp"]:
        assert r["path_gpu_speedup"] is None and r["path_gpu_reuse_p10_p90_ms"] is None
