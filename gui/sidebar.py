"""The sidebar (prompt, actions, model, sampling, tracing) and what its buttons do: Step, Run N, Reset, Load."""

from __future__ import annotations

import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from gpt_shape_tracer.gui.common import current_model, loaded_model, plain, state
from gpt_shape_tracer.gui.dry_run import LABEL as DRY_LABEL
from gpt_shape_tracer.gui.dry_run import dry_run_sidebar
from gpt_shape_tracer.gui.runs import forget_run, write_pending_runs
from gpt_shape_tracer.gui.server import reserve_memory
from gpt_shape_tracer.model import BUNDLED_MODELS, ModelLoadError
from gpt_shape_tracer.model.sources import ASSETS, OwnModuleError, resolve_model_path, weights_size
from gpt_shape_tracer.session import (
    DEFAULT_RUN_N,
    DEFAULTS,
    MAX_BUDGET_MB,
    MAX_SPILL_MB,
    MAX_WEIGHTS_GIB,
    SETTING_KEYS,
    ModelChoice,
    Settings,
    SettingsError,
    available_devices,
    check_device,
    checkpoint_path,
    compute_dtypes,
    describe_model,
    no_cache_reason,
    parse_run_steps,
    run_steps,
    settings_from,
)
from gpt_shape_tracer.tracer import FORWARD_CAPTURES, MAX_RUN_STEPS, PADDING_SIDES

BUNDLED = {"Bundled GPT-2-style story model": "story-gpt",  # label: the bundled model's name
           "Bundled Llama-style story model": "story-llama"}
SOURCES = {**BUNDLED, "Local Hugging Face directory": "directory",  # label: a bundled model's name, or the source
           "Your own module (package.module:function)": "factory", DRY_LABEL: "dry"}
DECODINGS = ["greedy", "sample"]
# str, as the settings' fields are (settings_from checks the widgets' values)
CAPTURES: list[str] = list(FORWARD_CAPTURES)  # gradients: a backward pass, from Attention → Gradients
PADDINGS: list[str] = list(PADDING_SIDES)
DRAWN_BY_THE_RUN = "step_button_drawn_by_the_run"  # session_state: this full run drew Step, before a Run N


def _loaded() -> tuple | None:
    """(model, tokenizer) of the sidebar's choice, or None when it does not load."""
    try:
        return current_model()
    except (ModelLoadError, OwnModuleError, OSError, ValueError):
        return None


def _end_of_sequence_ids(loaded: tuple | None) -> tuple[int, ...]:
    """The ids the loaded model's files declare as ending a sequence (empty: none, or no model loads)."""
    return tuple(getattr(loaded[1], "eos_ids", ()) or ()) if loaded is not None else ()


