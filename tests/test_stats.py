"""The fast statistics agree with NumPy's float64 answer, whatever the values hold."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.storage import _fused as fused
from tracer.storage import _stats as stats
from tracer.storage._stats import finite_flag, summarize, tensor_stats
from tracer.storage.records import Finite

SPECIALS = st.sampled_from([math.nan, math.inf, -math.inf])


@st.composite
def tensors(draw):
    n = draw(st.integers(1, 300))
    scale = draw(st.sampled_from([1e-6, 1.0, 1e3, 1e6]))
    offset = draw(st.sampled_from([0.0, 1.0, -50.0, 1e4]))
    base = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal(n) * scale + offset
    if draw(st.booleans()):
        where = draw(st.lists(st.integers(0, n - 1), max_size=n // 2))
        for i in where:
            base[i] = draw(SPECIALS)
    big = draw(st.booleans())  # past 65,536 elements the chunked sum of squares takes over
    values = np.tile(base, 70_000 // n + 1)[:70_000] if big else base
    return torch.tensor(values, dtype=torch.float32)


def reference(x: torch.Tensor) -> dict:
    a = x.numpy().astype(np.float64)
    finite = a[np.isfinite(a)]
    out = {"nan": int(np.isnan(a).sum()), "pos_inf": int(np.isposinf(a).sum()), "neg_inf": int(np.isneginf(a).sum())}
    if finite.size:
        out.update(min=finite.min(), max=finite.max(), mean=finite.mean(), std=finite.std())
    return out


@pytest.mark.parametrize("one_pass", [True, False], ids=["fused kernel", "pytorch passes"])
@settings(max_examples=120, deadline=None)
@given(x=tensors())
def test_statistics_match_numpy(x, one_pass):
    """Both ways of taking them: the one-pass kernel (from 4096 values) and PyTorch's reductions."""
    with pytest.MonkeyPatch.context() as patch:
        if not one_pass:
            patch.setattr(stats, "FUSED_NUMEL", 2**62)
        got = tensor_stats(x)
    want = reference(x)
    assert (got.nan, got.pos_inf, got.neg_inf) == (want["nan"], want["pos_inf"], want["neg_inf"])
    if "min" not in want:
        assert math.isnan(got.min) and math.isnan(got.mean)
        return
    spread = max(abs(want["min"]), abs(want["max"]), 1e-30)
    assert got.min == want["min"] and got.max == want["max"]
    assert math.isclose(got.mean, want["mean"], rel_tol=1e-5, abs_tol=1e-6 * spread)
    assert math.isclose(got.std, want["std"], rel_tol=1e-4, abs_tol=1e-6 * spread)


def test_the_flag_and_the_summary_shout_what_is_not_finite():
    clean, mask_like = torch.randn(4, 4), torch.zeros(4, 4).masked_fill(torch.ones(4, 4).triu(1).bool(), -math.inf)
    bad = clean.clone()
    bad[1, 2] = math.nan
    assert [finite_flag(t) for t in (clean, mask_like, bad)] == [Finite.CLEAN, Finite.NEG_INF, Finite.BAD]
    assert "NaN!×1" in summarize((4, 4), "float32", tensor_stats(bad))
    assert "−∞×6 (masked)" in summarize((4, 4), "float32", tensor_stats(mask_like), neg_inf_expected=True)
    assert "−∞!×6" in summarize((4, 4), "float32", tensor_stats(mask_like), neg_inf_expected=False)
    assert summarize((4, 4), "float32", None, flag=Finite.BAD).endswith("(values not kept) NaN/+∞ present!")
    assert "all zeros" in summarize((3,), "float32", tensor_stats(torch.zeros(3)))


def test_the_one_pass_kernel_is_built_where_there_is_a_compiler():
    """This machine kind has a C compiler: the kernel must be built and used, not silently replaced by the
    slower PyTorch path (where there is none, the fallback must say so)."""
    import shutil

    if shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"):
        assert fused.available(), fused.status()
        x = torch.randn(100_000)
        x[::7] = -math.inf
        x[5] = math.nan
        m = fused.moments(x)
        finite = x[torch.isfinite(x)].double()
        assert (m.nan, m.neg_inf, m.pos_inf, m.finite) == (1, int(torch.isneginf(x).sum()), 0, finite.numel())
        assert (m.min, m.max) == (float(finite.min()), float(finite.max()))
        assert math.isclose(m.sum, float(finite.sum()), abs_tol=1e-6 * float(finite.abs().sum()))
        assert math.isclose(m.sum_sq, float(finite.square().sum()), rel_tol=1e-6)
    else:
        assert not fused.available() and "no C compiler" in fused.status()
    assert fused.moments(torch.randn(10, dtype=torch.float64)) is None  # float32 only: others take PyTorch
    assert fused.moments(torch.randn(64, 64).t()) is None  # contiguous only


def statistics_in_a_process_of_its_own(cc: str, cache: Path) -> tuple[str, str]:
    """(what the statistics of a tensor holding −∞ came out as, fused.status()) in a fresh process whose C
    compiler is ``cc`` and kernel cache ``cache``: the kernel is built once per process."""
    import os
    import subprocess
    import sys

    probe = (
        "import math, torch\n"
        "from tracer.storage import _fused as fused\n"
        "from tracer.storage._stats import tensor_stats\n"
        "x = torch.arange(10_000, dtype=torch.float32)\n"
        "x[3] = -math.inf\n"
        "s = tensor_stats(x)\n"
        "print(fused.available(), s.min, s.max, s.neg_inf)\n"
        "print(fused.status())\n"
    )
    env = {**os.environ, "CC": cc, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, check=True)
    first, status = done.stdout.splitlines()
    return first, status


def test_without_a_compiler_the_statistics_say_why_and_take_the_pytorch_path(tmp_path):
    """A machine whose C compiler fails (here: CC names one that does not exist) gets the same statistics
    from PyTorch's reductions, and fused.status() says why."""
    first, status = statistics_in_a_process_of_its_own(str(tmp_path / "no-such-cc"), tmp_path)
    assert first == "False 0.0 9999.0 1"
    assert "did not run" in status and "PyTorch path" in status
    assert not list(tmp_path.glob("gpt-shape-tracer/*.so"))


def test_a_cached_library_without_the_kernel_symbol_takes_the_pytorch_path(tmp_path):
    """A library at the kernel's cache path that lacks ``fused_stats_f32`` (an odd $CC, or a file that is not our
    build) must not break every statistics call: the PyTorch reductions are used and status() says why."""
    import stat

    empty = tmp_path / "empty.c"
    empty.write_text("int unrelated(void) { return 1; }\n")
    cc = tmp_path / "odd-cc"  # compiles something else into the output path it is given
    cc.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo odd-cc 1; exit 0; fi\n"
                  f"while [ \"$1\" != -o ]; do shift; done\nexec gcc -shared -fPIC -o \"$2\" {empty}\n")
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    first, status = statistics_in_a_process_of_its_own(str(cc), tmp_path)
    assert first == "False 0.0 9999.0 1"
    assert "no fused_stats_f32 symbol" in status
