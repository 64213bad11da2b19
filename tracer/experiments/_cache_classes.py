"""Every cache class transformers has, one greedy step at a time: ``cache_class_run(model, tokenizer, prompt,
cache, steps)``.

A model transformers runs (an ``HFDecoder``: ``model.hf``) decodes the prompt greedily with transformers' own cache
class for the choice, built as ``generate()`` builds it (transformers/generation/utils.py,
``_prepare_cache_for_generation``):

- ``"dynamic"``: ``DynamicCache()``, every layer a ``DynamicLayer`` that keeps every row (on a model without
  sliding layers, what ``generate(cache_implementation="dynamic")`` runs; on one with them, generate's dynamic
  cache is the sliding one below);
- ``"static"``: ``StaticCache(config=…, max_cache_len=…)``: ``StaticLayer``\\ s reserve ``max_cache_len`` rows up
  front (generate's length: prompt + steps − 1) and fill them; a sliding layer is a ``StaticSlidingWindowLayer``
  that reserves the window and, once full, overwrites its oldest slot (``generate(cache_implementation="static")``);
- ``"sliding"``: ``DynamicCache(config=…)`` on a model whose config has sliding layers: ``DynamicSlidingWindowLayer``
  keeps the last ``sliding_window − 1`` rows and drops the older ones (``generate()``'s default cache there);
- ``"quantized-fp8"``: ``QuantizedCache(backend="fp8", config=…)``: ``Fp8QuantizedLayer`` stores K and V as
  float8_e4m3fn with one scale per tensor, frozen at the prefill (``generate(cache_implementation="quantized",
  cache_config={"backend": "fp8"})``; full-attention models only, as transformers says);
- ``"offloaded"``: ``DynamicCache(config=…, offloading=True)``: after its update each layer's rows go to the CPU
  and come back before its next use (``generate(cache_implementation="offloaded")``). transformers moves them on
  CUDA streams, so this needs a CUDA model; on a model that runs on the CPU the rows already live in CPU memory:
  the run is the dynamic cache, no row moves, and the run's ``note`` says so.

Beside it, in the same loop, a full-precision ``DynamicCache()`` is fed the same tokens (the reference): each step
records |Δ logits| against it, and for fp8 the dequantization error of every stored row against the reference's
row. Each step records, per layer, what the layer holds (``LayerHolding``) and what the step did to the cache as
``CacheEvent``\\ s (grow, drop, overwrite, quantize, move): the same events beam search and speculative decoding
record, so one view reads them all. Batch 1, no sampling, no logits processor (a bare config's greedy ``generate``
runs none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from gpt_shape_tracer.model.sources import HFDecoder, TextTokenizer, input_device_of
from gpt_shape_tracer.tracer.generation import CacheEvent

CacheClass = Literal["dynamic", "static", "sliding", "quantized-fp8", "offloaded"]
CACHE_CLASSES: tuple[str, ...] = ("dynamic", "static", "sliding", "quantized-fp8", "offloaded")
MAX_CACHE_STEPS = 256
# what generate() is called with to run the same class (None: generate's default cache, DynamicCache(config))
GENERATE_SETTINGS: dict[str, dict[str, Any]] = {
    "dynamic": {"cache_implementation": "dynamic"},
    "static": {"cache_implementation": "static"},
    "sliding": {},
    "quantized-fp8": {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}},
    "offloaded": {"cache_implementation": "offloaded"},
}


class CacheClassError(ValueError):
    """A cache class this model cannot run, or settings it cannot run with (said with the reason)."""


@dataclass(frozen=True)
class LayerHolding:
    """What one layer of the cache holds after a step's forward.

    ``kind``: transformers' layer class; ``keys_shape`` / ``values_shape`` and ``dtype``: the stored tensors
    (fp8: the 8-bit ones); ``nbytes``: K and V as stored (fp8: plus its two float32 scales; static: every reserved
    slot); ``seen``: positions the layer has been given so far; ``held``: positions whose rows it holds now, the
    positions ``first_held … seen − 1``; ``reserved``: rows allocated (static: ``max_cache_len`` or the window;
    otherwise ``held``); ``device``: where its rows live between uses; ``row_error``: fp8 only, per held position,
    max |dequantized − full precision| over K and V (else empty; NaN where the row read back as NaN);
    ``overflowed``: fp8 only, the positions whose full-precision K or V exceed the range the scale frozen at the
    prefill gives (|x| > 448 · scale): the cast clips them to ±448 · scale on the CPU and makes them NaN on CUDA."""

    layer: int
    kind: str
    keys_shape: tuple[int, ...]
    values_shape: tuple[int, ...]
    dtype: str
    nbytes: int
    seen: int
    held: int
    reserved: int
    first_held: int
    device: str
    row_error: tuple[float, ...] = ()
    overflowed: tuple[int, ...] = ()

    @property
    def free(self) -> int:
        """Reserved rows not (yet) holding a position."""
        return self.reserved - self.held


@dataclass(frozen=True)
class CacheClassStep:
    """One greedy step: the forward of ``fed`` positions (the prompt at step 0, then the previous token), the
    token chosen (``token``), its last row of ``logits`` ``[V]``, the reference's (a full-precision dynamic cache
    fed the same tokens) argmax ``reference_token`` and ``max_abs_delta`` = max |logits − reference's|, what each
    layer holds after it, the cache events of the step and the reference cache's bytes."""

    step: int
    fed: int
    token: int
    logits: torch.Tensor
    reference_token: int
    max_abs_delta: float
    layers: tuple[LayerHolding, ...]
    events: tuple[CacheEvent, ...]
    reference_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.layers)


