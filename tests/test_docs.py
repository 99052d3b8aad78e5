"""Every docstring example in the package runs (NumPy backend) and is right."""

import doctest
import importlib
import pkgutil

import pytest

import cpsparse

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(cpsparse.__path__, prefix="cpsparse.")
    if name != "cpsparse.__main__")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest example(s) failed in {name}"


def test_public_api_has_examples():
    """Every public function and class documents at least one example."""
    missing = [name for name in cpsparse.__all__
               if callable(getattr(cpsparse, name)) and name not in (
                   "get_array_module", "gpu_available", "set_device_value_checks")
               and ">>>" not in (getattr(cpsparse, name).__doc__ or "")]
    assert not missing, f"public names without a docstring example: {missing}"
