"""The real app under Streamlit's AppTest: step, switch every tab and selector, check what is on screen — and
that every sentence it shows holds for the step it is about."""

from __future__ import annotations

import base64
import gc
import json
import re
import tomllib
from html import unescape
from pathlib import Path

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

from gpt_shape_tracer.gui.runs import runs_written
from gpt_shape_tracer.tracer.files import archive_bytes, load_trace

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "app.py")
TABS = ["Shapes", "Attention", "Causal mask", "KV cache", "Next token", "What if", "Compare runs", "Worked example",
        "Inspector", "Export"]


def new_app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def run(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    runs_written(60)  # a Step's run is written by a thread once the rerun ends (gui/runs.py RunWrite): on disk now
    return at


def press(at: AppTest, key: str) -> AppTest:
    at.sidebar.button(key=key).click()
    return run(at)


def press_reset(at: AppTest) -> AppTest:
    """Reset, and yes when it asks (it asks when there are steps to discard: tests/app/test_runs.py)."""
    press(at, "reset_button")
    if any(b.key == "reset_confirm" for b in at.sidebar.button):
        press(at, "reset_confirm")
    return at


def charts(at: AppTest) -> list[dict]:
    """Each chart's figure as JSON, with plotly's packed arrays (numpy data is sent as base64) unpacked to lists."""
    return [unpack(json.loads(c.proto.spec)) for c in at.get("plotly_chart")]


def panels(at: AppTest) -> list[dict]:
    """Each heatmap-panels canvas's spec (gui/panels.js draws it: the attention Stages), as the page is sent it."""
    return [json.loads(e.proto.json) for e in at.get("bidi_component")
            if e.proto.component_name == "gpt_shape_tracer.panels"]


def unpack(obj):
    """Plotly packs a numpy array as ``{"dtype", "bdata", "shape"}``; decode it as the browser would, a NaN
    becoming None (both are a gap to plotly.js)."""
    if isinstance(obj, dict) and "bdata" in obj and "dtype" in obj:
        flat = np.frombuffer(base64.b64decode(obj["bdata"]), dtype=np.dtype(obj["dtype"]))
        shape = [int(s) for s in str(obj.get("shape", len(flat))).split(",")]
        values = flat.astype(object)
        if flat.dtype.kind == "f":
            values[np.isnan(flat)] = None
        return values.reshape(shape).tolist()
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack(v) for v in obj]
    return obj


def heatmaps(spec: dict) -> list[dict]:
    """The heatmaps that carry values (not the grey masked layers under them)."""
    return [d for d in spec["data"] if d["type"] == "heatmap" and d.get("hoverinfo") != "skip"]


def drawn_text(spec: dict) -> str:
    """Every text a figure writes on the page: its annotations and its traces' text labels."""
    texts = [a.get("text", "") for a in spec["layout"].get("annotations", [])]
    for trace in spec["data"]:
        labels = trace.get("text")
        texts += [labels] if isinstance(labels, str) else list(labels or [])
    return " ".join(texts)


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def show_tab(at: AppTest, name: str, sub: tuple[str, str] | None = None) -> AppTest:
    at.session_state["view"] = name
    if sub is not None:
        at.session_state[sub[0]] = sub[1]
    return run(at)


DIAGRAM = "<div class='diagram'>"  # gui.common.diagram: a figure drawn as SVG, shown through st.markdown


def _drawing(markdown: str) -> str | None:
    """The SVG a markdown element holds when it is a drawing (``gui.common.diagram``), else None."""
    return markdown[len(DIAGRAM):-len("</div>")] if markdown.startswith(DIAGRAM) else None


def diagrams(at: AppTest) -> list[str]:
    """The page's SVG drawings (``figures.svg``), in the page's order."""
    return [svg for m in at.markdown if (svg := _drawing(str(m.value))) is not None]


def diagram_text(svg: str) -> str:
    """Every label a drawing writes, line by line as a reader sees them (a tspan with its own y starts a line)."""
    import xml.etree.ElementTree as ET

    lines: list[str] = []
    for text in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text"):
        for span in text.iter("{http://www.w3.org/2000/svg}tspan"):
            if "y" in span.attrib:
                lines.append("")
            lines[-1] += span.text or ""
    return " ".join(lines)


def page_text(at: AppTest) -> str:
    """Everything the page says, as a person reads it (character references decoded; a drawing by its labels)."""
    parts = [*at.markdown, *at.caption, *at.info, *at.warning, *at.error, *at.success, *at.latex]
    said = [str(p.value) if (svg := _drawing(str(p.value))) is None else diagram_text(svg) for p in parts]
    return unescape(" | ".join(said))


def frame_with(at: AppTest, column: str):
    return next(d.value for d in at.dataframe if column in d.value.columns)


def gen_of(at: AppTest):
    return at.session_state["app"].live.generation


