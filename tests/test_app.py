"""The real app under Streamlit's AppTest: step, switch every tab and selector, check what is on screen."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from tracer.io import archive_bytes, load_trace

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
TABS = ["Shapes", "Attention", "Causal mask", "KV cache", "Next token", "Inspector", "Export"]


def new_app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def run(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def press(at: AppTest, key: str) -> AppTest:
    at.sidebar.button(key=key).click()
    return run(at)


def charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def heatmaps(spec: dict) -> list[dict]:
    return [d for d in spec["data"] if d["type"] == "heatmap"]


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def show_tab(at: AppTest, name: str) -> AppTest:
    at.session_state["view"] = name
    return run(at)


@pytest.fixture()
def stepped():
    """The app after three Steps of the default prompt (prefill + two decode steps)."""
    at = new_app()
    for _ in range(3):
        press(at, "step_button")
    return at


def prompt_tokens(at: AppTest) -> int:
    from model import load_bundled

    _, tok = load_bundled()
    return len(tok.encode(at.sidebar.text_area(key="prompt").value))


def test_first_page_invites_a_step():
    at = new_app()
    assert any("Press **Step**" in i.value for i in at.info)
    assert at.title[0].value == "GPT shape tracer"


def test_three_steps_show_the_right_shapes(stepped):
    at = stepped
    n0 = prompt_tokens(at)
    assert metric(at, "new positions n") == "1"
    assert metric(at, "key positions t") == str(n0 + 2)
    assert metric(at, "cache length after step") == str(n0 + 2)
    assert at.slider(key="step_view").value == 2
    flow = charts(at)[0]  # the Shapes tab is open first
    texts = " ".join(a["text"] for a in flow["layout"]["annotations"])
    assert f"[1, 4, {n0 + 2}, 32]" in texts and "[B, H, t, d_head]" in texts and "[1, 1, 1024]" in texts
    table = at.dataframe(key="records_table").value
    assert "blocks.0.attn.hook_pattern" in set(table["name"])
    assert f"[1, 4, 1, {n0 + 2}] = [B, H, n, t]" in set(table["shape"])


def test_every_tab_renders_at_every_step(stepped):
    at = stepped
    n0 = prompt_tokens(at)
    for step in (0, 2):
        at.slider(key="step_view").set_value(step)
        run(at)
        n, t = (n0, n0) if step == 0 else (1, n0 + step)
        for tab in TABS:
            show_tab(at, tab)
            if tab == "Attention":
                stages = heatmaps(charts(at)[0])
                assert len(stages) == 4
                assert all(len(h["z"]) == n and len(h["z"][0]) == t for h in stages)
                grid = heatmaps(charts(at)[-1])
                assert len(grid) == 1  # every head tiled into one heatmap: layers × heads
                assert len(grid[0]["z"]) == 4 * (n + 1) - 1
                assert len(grid[0]["z"][0]) == 4 * (t + max(1, t // 16)) - max(1, t // 16)
            if tab == "Causal mask":
                mask = heatmaps(charts(at)[0])[0]
                assert len(mask["z"]) == n and len(mask["z"][0]) == t
                explanation = " ".join(m.value for m in at.markdown)
                assert ("masks nothing" in explanation) == (step > 0)
            if tab == "KV cache":
                assert list(at.dataframe[0].value["K"]) == [f"[1, 4, {t}, 32]"] * 4
            if tab == "Next token":
                assert charts(at)[0]["data"][0]["type"] == "bar"


def test_next_token_shows_the_sampling_stages_only_when_sampling(stepped):
    at = show_tab(stepped, "Next token")
    assert any("Greedy decoding takes the argmax" in i.value for i in at.info)
    assert len(charts(at)) == 1  # greedy: the final distribution only, no reshaping to draw
    at.sidebar.radio(key="decoding").set_value("sample")
    run(at)
    at.sidebar.number_input(key="temperature").set_value(0.7)
    at.sidebar.number_input(key="top_k").set_value(5)
    press(at, "reset_button")
    press(at, "step_button")
    press(at, "step_button")
    assert at.session_state["view"] == "Next token"  # Reset → Step keeps the tab the person was on
    info = at.session_state["app"].generation.facts.step(1).sampling
    stages = charts(at)[1]["data"]
    assert [len(d["y"]) for d in stages] == [len(info.candidates[0])] * 4
    assert "5 token(s) left" in stages[2]["name"]  # top-k kept five
    assert sorted(stages[0]["y"], reverse=True) == sorted(info.stage_probs[0][0], reverse=True)


def test_attention_selectors_redraw_without_stepping(stepped):
    at = show_tab(stepped, "Attention")
    before = at.session_state["app"].generation.n_steps
    first = heatmaps(charts(at)[0])[3]["z"]
    at.selectbox(key="attn_layer").set_value(3)
    at.selectbox(key="attn_head").set_value(2)
    run(at)
    after = heatmaps(charts(at)[0])[3]["z"]
    assert after != first
    pattern = at.session_state["app"].generation.trace.get("blocks.3.attn.hook_pattern", 2)[0, 2]
    assert [round(v, 5) for v in after[0]] == [round(v, 5) for v in pattern[0].tolist()]
    assert at.session_state["app"].generation.n_steps == before  # switching a selector never runs the model
    at.selectbox(key="attn_query_s2_b0").set_value(0)
    run(at)
    assert any("rgba(255, 75, 75" in m.value for m in at.markdown)


def query_pick_shown(at: AppTest) -> tuple[str, list[float]]:
    """The query selector's label as displayed, and the weights the coloured text under it shows."""
    import re

    box = next(b for b in at.selectbox if b.label.startswith("query token"))
    html = next(m.value for m in at.markdown if "rgba(255, 75, 75" in m.value)
    return box.format_func(box.value), [float(w) for w in re.findall(r"title='([0-9.]+)'", html)]