@dataclass(frozen=True)
class CacheClassRun:
    """A greedy run with one of transformers' cache classes: ``cache`` (the choice), ``class_name`` (the Cache
    class transformers built), the prompt's ids and the generated ones, its steps, the ``generate()`` settings that
    run the same class (``generate_settings``; generate's default where the choice ran as the dynamic cache), the
    model's compute device, the rows a static cache reserved, and a ``note`` (where the choice ran as something
    else, why; else empty)."""

    cache: str
    class_name: str
    prompt_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    steps: tuple[CacheClassStep, ...]
    generate_settings: dict[str, Any]
    device: str
    max_cache_len: int | None
    note: str = ""

    @property
    def n_layer(self) -> int:
        return len(self.steps[0].layers) if self.steps else 0

    @property
    def events(self) -> tuple[CacheEvent, ...]:
        return tuple(e for s in self.steps for e in s.events)

    def kinds(self) -> tuple[str, ...]:
        """The layer classes, layer by layer."""
        return tuple(h.kind for h in self.steps[-1].layers) if self.steps else ()


def _text_config(hf: torch.nn.Module) -> Any:
    return hf.config.get_text_config(decoder=True)  # type: ignore[union-attr, operator]


def _has_sliding_layers(hf: torch.nn.Module) -> bool:
    from transformers import DynamicCache

    return any(getattr(layer, "is_sliding", False) for layer in DynamicCache(config=_text_config(hf)).layers)


def build_cache(hf: torch.nn.Module, cache: str, max_cache_len: int) -> tuple[Any, str]:
    """transformers' own cache object for ``cache`` on ``hf`` (as generate() builds it), and a note where the
    choice runs as something else here."""
    from transformers import DynamicCache, QuantizedCache, StaticCache

    config = _text_config(hf)
    if cache == "dynamic":
        return DynamicCache(), ""
    if cache == "static":
        return StaticCache(config=config, max_cache_len=max_cache_len), ""
    if cache == "sliding":
        if not _has_sliding_layers(hf):
            raise CacheClassError(f"this model ({config.model_type}) has no sliding-window layer: its config sets no "
                                  "sliding_window for any layer, so a sliding cache would be the dynamic one")
        return DynamicCache(config=config), ""
    if cache == "quantized-fp8":
        try:
            return QuantizedCache(backend="fp8", config=config), ""
        except ValueError as e:
            raise CacheClassError(f"transformers' fp8 cache refuses this model: {e}") from e
    if cache == "offloaded":
        if input_device_of(hf).type != "cuda":
            return DynamicCache(config=config), (
                "The model runs on the CPU: transformers offloads on CUDA streams, and a CPU model's rows already "
                "live in CPU memory, so this ran as the dynamic cache and no row moved. On a CUDA model each layer's "
                "rows go to the CPU after its update.")
        return DynamicCache(config=config, offloading=True), ""
    raise CacheClassError(f"cache must be one of {CACHE_CLASSES}, got {cache!r}")


def _device(t: torch.Tensor | None) -> str:
    return str(t.device) if t is not None else "none"


