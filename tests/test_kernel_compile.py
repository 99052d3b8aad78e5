"""Every kernel module compiles for sm_90a with NVRTC from pip: no GPU needed.

Fails on compile errors and on register spills / stack frames (local memory)
in any kernel, as reported by ptxas (-Xptxas -v). Runs in CPU CI: it is what
catches kernel breakage before a GPU ever sees it.

Each module also compiles for every other arch it claims (its registered
compute capabilities among sm_80, sm_90a, sm_100, sm_120; a successful compile
is enough there), and the archs it does not claim really fail to compile: that
is why the loader refuses them before calling NVRTC (wgmma on sm_100).
"""

import importlib.util
import pathlib
import re

import pytest

from benchmarks import profile_attention, profile_indexer
from cpsparse import raw_kernels
from cpsparse.raw_kernels import attention

_SPEC = importlib.util.spec_from_file_location(
    "sass_diff", pathlib.Path(__file__).resolve().parent.parent / "tools" / "sass_diff.py")
sass_diff = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sass_diff)

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="needs the [nvrtc] extra "
                            "(cuda-bindings + nvidia-cuda-nvrtc-cu12)")

# CuPy adds -ftz=true to every compile; compile the same way here.
CUPY_DEFAULTS = ("-ftz=true",)

# Compute capabilities whose arch the test compiles for (Ampere, Hopper,
# Blackwell datacenter, Blackwell consumer), as the loader names them.
CAPABILITIES = [(8, 0), (9, 0), (10, 0), (12, 0)]
ARCHS = {cc: raw_kernels.arch_for(cc) for cc in CAPABILITIES}   # sm_80 sm_90a sm_100 sm_120


def _supported_archs():
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    return set(archs)


NVRTC_VERSION = "{}.{}".format(*nvrtc.nvrtcVersion()[1:])
NVRTC_ARCHS = _supported_archs()          # e.g. {..., 80, 89, 90, 100, 101, 103, 120, 121}


def skip_unless_nvrtc_knows(cc):
    if cc[0] * 10 + cc[1] not in NVRTC_ARCHS:
        pytest.skip(f"NVRTC {NVRTC_VERSION} from pip cannot compile {ARCHS[cc]} "
                    f"(supported: {sorted(NVRTC_ARCHS)})")


def _cases(claimed):
    return [pytest.param(name, cc, id=f"{name}-{ARCHS[cc]}")
            for name in sorted(raw_kernels.MODULES) for cc in CAPABILITIES
            if (cc in raw_kernels.MODULES[name].capabilities) == claimed]


def _check(result, what):
    err = result[0]
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, f"{what}: {err}"
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


_BUILDS: dict = {}          # (module, arch) -> (ok, log, ptx) of the module's own source


def compile_module(name, arch="sm_90a", source=None):
    """(ok, log) of compiling module ``name`` exactly as the loader would (``source``:
    instead of its own source, e.g. a profile's variant of it)."""
    return _build(name, arch, source)[:2]


def module_ptx(name, arch="sm_90a"):
    """The PTX NVRTC made of module ``name`` (its own source; the compile is shared with
    :func:`compile_module`)."""
    ok, log, ptx, _ = _build(name, arch, None)
    assert ok, f"NVRTC failed on module {name}:\n{log}"
    return ptx


