"""Whether a change moved any kernel's machine code: the SASS of this tree against a revision.

    python3 tools/sass_diff.py [REV] [MODULE ...]        (REV: default HEAD)

Compiles the kernel modules (all, or those named) of the working tree and of REV (``git
archive`` into a temporary directory, so that REV's own Python-owned ``#define``s apply)
for sm_90a with NVRTC, with the loader's options (those of tests/test_kernel_compile.py),
disassembles both cubins with nvdisasm and compares each kernel's instructions, with
branch labels and addresses normalized. Prints a line a kernel: ``identical``, or how
many instruction lines differ; exits 1 when any kernel differs or exists on one side only.

A change whose SASS is identical on every kernel (a constant moved into Python, a helper
factored out, a comment) needs no GPU run: the GPU tests and benchmarks of REV stand for
it. Any difference, even one instruction moved, does not.

Needs what the CPU compile test needs (cuda-bindings, nvidia-cuda-nvrtc-cu12) and
nvdisasm: on PATH, or ``pip install nvidia-cuda-nvdisasm``.
"""

import difflib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARCH = "sm_90a"

# Run in a tree (cwd, on sys.path): compile each module as the loader would, one cubin each.
_COMPILE = r"""
import sys, pathlib
from cuda.bindings import nvrtc
from cpsparse import raw_kernels
out = pathlib.Path(sys.argv[1])
for name in sys.argv[2:] or sorted(raw_kernels.MODULES):
    src = raw_kernels.module_source(name).encode()
    opts = [o.encode() for o in raw_kernels.compile_options(name, "%(arch)s") + ("-ftz=true",)]
    err, prog = nvrtc.nvrtcCreateProgram(src, f"{name}.cu".encode(), 0, [], [])
    (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        sys.exit(f"{name}: NVRTC compile failed")
    err, n = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    (out / f"{name}.cubin").write_bytes(cubin)
    nvrtc.nvrtcDestroyProgram(prog)
""" % {"arch": ARCH}

_LABEL = re.compile(r"\.L_x_\d+")
_ADDRESS = re.compile(r"/\*[0-9a-f]+\*/")
_SECTION = re.compile(r"\s*\.text\.(\w+):")
# The module's internal helpers (the division and reciprocal slow paths) are numbered in
# the order the module's kernels call them: a kernel added to the module renumbers them.
_INTERNAL = re.compile(r"__internal_\d+_")


def kernels(sass):
    """{kernel: [instruction lines]} of nvdisasm output: one entry a ``.text.<name>``
    section, addresses and label numbers removed, directives, comments (nvdisasm's
    section banners) and label lines dropped (a label's number changes when code
    elsewhere in the module moves), internal helpers' numbers removed."""
    out, current = {}, None
    for line in sass.splitlines():
        m = _SECTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        if current is None:
            continue
        text = _INTERNAL.sub("__internal_", _LABEL.sub("L", _ADDRESS.sub("", line))).strip()
        if text and not text.startswith((".", "//")) and not text.endswith(":"):
            current.append(text)
    return out


def compare(old, new):
    """[(kernel, instruction lines added or removed (a diff), None when identical, -1 when
    on one side only)]."""
    rows = []
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            rows.append((name, -1))
            continue
        diff = sum(1 for line in difflib.unified_diff(old[name], new[name], n=0, lineterm="")
                   if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        rows.append((name, diff or None))
    return rows


def find_nvdisasm():
    """nvdisasm's path (on PATH, or the nvidia-cuda-nvdisasm wheel's), or None."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(pathlib.Path(base).glob("**/bin/nvdisasm")):
            return str(path)
    return None


def nvdisasm():
    return find_nvdisasm() or sys.exit(
        "nvdisasm not found: put it on PATH or pip install nvidia-cuda-nvdisasm")


def _sass_of(tree, modules, work, tool):
    work.mkdir()
    subprocess.run([sys.executable, "-c", _COMPILE, str(work), *modules], cwd=tree, check=True,
                   env=dict(os.environ, PYTHONPATH=str(tree)))
    out = {}
    for cubin in sorted(work.glob("*.cubin")):
        text = subprocess.run([tool, str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        for name, lines in kernels(text).items():
            out[f"{cubin.stem}:{name}"] = lines
    return out


def main(argv):
    rev = argv[0] if argv and argv[0] not in _module_names() else "HEAD"
    modules = [a for a in argv if a != rev]
    tool = nvdisasm()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        old_tree = tmp / "rev"
        old_tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "cpsparse"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
        old = _sass_of(old_tree, modules, tmp / "old", tool)
        new = _sass_of(ROOT, modules, tmp / "new", tool)
    changed = 0
    for name, diff in compare(old, new):
        what = "identical" if diff is None else (
            "on one side only" if diff == -1 else f"{diff} instruction lines added or removed")
        changed += diff is not None
        print(f"{name:55s} {what}")
    print(f"{changed} of {len(set(old) | set(new))} kernels differ from {rev}")
    return 1 if changed else 0


def _module_names():
    sys.path.insert(0, str(ROOT))
    from cpsparse import raw_kernels
    return set(raw_kernels.MODULES)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