@pytest.fixture()
def stepped():
    """The app after three Steps of the default prompt (prefill + two decode steps)."""
    at = new_app()
    for _ in range(3):
        press(at, "step_button")
    return at


def prompt_tokens(at: AppTest) -> int:
    return gen_of(at).info.prompt_lengths[0]


def test_first_page_invites_a_step_and_offers_the_worked_example():
    at = new_app()
    assert any("Press **Step**" in i.value for i in at.info)
    assert at.title[0].value == "GPT shape tracer"
    assert len(charts(at)) == 2  # the worked example needs no model run
    # rows are named as the charts label them (q0, q1), not counted from 1
    assert "Row q0 of A (the first query)" in page_text(at) and "Row 1" not in page_text(at)
    server_mb = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())["server"]["maxUploadSize"]
    assert server_mb == 1024 and any("up to 1 GiB" in u.label for u in at.get("file_uploader"))
    # the server's process froze its imports' objects out of the garbage collector's full walks (gui/server.py)
    assert gc.get_freeze_count() > 100_000


def test_three_steps_show_the_right_shapes(stepped):
    at = stepped
    n0 = prompt_tokens(at)
    assert metric(at, "new positions n") == "1"
    assert metric(at, "key positions t") == str(n0 + 2)
    assert metric(at, "cached after step") == str(n0 + 2)
    assert at.slider(key="step_view").value == 2
    texts = diagram_text(diagrams(at)[0])  # the Shapes tab is open first: its shape flow, drawn as SVG
    assert f"[1, 4, {n0 + 2}, 32]" in texts and "[B, H, t, d_head]" in texts and "[1, 1, 1024]" in texts
    assert "W_QKV [128, 384]" in texts and "GELU (tanh form)" in texts and "O = A·V" in texts
    table = at.dataframe(key="records_table").value
    assert "blocks.0.attn.hook_pattern" in set(table["name"])
    row = table[table["name"] == "blocks.0.attn.hook_pattern"].iloc[0]
    assert row["shape"] == f"[1, 4, 1, {n0 + 2}]" and row["axes"] == "[B, H, n, t]"
    assert list(table["#"]) == list(range(len(table)))  # numbered within the step, not across the trace


def test_a_rerun_sets_the_step_slider_only_where_it_must_move():
    """The page's view is a fragment, and Streamlit lets a fragment's run finish before the next: a rerun for an older
    value of a burst of arrow keys draws after the browser's slider has gone on. A value the server sets is pushed to
    the browser's slider, so a rerun sets none unless the slider must move — to a new step, or to a range that
    changed."""
    at = new_app()
    for _ in range(3):
        press(at, "step_button")
    slider = at.slider(key="step_view")
    assert slider.value == 2 and slider.proto.set_value  # the Step moved it to the new step
    slider.set_value(1)
    run(at)
    slider = at.slider(key="step_view")
    assert slider.value == 1 and not slider.proto.set_value  # the person's own value: left to the browser
    show_tab(at, "KV cache")  # a rerun for another reason: the same
    assert at.slider(key="step_view").value == 1 and not at.slider(key="step_view").proto.set_value
    press(at, "step_button")
    assert at.slider(key="step_view").value == 3 and at.slider(key="step_view").proto.set_value


def test_every_tab_renders_at_every_step_and_never_cites_a_document_the_user_lacks(stepped):
    at = stepped
    n0 = prompt_tokens(at)
    for step in (0, 2):
        at.slider(key="step_view").set_value(step)
        run(at)
        n, t = (n0, n0) if step == 0 else (1, n0 + step)
        for tab in TABS:
            show_tab(at, tab)
            text = page_text(at)
            assert not re.search(r"\bseeds?\b(?! =| \d)", text, flags=re.I), (tab, text[:300])
            if tab == "Attention":
                stages = panels(at)[0]["panels"]
                assert len(stages) == 4 and all(len(h["z"]) == n and len(h["z"][0]) == t for h in stages)
                assert "O = A\\,V" in text and "(QKᵀ + M)/√d_k" in text
            if tab == "Causal mask":
                assert ("masks nothing" in text) == (step > 0)
            if tab == "KV cache":
                assert list(at.dataframe[0].value["K"]) == [f"[1, 4, {t}, 32]"] * 4
            if tab == "Next token":
                assert charts(at)[0]["data"][0]["type"] == "bar"


def test_the_kv_verdict_says_nothing_was_cached_at_the_prefill(stepped):
    at = stepped
    at.slider(key="step_view").set_value(0)
    run(at)
    show_tab(at, "KV cache")
    assert any("nothing is cached yet" in i.value for i in at.info)
    assert not any("Only the new row was needed" in s.value for s in at.success)
    at.slider(key="step_view").set_value(2)
    run(at)
    n0 = prompt_tokens(at)
    verdict = next(s.value for s in at.success)
    assert "computed 1 query row(s)" in verdict and f"the full recompute {n0 + 2} rows" in verdict
    evidence = frame_with(at, "cached path")
    assert list(evidence["cached path"][:1]) == ["1"] and list(evidence["full recompute"][:1]) == [str(n0 + 2)]
    assert evidence.iloc[-1, 0].startswith("wall time (estimate")


