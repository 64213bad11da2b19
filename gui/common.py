"""What every tab shares: the session's state, the models, charts, uploads and the layer/head pickers (the server's
admission and memory ledger: gui/server.py; the header, step slider and banners above the tabs: gui/header.py)."""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from gpt_shape_tracer.figures.common import facts_of, layer_labels, no_attention
from gpt_shape_tracer.figures.common import inert as plain  # everything the app did not write passes through this
from gpt_shape_tracer.figures.panels import panels_spec
from gpt_shape_tracer.figures.svg import diagram_svg
from gpt_shape_tracer.gui.hover import crosshair
from gpt_shape_tracer.model import ModelLoadError
from gpt_shape_tracer.session import (
    AppState,
    ModelChoice,
    adopt_model,
    load,
)
from gpt_shape_tracer.tracer import Trace, TraceFileError, load_trace

UPLOAD_MB = 1024  # MiB, as .streamlit/config.toml server.maxUploadSize (Streamlit labels the dropzone "1GB")

__all__ = ["UPLOAD_MB", "chart", "current_model", "explain_missing_values", "layer_head_batch", "live_model_for",
           "loaded_model", "n_layer_head", "plain", "read_uploaded_trace", "remembered_tabs", "state", "values_kept"]


# -- models (shared by every session; tracing and interventions route per thread, so sharing is safe) --
MODELS_KEPT = 3  # the bundled model a page starts with and two others loaded (each may be gigabytes)


@st.cache_resource(show_spinner="Loading the model…", max_entries=MODELS_KEPT)
def loaded_model(choice: ModelChoice):
    """``(model, tokenizer)`` of ``choice`` (``session.load``: the one loader), loaded once per server process and
    kept while it is among the newest ``MODELS_KEPT`` used; a load that fails is not kept, so the next try loads
    again."""
    return load(choice)


def chart(fig, key: str, **kwargs):
    """``st.plotly_chart`` with the figure's own look (``figures.plot.TEMPLATE``): Streamlit's theme would
    re-theme each new chart after drawing it, one more full plot per chart on every Step."""
    return st.plotly_chart(fig, key=key, theme=None, **kwargs)


def diagram(fig, key: str) -> None:
    """A boxes-and-arrows figure (``figures.flow``'s shape flow and reshape) drawn as SVG (``figures.svg``): the
    browser draws it without plotly's redraw of a changed figure, 0.05–0.09 s of a Step here. Through
    ``st.markdown``, in an HTML block markdown leaves as it is: ``st.html``'s sanitiser drops an SVG."""
    st.markdown(f"<div class='diagram'>{diagram_svg(fig, key)}</div>", unsafe_allow_html=True)


# The canvas that draws heatmap panels (gui/panels.js): registered once per process, mounted once per page and
# handed a new spec on each rerun. Its code is this package's own files, never anything a user or a model supplies.
_PANELS = st.components.v2.component(
    "gpt_shape_tracer.panels", css=(Path(__file__).parent / "panels.css").read_text(encoding="utf-8"),
    js=(Path(__file__).parent / "panels.js").read_text(encoding="utf-8"))


PANELS_KEY = "panels-"  # every canvas's key starts so: the page's tests find them by it (st-key-panels-…)


def panels(fig, key: str) -> None:
    """A figure of heatmaps side by side (the attention Stages) drawn on a canvas (``figures.panels``): the browser
    redraws it in about 0.01 s, where Streamlit mounts a changed plotly chart afresh and plots it twice (0.1 s of a
    Step here). Hover names a cell's row and column, reads it in every panel of the same cells and draws its row
    and column across them. A figure the canvas does not draw is shown as the plotly chart it is."""
    try:
        spec = panels_spec(fig)
    except ValueError:
        chart(crosshair(fig), key=key)
        return
    # names this drawing: the page's tests wait until the canvas says it drew the spec it was handed
    spec["revision"] = hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=8).hexdigest()
    _PANELS(data=spec, key=f"{PANELS_KEY}{key}")


