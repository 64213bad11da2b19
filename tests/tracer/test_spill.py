""""Keep every value" (``spill_bytes``): what the budget evicts is written to a private temporary file and read
back when asked for — every value of a run exactly as a run with a budget large enough for all of it, the
in-memory budget still kept, the disk cap respected with a note from where, and the export complete."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from gpt_shape_tracer.tracer import TracedGeneration, load_trace, save_trace

PROMPTS = ["Once upon a time, there was a little girl named Lily. She had a red ball.", "Tom ran"]
BUDGET = 256 * 1024


def run(bundled, **kwargs) -> TracedGeneration:
    model, tok = bundled
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0, **kwargs)
    gen.run(12)
    return gen


def test_every_value_is_kept_exactly_and_memory_stays_within_the_budget(bundled, tmp_path):
    everything = run(bundled, budget_bytes=1 << 30).trace
    spilled = run(bundled, budget_bytes=BUDGET, spill_bytes=1 << 30).trace
    plain = run(bundled, budget_bytes=BUDGET).trace
    kept = [r for r in everything.records if everything.log.has_value(r.index)]  # held, not derived
    assert sum(plain.value(r) is None for r in kept) > len(kept) // 2  # without the spill most are statistics
    assert all(spilled.has_value(r) and torch.equal(spilled.value(r), everything.value(r)) for r in kept)
    assert spilled.log.peak_bytes_kept <= BUDGET < spilled.log.spilled_bytes
    assert all(spilled.value_note(r) == "" for r in kept)
    # every view reads them: the attention pattern of the prefill, long evicted from memory
    # (derived: recomputed from the spilled Q and K, the same numbers to float32 rounding)
    assert torch.allclose(spilled.get("blocks.1.attn.hook_pattern", 0), everything.get("blocks.1.attn.hook_pattern", 0),
                          rtol=0, atol=1e-6)
    save_trace(spilled, tmp_path / "t.zip")  # the export holds the spilled values too
    back = load_trace(tmp_path / "t.zip")
    assert all(torch.equal(back.value(r), everything.value(r)) for r in kept)


def test_the_disk_cap_is_respected_and_said(bundled):
    cap = 2 * 2**20
    capped = run(bundled, budget_bytes=BUDGET, spill_bytes=cap).trace
    log = capped.log
    assert 0 < log.spilled_bytes <= cap and log.spill_full_from is not None
    refused = capped.records[log.spill_full_from]
    assert capped.value(refused) is None and capped.stats(refused) is not None
    assert capped.value_note(refused).endswith(f"the disk spill is full ({cap:,} bytes)")


def test_the_spill_file_is_private_and_has_no_name(bundled):
    gen = run(bundled, budget_bytes=BUDGET, spill_bytes=1 << 30)
    spill = gen.trace.log._spill  # noqa: SLF001 - the file itself is what is checked
    fd = spill._file.fileno()  # noqa: SLF001
    assert stat.S_IMODE(os.fstat(fd).st_mode) & 0o077 == 0  # nobody else may read it
    target = os.readlink(f"/proc/self/fd/{fd}")
    assert "(deleted)" in target or target.startswith("/dev/fd") or "O_TMPFILE" in target or not os.path.exists(target)
    gen.trace.log.close_spill()
    assert gen.trace.value(gen.trace.record("blocks.1.attn.hook_pattern", 0)) is None  # gone with the file


def test_the_command_line_saves_every_value_with_spill_mb(capsys, tmp_path):
    from gpt_shape_tracer.trace_command import main

    argv = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--steps", "12", "--budget-mb", "1", "--json"]
    assert main([*argv, "--out", str(tmp_path / "plain.zip")]) == 0
    assert main([*argv, "--spill-mb", "200", "--out", str(tmp_path / "all.zip")]) == 0
    capsys.readouterr()
    plain, everything = load_trace(tmp_path / "plain.zip"), load_trace(tmp_path / "all.zip")
    valued = [r for r in everything.records if r.kind == "hook"]
    assert all(everything.has_value(r) for r in valued)
    assert sum(not plain.has_value(r) for r in valued) > len(valued) // 4  # 1 MB holds the last steps only
    assert main([*argv, "--capture", "shapes", "--spill-mb", "10", "--out", str(tmp_path / "x.zip")]) == 2
    assert "needs values to keep" in capsys.readouterr().err


def test_the_app_keeps_every_value_on_disk_when_asked():
    from tests.app.test_app import new_app, press
    from tests.app.test_app import run as run_app

    at = new_app()
    at.sidebar.number_input(key="budget_mb").set_value(1)
    at.sidebar.number_input(key="spill_mb").set_value(300)
    run_app(at)
    press(at, "step_button")
    at.sidebar.number_input(key="run_n").set_value(6)
    press(at, "run_button")
    log = at.session_state["app"].live.generation.trace.log
    assert log.spill_bytes == 300 * 2**20 and log.spilled_bytes > 0 and log.peak_bytes_kept <= 2**20
    trace = at.session_state["app"].live.generation.trace
    assert all(trace.has_value(r) for r in trace.filter(step=0, kind="hook"))


def test_the_app_says_why_a_steps_values_are_missing_with_and_without_the_spill():
    from tests.app.test_app import new_app, page_text, press, show_tab
    from tests.app.test_app import run as run_app

    for spill_mb, said in ((0, "Raise the budget, keep every value on disk (under Tracing), or view a later step"),
                           (1, "after the disk spill had filled its 1 MB")):
        at = new_app()
        at.sidebar.number_input(key="budget_mb").set_value(1)
        at.sidebar.number_input(key="spill_mb").set_value(spill_mb)
        at.sidebar.text_area(key="prompt").set_value(" ".join([PROMPTS[0]] * 3))
        run_app(at)
        press(at, "step_button")
        at.sidebar.number_input(key="run_n").set_value(12)
        press(at, "run_button")
        trace = at.session_state["app"].live.generation.trace
        # the oldest values go first: to disk while the spill has room, then to their statistics — V (with Q, K and
        # O, what a derived pattern is recomputed from) the last of its step, after the spill has filled
        step = next(s for s in range(trace.n_steps) if trace.get("blocks.0.attn.hook_v_all", s) is None)
        if spill_mb:
            assert trace.log.spilled_bytes > 0 and trace.log.spill_full_from is not None
            v_all = trace.record("blocks.0.attn.hook_v_all", step)
            assert "the disk spill is full" in trace.value_note(v_all)  # turned away by the full spill
        else:
            assert step == 0
        at.slider(key="step_view").set_value(step)
        run_app(at)
        show_tab(at, "Attention", ("attn_view", "O = A·V"))
        assert f"The values of step {step} were evicted by the memory budget" in page_text(at)
        assert said in page_text(at)


def test_exporting_a_spilled_run_reads_the_disk_one_value_at_a_time(bundled, tmp_path):
    """save_trace writes each spilled value as its turn comes: memory grows by far less than what is on disk."""
    from pathlib import Path

    from tests.app_in_browser import status_kib

    model, tok = bundled
    gen = TracedGeneration(model, tok, [" ".join([PROMPTS[0]] * 3)] * 4, temperature=0, budget_bytes=1 << 20,
                           spill_bytes=1 << 32)
    gen.run(60)
    on_disk = gen.trace.log.spilled_bytes
    assert on_disk > 100 * 2**20
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    before = status_kib("self", "VmRSS") * 1024
    save_trace(gen.trace, tmp_path / "t.zip")
    grew = status_kib("self", "VmHWM") * 1024 - before
    assert grew < on_disk / 2, (grew, on_disk)
    back = load_trace(tmp_path / "t.zip")
    name = "blocks.2.attn.hook_pattern"
    assert torch.equal(back.get(name, 0), gen.trace.get(name, 0))


def test_a_failed_step_retried_with_the_spill_on_saves_a_file_holding_the_retrys_values(tmp_path):
    """A step that fails part-way has spilled some of its values already; the retry reuses their record numbers.
    Here the retry feeds fewer tokens (the failed prompt shortened), so it keeps in memory records whose numbers
    the failed attempt had spilled: what is saved must be the retry's values, one per record, and it must load."""
    import pytest

    from gpt_shape_tracer.model import GPT, GPTConfig
    from gpt_shape_tracer.tracer import Tracer

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, n_ctx=24, d_model=32, n_layer=2, n_head=4)).eval()
    tokens = torch.randint(0, 64, (1, 12))
    attempts: list[str] = []

    def shift_then_fail(module, args, out):  # the failed attempt's block-1 input is far off, then it raises
        if not attempts:
            attempts.append("shifted")
            return out + 100.0
        return out

    def fail_once(module, args, out):  # at the last hook point: the failed attempt spilled all it could
        if attempts == ["shifted"]:
            attempts.append("raised")
            raise RuntimeError("boom")
        return out

    with torch.no_grad(), Tracer(gpt, capture="values", budget_bytes=1 << 30) as whole:
        gpt(tokens[:, :8])
        gpt(tokens[:, :3])
    handles = []
    try:
        with torch.no_grad(), Tracer(gpt, capture="values", budget_bytes=16384, spill_bytes=1 << 30) as tr:
            gpt(tokens[:, :8])
            handles = [gpt.blocks[0].hook_resid_post.register_forward_hook(shift_then_fail),
                       gpt.hook_logits.register_forward_hook(fail_once)]
            with pytest.raises(RuntimeError, match="boom"):
                gpt(tokens)
            gpt(tokens[:, :3])  # the retry
    finally:
        for handle in handles:
            handle.remove()
    assert attempts == ["shifted", "raised"] and tr.trace.log.spilled_bytes > 0
    back = load_trace(save_trace(tr.trace, tmp_path / "retried.zip"))
    expected = whole.trace
    assert [r.name for r in back.records] == [r.name for r in expected.records]
    for r in expected.records:
        assert torch.equal(back.value(back.records[r.index]), expected.value(r)), (r.step, r.name)


@pytest.mark.parametrize("spill", [float("nan"), True, 1e21, 10**21, -1, 2.5, "64"])
def test_a_spill_size_that_is_not_a_whole_number_of_bytes_is_refused_naming_the_range(spill):
    from gpt_shape_tracer.tracer.storage._log import TraceLog

    with pytest.raises(ValueError, match=r"spill_bytes must be a whole number of bytes from 0 \(off\) to "):
        TraceLog("values", spill_bytes=spill)