def test_the_query_picker_follows_the_step_slider(stepped):
    """Time travel must not leave one step's query label over another step's row; a pick is remembered."""
    at = show_tab(stepped, "Attention")
    gen = at.session_state["app"].generation
    n0 = prompt_tokens(at)
    for visit, (step, n) in enumerate(((2, 1), (0, n0), (1, 1), (0, n0))):
        at.slider(key="step_view").set_value(step)
        run(at)
        label, weights = query_pick_shown(at)
        pattern = gen.trace.get("blocks.0.attn.hook_pattern", step)[0, 0]
        assert len(next(b for b in at.selectbox if b.label.startswith("query token")).options) == n
        if visit == 3:  # back at step 0: the row picked on the first visit, its label and its weights
            assert label.startswith("2 · ") and weights == [round(w, 3) for w in pattern[2].tolist()]
            continue
        # by default the newest query row, labelled with its own position, and the text shows that row
        assert label.startswith(f"{n0 + step - 1} · ")
        assert weights == [round(w, 3) for w in pattern[-1].tolist()]
        if step == 0:
            at.selectbox(key="attn_query_s0_b0").set_value(2)
            run(at)
            label, weights = query_pick_shown(at)
            assert label.startswith("2 · ") and weights == [round(w, 3) for w in pattern[2].tolist()]


def test_history_builds_up_the_triangle(stepped):
    at = show_tab(stepped, "Attention")
    n0 = prompt_tokens(at)
    history = heatmaps(charts(at)[1])[0]
    assert len(history["z"]) == n0 + 2 and len(history["z"][0]) == n0 + 2


