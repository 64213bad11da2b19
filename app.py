"""GPT shape tracer — `streamlit run app.py`.

Wiring only: widgets, session state and layout. Traces and experiments come from ``tracer``, figures and
tables from ``figures`` (pure functions), settings checks and the session's state from ``session``.
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
from figures import whatif as whatif_views
from figures import worked as worked_views
from figures.common import facts_of, query_labels, shape_with_axes
from figures.common import inert as plain  # everything the app did not write passes through this
from gpt_shape_tracer.memory import reuse_freed_memory
from model import BUNDLED_MODELS, ModelLoadError, load_bundled, load_hf
from model.heads import repeated_random_tokens
from model.hook_table import act_name
from model.identity import identity_of
from model.loading import ASSETS
from session import (
    DEFAULT_PROMPT,
    MAX_BUDGET_MB,
    AblationResult,
    AppState,
    Comparison,
    LoadedTrace,
    PatchingRun,
    SettingsError,
    parse_run_steps,
    parse_settings,
)
from tracer import (
    DEFAULT_BUDGET_BYTES,
    LIMITS,
    MAX_RUN_STEPS,
    TENSOR_KINDS,
    ContextFullError,
    Finite,
    GenerationStopped,
    Trace,
    TracedGeneration,
    TraceFileError,
    ablate,
    activation_patching,
    archive_bytes,
    diff_traces,
    direct_logit_attribution,
    head_scores,
    load_trace,
    logit_lens,
    pattern_changes,
    replay,
    text_loss,
)

TABS = ["Shapes", "Attention", "Causal mask", "KV cache", "Next token", "What if", "Compare runs",
        "Worked example", "Inspector", "Export"]
AUTO_RECOMPUTE_PARAMS = 20_000_000  # below this, every step is checked against a full recompute (one timing)
RECOMPUTE_REPEATS = 5  # timings of the cache comparison on demand: the fastest of this many runs
LEGEND = "B batch · n new positions · t key positions (cache incl.) · d d_model · H query heads · G key/value " \
         "heads · d_head = d_k · V vocab"
SOURCES = {"Bundled GPT-2-style story model": "bundled:story-gpt",
           "Bundled Llama-style story model": "bundled:story-llama",
           "Local Hugging Face directory": "dir"}
UPLOAD_MB = 1024  # MiB, as .streamlit/config.toml server.maxUploadSize (Streamlit labels the dropzone "1GB")

st.set_page_config(page_title="GPT shape tracer", page_icon="🔎", layout="wide")
st.markdown("<style>.block-container {padding-top: 2.2rem;} h1 {font-size: 1.9rem !important;}</style>",
            unsafe_allow_html=True)


@st.cache_resource
def freed_memory_reused() -> bool:
    """Once per server process: a long prefill frees gigabytes, and glibc's malloc would hand each new tensor
    fresh pages to fault in again (gpt_shape_tracer/memory.py)."""
    return reuse_freed_memory()


freed_memory_reused()


# -- models (shared by every session; tracing and interventions route per thread, so sharing is safe) --
@st.cache_resource(show_spinner="Loading the bundled model…")
def bundled_model(name: str):
    return load_bundled(name)


@st.cache_resource(show_spinner="Loading the model from the local directory…", max_entries=2)
def directory_model(path: str, dtype: str):
    return load_hf(path, dtype=dtype)


def chart(fig, key: str, **kwargs):
    """``st.plotly_chart`` with the figure's own look (``figures.plot.TEMPLATE``): Streamlit's theme would
    re-theme each new chart after drawing it, one more full plot per chart on every Step."""
    return st.plotly_chart(fig, key=key, theme=None, **kwargs)


def state() -> AppState:
    """This session's state: one typed object, not loose keys."""
    return st.session_state.setdefault("app", AppState())


def current_model():
    key = state().model_key
    if key.startswith("bundled:"):
        return bundled_model(key.split(":", 1)[1])
    _, dtype, path = key.split(":", 2)
    return directory_model(path, dtype)


def describe_model(model) -> str:
    c = model.config
    kv = f" sharing {c.n_kv_heads} key/value heads" if c.n_kv_heads != c.n_head else ""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return (f"{c.n_layer} layers × {c.n_head} heads{kv}, d = {c.d_model}, d_head = {c.d_head}, V = {c.vocab_size}, "
            f"n_ctx = {c.n_ctx} — {model.num_parameters / 1e6:.1f}M parameters, {dtype}")


# -- sidebar: prompt, actions, model, sampling, tracing -------------------------------------------------
def sidebar() -> str | None:
    """Draws the sidebar; returns the action pressed ("step", "run", "reset") or None."""
    sb = st.sidebar
    sb.text_area("Prompt (one line per sequence: several lines make a batch)", value=DEFAULT_PROMPT,
                 key="prompt", height=96)
    cols = sb.columns(3)
    step = cols[0].button("Step", type="primary", key="step_button", width="stretch")
    run = cols[1].button("Run N", key="run_button", width="stretch")
    reset = cols[2].button("Reset", key="reset_button", width="stretch")
    sb.number_input(f"N for Run N (1…{MAX_RUN_STEPS})", value=8, step=1, key="run_n")

    sb.header("Model")
    available = {label: key for label, key in SOURCES.items()
                 if not key.startswith("bundled:") or key.split(":", 1)[1] in bundled_available()}
    label = sb.radio("Weights", list(available), key="source",
                     help="Bundled models ship with the app. A local directory is what Hugging Face save_pretrained "
                          "writes (config.json + weights; GPT-2, Llama, Mistral or Qwen2) — a Hugging Face cache "
                          "snapshot, …/models--org--name/snapshots/<hash>, works too. Nothing is downloaded.")
    chosen = available[label]
    if chosen == "dir":
        path = sb.text_input("Directory", key="model_dir", placeholder="/path/to/model")
        dtype = sb.selectbox("Compute dtype", ["float32", "bfloat16"], key="model_dtype",
                             help="float32 by default; bfloat16 halves the memory of a bf16 checkpoint (tolerances "
                                  "in the cache comparison follow the dtype)")
        if sb.button("Load", key="load_model"):
            load_directory(path, dtype)
    elif state().model_key != chosen:
        state().model_key = chosen
        state().reset()

    sb.header("Sampling")
    sb.radio("Decoding", ["greedy", "sample"], key="decoding", horizontal=True)
    sampling_off = st.session_state.get("decoding", "greedy") == "greedy"
    sb.number_input("temperature τ", value=1.0, step=0.1, key="temperature", disabled=sampling_off,
                    help="softmax(z/τ) over the logits z: τ < 1 sharpens, τ > 1 flattens; 0 < τ ≤ 100")
    cols = sb.columns(2)
    cols[0].number_input("top-k (0 = off)", value=0, step=1, key="top_k", disabled=sampling_off)
    cols[1].number_input("top-p", value=1.0, step=0.05, key="top_p", disabled=sampling_off, help="in (0, 1]")
    sb.text_input("seed", value="0", key="seed", disabled=sampling_off)
    sb.header("Tracing")
    sb.toggle("KV cache", value=True, key="use_cache",
              help="On: a decode step computes one new row. Off: every step recomputes all positions.")
    sb.selectbox("Capture", ["values", "shapes", "ops"], key="capture",
                 help="shapes: shape/dtype only (NaN/∞ checked on the residual stream and logits) · values: + "
                      "tensors (within the budget) · ops: + every torch op")
    cols = sb.columns(2)
    cols[0].selectbox("Padding", ["left", "right"], key="padding_side")
    cols[1].number_input("Budget (MB)", value=DEFAULT_BUDGET_BYTES // 2**20, min_value=1, max_value=MAX_BUDGET_MB,
                         key="budget_mb")
    if reset:
        return "reset"
    return "step" if step else ("run" if run else None)


