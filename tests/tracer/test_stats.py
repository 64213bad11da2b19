"""The fast statistics agree with NumPy's float64 answer, whatever the values hold."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpt_shape_tracer.tracer.storage import _fused as fused
from gpt_shape_tracer.tracer.storage import _stats as stats
from gpt_shape_tracer.tracer.storage._stats import finite_flag, summarize, tensor_stats
from gpt_shape_tracer.tracer.storage.records import Finite

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


def statistics_in_a_process_of_its_own(cc: str, cache: Path, *, umask: int = -1,
                                       setup: str = "") -> tuple[str, str, list[str]]:
    """(what the statistics of a tensor holding −∞ came out as, fused.status(), the files mapped into the process
    whose path holds ``fused_stats``) in a fresh process whose C compiler is ``cc``, kernel cache ``cache`` and
    umask ``umask`` (-1: this one's), after running ``setup``: the kernel is built once per process."""
    import os
    import subprocess
    import sys

    probe = setup + (
        "import math, os, torch\n"
        "from gpt_shape_tracer.tracer.storage import _fused as fused\n"
        "from gpt_shape_tracer.tracer.storage._stats import tensor_stats\n"
        "x = torch.arange(10_000, dtype=torch.float32)\n"
        "x[3] = -math.inf\n"
        "s = tensor_stats(x)\n"
        "print(fused.available(), s.min, s.max, s.neg_inf)\n"
        "maps = open('/proc/self/maps').read().splitlines() if os.path.exists('/proc/self/maps') else []\n"
        "print('|'.join(sorted({m.split(None, 5)[-1] for m in maps if 'fused_stats' in m})))\n"
        "print(fused.status())\n"
    )
    env = {**os.environ, "CC": cc, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, check=True, umask=umask)
    first, mapped, *status = done.stdout.splitlines()
    return first, "\n".join(status), [m for m in mapped.split("|") if m]


def test_without_a_compiler_the_statistics_say_why_and_take_the_pytorch_path(tmp_path):
    """A machine whose C compiler fails (here: CC names one that does not exist) gets the same statistics
    from PyTorch's reductions, and fused.status() says why."""
    first, status, _ = statistics_in_a_process_of_its_own(str(tmp_path / "no-such-cc"), tmp_path)
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
    first, status, _ = statistics_in_a_process_of_its_own(str(cc), tmp_path)
    assert first == "False 0.0 9999.0 1"
    assert "no fused_stats_f32 symbol" in status


# A cached library is code this process runs: only a file of ours, in a directory of ours that nobody else can
# write, whose bytes hash to what we recorded when we built it, is loaded (issue 26, item 5).

CC = shutil.which("cc") or "cc"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build a library with")


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A kernel cache directory as a process left it after building the kernel with ``cc`` (copy it to change
    it)."""
    xdg = tmp_path_factory.mktemp("built")
    first, status, _ = statistics_in_a_process_of_its_own(CC, xdg)
    assert first == "True 0.0 9999.0 1", status
    return xdg / "gpt-shape-tracer"


@pytest.fixture
def planted(tmp_path) -> tuple[Path, Path]:
    """(a library that, once loaded, has written the marker file from its constructor and whose
    ``fused_stats_f32`` gives fake statistics, the marker file)."""
    marker = tmp_path / "planted-library-ran"
    source = tmp_path / "planted.c"
    source.write_text(
        "#include <stdio.h>\n#include <stdint.h>\n"
        "struct r { double sum, sum_sq; float min, max; int64_t finite, nan, pos_inf, neg_inf; };\n"
        "__attribute__((constructor)) static void ran(void) {\n"
        f'    FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran\\n", f); fclose(f); }}\n'
        "}\n"
        "void fused_stats_f32(const float *x, int64_t n, struct r *out) {\n"
        "    out->sum = 0; out->sum_sq = n; out->min = -12345.0f; out->max = 12345.0f;\n"
        "    out->finite = n; out->nan = out->pos_inf = out->neg_inf = 0;\n"
        "}\n")
    library = tmp_path / "planted.so"
    import subprocess

    subprocess.run([CC, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library, marker


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def a_copy_of(built_cache: Path, xdg: Path) -> tuple[Path, Path, Path]:
    """(cache directory, library, its sha256 sidecar): a copy of the built cache under ``xdg``."""
    cache = shutil.copytree(built_cache, xdg / "gpt-shape-tracer")
    library = next(cache.glob("fused_stats-*.so"))
    return cache, library, library.with_suffix(".sha256")


def replace(path: Path, content: bytes | str) -> None:
    path.unlink(missing_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)


@needs_cc
def test_a_library_planted_in_a_world_writable_cache_directory_is_not_loaded(tmp_path, built_cache, planted):
    """Anyone can put a file into a mode-777 cache directory: nothing in it is loaded, even a library whose
    recorded hash matches; the kernel is built into a private directory for this process instead."""
    evil, marker = planted
    cache, library, recorded = a_copy_of(built_cache, tmp_path)
    replace(library, evil.read_bytes())
    replace(recorded, sha256(evil) + "\n")
    cache.chmod(0o777)
    first, status, mapped = statistics_in_a_process_of_its_own(CC, tmp_path)
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert first == "True 0.0 9999.0 1", status
    assert f"{cache} is writable by group or others (mode 0o777)" in status and "private directory" in status
    assert mapped and not any(m.startswith(str(cache)) for m in mapped), mapped
    assert library.read_bytes() == evil.read_bytes()  # the untrusted directory is left as it was


@needs_cc
def test_a_cache_directory_of_another_user_is_not_used(tmp_path, built_cache, planted):
    """A cache directory owned by another uid (here the process is made to believe it runs as another uid, so
    nothing on disk is its own and even a private build cannot be trusted): the PyTorch reductions, and
    status() names the owner."""
    evil, marker = planted
    _, library, recorded = a_copy_of(built_cache, tmp_path)
    replace(library, evil.read_bytes())
    replace(recorded, sha256(evil) + "\n")
    believes = "import os\n_uid = os.getuid()\nos.getuid = lambda: _uid + 1\n"
    first, status, mapped = statistics_in_a_process_of_its_own(CC, tmp_path, setup=believes)
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert first == "False 0.0 9999.0 1", status
    assert f"is owned by uid {os.getuid()}, not by this user (uid {os.getuid() + 1})" in status
    assert "PyTorch path" in status and mapped == []


@needs_cc
@pytest.mark.parametrize("sidecar", ["different", "missing"])
def test_a_cached_library_whose_bytes_do_not_match_the_recorded_hash_is_rebuilt(tmp_path, built_cache, planted,
                                                                                sidecar):
    """In a private cache directory, a library that is not what was built (different bytes, or no recorded
    hash) is rebuilt, not loaded: what is loaded then hashes to the recorded sha256."""
    evil, marker = planted
    cache, library, recorded = a_copy_of(built_cache, tmp_path)
    replace(library, evil.read_bytes())
    library.chmod(0o500)
    if sidecar == "missing":
        recorded.unlink(missing_ok=True)  # (the old code wrote none)
    first, status, mapped = statistics_in_a_process_of_its_own(CC, tmp_path)
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert first == "True 0.0 9999.0 1", status
    why = "do not match the sha256 recorded" if sidecar == "different" else "has no recorded sha256"
    assert "rebuilt" in status and why in status, status
    assert sha256(library) == recorded.read_text().strip() == sha256(next(built_cache.glob("*.so")))
    assert mapped == [str(library)]


@needs_cc
@pytest.mark.parametrize("link", ["library", "directory"])
def test_a_symbolic_link_in_the_cache_is_not_followed(tmp_path, built_cache, planted, link):
    """A link in place of the library (to a library with its recorded hash), or of the cache directory (to a
    private directory holding one), is not followed: the library is rebuilt in place of the link, or built
    into a private directory, and the link's target is left as it was."""
    evil, marker = planted
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    if link == "library":
        cache, library, recorded = a_copy_of(built_cache, xdg)
        library.unlink()
        library.symlink_to(evil)
        replace(recorded, sha256(evil) + "\n")
    else:
        elsewhere, library, recorded = a_copy_of(built_cache, tmp_path)
        replace(library, evil.read_bytes())
        replace(recorded, sha256(evil) + "\n")
        cache = xdg / "gpt-shape-tracer"
        cache.symlink_to(elsewhere)
    planted_bytes = evil.read_bytes()
    first, status, mapped = statistics_in_a_process_of_its_own(CC, xdg)
    assert not marker.exists(), "the planted library was loaded through the link: its constructor ran"
    assert first == "True 0.0 9999.0 1", status
    assert "is a symbolic link (not followed)" in status, status
    assert evil.read_bytes() == planted_bytes
    if link == "library":
        assert "rebuilt" in status and not library.is_symlink() and mapped == [str(library)]
        assert sha256(library) == recorded.read_text().strip()
    else:
        assert cache.is_symlink() and "private directory" in status
        assert library.read_bytes() == planted_bytes and not any(m.startswith(str(xdg)) for m in mapped)


@needs_cc
def test_under_umask_000_the_cache_is_private_all_the_same(tmp_path):
    """umask 000 would make the cache directory and the library 0777: they are made 0700 and 0500 explicitly
    (the sidecar 0400, and an XDG_CACHE_HOME that did not exist 0700)."""
    xdg = tmp_path / "xdg"
    first, status, mapped = statistics_in_a_process_of_its_own(CC, xdg, umask=0)
    assert first == "True 0.0 9999.0 1", status
    cache = xdg / "gpt-shape-tracer"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(xdg.stat().st_mode) == 0o700
    files = {p.suffix: stat.S_IMODE(p.lstat().st_mode) for p in cache.iterdir()}
    assert files == {".so": 0o500, ".sha256": 0o400}
    assert mapped == [str(next(cache.glob("*.so")))]


def test_the_cache_key_follows_the_instruction_sets_a_native_build_uses():
    """A ``-march=native`` library uses whatever extensions the CPU exposes: the same CPU model with AVX-512 hidden
    (a virtual machine, another host of the same name) must not load it. The key holds the CPU's flags as well as
    its name, and what the compiler's driver resolves ``-march=native`` to."""
    same_name = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    wide = fused._cpu(same_name + "flags\t\t: fpu sse2 avx2 avx512f avx512bw amx_tile\n\nprocessor\t: 1\n")
    narrow = fused._cpu(same_name + "flags\t\t: fpu sse2 avx2\n")
    assert wide != narrow and "avx512f" in wide and "Xeon" in narrow
    assert "processor\t: 1" not in wide  # the first CPU's lines only
    arm = fused._cpu("processor\t: 0\nFeatures\t: fp asimd sve\nCPU part\t: 0xd40\n")
    assert "sve" in arm
    keys = {fused._cache_key("cc", "12", cpu, target) for cpu in (wide, narrow)
            for target in ("-march=sapphirerapids -mavx512f", "-march=sapphirerapids -mno-avx512f")}
    assert len(keys) == 4
    if shutil.which("cc"):  # this machine's compiler says what -march=native means here, the same each time
        target = fused._target(CC)
        assert target and "-march=native" not in target.split() and target == fused._target(CC), target
