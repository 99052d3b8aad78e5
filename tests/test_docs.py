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


def _doctest_blocks(text):
    return re.findall(r"^```\{doctest\}\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_docs_page_doctests(page):
    """Every ```{doctest} block of the docs pages passes, as the Sphinx doctest build runs
    it (docs/conf.py's global setup: numpy as np, cpsparse), in one namespace a page."""
    import numpy as np
    globs = {"np": np, "cpsparse": cpsparse, "__name__": f"docs_{page.stem}"}
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    parser = doctest.DocTestParser()
    for n, block in enumerate(_doctest_blocks(page.read_text())):
        runner.run(parser.get_doctest(block, globs, f"{page.name}[{n}]", str(page), 0),
                   clear_globs=False)
    assert runner.failures == 0, f"{runner.failures} doctest example(s) failed in {page.name}"


def test_contract_page_is_doctested():
    assert len(_doctest_blocks((DOCS / "contract.md").read_text())) >= 4


def _api_objects():
    """Fully qualified names of the objects docs/api.md documents."""
    names = []
    for block in re.findall(r"^```\{eval-rst\}\n(.*?)^```", (DOCS / "api.md").read_text(),
                            flags=re.S | re.M):
        module = None
        for line in block.splitlines():
            line = line.strip()
            if line.startswith(".. currentmodule::"):
                module = line.split("::", 1)[1].strip()
            elif line and not line.startswith((":", "..")):
                names.append(f"{module}.{line}")
    return names


# The reference and paging helpers (for kernel authors) are not held to this yet.
NUMPYDOC_CHECKS = {"GL08", "PR01", "RT01"}
NUMPYDOC_UNCHECKED = re.compile(r"^cpsparse\.(reference|paging)\.")


def test_api_docstrings_document_parameters_and_returns():
    """numpydoc validation beyond the docs build's (docs/conf.py): every object of the
    API page has a docstring, documents every parameter, and has a Returns section
    when it returns something."""
    validate = pytest.importorskip("numpydoc.validate").validate
    names = [n for n in _api_objects() if not NUMPYDOC_UNCHECKED.match(n)]
    assert len(names) > 30
    bad = [f"{name}: {code} {msg}" for name in names
           for code, msg in validate(name)["errors"] if code in NUMPYDOC_CHECKS]
    assert not bad, "\n".join(bad)


def test_docs_have_examples():
    assert any(_python_blocks(p.read_text()) for p in PAGES), "no runnable docs example"