@st.cache_data(show_spinner=False)
def bundled_available() -> list[str]:
    return [name for name in BUNDLED_MODELS if (ASSETS / name / "config.json").is_file()]


def load_directory(path: str, dtype: str) -> None:
    app = state()
    if not path or not path.strip():
        app.notices = [("error", "Type the directory of a checkpoint first.")]
        return
    if "\x00" in path:
        app.notices = [("error", "That directory name holds a NUL character; the previous model stays loaded.")]
        return
    resolved = str(Path(path.strip()).expanduser())
    try:
        model, tok = directory_model(resolved, dtype)
    except ModelLoadError as e:
        app.notices = [("error", f"Could not load that model, the previous one stays loaded: {plain(e)}")]
        return
    except (OSError, RuntimeError, ValueError) as e:  # a path the system itself refuses
        app.notices = [("error", f"Could not read that directory, the previous model stays loaded: {plain(e)}")]
        return
    if tok is None:
        app.notices = [("error", f"{plain(resolved)} has no tokenizer (tokenizer.json, or vocab.json + merges.txt); "
                                 "the previous model stays loaded.")]
        return
    app.reset()
    app.model_key = f"dir:{dtype}:{resolved}"
    app.notices = [("success", f"Loaded {plain(resolved)}: {describe_model(model)}")]


def current_settings():
    s = st.session_state
    return parse_settings(
        prompt=s.get("prompt", DEFAULT_PROMPT), greedy=s.get("decoding", "greedy") == "greedy",
        temperature=s.get("temperature", 1.0), top_k=s.get("top_k", 0), top_p=s.get("top_p", 1.0),
        seed=s.get("seed", "0"), use_cache=s.get("use_cache", True), capture=s.get("capture", "values"),
        padding_side=s.get("padding_side", "left"), budget_mb=s.get("budget_mb", DEFAULT_BUDGET_BYTES / 2**20),
    )


def reset() -> None:
    try:
        current_settings()
    except SettingsError as e:  # refuse before throwing anything away
        state().notices = [("error", f"Reset refused, nothing was discarded: {e}")]
        return
    state().reset()
    state().notices = [("info", "Reset: the next Step starts from the prompt with these settings.")]


def advance(n_raw) -> None:
    """Step or Run N: one forward pass and one token per step, with progress and a Stop button for a run.
    A step that finished stays finished whatever interrupts the next one."""
    app = state()
    notices = []
    try:
        n = parse_run_steps(n_raw)
        gen = app.generation
        if gen is None:
            settings = current_settings()
            model, tok = current_model()
            gen = app.start(model, tok, settings)
            notices += [("warning", plain(w)) for w in gen.warnings]
    except SettingsError as e:
        app.notices = [("error", str(e))]
        return
    app.close_file()
    progress = st.progress(0.0, text=f"step 1 of {n}") if n > 1 else None
    if progress is not None:
        st.button("Stop", key="stop_run", help="Stops after the step in progress; every finished step is kept")
    for i in range(n):
        try:
            gen.step()
        except (ContextFullError, GenerationStopped) as e:
            notices.append(("warning", f"Stopped: {e}"))
            break
        except Exception as e:  # a failing forward: the trace keeps everything up to it
            notices.append(("error", f"The forward pass failed at step {gen.n_steps}: {type(e).__name__}: "
                                     f"{plain(e)}"))
            break
        if gen.model.num_parameters < AUTO_RECOMPUTE_PARAMS:
            gen.compare_with_recompute()
        if gen.stopped:
            notices.append(("warning", f"Stopped: {gen.stopped}"))
            break
        if progress is not None:
            progress.progress((i + 1) / n, text=f"step {i + 2} of {n}" if i + 1 < n else "drawing")
    if gen.n_steps:
        st.session_state["step_view"] = gen.n_steps - 1
    app.notices = notices


# -- banners and header --------------------------------------------------------------------------------
def banners(trace: Trace, step: int) -> None:
    """What every tab must know: a non-finite value, interventions in force, a file being viewed."""
    bad = trace.first_anomaly(step)
    if bad is not None:
        flag = trace.finite_flag(bad)
        what = "NaN or +∞" if flag == Finite.BAD else "−∞ that no mask explains"
        op = trace.op_before(bad) if trace.capture == "ops" else None
        made = f", made by the op {op.op} (inputs {', '.join(map(str, op.input_shapes))})" if op else ""
        partial = "" if trace.checked_everywhere(step) else (
            " Shapes capture checks only the residual stream and the logits: the value went bad inside this "
            "block, before this record; capture values to name the exact record.")
        cols = st.columns([5, 1])
        cols[0].error(f"**{what}** first appears at step {step} in **{plain(bad.name)}** (record "
                      f"{bad.index_in_step} of the step){made}.{partial}")
        if cols[1].button("Open in Inspector", key="open_anomaly"):
            state().inspect_name = bad.name
            st.session_state["view"] = "Inspector"
            st.rerun()
    active = trace.steps[step].interventions
    if active:
        st.warning("Interventions in force at this step: " + "; ".join(plain(i.describe()) for i in active))
    gen = state().generation
    if gen is not None and not state().viewing_file and gen.interventions and not active:
        st.warning("Later steps will run with: " + "; ".join(plain(i.describe()) for i in gen.interventions))


