"""tools/sass_diff.py's parsing and comparison (the compile and disassembly need NVRTC and
nvdisasm; they are not run here)."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sass_diff", ROOT / "tools" / "sass_diff.py")
sass_diff = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_diff)

SASS = """
	.headerflags	@"EF_CUDA_SM90"
	.section	.text.cps_a,"ax",@progbits
	.align	128
        .text.cps_a:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_12:
        /*0010*/              @P0 BRA `(.L_x_12) ;
        /*0020*/                   EXIT ;
        .text.cps_b:
        /*0000*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0010*/                   CALL.REL.NOINC `($__internal_6_$__cuda_sm20_rem_u64) ;
        /*0020*/                   EXIT ;
	//--------------------- .nv.shared.cps_b --------------------------
"""


def test_kernels_split_and_normalized():
    got = sass_diff.kernels(SASS)
    assert sorted(got) == ["cps_a", "cps_b"]
    assert got["cps_a"] == ["MOV R1, c[0x0][0x28] ;", "@P0 BRA `(L) ;", "EXIT ;"]
    # the same code at other addresses, under other label numbers, is identical
    moved = SASS.replace("/*0010*/", "/*0990*/").replace(".L_x_12", ".L_x_40")
    assert sass_diff.compare(got, sass_diff.kernels(moved)) == [("cps_a", None), ("cps_b", None)]
    # ... and so is a call of an internal helper a kernel added to the module renumbered
    renumbered = SASS.replace("__internal_6_", "__internal_8_")
    assert sass_diff.compare(got, sass_diff.kernels(renumbered)) == [("cps_a", None),
                                                                     ("cps_b", None)]
    other = SASS.replace("rem_u64", "div_u64")
    assert sass_diff.compare(got, sass_diff.kernels(other)) == [("cps_a", None), ("cps_b", 2)]


def test_compare_counts_changed_lines_and_one_sided_kernels():
    old = sass_diff.kernels(SASS)
    new = dict(old, cps_a=["MOV R1, c[0x0][0x28] ;", "NOP ;", "@P0 BRA `(L) ;", "EXIT ;"],
               cps_c=["EXIT ;"])
    del new["cps_b"]
    assert sass_diff.compare(old, new) == [("cps_a", 1), ("cps_b", -1), ("cps_c", -1)]
