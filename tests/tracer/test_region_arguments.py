"""The region readers (tracer/reading/_regions.py) refuse arguments they cannot answer with a RegionError (a
ValueError) naming the range — a float row or head, a sequence, row or top out of range, bins 0, a negative sink —
and a head listed a million times is refused before Q and K are gathered for each copy (checked in a child process
whose address space is capped a margin above what it holds, with its peak resident memory measured)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import GPT, GPTConfig
from gpt_shape_tracer.model.gpt import attention_path
from gpt_shape_tracer.tracer import (
    RegionError,
    Tracer,
    attention_overview,
    attention_region,
    head_statistics,
    query_row,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
PATTERN = "blocks.1.attn.hook_pattern"


@pytest.fixture(scope="module")
def fused():
    """A fused-attention trace of a tiny Llama: its patterns are derived (recomputed from Q and K)."""
    torch.manual_seed(1)
    config = GPTConfig.for_family("llama", vocab_size=64, n_ctx=64, d_model=64, n_layer=2, n_head=4, n_kv_head=2)
    model = GPT(config).eval()
    with torch.no_grad(), attention_path("fused"), Tracer(model) as tr:
        model(torch.randint(0, 64, (1, 40)))
    return tr.trace


BAD = {
    "float rows": (attention_region, dict(rows=(0.0, 1.0)), "rows must be a non-empty range"),
    "float head": (attention_region, dict(heads=[0.5]), "heads must lie in \\[0, 4\\) as whole numbers, got 0.5"),
    "a head twice": (attention_region, dict(heads=[1, 1]), "head 1 is listed twice"),
    "no heads": (attention_region, dict(heads=[]), "empty list"),
    "query_row batch 5": (query_row, dict(row=0, batch=5), "batch \\(the record has 1 sequences\\) must be"),
    "query_row batch -1": (query_row, dict(row=0, batch=-1), "batch .* in \\[0, 1\\), got -1"),
    "query_row top -1": (query_row, dict(row=0, top=-1), "top must be a whole number ≥ 1, got -1"),
    "query_row row 40": (query_row, dict(row=40), "row must be a whole number in \\[0, 40\\), got 40"),
    "query_row float head": (query_row, dict(row=0, head=1.5), "head .* got 1.5"),
    "overview bins 0": (attention_overview, dict(bins=0), "bins must be a whole number ≥ 1, got 0"),
    "overview batch -1": (attention_overview, dict(batch=-1), "got -1"),
    "statistics sink -5": (head_statistics, dict(sink=-5), "sink .* ≥ 0, got -5"),
    "statistics top 0": (head_statistics, dict(top=0), "top must be a whole number ≥ 1, got 0"),
    "statistics batch 2": (head_statistics, dict(batch=2), "batch .* got 2"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_argument_is_a_clear_value_error(fused, case):
    reader, kwargs, message = BAD[case]
    with pytest.raises(RegionError, match=message):
        reader(fused, PATTERN, 0, **kwargs)


def test_good_arguments_still_answer(fused):
    region = attention_region(fused, PATTERN, 0, rows=(3, 5), cols=(0, 4), heads=[3, 0])
    assert region.shape == (1, 2, 2, 4)
    weights, top = query_row(fused, PATTERN, 0, row=39, head=2, top=3)
    assert weights.shape == (40,) and len(top) == 3 and abs(float(weights.sum()) - 1) < 1e-5
    assert attention_overview(fused, PATTERN, 0, bins=1).mean.shape == (1, 1)
    assert len(head_statistics(fused, PATTERN, 0, sink=0, top=1)) == 4


def test_a_head_listed_a_million_times_is_refused_before_anything_is_gathered():
    """It once passed the cap (10⁶ cells of answer) and gathered Q and K per copy: 7.8 GB. The child's address
    space is capped 1 GiB above what it has mapped once torch is loaded and the trace made (a margin of its own,
    whatever the machine maps for its libraries), and its peak resident memory must grow by < 64 MiB."""
    probe = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        torch.set_num_threads(1)
        from gpt_shape_tracer.model import GPT, GPTConfig
        from gpt_shape_tracer.model.gpt import attention_path
        from gpt_shape_tracer.tracer import RegionError, Tracer, attention_region
        torch.manual_seed(1)
        config = GPTConfig.for_family("llama", vocab_size=64, n_ctx=64, d_model=64, n_layer=2, n_head=4, n_kv_head=2)
        model = GPT(config).eval()
        with torch.no_grad(), attention_path("fused"), Tracer(model) as tr:
            model(torch.randint(0, 64, (1, 40)))
        heads = [0] * 10**6
        mapped = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize:")))
        resource.setrlimit(resource.RLIMIT_AS, ((mapped << 10) + (1 << 30), resource.RLIM_INFINITY))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            attention_region(tr.trace, "{PATTERN}", 0, rows=(0, 1), cols=(0, 1), heads=heads)
            print("ANSWERED")
        except RegionError as e:
            print("REFUSED", e)
        print("GREW_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED head 0 is listed twice" in done.stdout, done.stdout
    grew = int(done.stdout.split("GREW_KIB")[1].split()[0])
    assert grew < 64 * 1024, done.stdout
