"""The Engine tab's work, without Streamlit: its form read and checked, the model it may run (transformers runs the
engine: a directory or a bundled model is loaded through transformers for it, our own GPT cannot take the paged
path), the engine run itself, and a saved run (.zip) opened. What it shows is ``figures.engine``'s."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt_shape_tracer.model import GPT, HFDecoder, TextTokenizer, load_hf, resolve_model_path
from gpt_shape_tracer.model.sources import ASSETS
from gpt_shape_tracer.session._choice import ModelChoice
from gpt_shape_tracer.session._errors import SettingsError
from gpt_shape_tracer.tracer import MAX_POOL_BYTES, EngineError, EngineRun, load_engine_run, trace_engine

MAX_APP_REQUESTS = 16
MAX_APP_PAGES = 4096
MIN_PAGE_SIZE = 4  # transformers' continuous batching refuses smaller pages (its BOUNDS)
MAX_APP_PAGE_SIZE = 256
MAX_APP_BATCH_TOKENS = 1024
MAX_APP_NEW_TOKENS = 64
ENGINE_BUDGET_BYTES = 64 * 2**20  # the attention values one app engine run keeps (the oldest steps go first)
DEFAULT_REQUESTS = ("Once upon a time, there was a little girl named Lily.\n"
                    "Once upon a time, there was a little girl who loved the sea.\n"
                    "The cat sat on the mat.")


@dataclass(frozen=True)
class EngineForm:
    """What the Engine tab was asked to run: the prompts, each one's arrival step, and the pool's sizes."""

    prompts: tuple[str, ...]
    arrivals: tuple[int, ...]
    page_size: int
    pages: int
    max_batch_tokens: int
    new_tokens: int


def parse_engine_form(requests: str, arrivals: str, page_size: int, pages: int, max_batch_tokens: int,
                      new_tokens: int) -> EngineForm:
    """The form's values checked: one prompt per line (no empty line), arrivals as engine steps separated by commas
    (empty: all at step 0; fewer than the prompts: the rest at 0). A ``SettingsError`` says what is wrong."""
    lines = [line for line in (requests or "").split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise SettingsError("no request: type one prompt per line")
    empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if empty:
        raise SettingsError(f"line {', '.join(map(str, empty))} is empty: every line is one request")
    if len(lines) > MAX_APP_REQUESTS:
        raise SettingsError(f"{len(lines)} requests: the app runs at most {MAX_APP_REQUESTS}")
    raw = [a.strip() for a in (arrivals or "").split(",") if a.strip()]
    try:
        steps = [int(a) for a in raw]
    except ValueError:
        raise SettingsError(f"arrivals {arrivals!r}: give whole engine steps separated by commas (0, 0, 3)") from None
    if len(steps) > len(lines):
        raise SettingsError(f"{len(steps)} arrivals for {len(lines)} requests: one engine step per request")
    if any(not 0 <= s <= 64 for s in steps):
        raise SettingsError(f"arrivals are engine steps 0 … 64, got {', '.join(map(str, steps))}")
    steps += [0] * (len(lines) - len(steps))
    for name, value, low, top in (("page size", page_size, MIN_PAGE_SIZE, MAX_APP_PAGE_SIZE),
                                  ("pages", pages, 1, MAX_APP_PAGES),
                                  ("max batch tokens", max_batch_tokens, 1, MAX_APP_BATCH_TOKENS),
                                  ("new tokens", new_tokens, 1, MAX_APP_NEW_TOKENS)):
        if not low <= int(value) <= top:
            raise SettingsError(f"{name} takes {low} … {top}, got {value}")
    return EngineForm(tuple(lines), tuple(steps), int(page_size), int(pages), int(max_batch_tokens), int(new_tokens))


def directory_of(choice: ModelChoice) -> Path | None:
    """The Hugging Face directory the sidebar's model was loaded from (a bundled model's is in assets/), or None."""
    if choice.kind == "bundled":
        return ASSETS / choice.where
    if choice.kind == "directory" and not choice.dry_run:
        path = resolve_model_path(choice.where)
        return path if path.is_dir() and (path / "config.json").is_file() else None
    return None


def engine_refusal(model: Any, choice: ModelChoice) -> str | None:
    """Why the sidebar's model cannot run the engine as it is loaded — trace_engine's own reason for our GPT — or
    None when it can (transformers runs it)."""
    if isinstance(model, HFDecoder):
        return None
    if isinstance(model, GPT):
        try:
            trace_engine(model, None, [[0]], page_size=1, pages=1)
        except EngineError as e:
            return str(e)
    return (f"{type(model).__name__} is your own module: continuous batching is transformers' "
            "(ContinuousBatchingManager and its paged cache), so only a model transformers runs can take it")


def engine_model(model: Any, tokenizer: TextTokenizer | None, choice: ModelChoice) -> tuple[Any, TextTokenizer | None]:
    """The model the engine runs for the sidebar's choice: the loaded one when transformers runs it, else the same
    directory loaded through transformers; an ``EngineError`` when there is none to load."""
    if isinstance(model, HFDecoder):
        return model, tokenizer
    directory = directory_of(choice)
    if directory is None:
        raise EngineError(engine_refusal(model, choice) or "this model cannot run the engine")
    twin, tok = load_hf(directory, implementation="transformers", dtype=choice.dtype, device=choice.device)
    return twin, tok or tokenizer


def engine_run(model: Any, tokenizer: TextTokenizer | None, form: EngineForm) -> EngineRun:
    """The form's requests through transformers' continuous batching, traced (greedy; stops at the tokenizer's
    end-of-sequence ids as the CLI does)."""
    eos = tuple(getattr(tokenizer, "eos_ids", ()) or ())
    return trace_engine(model, tokenizer, list(form.prompts), page_size=form.page_size, pages=form.pages,
                        max_batch_tokens=form.max_batch_tokens, max_new_tokens=form.new_tokens,
                        arrivals=list(form.arrivals), eos_token_id=eos or None, budget_bytes=ENGINE_BUDGET_BYTES)


def pool_bytes(model: Any, form: EngineForm) -> int:
    """Bytes the form's pool takes on ``model`` (2 · L · G · d_head · page_size per page), before it is built."""
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    hf = model.hf if isinstance(model, HFDecoder) else model
    config = hf.config.get_text_config()
    per_page = (2 * int(config.num_hidden_layers) * int(find_num_key_value_heads(config))
                * int(find_head_dim(config)) * hf.dtype.itemsize * form.page_size)
    return per_page * form.pages


