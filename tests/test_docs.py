"""Every docstring example in the package runs (NumPy backend) and is right."""

import doctest
import importlib
import pathlib
import pkgutil
import re

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
               if callable(getattr(cpsparse, name))
               and ">>>" not in (getattr(cpsparse, name).__doc__ or "")]
    assert not missing, f"public names without a docstring example: {missing}"


DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md")) + [DOCS.parent / "README.md"]


def _python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_docs_page_examples_run(page):
    """Every ```python block of the docs pages runs, in order, in one namespace."""
    blocks = _python_blocks(page.read_text())
    namespace = {"__name__": f"docs_{page.stem}"}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 - our own docs


def test_docs_have_examples():
    assert any(_python_blocks(p.read_text()) for p in PAGES), "no runnable docs example"
