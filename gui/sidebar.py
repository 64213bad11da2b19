"""The sidebar (prompt, actions, model, sampling, tracing) and what its buttons do: Step, Run N, Reset, Load."""

from __future__ import annotations

import streamlit as st

from gui.common import current_model, directory_model, plain, state
from model import BUNDLED_MODELS, ModelLoadError
from model.loading import ASSETS
from session import (
    DEFAULT_RUN_N,
    DEFAULTS,
    MAX_BUDGET_MB,
    Settings,
    SettingsError,
    checkpoint_path,
    describe_model,
    directory_key,
    parse_model_key,
    parse_run_steps,
    run_steps,
)
from tracer import MAX_RUN_STEPS

SOURCES = {"Bundled GPT-2-style story model": "bundled:story-gpt",
           "Bundled Llama-style story model": "bundled:story-llama",
           "Local Hugging Face directory": "dir"}
DECODINGS = ["greedy", "sample"]
CAPTURES = ["values", "shapes", "ops"]
PADDINGS = ["left", "right"]


def sidebar() -> tuple[str | None, dict[str, object]]:
    """Draws the sidebar; returns the action pressed ("step", "run", "reset") or None, and the settings'
    widget values by key (``session.settings_from`` reads them)."""
    sb = st.sidebar
    values: dict[str, object] = {}
    values["prompt"] = sb.text_area("Prompt (one line per sequence: several lines make a batch)",
                                    value=DEFAULTS.prompt, key="prompt", height=96)
    cols = sb.columns(3)
    step = cols[0].button("Step", type="primary", key="step_button", width="stretch")
    run = cols[1].button("Run N", key="run_button", width="stretch")
    reset = cols[2].button("Reset", key="reset_button", width="stretch")
    sb.number_input(f"N for Run N (1…{MAX_RUN_STEPS})", value=DEFAULT_RUN_N, step=1, key="run_n")

    sb.header("Model")
    available = {label: key for label, key in SOURCES.items()
                 if not key.startswith("bundled:") or parse_model_key(key)[0] in bundled_available()}
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
    values["decoding"] = sb.radio("Decoding", DECODINGS, index=DECODINGS.index(DEFAULTS.decoding), key="decoding",
                                  horizontal=True)
    sampling_off = values["decoding"] == "greedy"
    values["temperature"] = sb.number_input(
        "temperature τ", value=DEFAULTS.temperature, step=0.1, key="temperature", disabled=sampling_off,
        help="softmax(z/τ) over the logits z: τ < 1 sharpens, τ > 1 flattens; 0 < τ ≤ 100")
    cols = sb.columns(2)
    values["top_k"] = cols[0].number_input("top-k (0 = off)", value=DEFAULTS.top_k, step=1, key="top_k",
                                           disabled=sampling_off)
    values["top_p"] = cols[1].number_input("top-p", value=DEFAULTS.top_p, step=0.05, key="top_p",
                                           disabled=sampling_off, help="in (0, 1]")
    values["seed"] = sb.text_input("seed", value=DEFAULTS.seed, key="seed", disabled=sampling_off)
    sb.header("Tracing")
    values["use_cache"] = sb.toggle(
        "KV cache", value=DEFAULTS.use_cache, key="use_cache",
        help="On: a decode step computes one new row. Off: every step recomputes all positions.")
    values["capture"] = sb.selectbox(
        "Capture", CAPTURES, index=CAPTURES.index(DEFAULTS.capture), key="capture",
        help="shapes: shape/dtype only (NaN/∞ checked on the residual stream and logits) · values: + "
             "tensors (within the budget) · ops: + every torch op")
    cols = sb.columns(2)
    values["padding_side"] = cols[0].selectbox("Padding", PADDINGS, index=PADDINGS.index(DEFAULTS.padding_side),
                                               key="padding_side")
    values["budget_mb"] = cols[1].number_input("Budget (MB)", value=DEFAULTS.budget_mb, min_value=1,
                                               max_value=MAX_BUDGET_MB, key="budget_mb")
    if reset:
        return "reset", values
    return ("step" if step else ("run" if run else None)), values


@st.cache_data(show_spinner=False)
def bundled_available() -> list[str]:
    return [name for name in BUNDLED_MODELS if (ASSETS / name / "config.json").is_file()]


def load_directory(path: str, dtype: str) -> None:
    app = state()
    try:
        resolved = checkpoint_path(path)
    except SettingsError as e:
        app.notices = [("error", str(e))]
        return
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
    app.model_key = directory_key(resolved, dtype)
    app.notices = [("success", f"Loaded {plain(resolved)}: {describe_model(model)}")]


def reset(refused: SettingsError | None) -> None:
    """Reset, unless the settings are refused: then nothing is thrown away."""
    if refused is not None:
        state().notices = [("error", f"Reset refused, nothing was discarded: {refused}")]
        return
    state().reset()
    state().notices = [("info", "Reset: the next Step starts from the prompt with these settings.")]


def advance(n_raw: object, settings: Settings | None, refused: SettingsError | None) -> None:
    """Step or Run N: one forward pass and one token per step, with progress and a Stop button for a run.
    A step that finished stays finished whatever interrupts the next one (``session.run_steps``)."""
    app = state()
    notices = []
    try:
        n = parse_run_steps(n_raw)
        gen = app.generation
        if gen is None:
            if refused is not None:
                raise refused
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

    def show(done: int) -> None:
        if progress is not None:
            progress.progress(done / n, text=f"step {done + 1} of {n}" if done < n else "drawing")

    end = run_steps(gen, n, on_step=show)
    if end is not None:
        notices.append((end.level, end.message + plain(end.detail)))
    if gen.n_steps:
        st.session_state["step_view"] = gen.n_steps - 1
    app.notices = notices