def sidebar() -> tuple[str | None, dict[str, object], DeltaGenerator]:
    """Draws the sidebar; returns the action pressed ("run", "reset") or None, the settings' widget values by key
    (``sidebar_values``) and the Step button's place, left empty: the page's view draws the button there
    (``step_button``), so that a Step reruns the view alone and not the sidebar (app.py). Step is not an action:
    its click is counted by its callback (``owe_a_step``), and whichever run comes next makes the steps owed."""
    sb = st.sidebar
    sb.text_area("Prompt (one line per sequence: several lines make a batch)", value=DEFAULTS.prompt, key="prompt",
                 height=96)
    buttons = sb.columns(3)
    step_slot = buttons[0].empty()
    st.session_state[DRAWN_BY_THE_RUN] = False  # the view draws the button, unless this run does (step_button)
    run = buttons[1].button("Run N", key="run_button", width="stretch")
    buttons[2].button("Reset", key="reset_button", width="stretch", on_click=ask_reset)
    reset = reset_confirmation(sb)
    sb.number_input(f"N for Run N (1…{MAX_RUN_STEPS})", value=DEFAULT_RUN_N, step=1, key="run_n")

    sb.header("Model")
    available = {label: source for label, source in SOURCES.items()
                 if label not in BUNDLED or source in bundled_available()}
    label = sb.radio("Weights", list(available), key="source",
                     help="Bundled models ship with the app. A local directory is what Hugging Face save_pretrained "
                          "writes (config.json + weights): GPT-2, Llama, Mistral and Qwen2 run on our own "
                          "implementation, any other decoder transformers knows (Qwen3, Gemma, Phi-3, …) is run by "
                          "transformers through our hook points. A Hugging Face cache folder (models--org--name, or "
                          "its snapshots/<hash>), a repo id found in the local cache (org/name), or a nanoGPT "
                          "ckpt.pt work too. Your own module: a function in your own code on this machine that "
                          "returns (model, tokenizer). Config only: a config.json (or a shipped shape config such as "
                          "Llama 3.1 405B) built on the meta device, no weights: shapes and costs. Nothing is "
                          "downloaded.")
    chosen = available[label]
    device = device_choice(sb) if chosen == "directory" or label in BUNDLED else "cpu"
    if chosen == "directory":
        path = sb.text_input("Directory", key="model_dir", placeholder="/path/to/model, org/name or ckpt.pt")
        dtypes, not_offered = compute_dtypes(device)
        if st.session_state.get("model_dtype") not in (None, *dtypes):
            st.session_state["model_dtype"] = "float32"  # a half precision this device does not compute in
        dtype = sb.selectbox("Compute dtype", list(dtypes), key="model_dtype",
                             help="float32 by default; bfloat16 and float16 halve the memory of the weights "
                                  "(tolerances in the cache comparison follow the dtype)")
        if not_offered:
            sb.caption(not_offered)
        memory = sb.number_input(
            "Memory for the weights (GiB, 0 = all in memory)", value=0.0, min_value=0.0, max_value=MAX_WEIGHTS_GIB,
            step=0.5, key="model_memory_gib",
            help="For a model larger than this machine's memory: transformers runs it and Hugging Face "
                 "accelerate keeps the layers beyond this amount on disk, reading them in, memory-mapped from "
                 "the directory's own files, for each forward — slower, with the same logits and records")
        size = weights_size_of(path, dtype, memory)
        if size:
            sb.caption(size)
        if sb.button("Load", key="load_model"):
            load_directory(path, dtype, memory, device)
    elif chosen == "factory":
        spec = sb.text_input("Factory", key="model_factory", placeholder="my_package.my_model:make",
                             help="A function returning the model, or (model, tokenizer or a tokenizer.json path). "
                                  "It is imported from the Python path and the directory the app was started in, "
                                  "and only from a file nobody else can write. Its attention is seen where it calls "
                                  "torch.nn.functional.scaled_dot_product_attention.")
        if sb.button("Load", key="load_factory"):
            load_own_module(spec)
    elif chosen == "dry":
        dry_run_sidebar(sb)
    elif state().model != (bundled := ModelChoice("bundled", chosen, device=device)):
        choose_model(bundled, "")

    sb.header("Sampling")
    decoding = sb.radio("Decoding", DECODINGS, index=DECODINGS.index(DEFAULTS.decoding), key="decoding",
                        horizontal=True)
    sampling_off = decoding == "greedy"
    sb.number_input(
        "temperature τ", value=DEFAULTS.temperature, step=0.1, key="temperature", disabled=sampling_off,
        help="softmax(z/τ) over the logits z: τ < 1 sharpens, τ > 1 flattens; 0 < τ ≤ 100")
    cols = sb.columns(2)
    cols[0].number_input("top-k (0 = off)", value=DEFAULTS.top_k, step=1, key="top_k", disabled=sampling_off)
    cols[1].number_input("top-p", value=DEFAULTS.top_p, step=0.05, key="top_p", disabled=sampling_off,
                         help="in (0, 1]")
    sb.text_input("seed", value=DEFAULTS.seed, key="seed", disabled=sampling_off)
    sb.header("Tracing")
    sb.toggle(
        "KV cache", value=DEFAULTS.use_cache, key="use_cache",
        help="On: a decode step computes one new row. Off: every step recomputes all positions.")
    # the model the steps run: the generation's, or before its first Step the sidebar's choice (a Step reruns the
    # page's view alone, not this sidebar: what it says must hold before and after)
    live, loaded = state().live_generation, _loaded()
    stepped = live.model if live is not None else (loaded[0] if loaded is not None else None)
    if state().model.kind == "factory":
        sb.caption("Your module runs its own forward, without our KV cache: every step recomputes all positions.")
    elif stepped is not None and (reason := no_cache_reason(stepped)) is not None:  # OpenAI GPT keeps none
        sb.caption(f"{reason[:1].upper()}{reason[1:]}: every step recomputes all positions, whichever way this "
                   "switch is set.")
    sb.toggle("chat template", value=DEFAULTS.chat, key="chat",
              help="Wrap each prompt in the model's chat template as a user message, as "
                   "transformers' apply_chat_template(add_generation_prompt=True) does")
    declared = _end_of_sequence_ids(loaded)
    sb.toggle(
        "stop at EOS", value=DEFAULTS.stop_at_eos, key="stop_at_eos", disabled=not declared,
        help=f"Stop once every sequence has chosen an end-of-sequence token: this model declares "
             f"{', '.join(map(str, declared))} (the bundled models: <|endoftext|>, which ends each of their stories)"
        if declared else "This model's files declare no end-of-sequence token, so generation never stops on a token "
                         "and this switch would change nothing")
    sb.selectbox(
        "Capture", CAPTURES, index=CAPTURES.index(DEFAULTS.capture), key="capture",
        help="shapes: shape/dtype only (NaN/∞ checked on the residual stream and logits) · values: + "
             "tensors (within the budget) · ops: + every torch op")
    cols = sb.columns(2)
    cols[0].selectbox("Padding", PADDINGS, index=PADDINGS.index(DEFAULTS.padding_side), key="padding_side")
    cols[1].number_input("Budget (MB)", value=DEFAULTS.budget_mb, min_value=1, max_value=MAX_BUDGET_MB,
                         key="budget_mb")
    sb.number_input(
        "Keep every value on disk (MB, 0 = off)", value=DEFAULTS.spill_mb, min_value=0, max_value=MAX_SPILL_MB,
        step=256, key="spill_mb",
        help="Values past the budget go to a private temporary file (deleted with the session) instead of being "
             "summarised, up to this many MB, and every view reads them back: real numbers at every step")
    values = sidebar_values()
    if reset:
        return "reset", values, step_slot
    return ("run" if run else None), values, step_slot


