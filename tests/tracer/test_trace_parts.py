"""A trace written in parts (tracer.files.save_trace_part / load_trace_parts): a first file, then after each step
only what the trace added. Read back together they are the trace written whole, record by record; a part read
alone, out of order, of another trace, or after the trace dropped what the files hold is refused with the reason."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from gpt_shape_tracer.tracer import TraceFileError, Tracer, is_derived, load_trace, save_trace
from gpt_shape_tracer.tracer.files import TraceWritten, load_trace_parts, save_trace_part
from gpt_shape_tracer.tracer.generation._traced import TracedGeneration


def written_in_parts(gen, steps: int, folder, compare_at: int | None = None) -> tuple[list, TraceWritten]:
    """Step ``gen`` ``steps`` times, writing after each step what is new (the first write whole)."""
    after, paths = None, []
    for k in range(steps):
        gen.run(1)
        if k == compare_at:
            gen.compare_with_recompute()
        path = folder / ("trace.zip" if after is None else f"trace-from-{after.steps:06d}.zip")
        after = save_trace_part(gen.trace, path, after)
        paths.append(path)
    return paths, after


def assert_same_trace(a, b) -> None:
    """Every record's row (statistics, notes, flags), every value, the steps and the generation's facts equal, to
    the bit — a derived attention stage too, recomputed from the kept Q and K when read, wherever the file's bytes
    put Q and K in memory (tracer/reading/_regions.py aligns them: a part's values sat 40 bytes off a 64-byte
    boundary, and the matmul rounded 14 tokens' scores differently by up to 4e-6)."""
    pd.testing.assert_frame_equal(a.to_frame(), b.to_frame())
    derived = 0
    for ra, rb in zip(a.records, b.records, strict=True):
        va, vb = a.value(ra), b.value(rb)
        assert (va is None) == (vb is None), ra.name
        if va is not None:
            assert torch.equal(va, vb), (ra.step, ra.name)
            derived += is_derived(a, ra)
    assert derived or a.capture == "shapes"  # the fused layers' stages were compared
    assert a.steps == b.steps
    if a.generation is not None:
        assert a.generation.steps == b.generation.steps and a.generation.comparisons == b.generation.comparisons
        assert a.generation.info == b.generation.info


def test_parts_read_back_as_the_trace_written_whole(bundled, tmp_path):
    model, tok = bundled
    gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom said,"], temperature=0.8, seed=5,
                           capture="ops")
    paths, after = written_in_parts(gen, 6, tmp_path, compare_at=3)
    assert after.parts == 6 and after.steps == 6 and after.records == gen.trace.log.n_records
    # what is carried on to the next part is the last step's storages only, not every storage written
    last = gen.trace.log.steps[-1]
    assert 0 < len(after.spans) <= last.end_record - last.first_record
    assert len(gen.trace.generation.comparisons) == 1  # a comparison made at step 3 is in step 3's part
    save_trace(gen.trace, tmp_path / "whole.zip")
    back = load_trace_parts(paths)
    assert_same_trace(back, load_trace(tmp_path / "whole.zip"))
    assert_same_trace(back, gen.trace)
    assert len(back.ops) == len(gen.trace.ops) > 0
    # the KV cache's buffer, which each step's K and V view one position longer, is written once: a part adds
    # the grown rows, not the prefix again (written again, the six files held 2.04x the whole trace's bytes; 1.17x now)
    assert sum(p.stat().st_size for p in paths) < 1.25 * (tmp_path / "whole.zip").stat().st_size
    # each part holds only its own step: the first file the prompt's step, every other one step
    for path, step in zip(paths[1:], range(1, 6)):
        with pytest.raises(TraceFileError, match=f"continues one from step {step}"):
            load_trace(path)


def test_a_part_that_does_not_continue_the_files_before_it_is_refused(bundled, tmp_path):
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0)
    paths, _ = written_in_parts(gen, 4, tmp_path)
    with pytest.raises(TraceFileError, match="its first part is missing"):
        load_trace_parts(paths[1:])
    with pytest.raises(TraceFileError, match=r"files before it end at \{'steps': 1"):
        load_trace_parts([paths[0], paths[2]])  # step 1's part left out
    with pytest.raises(TraceFileError, match="a whole trace"):
        load_trace_parts([paths[0], paths[0]])
    other = TracedGeneration(model, tok, "Tom said, look!", temperature=0)
    (tmp_path / "b").mkdir()
    others, _ = written_in_parts(other, 2, tmp_path / "b")
    with pytest.raises(TraceFileError, match="its generation differs"):
        load_trace_parts([paths[0], others[1]])  # the same numbering, another prompt