def _build(name, arch, source):
    if source is None and (name, arch) in _BUILDS:
        return _BUILDS[name, arch]
    src = (raw_kernels.module_source(name) if source is None else source).encode()
    opts = [o.encode() for o in raw_kernels.compile_options(name, arch) + CUPY_DEFAULTS
            + ("-Xptxas=-v",)]
    err, prog = nvrtc.nvrtcCreateProgram(src, f"{name}.cu".encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        ok = status == nvrtc.nvrtcResult.NVRTC_SUCCESS
        ptx, cubin = "", b""
        if ok:
            err, cubin_size = nvrtc.nvrtcGetCUBINSize(prog)
            ok = cubin_size > 0
            cubin = b" " * cubin_size
            nvrtc.nvrtcGetCUBIN(prog, cubin)
            err, ptx_size = nvrtc.nvrtcGetPTXSize(prog)
            buf = b" " * ptx_size
            nvrtc.nvrtcGetPTX(prog, buf)
            ptx = buf.decode(errors="replace").rstrip("\x00 ")
        result = ok, log.decode(errors="replace").rstrip("\x00 "), ptx, cubin
        if source is None:
            _BUILDS[name, arch] = result
        return result
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def kernel_reports(log):
    """{kernel: (registers, spill stores, spill loads, stack bytes)} from ptxas -v."""
    reports = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", line)
        if m and current:
            stack, stores, loads = (int(g) for g in m.groups())
            reports.setdefault(current, [0, stores, loads, stack])
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            reports.setdefault(current, [0, 0, 0, 0])[0] = int(m.group(1))
    return {k: tuple(v) for k, v in reports.items()}


def test_modules_are_registered():
    assert raw_kernels.MODULES, "no kernel module registered"


@pytest.mark.parametrize("name", sorted(raw_kernels.MODULES))
def test_module_compiles_without_spills(name):
    ok, log = compile_module(name)
    assert ok, f"NVRTC failed on module {name}:\n{log}"
    reports = kernel_reports(log)
    assert reports, f"no ptxas report for module {name}:\n{log}"
    spilling = {k: r for k, r in reports.items() if r[1] or r[2] or r[3]}
    assert not spilling, (f"kernels of {name} use local memory "
                          f"(registers, spill stores, spill loads, stack): {spilling}\n{log}")
    # ptxas C7514..C7518: it serialized the wgmma of a kernel (waits after each one),
    # silently undoing the overlap the kernel is written for.
    serialized = [line for line in log.splitlines() if "wgmma.mma_async instructions are "
                  "serialized" in line]
    assert not serialized, "\n".join(serialized)


# A PTX instruction that reads or writes memory, and its state-space / type qualifiers.
_MEMORY_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|st|atom|red|cp|prefetch|prefetchu|multimem|"
                        r"tensormap|mbarrier)((?:\.\w+)*)\s", re.M)
_LOCAL_SPACES = (".param", ".shared", ".local", ".const")


@pytest.mark.parametrize("name", sorted(raw_kernels.MODULES))
def test_pdl_kernels_wait_before_any_global_access(name):
    """The compiled code of every kernel (every .entry NVRTC made, however the source
    declares it) of a module launched with PDL runs griddepcontrol.wait before its first
    instruction that may touch global memory (a generic-address load counts: only
    parameter, shared, local and constant accesses may come first); a module launched
    without PDL has none. The source-level test (test_kernel_signatures.py) names the
    macros; this one holds even if a macro is emptied or a kernel is declared in a way
    its regex misses."""
    ptx = module_ptx(name)
    starts = [m for m in re.finditer(r"\.entry\s+(\w+)", ptx)]
    assert starts, name
    pdl = raw_kernels.MODULES[name].pdl
    for i, m in enumerate(starts):
        body = ptx[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(ptx)]
        wait = body.find("griddepcontrol.wait")
        if not pdl:
            assert wait < 0, (name, m.group(1))
            continue
        assert wait >= 0, f"{name}: kernel {m.group(1)} never waits for the grid before it"
        early = [op.group(0).strip() for op in _MEMORY_OP.finditer(body[:wait])
                 if not any(q in op.group(2) for q in _LOCAL_SPACES)]
        assert not early, f"{name}: kernel {m.group(1)} accesses memory before its wait: {early}"


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(set(profile_attention.VARIANTS) - {"base"})
                         + ["trace", "timeline"])
