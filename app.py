"""GPT shape tracer — `streamlit run app.py`.

Wiring only: widgets, session state and layout. Traces come from ``tracer``,
figures and tables from ``figures`` (pure functions), settings checks from
``session``.
"""

from __future__ import annotations

import time
from pathlib import Path

import streamlit as st
import torch

from figures import attention as attn_views
from figures import cache as cache_views
from figures import flow as flow_views
from figures import inspector as inspect_views
from figures import mask as mask_views
from figures import tokens as token_views
from figures.common import dims_for, is_greedy, query_labels, shape_with_symbols, step_info, symbols
from model import ModelLoadError, load_bundled, load_hf_gpt2
from model.loading import BUNDLED_DIR
from session import (
    DEFAULT_PROMPT,
    MAX_BUDGET_MB,
    SettingsError,
    new_generation,
    parse_run_steps,
    parse_settings,
)
from tracer import Trace
from tracer.generation import MAX_RUN_STEPS, ContextFullError
from tracer.io import TraceFileError, load_trace, trace_archive_bytes
from tracer.store import DEFAULT_BUDGET_BYTES

TABS = ["Shapes", "Attention", "Causal mask", "KV cache", "Next token", "Inspector", "Export"]
AUTO_RECOMPUTE_PARAMS = 20_000_000  # below this, every step is checked against a full recompute
RECOMPUTE_REPEATS = 5  # timings of the cache comparison: the fastest of this many runs
LEGEND = "B batch · n new positions · t key positions (cache incl.) · d d_model · H heads · d_head = d/H · V vocab"

st.set_page_config(page_title="GPT shape tracer", page_icon="🔎", layout="wide")


# -- models (shared by every session; tracing routes per thread, so sharing is safe) --
@st.cache_resource(show_spinner="Loading the bundled story model…")
def bundled_model():
    return load_bundled()


@st.cache_resource(show_spinner="Loading GPT-2 from the local directory…", max_entries=2)
def directory_model(path: str):
    return load_hf_gpt2(path)


def current_model():
    key = st.session_state.get("model_key", "bundled")
    if key == "bundled":
        model, tok = bundled_model()
        return model, tok, f"bundled story model ({BUNDLED_DIR.name})"
    model, tok = directory_model(key)
    return model, tok, key


def describe_model(model) -> str:
    c = model.config
    return (f"{c.n_layer} layers × {c.n_head} heads, d = {c.d_model}, d_head = {c.d_head}, V = {c.vocab_size}, "
            f"n_ctx = {c.n_ctx} — {model.num_parameters / 1e6:.1f}M parameters")


def close_generation() -> None:
    gen = st.session_state.pop("gen", None)
    if gen is not None:
        gen.close()
    st.session_state["recompute"] = {}
    st.session_state["query_picks"] = {}


