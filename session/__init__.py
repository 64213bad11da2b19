"""What the app's widgets mean, what a session holds and what its buttons run, without Streamlit.

The sidebar's widgets take their defaults from ``DEFAULTS`` and their values reach ``settings_from`` once;
every refusal is a ``SettingsError`` (``_errors.py``) whose message the app shows as it is. What to load is a
``ModelChoice`` (``_choice.py``, with the devices): the sidebar, the command line and a saved run each build one,
and ``load`` loads it for all three. ``AppState`` is the one object a browser session keeps between reruns: the
live generation, the trace file being viewed (if any) and the small choices that outlive a widget. The GUI
(``gui/``) draws; what its buttons compute — a run of steps, a rerun to compare with, a step replayed with heads
off — is here, so that it can be tested without a page.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from gpt_shape_tracer.model.analysis import repeated_random_tokens
from gpt_shape_tracer.model.gpt import act_name, identity_of
from gpt_shape_tracer.model.sampling import SamplingConfig, SamplingError
from gpt_shape_tracer.model.sources import TokenizerConfigError
from gpt_shape_tracer.session._choice import DEFAULT_MODEL as DEFAULT_MODEL
from gpt_shape_tracer.session._choice import HOST as HOST
from gpt_shape_tracer.session._choice import MAX_WEIGHTS_GIB as MAX_WEIGHTS_GIB
from gpt_shape_tracer.session._choice import ModelChoice as ModelChoice
from gpt_shape_tracer.session._choice import available_devices as available_devices
from gpt_shape_tracer.session._choice import check_device as check_device
from gpt_shape_tracer.session._choice import checkpoint_path as checkpoint_path
from gpt_shape_tracer.session._choice import compute_dtypes as compute_dtypes
from gpt_shape_tracer.session._choice import gib_of as gib_of
from gpt_shape_tracer.session._choice import load as load
from gpt_shape_tracer.session._errors import SettingsError as SettingsError
from gpt_shape_tracer.session.decoding import BeamRun
from gpt_shape_tracer.tracer import (
    DEFAULT_BUDGET_BYTES,
    FORWARD_CAPTURES,
    MAX_BATCH,
    MAX_RUN_STEPS,
    PADDING_SIDES,
    CacheClassRun,
    CachePrecisionRun,
    ContextFullError,
    GenerationStopped,
    Intervention,
    PatchingResult,
    PromptError,
    SpeculativeDecoding,
    Trace,
    TracedGeneration,
    ablate,
    activation_patching,
    diff_traces,
    pattern_changes,
    replay,
    text_loss,
)

if TYPE_CHECKING:
    import pandas as pd

    from gpt_shape_tracer.session.engine import EngineView

MAX_BUDGET_MB = 8192
MAX_SPILL_MB = 65536  # "keep every value on disk": at most 64 GiB of one session's temporary file
DEFAULT_PROMPT = "Once upon a time, there was a little girl named Lily. She had a red ball."
DEFAULT_RUN_N = 8  # the sidebar's "N for Run N"
AUTO_RECOMPUTE_PARAMS = 20_000_000  # below this, every step is checked against a full recompute (one timing)


@dataclass(frozen=True)
class Settings:
    prompts: tuple[str, ...]
    sampling: SamplingConfig
    use_cache: bool
    capture: str
    padding_side: str
    budget_bytes: int
    chat: bool = False  # each prompt wrapped in the model's chat template as a user message
    stop_at_eos: bool = True  # generation stops once every sequence chose an end-of-sequence id
    spill_bytes: int = 0  # values the budget evicts kept in a private temporary file, up to this (0: off)


def split_prompts(text: str) -> tuple[str, ...]:
    """One prompt per line; a single line is a batch of one. Empty lines among several are refused."""
    if text is None or not text.strip():
        raise SettingsError("the prompt is empty: type some text" if not text else "the prompt is only whitespace")
    lines = text.split("\n")
    if len(lines) > 1 and lines[-1] == "":
        lines = lines[:-1]  # a trailing newline is not an extra prompt
    if len(lines) == 1:
        return (lines[0],)
    empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if empty:
        raise SettingsError(
            f"line {', '.join(map(str, empty))} of the batch {'is' if len(empty) == 1 else 'are'} empty: "
            "every line is one prompt — remove the empty line(s)"
        )
    if len(lines) > MAX_BATCH:
        raise SettingsError(f"{len(lines)} prompts: a batch holds at most {MAX_BATCH} lines")
    return tuple(lines)


def parse_seed(raw: object) -> int:
    text = str(raw).strip()
    try:
        return int(text)
    except ValueError:
        raise SettingsError(f"the seed must be a whole number, got {text!r}") from None


@dataclass(frozen=True)
class SettingsDefaults:
    """The sidebar's settings before anyone touches them, declared once: the widgets start from these, and
    ``settings_from`` falls back on them for a widget not drawn yet. Field names are the widgets' keys."""

    prompt: str = DEFAULT_PROMPT
    decoding: str = "greedy"  # or "sample"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: str = "0"
    use_cache: bool = True
    capture: str = "values"
    padding_side: str = "left"
    budget_mb: int = DEFAULT_BUDGET_BYTES // 2**20
    chat: bool = False
    stop_at_eos: bool = True
    spill_mb: int = 0  # "keep every value on disk", MB (0: off)


