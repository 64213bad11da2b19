"""The app's "Config only (no weights)" source under Streamlit's AppTest: a shipped shape config and a user's
config.json are traced on the meta device, and the Shapes, KV cache, Costs and placement views render with the
dry run's own numbers."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from gpt_shape_tracer.gui.dry_run import LABEL
from gpt_shape_tracer.model.sources import ASSETS

APP = str(Path(__file__).resolve().parents[2] / "app.py")


def _run(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_config_only_source_renders_shapes_cache_and_costs():
    at = _run(AppTest.from_file(APP, default_timeout=240))
    at.sidebar.radio(key="source").set_value(LABEL)
    _run(at)
    at.sidebar.selectbox(key="dry_shapes").set_value("llama-3.1-405b")
    at.sidebar.number_input(key="dry_tokens").set_value(64)
    at.sidebar.number_input(key="dry_steps").set_value(2)
    at.sidebar.button(key="dry_trace").click()
    _run(at)
    assert any("llama-3.1-405b: a dry run" in s.value for s in at.subheader)
    frames = [d.value for d in at.dataframe]
    shapes = frames[0]
    row = shapes[shapes["name"] == "blocks.125.attn.hook_pattern"].iloc[0]
    assert row["shape"] == "[1, 128, 64, 64]" and row["dtype"] == "bfloat16"
    assert row["summary"].endswith("no values (dry run)")
    growth = frames[1]
    assert list(growth["t"]) == [64, 65, 66]
    # each decode step adds one row per layer: 2 (K, V) × 126 layers × 8 KV heads × 128 × 2 bytes
    assert list(growth["KV cache bytes"].diff().dropna()) == [2 * 126 * 8 * 128 * 2] * 2
    texts = " ".join(m.value for m in at.markdown)
    assert "H100 SXM: at least" in texts and "longest context that fits" in texts
    # another step of the slider, and a user's own config.json
    at.select_slider(key="dry_step").set_value(2)
    _run(at)
    at.sidebar.text_input(key="dry_path").set_value(str(ASSETS / "story-llama" / "config.json"))
    at.sidebar.button(key="dry_trace").click()
    _run(at)
    assert any("story-llama: a dry run" in s.value for s in at.subheader)


def test_config_only_source_says_why_it_refuses():
    at = _run(AppTest.from_file(APP, default_timeout=240))
    at.sidebar.radio(key="source").set_value(LABEL)
    _run(at)
    at.sidebar.text_input(key="dry_path").set_value("/no/such/config.json")
    at.sidebar.button(key="dry_trace").click()
    _run(at)
    assert at.error and "Could not build a dry run" in at.error[0].value


def test_config_only_source_traces_one_tensor_parallel_rank():
    """One rank of 8 of Llama 3.1 70B, as transformers' plan splits it: 64/8 query heads, 8/8 KV heads per rank,
    the KV cache an eighth, and what each forward sends, summed from the records shown."""
    at = _run(AppTest.from_file(APP, default_timeout=300))
    at.sidebar.radio(key="source").set_value(LABEL)
    _run(at)
    at.sidebar.selectbox(key="dry_shapes").set_value("llama-3.1-70b")
    at.sidebar.number_input(key="dry_tokens").set_value(16)
    at.sidebar.number_input(key="dry_steps").set_value(1)
    at.sidebar.number_input(key="dry_ranks").set_value(8)
    at.sidebar.button(key="dry_trace").click()
    _run(at)
    assert any("llama-3.1-70b: a dry run, one rank of 8" in s.value for s in at.subheader)
    frames = [d.value for d in at.dataframe]
    shapes = frames[0]
    assert shapes[shapes["name"] == "blocks.79.attn.hook_pattern"].iloc[0]["shape"] == "[1, 8, 16, 16]"
    growth = frames[1]
    assert list(growth["KV cache bytes"].diff().dropna()) == [2 * 80 * 1 * 128 * 2]  # one KV head per rank
    sentence = next(m.value for m in at.markdown if "one rank of 8" in m.value)
    # 80 layers × (attention out + MLP down) + the embedding; each [1, 16, 8192] bf16 at the prefill
    assert f"161 all-reduces of {161 * 16 * 8192 * 2:,} B in all" in sentence