def _holding(index: int, layer: Any, reference: Any | None) -> LayerHolding:
    """What transformers' cache layer ``layer`` holds now (``reference``: the full-precision layer, for fp8)."""
    from transformers.cache_utils import (
        BaseQuantizedLayer,
        DynamicSlidingWindowLayer,
        StaticLayer,
        StaticSlidingWindowLayer,
    )

    kind = type(layer).__name__
    if not getattr(layer, "is_initialized", False):
        return LayerHolding(index, kind, (), (), "none", 0, 0, 0, 0, 0, "none")
    if isinstance(layer, BaseQuantizedLayer):
        (qk, sk), (qv, sv) = layer._quantized_keys, layer._quantized_values
        held = int(qk.shape[-2])
        errors: tuple[float, ...] = ()
        overflowed: tuple[int, ...] = ()
        seen = int(layer.cumulative_length)
        if reference is not None and getattr(reference, "is_initialized", False):
            ref_k, ref_v = reference.keys.float()[..., -held:, :], reference.values.float()[..., -held:, :]
            dk = (layer._dequantize((qk, sk)).float() - ref_k).abs()
            dv = (layer._dequantize((qv, sv)).float() - ref_v).abs()
            per_row = torch.maximum(dk.amax(dim=(0, 1, 3)), dv.amax(dim=(0, 1, 3)))  # [held]; NaN stays NaN
            errors = tuple(float(x) for x in per_row)
            top = float(torch.finfo(qk.dtype).max)  # 448 for float8_e4m3fn, the largest the cast keeps
            over = ((ref_k.abs().amax(dim=(0, 1, 3)) > top * sk.float())
                    | (ref_v.abs().amax(dim=(0, 1, 3)) > top * sv.float()))
            overflowed = tuple(seen - held + int(i) for i in torch.nonzero(over.cpu()).flatten())
        nbytes = qk.nbytes + qv.nbytes + torch.as_tensor(sk).nbytes + torch.as_tensor(sv).nbytes
        return LayerHolding(index, kind, tuple(qk.shape), tuple(qv.shape), str(qk.dtype).replace("torch.", ""),
                            nbytes, seen, held, held, seen - held, _device(qk), errors, overflowed)
    keys, values = layer.keys, layer.values
    nbytes = keys.nbytes + values.nbytes
    shape_k, shape_v, dtype = tuple(keys.shape), tuple(values.shape), str(keys.dtype).replace("torch.", "")
    if isinstance(layer, StaticSlidingWindowLayer):
        seen, reserved = int(layer.cumulative_length_int), int(layer.max_cache_len)
        held = min(seen, reserved)
    elif isinstance(layer, StaticLayer):
        reserved = int(layer.max_cache_len)
        seen = held = int(layer.cumulative_length)
    elif isinstance(layer, DynamicSlidingWindowLayer):
        seen, held = int(layer.cumulative_length), int(keys.shape[-2])
        reserved = held
    else:
        seen = held = reserved = int(keys.shape[-2])
    return LayerHolding(index, kind, shape_k, shape_v, dtype, nbytes, seen, held, reserved, seen - held,
                        _device(keys))


def _events(step: int, before: tuple[LayerHolding, ...], after: tuple[LayerHolding, ...], compute: str,
            scales: list[str]) -> tuple[CacheEvent, ...]:
    """What the step did to the cache, from each layer's holding before and after it."""
    events = [CacheEvent.grow(step, before[0].seen, after[0].seen)] if after and before else []
    per_layer: list[CacheEvent] = []
    for b, a in zip(before, after):
        kept_before = range(b.first_held, b.seen)
        gone = tuple(p for p in kept_before if p < a.first_held)  # held before, not now
        never = tuple(range(max(b.seen, b.first_held), min(a.first_held, a.seen)))  # arrived past the window
        if gone:
            kind = "overwrite" if a.kind.startswith("Static") else "drop"
            per_layer.append(CacheEvent(kind, step, b.held, a.held, gone, layer=a.layer))
        if never:
            per_layer.append(CacheEvent("drop", step, b.held, a.held, never, layer=a.layer,
                                        detail="never kept: outside the window when it arrived"))
        if a.row_error:
            per_layer.append(CacheEvent("quantize", step, b.held, a.held, tuple(range(b.seen, a.seen)),
                                        layer=a.layer, detail=scales[a.layer]))
        if a.device not in ("none", compute):
            per_layer.append(CacheEvent("move", step, a.held, a.held, (), layer=a.layer,
                                        detail=f"{compute} → {a.device} after its update, back before its next use"))
    # one event for all layers where every layer did the same
    by_kind: dict[tuple, list[CacheEvent]] = {}
    for e in per_layer:
        by_kind.setdefault((e.kind, e.rows_before, e.rows_after, e.indices, e.detail), []).append(e)
    for (kind, rb, ra, idx, detail), group in by_kind.items():
        if len(group) == len(after) > 1:
            events.append(CacheEvent(kind, step, rb, ra, idx, layer=None, detail=detail))
        else:
            events.extend(group)
    return tuple(events)