# -- sidebar: model, prompt, sampling, actions -------------------------------------
def sidebar() -> None:
    sb = st.sidebar
    sb.header("Model")
    source = sb.radio("Weights", ["Bundled story model", "Local GPT-2 directory"], key="source",
                      help="A directory written by Hugging Face save_pretrained (config.json + weights).")
    if source == "Local GPT-2 directory":
        path = sb.text_input("Directory", key="model_dir", placeholder="/path/to/gpt2")
        if sb.button("Load", key="load_model"):
            load_directory(path)
    elif st.session_state.get("model_key", "bundled") != "bundled":
        st.session_state["model_key"] = "bundled"
        close_generation()

    sb.header("Prompt")
    sb.text_area("Prompt (one line per sequence: several lines make a batch)", value=DEFAULT_PROMPT,
                 key="prompt", height=110)
    sb.header("Sampling")
    sb.radio("Decoding", ["greedy", "sample"], key="decoding", horizontal=True)
    sampling_off = st.session_state.get("decoding", "greedy") == "greedy"
    sb.number_input("temperature τ", value=1.0, step=0.1, key="temperature", disabled=sampling_off,
                    help="softmax(z/τ): τ < 1 sharpens, τ > 1 flattens; 0 < τ ≤ 100")
    cols = sb.columns(2)
    cols[0].number_input("top-k (0 = off)", value=0, step=1, key="top_k", disabled=sampling_off)
    cols[1].number_input("top-p", value=1.0, step=0.05, key="top_p", disabled=sampling_off, help="in (0, 1]")
    sb.text_input("seed", value="0", key="seed", disabled=sampling_off)
    sb.header("Tracing")
    sb.toggle("KV cache", value=True, key="use_cache",
              help="On: a decode step computes one new row. Off: every step recomputes all positions.")
    sb.selectbox("Capture", ["values", "shapes", "ops"], key="capture",
                 help="shapes: shape/dtype only · values: + tensors (within the budget) · ops: + every torch op")
    cols = sb.columns(2)
    cols[0].selectbox("Padding", ["left", "right"], key="padding_side")
    cols[1].number_input("Budget (MB)", value=DEFAULT_BUDGET_BYTES // 2**20, min_value=1, max_value=MAX_BUDGET_MB,
                         key="budget_mb")
    sb.header("Generate")
    cols = sb.columns(3)
    step = cols[0].button("Step", type="primary", key="step_button", use_container_width=True)
    run = cols[1].button("Run N", key="run_button", use_container_width=True)
    reset = cols[2].button("Reset", key="reset_button", use_container_width=True)
    sb.number_input(f"N (1…{MAX_RUN_STEPS})", value=8, step=1, key="run_n")
    if reset:
        try:
            current_settings()
        except SettingsError as e:  # refuse before throwing anything away
            st.session_state["notices"] = [("error", f"Reset refused, nothing was discarded: {e}")]
        else:
            close_generation()
            st.session_state.pop("loaded_trace", None)
            st.session_state["notices"] = [("info", "Reset: the next Step starts from the prompt with these settings.")]
    if step or run:
        advance(1 if step else st.session_state.get("run_n", 8))


def load_directory(path: str) -> None:
    if not path or not path.strip():
        st.session_state["notices"] = [("error", "Type the directory of a GPT-2 checkpoint first.")]
        return
    resolved = str(Path(path.strip()).expanduser())
    try:
        directory_model(resolved)
    except ModelLoadError as e:
        st.session_state["notices"] = [("error", f"Could not load that model, the previous one stays loaded: {e}")]
        return
    model, tok = directory_model(resolved)
    if tok is None:
        st.session_state["notices"] = [("error", f"{resolved} has no tokenizer (tokenizer.json, or vocab.json + "
                                                 "merges.txt); the previous model stays loaded.")]
        return
    close_generation()
    st.session_state["model_key"] = resolved
    st.session_state["notices"] = [("success", f"Loaded {resolved}: {describe_model(model)}")]


def current_settings():
    s = st.session_state
    return parse_settings(
        prompt=s.get("prompt", DEFAULT_PROMPT), greedy=s.get("decoding", "greedy") == "greedy",
        temperature=s.get("temperature", 1.0), top_k=s.get("top_k", 0), top_p=s.get("top_p", 1.0),
        seed=s.get("seed", "0"), use_cache=s.get("use_cache", True), capture=s.get("capture", "values"),
        padding_side=s.get("padding_side", "left"), budget_mb=s.get("budget_mb", DEFAULT_BUDGET_BYTES / 2**20),
    )