def test_a_cache_that_lies_gets_a_not_equal_verdict(stepped):
    at = stepped
    for keys in gen_of(at).cache.keys:
        keys.data.mul_(-1.0)  # a cache bug that returns wrong keys
    press(at, "step_button")
    show_tab(at, "KV cache")
    assert any(e.value.startswith("NOT equal") for e in at.error)


def test_the_memory_formula_follows_the_step(stepped):
    at = show_tab(stepped, "KV cache")
    t = prompt_tokens(at) + 2
    assert any(f"2\\cdot 1\\cdot 4\\cdot {t}\\cdot 32" in x.value for x in at.latex)


def test_attention_selectors_redraw_without_stepping(stepped):
    at = show_tab(stepped, "Attention")
    before = gen_of(at).n_steps
    first = panels(at)[0]["panels"][3]["z"]
    at.selectbox(key="attn_layer").set_value(3)
    at.selectbox(key="attn_head").set_value(2)
    run(at)
    after = panels(at)[0]["panels"][3]["z"]
    assert after != first
    pattern = gen_of(at).trace.get("blocks.3.attn.hook_pattern", 2)[0, 2]
    assert np.allclose(after[0], pattern[0].tolist(), rtol=1e-4)
    assert gen_of(at).n_steps == before  # switching a selector never runs the model
    at.toggle(key="attn_shared").set_value(True)
    run(at)
    maps = panels(at)[0]["panels"]
    assert maps[0]["zmax"] == maps[1]["zmax"] == maps[2]["zmax"] and maps[3]["zmax"] != maps[0]["zmax"]
    # hover (a cell's row and column drawn across its panel) is the canvas's own: tests/browser/test_panels_browser.py


def crosshaired(spec: dict) -> bool:
    """Whether every axis of a chart draws the hovered cell's row or column across its panel (gui/hover.py)."""
    axes = [v for k, v in spec["layout"].items() if k.startswith(("xaxis", "yaxis"))]
    return bool(axes) and all(a.get("showspikes") and a.get("spikemode") == "across" for a in axes) \
        and spec["layout"].get("hovermode") == "closest"


def query_pick_shown(at: AppTest) -> tuple[str, list[float]]:
    """The query selector's label as displayed, and the weights the coloured text under it shows."""
    box = next(b for b in at.selectbox if b.label.startswith("query token"))
    html = next(m.value for m in at.markdown if "weight " in m.value and "title='key" in m.value)
    return box.format_func(box.value), [float(w) for w in re.findall(r"weight ([0-9.]+)'", html)]


def test_the_query_picker_follows_the_step_slider(stepped):
    """Time travel must not leave one step's query label over another step's row; a pick is remembered."""
    at = show_tab(stepped, "Attention")
    gen = gen_of(at)
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
        assert label.startswith(f"{n0 + step - 1} · ")
        assert weights == [round(w, 3) for w in pattern[-1].tolist()]
        if step == 0:
            at.selectbox(key="attn_query_s0_b0_1").set_value(2)
            run(at)
            label, weights = query_pick_shown(at)
            assert label.startswith("2 · ") and weights == [round(w, 3) for w in pattern[2].tolist()]


def test_the_attention_subviews(stepped):
    at = show_tab(stepped, "Attention", ("attn_view", "O = A·V"))
    assert len(charts(at)) == 1 and "o = Σᵢ αᵢ vᵢ" in page_text(at) and crosshaired(charts(at)[0])
    at = show_tab(at, "Attention", ("attn_view", "Pitfalls"))
    table = frame_with(at, "variant").set_index("variant")
    assert table.loc["as the model does it", "row sum"] == pytest.approx(1.0)
    at = show_tab(at, "Attention", ("attn_view", "All heads"))
    grid = charts(at)[0]
    texts = [a["text"] for a in grid["layout"].get("annotations", [])]
    assert "previous-token 1.00" in texts and any(t.startswith("induction 0.8") for t in texts)
    at = show_tab(at, "Attention", ("attn_view", "History"))
    n0 = prompt_tokens(at)
    (history,) = panels(at)[0]["panels"]  # drawn on the canvas, this step's row outlined
    assert len(history["z"]) == n0 + 2 and len(history["z"][0]) == n0 + 2
    assert panels(at)[0]["outlines"] == [{"panel": 0, "x0": -0.5, "x1": n0 + 1.5, "y0": n0 + 0.5, "y1": n0 + 1.5,
                                          "colour": "rgb(245, 133, 24)", "width": 2.0}]