def sidebar_values() -> dict[str, object]:
    """The settings' widget values by key, as the widgets hold them (``session.settings_from`` reads them): what the
    sidebar drew, read again by a rerun of the view alone, which does not draw it."""
    held = st.session_state
    return {key: held[key] for key in SETTING_KEYS if key in held}


def read_settings(values: dict[str, object]) -> tuple[Settings | None, SettingsError | None]:
    """The settings of the widgets' values, or why they are refused: read once per run, so that every use in it
    sees the same settings or the same refusal."""
    try:
        return settings_from(values), None
    except SettingsError as e:
        return None, e


def step_button(slot: DeltaGenerator, *, by_the_run: bool = False) -> None:
    """The Step button, in its place in the sidebar (``sidebar``'s third value), drawn by the page's view (a click
    reruns the view alone). ``by_the_run``: drawn by the full run itself, before a Run N — Streamlit does not stop a
    run for a click in a fragment, and a Step clicked while N steps run stops them after the step in progress
    (``advance``); the view then leaves it as it is."""
    if by_the_run:
        st.session_state[DRAWN_BY_THE_RUN] = True
    elif st.session_state.get(DRAWN_BY_THE_RUN):
        return
    slot.button("Step", type="primary", key="step_button", width="stretch", on_click=owe_a_step)


def device_choice(sb) -> str:
    """The device the model is loaded on: one of those this machine offers. A device asked for otherwise — the
    address's ``?device=``, a value put in the session's state — that this machine lacks is refused with a
    message, and the choice stays where it was (nothing loaded or computed is touched)."""
    app = state()
    offered = available_devices()
    asked = st.query_params.get("device")
    if asked is not None:
        del st.query_params["device"]  # asked once: a refusal is not repeated at every rerun
        st.session_state["model_device"] = asked
    requested = st.session_state.get("model_device")
    if requested is not None and requested not in offered:
        current = app.model.device
        try:
            st.session_state["model_device"] = check_device(requested)  # "cuda" is "cuda:0"
        except SettingsError as e:
            st.session_state["model_device"] = current if current in offered else "cpu"
            kept = ("the current generation and its steps are kept" if app.live.generation is not None
                    else "nothing changed")
            app.notices.append(("error", f"Device refused — {plain(e)}. The model stays on "
                                         f"{st.session_state['model_device']}; {kept}."))
    return sb.selectbox("Device", list(offered), key="model_device",
                        help="Where the model's weights live and its forward runs: the CPU, or each GPU PyTorch "
                             "sees on this machine. The trace's values come back to the host as they are kept.")