def test_kv_cache_tab_reports_the_recompute_check(stepped):
    at = show_tab(stepped, "KV cache")
    value = float(metric(at, "max |Δ logits|, cached vs full recompute"))
    assert value < 1e-4
    assert any("equal up to float32 rounding" in c.value for c in at.caption)
    n0 = prompt_tokens(at)
    # both timings are of the untraced model, labelled with the query rows each path computes
    cached_ms = float(metric(at, "cached path (1 query row)").removesuffix(" ms"))
    full_ms = float(metric(at, f"full recompute ({n0 + 2} rows)").removesuffix(" ms"))
    assert cached_ms > 0 and full_ms > 0
    seconds = [d for d in charts(at)[2]["data"] if d["type"] == "scatter"]
    assert [d["name"] for d in seconds][:2] == ["cached path", "full recompute"]
    assert len(seconds[0]["y"]) == 3  # every step of the small model was measured
    at.radio(key="kv_which").set_value("V")
    at.selectbox(key="kv_layer").set_value(1)
    run(at)
    v = at.session_state["app"].generation.trace.get("blocks.1.attn.hook_v_all", 2)[0, 0]
    assert len(heatmaps(charts(at)[1])[0]["z"]) == v.shape[0]


def test_inspector_opens_a_record_and_its_slices(stepped):
    at = show_tab(stepped, "Inspector")
    at.selectbox(key="inspect_select").set_value("blocks.1.attn.hook_qk")
    run(at)
    assert at.code[0].value.startswith("tensor[1, 4, 1, ")
    at.selectbox(key="insp_rows_blocks.1.attn.hook_qk").set_value(1)
    run(at)
    spec = charts(at)[0]
    assert spec["data"][0]["type"] == "heatmap" and len(spec["data"][0]["z"]) == 4  # H rows now


def test_inspector_slicing_survives_switching_records_and_steps(stepped):
    """Dim pickers set for a 4-D record must not leave a 3-D record (or another step) showing nothing."""
    at = show_tab(stepped, "Inspector")
    gen = at.session_state["app"].generation
    at.selectbox(key="inspect_select").set_value("blocks.0.attn.hook_pattern")
    run(at)
    # named by symbol, not by size: labels a widget keeps across steps must not go stale as t grows
    assert at.selectbox(key="insp_cols_blocks.0.attn.hook_pattern").options == [
        "dim 0 (B)", "dim 1 (H)", "dim 2 (n)", "dim 3 (t)"]
    at.selectbox(key="insp_rows_blocks.0.attn.hook_pattern").set_value(3)  # rows t
    at.selectbox(key="insp_cols_blocks.0.attn.hook_pattern").set_value(1)  # columns H
    run(at)
    at.number_input(key="insp_fix_blocks.0.attn.hook_pattern_2_1").set_value(0)
    run(at)
    at.selectbox(key="inspect_select").set_value("blocks.0.hook_resid_post")  # [B, n, d]
    run(at)
    assert not at.warning
    resid = gen.trace.get("blocks.0.hook_resid_post", 2)[0]
    z = heatmaps(charts(at)[0])[0]["z"]
    assert (len(z), len(z[0])) == tuple(resid.shape)  # its own default: the last two dims, n × d
    # to the prefill, where n is the prompt length: the pattern's index pickers fit the new sizes
    at.slider(key="step_view").set_value(0)
    run(at)
    at.selectbox(key="inspect_select").set_value("blocks.0.attn.hook_pattern")
    run(at)
    n0 = prompt_tokens(at)
    z = heatmaps(charts(at)[0])[0]["z"]
    assert not at.warning and (len(z), len(z[0])) == (n0, n0)


def test_run_n_and_time_travel(stepped):
    at = stepped
    at.sidebar.number_input(key="run_n").set_value(5)
    press(at, "run_button")
    assert at.slider(key="step_view").value == 7
    at.slider(key="step_view").set_value(4)
    run(at)
    assert metric(at, "key positions t") == str(prompt_tokens(at) + 4)