def header(trace: Trace) -> int:
    n_steps = trace.n_steps
    if "pending_step_view" in st.session_state:
        st.session_state["step_view"] = st.session_state.pop("pending_step_view")
    if n_steps > 1:
        st.session_state["step_view"] = min(st.session_state.get("step_view", n_steps - 1), n_steps - 1)
        step = st.slider("Step (time travel: every view shows this step)", 0, n_steps - 1, key="step_view")
    else:
        step = 0
        st.caption("Step 0, the prefill" + (": the file holds this one step." if state().viewing_file else
                                             ". Step again to generate more tokens."))
    facts = facts_of(trace)
    forward = facts.step(step).forward
    for row in range(facts.batch_size):
        prefix = f"**Sequence {row}** " if facts.batch_size > 1 else ""
        st.markdown(prefix + token_views.generated_text_html(trace, row, upto_step=step), unsafe_allow_html=True)
    st.markdown(token_views.text_legend(), unsafe_allow_html=True)
    cols = st.columns(5)
    cols[0].metric("new positions n", forward.n)
    cols[1].metric("key positions t", forward.t)
    cols[2].metric("cache length after step", forward.cache_after if facts.info.use_cache else 0,
                   help="0 when the KV cache is off")
    cols[3].metric("query rows computed", f"{forward.n} of {forward.t}")
    cols[4].metric("traced forward time", f"{trace.steps[step].seconds * 1000:.1f} ms",
                   help="wall time of the traced forward on this (shared) machine: an estimate")
    banners(trace, step)
    return step


# -- shared pickers ------------------------------------------------------------------------------------
def n_layer_head(trace: Trace) -> tuple[int, int]:
    config = trace.config
    return (config.n_layer, config.n_head) if config is not None else (1, 1)


def layer_head_batch(trace: Trace, prefix: str, heads: bool = True) -> tuple[int, int, int]:
    n_layer, n_head = n_layer_head(trace)
    app = state()
    if app.pending_head is not None and prefix == "attn":
        st.session_state["attn_layer"], st.session_state["attn_head"] = app.pending_head
        app.pending_head = None
    cols = st.columns(3)
    layer = cols[0].selectbox("layer", list(range(n_layer)), key=f"{prefix}_layer")
    head = cols[1].selectbox("head", list(range(n_head)), key=f"{prefix}_head") if heads else 0
    batch_size = facts_of(trace).batch_size
    batch = cols[2].selectbox("sequence", list(range(batch_size)), key=f"{prefix}_batch") if batch_size > 1 else 0
    return layer, head, batch


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


# -- tabs --------------------------------------------------------------------------------------------
@st.fragment
def shapes_tab(trace: Trace, step: int) -> None:
    n_layer, _ = n_layer_head(trace)
    layer = st.selectbox("block shown in the flow", list(range(n_layer)), key="flow_layer")
    st.caption(f"Live shapes at step {step}, numerically and in symbols — {LEGEND}. In purple, the weight a stage "
               "multiplies by (the per-head W_Q^i, W_K^i, W_V^i of [d, d_k] are W_QKV's column blocks, d_k columns "
               "per head).")
    chart(flow_views.shape_flow_figure(trace, step, layer), key="flow_chart")
    st.subheader("The multi-head reshape, op by op")
    st.caption("How Q is split into heads and the heads' outputs merged back; green boxes are views (the same "
               "numbers, new shape and strides), orange ones new memory.")
    chart(flow_views.reshape_figure(trace, step, layer), key="reshape_chart")
    st.subheader("Every record of this step")
    cols = st.columns([1, 2, 1, 2])
    layer_filter = cols[0].selectbox("layer", ["all"] + list(range(n_layer)), key="table_layer")
    module_filter = cols[1].text_input("module (path prefix)", key="table_module", placeholder="blocks.0.attn")
    kind_filter = cols[2].selectbox("kind", ["all", *TENSOR_KINDS], key="table_kind")
    name_filter = cols[3].text_input("name contains (or glob)", key="table_name")
    frame = trace.to_frame(
        step=step, layer=None if layer_filter == "all" else int(layer_filter),
        module=module_filter.strip() or None, kind=None if kind_filter == "all" else kind_filter,
        name=name_filter.strip() or None,
    )
    frame["shape"] = [str(list(s)) for s in frame["shape"]]
    shown = frame[["index_in_step", "name", "shape", "axes", "kind", "module_type", "dtype", "nbytes", "summary"]]
    shown = shown.rename(columns={"index_in_step": "#"})
    column = st.column_config
    event = st.dataframe(shown, key="records_table", hide_index=True, on_select="rerun",
                         selection_mode="single-row", height=560,
                         column_config={"#": column.NumberColumn(width=40),
                                        "name": column.TextColumn(width=300), "shape": column.TextColumn(width=120),
                                        "axes": column.TextColumn(width=130), "kind": column.TextColumn(width=60),
                                        "module_type": column.TextColumn("module type", width=120),
                                        "dtype": column.TextColumn(width=70), "nbytes": column.NumberColumn(width=80),
                                        "summary": column.TextColumn(width=520)})
    rows = event.selection.rows if event is not None and hasattr(event, "selection") else []
    if rows:
        state().inspect_name = shown.iloc[rows[0]]["name"]
        st.info(f"Opened **{plain(shown.iloc[rows[0]]['name'])}** in the Inspector tab.")
    st.caption(f"{len(frame)} record(s) at step {step}, numbered from 0 within the step. Select a row to open it in "
               "the Inspector.")