def advance(n_raw) -> None:
    """Step or Run N: one forward pass and one token per step, on this session's generation."""
    notices = []
    try:
        n = parse_run_steps(n_raw)
        gen = st.session_state.get("gen")
        if gen is None:
            settings = current_settings()
            model, tok, _ = current_model()
            gen = new_generation(model, tok, settings)
            st.session_state["gen"] = gen
            st.session_state["gen_signature"] = settings.signature()
            st.session_state["recompute"] = {}
            st.session_state["query_picks"] = {}
            notices += [("warning", w) for w in gen.warnings]
    except SettingsError as e:
        st.session_state["notices"] = [("error", str(e))]
        return
    st.session_state.pop("loaded_trace", None)
    started = time.perf_counter()
    for _ in range(n):
        try:
            gen.step()
        except ContextFullError as e:
            notices.append(("warning", f"Stopped: {e}"))
            break
        except Exception as e:  # a failing forward: the trace keeps everything up to it
            notices.append(("error", f"The forward pass failed at step {gen.n_steps}: {type(e).__name__}: {e}"))
            break
        if gen.model.num_parameters < AUTO_RECOMPUTE_PARAMS:
            st.session_state["recompute"][gen.n_steps - 1] = gen.compare_with_recompute(repeats=RECOMPUTE_REPEATS)
    st.session_state["last_action_seconds"] = time.perf_counter() - started
    if gen.n_steps:
        st.session_state["step_view"] = gen.n_steps - 1
    st.session_state["notices"] = notices


# -- header: text, step slider, step facts -------------------------------------------
def viewed_trace() -> Trace | None:
    loaded = st.session_state.get("loaded_trace")
    if loaded is not None:
        return loaded
    gen = st.session_state.get("gen")
    return gen.trace if gen is not None and gen.n_steps else None


def header(trace: Trace) -> int:
    n_steps = trace.n_steps
    if "pending_step_view" in st.session_state:
        st.session_state["step_view"] = st.session_state.pop("pending_step_view")
    if n_steps > 1:
        st.session_state["step_view"] = min(st.session_state.get("step_view", n_steps - 1), n_steps - 1)
        step = st.slider("Step (time travel: every view shows this step)", 0, n_steps - 1, key="step_view")
    else:
        step = 0
        st.caption("Step 0 (the prefill). Step again to generate more tokens.")
    info = step_info(trace, step)
    batch = len(trace.meta.get("columns", [[0]]))
    for row in range(batch):
        prefix = f"**Sequence {row}** " if batch > 1 else ""
        st.markdown(prefix + token_views.generated_text_html(trace, row, upto_step=step), unsafe_allow_html=True)
    st.caption("Prompt in grey; each generated token shaded by the probability it was chosen with, "
               "red (unlikely) → green (likely); hover a token for its step and p.")
    cols = st.columns(5)
    cols[0].metric("new positions n", info.n)
    cols[1].metric("key positions t", info.t)
    cols[2].metric("cache length after step", info.cache_length_after if info.use_cache else 0,
                   help="0 when the KV cache is off")
    cols[3].metric("forward time", f"{info.seconds * 1000:.1f} ms")
    cols[4].metric("rows computed", f"{info.n} of {info.t}")
    return step


# -- tabs ------------------------------------------------------------------------------
def layer_head_batch(trace: Trace, prefix: str, heads: bool = True) -> tuple[int, int, int]:
    cfg = trace.meta.get("model_config", {})
    cols = st.columns(3)
    layer = cols[0].selectbox("layer", list(range(cfg.get("n_layer", 1))), key=f"{prefix}_layer")
    head = cols[1].selectbox("head", list(range(cfg.get("n_head", 1))), key=f"{prefix}_head") if heads else 0
    batch_size = len(trace.meta.get("columns", [[0]]))
    batch = cols[2].selectbox("sequence", list(range(batch_size)), key=f"{prefix}_batch") if batch_size > 1 else 0
    return layer, head, batch


