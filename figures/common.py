"""Helpers every view shares: token labels per step, symbolic shapes, safe text."""

from __future__ import annotations

import html
import math

import torch

from model.hook_table import dims_of, resolve, spec_for
from tracer import Trace
from tracer.records import StepInfo

HEATMAP_SCALE = "Viridis"
MAX_TICKS = 48  # beyond this many positions, axes show every k-th label


def safe_text(label: str) -> str:
    """User-controlled text (token strings) made inert for HTML and for plotly's pseudo-HTML.

    Only <, > and & are escaped: with no tag able to open, quotes are harmless in element text, and
    plotly shows ``&quot;`` literally. Never put the result inside an attribute value."""
    return html.escape(label, quote=False)


def is_greedy(trace: Trace) -> bool:
    """Whether the trace's tokens were chosen by argmax (τ = 0) rather than sampled."""
    return trace.meta.get("sampling", {}).get("temperature") == 0


def step_info(trace: Trace, step: int) -> StepInfo:
    for info in trace.steps:
        if info.step == step:
            return info
    raise KeyError(f"the trace has no step {step} (it has {trace.n_steps})")


def column_labels(trace: Trace, row: int = 0) -> list[str]:
    """Label of every column of the padded token matrix, for one batch row."""
    labels = trace.meta.get("labels")
    if labels and row < len(labels):
        return list(labels[row])
    return []


def key_labels(trace: Trace, step: int, row: int = 0) -> list[str]:
    """The t key positions of ``step``: ``"3 · the"``."""
    info = step_info(trace, step)
    labels = column_labels(trace, row)
    t = info.t if info.t > 0 else len(labels)
    return [f"{j} · {labels[j]}" if j < len(labels) else str(j) for j in range(t)]


def query_labels(trace: Trace, step: int, row: int = 0) -> list[str]:
    """The n query positions of ``step`` (the last n key positions)."""
    info = step_info(trace, step)
    keys = key_labels(trace, step, row)
    n = info.n if info.n > 0 else len(keys)
    return keys[len(keys) - n :]


def dims_for(trace: Trace, step: int) -> dict[str, int] | None:
    """Values of the legend's symbols at ``step`` (None when the trace has no model config)."""
    cfg = trace.meta.get("model_config")
    if not cfg:
        return None
    info = step_info(trace, step)
    batch = len(trace.meta.get("columns", [[0]]))

    class _Cfg:
        d_model = cfg["d_model"]
        n_head = cfg["n_head"]
        d_head = cfg["d_model"] // cfg["n_head"]
        vocab_size = cfg["vocab_size"]
        d_ff = cfg.get("d_ff", 4 * cfg["d_model"])

    dims = dims_of(_Cfg, batch, info.n, info.t)
    dims["B|1"] = batch
    return dims


def symbols(name: str, shape: tuple[int, ...], dims: dict[str, int] | None) -> list[str] | None:
    """The symbolic shape of a record, e.g. ``["B", "n", "d"]``, checked against its numbers."""
    if name.startswith("model:in[0]") or name.endswith("embed:in[0]"):
        spec_shape = ("B", "n")
    else:
        spec = spec_for(name)
        if spec is None:
            return None
        spec_shape = spec.shape
    if dims is None or len(spec_shape) != len(shape):
        return None
    out = []
    for sym, value in zip(spec_shape, shape):
        if sym == "B|1":
            out.append("B" if value == dims["B"] and value != 1 else "1")
            continue
        try:
            expected = resolve(sym, dims)
        except (KeyError, ValueError):
            return None
        if expected != value:
            return None
        out.append(sym)
    return out


def shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def shape_with_symbols(name: str, shape: tuple[int, ...], dims: dict[str, int] | None) -> str:
    """``[1, 5, 128] = [B, n, d]`` (or just the numbers when no symbol fits)."""
    sym = symbols(name, shape, dims)
    return f"{shape_text(shape)} = [{', '.join(sym)}]" if sym else shape_text(shape)


def finite_or_none(matrix: torch.Tensor) -> list[list[float | None]]:
    """A 2-D tensor as nested lists for plotly, −∞/+∞/NaN as None (drawn as gaps)."""
    m = matrix.detach().double()
    out = []
    for row in m.tolist():
        out.append([v if math.isfinite(v) else None for v in row])
    return out


def hover_values(matrix: torch.Tensor) -> list[list[str]]:
    out = []
    for row in matrix.detach().double().tolist():
        out.append([("−∞" if v < 0 else "+∞") if math.isinf(v) else ("NaN" if math.isnan(v) else f"{v:.4f}")
                    for v in row])
    return out


def tick_step(count: int) -> int:
    return max(1, math.ceil(count / MAX_TICKS))
