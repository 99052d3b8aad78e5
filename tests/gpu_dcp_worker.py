"""One rank of the NCCL DCP test (tests/test_gpu_parallel.py): one process per GPU.

``python gpu_dcp_worker.py WORLD RANK INTERLEAVE ID_FILE``: rank 0 writes the NCCL
unique id to ID_FILE, the others wait for it; every rank runs the decode step of
tests/test_parallel.py and the MLA layer's DCP decode steps of tests/test_dcp_layer.py
over NCCL and exits 0 when its rows and merged attention match the unsharded ops.
"""

import os
import pickle
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupy  # noqa: E402

from cpsparse import parallel as P  # noqa: E402
from cpsparse.mla import init_weights  # noqa: E402
from test_dcp_layer import CFG, check_dcp_steps, dcp_layer_rank, run_one_rank, steps  # noqa: E402
from test_parallel import check_decode_step, decode_step_case  # noqa: E402


def main(world, rank, interleave, id_file):
    cupy.cuda.Device(rank).use()
    if rank == 0:
        uid = P.NcclGroup.unique_id()
        with open(id_file + ".tmp", "wb") as f:
            pickle.dump(uid, f)
        os.replace(id_file + ".tmp", id_file)
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(id_file):
            if time.monotonic() > deadline:
                raise TimeoutError("no NCCL id from rank 0")
            time.sleep(0.05)
        with open(id_file, "rb") as f:
            uid = pickle.load(f)
    group = P.NcclGroup(world, rank, uid)
    check_decode_step(cupy, *decode_step_case(cupy, world, interleave, group=group))
    # The MLA layer's DCP decode steps over NCCL against one layer on this GPU.
    weights = init_weights(CFG, 3)
    plan = steps(2)
    want = run_one_rank(plan, 2, weights, xp=cupy)
    check_dcp_steps(want, [dcp_layer_rank(plan, 2, weights, group, interleave, xp=cupy)],
                    rtol=4.02 / 128, atol=2e-3)


if __name__ == "__main__":
    w, r, i, path = sys.argv[1:5]
    main(int(w), int(r), int(i), path)