@st.fragment
def shapes_tab(trace: Trace, step: int) -> None:
    cfg = trace.meta.get("model_config", {})
    layer = st.selectbox("block shown in the flow", list(range(cfg.get("n_layer", 1))), key="flow_layer")
    st.caption(f"Live shapes at step {step}, numerically and in symbols — {LEGEND}.")
    st.plotly_chart(flow_views.shape_flow_figure(trace, step, layer), key="flow_chart")
    st.subheader("Every record of this step")
    cols = st.columns([1, 2, 1, 2])
    layers = ["all"] + list(range(cfg.get("n_layer", 0)))
    layer_filter = cols[0].selectbox("layer", layers, key="table_layer")
    module_filter = cols[1].text_input("module (path prefix)", key="table_module", placeholder="blocks.0.attn")
    kind_filter = cols[2].selectbox("kind", ["all", "hook", "input", "output"], key="table_kind")
    name_filter = cols[3].text_input("name contains (or glob)", key="table_name")
    frame = trace.to_frame(
        step=step, layer=None if layer_filter == "all" else int(layer_filter),
        module=module_filter.strip() or None, kind=None if kind_filter == "all" else kind_filter,
        name=name_filter.strip() or None,
    )
    dims = dims_for(trace, step)
    frame["shape"] = [shape_with_symbols(n, s, dims) for n, s in zip(frame["name"], frame["shape"])]
    shown = frame[["index", "name", "kind", "module_type", "shape", "dtype", "numel", "nbytes", "summary"]]
    event = st.dataframe(shown, key="records_table", hide_index=True, on_select="rerun",
                         selection_mode="single-row", height=420)
    rows = event.selection.rows if event is not None and hasattr(event, "selection") else []
    if rows:
        st.session_state["inspect_name"] = shown.iloc[rows[0]]["name"]
        st.info(f"Opened **{shown.iloc[rows[0]]['name']}** in the Inspector tab.")
    st.caption(f"{len(frame)} record(s). Select a row to open it in the Inspector.")


def values_kept(trace: Trace, step: int, name: str, what: str) -> bool:
    """Whether ``name``'s values exist at ``step``; if not, say why instead of drawing empty charts."""
    if trace.get(name, step) is not None:
        return True
    explain_missing_values(trace, step, what)
    return False


def explain_missing_values(trace: Trace, step: int, what: str) -> None:
    if trace.capture == "shapes":
        st.info(f"Capture is **shapes**: only shapes, dtypes and sizes were recorded, so there are no {what} to "
                "draw. Choose **values** (or ops) under Tracing in the sidebar and Reset.")
    else:
        st.info(f"The values of step {step} were evicted by the memory budget (the oldest steps go first); "
                f"its shapes and statistics are kept, its {what} are not. Raise the budget, or view a later step.")


@st.fragment
def attention_tab(trace: Trace, step: int) -> None:
    layer, head, batch = layer_head_batch(trace, "attn")
    st.latex(r"A = \operatorname{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}} + M\right), \qquad z = A\,V")
    if not values_kept(trace, step, f"blocks.{layer}.attn.hook_pattern", "attention heatmaps"):
        stages = attn_views.attention_stages(trace, step, layer, head, batch)
        st.markdown("\n".join(f"- **{s.title}**: `{s.shapes}`" for s in stages))
        return
    st.plotly_chart(attn_views.attention_stages_figure(trace, step, layer, head, batch), key="stages_chart")
    queries = query_labels(trace, step, batch)
    # keyed by step and sequence: the query rows differ between steps (n0 at the prefill, 1 after), and a
    # widget kept across them would show one step's label over another step's row. Streamlit forgets a
    # widget that was not drawn, so the pick per step is remembered in a plain key.
    picks = st.session_state.setdefault("query_picks", {})
    remembered = picks.get((step, batch), len(queries) - 1)
    pick = st.selectbox("query token: which keys does it attend to?", list(range(len(queries))),
                        index=remembered if remembered < len(queries) else len(queries) - 1,
                        format_func=lambda i: queries[i], key=f"attn_query_s{step}_b{batch}")
    picks[(step, batch)] = pick
    st.markdown(attn_views.query_attention_html(trace, step, layer, head, pick, batch), unsafe_allow_html=True)
    info = step_info(trace, step)
    if info.use_cache and step > 0:
        st.subheader("Rows accumulated over the steps")
        st.caption("With the cache a decode step computes one query row; stacking the rows of steps 0…s "
                   "rebuilds the lower-triangular pattern token by token (this step's row outlined).")
        st.plotly_chart(attn_views.attention_history_figure(trace, layer, head, step, batch), key="history_chart")
    st.subheader("All heads (layers × heads)")
    fig, note = attn_views.all_heads_figure(trace, step, batch)
    if note:
        st.caption(note)
    st.plotly_chart(fig, key="all_heads_chart")


