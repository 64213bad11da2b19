"""GPT shape tracer — `streamlit run app.py`.

Wiring only: widgets, session state and layout. Traces come from ``tracer``,
figures and tables from ``figures`` (pure functions), settings checks from
``session``.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st
import torch

from figures import attention as attn_views
from figures import cache as cache_views
from figures import flow as flow_views
from figures import inspector as inspect_views
from figures import mask as mask_views
from figures import tokens as token_views
from figures.common import facts_of, is_greedy, query_labels, shape_with_axes
from model import ModelLoadError, load_bundled, load_hf_gpt2
from model.hook_table import act_name
from model.identity import identity_of
from session import (
    DEFAULT_PROMPT,
    MAX_BUDGET_MB,
    AppState,
    LoadedTrace,
    SettingsError,
    parse_run_steps,
    parse_settings,
)
from tracer import Trace, TraceFileError, load_trace
from tracer.generation import MAX_RUN_STEPS, ContextFullError, GenerationStopped
from tracer.io import archive_bytes
from tracer.records import TENSOR_KINDS
from tracer.store import DEFAULT_BUDGET_BYTES

TABS = ["Shapes", "Attention", "Causal mask", "KV cache", "Next token", "Inspector", "Export"]
AUTO_RECOMPUTE_PARAMS = 20_000_000  # below this, every step is checked against a full recompute
RECOMPUTE_REPEATS = 5  # timings of the cache comparison on demand: the fastest of this many runs
LEGEND = "B batch · n new positions · t key positions (cache incl.) · d d_model · H heads · d_head = d/H · V vocab"

st.set_page_config(page_title="GPT shape tracer", page_icon="🔎", layout="wide")


# -- models (shared by every session; tracing routes per thread, so sharing is safe) --
@st.cache_resource(show_spinner="Loading the bundled story model…")
def bundled_model():
    return load_bundled()


@st.cache_resource(show_spinner="Loading GPT-2 from the local directory…", max_entries=2)
def directory_model(path: str):
    return load_hf_gpt2(path)


def state() -> AppState:
    """This session's state: one typed object, not loose keys."""
    return st.session_state.setdefault("app", AppState())


def current_model():
    key = state().model_key
    if key == "bundled":
        model, tok = bundled_model()
        return model, tok
    return directory_model(key)


def describe_model(model) -> str:
    c = model.config
    return (f"{c.n_layer} layers × {c.n_head} heads, d = {c.d_model}, d_head = {c.d_head}, V = {c.vocab_size}, "
            f"n_ctx = {c.n_ctx} — {model.num_parameters / 1e6:.1f}M parameters")


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
    elif state().model_key != "bundled":
        state().model_key = "bundled"
        state().reset()

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
            state().notices = [("error", f"Reset refused, nothing was discarded: {e}")]
        else:
            state().reset()
            state().notices = [("info", "Reset: the next Step starts from the prompt with these settings.")]
    if step or run:
        advance(1 if step else st.session_state.get("run_n", 8))


def load_directory(path: str) -> None:
    app = state()
    if not path or not path.strip():
        app.notices = [("error", "Type the directory of a GPT-2 checkpoint first.")]
        return
    resolved = str(Path(path.strip()).expanduser())
    try:
        model, tok = directory_model(resolved)
    except ModelLoadError as e:
        app.notices = [("error", f"Could not load that model, the previous one stays loaded: {e}")]
        return
    if tok is None:
        app.notices = [("error", f"{resolved} has no tokenizer (tokenizer.json, or vocab.json + merges.txt); the "
                                 "previous model stays loaded.")]
        return
    app.reset()
    app.model_key = resolved
    app.notices = [("success", f"Loaded {resolved}: {describe_model(model)}")]


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
    app = state()
    notices = []
    try:
        n = parse_run_steps(n_raw)
        gen = app.generation
        if gen is None:
            settings = current_settings()
            model, tok = current_model()
            gen = app.start(model, tok, settings)
            notices += [("warning", w) for w in gen.warnings]
    except SettingsError as e:
        app.notices = [("error", str(e))]
        return
    app.close_file()
    for _ in range(n):
        try:
            gen.step()
        except (ContextFullError, GenerationStopped) as e:
            notices.append(("warning", f"Stopped: {e}"))
            break
        except Exception as e:  # a failing forward: the trace keeps everything up to it
            notices.append(("error", f"The forward pass failed at step {gen.n_steps}: {type(e).__name__}: {e}"))
            break
        if gen.model.num_parameters < AUTO_RECOMPUTE_PARAMS:
            gen.compare_with_recompute()
        if gen.stopped:
            notices.append(("warning", f"Stopped: {gen.stopped}"))
            break
    if gen.n_steps:
        st.session_state["step_view"] = gen.n_steps - 1
    app.notices = notices