@dataclass
class EngineView:
    """An engine run on view: made here on the sidebar's model, or opened from a saved .zip."""

    run: EngineRun
    source: str  # what ran it, as a person reads it
    texts: dict[str, str]  # request id → its generated text (empty for a file: it carries no tokenizer)

    @property
    def nbytes(self) -> int:
        return self.run.bytes_kept


def view_of(run: EngineRun, tokenizer: TextTokenizer | None, source: str) -> EngineView:
    texts = {r.request_id: tokenizer.decode(list(r.generated_ids)) for r in run.requests} if tokenizer else {}
    return EngineView(run, source, texts)


def open_engine_file(data: bytes, name: str) -> EngineView:
    """A saved engine run (``save_engine_run``'s .zip) from its bytes; a ``TraceFileError`` says why not."""
    with tempfile.NamedTemporaryFile(suffix=".zip") as f:
        f.write(data)
        f.flush()
        run = load_engine_run(f.name)
    return EngineView(run, f"the file {name}", {})


__all__ = ["DEFAULT_REQUESTS", "ENGINE_BUDGET_BYTES", "MAX_APP_BATCH_TOKENS", "MAX_APP_NEW_TOKENS", "MAX_APP_PAGES",
           "MAX_APP_PAGE_SIZE", "MAX_APP_REQUESTS", "MAX_POOL_BYTES", "MIN_PAGE_SIZE", "EngineForm", "EngineView",
           "directory_of", "engine_model", "engine_refusal", "engine_run", "open_engine_file", "parse_engine_form",
           "pool_bytes", "view_of"]


def valid_engine_picks(picks: dict, view: EngineView) -> dict:
    """The Engine tab's layer and head picks kept with a run, less any outside what ``view``'s pool has (a run file
    edited by hand, or one from a model with fewer layers): those pickers then start from their first value."""
    tops = {"engine_layer": view.run.pool.n_layer, "engine_head": view.run.pool.n_head}
    return {key: value for key, value in picks.items()
            if key not in tops or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < tops[key])}