@st.fragment
def attention_tab(trace: Trace, step: int) -> None:
    layer, head, batch = layer_head_batch(trace, "attn")
    st.latex(r"A = \operatorname{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}} + M\right), \qquad O = A\,V")
    st.caption(attn_views.M_NOTE + " (Vaswani et al., 2017, “Attention Is All You Need”.)")
    rope = trace.has(act_name("rot_q", layer), step)
    parts = ["Stages", "O = A·V", "Pitfalls"] + (["RoPE"] if rope else []) + ["All heads", "History"]
    sub = dict(zip(parts, st.tabs(parts, key="attn_view", on_change="rerun")))
    pattern_kept = trace.get(act_name("pattern", layer), step) is not None
    with sub["Stages"]:
        if sub["Stages"].open:
            stages = attn_views.attention_stages(trace, step, layer, head, batch)
            if all(s.matrix is None for s in stages):
                explain_missing_values(trace, step, "attention heatmaps")
                st.markdown("\n".join(f"- **{s.title}**: `{s.shapes}`" for s in stages))
            else:
                shared = st.toggle("one colour scale for QKᵀ, ÷√d_k and + M", key="attn_shared",
                                   help="With one scale, dividing by √d_k shows as what it does: every score "
                                        "shrinks by the same factor")
                chart(attn_views.attention_stages_figure(trace, step, layer, head, batch, shared),
                      key="stages_chart")
            if pattern_kept:
                query_picker(trace, step, layer, head, batch)
    with sub["O = A·V"]:
        if sub["O = A·V"].open and values_kept(trace, step, act_name("v_all", layer), "values V and outputs O"):
            query = query_picker(trace, step, layer, head, batch, show=False)
            result = attn_views.weighted_sum_figure(trace, step, layer, head, query, batch)
            if result is not None:
                st.caption("For the picked query: each value row vᵢ times its weight αᵢ, and their sum "
                           "o = Σᵢ αᵢ vᵢ — one row of O = A·V.")
                chart(result[0], key="av_chart")
    with sub["Pitfalls"]:
        if sub["Pitfalls"].open:
            table = attn_views.pitfall_table(trace, step, layer, head, batch)
            if table is None:
                explain_missing_values(trace, step, "Q, K and M to recompute from")
            else:
                st.caption("This head recomputed from its recorded Q, K and M, four ways. Without ÷√d_k the "
                           "scores are √d_k times larger and the softmax far peakier (a larger max weight, a lower "
                           "entropy); without M, weight leaks onto keys after the query; masking after the "
                           "softmax leaves rows that no longer sum to 1.")
                st.dataframe(table.round(4), hide_index=True, key="pitfall_table")
                chart(attn_views.pitfall_figure(trace, step, layer, head, batch), key="pitfall_chart")
    if "RoPE" in sub:
        with sub["RoPE"]:
            if sub["RoPE"].open:
                rope_section(trace, step, layer, head, batch)
    with sub["All heads"]:
        if sub["All heads"].open:
            heads_grid(trace, step, batch, (layer, head))
    with sub["History"]:
        if sub["History"].open:
            if facts_of(trace).info.use_cache and step > 0 and pattern_kept:
                st.caption("With the cache a decode step computes one query row; stacking the rows of steps 0…s "
                           "rebuilds the lower-triangular pattern token by token (this step's row outlined).")
                chart(attn_views.attention_history_figure(trace, layer, head, step, batch),
                      key="history_chart")
            else:
                st.info("The history stacks the one row each cached decode step computes; it needs the KV cache on, "
                        "a step after the prefill, and kept values.")


def query_picker(trace: Trace, step: int, layer: int, head: int, batch: int, show: bool = True) -> int:
    queries = query_labels(trace, step, batch)
    # keyed by step and sequence: the query rows differ between steps (n0 at the prefill, 1 after); the pick
    # per step is remembered in the app state, since Streamlit forgets a widget that was not drawn
    picks = state().query_picks
    remembered = picks.get((step, batch), len(queries) - 1)
    pick = st.selectbox("query token: which keys does it attend to?", list(range(len(queries))),
                        index=remembered if remembered < len(queries) else len(queries) - 1,
                        format_func=lambda i: queries[i], key=f"attn_query_s{step}_b{batch}_{int(show)}")
    picks[(step, batch)] = pick
    if show:
        st.markdown(attn_views.query_attention_html(trace, step, layer, head, pick, batch), unsafe_allow_html=True)
    return pick


def rope_section(trace: Trace, step: int, layer: int, head: int, batch: int) -> None:
    st.markdown("RoPE turns position into rotation: q at position m becomes R(m)q and k at position n becomes "
                "R(n)k, rotating each pair of dimensions i by the angle m·θᵢ. Since R(m)ᵀR(n) = R(n − m), the "
                "score R(m)q · R(n)k depends on the positions only through m − n (Su et al., 2021, RoFormer). "
                "This model, like Hugging Face's Llama, pairs dimension i with i + d_head/2 (the two halves); the "
                "RoFormer paper writes the rotation on consecutive pairs (2i, 2i + 1) — the same rotations on "
                "a permuted order of dimensions.")
    figure = attn_views.rope_figure(trace, step, layer, head, batch)
    if figure is None:
        explain_missing_values(trace, step, "Q and K before and after the rotation")
        return
    chart(figure, key="rope_chart")
    relative = attn_views.rope_relative_figure(trace, step, layer, head, batch)
    if relative is not None:
        chart(relative, key="rope_relative_chart")


def heads_grid(trace: Trace, step: int, batch: int, picked: tuple[int, int]) -> None:
    if trace.get(act_name("pattern", 0), step) is None and trace.digest(trace.record(act_name("pattern", 0), step)) \
            is None:
        explain_missing_values(trace, step, "attention patterns")
        return
    model = live_model_for(trace)
    scores = scores_for(model) if model is not None else None
    grid = attn_views.all_heads_figure(trace, step, batch, scores=scores, picked=picked)
    st.caption("Layers × heads at this step (click a head to open it above)."
               + (f" {grid.note[0].upper()}{grid.note[1:]}." if grid.note else "")
               + (" Each tile names the head's clearest role where its score reaches 0.3, measured on 4 random token "
                  "sequences each repeated twice: previous-token (weight on the key just before), induction (in "
                  "the repeat, weight on the key after the earlier occurrence of the same token), duplicate-token "
                  "(on that earlier occurrence), first-token (on key 0). Hover a head for all four."
                  if scores else ""))
    event = chart(grid.figure, key="all_heads_chart", on_select="rerun", selection_mode="points")
    points = event.selection.points if event is not None and hasattr(event, "selection") else []
    if points and "customdata" in points[0]:
        layer, head = points[0]["customdata"][:2]
        if (layer, head) != picked:
            state().pending_head = (int(layer), int(head))
            st.rerun(scope="fragment")