def test_profile_variants_compile_like_the_kernel(variant):
    # A profile variant that spills, or makes ptxas serialize the wgmma, times something
    # else than the part it removes (a wgmma under a runtime guard did both).
    src = profile_attention.variant_source(raw_kernels.module_source("attention"), variant)
    ok, log = compile_module("attention", source=src)
    assert ok, log
    fp8 = kernel_reports(log)["cps_sparse_mla_fp8"]
    assert fp8[1:] == (0, 0, 0), f"variant {variant}: cps_sparse_mla_fp8 uses local memory {fp8}"
    assert "wgmma.mma_async instructions are serialized" not in log, log


def _sass(name, source, tool, tmp_path):
    """{kernel: its SASS instruction lines} (sass_diff.kernels) of module ``name`` compiled
    for sm_90a from ``source`` (None: its own), disassembled with nvdisasm ``tool``."""
    import subprocess
    ok, log, _, cubin = _build(name, "sm_90a", source)
    assert ok, log
    path = tmp_path / f"{name}.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([tool, str(path)], capture_output=True, text=True, check=True).stdout
    return sass_diff.kernels(text)


def _wgmma_counts(source, tool, tmp_path):
    """{kernel: wgmma (HGMMA) instructions in its SASS} of the attention module from
    ``source``."""
    return {k: sum("HGMMA" in line for line in v)
            for k, v in _sass("attention", source, tool, tmp_path).items()}


@pytest.mark.slow
def test_profile_variants_remove_only_the_products_they_name(tmp_path):
    # ptxas drops a product whose result nothing reads: the rows' write under a runtime
    # guard (if (d_v == -1)) left O of one warpgroup unread and took 21 of the fp8
    # kernel's 60 wgmma, which timed as 20% of the kernel. A variant that does not say it
    # removes products keeps the base's count (ptxas's own count, from the SASS).
    tool = sass_diff.find_nvdisasm()
    if tool is None:
        pytest.skip("needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    base = raw_kernels.module_source("attention")
    want = _wgmma_counts(base, tool, tmp_path)
    tables = [(profile_attention.VARIANTS, "cps_sparse_mla_fp8",
               set(profile_attention.VARIANTS_WITHOUT_PRODUCTS) | {"base"}),
              (profile_attention.PREFILL_VARIANTS, "cps_sparse_mla_bf16", {"base", "nomath"}),
              (profile_attention.MODEL1_VARIANTS, "cps_sparse_mla_model1", {"base", "nomath"})]
    for table, kernel, removing in tables:
        for name in sorted(set(table) - removing) + (["trace", "timeline"] if table is
                                                      profile_attention.VARIANTS else []):
            got = _wgmma_counts(profile_attention.variant_source(base, name, table), tool,
                                tmp_path)[kernel]
            assert got == want[kernel], \
                f"variant {name}: {kernel} has {got} wgmma, the base {want[kernel]}"
        for name in removing - {"base"}:
            got = _wgmma_counts(profile_attention.variant_source(base, name, table), tool,
                                tmp_path)[kernel]
            assert got < want[kernel], f"variant {name} says it removes {kernel}'s products"


# A SASS instruction line: optional predicate, opcode, operands.
_SASS_INSTR = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?)\s*;")
_UREG = re.compile(r"\bUR(\d+)\b")