def test_after_a_discard_the_trace_is_written_whole_again(bundled, tmp_path):
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0)
    paths, after = written_in_parts(gen, 3, tmp_path)
    assert after.continued_by(gen.trace)
    gen.trace.log.discard_from(2)  # what a rewind does: the files hold a step the trace no longer has
    gen.run(1)
    assert not after.continued_by(gen.trace)
    with pytest.raises(TraceFileError, match="write it whole"):
        save_trace_part(gen.trace, tmp_path / "next.zip", after)
    again = save_trace_part(gen.trace, tmp_path / "whole.zip")
    assert again.parts == 1 and again.steps == 3


def test_a_comparison_added_to_a_written_step_makes_the_next_write_whole(bundled, tmp_path):
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0)
    _, after = written_in_parts(gen, 2, tmp_path)
    gen.compare_with_recompute()  # about step 1, written already: no part after it would carry it
    gen.run(1)
    assert not after.continued_by(gen.trace)
    # measured again (the KV cache tab's "Measure this step again"): the same step, another comparison
    gen.compare_with_recompute()
    after = save_trace_part(gen.trace, tmp_path / "again.zip")
    assert after.continued_by(gen.trace)
    gen.compare_with_recompute(timing_repeats=2)
    assert not after.continued_by(gen.trace)


class FailsWhenAsked(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.fail = inner, False

    def forward(self, *args, **kwargs):
        if self.fail:
            raise RuntimeError("asked to fail")
        return self.inner(*args, **kwargs)


def test_a_failed_step_is_written_with_its_records_and_nothing_continues_it(tmp_path):
    from gpt_shape_tracer.model import load_bundled

    model, _ = load_bundled()
    model.blocks[1].mlp = FailsWhenAsked(model.blocks[1].mlp)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="asked to fail"), torch.no_grad(), Tracer(model) as tr:
        model(ids)
        first = save_trace_part(tr.trace, tmp_path / "trace.zip")
        model.blocks[1].mlp.fail = True
        model(ids)  # the exception leaves the traced block: the step's records are kept, with the error
    second = save_trace_part(tr.trace, tmp_path / "trace-from-000001.zip", first)
    assert second.ends_in_failure and second.steps == 1 and second.records == tr.trace.log.n_records > first.records
    back = load_trace_parts([tmp_path / "trace.zip", tmp_path / "trace-from-000001.zip"])
    assert back.error is not None and back.error.describe() == tr.trace.error.describe()
    assert back.log.n_records == tr.trace.log.n_records and back.n_steps == 1
    # the next step drops the failed attempt's records: no part can continue files that hold them
    assert not second.continued_by(tr.trace)
    with pytest.raises(TraceFileError, match="write it whole"):
        save_trace_part(tr.trace, tmp_path / "next.zip", second)


def misaligned(t: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """A contiguous copy of ``t`` starting ``offset_bytes`` past a 64-byte boundary (where a file's bytes may put
    a loaded value)."""
    flat = torch.empty(t.numel() + 16, dtype=t.dtype)
    start = offset_bytes // t.element_size()
    out = flat[start:start + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 64 == offset_bytes and out.is_contiguous()
    return out


def test_a_derived_stage_is_the_same_wherever_its_q_and_k_sit_in_memory(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Lily had a red kite. She ran and ran.", temperature=0)
    gen.run(3)
    trace = gen.trace
    records = [r for r in trace.filter(step=2) if is_derived(trace, r)]
    assert records
    live = {r.index: trace.value(r).clone() for r in records}
    get = trace.get
    for offset in range(4, 64, 4):
        trace.derived_memo.clear()
        trace.attention_memo.clear()
        trace.get = lambda name, step=None, offset=offset: (  # noqa: E731 - the reader asks through trace.get
            None if (v := get(name, step)) is None else misaligned(v, offset))
        try:
            for r in records:
                assert torch.equal(trace.value(r), live[r.index]), (offset, r.name)
        finally:
            del trace.get


def test_a_part_that_names_a_storage_it_does_not_hold_is_refused(bundled, tmp_path):
    """Each part numbers its own storages; one that names a storage past its own (which, read together, would be
    the next part's) is refused, naming the file."""
    import io
    import zipfile

    model, tok = bundled
    gen = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0)
    paths, _ = written_in_parts(gen, 3, tmp_path)
    with zipfile.ZipFile(paths[1]) as zf:
        members = {info.filename: zf.read(info) for info in zf.infolist()}
    frame = pd.read_parquet(io.BytesIO(members["records.parquet"]))
    kept = frame["storage"] >= 0
    frame.loc[kept.idxmax(), "storage"] = frame["storage"].max() + 1  # the first storage of the next part
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    members["records.parquet"] = buf.getvalue()
    with zipfile.ZipFile(paths[1], "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    with pytest.raises(TraceFileError, match=r"^trace-from-000001.zip records.parquet: column storage has values "
                                             r"outside \[-1, \d+\]"):
        load_trace_parts(paths)