@st.cache_data(show_spinner=False)
def bundled_available() -> list[str]:
    return [name for name in BUNDLED_MODELS if (ASSETS / name / "config.json").is_file()]


def weights_size_of(path: str, dtype: str, memory_gib: float = 0) -> str:
    """What loading will hold, read from the safetensors headers before anything is loaded ("" when unknown),
    and the part of it that stays on disk when its weights are given ``memory_gib``."""
    try:
        directory = resolve_model_path(checkpoint_path(path))
        count, nbytes = weights_size(directory, dtype) if directory.is_dir() else (0, 0)
    except Exception:  # an estimate only: a file Load would refuse (and explain) just shows none
        return ""
    if not count:
        return ""
    size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
    held = f"Loading holds {count / 1e6:,.1f}M parameters: {size} in {dtype}."
    if memory_gib and nbytes > memory_gib * 2**30:
        return (f"{count / 1e6:,.1f}M parameters: {size} in {dtype}, of which at most {memory_gib:g} GiB is held "
                "in memory; the rest stays on disk and is read at every forward.")
    return held


def load_own_module(spec: str) -> None:
    app = state()
    try:
        choice = ModelChoice("factory", spec.strip())
        model, tok = loaded_model(choice)
    except (OwnModuleError, ModelLoadError, ImportError, OSError, ValueError, TypeError, RuntimeError) as e:
        app.notices = [("error", f"Could not load that module, the previous model stays loaded: {plain(e)}")]
        return
    if tok is None:
        app.notices = [("error", "Your factory returned no tokenizer: return (model, tokenizer), where the tokenizer "
                                 "is a model.TextTokenizer or the path of a tokenizer.json; the previous model stays "
                                 "loaded.")]
        return
    choose_model(choice, f"Loaded {plain(spec)}: {describe_model(model)}.")


def load_directory(path: str, dtype: str, memory_gib: float = 0, device: str = "cpu") -> None:
    app = state()
    try:
        choice = ModelChoice("directory", checkpoint_path(path), dtype=dtype, memory_gib=memory_gib, device=device)
    except SettingsError as e:
        app.notices = [("error", str(e))]
        return
    try:
        model, tok = loaded_model(choice)
    except ModelLoadError as e:
        app.notices = [("error", f"Could not load that model, the previous one stays loaded: {plain(e)}")]
        return
    except (OSError, RuntimeError, ValueError) as e:  # a path the system itself refuses
        app.notices = [("error", f"Could not read that directory, the previous model stays loaded: {plain(e)}")]
        return
    if tok is None:
        app.notices = [("error", f"{plain(choice.where)} has no tokenizer (tokenizer.json, or vocab.json + "
                                 "merges.txt); the previous model stays loaded.")]
        return
    choose_model(choice, f"Loaded {plain(choice.where)}: {describe_model(model)}.")


def choose_model(choice: ModelChoice, loaded: str) -> None:
    """Make ``choice`` the model the next generation uses. A live generation keeps its own model until Reset,
    like every other setting, and an opened file stays open: choosing a model discards nothing."""
    app = state()
    app.model = choice
    if app.live.generation is None:
        if loaded:
            app.notices = [("success", loaded)]
        return
    waiting = ("Step continues the current generation with its own model; Reset starts a new one with "
               f"{plain(choice.describe())}." if app.model_changed else
               "It is the model of the current generation, which goes on as it was.")
    app.notices = [("success" if loaded else "info", (loaded + " " if loaded else "") + waiting)]


def ask_reset() -> None:
    """Reset's callback: with steps to discard it asks first (``reset_confirmation``), else it resets."""
    app = state()
    gen = app.live.generation
    if gen is not None and gen.n_steps:
        app.confirm_reset = True
    else:
        app.reset_confirmed = True


