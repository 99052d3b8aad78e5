"""Shared test setup: GPU tests skip cleanly without a CUDA device."""

import pytest

import cpsparse


def pytest_collection_modifyitems(config, items):
    if cpsparse.gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[True, False], ids=["kernels", "reference_on_gpu"])
def cupy_kernels(request):
    """Run a GPU test with the CUDA kernels, then with the reference on CuPy arrays."""
    previous = cpsparse.set_kernels_enabled(request.param)
    try:
        yield request.param
    finally:
        cpsparse.set_kernels_enabled(previous)