def test_the_zoom_reads_one_head_at_any_length(stepped):
    from gpt_shape_tracer.figures.long_attention import derived_sentence

    at = show_tab(stepped, "Attention", ("attn_view", "Zoom"))
    # a traced forward runs the fused kernel at every length: the sentence says so, and the numbers are recomputed
    step, layer = at.slider(key="step_view").value, at.selectbox(key="attn_layer").value
    sentence = derived_sentence(gen_of(at).trace, step, layer)
    assert "ran the fused kernel" in sentence and sentence in page_text(at)
    overview, region, strip = charts(at)[:3]
    assert "exact weights" in overview["layout"]["title"]["text"]  # a short prompt: one cell per query × key
    assert "exact weights" in region["layout"]["title"]["text"]
    assert "its weight on each of" in strip["layout"]["title"]["text"]
    at.toggle(key="zoom_stats").set_value(True)
    run(at)
    assert "entropy (nats)" in frame_with(at, "entropy (nats)").columns


def test_flash_attention_tile_by_tile_ends_at_the_models_output(stepped):
    at = show_tab(stepped, "Attention", ("attn_view", "FlashAttention"))
    text = page_text(at)
    assert "Every row's output is final — max |O(tiles) − O(model)| = " in text and "one tile of S (1 × 8)" in text
    delta = float(text.split("max |O(tiles) − O(model)| = ")[1].split(",")[0])
    assert delta < 1e-5
    at.slider(key="step_view").set_value(0)  # the prefill: several query blocks, several tiles
    run(at)
    at.selectbox(key="flash_block").set_value(4)
    run(at)
    at.slider(key="flash_tile_4_" + str(at.selectbox(key="flash_rows_4").value)).set_value(0)
    run(at)
    assert "row(s) still have unmasked keys in" in page_text(at)
    assert any(d.get("name") == "m (running max)" for d in charts(at)[0]["data"])


def test_a_cheaper_cache_is_measured_on_the_live_model(stepped):
    at = show_tab(stepped, "KV cache", ("kv_view", "A cheaper cache"))
    assert "Choose a format" in page_text(at)
    at.number_input(key="kv_storage_steps").set_value(4)
    at.button(key="kv_storage_run").click()
    run(at)
    result = at.session_state["app"].live.precision
    assert result.storage == "int8" and len(result.steps) == 4
    assert metric(at, "int8 cache after 4 steps") == f"{result.stored_bytes:,} B"
    assert result.formula() in page_text(at) and len(charts(at)) == 1
    assert gen_of(at).n_steps == 3  # the generation itself is untouched
    press_reset(at)
    assert at.session_state["app"].live.precision is None


def test_the_gradients_of_a_head_equal_autograds_in_the_app(stepped):
    at = show_tab(stepped, "Attention", ("attn_view", "Gradients"))  # computed as the view opens
    text = page_text(at)
    assert "Starting from autograd's G_O = ∂L/∂O, the 5 gradients computed from their formulas" in text
    assert "equal autograd's within" in text and len(charts(at)) == 2
    kept = at.session_state["app"].live.gradients
    assert len(kept) == 1
    first = kept.get(kept.computed_for()[0])
    at.radio(key="grad_loss").set_value("−log p(chosen token)")  # another loss: its own backward pass
    run(at)
    assert len(kept) == 2 and "−log p(chosen token)" in page_text(at)
    at.radio(key="grad_loss").set_value("next-token cross-entropy")  # back: the kept one, not a new pass
    run(at)
    assert len(kept) == 2 and kept.get(kept.computed_for()[0]) is first


def test_kv_cache_tab_reports_the_recompute_check(stepped):
    at = show_tab(stepped, "KV cache")
    assert any("agree within 0.0001" in s.value for s in at.success)
    at.radio(key="kv_which").set_value("V")
    at.selectbox(key="kv_layer").set_value(1)
    run(at)
    v = gen_of(at).trace.get("blocks.1.attn.hook_v_all", 2)[0, 0]
    drawn = np.array(panels(at)[0]["panels"][0]["z"], dtype=np.float64)  # the canvas: positions × d_head
    assert drawn.shape == tuple(v.shape) and np.allclose(drawn, v.numpy(), rtol=1e-5, atol=1e-6)
    at.button(key="measure_recompute").click()
    run(at)
    evidence = frame_with(at, "cached path")
    assert "fastest of 5" in evidence.iloc[-1, 0]


def test_inspector_opens_a_record_and_its_slices(stepped):
    at = show_tab(stepped, "Inspector")
    at.selectbox(key="inspect_select").set_value("blocks.1.attn.hook_qk")
    run(at)
    assert at.code[0].value.startswith("tensor[1, 4, 1, ")
    at.selectbox(key="insp_rows_blocks.1.attn.hook_qk").set_value(1)
    run(at)
    spec = charts(at)[0]
    assert heatmaps(spec)[0]["type"] == "heatmap" and len(heatmaps(spec)[0]["z"]) == 4  # H rows now
    hist = charts(at)[1]["data"][0]
    assert hist["type"] == "bar" and sum(hist["y"]) == gen_of(at).trace.record("blocks.1.attn.hook_qk", 2).numel