DEFAULTS = SettingsDefaults()
SETTING_KEYS = tuple(f.name for f in fields(SettingsDefaults))


def settings_from(values: Mapping[str, object]) -> Settings:
    """The settings of the sidebar's widget values (by key; a missing key takes its default)."""
    # what the widgets hold, as they hold it: parse_settings and the config classes it fills check every value
    v: dict[str, Any] = {key: values.get(key, getattr(DEFAULTS, key)) for key in SETTING_KEYS}
    return parse_settings(
        prompt=v["prompt"], greedy=v["decoding"] == "greedy", temperature=v["temperature"], top_k=v["top_k"],
        top_p=v["top_p"], seed=v["seed"], use_cache=v["use_cache"], capture=v["capture"],
        padding_side=v["padding_side"], budget_mb=v["budget_mb"], chat=v["chat"], stop_at_eos=v["stop_at_eos"],
        spill_mb=v["spill_mb"],
    )


def parse_settings(
    prompt: str, greedy: bool, temperature: float, top_k: int, top_p: float, seed: object,
    use_cache: bool, capture: str, padding_side: str, budget_mb: float, chat: bool = False, stop_at_eos: bool = True,
    spill_mb: float = 0,
) -> Settings:
    """The app's settings: the prompt box's text is one prompt per line."""
    return build_settings(split_prompts(prompt), greedy, temperature, top_k, top_p, seed, use_cache, capture,
                          padding_side, budget_mb, chat, stop_at_eos, spill_mb)


def build_settings(
    prompts: tuple[str, ...], greedy: bool, temperature: float, top_k: int | None, top_p: float | None,
    seed: object, use_cache: bool, capture: str, padding_side: str, budget_mb: float, chat: bool = False,
    stop_at_eos: bool = True, spill_mb: float = 0,
) -> Settings:
    """Settings from their values, refused with a ``SettingsError`` saying why: the one set of rules, limits and
    defaults the app and the command line (``gpt-shape-tracer trace``) share."""
    if not prompts or len(prompts) > MAX_BATCH:
        raise SettingsError(f"give 1 to {MAX_BATCH} prompts, got {len(prompts)}")
    try:
        sampling = SamplingConfig(
            temperature=0.0 if greedy else temperature,
            top_k=top_k if top_k else None,
            top_p=top_p if top_p is not None and top_p != 1 else None,
            seed=parse_seed(seed),
        )
    except SamplingError as e:
        raise SettingsError(str(e)) from None
    if not greedy and temperature == 0:
        raise SettingsError("temperature 0 is greedy decoding: choose “greedy”, or a temperature above 0")
    if capture not in FORWARD_CAPTURES:
        raise SettingsError(f"capture must be one of {', '.join(FORWARD_CAPTURES)}")
    if padding_side not in PADDING_SIDES:
        raise SettingsError("padding must be left or right")
    if not 1 <= budget_mb <= MAX_BUDGET_MB:
        raise SettingsError(f"the value budget must be between 1 and {MAX_BUDGET_MB} MB, got {budget_mb:g}")
    if not 0 <= spill_mb <= MAX_SPILL_MB:  # also refuses NaN
        raise SettingsError(f"keeping values on disk takes 0 (off) to {MAX_SPILL_MB} MB, got {spill_mb:g}")
    if spill_mb and capture == "shapes":
        raise SettingsError("keeping every value on disk needs values to keep: choose the values or ops capture")
    spill_bytes = int(spill_mb * 2**20)
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if spill_bytes > free:
        raise SettingsError(f"keeping {spill_mb:g} MB of values on disk: the temporary directory "
                            f"{tempfile.gettempdir()} has {free / 2**20:,.0f} MB free")
    return Settings(prompts, sampling, bool(use_cache), capture, padding_side, int(budget_mb * 2**20), bool(chat),
                    bool(stop_at_eos), spill_bytes)