def scores_for(model) -> dict:
    """Head scores of ``model``, computed once per model and process (a probe forward)."""
    gen = state().generation
    first = gen.tokenizer.eos_id if gen is not None and gen.tokenizer.eos_id is not None else 0
    return cached_head_scores(identity_of(model).weights_digest, first, model)


@st.cache_resource(show_spinner="Measuring what each head does…", max_entries=4)
def cached_head_scores(digest: str, first_token: int, _model) -> dict:
    return head_scores(_model, first_token=first_token)


@st.fragment
def mask_tab(trace: Trace, step: int) -> None:
    layer, head, batch = layer_head_batch(trace, "mask")
    facts = mask_views.mask_facts(trace, step, layer, batch)
    st.markdown(plain_paragraphs(facts.explanation()))
    if not values_kept(trace, step, act_name("mask", layer), "mask and score heatmaps"):
        return
    chart(mask_views.mask_figure(trace, step, layer, batch), key="mask_chart")
    chart(mask_views.scores_before_after_figure(trace, step, layer, head, batch), key="before_after_chart")


def plain_paragraphs(text: str) -> str:
    return "\n\n".join(plain(p) for p in text.split("\n\n"))


@st.fragment
def cache_tab(trace: Trace, step: int) -> None:
    if not facts_of(trace).info.use_cache:
        st.warning("The KV cache is off for this generation: every step recomputes K and V for all positions. "
                   "The table shows what each step computed.")
    # two views, drawn only when open: a Step then redraws one chart of this tab, not two
    this_step, over_steps = st.tabs(["This step", "Over the steps"], key="kv_view", on_change="rerun")
    with this_step:
        if this_step.open:
            cache_this_step(trace, step)
    with over_steps:
        if over_steps.open:
            ran = ("this run used the cache" if facts_of(trace).info.use_cache else
                   "this run has the cache off, so it computed the rows without")
            st.caption("Every step so far, counted: what the cache holds, the query rows a step computes with the "
                       f"cache and without it ({ran}), and the multiply-adds of both paths at the steps compared "
                       "with a recompute. The step shown is marked.")
            chart(cache_views.cache_steps_figure(trace, step), key="steps_chart")


def cache_this_step(trace: Trace, step: int) -> None:
    app = state()
    facts = facts_of(trace)
    st.dataframe(cache_views.cache_table(trace, step), hide_index=True, key="cache_table")
    if facts.info.use_cache:
        latex, sentence = cache_views.memory_formula(trace, step)
        st.latex(latex)
        st.caption(sentence)
    cols = st.columns([3, 1])
    with cols[0]:
        layer, head, batch = layer_head_batch(trace, "kv")
    which = cols[1].radio("tensor", ["K", "V"], horizontal=True, key="kv_which")
    kv = attn_views.kv_head(trace, layer, head, step)
    if values_kept(trace, step, act_name("k_all" if which == "K" else "v_all", layer), f"{which} values"):
        chart(cache_views.key_heatmap_figure(trace, step, layer, kv, batch, which), key="kv_chart")
    st.subheader("Cache on vs off")
    comparisons = facts.comparisons
    gen = app.generation if not app.viewing_file else None
    latest = gen is not None and step == gen.n_steps - 1
    if latest and st.button("Measure this step again, timing each path 5 times", key="measure_recompute",
                            help="Redo the latest step untraced with the cache and as a full recompute; count, "
                                 "time (fastest of 5) and compare the logits"):
        gen.compare_with_recompute(timing_repeats=RECOMPUTE_REPEATS)
        comparisons = facts_of(trace).comparisons
    if step in comparisons:
        c = comparisons[step]
        level, text = cache_views.verdict(c)
        getattr(st, level)(text)
        st.dataframe(cache_views.evidence_table(c), hide_index=True, key="evidence_table")
        warning = cache_views.timing_warning(c)
        if warning:
            st.warning(warning)
    elif gen is not None and not latest:
        st.caption("This step was not compared with a recompute; go to the latest step to measure it.")
    elif gen is not None:
        st.caption("Press the button to redo this step both ways and compare.")
    else:
        st.caption("The file holds no comparison for this step.")
    st.caption("The query rows and multiply-adds of every step are under **Over the steps**.")


@st.fragment
def next_token_tab(trace: Trace, step: int) -> None:
    facts = facts_of(trace)
    row = st.selectbox("sequence", list(range(facts.batch_size)), key="next_row") if facts.batch_size > 1 else 0
    st.caption("Sampling: " + facts.info.sampling.describe())
    if facts.step(step).sampling is None:
        st.error(f"No token was chosen at step {step}: the logits held NaN or +∞ (see the banner above).")
        return
    chart(token_views.next_token_figure(trace, step, row), key="next_chart")
    if facts.info.sampling.greedy:
        st.info("Greedy decoding takes the argmax of the logits: temperature, top-k and top-p play no part, so "
                "there is no reshaping to show. Choose **sample** in the sidebar (and Reset) to see it.")
    else:
        chart(token_views.distribution_stages_figure(trace, step, row), key="stages_dist_chart")


# -- what if --------------------------------------------------------------------------------------------
def live_model_for(trace: Trace):
    """The model whose weights made ``trace`` (its own, or the loaded one when the digests match), or None."""
    model = trace.live_model
    if model is not None:
        return model
    try:
        model, _ = current_model()
    except ModelLoadError:
        return None
    if trace.model is not None and identity_of(model).weights_digest == trace.model.weights_digest:
        trace.attach_model(model)
        return model
    return None


@st.fragment
def whatif_tab(trace: Trace, step: int) -> None:
    app = state()
    model = live_model_for(trace)
    if model is None:
        st.info("These experiments run the model that made the trace; the model selected in the sidebar has "
                "other weights (its digest differs). Load the same model to use them on this file.")
        return
    parts = st.tabs(["Switch heads off", "Activation patching", "Logit attribution", "Logit lens"],
                    key="whatif_view", on_change="rerun")
    gen = app.generation if not app.viewing_file else None
    with parts[0]:
        if parts[0].open:
            ablation_section(trace, step, model, gen)
    with parts[1]:
        if parts[1].open:
            patching_section(trace, model, gen)
    with parts[2]:
        if parts[2].open:
            attribution_section(trace, step, model)
    with parts[3]:
        if parts[3].open:
            lens_section(trace, step, model)