# -- header: text, step slider, step facts -------------------------------------------
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
    facts = facts_of(trace)
    forward = facts.step(step).forward
    batch = facts.batch_size
    for row in range(batch):
        prefix = f"**Sequence {row}** " if batch > 1 else ""
        st.markdown(prefix + token_views.generated_text_html(trace, row, upto_step=step), unsafe_allow_html=True)
    st.caption("Prompt in grey; each generated token shaded by the probability it was chosen with, "
               "red (unlikely) → green (likely); hover a token for its step and p.")
    cols = st.columns(5)
    cols[0].metric("new positions n", forward.n)
    cols[1].metric("key positions t", forward.t)
    cols[2].metric("cache length after step", forward.cache_after if facts.info.use_cache else 0,
                   help="0 when the KV cache is off")
    cols[3].metric("forward time", f"{trace.steps[step].seconds * 1000:.1f} ms")
    cols[4].metric("rows computed", f"{forward.n} of {forward.t}")
    return step


# -- tabs ------------------------------------------------------------------------------
def n_layer_head(trace: Trace) -> tuple[int, int]:
    config = trace.config
    return (config.n_layer, config.n_head) if config is not None else (1, 1)


def layer_head_batch(trace: Trace, prefix: str, heads: bool = True) -> tuple[int, int, int]:
    n_layer, n_head = n_layer_head(trace)
    cols = st.columns(3)
    layer = cols[0].selectbox("layer", list(range(n_layer)), key=f"{prefix}_layer")
    head = cols[1].selectbox("head", list(range(n_head)), key=f"{prefix}_head") if heads else 0
    batch_size = facts_of(trace).batch_size
    batch = cols[2].selectbox("sequence", list(range(batch_size)), key=f"{prefix}_batch") if batch_size > 1 else 0
    return layer, head, batch


@st.fragment
def shapes_tab(trace: Trace, step: int) -> None:
    n_layer, _ = n_layer_head(trace)
    layer = st.selectbox("block shown in the flow", list(range(n_layer)), key="flow_layer")
    st.caption(f"Live shapes at step {step}, numerically and in symbols — {LEGEND}.")
    st.plotly_chart(flow_views.shape_flow_figure(trace, step, layer), key="flow_chart")
    st.subheader("Every record of this step")
    cols = st.columns([1, 2, 1, 2])
    layers = ["all"] + list(range(n_layer))
    layer_filter = cols[0].selectbox("layer", layers, key="table_layer")
    module_filter = cols[1].text_input("module (path prefix)", key="table_module", placeholder="blocks.0.attn")
    kind_filter = cols[2].selectbox("kind", ["all", *TENSOR_KINDS], key="table_kind")
    name_filter = cols[3].text_input("name contains (or glob)", key="table_name")
    frame = trace.to_frame(
        step=step, layer=None if layer_filter == "all" else int(layer_filter),
        module=module_filter.strip() or None, kind=None if kind_filter == "all" else kind_filter,
        name=name_filter.strip() or None,
    )
    frame["shape"] = [f"{list(s)} = {a}" if a else str(list(s)) for s, a in zip(frame["shape"], frame["axes"])]
    shown = frame[["index", "name", "kind", "module_type", "shape", "dtype", "numel", "nbytes", "summary"]]
    event = st.dataframe(shown, key="records_table", hide_index=True, on_select="rerun",
                         selection_mode="single-row", height=420)
    rows = event.selection.rows if event is not None and hasattr(event, "selection") else []
    if rows:
        state().inspect_name = shown.iloc[rows[0]]["name"]
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
    if not values_kept(trace, step, act_name("pattern", layer), "attention heatmaps"):
        stages = attn_views.attention_stages(trace, step, layer, head, batch)
        st.markdown("\n".join(f"- **{s.title}**: `{s.shapes}`" for s in stages))
        return
    st.plotly_chart(attn_views.attention_stages_figure(trace, step, layer, head, batch), key="stages_chart")
    queries = query_labels(trace, step, batch)
    # keyed by step and sequence: the query rows differ between steps (n0 at the prefill, 1 after), and a
    # widget kept across them would show one step's label over another step's row. Streamlit forgets a
    # widget that was not drawn, so the pick per step is remembered in a plain key.
    picks = state().query_picks
    remembered = picks.get((step, batch), len(queries) - 1)
    pick = st.selectbox("query token: which keys does it attend to?", list(range(len(queries))),
                        index=remembered if remembered < len(queries) else len(queries) - 1,
                        format_func=lambda i: queries[i], key=f"attn_query_s{step}_b{batch}")
    picks[(step, batch)] = pick
    st.markdown(attn_views.query_attention_html(trace, step, layer, head, pick, batch), unsafe_allow_html=True)
    if facts_of(trace).info.use_cache and step > 0:
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
    if not values_kept(trace, step, act_name("mask", layer), "mask and score heatmaps"):
        return
    st.plotly_chart(mask_views.mask_figure(trace, step, layer, batch), key="mask_chart")
    st.plotly_chart(mask_views.scores_before_after_figure(trace, step, layer, head, batch), key="before_after_chart")


