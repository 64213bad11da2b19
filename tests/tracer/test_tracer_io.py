"""Saving and loading traces, and refusing malformed ones; the command line."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest
import torch

from gpt_shape_tracer.tracer import TraceFileError, is_derived, load_trace, save_trace
from gpt_shape_tracer.tracer.files._format import Limits
from gpt_shape_tracer.tracer.files._save import write_archive
from gpt_shape_tracer.tracer.generation._traced import TracedGeneration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generation(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom said,"], capture="ops", temperature=0)
    gen.run(3)
    return gen


@pytest.mark.parametrize("suffix", [".zip", ""])
def test_round_trip_keeps_records_values_ops_steps_and_facts(generation, tmp_path, suffix):
    t = generation.trace
    generation.compare_with_recompute()
    path = tmp_path / f"trace{suffix}"
    save_trace(t, path)
    back = load_trace(path)
    a, b = t.to_frame(), back.to_frame()
    pd.testing.assert_frame_equal(a.drop(columns=["shape"]), b.drop(columns=["shape"]))
    assert list(a["shape"]) == list(b["shape"])
    for name in ("blocks.2.attn.hook_pattern", "hook_logits", "blocks.0.attn.hook_mask", "model:in[0]"):
        for step in range(3):
            assert torch.equal(t.get(name, step), back.get(name, step)), (name, step)
    assert len(back.ops) == len(t.ops) and back.ops[5] == t.ops[5]
    assert back.steps == t.steps and back.capture == "ops"
    assert back.generation == t.generation  # prompts, tokens, labels, sampling, every step, the comparison
    assert back.model == t.model and back.model.name == "story-gpt"


def test_the_table_opens_with_plain_pandas(generation, tmp_path):
    save_trace(generation.trace, tmp_path / "t")
    frame = pd.read_parquet(tmp_path / "t" / "records.parquet")
    assert {"step", "name", "shape", "axes", "dtype", "numel", "nbytes"} <= set(frame.columns)
    width = generation.info.prompt_width
    assert list(frame[frame["name"] == "hook_logits"]["shape"].iloc[0]) == [2, width, 1024]


def test_a_failed_forward_round_trips_its_error(tmp_path, bundled):
    from gpt_shape_tracer.tracer import Tracer
    from tests.tracer.test_tracer_capture import MissingTranspose

    model, _ = bundled
    from gpt_shape_tracer.model import load_bundled

    broken, _ = load_bundled()
    broken.blocks[0].attn = MissingTranspose(broken.blocks[0].attn)
    with pytest.raises(RuntimeError), torch.no_grad(), Tracer(broken, capture="ops") as tr:
        broken(torch.tensor([[1, 2, 3]]))
    save_trace(tr.trace, tmp_path / "err.zip")
    back = load_trace(tmp_path / "err.zip")
    assert back.error.module == "blocks.0.attn" and back.error.op == "Tensor.matmul"
    assert back.error.describe() == tr.trace.error.describe()


def rewrite(archive: bytes, name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, data if info.filename == name else src.read(info.filename))
    return out.getvalue()


def member(archive: bytes, name: str) -> bytes:
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        return zf.read(name)


def archive_bytes(trace) -> bytes:
    buf = io.BytesIO()
    write_archive(trace, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def archive(generation) -> bytes:
    return archive_bytes(generation.trace)


def test_truncated_archive_is_refused(archive):
    with pytest.raises(TraceFileError, match="trace archive"):
        load_trace(archive[: len(archive) // 2])


def test_wrong_version_is_refused(archive):
    manifest = json.loads(member(archive, "manifest.json"))
    manifest["version"] = 99
    with pytest.raises(TraceFileError, match="version 99"):
        load_trace(rewrite(archive, "manifest.json", json.dumps(manifest).encode()))


def test_not_a_trace_manifest_is_refused(archive):
    with pytest.raises(TraceFileError, match="not a gpt-shape-trace manifest"):
        load_trace(rewrite(archive, "manifest.json", b'{"format": "something else"}'))


def test_table_shapes_that_disagree_with_the_values_are_refused(archive):
    for name, shape, refusal in (
            ("blocks.0.attn.hook_z", [2, 4, 70, 8],
             r"record \d+: its view reaches element \d+ of a storage of \d+"),
            # a derived stage holds no value: its shape is checked against its mask description
            ("blocks.0.attn.hook_pattern", [2, 4, 7, 8],
             r"record \d+: a derived 'pattern' of shape \[2, 4, 7, 8\] does not match its mask description")):
        frame = pd.read_parquet(io.BytesIO(member(archive, "records.parquet")))
        row = frame.index[frame.name == name][0]
        frame.at[row, "shape"] = shape
        buf = io.BytesIO()
        frame.to_parquet(buf, index=False)
        with pytest.raises(TraceFileError, match=refusal):
            load_trace(rewrite(archive, "records.parquet", buf.getvalue()))


def test_a_huge_declared_value_size_is_refused_before_allocating(archive):
    manifest = json.loads(member(archive, "manifest.json"))
    entries = {f"s{k}": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}
               for k in range(manifest["counts"]["storages"])}
    header = json.dumps(entries).encode()
    bogus = struct.pack("<Q", len(header)) + header + b"\0" * 64
    with pytest.raises(TraceFileError, match="declares 1099511627776 elements"):
        load_trace(rewrite(archive, "values.safetensors", bogus))
    with pytest.raises(TraceFileError, match="more than 1000 bytes"):
        load_trace(archive, limits=Limits(value_bytes=1000))


def test_a_huge_declared_header_is_refused(archive):
    bogus = struct.pack("<Q", 2**40) + b"{}"
    with pytest.raises(TraceFileError, match="header"):
        load_trace(rewrite(archive, "values.safetensors", bogus))


def test_unexpected_archive_members_and_missing_paths_are_refused(archive, tmp_path):
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("../evil.py", b"print('no')")
    with pytest.raises(TraceFileError, match="unexpected member"):
        load_trace(out.getvalue())
    with pytest.raises(TraceFileError, match="no such trace"):
        load_trace(tmp_path / "missing.zip")
    with pytest.raises(TraceFileError, match="Parquet"):
        load_trace(rewrite(archive, "records.parquet", b"PAR1 this is not parquet"))


def test_command_line_writes_a_trace_and_prints_the_shape_table(tmp_path):
    out = tmp_path / "cli.zip"
    proc = subprocess.run(
        [sys.executable, "-m", "gpt_shape_tracer", "trace", "--prompt", "Once upon a time", "--steps", "3",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "step 2: n = 1, t = 6" in proc.stdout
    assert "blocks.0.attn.hook_pattern" in proc.stdout and "[1, 4, 1, 6]" in proc.stdout
    back = load_trace(out)
    assert back.n_steps == 3 and back.record("blocks.3.attn.hook_k_all", 2).shape == (1, 4, 6, 32)


def test_command_line_reports_bad_input_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gpt_shape_tracer", "trace", "--prompt", "hi", "--model-dir", str(tmp_path / "nope"),
         "--out", str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "no such directory" in proc.stderr and "Traceback" not in proc.stderr


def test_a_record_whose_dtype_disagrees_with_its_value_is_refused(archive):
    """records.parquet says float16 where values.safetensors holds float32: the file is refused, naming the
    record, rather than showing numbers under the wrong dtype."""
    frame = pd.read_parquet(io.BytesIO(member(archive, "records.parquet")))
    row = frame.index[frame.name == "blocks.0.attn.hook_z"][0]  # a kept value (the pattern is derived: no value)
    assert frame.at[row, "dtype"] == "float32"
    frame.at[row, "dtype"] = "float16"
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    with pytest.raises(TraceFileError, match=r"record \d+.*float16"):
        load_trace(rewrite(archive, "records.parquet", buf.getvalue()))


def test_why_a_value_is_missing_survives_a_round_trip(bundled, tmp_path):
    """A value dropped because it was changed in place, and values evicted by the budget, keep their notes
    (what the Inspector says instead of a heatmap) in the saved file."""
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Once upon a time", budget_bytes=64 * 1024)
    gen.run(3)
    trace = gen.trace
    noted = {(r.step, r.name): trace.value_note(r) for r in trace.records if trace.value_note(r)}
    assert len(noted) > 10  # the budget evicted most of step 0
    loaded = load_trace(save_trace(trace, tmp_path / "t.zip"))
    assert {(r.step, r.name): loaded.value_note(r) for r in loaded.records if loaded.value_note(r)} == noted
    gen.close()


def test_the_number_checks_say_what_they_expected_and_where():
    """Every number read from a file passes one of these: whole or not, finite or not, in range, never a
    bool; a refusal names the field and the value."""
    import math

    from gpt_shape_tracer.tracer.files._schema import Float, Int

    delta = Float(0, finite=False)  # max |Δ logits|: may be NaN or ∞, which JSON writes as strings
    assert math.isnan(delta("nan", "d")) and delta("inf", "d") == math.inf and delta(0, "d") == 0.0
    assert isinstance(delta(0, "d"), float)
    with pytest.raises(TraceFileError, match=r"^d: -inf is outside \[0, inf\]$"):
        delta("-inf", "d")
    with pytest.raises(TraceFileError, match=r"^d: expected a number, got str 'NaN'$"):
        delta("NaN", "d")  # only the three spellings JSON output uses
    with pytest.raises(TraceFileError, match=r"^tol: expected a number, got str 'inf'$"):
        Float(0)("inf", "tol")  # a finite field does not take the strings
    with pytest.raises(TraceFileError, match=r"^tol: expected a finite number, got inf$"):
        Float(0)(math.inf, "tol")
    count = Int(1, 64)
    assert count(3, "batch") == 3
    for bad, said in ((1.5, "float '1.5'"), (True, "bool 'True'"), ("3", "str '3'")):
        with pytest.raises(TraceFileError) as e:
            count(bad, "batch")
        assert str(e.value) == f"batch: expected a whole number, got {said}" and e.value.field == "batch"
    with pytest.raises(TraceFileError, match=r"^batch: 65 is outside \[1, 64\]$"):
        count(65, "batch")


@pytest.mark.parametrize("capture", ["shapes", "values", "ops"])
def test_a_1024_token_prefill_round_trips_at_every_capture_level(bundled, tmp_path, capture):
    """A trace loads back whatever the prompt's length: the strides of ``[B, H, n, n]`` scores (``H·n²``, ``n²``,
    ``n``, 1) were once checked as if they were a shape, and a prompt of 195 tokens or more could not be reopened."""
    from gpt_shape_tracer.model import GPT, GPTConfig

    _, tok = bundled
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, n_ctx=2048, d_model=16, n_layer=1, n_head=2)).eval()
    words = "Lily had a red kite and Tom said yes to the big dog at the park. "
    prompt = words * 80
    assert len(tok.encode(prompt)) >= 1024
    gen = TracedGeneration(model, tok, prompt, capture=capture, temperature=0,
                           budget_bytes=512 * 2**20)
    gen.run(2)
    n = gen.info.prompt_width
    assert n >= 1024
    save_trace(gen.trace, tmp_path / "long")
    back = load_trace(tmp_path / "long")
    assert back.steps == gen.trace.steps and back.generation == gen.trace.generation
    if capture != "shapes":
        for name in ("blocks.0.attn.hook_qk", "blocks.0.attn.hook_pattern", "hook_logits"):
            for step in range(2):
                live, read = gen.trace.get(name, step), back.get(name, step)
                if is_derived(back, name, step):  # recomputed from Q and K each side: equal to float32 rounding
                    assert torch.equal(torch.isinf(live), torch.isinf(read)), (name, step)
                    finite = torch.isfinite(live)
                    assert float((live[finite] - read[finite]).abs().max()) <= 1e-6, (name, step)
                else:
                    assert torch.equal(live, read), (name, step)
        assert tuple(back.get("blocks.0.attn.hook_pattern", 0).shape) == (1, 2, n, n)


@pytest.mark.parametrize("what", [12345, None, 3.5, ["trace.zip"]])
def test_load_trace_of_something_that_is_not_a_path_says_so(what):
    with pytest.raises(TraceFileError, match="takes a path or the bytes of a .zip"):
        load_trace(what)


@pytest.mark.parametrize("field, value", [("probs", [1.5]), ("probs", [-0.25]), ("stage_probs", [[[1.5] * 20]])])
def test_a_probability_outside_0_to_1_is_refused_naming_the_field(archive, field, value):
    """A chosen token's probability of 1.5 (or a candidate's) is no probability: the file is refused, and the
    refusal says which field of which step."""
    manifest = json.loads(member(archive, "manifest.json"))
    sampling = manifest["generation"]["steps"][1]["sampling"]
    sampling[field] = value * len(sampling[field]) if field == "probs" else value + sampling[field][1:]
    where = rf"generation\.steps\[1\]\.sampling\.{field}\[0\]"
    with pytest.raises(TraceFileError, match=where + r".*: -?[0-9.]+ is outside \[0, 1\]"):
        load_trace(rewrite(archive, "manifest.json", json.dumps(manifest).encode()))


@pytest.mark.parametrize(("total", "loads"), [(1.5, False), (1.01, False), (1.0005, True)])
def test_a_stage_whose_probabilities_add_up_to_more_than_1_is_refused_and_rounding_is_not(archive, total, loads):
    """Each candidate's probability may lie in [0, 1] while their sum does not: a stage adding up to 1.5 (or 1.01)
    is refused with its sum; 1.0005, within what float32 rounding over a vocabulary can add, loads."""
    manifest = json.loads(member(archive, "manifest.json"))
    stage = manifest["generation"]["steps"][1]["sampling"]["stage_probs"][0][0]  # sequence 0, first stage
    assert len(stage) >= 2
    stage[:] = [total / 2, total / 2] + [0.0] * (len(stage) - 2)  # each ≤ 1, the sum `total`
    data = rewrite(archive, "manifest.json", json.dumps(manifest).encode())
    if loads:
        assert sum(load_trace(data).generation.steps[1].sampling.stage_probs[0][0]) == pytest.approx(total)
    else:
        with pytest.raises(TraceFileError, match=rf"sequence 0, stage 0: the probabilities add up to {total:g}, "
                                                 "more than 1"):
            load_trace(data)


@pytest.mark.parametrize("field", ["records", "records_per_step", "ops", "steps", "modules", "value_bytes",
                                   "table_bytes", "manifest_bytes"])
def test_every_trace_the_writer_saves_loads_back_and_the_rest_is_refused_before_writing(generation, tmp_path,
                                                                                       monkeypatch, field):
    """Whatever the limits (here swept from 1 up, one field at a time), save_trace either refuses with the numbers
    and writes nothing, or writes a file load_trace reads back under the same limits: never a saved run its own
    reader refuses (a 48-layer, 150-step shapes run held 318,600 records against a 300,000 limit; a 4 GiB spill
    against a 2 GiB values limit)."""
    import dataclasses

    import gpt_shape_tracer.tracer.files._save as io_module  # the writer checks against the reader's LIMITS

    outcomes = []
    for k, limit in enumerate(10**e for e in range(0, 10)):
        limits = dataclasses.replace(Limits(), **{field: limit})
        monkeypatch.setattr(io_module, "LIMITS", limits)
        path = tmp_path / f"t{k}.zip"
        try:
            save_trace(generation.trace, path)
        except TraceFileError as e:
            assert "cannot be saved as one that loads back" in str(e) and f"limit of {limit} " in str(e)
            assert not path.exists()  # refused before the file was created
            outcomes.append("refused")
            continue
        back = load_trace(path, limits=limits)
        assert back.log.n_records == generation.trace.log.n_records
        outcomes.append("loads")
    assert "refused" in outcomes and "loads" in outcomes, outcomes  # the sweep crossed this trace's own size


def test_the_default_limits_load_a_48_layer_model_traced_for_150_steps(bundled):
    """The records a step holds grow by a fixed number per layer: measured here on 1- and 2-layer models (shapes
    only, 3 steps), a 48-layer run of 150 steps must fit the reader's default limits (it held 318,600 records
    against a limit of 300,000, and its own reader refused it)."""
    from gpt_shape_tracer.model.gpt import GPT, GPTConfig

    _, tok = bundled
    per_step = []
    for n_layer in (1, 2):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_ctx=64, d_model=8, n_layer=n_layer, n_head=2)).eval()
        gen = TracedGeneration(model, tok, "Lily", capture="shapes", temperature=0, stop_at_eos=False)
        gen.run(3)
        steps = gen.trace.log.steps
        per_step.append(max(s.end_record - s.first_record for s in steps[1:]))  # a decode step
    per_layer = per_step[1] - per_step[0]
    at_48 = per_step[0] + 47 * per_layer
    assert per_layer > 0 and Limits().records >= 150 * at_48 and Limits().records_per_step >= at_48