@st.fragment
def mask_tab(trace: Trace, step: int) -> None:
    layer, head, batch = layer_head_batch(trace, "mask")
    facts = mask_views.mask_facts(trace, step, layer, batch)
    st.markdown(facts.explanation())
    if not values_kept(trace, step, f"blocks.{layer}.attn.hook_mask", "mask and score heatmaps"):
        return
    st.plotly_chart(mask_views.mask_figure(trace, step, layer, batch), key="mask_chart")
    st.plotly_chart(mask_views.scores_before_after_figure(trace, step, layer, head, batch), key="before_after_chart")


@st.fragment
def cache_tab(trace: Trace, step: int) -> None:
    info = step_info(trace, step)
    if not info.use_cache:
        st.warning("The KV cache is off for this generation: every step recomputes K and V for all positions. "
                   "The table shows what each step computed.")
    st.dataframe(cache_views.cache_table(trace, step), hide_index=True, key="cache_table")
    st.plotly_chart(cache_views.cache_growth_figure(trace, step), key="growth_chart")
    cols = st.columns([3, 1])
    with cols[0]:
        layer, head, batch = layer_head_batch(trace, "kv")
    which = cols[1].radio("tensor", ["K", "V"], horizontal=True, key="kv_which")
    hook = "hook_k_all" if which == "K" else "hook_v_all"
    if values_kept(trace, step, f"blocks.{layer}.attn.{hook}", f"{which} values"):
        st.plotly_chart(cache_views.key_heatmap_figure(trace, step, layer, head, batch, which), key="kv_chart")
    st.subheader("Cache on vs off")
    comparisons = st.session_state.get("recompute", {}) if "loaded_trace" not in st.session_state else {}
    gen = st.session_state.get("gen")
    if gen is not None and "loaded_trace" not in st.session_state and st.button(
            "Measure the latest step both ways", key="measure_recompute",
            help="Redo the latest step untraced with the cache and as a full recompute; time both, compare logits"):
        comparisons[gen.n_steps - 1] = gen.compare_with_recompute(repeats=RECOMPUTE_REPEATS)
        st.session_state["recompute"] = comparisons
    st.plotly_chart(cache_views.cache_on_off_figure(trace, comparisons), key="on_off_chart")
    if step in comparisons:
        c = comparisons[step]
        equal = c.max_abs_delta < 1e-4
        verdict = ("equal up to float32 rounding: only the new row was needed, as the KV-caching notes "
                   "(seed document 001) argue" if equal else
                   "NOT equal: the cached path disagrees with a full recompute")
        cols = st.columns(3)
        cols[0].metric("max |Δ logits|, cached vs full recompute", f"{c.max_abs_delta:.2e}",
                       help="over the logits rows sampled from")
        cols[1].metric(f"cached path ({c.cached_rows} query row{'s' if c.cached_rows != 1 else ''})",
                       f"{c.cached_seconds * 1000:.1f} ms", help="untraced, fastest of the repeats")
        cols[2].metric(f"full recompute ({c.full_rows} rows)", f"{c.full_seconds * 1000:.1f} ms",
                       help="untraced, fastest of the repeats")
        own = ("this run's own cached logits" if c.run_used_cache else
               "an untraced cached re-run (this run has the cache off: it is itself the full recompute)")
        st.caption(f"{verdict}. The cached side is {own}. Both timings leave the tracer out (the traced step "
                   f"took {info.seconds * 1000:.1f} ms); each is the fastest of {RECOMPUTE_REPEATS} runs, yet on a "
                   "busy machine a few ms can swing either way — the rows computed per step are the exact "
                   "comparison, the seconds an estimate.")
    elif gen is not None:
        st.caption("Press the button to redo this generation's latest step both ways and compare.")