def test_ops_capture_lists_the_ops_of_a_module():
    at = new_app()
    at.sidebar.selectbox(key="capture").set_value("ops")
    press(at, "step_button")
    show_tab(at, "Inspector")
    at.selectbox(key="inspect_select").set_value("blocks.0.attn.hook_pattern")
    run(at)
    ops = next(d.value for d in at.dataframe if "op" in d.value.columns)
    assert "Tensor.transpose" in set(ops["op"]) and "torch.softmax" in set(ops["op"])


def test_shapes_capture_says_what_is_missing_instead_of_drawing_empty_charts():
    at = new_app()
    at.sidebar.selectbox(key="capture").set_value("shapes")
    for _ in range(2):
        press(at, "step_button")
    n0 = prompt_tokens(at)
    show_tab(at, "Attention")
    assert any("Capture is **shapes**" in i.value for i in at.info) and not charts(at)
    stage_list = " ".join(m.value for m in at.markdown)
    assert f"[1, 4, 1, 32] @ [1, 4, 32, {n0 + 1}] → [1, 4, 1, {n0 + 1}]" in stage_list  # the shapes still
    show_tab(at, "Causal mask")
    text = " ".join(m.value for m in at.markdown)
    assert "-1" not in text and "not counted" in text and not charts(at)
    show_tab(at, "KV cache")
    assert any("no K values" in i.value for i in at.info)
    assert list(at.dataframe[0].value["K"]) == [f"[1, 4, {n0 + 1}, 32]"] * 4  # shapes are all there
    show_tab(at, "Inspector")
    assert any("Capture is **shapes**" in i.value for i in at.info)


def test_cache_off_recomputes_everything():
    at = new_app()
    at.sidebar.toggle(key="use_cache").set_value(False)
    for _ in range(2):
        press(at, "step_button")
    n0 = prompt_tokens(at)
    assert metric(at, "new positions n") == str(n0 + 1)
    assert metric(at, "cache length after step") == "0"
    show_tab(at, "KV cache")
    # with the cache off the run is itself the full recompute: the cached side is a re-run, and it says so
    assert float(metric(at, "max |Δ logits|, cached vs full recompute")) < 1e-4
    assert metric(at, "cached path (1 query row)").endswith(" ms")
    assert any("untraced cached re-run" in c.value for c in at.caption)
    growth = charts(at)[0]
    assert growth["layout"]["title"]["text"].startswith("KV cache off: nothing is kept")
    bars = growth["data"][0]["y"]  # plotly ships a pandas column as a typed array
    assert np.frombuffer(base64.b64decode(bars["bdata"]), dtype=bars["dtype"]).tolist() == [n0, n0 + 1]


def test_a_batch_of_two_prompts_with_padding():
    at = new_app()
    at.sidebar.text_area(key="prompt").set_value("Lily had a red ball.\nTom said,")
    press(at, "step_button")
    press(at, "step_button")
    gen = at.session_state["app"].generation
    assert gen.batch_size == 2 and gen.padded
    show_tab(at, "Causal mask")
    at.selectbox(key="mask_batch").set_value(1)
    run(at)
    assert "padding" in " ".join(m.value for m in at.markdown)


def test_export_and_load_a_trace_back(stepped):
    at = stepped
    data = archive_bytes(at.session_state["app"].generation.trace)
    assert load_trace(data).n_steps == 3
    show_tab(at, "Export")
    at.file_uploader(key="upload_trace").upload("trace.zip", data, "application/zip")
    run(at)
    assert at.session_state["app"].viewing_file
    assert any("Viewing the trace file trace.zip" in i.value for i in at.info)
    show_tab(at, "Attention")
    assert len(heatmaps(charts(at)[0])) == 4


def test_a_broken_trace_file_gets_a_message_and_nothing_is_lost(stepped):
    at = show_tab(stepped, "Export")
    at.file_uploader(key="upload_trace").upload("broken.zip", b"PK\x03\x04 not really a zip", "application/zip")
    run(at)
    assert any("Could not load broken.zip" in e.value for e in at.error)
    assert not at.session_state["app"].viewing_file and at.session_state["app"].generation.n_steps == 3