def parse_run_steps(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or int(raw) != raw:
        raise SettingsError(f"Run N takes a whole number of steps, got {raw!r}")
    n = int(raw)
    if not 1 <= n <= MAX_RUN_STEPS:
        raise SettingsError(f"Run N takes 1 to {MAX_RUN_STEPS} steps at a time, got {n}")
    return n


def new_generation(model, tokenizer, settings: Settings) -> TracedGeneration:
    """The generation the settings describe. With ``chat``, each prompt is rendered by the model's chat template
    (which writes the special tokens itself, so encoding adds none, as transformers does). A model that runs
    without our KV cache (your own module, OpenAI GPT: ``no_cache_reason``) runs with the cache off."""
    prompts = list(settings.prompts)
    if settings.chat:
        try:
            prompts = [tokenizer.apply_chat_template(p) for p in prompts]
        except TokenizerConfigError as e:
            raise SettingsError(f"“chat template” is on, but {e}") from None
        tokenizer = tokenizer.without_special_tokens()
    try:
        return TracedGeneration(
            model, tokenizer, prompts if len(prompts) > 1 else prompts[0],
            use_cache=settings.use_cache and caches(model), capture=settings.capture, sampling=settings.sampling,
            padding_side=settings.padding_side, budget_bytes=settings.budget_bytes, stop_at_eos=settings.stop_at_eos,
            spill_bytes=settings.spill_bytes,
        )
    except PromptError as e:
        raise SettingsError(str(e)) from None


def caches(model) -> bool:
    """Whether ``model`` runs with our KV cache (a module of your own runs its own code, without one; a
    transformers family whose forward takes no cache, OpenAI GPT, keeps none: ``no_cache_reason``)."""
    return no_cache_reason(model) is None


def no_cache_reason(model) -> str | None:
    """Why ``model`` runs without a KV cache, as a clause starting in lower case (None: it keeps one)."""
    reason = getattr(model, "no_cache_reason", None)
    return str(reason) if reason else None


# -- models -------------------------------------------------------------------------------------------
def describe_model(model) -> str:
    """The live model's size and dtype in one line (beside its identity, which a file also carries)."""
    c = model.config
    kv = f" sharing {c.n_kv_heads} key/value heads" if c.n_kv_heads != c.n_head else ""
    weight = next(model.parameters())
    dtype = str(weight.dtype).removeprefix("torch.")
    if weight.device.type != HOST:
        dtype += f" on {weight.device}"
    placed = getattr(model, "offloaded", None) or {}
    on_disk = sum(1 for where in placed.values() if where == "disk")
    offload = f"; {on_disk} of its {len(placed)} parts on disk, read at every forward" if on_disk else ""
    heads = (f"d_head = {c.d_head}" if getattr(c, "d_v", c.d_head) == c.d_head else
             f"d_qk = {c.d_head}, d_v = {c.d_v}")  # latent attention: the value heads are narrower
    if getattr(c, "kv_latent_dim", None) is not None:
        heads += f", cache per position d_c + d_R = {c.kv_latent_dim} + {c.rope_key_dim}"
    lists = len({p.rpartition(".")[0] for p in getattr(c, "block_paths", ())})  # BLT: its lists of layers
    layers = f"{c.n_layer} attention blocks in {lists} lists of layers" if lists else f"{c.n_layer} layers"
    return (f"{layers} × {c.n_head} heads{kv}, d = {c.d_model}, {heads}, V = {c.vocab_size}, "
            f"n_ctx = {c.n_ctx} — {model.num_parameters / 1e6:.1f}M parameters, {dtype}{offload}")


def adopt_model(trace: Trace, model):
    """``model`` when its weights made ``trace`` (the digests match), attached to the trace for the
    experiments to run; None when it has other weights."""
    if trace.model is not None and identity_of(model).weights_digest == trace.model.weights_digest:
        trace.attach_model(model)
        return model
    return None


def first_token(tokenizer) -> int:
    """The token a probe sequence starts with: the tokenizer's end-of-text, else id 0."""
    return tokenizer.eos_id if tokenizer is not None and tokenizer.eos_id is not None else 0


# -- running steps -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunEnd:
    """Why a run of steps ended before its N. ``detail`` quotes text from outside the app (an exception's
    message): the GUI shows it as plain text after ``message``."""

    level: str  # "warning" or "error"
    message: str
    detail: str = ""


def run_steps(gen: TracedGeneration, n: int, on_step: Callable[[int], None] | None = None) -> RunEnd | None:
    """Up to ``n`` steps of ``gen``, each checked against a full recompute for a small model; ``on_step(k)``
    after the k-th step when more follow or it was the last. A step that finished stays finished whatever
    stops the next one; returns None when all ``n`` ran."""
    for done in range(1, n + 1):
        try:
            gen.step()
        except (ContextFullError, GenerationStopped) as e:
            return RunEnd("warning", f"Stopped: {e}")
        except Exception as e:  # a failing forward: the trace keeps everything up to it
            return RunEnd("error", f"The forward pass failed at step {gen.n_steps}: {type(e).__name__}: ", str(e))
        if gen.model.num_parameters < AUTO_RECOMPUTE_PARAMS and caches(gen.model):
            gen.compare_with_recompute()
        if gen.stopped:
            return RunEnd("warning", f"Stopped: {gen.stopped}")
        if on_step is not None:
            on_step(done)
    return None


# -- what if -------------------------------------------------------------------------------------------
def all_heads(n_layer: int, n_head: int, layers: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Every (layer, head), layer by layer — of ``layers`` only where given (a hybrid model's attention layers):
    the options of a head picker."""
    return [(layer, head) for layer in (range(n_layer) if layers is None else layers) for head in range(n_head)]


def head_label(head: tuple[int, int]) -> str:
    return f"L{head[0]} H{head[1]}"


def head_ablations(heads: Sequence[tuple[int, int]], how: str) -> list[Intervention]:
    """Switch off each (layer, head)'s output O_h (``how``: "zero" or "mean")."""
    return [ablate(act_name("z", layer), head=head, how=how) for layer, head in heads]


def loss_probe(model, tokenizer, prompt_tokens: Sequence[int] | None) -> tuple[list[int], int, str]:
    """(token ids, first scored position, what they are) to measure a loss on: the prompt's tokens when
    given, else a random sequence repeated twice — on which only induction predicts the second half."""
    if prompt_tokens is not None:
        return list(prompt_tokens), 1, "the prompt (sequence 0)"
    half = min(50, (model.config.n_ctx - 1) // 2)
    ids = repeated_random_tokens(model.config.vocab_size, half, 1, seed=7, prefix=first_token(tokenizer))[0].tolist()
    return ids, len(ids) - half + 1, f"the second half of a random {half}-token sequence repeated twice"


def ablation_run(gen: TracedGeneration, step: int, model, interventions: Sequence[Intervention],
                 on_prompt: bool) -> AblationResult:
    """Step ``step`` replayed with ``interventions`` and the loss on a probe text with and without them; the
    generation itself is not changed."""
    ids, start, what = loss_probe(model, gen.tokenizer, gen.info.prompt_tokens[0] if on_prompt else None)
    result = replay(gen, step, interventions)
    before = text_loss(model, ids, start=start)
    after = text_loss(model, ids, interventions, start=start)
    return AblationResult(step, tuple(i.describe() for i in interventions), result, what, before, after,
                          tuple(pattern_changes(gen, result)))


def patching_run(model, tokenizer, clean: str, corrupted: str, kind: str,
                 progress: Callable[[float], None] | None = None) -> PatchingRun:
    """Activation patching of ``clean`` into ``corrupted`` (``kind``: "resid_pre" or "z"), with the labels
    of its columns: the clean prompt's positions, or the heads."""
    clean_ids = tokenizer.encode(clean)
    result = activation_patching(model, clean_ids, tokenizer.encode(corrupted), kind, progress=progress)
    labels = tuple(f"{i} · {tokenizer.token_label(t)}" for i, t in enumerate(clean_ids)) if kind == "resid_pre" \
        else tuple(f"H{h}" for h in range(model.config.n_head))
    return PatchingRun(clean, corrupted, result, labels)


# -- compare runs --------------------------------------------------------------------------------------
def rerun_and_compare(gen: TracedGeneration, trace: Trace, label: str, started_with: Settings | None, *,
                      toggle_cache: bool = False, heads_off: Sequence[tuple[int, int]] = (),
                      how: str = "zero") -> Comparison:
    """This generation's prompt run again as far as it got — with the KV cache toggled, or with ``heads_off``
    switched off — and its record-by-record difference from ``trace``."""
    twin = TracedGeneration(gen.model, gen.tokenizer, list(gen.info.prompts),
                            use_cache=gen.use_cache != toggle_cache, capture=trace.capture, sampling=gen.sampling,
                            padding_side=gen.info.padding_side,
                            budget_bytes=started_with.budget_bytes if started_with else trace.budget_bytes,
                            interventions=head_ablations(heads_off, how))
    try:
        twin.run(max(1, gen.n_steps))
    finally:
        twin.close()
    return Comparison(label, twin.trace, diff_traces(trace, twin.trace))


def ops_module(record) -> str:
    """The module whose ops explain ``record`` ("" for the whole model): a hook point computes nothing
    itself, so for one the module that produced its tensor, its parent."""
    if record.kind != "hook":
        return record.module
    return record.module.rsplit(".", 1)[0] if "." in record.module else ""


@dataclass
class LoadedTrace:
    """A trace file the person opened: kept until they close it, shown instead of the live generation until
    they step (and again whenever they ask)."""

    trace: Trace
    file_name: str
    file_id: str


@dataclass(frozen=True)
class AblationResult:
    """A step re-run with heads switched off: what it changed."""

    step: int
    described: tuple[str, ...]  # the interventions, described
    replay: object  # tracer.Replay
    loss_text: str  # what the loss was measured on
    loss_before: float
    loss_after: float
    changes: tuple[tuple[int, int, float], ...]  # (layer, head, max |Δ weight|), largest first

    @property
    def moved(self) -> list[tuple[int, int, float]]:
        """The heads whose pattern moved by more than rounding."""
        return [c for c in self.changes if c[2] > 1e-3]


@dataclass(frozen=True)
class PatchingRun:
    clean: str
    corrupted: str
    result: PatchingResult
    labels: tuple[str, ...]  # the columns: positions (token labels) or heads


@dataclass(frozen=True)
class Comparison:
    """Another run to hold the current one against, and their record-by-record difference."""

    label: str
    trace: Trace
    frame: pd.DataFrame  # from gpt_shape_tracer.tracer.diff_traces


GRADIENTS_KEPT = 32  # backward passes kept per session: small [t, t] tensors each


class Kept:
    """Experiment results by what they were computed for (step and settings), the newest ``size`` of them: a
    result comes back when its person returns to its step and settings (a Step or another choice between
    does not throw it away). Bounded, as every result holds tensors."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._results: dict[tuple, Any] = {}

    def keep(self, key: tuple, result: Any) -> None:
        self._results.pop(key, None)
        self._results[key] = result
        while len(self._results) > self.size:
            del self._results[next(iter(self._results))]  # the oldest

    def get(self, key: tuple) -> Any:
        return self._results.get(key)

    def computed_for(self) -> list[tuple]:
        return list(self._results)

    def clear(self) -> None:
        self._results.clear()

    def __len__(self) -> int:
        return len(self._results)


@dataclass
class LiveRun:
    """The live generation and everything run on it: Reset replaces the whole of it (one assignment)."""

    generation: TracedGeneration | None = None
    started_with: Settings | None = None  # the settings the generation started with
    started_model: ModelChoice | None = None  # the model the generation started with (a new choice waits for Reset)
    query_picks: dict[tuple[int, int], int] = field(default_factory=dict)  # (step, sequence) → query row
    ablations: Kept = field(default_factory=Kept)  # (step, heads, how, loss text) → AblationResult
    patching: PatchingRun | None = None
    comparison: Comparison | None = None
    precision: CachePrecisionRun | None = None  # the cheaper-cache experiment on this generation
    beams: BeamRun | None = None  # the Decoding tab's beam search on this generation's model and prompts
    speculative: SpeculativeDecoding | None = None  # …and its speculative decoding of the first prompt
    cache_class: CacheClassRun | None = None  # the KV cache tab's run of transformers' own cache classes
    # (step, layer, head, sequence, loss) → HeadGradients, kept so that returning to a head shows it at once
    gradients: Kept = field(default_factory=lambda: Kept(GRADIENTS_KEPT))
    gradient_trace: tuple[tuple, Trace] | None = None  # (step, loss), ∂L/∂x at every hook point

    def close(self) -> None:
        if self.generation is not None:
            self.generation.close()


@dataclass
class EngineTab:
    """The Engine tab's run — continuous batching on the sidebar's model, or an opened file — and the runs-folder
    entry it is kept under (``?engine=…``; gui/runs.py). It outlives a generation's Reset only when asked."""

    view: EngineView | None = None
    run_id: str | None = None
    foreign: bool = False  # opened by its id but made by another page: its picks are not written back
    saved_view: tuple | None = None  # (engine step, picks) last written to its record


@dataclass
class AppState:
    """Everything one browser session keeps between reruns (widget values aside, which Streamlit keeps): the sidebar's
    model choice, the live run with its experiments (``live``), the Engine tab's run (``engine``), an opened file, the
    run book (the runs-folder entry the live run is kept under) and the page's own flags."""

    model: ModelChoice = DEFAULT_MODEL  # the sidebar's choice
    live: LiveRun = field(default_factory=LiveRun)
    engine: EngineTab = field(default_factory=EngineTab)
    loaded: LoadedTrace | None = None  # an opened trace file, kept until closed
    showing_file: bool = False  # whether the tabs show the file (else the live generation)
    notices: list[tuple[str, str]] = field(default_factory=list)  # (level, message) for the next rerun
    inspect_name: str | None = None  # the record the Inspector opens
    open_tabs: dict[str, str] = field(default_factory=dict)  # tabs' key → the open one, kept while none are drawn
    last_upload_id: str | None = None
    pending_head: tuple[int, int] | None = None  # a head clicked on the grid, applied before the pickers draw
    last_compare_upload_id: str | None = None
    # Held by a script run for as long as it reads or changes this state. Streamlit answers a click that comes
    # while a run is in flight by starting a new script thread at once (runner.fastReruns) and asking the old
    # one to stop at its next Streamlit call: without this lock both threads stepped one generation together,
    # and the click was lost to "step 0 is still in progress" (issue 26 item 16). Reentrant: a tab's fragment
    # takes it again inside a full run.
    run_lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    steps_owed: int = 0  # Step clicks not yet stepped: a click that interrupts a run before its step loses none
    # the run this session's generation is kept under (gui/runs.py, session/runs.py)
    run_id: str | None = None
    run_widgets: dict[str, Any] = field(default_factory=dict)  # the settings' widget values it started with
    run_foreign: bool = False  # the run was opened by its id but made by another page: a Step writes a new run
    owner_token: str | None = None  # whose runs "Recent runs" lists: the address's ?owner= (gui/runs.py)
    saved_view: tuple[int, str] | None = None  # (step, tab) last written to its record
    saved_steps: int = 0  # steps of the generation last written
    slider_moved_at: float = 0.0  # time.monotonic() of the step slider's last change (gui/header.py)
    slider_last: int = -1  # the step slider's last step when it was last drawn (gui/header.py place_the_slider)
    restoring: Any = None  # gpt_shape_tracer.session.runs.RunRecord whose steps are being run again
    runs_refused: bool = False  # the runs folder's settings were refused (said once)
    confirm_reset: bool = False  # Reset was pressed with a generation to discard: the sidebar asks first
    reset_confirmed: bool = False  # …and the person said yes
    confirm_close: bool = False  # "Close the file" was pressed: the page asks before it lets the file go

    def held_bytes(self) -> dict[str, int]:
        """What this session holds, by part, for the server's memory ledger (gui/server.py ``reserve_memory``): the
        budget its generation may fill, and the bytes its opened file, gradients trace, Engine run, Decoding
        runs and compared run keep now (the cache-classes run's logits counted with the Decoding runs), and the
        attention stages its views recomputed (``Trace.recomputed_bytes``)."""
        live = self.live
        decoding = live.beams.nbytes if live.beams is not None else 0
        if live.speculative is not None:
            decoding += sum(t.log.bytes_kept for t in (live.speculative.trace, live.speculative.draft_trace)
                            if t is not None)
        if live.cache_class is not None:
            decoding += sum(int(s.logits.numel() * s.logits.element_size()) for s in live.cache_class.steps)
        return {"generation": live.started_with.budget_bytes if live.generation is not None and live.started_with
                else 0,
                "file": self.loaded.trace.log.bytes_kept if self.loaded is not None else 0,
                "gradients": live.gradient_trace[1].log.bytes_kept if live.gradient_trace is not None else 0,
                "engine": self.engine.view.nbytes if self.engine.view is not None else 0,
                "decoding": decoding,
                # Compare runs: the file or rerun held against this run
                "comparison": live.comparison.trace.log.bytes_kept if live.comparison is not None else 0,
                # attention stages the views recomputed from Q and K, remembered beside the values budget
                "recomputed": sum(t.recomputed_bytes for t in (self.loaded.trace if self.loaded else None,
                                                               live.generation.trace if live.generation else None)
                                  if t is not None)}

    @property
    def viewing_file(self) -> bool:
        return self.loaded is not None and self.showing_file

    @property
    def viewed_trace(self) -> Trace | None:
        """The loaded file's trace while it is shown, else the live generation's once it has a step."""
        if self.viewing_file:
            assert self.loaded is not None
            return self.loaded.trace
        gen = self.live.generation
        return gen.trace if gen is not None and gen.n_steps else None

    @property
    def live_generation(self) -> TracedGeneration | None:
        """The generation the tabs may run experiments on: None while a file is on view (its trace is not it)."""
        return None if self.viewing_file else self.live.generation

    @property
    def model_changed(self) -> bool:
        """Whether the sidebar names another model than the live generation runs (it waits for Reset)."""
        return self.live.generation is not None and self.live.started_model not in (None, self.model)

    def start(self, model, tokenizer, settings: Settings) -> TracedGeneration:
        """A new generation of the chosen model with ``settings`` (the previous one is closed). The Engine tab's run
        stays: it runs the sidebar's model, not this generation, so the first Step after it must not discard it
        (Reset, asked for, does)."""
        gen = new_generation(model, tokenizer, settings)
        self.reset(keep_engine=True)
        self.live = LiveRun(generation=gen, started_with=settings, started_model=self.model)
        return gen

    def reset(self, keep_engine: bool = False) -> None:
        """Forget the generation and every per-run choice; keep the model, the tab and an opened file (and the Engine
        tab's run with ``keep_engine``: it runs the sidebar's model, not the generation, and a generation's run
        opened from the runs folder leaves the one in the address's ``?engine=`` in place)."""
        self.live.close()
        self.live = LiveRun()
        if not keep_engine:
            self.engine = EngineTab()
        self.confirm_reset = self.reset_confirmed = False

    def open_file(self, loaded: LoadedTrace) -> None:
        self.loaded = loaded
        self.show_file(True)

    def show_file(self, shown: bool) -> None:
        """Show the opened file (True) or the live generation (False); the file stays open either way."""
        if shown != self.viewing_file:
            self.live.query_picks = {}  # picks are per (step, sequence) of the trace on view
        self.showing_file = shown and self.loaded is not None

    def close_file(self) -> None:
        self.loaded = None
        self.confirm_close = False
        self.show_file(False)