@st.fragment
def next_token_tab(trace: Trace, step: int) -> None:
    batch_size = len(trace.meta.get("columns", [[0]]))
    row = st.selectbox("sequence", list(range(batch_size)), key="next_row") if batch_size > 1 else 0
    sampling = trace.meta.get("sampling", {})
    st.caption("Sampling: " + ("greedy (argmax)" if is_greedy(trace) else
                               f"τ = {sampling.get('temperature')}, top-k = {sampling.get('top_k') or 'off'}, "
                               f"top-p = {sampling.get('top_p') or 'off'}, seed {sampling.get('seed')}"))
    st.plotly_chart(token_views.next_token_figure(trace, step, row), key="next_chart")
    if is_greedy(trace):
        st.info("Greedy decoding takes the argmax of the logits: temperature, top-k and top-p play no part, so "
                "there is no reshaping to show. Choose **sample** in the sidebar (and Reset) to see it.")
    else:
        st.plotly_chart(token_views.distribution_stages_figure(trace, step, row), key="stages_dist_chart")


@st.fragment
def inspector_tab(trace: Trace, step: int) -> None:
    names = trace.names(step)
    anomaly = trace.first_anomaly(step)
    if anomaly is not None:
        st.error(f"NaN/Inf first appears in **{anomaly.name}** (record {anomaly.index}, step {step}): "
                 f"{trace.summary(anomaly.name, step)}")
    default = st.session_state.get("inspect_name", "blocks.0.attn.hook_pattern")
    index = names.index(default) if default in names else 0
    name = st.selectbox("record", names, index=index, key="inspect_select")
    rec = trace.record(name, step)
    st.code(trace.summary(name, step), language=None)
    st.caption(f"{rec.module_type} `{rec.module or 'model'}` · {rec.kind} · {rec.module_params:,} parameters · "
               f"{shape_with_symbols(name, rec.shape, dims_for(trace, step))}"
               + (f" · {rec.value_note}" if rec.value_note else ""))
    value = trace.get(name, step)
    if value is None:
        explain_missing_values(trace, step, "values (heatmap, histogram, raw numbers)")
    else:
        show_tensor(value, name, symbols(name, rec.shape, dims_for(trace, step)))
    if trace.capture == "ops":
        # a hook point computes nothing itself: show the module that produced its tensor
        module = rec.module.rsplit(".", 1)[0] if rec.kind == "hook" and "." in rec.module else rec.module
        module = "" if rec.kind == "hook" and "." not in rec.module else module
        st.subheader(f"Ops inside `{module or 'model'}` at step {step}, in call order")
        st.dataframe(inspect_views.module_ops(trace, step, module or None), hide_index=True, key="ops_table")


def show_tensor(value: torch.Tensor, name: str, dim_symbols: list[str] | None = None) -> None:
    if value.dim() >= 2:
        # keyed by record: another record has other dims and starts from its own default (its last two
        # dims). Options are named by symbol, not size: a widget's labels would not follow t as it grows.
        dims = list(range(value.dim()))
        cols = st.columns(2)
        label = (lambda d: f"dim {d} ({dim_symbols[d]})") if dim_symbols else (lambda d: f"dim {d}")
        rows_dim = cols[0].selectbox("rows", dims, index=value.dim() - 2, key=f"insp_rows_{name}", format_func=label)
        cols_dim = cols[1].selectbox("columns", dims, index=value.dim() - 1, key=f"insp_cols_{name}",
                                     format_func=label)
        if rows_dim == cols_dim:
            st.warning("Pick two different dimensions for rows and columns.")
            return
        fixed = {}
        others = [d for d in dims if d not in (rows_dim, cols_dim)]
        if others:
            sel = st.columns(len(others))
            for col, d in zip(sel, others):
                fixed[d] = col.number_input(f"index in {label(d)}, 0 … {value.shape[d] - 1}", min_value=0,
                                            max_value=value.shape[d] - 1,
                                            value=0, key=f"insp_fix_{name}_{d}_{value.shape[d]}")
        matrix = inspect_views.slice_2d(value, rows_dim, cols_dim, fixed)
        st.plotly_chart(inspect_views.tensor_heatmap_figure(matrix, name), key="insp_heatmap")
    st.plotly_chart(inspect_views.histogram_figure(value, f"values of {name}"), key="insp_hist")
    raw = inspect_views.raw_frame(value)
    if raw is not None:
        st.dataframe(raw, key="insp_raw")