def unwritten_uniform_reads(lines, opcode="LDGSTS"):
    """The ``opcode`` instructions of one kernel's SASS (sass_diff.kernels' lines, in
    program order) that read a uniform register no earlier instruction wrote. A
    destination is an instruction's first operand (after a predicate destination);
    a .64 opcode writes the pair. (Program order, not control flow: a value written
    later in the text and reaching the read through a loop's back edge would be
    reported too; none of the checked kernels has one.)"""
    written, bad = set(), []
    for line in lines:
        m = _SASS_INSTR.match(line)
        if not m:
            continue
        op, args = m.groups()
        ops = [a.strip() for a in args.split(",")] if args else []
        if op.startswith(opcode):
            bad += [line for r in _UREG.findall(args) if int(r) not in written][:1]
        dest = ops[1] if len(ops) > 1 and re.fullmatch(r"U?P\w+", ops[0]) else (ops[0] if ops else "")
        d = re.fullmatch(r"UR(\d+)(?:\.\w+)*", dest)
        if d:
            written.add(int(d.group(1)))
            if ".64" in op:
                written.add(int(d.group(1)) + 1)
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("variant", [None, *sorted(profile_indexer.VARIANTS)])
def test_decode_copies_read_only_uniform_registers_written_before(tmp_path, variant):
    # NVRTC 12.9 and 13.0 compiled the ws decode producer's early copies of ring slot 0
    # (cps_paged_ws_body, slot 0 as a literal) into LDGSTS whose shared base and L2 policy
    # came from uniform registers nothing wrote (`[R24+UR0+0x8000], desc[UR1]`): every
    # launch trapped on an H100 with an illegal instruction, and the compile itself was
    # clean (NVRTC 13.5 compiled it right). The kernels' cp.async copies must read only
    # uniform registers the kernel wrote before them.
    # (and so must profile_indexer's variants of them, which the ab mode launches)
    tool = sass_diff.find_nvdisasm()
    if tool is None:
        pytest.skip("needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    source = None if variant is None else profile_indexer.variant_source(
        raw_kernels.module_source("indexer"), variant)
    found = _sass("indexer", source, tool, tmp_path)
    ws = [k for k in found if k.startswith("cps_paged_mqa_logits_") and "_ws_" in k]
    assert len(ws) == 4, sorted(found)
    for name in ws:
        assert any(line.startswith("LDGSTS") for line in found[name]), name
        bad = unwritten_uniform_reads(found[name])
        assert not bad, f"{name} {variant or ''} (NVRTC {NVRTC_VERSION}): {bad[:3]}"


def test_unwritten_uniform_reads_reads_destinations_and_pairs():
    lines = ["ULDC.64 UR4, c[0x0][0x208] ;",
             "R2UR UR8, R2 ;",
             "@P0 R2UR P1, UR9, R3 ;",
             "LDGSTS.E.BYPASS.128 [R1+0x8000], desc[UR4][R2.64], P0 ;",
             "LDGSTS.E.BYPASS.128 [R1+UR8+0x10], desc[UR5][R2.64], P0 ;",
             "LDGSTS.E [R1+0x10], desc[UR9][R2.64], P0 ;",
             "LDGSTS.E.BYPASS.128 [R24+UR0+0x8000], desc[UR1][R34.64], P0 ;",
             "UMOV UR0, UR8 ;"]
    assert unwritten_uniform_reads(lines) == [lines[6]]       # (the trap's pattern)
    assert unwritten_uniform_reads(lines[1:]) == lines[3:5] + [lines[6]]   # no ULDC.64


def head_sum_chains(lines):
    """The ReLU-weighted head sums of one kernel's SASS after each wgmma wait (a wgmma with
    gsb0: its accumulators R(base)..): for every chain of FFMAs that starts from RZ (the
    first product rounded) and adds ``x + |x|`` of an accumulator each step, the
    accumulator indices in the order added. (Program order over the 1500 instructions
    after the wait, as unwritten_uniform_reads: a chain split by a branch or a move is
    not reported, or only its tail from the last FFMA of RZ.)"""
    found = []
    for start, line in enumerate(lines):
        m = re.match(r"(?:@!?P\w+\s+)?[QH]GMMA\.64x(\d+)x\S*\s+R(\d+),.*gsb0", line)
        if not m:
            continue
        n, base = int(m.group(1)) // 2, int(m.group(2))
        val = {f"R{base + j}": ("acc", j) for j in range(n)}
        fmas, addends = [], set()
        for text in lines[start + 1:start + 1500]:
            im = _SASS_INSTR.match(text)
            if not im:
                continue
            op, args = im.groups()
            ops = [a.strip().replace(".reuse", "") for a in args.split(",")] if args else []
            if op.startswith(("QGMMA", "HGMMA")):
                break
            if not ops or not re.fullmatch(r"R\d+", ops[0]):
                continue
            got = [val.get(o.strip("|-"), o) for o in ops[1:]]
            if op.startswith("FADD") and len(ops) == 3 and ops[2] == f"|{ops[1]}|" \
                    and isinstance(got[0], tuple) and got[0][0] == "acc":
                val[ops[0]] = ("relu", got[0][1])
            elif op.startswith("FFMA") and len(ops) == 4:
                e = ("fma", *got)
                fmas.append(e)
                addends.add(id(got[2]))
                val[ops[0]] = e
            else:
                val[ops[0]] = (op, *got)
        for e in fmas:
            if id(e) in addends:
                continue                            # not a chain's last step
            seq = []
            while isinstance(e, tuple) and e[0] == "fma":
                relu = [x for x in e[1:3] if isinstance(x, tuple) and x[0] == "relu"]
                if not relu:
                    break
                seq.append(relu[0][1])
                e = e[3]
            if seq and e == "RZ":
                found.append(seq[::-1])
    return found


