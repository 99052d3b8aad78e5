"""``python -m cpsparse`` (cpsparse/demo.py): runs for every --config, refuses bad sizes.

A bad argument is one argparse ``error:`` line with exit code 2, never a
traceback; the sizes of ``--config v32`` on NumPy fit the CPU machine (memory
estimate under a budget, and a real run whose peak RSS stays under it).
"""

import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import pytest

import cpsparse
from cpsparse import demo

ROOT = pathlib.Path(__file__).resolve().parent.parent
GiB = 1 << 30
# The CPU machine the demo must fit: 24 GiB. "Well under": half of it.
V32_NUMPY_BUDGET = 12 * GiB


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _main(capsys, argv):
    """(exit code, stdout, stderr) of demo.main(argv), SystemExit included."""
    try:
        code = demo.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _steps(out):
    return [int(m) for m in re.findall(r"^\[(\d)/4\] ", out, flags=re.M)]


# ---- the small config runs ---------------------------------------------------

def test_small_config_runs_and_prints_ok(capsys):
    code, out, err = _main(capsys, ["--backend", "numpy"])
    assert code == 0, err
    assert out.rstrip().endswith("ok")
    assert _steps(out) == [1, 2, 3, 4]
    assert "Traceback" not in out + err
    # step 2 is a sparse prefill (longer than index_topk) with decodes
    step2 = out.split("[2/4]")[1].split("[3/4]")[0]
    assert "4 decode + 150 prefill tokens" in step2 and "use_dense_mha=False" in step2
    # step 3 takes the skip on both indexer layers
    step3 = out.split("[3/4]")[1].split("[4/4]")[0]
    assert "use_dense_mha=True: 2 indexer call(s) skipped" in step3
    # step 4: the indexer scored once, the draft steps reused
    assert "indexer ran 1 time(s) (step 0), steps 1..2 reused its top-k" in out


def test_default_num_blocks_is_exactly_what_the_run_uses(capsys):
    plan = demo.plan_run("small", "numpy")
    assert plan.num_blocks == plan.pages_needed == max(plan.stack_pages, plan.mtp_pages)
    code, out, err = _main(capsys, ["--backend", "numpy", "--layers", "1", "--decodes", "1"])
    assert code == 0, err
    small = demo.plan_run("small", "numpy", layers=1, decodes=1)
    used = re.search(r"cache pages used: (\d+) by the stack, (\d+) by the MTP layer, of "
                     r"(\d+) per layer", out)
    stack, mtp, per_layer = map(int, used.groups())
    # the pools handed out what the plan counted, and the default is exactly that (no
    # padding): the fuller pool ran out of nothing with no page to spare
    assert (stack, mtp) == (small.stack_pages, small.mtp_pages)
    assert per_layer == max(stack, mtp) == small.pages_needed
    assert f"{per_layer} cache pages per layer (needs {per_layer})" in out


def test_explicit_sizes_override_the_defaults(capsys):
    argv = ["--backend", "numpy", "--layers", "2", "--decodes", "1", "--context", "40",
            "--prefill-len", "65", "--short-len", "64", "--mtp-requests", "1",
            "--mtp-len", "3", "--mtp-steps", "1", "--num-blocks", "40"]
    code, out, err = _main(capsys, argv)
    assert code == 0, err
    assert "2 layers + 1 MTP layer" in out
    assert "1 decode + 65 prefill tokens" in out and "use_dense_mha=False" in out
    assert "short prefill of 64 tokens" in out and "use_dense_mha=True" in out
    assert "MTP round of 1 step(s) over 1 requests" in out and "no draft step" in out
    assert "of 40 per layer" in out
    assert out.rstrip().endswith("ok")


def test_help_works(capsys):
    code, out, _ = _main(capsys, ["--help"])
    assert code == 0
    assert out.startswith("usage: python -m cpsparse")
    for flag in ("--config", "--layers", "--num-blocks", "--mtp-len", "--prefill-len"):
        assert flag in out


# ---- user errors: one line, exit code 2, no traceback --------------------------