@st.fragment
def cache_tab(trace: Trace, step: int) -> None:
    app = state()
    facts = facts_of(trace)
    if not facts.info.use_cache:
        st.warning("The KV cache is off for this generation: every step recomputes K and V for all positions. "
                   "The table shows what each step computed.")
    st.dataframe(cache_views.cache_table(trace, step), hide_index=True, key="cache_table")
    st.plotly_chart(cache_views.cache_growth_figure(trace, step), key="growth_chart")
    cols = st.columns([3, 1])
    with cols[0]:
        layer, head, batch = layer_head_batch(trace, "kv")
    which = cols[1].radio("tensor", ["K", "V"], horizontal=True, key="kv_which")
    if values_kept(trace, step, act_name("k_all" if which == "K" else "v_all", layer), f"{which} values"):
        st.plotly_chart(cache_views.key_heatmap_figure(trace, step, layer, head, batch, which), key="kv_chart")
    st.subheader("Cache on vs off")
    gen = app.generation if not app.viewing_file else None
    if gen is not None and st.button(
            "Measure the latest step both ways", key="measure_recompute",
            help="Redo the latest step untraced with the cache and as a full recompute; time both, compare logits"):
        gen.compare_with_recompute(timing_repeats=RECOMPUTE_REPEATS)
    st.plotly_chart(cache_views.cache_on_off_figure(trace), key="on_off_chart")
    comparisons = facts_of(trace).comparisons
    if step in comparisons:
        c = comparisons[step]
        verdict = ("equal up to float32 rounding: only the new row was needed" if c.equal else
                   "NOT equal: the cached path disagrees with a full recompute")
        cols = st.columns(3)
        cols[0].metric("max |Δ logits|, cached vs full recompute", f"{c.max_abs_delta:.2e}",
                       help="over the logits rows sampled from")
        cols[1].metric(f"cached path ({c.cached.query_rows} query row{'s' if c.cached.query_rows != 1 else ''})",
                       f"{c.cached.seconds * 1000:.1f} ms", help="untraced, fastest of the repeats")
        cols[2].metric(f"full recompute ({c.full.query_rows} rows)", f"{c.full.seconds * 1000:.1f} ms",
                       help="untraced, fastest of the repeats")
        own = ("this run's own cached logits" if c.run_used_cache else
               "an untraced cached re-run (this run has the cache off: it is itself the full recompute)")
        st.caption(f"{verdict}. The cached side is {own}. Both timings leave the tracer out (the traced step "
                   f"took {trace.steps[step].seconds * 1000:.1f} ms); each is the fastest of {c.timing_repeats} "
                   "run(s), yet on a busy machine a few ms can swing either way — the rows computed per step are "
                   "the exact comparison, the seconds an estimate.")
    elif gen is not None:
        st.caption("Press the button to redo this generation's latest step both ways and compare.")


