"""Speculative (assisted) decoding drawn from its steps (``tracer.SpeculativeStep``): which drafted token the main
model accepted or rejected at each step, the main cache's length before the verify forward, after it and after the
crop, and the sentences that say what happened — the acceptance rate and the main-model forwards saved — each
produced from the steps' own numbers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import plotly.graph_objects as go

from gpt_shape_tracer.figures.common import safe_text
from gpt_shape_tracer.figures.palette import ACCENT, ALARM, MASKED, NEUTRAL
from gpt_shape_tracer.figures.plot import figure, fitted, text_trace
from gpt_shape_tracer.tracer import SpeculativeStep

FATE_COLOURS = {"accepted": "#2ca02c", "rejected": ALARM, "unchecked": MASKED, "cut": NEUTRAL, "bonus": ACCENT}
FATE_WORDS = {"accepted": "accepted: the main model would have chosen it",
              "rejected": "rejected: the main model chose another token here",
              "unchecked": "discarded: after a rejected draft", "cut": "matched, but past the length or an end token",
              "bonus": "the main model's own token after the accepted drafts"}


def token_cells(steps: Sequence[SpeculativeStep]) -> list[dict]:
    """One cell per drafted token (x = step, y = its place in the draft, its fate), and per step one "bonus" cell
    at y = accepted: the token the verify forward chose there — beside the rejected draft it replaces (x = step +
    0.3), or below the last draft when every draft was accepted."""
    cells = []
    for s in steps:
        for i, (token, fate) in enumerate(zip(s.draft_tokens, s.fates)):
            cells.append({"step": s.step, "x": s.step, "place": i, "token": token, "fate": fate,
                          "main": s.choices[i] if i < len(s.choices) else None})
        beside = s.accepted < len(s.draft_tokens)
        cells.append({"step": s.step, "x": s.step + 0.3 if beside else s.step, "place": s.accepted,
                      "token": s.bonus, "fate": "bonus", "main": s.bonus})
    return cells


@fitted
def acceptance_figure(steps: Sequence[SpeculativeStep], label: Callable[[int], str]) -> go.Figure:
    """Each step's drafts, coloured by fate (accepted, rejected, discarded after a rejection, cut), with the bonus
    token marked where it goes; each token's text written on it."""
    cells = token_cells(steps)
    fig = figure()
    for fate, colour in FATE_COLOURS.items():
        mine = [c for c in cells if c["fate"] == fate]
        if not mine:
            continue
        fig.add_trace(go.Scatter(
            x=[c["x"] for c in mine], y=[c["place"] for c in mine], mode="markers", name=FATE_WORDS[fate],
            marker={"size": 16, "color": colour, "symbol": "star" if fate == "bonus" else "square",
                    "line": {"width": 1, "color": "#ffffff"}},
            customdata=[[safe_text(label(c["token"])), c["token"],
                         safe_text(label(c["main"])) if c["main"] is not None else "—"] for c in mine],
            hovertemplate="step %{x}, draft %{y}: %{customdata[0]} (id %{customdata[1]}); the main model chose "
                          "%{customdata[2]}<extra>" + FATE_WORDS[fate] + "</extra>"))
    fig.add_trace(text_trace([c["x"] for c in cells], [c["place"] + 0.38 for c in cells],
                             [safe_text(label(c["token"]))[:8] for c in cells], size=9))
    depth = max((c["place"] for c in cells), default=0)
    fig.update_layout(height=max(300, 120 + 44 * (depth + 1)), legend={"orientation": "h", "y": -0.3},
                      title_text="each step's drafts: accepted, rejected, and the main model's bonus token",
                      margin={"t": 50, "l": 10, "r": 10, "b": 80})
    fig.update_xaxes(title_text="step (one verify forward of the main model)", dtick=1)
    fig.update_yaxes(title_text="place in the draft", autorange="reversed", dtick=1)
    return fig


