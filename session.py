"""What the app's widgets mean, and what a session holds, without Streamlit.

``app.py`` reads raw widget values into ``parse_settings``; every refusal is a
``SettingsError`` whose message the app shows as it is. ``AppState`` is the one
object a browser session keeps between reruns: the live generation, the trace
file being viewed (if any) and the small choices that outlive a widget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.sampling import SamplingConfig, SamplingError
from tracer import CAPTURE_LEVELS, MAX_BATCH, MAX_RUN_STEPS, PromptError, Trace, TracedGeneration

MAX_BUDGET_MB = 8192
DEFAULT_PROMPT = "Once upon a time, there was a little girl named Lily. She had a red ball."


class SettingsError(ValueError):
    """A setting the user typed that cannot be used; the message says why."""


@dataclass(frozen=True)
class Settings:
    prompts: tuple[str, ...]
    sampling: SamplingConfig
    use_cache: bool
    capture: str
    padding_side: str
    budget_bytes: int

    def signature(self) -> tuple:
        return (self.prompts, self.sampling, self.use_cache, self.capture, self.padding_side, self.budget_bytes)


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


def parse_settings(
    prompt: str, greedy: bool, temperature: float, top_k: int, top_p: float, seed: object,
    use_cache: bool, capture: str, padding_side: str, budget_mb: float,
) -> Settings:
    prompts = split_prompts(prompt)
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
    if capture not in CAPTURE_LEVELS:
        raise SettingsError(f"capture must be one of {', '.join(CAPTURE_LEVELS)}")
    if padding_side not in ("left", "right"):
        raise SettingsError("padding must be left or right")
    if not 1 <= budget_mb <= MAX_BUDGET_MB:
        raise SettingsError(f"the value budget must be between 1 and {MAX_BUDGET_MB} MB, got {budget_mb:g}")
    return Settings(prompts, sampling, bool(use_cache), capture, padding_side, int(budget_mb * 2**20))


def parse_run_steps(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or int(raw) != raw:
        raise SettingsError(f"Run N takes a whole number of steps, got {raw!r}")
    n = int(raw)
    if not 1 <= n <= MAX_RUN_STEPS:
        raise SettingsError(f"Run N takes 1 to {MAX_RUN_STEPS} steps at a time, got {n}")
    return n


def new_generation(model, tokenizer, settings: Settings) -> TracedGeneration:
    try:
        return TracedGeneration(
            model, tokenizer, list(settings.prompts) if len(settings.prompts) > 1 else settings.prompts[0],
            use_cache=settings.use_cache, capture=settings.capture, sampling=settings.sampling,
            padding_side=settings.padding_side, budget_bytes=settings.budget_bytes,
        )
    except PromptError as e:
        raise SettingsError(str(e)) from None


@dataclass
class LoadedTrace:
    """A trace file the person opened: shown instead of the live generation until they step or reset."""

    trace: Trace
    file_name: str
    file_id: str


@dataclass(frozen=True)
class AblationResult:
    """A step re-run with heads switched off: what it changed."""

    step: int
    described: tuple[str, ...]  # the interventions, described
    replay: object  # tracer.whatif.Replay
    loss_text: str  # what the loss was measured on
    loss_before: float
    loss_after: float
    changes: tuple[tuple[int, int, float], ...]  # (layer, head, max |Δ weight|), largest first


@dataclass(frozen=True)
class PatchingRun:
    clean: str
    corrupted: str
    result: object  # tracer.whatif.PatchingResult
    labels: tuple[str, ...]  # the columns: positions (token labels) or heads


@dataclass(frozen=True)
class Comparison:
    """Another run to hold the current one against, and their record-by-record difference."""

    label: str
    trace: Trace
    frame: object  # pandas DataFrame from tracer.diff_traces


@dataclass
class AppState:
    """Everything one browser session keeps between reruns (widget values aside, which Streamlit keeps)."""

    model_key: str = "bundled:story-gpt"  # "bundled:<name>", or "dir:<dtype>:<path>"
    generation: TracedGeneration | None = None
    started_with: Settings | None = None  # the settings the generation started with
    loaded: LoadedTrace | None = None
    notices: list[tuple[str, str]] = field(default_factory=list)  # (level, message) for the next rerun
    query_picks: dict[tuple[int, int], int] = field(default_factory=dict)  # (step, sequence) → query row
    inspect_name: str | None = None  # the record the Inspector opens
    open_tab: str | None = None  # survives reruns where no tabs are drawn
    last_upload_id: str | None = None
    pending_head: tuple[int, int] | None = None  # a head clicked on the grid, applied before the pickers draw
    ablation: AblationResult | None = None
    patching: PatchingRun | None = None
    comparison: Comparison | None = None
    last_compare_upload_id: str | None = None

    @property
    def viewing_file(self) -> bool:
        return self.loaded is not None

    @property
    def viewed_trace(self) -> Trace | None:
        """The loaded file's trace, else the live generation's once it has a step."""
        if self.loaded is not None:
            return self.loaded.trace
        gen = self.generation
        return gen.trace if gen is not None and gen.n_steps else None

    def start(self, model, tokenizer, settings: Settings) -> TracedGeneration:
        """A new generation with ``settings`` (the previous one is closed)."""
        gen = new_generation(model, tokenizer, settings)
        self.reset()
        self.generation, self.started_with = gen, settings
        return gen

    def reset(self) -> None:
        """Forget the generation, the file view and every per-run choice; keep the model and the tab."""
        if self.generation is not None:
            self.generation.close()
        self.generation = None
        self.started_with = None
        self.loaded = None
        self.query_picks = {}
        self.ablation = None
        self.patching = None
        self.comparison = None

    def open_file(self, loaded: LoadedTrace) -> None:
        self.loaded = loaded
        self.query_picks = {}

    def close_file(self) -> None:
        self.loaded = None
