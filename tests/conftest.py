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