def confirm_reset(answer: bool) -> None:
    app = state()
    app.confirm_reset, app.reset_confirmed = False, answer


def reset_confirmation(sb) -> bool:
    """The question Reset asks before it discards a generation; True when a reset is to be made now."""
    app = state()
    if app.reset_confirmed:
        app.reset_confirmed = False
        return True
    gen = app.live.generation
    if not app.confirm_reset or gen is None or not gen.n_steps:
        app.confirm_reset = False
        return False
    box = sb.container(border=True, key="reset_question")
    kept = (" It stays under **Recent runs** (below), one click away." if app.run_id else "")
    box.warning(f"Reset discards this page's generation ({gen.n_steps} step{'s' if gen.n_steps != 1 else ''}) and "
                f"its experiment results.{kept}")
    cols = box.columns(2)
    cols[0].button("Discard", key="reset_confirm", type="primary", width="stretch",
                   on_click=confirm_reset, args=(True,))
    cols[1].button("Cancel", key="reset_cancel", width="stretch", on_click=confirm_reset, args=(False,))
    return False


def reset(refused: SettingsError | None) -> None:
    """Reset, unless the settings are refused: then nothing is thrown away."""
    if refused is not None:
        state().notices = [("error", f"Reset refused, nothing was discarded: {refused}")]
        return
    write_pending_runs(state())  # the steps of the run let go are written first (its writing is a thread's)
    state().reset()
    forget_run()  # the address names no run now; the old one stays in Recent runs
    reserve_memory()  # the generation's share goes back to the server
    state().notices = [("info", "Reset: the next Step starts from the prompt with these settings and "
                                f"{plain(state().model.describe())}.")]


def advance(n_raw: object, settings: Settings | None, refused: SettingsError | None, owed: bool = False) -> None:
    """Step or Run N: one forward pass and one token per step, with progress and a Stop button for a run.
    A step that finished stays finished whatever interrupts the next one (``session.run_steps``). ``owed``:
    the steps are ``AppState.steps_owed``, each paid off as it finishes; an error or a stop forgives the rest."""
    app = state()
    notices = []
    try:
        n = parse_run_steps(n_raw)
        gen = app.live.generation
        if gen is None:
            if refused is not None:
                raise refused
            assert settings is not None  # settings_from gives the settings or a refusal (app.run)
            model, tok = current_model()
            refusal = reserve_memory(generation_bytes=settings.budget_bytes)  # the server's total, shared
            if refusal:
                app.notices = [("error", f"Not started: {refusal}")]
                app.steps_owed = 0
                return
            gen = app.start(model, tok, settings)
            notices += [("warning", plain(w)) for w in gen.warnings]
    except SettingsError as e:
        app.notices = [("error", str(e))]
        app.steps_owed = 0
        return
    app.show_file(False)
    # the bar and its Stop button live only while the steps run: afterwards a Stop would stop nothing
    running = st.empty()
    progress = None
    if n > 1:
        with running.container():
            progress = st.progress(0.0, text=f"step 1 of {n}")
            st.button("Stop", key="stop_run", help="Stops after the step in progress; every finished step is kept",
                      on_click=forgive_steps)

    def show(done: int) -> None:
        if owed:  # paid off before the next Streamlit call, where a click can stop this run
            app.steps_owed = max(0, app.steps_owed - 1)
        if progress is not None and done < n:
            progress.progress(done / n, text=f"step {done + 1} of {n}")

    try:
        end = run_steps(gen, n, on_step=show)
    finally:
        running.empty()
    if end is not None:
        app.steps_owed = 0
        notices.append((end.level, end.message + plain(end.detail)))
    if gen.n_steps:
        st.session_state["step_view"] = gen.n_steps - 1
    app.notices = notices


def owe_a_step() -> None:
    """Step's callback, which Streamlit calls before the run's script: the click is counted before anything in
    the run can be interrupted by the next click (the run that makes the step may be a later one)."""
    app = state()
    with app.run_lock:  # a run still stopping may be paying off an earlier step
        app.steps_owed += 1


def forgive_steps() -> None:
    """Stop's callback: Step clicks still owed are not made (a click's rerun would otherwise make them)."""
    state().steps_owed = 0