def test_run_n_and_time_travel(stepped):
    at = stepped
    at.sidebar.number_input(key="run_n").set_value(5)
    press(at, "run_button")
    assert at.slider(key="step_view").value == 7
    # once the run is over, its progress bar and Stop button are gone: a Stop now would stop nothing
    assert not at.get("progress") and "stop_run" not in [b.key for b in at.button]
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
    ops = set(next(d.value for d in at.dataframe if "op" in d.value.columns)["op"])
    # the ops that ran: the traced forward runs attention fused (its stages are recomputed when read), so the
    # kernel call is listed, with the reshapes around it, and no softmax of ours
    assert "F.scaled_dot_product_attention" in ops and "Tensor.transpose" in ops and "torch.softmax" not in ops


def test_shapes_capture_says_what_is_missing_instead_of_drawing_empty_charts():
    at = new_app()
    at.sidebar.selectbox(key="capture").set_value("shapes")
    for _ in range(2):
        press(at, "step_button")
    n0 = prompt_tokens(at)
    show_tab(at, "Attention")
    assert any("Capture is **shapes**" in i.value for i in at.info) and not charts(at) and not panels(at)
    assert f"[1, 4, 1, 32] @ [1, 4, 32, {n0 + 1}] → [1, 4, 1, {n0 + 1}]" in page_text(at)
    show_tab(at, "Causal mask")
    assert "Causal mask" in [t.label for t in at.tabs] and "Attention mask" not in [t.label for t in at.tabs]
    text = page_text(at)
    assert "-1" not in text and "not counted" in text and not charts(at)
    show_tab(at, "KV cache")
    assert any("no K values" in i.value for i in at.info)
    assert list(at.dataframe[0].value["K"]) == [f"[1, 4, {n0 + 1}, 32]"] * 4


def test_cache_off_recomputes_everything_and_draws_no_cache():
    at = new_app()
    at.sidebar.toggle(key="use_cache").set_value(False)
    for _ in range(2):
        press(at, "step_button")
    n0 = prompt_tokens(at)
    assert metric(at, "positions n, all fed again") == str(n0 + 1)  # only the newest of them is new
    assert not any(m.label == "new positions n" for m in at.metric)
    assert "(no cache: the newest and, again, the" in page_text(at)  # the Shapes takeaway says the same
    assert metric(at, "cached after step") == "0"
    flow = diagram_text(diagrams(at)[0])
    assert "K (all t rows, recomputed)" in flow and "cache ++ new" not in flow
    show_tab(at, "KV cache")
    assert any("untraced cached re-run" in s.value for s in at.success)
    show_tab(at, "KV cache", ("kv_view", "Over the steps"))
    steps = charts(at)[0]
    assert drawn_text(steps).startswith("KV cache off: nothing is kept")
    assert "this run has the cache off, so it computed the rows without" in page_text(at)


def test_a_batch_of_two_prompts_names_the_padding_columns():
    at = new_app()
    at.sidebar.text_area(key="prompt").set_value("Lily had a red ball and a blue kite.\nTom said,")
    press(at, "step_button")
    press(at, "step_button")
    gen = gen_of(at)
    assert gen.batch_size == 2 and gen.padded
    pad = gen.info.prompt_width - gen.info.prompt_lengths[1]
    show_tab(at, "Causal mask")
    at.selectbox(key="mask_batch").set_value(1)
    run(at)
    assert f"Key column(s) {', '.join(map(str, range(pad)))} of sequence 1 are padding" in page_text(at)


def test_what_if_switching_off_the_previous_token_head_breaks_induction(stepped):
    """Three clicks: the What if tab, head L0 H0, re-run."""
    at = show_tab(stepped, "What if")
    picker = at.multiselect(key="ablate_heads")
    assert picker.options[:2] == ["L0 H0", "L0 H1"]  # (layer, head) pairs, shown by name
    picker.select((0, 0))
    run(at)
    at.button(key="ablate_run").click()
    run(at)
    app = at.session_state["app"]
    (key,) = app.live.ablations.computed_for()
    result = app.live.ablations.get(key)
    assert result.loss_after - result.loss_before > 2.0
    assert "Loss measured on the second half of a random" in page_text(at)
    assert float(metric(at, "loss with these heads off").split()[0]) == pytest.approx(result.loss_after, abs=1e-3)
    assert len(charts(at)) == 2
    assert gen_of(at).n_steps == 3 and not gen_of(at).interventions  # the generation is untouched
    at.button(key="ablate_keep").click()
    run(at)
    press(at, "step_button")
    assert any("Interventions in force at this step" in w.value for w in at.warning)
    z = gen_of(at).trace.get("blocks.0.attn.hook_z", 3)
    assert not z[0, 0].any()