def ablation_section(trace: Trace, step: int, model, gen: TracedGeneration | None) -> None:
    app = state()
    n_layer, n_head = n_layer_head(trace)
    heads = [f"L{layer} H{head}" for layer in range(n_layer) for head in range(n_head)]
    cols = st.columns([3, 1, 2])
    chosen = cols[0].multiselect("heads to switch off (their output O_h)", heads, key="ablate_heads")
    how = cols[1].radio("how", ["zero", "mean"], key="ablate_how",
                        help="zero: O_h = 0 · mean: O_h replaced by its mean over the positions seen so far")
    text = cols[2].radio("loss measured on", ["a random sequence repeated twice", "the prompt"], key="ablate_text",
                         help="On a random token sequence followed by itself, only induction predicts the second "
                              "half: the loss there shows what the induction circuit is worth")
    interventions = [ablate(act_name("z", int(h.split()[0][1:])), head=int(h.split()[1][1:]), how=how) for h in chosen]
    if gen is None:
        st.info("Re-running a step needs the live generation (Step once, or leave the file view).")
        return
    if st.button("Re-run this step with these heads switched off", key="ablate_run", disabled=not chosen,
                 type="primary"):
        tok = gen.tokenizer
        if text == "the prompt":
            ids, start, what = list(gen.info.prompt_tokens[0]), 1, "the prompt (sequence 0)"
        else:
            half = min(50, (model.config.n_ctx - 1) // 2)
            first = tok.eos_id if tok.eos_id is not None else 0
            ids = repeated_random_tokens(model.config.vocab_size, half, 1, seed=7, prefix=first)[0].tolist()
            start, what = len(ids) - half + 1, f"the second half of a random {half}-token sequence repeated twice"
        with st.spinner("re-running…"):
            result = replay(gen, step, interventions)
            before = text_loss(model, ids, start=start)
            after = text_loss(model, ids, interventions, start=start)
        app.ablation = AblationResult(step, tuple(i.describe() for i in interventions), result, what, before, after,
                                      tuple(pattern_changes(gen, result)))
    res = app.ablation
    if res is None or res.step != step:
        st.caption("Pick heads, then re-run: the step runs again from the same cache with them switched off, and "
                   "the loss on a text is measured with and without. Nothing in the generation changes.")
        return
    st.markdown(f"Re-ran step {res.step} with: " + "; ".join(plain(d) for d in res.described))
    cols = st.columns(3)
    cols[0].metric(f"loss on {res.loss_text}", f"{res.loss_after:.3f} nats", f"{res.loss_after - res.loss_before:+.3f}",
                   delta_color="inverse")
    cols[1].metric("loss as the model is", f"{res.loss_before:.3f} nats")
    moved = [c for c in res.changes if c[2] > 1e-3]
    cols[2].metric("heads whose pattern moved", f"{len(moved)} of {len(res.changes)}")
    frame = whatif_views.next_token_change(res.replay.original[0], res.replay.logits[0], gen.tokenizer.token_label)
    chart(whatif_views.next_token_change_figure(frame, f"next token at step {res.step}, sequence 0"),
          key="ablate_next_chart")
    chart(whatif_views.pattern_change_figure(list(res.changes), n_layer, n_head), key="ablate_heads_chart")
    if st.button("Keep these heads off for the next steps", key="ablate_keep"):
        gen.set_interventions(interventions)
        st.rerun()
    if gen.interventions and st.button("Switch every head back on for the next steps", key="ablate_clear"):
        gen.set_interventions([])
        st.rerun()


def patching_section(trace: Trace, model, gen: TracedGeneration | None) -> None:
    app = state()
    if gen is None:
        st.info("Patching runs the live model on two prompts; Step once (or leave the file view).")
        return
    tok = gen.tokenizer
    clean = gen.info.prompts[0]
    st.caption("The clean prompt is this generation's (sequence 0). Type a corrupted one with the same number of "
               "tokens — change a name, say. Each cell patches the clean run's activation into the corrupted run "
               "and measures how much of the clean answer's logit difference comes back.")
    corrupted = st.text_input("corrupted prompt (same number of tokens)", key="patch_corrupted")
    kind = st.radio("patch", ["the residual stream (layer × position)", "each head's output (layer × head)"],
                    key="patch_kind", horizontal=True)
    n_clean, n_corrupt = len(tok.encode(clean)), len(tok.encode(corrupted)) if corrupted else 0
    if corrupted and n_clean != n_corrupt:
        st.error(f"The clean prompt has {n_clean} tokens and this one {n_corrupt}: patching needs the same count.")
    ready = bool(corrupted) and n_clean == n_corrupt
    if st.button("Run activation patching", key="patch_run", disabled=not ready, type="primary"):
        code = "resid_pre" if kind.startswith("the residual") else "z"
        bar = st.progress(0.0, text="patching…")
        result = activation_patching(model, tok.encode(clean), tok.encode(corrupted), code,
                                     progress=lambda f: bar.progress(f, text=f"patching… {f:.0%}"))
        labels = tuple(f"{i} · {tok.token_label(t)}" for i, t in enumerate(tok.encode(clean))) if code == "resid_pre" \
            else tuple(f"H{h}" for h in range(model.config.n_head))
        app.patching = PatchingRun(clean, corrupted, result, labels)
    run = app.patching
    if run is None:
        return
    res = run.result
    if res.clean_answer == res.corrupted_answer:
        st.warning(f"Both prompts give the same top token ({plain(tok.token_label(res.clean_answer))}): there is no "
                   "difference to restore. Change the prompt so that the answers differ.")
        return
    st.markdown(f"Clean answer **{plain(tok.token_label(res.clean_answer))}**, corrupted answer "
                f"**{plain(tok.token_label(res.corrupted_answer))}**; logit difference {res.clean_diff:.2f} clean, "
                f"{res.corrupted_diff:.2f} corrupted.")
    chart(whatif_views.patching_figure(res.restored, list(run.labels), res.kind), key="patching_chart")


def attribution_section(trace: Trace, step: int, model) -> None:
    facts = facts_of(trace)
    row = st.selectbox("sequence", list(range(facts.batch_size)), key="dla_row") if facts.batch_size > 1 else 0
    choice = facts.step(step).sampling
    if choice is None:
        st.error("This step chose no token (its logits were not finite).")
        return
    try:
        frame = direct_logit_attribution(trace, step, row, model=model)
    except ValueError as e:
        st.info(plain(e))
        return
    st.caption("How much each head (through W_O), each MLP and the embeddings add directly to the chosen token's "
               "logit z, reading the final norm with its scale frozen at this position.")
    chart(whatif_views.attribution_figure(frame, choice.labels[row]), key="dla_chart")


def lens_section(trace: Trace, step: int, model) -> None:
    facts = facts_of(trace)
    row = st.selectbox("sequence", list(range(facts.batch_size)), key="lens_row") if facts.batch_size > 1 else 0
    tok = state().generation.tokenizer if state().generation is not None else None
    try:
        frame = logit_lens(trace, step, row, model=model, label=tok.token_label if tok else None)
    except ValueError as e:
        st.info(plain(e))
        return
    figure, note = whatif_views.lens_figure(frame, model.config.n_layer)
    st.caption("What each layer already predicts: its residual stream put through the final norm and W_U. Colour: "
               "the probability of the token the model finally chose there; text: that layer's own top token."
               + (f" Showing {note}." if note else ""))
    chart(figure, key="lens_chart")


def read_uploaded_trace(upload) -> Trace | None:
    """The trace in an uploaded file, or None after saying why it could not be read (nothing else changes)."""
    try:
        return load_trace(upload.getvalue())
    except TraceFileError as e:
        st.error(f"Could not load {plain(upload.name)}: {plain(e)}. Nothing else changed.")
        return None


# -- compare two runs ---------------------------------------------------------------------------------
@st.fragment
def compare_tab(trace: Trace, step: int) -> None:
    app = state()
    gen = app.generation if not app.viewing_file else None
    options = ["a trace file"] + (["this prompt with the KV cache " + ("off" if gen.use_cache else "on"),
                                   "this prompt with the heads chosen under What if switched off"]
                                  if gen is not None else [])
    other = st.radio("compare this run with", options, key="compare_with", horizontal=True)
    if other == "a trace file":
        upload = st.file_uploader(f"a trace (.zip, up to {UPLOAD_MB // 1024} GiB)", type=["zip"],
                                  max_upload_size=UPLOAD_MB, key="compare_upload")
        if upload is not None and app.last_compare_upload_id != upload.file_id:
            app.last_compare_upload_id = upload.file_id
            loaded = read_uploaded_trace(upload)
            if loaded is None:
                return
            app.comparison = Comparison(f"the file {upload.name}", loaded, diff_traces(trace, loaded))
    elif st.button("Run it and compare", key="compare_run", type="primary"):
        settings = app.started_with
        interventions = ()
        use_cache = gen.use_cache
        if other.endswith("switched off"):
            chosen = st.session_state.get("ablate_heads", [])
            if not chosen:
                st.warning("Choose heads under What if → Switch heads off first.")
                return
            how = st.session_state.get("ablate_how", "zero")
            interventions = [ablate(act_name("z", int(h.split()[0][1:])), head=int(h.split()[1][1:]), how=how)
                             for h in chosen]
        else:
            use_cache = not gen.use_cache
        twin = TracedGeneration(gen.model, gen.tokenizer, list(gen.info.prompts), use_cache=use_cache,
                                capture=trace.capture, sampling=gen.sampling, padding_side=gen.info.padding_side,
                                budget_bytes=settings.budget_bytes if settings else trace.budget_bytes,
                                interventions=interventions)
        with st.spinner("running…"):
            twin.run(max(1, gen.n_steps))
        twin.close()
        app.comparison = Comparison(other, twin.trace, diff_traces(trace, twin.trace))
    comparison = app.comparison
    if comparison is None:
        return
    frame = comparison.frame
    compared = frame[frame["compared"]]
    first = frame[frame["first_divergence"]]
    st.markdown(f"Compared with {plain(comparison.label)}: {len(compared)} of {len(frame)} records compared; "
                f"largest |Δ| {compared['max_abs_delta'].max():.3g}." if len(compared) else
                f"Compared with {plain(comparison.label)}: no record could be compared value by value.")
    if len(first):
        row = first.iloc[0]
        st.error(f"The runs first diverge at step {row['step']} in **{plain(row['name'])}** (max |Δ| "
                 f"{row['max_abs_delta']:.3g}, tolerance {row['tolerance']:.1e}; {plain(row['note'])}).")
    elif len(compared):
        st.success("No record diverges beyond its dtype's tolerance.")
    at_step = frame[frame["step"] == step].copy()
    at_step["shape_a"] = [str(list(s)) if s is not None else "" for s in at_step["shape_a"]]
    at_step["shape_b"] = [str(list(s)) if s is not None else "" for s in at_step["shape_b"]]
    st.dataframe(at_step[["name", "shape_a", "shape_b", "max_abs_delta", "rel_delta", "diverged", "first_divergence",
                          "note"]], hide_index=True, key="diff_table", height=360)
    names = [n for n in at_step.loc[at_step["compared"], "name"]]
    if names:
        name = st.selectbox("difference of one record (b − a), its last two dimensions", names, key="diff_record")
        a, b = trace.get(name, step), comparison.trace.get(name, step)
        if a is not None and b is not None and a.shape == b.shape and a.dim() >= 2:
            index = (0,) * (a.dim() - 2)
            chart(whatif_views.difference_figure(a[index], b[index], f"{name} at step {step}"),
                  key="diff_chart")


# -- the worked example -------------------------------------------------------------------------------
@st.fragment
def worked_tab(trace: Trace | None = None, step: int = 0) -> None:
    st.markdown("A two-token attention you can check by hand (edit any number). Every stage runs through the "
                "same `attention` function the model runs; the gradient ∂L/∂V = Aᵀ·∂L/∂O is checked against "
                "autograd's.")
    cols = st.columns(4)
    tables = {}
    for col, (name, default) in zip(cols, (("Q", worked_views.DEFAULT_Q), ("K", worked_views.DEFAULT_K),
                                           ("V", worked_views.DEFAULT_V), ("∂L/∂O", worked_views.DEFAULT_GRAD_O))):
        col.markdown(f"**{name}**")
        tables[name] = col.data_editor(default, key=f"worked_{name}", num_rows="dynamic", width="stretch")
    causal = st.toggle("add the causal mask M", key="worked_causal")
    try:
        w = worked_views.compute(*(list(map(list, tables[k])) for k in ("Q", "K", "V", "∂L/∂O")), causal=causal)
    except worked_views.WorkedInputError as e:
        st.error(plain(e))
        return
    chart(worked_views.forward_figure(w), key="worked_forward")
    st.markdown(f"Row 1 of A: e^{w.scores[0, 0]:.3f} and e^{w.scores[0, 1]:.3f} normalised to "
                f"{w.a[0, 0]:.3f} and {w.a[0, 1]:.3f}." if w.a.shape[1] >= 2 and not causal else "")
    chart(worked_views.backward_figure(w), key="worked_backward")


# -- inspector --------------------------------------------------------------------------------------
@st.fragment
def inspector_tab(trace: Trace, step: int) -> None:
    names = trace.names(step)
    default = state().inspect_name or act_name("pattern", 0)
    index = names.index(default) if default in names else 0
    name = st.selectbox("record", names, index=index, key="inspect_select")
    state().inspect_name = name
    rec = trace.record(name, step)
    st.code(trace.summary(rec), language=None)
    note = trace.value_note(rec)
    st.caption(f"record {rec.index_in_step} of step {step} · {plain(rec.module_type)} {plain(rec.module or 'model')} · "
               f"{rec.kind} · {rec.module_params:,} parameters · {shape_with_axes(rec)}"
               + (f" · {plain(note)}" if note else "") + (f" · {plain(rec.axes_note)}" if rec.axes_note else ""))
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
        offset = (0, 0)
        if max(matrix.shape) > 256:
            st.caption(f"The slice is {matrix.shape[0]} × {matrix.shape[1]}: the heatmap pools it for the page. "
                       "Pick a window to see at full resolution:")
            wcols = st.columns(2)
            r0 = wcols[0].number_input("first row", 0, max(0, matrix.shape[0] - 1), 0, key=f"insp_r0_{name}")
            c0 = wcols[1].number_input("first column", 0, max(0, matrix.shape[1] - 1), 0, key=f"insp_c0_{name}")
            full = st.toggle("show the window (256 × 256) at full resolution", key=f"insp_window_{name}")
            if full:
                matrix, offset = matrix[r0:r0 + 256, c0:c0 + 256], (int(r0), int(c0))
        chart(inspect_views.tensor_heatmap_figure(matrix, name, offset=offset), key="insp_heatmap")
    every = value.numel() > inspect_views.HISTOGRAM_SAMPLE and st.toggle(
        f"count all {value.numel():,} values in the histogram (slower)", key=f"insp_every_{name}")
    chart(inspect_views.histogram_figure(value, f"values of {name}", every_value=every), key="insp_hist")
    raw = inspect_views.raw_frame(value)
    if raw is not None:
        st.dataframe(raw, key="insp_raw")


# -- export ---------------------------------------------------------------------------------------------
def export_tab(trace: Trace | None, step: int = 0) -> None:
    app = state()
    if trace is not None:
        st.download_button("Download this trace (.zip: manifest.json, records.parquet, ops.parquet, "
                           "values.safetensors)", data=lambda: archive_bytes(trace),
                           file_name="trace.zip", mime="application/zip", key="download_trace", on_click="ignore")
    upload = st.file_uploader(f"Load a trace (.zip, up to {UPLOAD_MB // 1024} GiB; checked against limits of "
                              f"{LIMITS.records:,} records and {LIMITS.value_bytes // 2**30} GiB of values before "
                              "anything is allocated)", type=["zip"], max_upload_size=UPLOAD_MB,
                              key="upload_trace")
    if upload is not None and app.last_upload_id != upload.file_id:
        app.last_upload_id = upload.file_id
        loaded = read_uploaded_trace(upload)
        if loaded is None:
            return
        if not loaded.steps or loaded.generation is None:
            st.error(f"{plain(upload.name)} is a valid trace but not of a generation this app can show.")
            return
        app.open_file(LoadedTrace(loaded, upload.name, upload.file_id))
        st.session_state["pending_step_view"] = loaded.n_steps - 1  # the slider exists already: apply next run
        st.rerun()


# -- page ------------------------------------------------------------------------------------------------
PANELS = {"Shapes": shapes_tab, "Attention": attention_tab, "Causal mask": mask_tab, "KV cache": cache_tab,
          "Next token": next_token_tab, "What if": whatif_tab, "Compare runs": compare_tab,
          "Worked example": worked_tab, "Inspector": inspector_tab, "Export": export_tab}


def main() -> None:
    app = state()
    action = sidebar()
    st.title("GPT shape tracer")
    if action == "reset":
        reset()
    elif action in ("step", "run"):
        advance(1 if action == "step" else st.session_state.get("run_n", 8))
    if st.session_state.get("stop_run"):
        app.notices.append(("info", "Stopped: every step finished before the Stop is kept."))
    for level, message in app.notices:
        getattr(st, level)(message)
    app.notices = []
    trace = app.viewed_trace
    if trace is not None and trace.model is not None:
        where = f" — from the file {plain(app.loaded.file_name)}" if app.viewing_file else ""
        st.caption(f"Model: **{plain(trace.model.describe())}**{where}")
    else:
        try:
            model, _ = current_model()
            st.caption(f"Model: **{plain(identity_of(model).describe())}** — {describe_model(model)}")
        except ModelLoadError as e:
            st.error(f"The selected model cannot be loaded: {plain(e)}")
            app.model_key = "bundled:story-gpt"
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
            st.error(plain(gen.trace.error.describe()))
    if app.viewing_file:
        st.info(f"Viewing the trace file {plain(app.loaded.file_name)}. Step, Run N or Reset return to live "
                "generation (and leave this file view).")
    if trace is None:
        st.info("Press **Step** (top of the sidebar) to run the prompt: step 0 runs the whole prompt (the "
                "prefill), every further step one new token.")
        tabs = st.tabs(["Worked example", "Export"])
        with tabs[0]:
            worked_tab()
        with tabs[1]:
            export_tab(None)
        return
    step = header(trace)
    # no tabs are drawn while there is nothing to view (after Reset), and Streamlit forgets the state of a
    # widget that was not drawn: the app state keeps the open tab, so Reset → Step returns to the same view
    if "view" not in st.session_state and app.open_tab in TABS:
        st.session_state["view"] = app.open_tab
    tabs = st.tabs(TABS, key="view", on_change="rerun")
    app.open_tab = st.session_state.get("view")
    for tab, name in zip(tabs, TABS):
        with tab:
            if tab.open:
                PANELS[name](trace, step)


main()
