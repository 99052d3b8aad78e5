"""Backend dispatch: NumPy in -> NumPy out; import works without a usable CuPy."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cpsparse

PROBE = textwrap.dedent("""
    import numpy as np, cpsparse
    print("gpu", cpsparse.gpu_available())
    codes, scales = cpsparse.quantize_fp8(np.ones((1, 128), np.float32))
    print("type", type(codes).__module__)
""")


def _run_with_fake_cupy(tmp_path, cupy_source):
    pkg = tmp_path / "cupy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(cupy_source))
    env_path = f"{tmp_path}"
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_with_cupy_that_fails_to_import(tmp_path):
    out = _run_with_fake_cupy(tmp_path, "raise ImportError('libcudart.so.12: not found')")
    assert "gpu False" in out and "type numpy" in out


def test_import_with_cupy_but_no_device(tmp_path):
    fake = """
        class ndarray: pass
        class _Runtime:
            @staticmethod
            def getDeviceCount():
                raise RuntimeError('cudaErrorNoDevice: no CUDA-capable device is detected')
        class cuda:
            runtime = _Runtime
    """
    out = _run_with_fake_cupy(tmp_path, fake)
    assert "gpu False" in out and "type numpy" in out


def test_numpy_in_numpy_out():
    logits = np.random.default_rng(0).standard_normal((3, 10)).astype(np.float32)
    starts = np.zeros(3, np.int32)
    ends = np.full(3, 10, np.int32)
    idx = cpsparse.topk_per_row(logits, starts, ends, 4)
    assert type(idx) is np.ndarray and idx.dtype == np.int32


def test_get_array_module_names_arguments():
    assert cpsparse.get_array_module(a=np.zeros(1), b=None) is np
    with pytest.raises(TypeError, match="Invalid type of weights"):
        cpsparse.get_array_module(q=np.zeros(1), weights=[1.0])


@pytest.mark.gpu
def test_mixed_backends_refused():
    import cupy
    with pytest.raises(TypeError, match="Mixed array backends"):
        cpsparse.topk_per_row(cupy.zeros((2, 4), cupy.float32), np.zeros(2, np.int32),
                              np.full(2, 4, np.int32), 2)
