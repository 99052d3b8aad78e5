"""The attention profile's substitutions still hit the kernel source (CPU only)."""

import pytest

from benchmarks import profile_attention as P
from cpsparse import raw_kernels


@pytest.mark.parametrize("name", sorted(P.VARIANTS))
def test_variant_changes_the_source_where_it_says(name):
    base = raw_kernels.module_source("attention")
    src = P.variant_source(base, name)
    assert (src == base) == (name == "base")
    for old, new in P.VARIANTS[name]:
        assert new in src


def test_a_stale_substitution_is_an_error(monkeypatch):
    monkeypatch.setitem(P.VARIANTS, "stale", [("no such text in attention.cu", "")])
    with pytest.raises(ValueError, match="expected one occurrence"):
        P.variant_source(raw_kernels.module_source("attention"), "stale")