BAD_ARGS = [
    (["--layers", "0"], "--layers"),
    (["--layers", "-3"], "--layers"),
    (["--decodes", "0"], "--decodes"),
    (["--context", "-5"], "--context"),
    (["--context", "1"], "--context"),
    (["--prefill-len", "-1"], "--prefill-len"),
    (["--prefill-len", "64"], "index_topk=64"),            # not longer than index_topk
    (["--short-len", "0"], "--short-len"),
    (["--short-len", "65"], "index_topk=64"),              # would not take the skip
    (["--mtp-requests", "0"], "--mtp-requests"),
    (["--mtp-len", "-2"], "--mtp-len"),
    (["--mtp-steps", "0"], "--mtp-steps"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--num-blocks", "64"], "at least 65"),                # names the minimum
    (["--seed", "-1"], "--seed"),
    (["--layers", "two"], "invalid int value"),
    (["--config", "v4"], "invalid choice"),
    (["--config", "v32", "--context", "100000000"], "GiB of host memory"),
]


@pytest.mark.parametrize("argv,needle", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_argument_is_one_error_line(capsys, argv, needle):
    code, out, err = _main(capsys, ["--backend", "numpy"] + argv)
    assert code == 2
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert needle in errors[0]
    assert "Traceback" not in out + err
    assert "[1/4]" not in out          # refused up front: nothing ran


def test_too_small_num_blocks_names_the_minimum(capsys):
    plan = demo.plan_run("v32", "numpy")
    code, _, err = _main(capsys, ["--backend", "numpy", "--config", "v32", "--num-blocks",
                                  str(plan.pages_needed - 1)])
    assert code == 2
    assert f"at least {plan.pages_needed} cache pages per layer" in err
    assert f"got {plan.pages_needed - 1}" in err


@pytest.mark.skipif(cpsparse.gpu_available(), reason="a CUDA device is there")
def test_cupy_without_a_gpu_is_one_error_line(capsys):
    code, out, err = _main(capsys, ["--backend", "cupy"])
    assert code == 2
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--backend cupy needs CuPy and a CUDA device" in errors[0]
    assert "Traceback" not in out + err


def test_entry_point_reports_one_error_line():
    """The real ``python -m cpsparse`` (with __main__) for --layers 0, the old IndexError."""
    done = subprocess.run([sys.executable, "-m", "cpsparse", "--backend", "numpy",
                           "--layers", "0"], capture_output=True, text=True, env=_env(),
                          cwd=ROOT, timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == ["python -m cpsparse: error: argument --layers: expected an int >= 1 "
                      "(the stack needs a layer), got 0"]
    assert "Traceback" not in done.stdout + done.stderr


# ---- v32 sizes on NumPy fit the CPU machine ----------------------------------

def test_v32_numpy_defaults_do_every_step():
    plan = demo.plan_run("v32", "numpy")
    topk = plan.config.index_topk
    demo.check_plan(plan)                                    # valid as they are
    assert plan.config.hidden_size == 7168 and topk == 2048
    assert plan.layers >= 2                                  # one layer shares the index
    assert plan.prefill_len > topk                           # step 2: real sparse prefill
    assert plan.decodes >= 1
    assert 2 <= plan.short_len <= topk                       # step 3 takes the skip
    assert plan.mtp_steps >= 2 and plan.mtp_requests >= 1    # step 4 reuses step 0
    # smaller than the GPU sizes
    gpu = demo.plan_run("v32", "cupy")
    assert plan.layers < gpu.layers and plan.stack_rows < gpu.stack_rows


def test_v32_numpy_defaults_fit_the_memory_budget():
    plan = demo.plan_run("v32", "numpy")
    need = demo.estimate_host_bytes(plan)
    assert need < V32_NUMPY_BUDGET, f"{need / GiB:.1f} GiB"
    # the float32 weights of the layers (without their indexers) are a floor of it
    c = plan.config
    layer = (c.hidden_size * c.q_lora_rank + c.q_lora_rank * c.num_heads * c.qk_head_dim
             + c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
             + c.num_heads * c.v_head_dim * c.hidden_size)
    assert need > 4 * layer * (plan.layers + 1)
    # the GPU sizes would not fit the CPU machine: the estimate sees the difference
    assert demo.estimate_host_bytes(demo.plan_run("v32", "numpy", **demo.default_sizes(
        "v32", "cupy"))) > 24 * GiB


def test_memory_check_refuses_above_the_total_and_warns_above_available():
    plan = demo.plan_run("v32", "numpy")
    need = demo.estimate_host_bytes(plan)
    assert demo.check_memory(plan, total=need, available=need) is None
    assert "warning:" in demo.check_memory(plan, total=need, available=need - 1)
    with pytest.raises(demo.DemoError, match="GiB of host memory"):
        demo.check_memory(plan, total=need - 1, available=need - 1)
    assert demo.check_memory(demo.plan_run("v32", "cupy"), total=1, available=1) is None


def test_estimate_grows_with_every_size():
    base = demo.plan_run("v32", "numpy")
    need = demo.estimate_host_bytes(base)
    for name, value in [("layers", 4), ("decodes", 12), ("context", 2048),
                        ("prefill_len", 4096), ("mtp_requests", 40)]:
        assert demo.estimate_host_bytes(demo.plan_run("v32", "numpy", **{name: value})) > need, name


def _run_measured(argv, timeout):
    """(exit code, stdout, stderr, peak RSS bytes, seconds) of python -m cpsparse argv."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "cpsparse"] + argv, stdout=out,
                                stderr=err, text=True, env=_env(), cwd=ROOT)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise AssertionError(f"python -m cpsparse {' '.join(argv)} ran past {timeout} s")
            time.sleep(0.5)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), usage.ru_maxrss * 1024, seconds


def test_small_entry_point_runs_within_its_estimate():
    code, out, err, peak, _ = _run_measured(["--backend", "numpy"], timeout=300)
    assert code == 0, err
    assert out.rstrip().endswith("ok")
    assert peak < demo.estimate_host_bytes(demo.plan_run("small", "numpy"))


def _full_config_run(config):
    """(plan, stdout, step 2's text, peak RSS, seconds) of a whole NumPy run of a
    full-size config, checked to finish every step cleanly."""
    plan = demo.plan_run(config, "numpy")
    code, out, err, peak, seconds = _run_measured(
        ["--config", config, "--backend", "numpy"], timeout=3600)
    assert code == 0, err
    assert "Traceback" not in out + err
    assert out.rstrip().endswith("ok")
    assert _steps(out) == [1, 2, 3, 4]
    return plan, out, out.split("[2/4]")[1].split("[3/4]")[0], peak, seconds


@pytest.mark.slow
def test_v32_numpy_run_completes_within_its_estimate():
    plan, out, step2, peak, seconds = _full_config_run("v32")
    assert (f"{plan.decodes} decode + {plan.prefill_len} prefill tokens" in step2
            and "use_dense_mha=False" in step2)
    assert "layers.0.attn  indexer: 1 call(s), 1 scored, 0 skipped" in step2
    step3 = out.split("[3/4]")[1].split("[4/4]")[0]
    assert "use_dense_mha=True: 1 indexer call(s) skipped" in step3
    assert "steps 1..2 reused its top-k" in out
    assert peak <= demo.estimate_host_bytes(plan) < V32_NUMPY_BUDGET, (
        f"peak {peak / GiB:.2f} GiB in {seconds:.0f} s")
    print(f"v32 on NumPy: {seconds:.0f} s, peak RSS {peak / GiB:.2f} GiB")


@pytest.mark.gpu
def test_small_config_runs_on_cupy(capsys):
    code, out, err = _main(capsys, ["--backend", "cupy"])
    assert code == 0, err
    assert "backend cupy" in out and out.rstrip().endswith("ok")


def test_glm5_numpy_defaults_show_index_sharing():
    plan = demo.plan_run("glm5", "numpy")
    demo.check_plan(plan)
    c = plan.config
    assert (c.num_heads, c.index_n_heads, c.qk_nope_head_dim, c.v_head_dim) == (64, 32, 192, 256)
    assert c.indexer_rope_interleave
    assert [c.layer_scores(i) for i in range(plan.layers)] == [True, True, True, False]
    assert demo.estimate_host_bytes(plan) < V32_NUMPY_BUDGET


@pytest.mark.slow
def test_glm5_numpy_run_completes_within_its_estimate():
    plan, out, step2, peak, seconds = _full_config_run("glm5")
    assert "layers.2.attn  indexer: 1 call(s), 1 scored, 0 skipped" in step2
    assert "layers.3.attn  indexer: shares the last scoring layer's rows" in step2
    assert peak <= demo.estimate_host_bytes(plan), f"peak {peak / GiB:.2f} GiB"
    print(f"glm5 on NumPy: {seconds:.0f} s, peak RSS {peak / GiB:.2f} GiB")