def test_what_if_patching_attribution_and_lens():
    at = new_app()
    at.sidebar.text_area(key="prompt").set_value(
        'Mia had a cat. Mia gave the cat to Ben. Ben loved the cat. Ben said, "Thank you,')
    press(at, "step_button")
    show_tab(at, "What if", ("whatif_view", "Activation patching"))
    at.text_input(key="patch_corrupted").set_value(
        'Mia had a cat. Mia gave the cat to Sam. Sam loved the cat. Sam said, "Thank you,')
    run(at)
    at.button(key="patch_run").click()
    run(at)
    assert not at.get("progress")  # the bar went when patching ended
    # the takeaway first, in bold (figures/view_takeaways.patching_takeaway; its truth: tests/figures/test_sentences.py)
    said = next(unescape(m.value) for m in at.markdown if m.value.startswith(("**Patching", "**No single patch")))
    spans = re.findall(r"\*\*(.+?)\*\*", said)  # markdown makes no bold of "** Ben**": no edge spaces
    assert len(spans) == 1 and spans[0] == spans[0].strip()
    res = at.session_state["app"].live.patching.result
    assert f"{res.corrupted_diff:.2f} on the corrupted prompt, {res.clean_diff:.2f} on the clean one" in said
    assert dict((m.label, m.value) for m in at.metric)["largest share restored"] == f"{float(res.restored.max()):.0%}"
    spec = charts(at)[0]
    n = prompt_tokens(at)
    assert len(heatmaps(spec)[0]["z"]) == 4 and len(heatmaps(spec)[0]["z"][0]) == n
    at.text_input(key="patch_corrupted").set_value("too short")
    run(at)
    assert any("patching needs the same count" in e.value for e in at.error)
    show_tab(at, "What if", ("whatif_view", "Logit attribution"))
    assert "add up to" in charts(at)[0]["layout"]["title"]["text"]
    show_tab(at, "What if", ("whatif_view", "Logit lens"))
    assert len(heatmaps(charts(at)[0])[0]["z"]) == 4


def test_compare_runs_cache_off_agrees_and_an_ablation_diverges(stepped):
    at = show_tab(stepped, "Compare runs")
    at.radio(key="compare_with").set_value("this prompt with the KV cache off")
    run(at)
    at.button(key="compare_run").click()
    run(at)
    assert any(m.value.startswith("**Compared with") and "no record diverges" in m.value for m in at.markdown)
    frame = at.session_state["app"].live.comparison.frame
    assert frame["compared"].all() and frame["max_abs_delta"].max() < 1e-4
    ids = frame[frame["name"] == "model:in[0]"]  # token ids: equal or not, never a numeric |Δ|
    assert ids["max_abs_delta"].isna().all() and (ids["note"].str.contains("all equal")).all()
    # at a decode step the cached run holds the new row only: the b − a heatmap draws the row both computed
    assert at.slider(key="step_view").value == 2
    at.selectbox(key="diff_record").set_value("blocks.0.attn.hook_pattern")
    run(at)
    assert "compared on the last 1 position(s), which both runs computed" in page_text(at)
    spec = charts(at)[-1]
    (z,) = [d["z"] for d in heatmaps(spec)]
    n = prompt_tokens(at) + 2
    assert len(z) == 1 and len(z[0]) == n and heatmaps(spec)[0]["y"] == [str(n - 1)]
    assert max(abs(v) for v in z[0]) < 1e-5
    # the heads are chosen on the What if tab, as a person does, and the choice outlives the tab change
    show_tab(at, "What if")
    at.multiselect(key="ablate_heads").select((2, 1))
    run(at)
    show_tab(at, "Compare runs")
    at.radio(key="compare_with").set_value("this prompt with the heads chosen under What if switched off")
    run(at)
    at.button(key="compare_run").click()
    run(at)
    assert not any("Choose heads under What if" in w.value for w in at.warning)
    verdict = next(unescape(m.value) for m in at.markdown if "first diverge" in m.value)  # the takeaway, bold
    assert "first diverge at step 0 in blocks.2.attn.hook_z (max |Δ|" in verdict and "; )" not in verdict


