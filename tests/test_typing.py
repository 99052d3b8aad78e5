"""The type hints a user sees: ``mypy --strict`` on a user script (tests/typing_user_script.py).

Skips without mypy (the ``typecheck`` extra). mypy runs from the checkout's root
with ``--follow-imports=silent``, so cpsparse is read as an installed package is
(its hints are used, its own errors are not the user's); ``.ci/run`` runs the same
script against the built wheel, which also proves that ``py.typed`` ships.
"""

import configparser
import pathlib
import runpy
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "typing_user_script.py"


def test_py_typed_marker_ships():
    assert (ROOT / "cpsparse" / "py.typed").is_file()
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "py.typed" in cfg["options.package_data"]["cpsparse"]
    assert "py.typed" in (ROOT / "MANIFEST.in").read_text()


def test_user_script_runs():
    runpy.run_path(str(SCRIPT), run_name="__main__")


def _mypy_strict(path, tmp_path):
    pytest.importorskip("mypy", reason="the typecheck extra (mypy) is not installed")
    config = tmp_path / "user_mypy.ini"       # a user's defaults, not setup.cfg's [mypy]
    config.write_text("[mypy]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", str(config),
         "--follow-imports=silent", "--cache-dir", str(tmp_path / "mypy_cache"),
         "--no-error-summary", "--hide-error-context", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_user_script_passes_mypy_strict(tmp_path):
    rc, out = _mypy_strict(SCRIPT, tmp_path)
    assert rc == 0, out


def _check(tmp_path, body):
    path = tmp_path / "snippet.py"
    path.write_text(textwrap.dedent(body))
    return _mypy_strict(path, tmp_path)


def test_public_returns_are_typed(tmp_path):
    """Not ``Any``: tuples of arrays, the cache classes, ints, lists of names."""
    rc, out = _check(tmp_path, """
        import numpy as np
        import cpsparse
        x = np.zeros((2, 128), np.float32)
        reveal_type(cpsparse.quantize_fp8(x))
        reveal_type(cpsparse.sparse_mla_attention)
        reveal_type(cpsparse.MLAKVCache.wrap(np.zeros((1, 64, 656), np.uint8)))
        reveal_type(cpsparse.IndexerKCache(1).num_slots)
        reveal_type(cpsparse.precompile)
        reveal_type(cpsparse.reference.indexer.topk_per_row)
        """)
    # mypy versions differ in qualifying builtins (list[str] vs builtins.list[builtins.str])
    revealed = [line.split("Revealed type is ", 1)[1].replace("builtins.", "")
                for line in out.splitlines() if "Revealed type is " in line]
    assert rc == 0 and len(revealed) == 6, out
    assert '"Any"' not in revealed, out
    # (older mypy writes Union[X, Y] for X | Y)
    assert revealed[0].startswith('"tuple[') and "numpy.ndarray[Any, Any]" in revealed[0]
    assert "-> tuple[" in revealed[1] and "kv_cache:" in revealed[1], revealed[1]
    assert revealed[2] == '"cpsparse.cache.MLAKVCache"' and revealed[3] == '"int"', revealed
    assert "-> list[str]" in revealed[4], revealed[4]
    assert "k: int" in revealed[5], revealed[5]


def test_mypy_flags_a_str_where_an_int_is_required(tmp_path):
    """The check can fail: a wrong argument type in user code is an error."""
    rc, out = _check(tmp_path, """
        import numpy as np
        import cpsparse
        logits = np.zeros((2, 8), np.float32)
        ends = np.full(2, 8, np.int32)
        cpsparse.topk_per_row(logits, np.zeros(2, np.int32), ends, "4")
        """)
    assert rc == 1, out
    assert 'Argument 4 to "topk_per_row" has incompatible type "str"' in out, out
