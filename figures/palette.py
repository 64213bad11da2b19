"""One palette, one meaning per colour, the same in every view.

* **Amount in [0, 1]** — a probability, an attention weight: the sequential
  ``AMOUNT`` scale (Viridis, dark = 0, yellow = 1), in heatmaps and as the
  background of tokens in text, always with a legend.
* **Signed value** — a score, an activation, a difference: the diverging
  ``SIGNED`` scale centred on 0 (blue below, red above).
* **Picked / chosen / new at this step** — the single ``ACCENT`` (orange), as an
  outline or a marker, never as a value.
* **Masked (−∞)** — ``MASKED`` grey: the cell holds no number.
* **Alarm** — ``ALARM`` red, for NaN and ±∞ that no mask explains, and nothing else.
"""

from __future__ import annotations

import functools
import html

import plotly.colors

AMOUNT = "Viridis"
SIGNED = "RdBu_r"
ACCENT = "#f58518"
MASKED = "#d9d9d9"
ALARM = "#d62728"
NEUTRAL = "#7a8ca3"  # bars and lines that carry no value of their own


def amount_colour(value: float) -> str:
    """The ``AMOUNT`` colour of a value in [0, 1] (clipped), as ``rgb(r, g, b)``."""
    v = min(1.0, max(0.0, float(value)))
    return plotly.colors.sample_colorscale([list(stop) for stop in _amount_scale()], [v])[0]


@functools.cache
def _amount_scale() -> tuple:
    # plotly looks a named scale up by rebuilding its table of every named scale: once is enough
    return tuple(tuple(stop) for stop in plotly.colors.get_colorscale(AMOUNT))


def text_colour(background: str) -> str:
    """Black or white, whichever reads on ``background`` (an ``rgb(...)`` string)."""
    r, g, b = (float(c) for c in background[background.index("(") + 1 : -1].split(","))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def amount_span(text: str, value: float, title: str, outline: bool = False) -> str:
    """A token (already made inert) on its ``AMOUNT`` background; ``outline`` marks it with the accent."""
    bg = amount_colour(value)
    border = f"outline: 2px solid {ACCENT}; outline-offset: 1px; " if outline else ""
    return (f"<span title='{html.escape(title, quote=True)}' style='background: {bg}; color: {text_colour(bg)}; "
            f"{border}border-radius: 3px; padding: 1px 2px; white-space: pre'>{text}</span>")


def amount_legend(what: str, extra: str = "") -> str:
    """A small horizontal legend for ``AMOUNT``: what the colour means, 0 → 1."""
    stops = ", ".join(amount_colour(v / 4) for v in range(5))
    bar = (f"<span style='display: inline-block; width: 120px; height: 10px; vertical-align: middle; "
           f"background: linear-gradient(to right, {stops}); border-radius: 2px'></span>")
    accent = (f" &nbsp; <span style='outline: 2px solid {ACCENT}; padding: 0 4px; border-radius: 3px'>"
              f"{html.escape(extra)}</span>") if extra else ""
    return (f"<div style='font-size: 0.8rem; color: #555; margin: 2px 0 8px 0'>{html.escape(what)}: 0 "
            f"{bar} 1{accent}</div>")