def _scale_words(layer: Any) -> str:
    from transformers.cache_utils import BaseQuantizedLayer

    if not isinstance(layer, BaseQuantizedLayer) or layer._quantized_keys is None:
        return ""
    (qk, sk), (_, sv) = layer._quantized_keys, layer._quantized_values
    return f"{str(qk.dtype).replace('torch.', '')}, one scale per tensor: K × {float(sk):.3g}, V × {float(sv):.3g}"


def _cache_bytes(cache: Any) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers
               if getattr(layer, "is_initialized", False))


@torch.no_grad()
def cache_class_run(model: torch.nn.Module, tokenizer: TextTokenizer, prompt: str, cache: CacheClass | str,
                    steps: int = 8, max_cache_len: int | None = None) -> CacheClassRun:
    """Decode ``prompt`` greedily ``steps`` tokens with transformers' own ``cache`` class (``CACHE_CLASSES``) on a
    model transformers runs, recording what the cache holds and does at every step, beside a full-precision
    dynamic cache fed the same tokens. ``max_cache_len`` (static only): rows reserved, by default generate's
    prompt + steps − 1. Raises ``CacheClassError`` for our own GPT (its cache is ours: model/gpt/_cache.py), a
    class the model cannot run, or settings out of range."""
    if not isinstance(model, HFDecoder):
        raise CacheClassError(f"{type(model).__name__} runs our own forward and our own KV cache "
                              "(model/gpt/_cache.py), not transformers' cache classes: load the directory with "
                              "implementation='transformers' to run them")
    if cache not in CACHE_CLASSES:
        raise CacheClassError(f"cache must be one of {CACHE_CLASSES}, got {cache!r}")
    if not getattr(model.new_cache(), "rows_by_position", True):  # model/sources/_hf_compressed.py
        raise CacheClassError(f"this model ({model.architecture.model_type}) compresses its keys and values in cache "
                              "layers of its own (DeepSeek-V4), which none of transformers' shared cache classes "
                              "keeps: its cache is shown under Over the steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_CACHE_STEPS:
        raise CacheClassError(f"steps must be a whole number from 1 to {MAX_CACHE_STEPS}, got {steps!r}")
    hf = cast(torch.nn.Module, model.hf)
    ids = [int(i) for i in tokenizer.encode(prompt)]
    if not ids:
        raise CacheClassError("the prompt has no tokens")
    needed = len(ids) + steps - 1
    if max_cache_len is not None and cache != "static":
        raise CacheClassError("max_cache_len is a static cache's setting (the rows it reserves)")
    length = needed if max_cache_len is None else int(max_cache_len)
    if length < needed:
        raise CacheClassError(f"max_cache_len {length} is shorter than the {len(ids)} prompt tokens + {steps - 1} "
                              f"fed back = {needed} positions the run writes")
    from transformers import DynamicCache

    built, note = build_cache(hf, cache, length)
    reference = DynamicCache()
    device = input_device_of(hf)
    compute = str(device)
    fed = torch.tensor([ids], device=device)
    holdings = tuple(_holding(i, layer, None) for i, layer in enumerate(built.layers))
    records: list[CacheClassStep] = []
    tokens: list[int] = []
    for step in range(steps):
        logits = hf(input_ids=fed, past_key_values=built, use_cache=True).logits[0, -1].float()
        ref_logits = hf(input_ids=fed, past_key_values=reference, use_cache=True).logits[0, -1].float()
        token = int(logits.argmax())
        refs = list(reference.layers) + [None] * max(0, len(built.layers) - len(reference.layers))
        after = tuple(_holding(i, layer, refs[i] if cache == "quantized-fp8" else None)
                      for i, layer in enumerate(built.layers))
        if len(holdings) != len(after):  # a cache that makes its layers as they are first used: empty before
            holdings = tuple(_holding(i, None, None) for i in range(len(after)))
        scales = [_scale_words(layer) for layer in built.layers]
        events = _events(step, holdings, after, compute, scales)
        records.append(CacheClassStep(step, int(fed.shape[1]), token, logits.cpu(), int(ref_logits.argmax()),
                                      float((logits - ref_logits).abs().max()), after, events,
                                      _cache_bytes(reference)))
        tokens.append(token)
        holdings = after
        fed = torch.tensor([[token]], device=device)
    return CacheClassRun(cache, type(built).__name__, tuple(ids), tuple(tokens), tuple(records),
                         {} if note else dict(GENERATE_SETTINGS[cache]), compute,
                         length if cache == "static" else None, note)
