"""What a user installs: the license, the runtime dependencies, the sdist, the CLI.

The sdist test builds it with setuptools (no network) and compares its files
with the checkout's; ``.ci/run`` also builds the wheel and runs the unpacked
sdist's own test suite.
"""

import ast
import configparser
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

import cpsparse

ROOT = pathlib.Path(__file__).resolve().parent.parent
CFG = configparser.ConfigParser()
CFG.read(ROOT / "setup.cfg")


def _requirements(text):
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _name(requirement):
    for sep in "<>=!~[; ":
        requirement = requirement.split(sep, 1)[0]
    return requirement.lower().replace("-", "_")


def _top_level_imports():
    """Top-level modules that cpsparse/ imports (anywhere, lazy imports included)."""
    names = set()
    for path in (ROOT / "cpsparse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"cpsparse"}


def test_license_is_apache_2_and_declared():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert CFG["metadata"]["license"] == "Apache-2.0"
    assert CFG["metadata"]["license_files"].split() == ["LICENSE"]


def test_runtime_dependencies_are_what_the_package_imports():
    required = {_name(r) for r in _requirements(CFG["options"]["install_requires"])}
    # the cuda12/13 and plots extras; torch: an optional peer of cpsparse.timing;
    # ml_dtypes: imported only when a caller names out_dtype="bfloat16"
    # (cpsparse._validation.check_out_dtype, which says so when it is missing)
    optional = {"cupy", "cupy_backends", "matplotlib", "ml_dtypes", "torch"}
    imported = _top_level_imports()
    assert imported - optional == required, (imported, required)
    assert "scipy" not in required and "ml_dtypes" not in required
    extras = {k: {_name(r) for r in _requirements(v)}
              for k, v in CFG["options.extras_require"].items()}
    assert {"scipy", "ml_dtypes"} <= extras["test"] and "matplotlib" in extras["plots"]
    # the NVRTC wheels only where the compile check needs them (CI installs the extra)
    nvidia = {n for reqs in extras.values() for n in reqs
              if n.startswith(("nvidia_", "cuda_bindings"))}
    assert nvidia and nvidia <= extras["nvrtc"] and not nvidia & extras["test"]
    assert 'pip install -e ".[nvrtc]"' in (ROOT / ".ci" / "run").read_text()


def test_changelog_has_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert f"\n## {cpsparse.__version__} " in text or f"\n## {cpsparse.__version__}\n" in text


def _cli(*args):
    env = dict(os.environ,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "cpsparse", *args], capture_output=True,
                          text=True, check=True, env=env, cwd=ROOT, timeout=120)


def test_cli_version():
    assert _cli("--version").stdout.strip() == f"cpsparse {cpsparse.__version__}"


def test_cli_help_is_plain_text():
    out = _cli("--help").stdout
    assert out.startswith("usage: python -m cpsparse")
    for markup in ("``", ":func:", ":class:", ":mod:", ":meth:"):
        assert markup not in out, markup
    assert "--version" in out


# ---- the sdist -------------------------------------------------------------------

SHIPPED = ("tests", "docs", "examples", "benchmarks", "tools")


def _checkout_files():
    """Files of SHIPPED folders on disk, less build output and caches."""
    files = set()
    for top in SHIPPED:
        for path in (ROOT / top).rglob("*"):
            rel = path.relative_to(ROOT)
            if (path.is_file() and "__pycache__" not in rel.parts
                    and rel.parts[:2] not in (("docs", "_build"), ("docs", "generated"))):
                files.add(rel.as_posix())
    return files


@pytest.fixture(scope="module")
def sdist_files(tmp_path_factory):
    pytest.importorskip("setuptools", reason="building the sdist needs setuptools")
    out = tmp_path_factory.mktemp("sdist")
    code = ("import sys\nfrom setuptools import build_meta\n"
            "print(build_meta.build_sdist(sys.argv[1]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = proc.stdout.strip().splitlines()[-1]
    with tarfile.open(out / name) as tar:
        members = [m.name for m in tar.getmembers() if m.isfile()]
    prefix = members[0].split("/", 1)[0] + "/"
    return {m[len(prefix):] for m in members if m.startswith(prefix)}


def test_sdist_ships_license_changelog_and_kernel_sources(sdist_files):
    for name in ("LICENSE", "README.md", "CHANGELOG.md", "setup.cfg", "pyproject.toml",
                 ".ci/run"):
        assert name in sdist_files, name
    sources = {p.relative_to(ROOT).as_posix()
               for p in (ROOT / "cpsparse").rglob("*") if p.suffix in (".py", ".cu", ".cuh")
               and "__pycache__" not in p.parts}
    assert sources and sources <= sdist_files, sorted(sources - sdist_files)


def test_sdist_ships_what_its_tests_need(sdist_files):
    """tests/ (conftest.py included), docs/, examples/ and the benchmarks/tools the
    tests import: everything on disk there, nothing built."""
    wanted = _checkout_files()
    assert "tests/conftest.py" in wanted and "docs/bad_input.md" in wanted
    assert wanted <= sdist_files, sorted(wanted - sdist_files)
    stray = {f for f in sdist_files if f.split("/", 1)[0] in SHIPPED} - wanted
    assert not stray, sorted(stray)
    assert not [f for f in sdist_files if "__pycache__" in f or f.endswith(".pyc")]