def remembered_tabs(names: list[str], key: str, same: tuple[str, ...] = ()) -> list:
    """``st.tabs`` that reopens where the person left it. Streamlit forgets a widget's state on a rerun that does
    not draw it (a sub-tab inside another open tab, every tab after Reset), so the open tab is kept in the app
    state and given back before the tabs are drawn again. ``same``: names of one tab whose name follows the model
    (the mask tab's): the one opened under another of them opens under the name drawn now."""
    app = state()
    drawn_as = next((name for name in names if name in same), None)
    for held in (app.open_tabs, st.session_state):
        if drawn_as is not None and held.get(key) in same and held.get(key) != drawn_as:
            held[key] = drawn_as
    if key not in st.session_state and app.open_tabs.get(key) in names:
        st.session_state[key] = app.open_tabs[key]
    elif st.session_state.get(key) in names:
        # set again: Streamlit names the tabs' widget by its labels, so when a name changes (the mask tab's, from
        # one trace to the next) the open tab is kept only if it is handed to the new widget
        st.session_state[key] = st.session_state[key]
    drawn = st.tabs(names, key=key, on_change="rerun")
    opened = st.session_state.get(key)
    if isinstance(opened, str):
        app.open_tabs[key] = opened
    return list(drawn)


# each session's state, by session id, held weakly: an ended session's trace is let go by us, not only when
# Streamlit's session store gets round to dropping the session (it expires entries lazily, on its next use)
_STATES: weakref.WeakValueDictionary[str, AppState] = weakref.WeakValueDictionary()


def this_session() -> str:
    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no session"


def state() -> AppState:
    """This session's state: one typed object, not loose keys."""
    app = st.session_state.setdefault("app", AppState())
    _STATES[this_session()] = app
    return app


def current_model():
    """(model, tokenizer) of the sidebar's choice, loaded once per process."""
    return loaded_model(state().model)


def live_model_for(trace: Trace):
    """The model whose weights made ``trace`` (its own, or the loaded one when the digests match), or None."""
    model = trace.live_model
    if model is not None:
        return model
    try:
        model, _ = current_model()
    except ModelLoadError:
        return None
    return adopt_model(trace, model)


def read_uploaded_trace(upload) -> Trace | None:
    """The trace in an uploaded file, or None after saying why it could not be read (nothing else changes)."""
    try:
        return load_trace(upload.getvalue())
    except TraceFileError as e:
        st.error(f"Could not load {plain(upload.name)}: {plain(e)}. Nothing else changed.")
        return None


# -- shared pickers and messages -----------------------------------------------------------------------
def n_layer_head(trace: Trace) -> tuple[int, int]:
    config = trace.config
    return (config.n_layer, config.n_head) if config is not None else (1, 1)


def layer_head_batch(trace: Trace, prefix: str, heads: bool = True) -> tuple[int, int, int]:
    """Layer, head and sequence pickers keyed by ``prefix``; a head clicked on the grid applies to "attn"."""
    n_layer, n_head = n_layer_head(trace)
    app = state()
    if app.pending_head is not None and prefix == "attn":
        st.session_state["attn_layer"], st.session_state["attn_head"] = app.pending_head
        app.pending_head = None
    cols = st.columns(3)
    layer = cols[0].selectbox("layer", list(range(n_layer)), key=f"{prefix}_layer", persist_state="page",
                              # BLT: its list of layers; strings only (a widget kept between reruns holds it)
                              format_func=layer_labels(trace, n_layer).__getitem__)
    head = cols[1].selectbox("head", list(range(n_head)), key=f"{prefix}_head", persist_state="page") if heads else 0
    batch_size = facts_of(trace).batch_size
    batch = cols[2].selectbox("sequence", list(range(batch_size)), key=f"{prefix}_batch",
                              persist_state="page") if batch_size > 1 else 0
    return layer, head, batch


def said_no_attention(trace: Trace, layer: int, instead: str = "") -> bool:
    """Whether ``layer`` has no attention (a hybrid model's state layer); if so, say what it is — the model's own
    sentence, "layer L has no softmax attention: it is a <mixer> layer whose state does not grow with t …" — and what
    this view shows ``instead``, rather than drawing an empty chart."""
    sentence = no_attention(trace, layer)
    if sentence is None:
        return False
    st.info(f"{sentence[0].upper()}{sentence[1:]}." + (f" {instead}" if instead else ""))
    return True


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
    elif trace.log.spill_bytes:
        st.info(f"The values of step {step} were evicted by the memory budget (the oldest steps go first) after "
                f"the disk spill had filled its {trace.log.spill_bytes / 2**20:,.0f} MB; its shapes and statistics "
                f"are kept, its {what} are not. Raise “Keep every value on disk” and Reset, or view a later step.")
    else:
        st.info(f"The values of step {step} were evicted by the memory budget (the oldest steps go first); "
                f"its shapes and statistics are kept, its {what} are not. Raise the budget, keep every value on "
                "disk (under Tracing), or view a later step.")
