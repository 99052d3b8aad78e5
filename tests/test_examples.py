"""Every script in examples/ runs to completion (GPU ones only where a GPU is)."""

import pathlib
import subprocess
import sys

import pytest

import cpsparse

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


def _needs_gpu(path):
    return path.read_text().lstrip('"\' \n').startswith("requires: gpu")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    if _needs_gpu(path) and not cpsparse.gpu_available():
        pytest.skip("example needs CuPy and a CUDA device")
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, f"{path.name} failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip(), f"{path.name} printed nothing"


def test_examples_exist():
    assert len(EXAMPLES) >= 3