def test_typed_inputs_and_sub_tabs_survive_a_round_trip(stepped):
    """Heads chosen under Switch heads off, the corrupted prompt under Activation patching, the open sub-tab
    and the Shapes table's filter stay as the person left them after visiting other tabs and sub-tabs."""
    at = show_tab(stepped, "What if")
    at.multiselect(key="ablate_heads").select((1, 0))
    at.radio(key="ablate_how").set_value("mean")
    run(at)
    show_tab(at, "What if", ("whatif_view", "Activation patching"))
    at.text_input(key="patch_corrupted").set_value("Lily and Sam went to the park")
    run(at)
    show_tab(at, "What if", ("whatif_view", "Logit lens"))
    show_tab(at, "What if", ("whatif_view", "Switch heads off"))
    assert at.multiselect(key="ablate_heads").value == [(1, 0)] and at.radio(key="ablate_how").value == "mean"
    show_tab(at, "What if", ("whatif_view", "Activation patching"))
    show_tab(at, "Shapes")
    at.text_input(key="table_name").set_value("hook_q")
    run(at)
    show_tab(at, "KV cache")
    show_tab(at, "What if")  # the sub-tab left open last time opens again
    assert at.text_input(key="patch_corrupted").value == "Lily and Sam went to the park"
    show_tab(at, "Shapes")
    assert at.text_input(key="table_name").value == "hook_q"


def test_export_and_load_a_trace_back_labelled_with_its_own_model(stepped, hf_dir_with_tokenizer):
    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.tracer import TracedGeneration

    other, tok = load_hf(hf_dir_with_tokenizer)
    theirs = TracedGeneration(other, tok, "Tom had a kite.", temperature=0)
    theirs.step()
    at = show_tab(stepped, "Export")
    assert any(b.label.startswith("Download a one-file HTML report of step 2") for b in at.get("download_button"))
    assert any(b.label.startswith("Download a one-file HTML report of the whole run (3 steps")
               for b in at.get("download_button"))
    at.file_uploader(key="upload_trace").upload("theirs.zip", archive_bytes(theirs.trace), "application/zip")
    run(at)
    assert at.session_state["app"].viewing_file
    model_line = next(c.value for c in at.caption if c.value.startswith("Model:"))
    assert "story" not in model_line and "2 layers × 2 heads" in model_line and "from the file" in model_line
    assert "Step again" not in page_text(at) and "the file holds this one step" in page_text(at)
    show_tab(at, "Attention")
    assert len(panels(at)[0]["panels"]) == 4
    data = archive_bytes(gen_of(at).trace)
    assert load_trace(data).n_steps == 3


def test_choosing_a_model_discards_nothing_and_a_file_stays_open_until_closed(stepped):
    """A model chosen under Weights waits for Reset like every other setting; an opened file stays viewable
    through Step and Reset until the person closes it."""
    gen = gen_of(stepped)
    at = show_tab(stepped, "Export")
    at.file_uploader(key="upload_trace").upload("mine.zip", archive_bytes(gen.trace), "application/zip")
    run(at)
    assert at.session_state["app"].viewing_file
    at.sidebar.radio(key="source").set_value("Bundled Llama-style story model")
    run(at)
    app = at.session_state["app"]
    assert gen_of(at) is gen and gen.n_steps == 3 and app.viewing_file  # nothing discarded
    at.sidebar.radio(key="source").set_value("Bundled GPT-2-style story model")  # the file's own model
    run(at)
    assert gen_of(at) is gen and app.viewing_file
    at.sidebar.radio(key="source").set_value("Bundled Llama-style story model")
    run(at)
    press(at, "step_button")  # continues the live generation with its own model; the file stays open
    assert gen_of(at) is gen and gen.n_steps == 4 and app.loaded is not None and not app.viewing_file
    assert "this generation runs the bundled story-gpt" in page_text(at)
    assert "The trace file mine.zip is open too" in page_text(at)
    at.button(key="show_file").click()
    run(at)
    assert app.viewing_file and app.viewed_trace.n_steps == 3
    press_reset(at)
    assert app.viewing_file and gen_of(at) is None  # Reset forgets the generation, not the file
    press(at, "step_button")
    assert gen_of(at).model.config.family == "llama" and not app.viewing_file and app.loaded is not None
    at.button(key="close_file").click()
    run(at)
    assert app.loaded is not None and "Closed mine.zip" not in page_text(at)  # it asks first, as Reset does
    question = unescape(" ".join(w.value for w in at.warning))
    assert "Close the file mine.zip?" in question and "loading the file again (Export tab)" in question
    at.button(key="close_cancel").click()
    run(at)
    assert app.loaded is not None and not any(b.key == "close_confirm" for b in at.button)
    at.button(key="show_file").click()
    run(at)
    assert app.viewing_file  # Cancel left it as it was: still viewable
    at.button(key="close_file").click()
    run(at)
    assert "lets go of what the page shows now" in unescape(" ".join(w.value for w in at.warning))
    at.button(key="close_confirm").click()
    run(at)
    assert app.loaded is None and not app.viewing_file and "Closed mine.zip" in page_text(at)


