"""GPU, production mode: no index value ever faults the device.

Every op that dereferences an index runs with device value checks off, eagerly
and inside a captured CUDA graph (where no host check can run), with each bad
value planted in its index arrays (int32 and int64): -2**31, -123456, -2, the
bound itself (num_slots / num_blocks / num_reqs), 2**31 - 1, 2**32 (int64 only),
a position or context past the block table, and a page id whose slot wraps
int32. Out of range reads as masked and writes nothing; the results must equal
the NumPy reference, which bounds the same way.

Each (op, value) runs in its own process (tests/gpu_bad_index_worker.py): an
illegal address kills the CUDA context, and with it every later test of a
shared process, so a fault could otherwise hide behind the first one.
"""

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_bad_index_worker as worker  # noqa: E402

CASES = [(op, v) for op in worker.CASES
         for v in worker.VALUES + worker.EXTRA_VALUES.get(op, ())]


@pytest.fixture(scope="module")
def results():
    import cpsparse
    cpsparse.precompile()          # fill CuPy's kernel cache once, before the workers
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))

    def run(case):
        proc = subprocess.run([sys.executable, str(HERE / "gpu_bad_index_worker.py"), *case],
                              capture_output=True, text=True, env=env, timeout=300)
        return case, proc

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return dict(pool.map(run, CASES))


@pytest.mark.parametrize("op,value", CASES, ids=[f"{o}-{v}" for o, v in CASES])
def test_bad_index_is_masked_never_faults(results, op, value):
    proc = results[(op, value)]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode in (0, 1) and lines, (
        f"{op} with index {value} crashed the process (exit {proc.returncode}):\n"
        f"{proc.stderr[-3000:]}")
    report = json.loads(lines[-1])
    if report.get("skipped"):
        pytest.skip(f"{value} does not apply to {op}")
    bad = [c for c in report["checks"] if not c["ok"]]
    assert report["checks"] and not bad, f"{op} with index {value}: mismatches {bad}\n" \
                                         f"{proc.stderr[-2000:]}"