@fitted
def cache_figure(steps: Sequence[SpeculativeStep]) -> go.Figure:
    """The main cache's positions per step: before the verify forward, after it (the drafts' rows included) and
    after the crop (the rejected drafts' rows dropped)."""
    x = [s.step for s in steps]
    fig = figure()
    for i, (name, colour) in enumerate((("before the verify forward", MASKED), ("after it", ALARM),
                                        ("after the crop", "#2ca02c"))):
        fig.add_trace(go.Bar(x=x, y=[s.main_rows[i] for s in steps], name=name, marker_color=colour,
                             hovertemplate="step %{x}: %{y} positions " + name + "<extra></extra>"))
    fig.update_layout(barmode="group", height=300, legend={"orientation": "h", "y": -0.3},
                      title_text="the main KV cache: grown by the verify forward, cropped to the accepted prefix",
                      margin={"t": 50, "l": 10, "r": 10, "b": 80})
    fig.update_xaxes(title_text="step", dtick=1)
    fig.update_yaxes(title_text="cached positions")
    return fig


def run_numbers(steps: Sequence[SpeculativeStep]) -> dict[str, int | float]:
    """The run's totals: drafted and accepted tokens, the acceptance rate (accepted / drafted; 0 with no draft),
    tokens generated, main-model forwards (one per step) and the forwards saved (generated − forwards: what greedy
    decoding's one forward per token would have cost more), rows cropped from the main cache."""
    drafted = sum(len(s.draft_tokens) for s in steps)
    accepted = sum(s.accepted for s in steps)
    generated = sum(len(s.new_tokens) for s in steps)
    return {"drafted": drafted, "accepted": accepted, "rate": accepted / drafted if drafted else 0.0,
            "generated": generated, "forwards": len(steps), "saved": generated - len(steps),
            "cropped": sum(s.main_cropped for s in steps), "draft forwards": sum(len(s.draft_forwards) for s in steps)}


def run_sentence(steps: Sequence[SpeculativeStep], source: str) -> tuple[str, list[tuple[str, str]]]:
    """The run's takeaway: the acceptance rate, the forwards saved, the rows cropped (``source``: "assistant" or
    "prompt lookup")."""
    if not steps:
        raise ValueError("no step has run")
    n = run_numbers(steps)
    sentence = (f"{source}: {n['drafted']} token(s) drafted over {n['forwards']} step(s), {n['accepted']} accepted "
                f"(acceptance rate {n['rate']:.0%}). The main model ran {n['forwards']} forward(s) for "
                f"{n['generated']} token(s): {n['saved']} forward(s) saved against greedy decoding's one per token")
    if source == "assistant":
        sentence += f", at the cost of {n['draft forwards']} assistant forward(s)"
    sentence += f". {n['cropped']} rejected row(s) were cropped from the main cache."
    return sentence, [("acceptance rate", f"{n['rate']:.0%}"), ("forwards saved", str(n["saved"])),
                      ("rows cropped", str(n["cropped"]))]


def step_sentence(step: SpeculativeStep, label: Callable[[int], str]) -> str:
    """One step in words: what was drafted, how much was accepted, the bonus token, what the crops dropped."""
    n = len(step.draft_tokens)
    before, verified, after = step.main_rows
    if not n:
        said = f"Step {step.step}: nothing was drafted; the verify forward chose {safe_text(label(step.bonus))!r}"
    else:
        said = (f"Step {step.step}: {n} token(s) drafted, {step.accepted} accepted; the main model then chose "
                f"{safe_text(label(step.bonus))!r}")
        if step.matched < n:
            said += (f" where the draft said {safe_text(label(step.draft_tokens[step.matched]))!r}"
                     if step.accepted == step.matched else "")
    said += (f". Main cache: {before} → {verified} positions by the verify forward, cropped by {step.main_cropped} "
             f"to {after}.")
    if step.draft_cropped:
        said += f" The assistant's cache dropped {step.draft_cropped} row(s) of the last step's rejected drafts."
    if step.done:
        said += " The run ends here."
    return said


__all__ = ["FATE_COLOURS", "acceptance_figure", "cache_figure", "run_numbers", "run_sentence", "step_sentence",
           "token_cells"]