def test_reset_lets_the_trace_go(stepped):
    """After Reset nothing of the session holds the old trace (its memory can be freed): not the app state, not
    a tab drawn from it. (That an ended session's trace is let go on a real server is checked in
    test_server_limits.py, with the server's own memory.)"""
    import gc
    import weakref

    at = stepped
    for tab in ("Attention", "KV cache", "What if", "Inspector"):  # each tab drawn once, as fragments
        show_tab(at, tab)
    trace = weakref.ref(gen_of(at).trace)
    press_reset(at)
    gc.collect()
    assert trace() is None


def test_a_broken_trace_file_gets_a_message_and_nothing_is_lost(stepped):
    at = show_tab(stepped, "Export")
    at.file_uploader(key="upload_trace").upload("broken.zip", b"PK\x03\x04 not really a zip", "application/zip")
    run(at)
    assert any("Could not load broken.zip" in unescape(e.value) for e in at.error)
    assert not at.session_state["app"].viewing_file and gen_of(at).n_steps == 3


def test_a_nan_weight_is_named_on_every_tab_even_with_shapes_capture(tmp_path, hf_dir_with_tokenizer):
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path / "nan-model"
    shutil.copytree(hf_dir_with_tokenizer, directory)
    weights = load_file(directory / "model.safetensors")
    weights["transformer.h.1.mlp.c_fc.weight"][3, 5] = float("nan")
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    for capture in ("values", "shapes"):
        at = new_app()
        at.sidebar.radio(key="source").set_value("Local Hugging Face directory")
        run(at)
        at.sidebar.text_input(key="model_dir").set_value(str(directory))
        at.sidebar.selectbox(key="capture").set_value(capture)
        press(at, "load_model")
        press(at, "step_button")
        for tab in ("Shapes", "Attention", "Next token", "Inspector"):
            show_tab(at, tab)
            banner = next(unescape(e.value) for e in at.error if "first appears at step 0" in e.value)
            if capture == "values":  # W₁'s output: the projection's, then the hook point's (one tensor)
                assert "in **blocks.1.mlp.c_fc:out**" in banner
            else:  # only the residual stream is checked: the block is named, and why not the record
                assert "in **blocks.1.hook_resid_post**" in banner and "capture values" in banner
        assert any("no token can be chosen" in w.value or "No token was chosen" in e.value
                   for w in at.warning for e in at.error) or gen_of(at).stopped
        if capture == "values":
            show_tab(at, "Shapes")
            at.button(key="open_anomaly").click()
            run(at)
            assert at.session_state["view"] == "Inspector"
            assert at.selectbox(key="inspect_select").value == "blocks.1.mlp.c_fc:out"
        torch.manual_seed(0)


def test_the_gradients_of_every_hook_point_are_recorded_and_saved(stepped):
    at = show_tab(stepped, "Attention", ("attn_view", "Gradients"))
    at.button(key="grad_capture").click()
    run(at)
    grads = at.session_state["app"].live.gradient_trace[1]
    assert grads.capture == "gradients" and grads.records
    frame = frame_with(at, "has_value")
    assert list(frame["name"]) == [r.name for r in grads.records]
    width, vocab = gen_of(at).facts.width(2), gen_of(at).model.config.vocab_size
    assert grads.record("hook_logits", 0).shape == (1, width, vocab)  # all t positions, recomputed
    assert ("∂L/∂x at every hook point the backward pass reaches: L = next-token cross-entropy = "
            f"{float(grads.value_note(grads.records[0]).split('= ')[2].split(',')[0]):.6g}, over the "
            f"{width} positions of generation step 2") in page_text(at)
    assert any(b.label == "Download the gradients trace of step 2 (.zip, the trace file format)"
               for b in at.get("download_button"))
    back = load_trace(archive_bytes(grads))
    assert back.capture == "gradients" and [r.name for r in back.records] == [r.name for r in grads.records]
    at.radio(key="grad_loss").set_value("−log p(chosen token)")  # another loss: asks for its own recording
    run(at)
    assert "Press the button to record step 2's gradients for L = −log p(chosen token)" in page_text(at)
    press_reset(at)
    assert at.session_state["app"].live.gradient_trace is None


def test_the_app_stops_a_bundled_story_at_its_end():
    """The bundled models declare <|endoftext|>: Run N stops there, says so, and the switch says which id."""
    at = new_app()
    at.sidebar.radio(key="source").set_value("Bundled Llama-style story model")
    at.sidebar.text_area(key="prompt").set_value("Once upon a time, Tom had a red ball. He")
    at.sidebar.selectbox(key="capture").set_value("shapes")
    run(at)
    switch = at.sidebar.toggle(key="stop_at_eos")
    assert not switch.disabled and "declares 0" in switch.help
    at.sidebar.number_input(key="run_n").set_value(200)
    press(at, "run_button")
    gen = gen_of(at)
    assert gen.n_steps < 200 and "end-of-sequence" in gen.stopped
    assert any("end-of-sequence" in w.value for w in at.warning)