@st.fragment
def next_token_tab(trace: Trace, step: int) -> None:
    facts = facts_of(trace)
    batch_size = facts.batch_size
    row = st.selectbox("sequence", list(range(batch_size)), key="next_row") if batch_size > 1 else 0
    st.caption("Sampling: " + facts.info.sampling.describe())
    if facts.step(step).sampling is None:
        st.error(f"No token was chosen at step {step}: the logits held NaN or +∞. See the Inspector.")
        return
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
    default = state().inspect_name or act_name("pattern", 0)
    index = names.index(default) if default in names else 0
    name = st.selectbox("record", names, index=index, key="inspect_select")
    rec = trace.record(name, step)
    st.code(trace.summary(name, step), language=None)
    note = trace.value_note(rec)
    st.caption(f"{rec.module_type} `{rec.module or 'model'}` · {rec.kind} · {rec.module_params:,} parameters · "
               f"{shape_with_axes(rec)}" + (f" · {note}" if note else ""))
    value = trace.value(rec)
    if value is None:
        explain_missing_values(trace, step, "values (heatmap, histogram, raw numbers)")
    else:
        show_tensor(value, name, list(rec.axes) if rec.axes else None)
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
    app = state()
    if trace is not None:
        st.download_button("Download this trace (.zip: manifest.json, records.parquet, ops.parquet, "
                           "values.safetensors)", data=lambda: archive_bytes(trace),
                           file_name="trace.zip", mime="application/zip", key="download_trace", on_click="ignore")
    upload = st.file_uploader("Load a trace (.zip)", type=["zip"], key="upload_trace")
    if upload is not None and app.last_upload_id != upload.file_id:
        app.last_upload_id = upload.file_id
        try:
            loaded = load_trace(upload.getvalue())
        except TraceFileError as e:
            st.error(f"Could not load {upload.name}: {e}. Nothing else changed.")
            return
        if not loaded.steps or loaded.generation is None:
            st.error(f"{upload.name} is a valid trace but not of a generation this app can show.")
            return
        app.open_file(LoadedTrace(loaded, upload.name, upload.file_id))
        st.session_state["pending_step_view"] = loaded.n_steps - 1  # the slider exists already: apply next run
        st.rerun()


# -- page ------------------------------------------------------------------------------
def main() -> None:
    app = state()
    sidebar()
    st.title("GPT shape tracer")
    for level, message in app.notices:
        getattr(st, level)(message)
    app.notices = []
    trace = app.viewed_trace
    if trace is not None and trace.model is not None:
        st.caption(f"Model: **{trace.model.describe()}**" + (" — from the loaded file" if app.viewing_file else ""))
    else:
        try:
            model, _ = current_model()
            st.caption(f"Model: **{identity_of(model).describe()}** — {describe_model(model)}")
        except ModelLoadError as e:
            st.error(f"The selected model cannot be loaded: {e}")
            app.model_key = "bundled"
            return
    gen = app.generation
    try:
        settings = current_settings()
    except SettingsError as e:
        settings = None
        st.warning(f"These settings cannot be used: {e}"
                   + (" — Step keeps continuing the current generation with its own settings." if gen else ""))
    if gen is not None and not app.viewing_file:
        if settings is not None and settings != app.started_with:
            st.info("The settings changed since this generation started: Step continues it as it was; "
                    "Reset applies the new settings.")
        if gen.trace.error is not None:
            st.error(gen.trace.error.describe())
    if app.viewing_file:
        st.info(f"Viewing the trace file {app.loaded.file_name}. Step, Run N or Reset return to live generation "
                "(and leave this file view).")
    if trace is None:
        st.info("Press **Step** to run the prompt in the sidebar (edit it first if you like): step 0 runs the "
                "whole prompt (the prefill), every further step one new token.")
        with st.tabs(["Export"])[0]:
            export_tab(None)
        return
    step = header(trace)
    # no tabs are drawn while there is nothing to view (after Reset), and Streamlit forgets the state of a
    # widget that was not drawn: the app state keeps the open tab, so Reset → Step returns to the same view
    if "view" not in st.session_state and app.open_tab in TABS:
        st.session_state["view"] = app.open_tab
    tabs = st.tabs(TABS, key="view", on_change="rerun")
    app.open_tab = st.session_state.get("view")
    panels = [shapes_tab, attention_tab, mask_tab, cache_tab, next_token_tab, inspector_tab]
    for tab, panel in zip(tabs, panels):
        with tab:
            if tab.open:
                panel(trace, step)
    with tabs[-1]:
        if tabs[-1].open:
            export_tab(trace)


main()
