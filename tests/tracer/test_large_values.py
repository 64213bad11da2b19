"""A very large value costs the Inspector time in proportion to its size and memory bounded whatever its size.

The statistics, the pooled digest of attention weights, the Inspector's heatmap and histogram read a tensor of
more than ``WHOLE_UP_TO`` elements block by block. Two kinds of test: the blocked answers equal the whole-tensor
ones (NumPy's float64 or torch's adaptive pooling, on tensors a few blocks long), and a fresh process takes all
four of a stride-0 view that claims 4 GiB over 256 KiB of real numbers with its peak resident memory growing by
less than ``GREW_MIB`` — a copy of the whole (the old ``.float().reshape``, ``.flatten()``, ``.contiguous()``)
would need 4 GiB. (8 GiB views take twice as long and show nothing more: the cost is the elements read.)
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gpt_shape_tracer.figures.heatmap as heatmap
import gpt_shape_tracer.figures.inspector as inspector
import gpt_shape_tracer.tracer.storage._stats as stats
from gpt_shape_tracer.tracer.storage._log import pooled

ROOT = Path(__file__).resolve().parents[2]


def numpy_stats(x: torch.Tensor) -> tuple[float, float, float, float, int, int, int]:
    a = x.double().numpy().reshape(-1)
    finite = a[np.isfinite(a)]
    return (float(finite.min()), float(finite.max()), float(finite.mean()), float(finite.std()),
            int(np.isnan(a).sum()), int(np.isposinf(a).sum()), int(np.isneginf(a).sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_statistics_taken_block_by_block_equal_numpys_over_the_whole(monkeypatch, dtype):
    monkeypatch.setattr(stats, "WHOLE_UP_TO", 1000)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 13, 37, generator=g) * 3 + 100).to(dtype)  # 10 101 elements: 11 blocks and a bit
    x[0, 0, 0, 0], x[6, 2, 12, 36], x[3, 1, 5, 5] = math.nan, math.inf, -math.inf
    x[2] = -math.inf  # a block with no finite value at all
    strided = x.transpose(1, 3)  # not contiguous: each block is its own copy
    for t in (x, strided):
        got = stats.tensor_stats(t)
        lo, hi, mean, std, nan, pos, neg = numpy_stats(t)
        assert (got.min, got.max, got.nan, got.pos_inf, got.neg_inf) == (lo, hi, nan, pos, neg)
        assert math.isclose(got.mean, mean, rel_tol=1e-6) and math.isclose(got.std, std, rel_tol=1e-4)
    assert len(list(stats.value_blocks(x, 1000))) > 10


def test_value_blocks_hold_each_element_once():
    x = torch.arange(5 * 7 * 11).reshape(5, 7, 11)
    for most in (1, 6, 11, 12, 77, 78, 385, 1000):
        parts = list(stats.value_blocks(x, most))
        assert all(p.numel() <= most for p in parts)
        assert torch.equal(torch.cat([p.reshape(-1) for p in parts]), x.reshape(-1))


def test_the_digest_of_a_large_pattern_equals_adaptive_pooling_of_the_whole(monkeypatch):
    import gpt_shape_tracer.tracer.storage._log as log

    g = torch.Generator().manual_seed(1)
    weights = torch.softmax(torch.randn(2, 3, 300, 257, generator=g), dim=-1)  # bins of uneven, overlapping rows
    whole = torch.nn.functional.adaptive_avg_pool2d(weights.reshape(6, 300, 257), (128, 128)).reshape(2, 3, 128, 128)
    monkeypatch.setattr(log, "WHOLE_UP_TO", 10_000)
    blocked = pooled(weights)
    assert blocked.shape == whole.shape
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("masked", [False, True])
def test_the_heatmap_of_a_large_slice_pooled_tile_by_tile_equals_the_whole_pooling(masked):
    g = torch.Generator().manual_seed(2)
    m = torch.randn(1031, 517, generator=g)
    if masked:  # a causal −∞ and a NaN: left out of their block's mean; a block of nothing but −∞ is NaN
        m = m.masked_fill(torch.ones(1031, 517, dtype=torch.bool).triu(1), -math.inf)
        m[500, 3] = math.nan
    whole, report = heatmap.pool_reported(m, 256, 256)
    # what the caption reads: the cells left out, each counted once (1031 rows in 256 blocks share rows)
    assert (report.minus_inf, report.nan, report.plus_inf) == ((517 * 516 // 2, 1, 0) if masked
                                                                else (0, 0, 0))
    for tile in (200, 517, 5000, 100_000):  # a tile narrower than a row, one row, several rows
        tiled, tiled_report = heatmap.pool_reported(m, 256, 256, whole_up_to=tile)
        torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert tiled_report == report, tile


def test_a_histogram_of_every_value_counted_block_by_block_equals_numpys(monkeypatch):
    monkeypatch.setattr(inspector, "WHOLE_UP_TO", 999)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 250, generator=g)
    x[5, 5], x[7, 1] = math.inf, math.nan
    fig = inspector.histogram_figure(x, "x", bins=10, every_value=True)
    finite = x[torch.isfinite(x)].double().numpy()
    expected, _ = np.histogram(finite, bins=10, range=(finite.min(), finite.max()))
    assert list(fig.data[0].y) == expected.tolist()
    assert "all 9,998 finite values (2 NaN/±∞ not drawn)" in fig.layout.title.text


PROBE = """
import resource, torch
torch.set_num_threads(2)
from gpt_shape_tracer.figures.inspector import histogram_figure, slice_2d, tensor_heatmap_figure
from gpt_shape_tracer.tracer import tensor_stats
from gpt_shape_tracer.tracer.storage._log import pooled
row = torch.rand(32768, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
# each summary once on a small view: the statistics kernel loaded, plotly's figure classes imported (their cost is
# not the case's)
small = row.expand(1, 1, 2, 32768)
tensor_stats(small), pooled(small), histogram_figure(small, "x")
tensor_heatmap_figure(slice_2d(small, 2, 3, {0: 0, 1: 0}), "x")
# a cap a margin above what this process maps now, whatever the machine maps for its libraries and threads (a
# fixed 3 GiB cap failed on a many-core Xeon): far below the 4 GiB a copy of the view would need
mapped = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize:"))) << 10
resource.setrlimit(resource.RLIMIT_AS, (mapped + (3 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    torch.empty(1 << 31)  # the cap holds: a copy of the whole would fail like this
    print("uncapped")
except RuntimeError:
    pass
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
claims = row.expand(1, 4, 4096, 32768)  # 2^29 float64 elements: 4 GiB over 256 KiB
s = tensor_stats(claims)
print("stats", s.min, s.max, s.mean, s.std, float(row.min()), float(row.max()), float(row.double().mean()),
      float(row.double().std(correction=0)))
d = pooled(claims)
by_columns = torch.nn.functional.adaptive_avg_pool1d(row[None, None], 128)[0, 0]
print("digest", list(d.shape), float((d - by_columns).abs().max()))
wide = row.expand(1, 16384, 32768)  # one slice of 4 GiB
fig = tensor_heatmap_figure(slice_2d(wide, 1, 2, {0: 0}), "x")
print("heatmap", len(fig.data[-1].z), len(fig.data[-1].z[0]))
h = histogram_figure(claims, "x")
print("histogram", int(sum(h.data[0].y)))
print("grew_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""

# peak resident memory the summaries of a 4 GiB view may add. They read it block by block (blocks of 2^24
# elements): 130 to 630 MiB measured on a 2-core machine, by whether the allocator reuses a freed block or maps a
# new one; a copy of the view would be 4 GiB
GREW_MIB = 1536


def test_a_view_claiming_4_gib_is_summarised_in_a_bounded_resident_memory():
    """The bound is on what the case really uses, its peak resident memory (ru_maxrss), not on the address space:
    a fixed address-space cap depends on what the machine maps for libraries, threads and malloc arenas. The
    address space is capped too, but a margin above what the process maps once loaded, so a regression that
    copies the view fails fast instead of swapping."""
    env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_ARENA_MAX="2")  # threads and arenas not per core
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
    assert "uncapped" not in lines
    lo, hi, mean, std, row_lo, row_hi, row_mean, row_std = map(float, lines["stats"])
    assert (lo, hi) == (row_lo, row_hi)
    assert math.isclose(mean, row_mean, rel_tol=1e-5) and math.isclose(std, row_std, rel_tol=1e-4)
    assert lines["digest"][:4] == ["[1,", "4,", "128,", "128]"] and float(lines["digest"][4]) < 1e-5
    assert lines["heatmap"] == ["256", "256"]
    assert lines["histogram"] == [str(inspector.HISTOGRAM_SAMPLE)]
    grew_mib = int(lines["grew_kib"][0]) / 1024
    assert grew_mib < GREW_MIB, f"{grew_mib:.0f} MiB of resident memory to summarise a 4 GiB view"