def export_tab(trace: Trace | None) -> None:
    if trace is not None:
        st.download_button("Download this trace (.zip: manifest.json, records.parquet, ops.parquet, "
                           "values.safetensors)", data=lambda: trace_archive_bytes(trace),
                           file_name="trace.zip", mime="application/zip", key="download_trace", on_click="ignore")
    upload = st.file_uploader("Load a trace (.zip)", type=["zip"], key="upload_trace")
    if upload is not None and st.session_state.get("uploaded_id") != upload.file_id:
        st.session_state["uploaded_id"] = upload.file_id
        try:
            loaded = load_trace(upload.getvalue())
        except TraceFileError as e:
            st.error(f"Could not load {upload.name}: {e}. Nothing else changed.")
            return
        if not loaded.steps or not loaded.meta.get("labels"):
            st.error(f"{upload.name} is a valid trace but not of a generation this app can show.")
            return
        st.session_state["loaded_trace"] = loaded
        st.session_state["pending_step_view"] = loaded.n_steps - 1  # the slider exists already: apply next run
        st.rerun()


# -- page ------------------------------------------------------------------------------
def main() -> None:
    sidebar()
    st.title("GPT shape tracer")
    try:
        model, _, label = current_model()
        st.caption(f"Model: **{label}** — {describe_model(model)}")
    except ModelLoadError as e:
        st.error(f"The selected model cannot be loaded: {e}")
        st.session_state["model_key"] = "bundled"
        return
    for level, message in st.session_state.pop("notices", []):
        getattr(st, level)(message)
    gen = st.session_state.get("gen")
    try:
        settings = current_settings()
    except SettingsError as e:
        settings = None
        st.warning(f"These settings cannot be used: {e}"
                   + (" — Step keeps continuing the current generation with its own settings." if gen else ""))
    if gen is not None and "loaded_trace" not in st.session_state:
        if settings is not None and settings.signature() != st.session_state.get("gen_signature"):
            st.info("The settings changed since this generation started: Step continues it as it was; "
                    "Reset applies the new settings.")
        if gen.trace.error is not None:
            st.error(gen.trace.error.describe())
    if "loaded_trace" in st.session_state:
        st.info("Viewing a loaded trace file. Step, Run N or Reset return to live generation.")
    trace = viewed_trace()
    if trace is None:
        st.info("Press **Step** to run the prompt in the sidebar (edit it first if you like): step 0 runs the "
                "whole prompt (the prefill), every further step one new token.")
        with st.tabs(["Export"])[0]:
            export_tab(None)
        return
    step = header(trace)
    # no tabs are drawn while there is nothing to view (after Reset), and Streamlit forgets the state of a
    # widget that was not drawn: a plain key keeps the open tab, so Reset → Step returns to the same view
    if "view" not in st.session_state and st.session_state.get("open_tab") in TABS:
        st.session_state["view"] = st.session_state["open_tab"]
    tabs = st.tabs(TABS, key="view", on_change="rerun")
    st.session_state["open_tab"] = st.session_state.get("view")
    panels = [shapes_tab, attention_tab, mask_tab, cache_tab, next_token_tab, inspector_tab]
    for tab, panel in zip(tabs, panels):
        with tab:
            if tab.open:
                panel(trace, step)
    with tabs[-1]:
        if tabs[-1].open:
            export_tab(trace)


main()