def in_deepgemm_order(groups):
    """Whether a row's column groups were added in DeepGEMM's order: consecutive groups,
    the second first, then the first, then the rest ascending (indexer.cu,
    cps_groups_in_dg_order)."""
    s = sorted(groups)
    want = s if len(s) < 2 else [s[1], s[0]] + s[2:]
    return groups == want and s == list(range(s[0], s[0] + len(s)))


# Kernels with their rows' bounds known at compile time: every head sum straight-line,
# (chains, groups a chain) in their SASS.
DG_ORDER_KERNELS = {"cps_paged_mqa_logits_ws_h64n1": (4, 8), "cps_paged_mqa_logits_ws_h64n2": (8, 8),
                    "cps_paged_mqa_logits_fp4_ws_h64n1": (4, 8),
                    "cps_paged_mqa_logits_fp4_ws_h64n2": (8, 8),
                    "cps_mqa_logits_ws_h64": (8, 8), "cps_paged_mqa_logits_wgmma_n64_h64_s3": (4, 8),
                    "cps_paged_mqa_logits_fp4_wgmma_n64_h64_s3": (4, 8)}


@pytest.mark.slow
def test_head_sums_add_column_groups_in_deepgemms_order(tmp_path):
    # DeepGEMM's SASS (nvcc) rounds a row's second column group's products and fuses the
    # first group's onto them; in the order written (the first rounded) about 11% of
    # cpsparse's logits differed from DeepGEMM's in the last bits
    # (benchmarks/probe_deepgemm_bits.py). Every chain found in the SASS of the indexer
    # kernels adds its groups so; the kernels built for 64 heads have all of theirs whole.
    tool = sass_diff.find_nvdisasm()
    if tool is None:
        pytest.skip("needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    found = _sass("indexer", None, tool, tmp_path)
    assert set(DG_ORDER_KERNELS) <= set(found), sorted(found)
    for name, lines in found.items():
        chains = head_sum_chains(lines)
        bad = [c for c in chains if not in_deepgemm_order([j // 4 for j in c])]
        assert not bad, f"{name}: head sums out of DeepGEMM's order: {bad[:2]}"
        if name in DG_ORDER_KERNELS:
            count, groups = DG_ORDER_KERNELS[name]
            assert len(chains) == count and {len(c) for c in chains} == {groups}, \
                f"{name}: {len(chains)} chains of {sorted({len(c) for c in chains})} groups"


def test_head_sum_chains_follow_ffma_chains_from_rz():
    lines = ["QGMMA.64x32x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;",
             "FADD.FTZ R40, R28, |R28| ;",            # relu 2x of acc 4
             "FADD.FTZ R41, R24, |R24| ;",            # acc 0
             "FADD.FTZ R42, R32, |R32| ;",            # acc 8
             "FFMA.FTZ R43, R2, R40, RZ ;",
             "FFMA.FTZ R43, R3, R41, R43 ;",
             "FFMA.FTZ R43, R4, R42, R43 ;",
             "FADD.FTZ R44, R25, |R25| ;",            # a chain of acc 1, then 5: the other order
             "FADD.FTZ R45, R29, |R29| ;",
             "FFMA.FTZ R46, R2, R44, RZ ;",
             "FFMA.FTZ R46, R3, R45, R46 ;",
             "MOV R47, R26 ;",                         # through a move: not followed
             "FADD.FTZ R48, R47, |R47| ;",
             "FFMA.FTZ R49, R2, R48, RZ ;",
             "FADD.FTZ R50, R43, R46 ;"]
    chains = head_sum_chains(lines)
    assert sorted(chains) == [[1, 5], [4, 0, 8]], chains
    assert in_deepgemm_order([1, 0, 2]) and in_deepgemm_order([3])
    assert not in_deepgemm_order([0, 1, 2]) and not in_deepgemm_order([1, 0, 3])
    assert in_deepgemm_order([2, 1, 3]) and not in_deepgemm_order([2, 1, 0])


@pytest.mark.slow
@pytest.mark.parametrize("variant", [None, *[pytest.param(v, marks=pytest.mark.slow)
                                             for v in sorted(profile_indexer.VARIANTS)]])
def test_indexer_trace_compiles_like_the_kernel(variant):
    # The ws decode trace (benchmarks.profile_indexer trace [--variant=NAME]) times the fp8
    # kernels it launches only if the stamps leave them without local memory.
    src = raw_kernels.module_source("indexer")
    if variant is not None:
        src = profile_indexer.variant_source(src, variant)
    src = profile_indexer.trace_source(src)
    ok, log = compile_module("indexer", source=src)
    assert ok, log
    reports = kernel_reports(log)
    for name in ("cps_paged_mqa_logits_ws_h64n1", "cps_paged_mqa_logits_ws_h64n2"):
        assert reports[name][1:] == (0, 0, 0), f"traced {name} uses local memory {reports[name]}"


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(profile_indexer.VARIANTS))
def test_indexer_variants_compile_like_the_kernel(variant):
    # profile_indexer ab times these against the kernels: spilling, they would time
    # something else than the change they name.
    src = profile_indexer.variant_source(raw_kernels.module_source("indexer"), variant)
    ok, log = compile_module("indexer", source=src)
    assert ok, log
    reports = kernel_reports(log)
    ws = [k for k in reports if k.startswith("cps_paged_mqa_logits_") and "_ws_" in k]
    assert len(ws) == 4, sorted(reports)
    for name in ws:
        assert reports[name][1:] == (0, 0, 0), f"{variant}: {name} uses local memory {reports[name]}"


def test_page_landing_probe_compiles_like_the_kernels():
    # benchmarks.probe_page_landing builds its kernel on the project's headers with the
    # indexer module's options (-std=c++17, sm_90a): TMA tensor and bulk copies, cp.async
    # arrivals, clock64 stamps, no local memory.
    from benchmarks import probe_page_landing
    ok, log = compile_module("indexer", source=probe_page_landing.source())
    assert ok, log
    reports = kernel_reports(log)
    assert reports["cps_probe_land_pages"][1:] == (0, 0, 0), reports["cps_probe_land_pages"]


@pytest.mark.parametrize("module,kernel,define", [
    *[("attention", f"cps_sparse_mla_{kind}{out}", define)
      for out in attention.OUT_SUFFIX.values()
      for kind, define in (("fp8", "ATT_DEC_LAUNCH_REGS"), ("model1", "ATT_LAUNCH_REGS"),
                           ("bf16", "ATT_LAUNCH_REGS"))],
    ("indexer", "cps_mqa_logits_ws", "CPS_IDX_WS_LAUNCH_REGS"),
    ("indexer", "cps_mqa_logits_ws_h64", "CPS_IDX_WS_LAUNCH_REGS"),
    ("indexer", "cps_paged_mqa_logits_ws_h64n1", "CPS_IDX_WS_LAUNCH_REGS"),
    ("indexer", "cps_paged_mqa_logits_ws_h64n2", "CPS_IDX_WS_LAUNCH_REGS"),
    ("indexer", "cps_paged_mqa_logits_fp4_ws_h64n1", "CPS_IDX_WS_LAUNCH_REGS"),
    ("indexer", "cps_paged_mqa_logits_fp4_ws_h64n2", "CPS_IDX_WS_LAUNCH_REGS"),
])
def test_warp_specialized_kernel_launches_with_the_pool_its_split_assumes(module, kernel, define):
    # The warp-specialized kernels move registers between warpgroups with setmaxnreg;
    # the increase blocks forever unless the CTA's pool (threads x registers at launch)
    # covers the split, which the source sizes for `define` registers a thread
    # (attention: 384 threads, 168, the fp8 decode 512, 128; prefill scoring: 640 threads,
    # 5 warps a scheduler, 96).
    ok, log = compile_module(module)
    assert ok, log
    regs = kernel_reports(log)[kernel][0]
    src = raw_kernels.module_source(module)
    launch = int(re.search(rf"#define {define} (\d+)", src).group(1))
    assert regs == launch, f"{kernel} uses {regs} registers, the split assumes {launch}"


@pytest.mark.parametrize("name,cc", [c for c in _cases(True) if c.values[1] != (9, 0)])
def test_module_compiles_for_every_claimed_arch(name, cc):
    """sm_90a is test_module_compiles_without_spills; here a compile is enough."""
    skip_unless_nvrtc_knows(cc)
    ok, log = compile_module(name, ARCHS[cc])
    assert ok, f"NVRTC failed on module {name} for {ARCHS[cc]}, which it claims:\n{log}"


@pytest.mark.parametrize("name,cc", _cases(False))
def test_why_we_refuse_unclaimed_archs_do_not_compile(name, cc):
    """Why the loader refuses: an arch a module does not claim fails inside NVRTC.

    If one of these starts to compile, widen the module's capabilities in
    cpsparse/raw_kernels/__init__.py (and check it on that GPU).
    """
    skip_unless_nvrtc_knows(cc)
    ok, log = compile_module(name, ARCHS[cc])
    assert not ok, (f"module {name} compiles for {ARCHS[cc]} but its capabilities "
                    f"({raw_kernels.MODULES[name].capabilities}) refuse it")
    # ... and fails for the arch, not for an unrelated error in the source.
    assert re.search(r"\.target|architecture", log), log


@pytest.mark.parametrize("name", ["indexer", "attention"])
def test_why_we_refuse_wgmma_modules_on_sm_100(name):
    """The wgmma modules are 9.0-only: NVRTC rejects their PTX for Blackwell."""
    assert (10, 0) not in raw_kernels.MODULES[name].capabilities
    assert raw_kernels.MODULES[name].capabilities == raw_kernels.exactly((9, 0))
    skip_unless_nvrtc_knows((10, 0))
    ok, log = compile_module(name, "sm_100")
    assert not ok, f"module {name} now compiles for sm_100:\n{log}"
    assert "wgmma" in log and "sm_100" in log, log


def test_compile_check_catches_errors(monkeypatch):
    """The check itself fails on broken source (so a green run means something)."""
    monkeypatch.setitem(raw_kernels.MODULES, "_broken", raw_kernels.ModuleSpec(
        ("common.cuh",), (), raw_kernels.at_least(8, 0)))
    monkeypatch.setattr(raw_kernels, "module_source",
                        lambda name: 'extern "C" __global__ void k() { undeclared(); }')
    ok, log = compile_module("_broken")
    assert not ok and "undeclared" in log


def test_spill_parser():
    log = ("ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n"
           "ptxas info    : Function properties for k1\n"
           "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 0 barriers\n")
    assert kernel_reports(log) == {"k1": (255, 4, 4, 8)}
