"""DCP on the GPU: the simulated ranks over CuPy arrays (the kernels), a one-rank NCCL
communicator, and real ranks (one process per GPU) when the machine has several GPUs.
NCCL_NVLS_ENABLE stays 0 (the lent machines grant no NVLink multicast)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cpsparse import parallel as P
from test_dcp_layer import check_dcp_steps, run_dcp, run_one_rank, steps
from test_parallel import check_decode_step, decode_step_case, pcp_layer_case

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent


def _nccl_or_skip():
    from cupy.cuda import nccl
    if not getattr(nccl, "available", False):
        pytest.skip("NCCL is not available to CuPy")


@pytest.mark.parametrize("world,interleave,next_n", [(2, 1, 1), (2, 4, 2)])
def test_dcp_layer_on_the_gpu(world, interleave, next_n):
    """The MLA layer's DCP decode steps on CuPy (the kernels: paged scoring per token
    row, top-k, sparse attention) against one CuPy layer holding every key; outputs
    at twice FlashMLA's tolerances (P rounds to bf16 against each rank's row max)."""
    import cupy
    from cpsparse.mla import init_weights
    from test_dcp_layer import CFG
    weights = init_weights(CFG, 3)
    plan = steps(next_n)
    want = run_one_rank(plan, next_n, weights, xp=cupy)
    check_dcp_steps(want, run_dcp(plan, next_n, weights, world, interleave, xp=cupy),
                    rtol=4.02 / 128, atol=2e-3)


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (4, 2)])
def test_simulated_ranks_on_the_gpu(world, interleave):
    import cupy
    check_decode_step(cupy, *decode_step_case(cupy, world, interleave))


def test_one_rank_nccl_group():
    import cupy
    _nccl_or_skip()
    group = P.NcclGroup(1, 0, P.NcclGroup.unique_id())
    x = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)
    got = group.all_gather(x)
    assert got.shape == (1, 2, 3) and (got[0] == x).all()
    check_decode_step(cupy, *decode_step_case(cupy, 1, 1, group=group))


@pytest.mark.parametrize("interleave", [1, 2])
def test_real_ranks_over_nccl(tmp_path, interleave):
    import cupy
    _nccl_or_skip()
    world = cupy.cuda.runtime.getDeviceCount()
    if world < 2:
        pytest.skip(f"needs 2 GPUs or more, this machine has {world}")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    id_file = str(tmp_path / "nccl_id")
    procs = [subprocess.Popen([sys.executable, str(HERE / "gpu_dcp_worker.py"), str(world),
                               str(r), str(interleave), id_file], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    outs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} of {world}:\n{out[-3000:]}"
    assert np.all([p.returncode == 0 for p in procs])


def test_pcp_all_gather_on_the_gpu():
    import cupy
    total = 37
    x = cupy.random.standard_normal((total, 5), dtype=cupy.float32)

    def rank(g):
        pos = cupy.arange(g.rank, total, g.world)
        return P.pcp_all_gather(g, x[pos], pos, total)
    for got in P.ThreadGroup.run(3, rank):
        assert bool((got == x).all())


@pytest.mark.parametrize("world", [1, 3])
def test_pcp_layer_on_the_gpu(world):
    """The PCP layer on CuPy (the kernels) against one rank on CuPy."""
    import cupy
    metas, want, ranks = pcp_layer_case(world, [([50, 30], [0, 0]), ([40, 60], [50, 30])],
                                        xp=cupy)
    for got in ranks:
        own, y, rows, _ = got[1]
        assert np.array_equal(rows, want[1][1][own])
        np.testing.assert_allclose(y, want[1][0][own], rtol=1e-3,
                                   atol=1e-4 * np.abs(want[1][0]).max())
