"""Beam search drawn from its steps (``tracer.BeamStep``): the tree of hypotheses over steps (the k that go on,
the candidates dropped or ended, the scores that decided it), the KV cache's reorder as its rows before and after,
and the sentences that say what happened — each produced from the step's own numbers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.common import safe_text
from gpt_shape_tracer.figures.palette import ACCENT, ALARM, MASKED
from gpt_shape_tracer.figures.plot import arrow_trace, figure, fitted, subplots, text_trace
from gpt_shape_tracer.tracer import BeamStep

FATE_COLOURS = {"running": ACCENT, "finished": "#2ca02c", "ended": ALARM, "dropped": MASKED}
FATE_ORDER = ("running", "finished", "ended", "dropped")  # top to bottom in the tree
FATE_WORDS = {"running": "goes on", "finished": "finished: kept among the best hypotheses",
              "ended": "ended, but scored below every kept hypothesis", "dropped": "dropped: not among the k best"}


def tree_layout(steps: Sequence[BeamStep], prompt: int = 0) -> list[dict]:
    """The nodes of one prompt's beam tree. A node is a candidate of a step: at x = step, y = its slot (the
    running beams take the first slots in the order transformers keeps them; below them, best first, the
    candidates that finished, then those that ended below the kept hypotheses, then those dropped). Its
    ``edge`` joins it to the slot its parent beam held at the step before (None at the prefill, whose
    candidates all continue the one prompt)."""
    nodes: list[dict] = []
    for s in steps:
        kept = list(zip(s.parents[prompt], s.tokens[prompt]))
        ranked = s.candidates[prompt]
        order = sorted(range(len(ranked)), key=lambda i: (FATE_ORDER.index(ranked[i].fate), i))  # noqa: B023
        slots = {i: slot for slot, i in enumerate(order)}
        for rank, c in enumerate(ranked):
            slot = kept.index((c.parent, c.token)) if c.fate == "running" else slots[rank]
            edge = (s.step - 1, c.parent, s.step, slot) if s.step > 0 else None
            nodes.append({"step": s.step, "slot": slot, "parent": c.parent, "token": c.token, "score": c.score,
                          "fate": c.fate, "rank": rank, "edge": edge})
    return nodes


@fitted
def beam_tree_figure(steps: Sequence[BeamStep], label: Callable[[int], str], prompt: int = 0,
                     shown_step: int | None = None) -> go.Figure:
    """The beam tree: each step's ranked candidates, coloured by fate, joined to the beam they continue; the
    running beams' tokens written on their nodes. ``shown_step`` is outlined."""
    nodes = tree_layout(steps, prompt)
    fig = figure()
    live = [n["edge"] for n in nodes if n["edge"] and n["fate"] in ("running", "finished")]
    faded = [n["edge"] for n in nodes if n["edge"] and n["fate"] not in ("running", "finished")]
    if faded:
        fig.add_trace(arrow_trace(faded, color="#dddddd", width=0.8))
    if live:
        fig.add_trace(arrow_trace(live, color="#9aa7b8", width=1.4))
    for fate, colour in FATE_COLOURS.items():
        mine = [n for n in nodes if n["fate"] == fate]
        if not mine:
            continue
        fig.add_trace(go.Scatter(
            x=[n["step"] for n in mine], y=[n["slot"] for n in mine], mode="markers", name=FATE_WORDS[fate],
            marker={"size": 16 if fate in ("running", "finished") else 10, "color": colour,
                    "symbol": "star" if fate == "finished" else "circle", "line": {"width": 1, "color": "#ffffff"}},
            customdata=[[safe_text(label(n["token"])), n["token"], n["score"], n["parent"], n["rank"]] for n in mine],
            hovertemplate="step %{x}, candidate %{customdata[4]}: %{customdata[0]} (id %{customdata[1]})<br>"
                          "continues beam %{customdata[3]}; running score %{customdata[2]:.3f}<extra>"
                          + FATE_WORDS[fate] + "</extra>"))
    running = [n for n in nodes if n["fate"] in ("running", "finished")]
    fig.add_trace(text_trace([n["step"] for n in running], [n["slot"] + 0.38 for n in running],
                             [safe_text(label(n["token"]))[:10] for n in running], size=10))
    if shown_step is not None:
        fig.add_vrect(x0=shown_step - 0.4, x1=shown_step + 0.4, fillcolor=ACCENT, opacity=0.08, line_width=0)
    depth = max((n["slot"] for n in nodes), default=0)
    fig.update_layout(height=max(300, 120 + 44 * (depth + 1)), title_text="the beam tree: every step's candidates, "
                      "joined to the beam they continue", legend={"orientation": "h", "y": -0.28},
                      margin={"t": 50, "l": 10, "r": 10, "b": 70})
    fig.update_xaxes(title_text="step (0: the prefill)", dtick=1)
    fig.update_yaxes(title_text="beam slot (below: candidates not kept)", autorange="reversed", dtick=1)
    return fig


def row_norms(keys: torch.Tensor, head: int = 0) -> torch.Tensor:
    """``[B·k, G, t, d_head]`` → ``[B·k, t]``: the length of each cached key row of one head (what the reorder
    figure colours, so a row copied from another beam shows as the same stripe)."""
    return keys[:, head].float().norm(dim=-1)


@fitted
def reorder_figure(step: BeamStep, head: int = 0) -> go.Figure:
    """One layer's cached keys, each beam's row of positions, before and after the step's reorder: row j after is
    row ``beam_idx[j]`` before."""
    if step.keys_before is None or step.keys_after is None:
        raise ValueError(f"step {step.step} kept no keys for the reorder (more than the snapshot allows)")
    before, after = row_norms(step.keys_before, head), row_norms(step.keys_after, head)
    rows = [f"row {j}" for j in range(before.shape[0])]
    after_rows = [f"row {j} ← {src}" for j, src in enumerate(step.beam_idx)]
    fig = subplots(rows=1, cols=2, horizontal_spacing=0.12,
                   subplot_titles=("before the reorder", "after: row j ← row beam_idx[j]"))
    top = float(max(before.max(), after.max())) if before.numel() else 1.0
    for col, (values, names) in enumerate(((before, rows), (after, after_rows)), start=1):
        fig.add_trace(go.Heatmap(z=values.tolist(), y=names, x=list(range(values.shape[1])), zmin=0, zmax=top,
                                 colorscale="Viridis", showscale=col == 2,
                                 colorbar={"title": {"text": "|k|"}, "thickness": 12},
                                 hovertemplate="%{y}, position %{x}: |k| = %{z:.3f}<extra></extra>"), row=1, col=col)
        fig.update_yaxes(autorange="reversed", row=1, col=col)
        fig.update_xaxes(title_text="position", row=1, col=col)
    fig.update_layout(height=max(240, 90 + 26 * before.shape[0]), margin={"t": 60, "l": 10, "r": 10, "b": 10},
                      title_text=f"layer {step.snapshot_layer}, head {head}: the cache's key rows per beam")
    return fig


def step_sentence(step: BeamStep, label: Callable[[int], str], prompt: int = 0) -> str:
    """What one step did for one prompt, from its numbers."""
    k = len(step.tokens[prompt])
    fates = [c.fate for c in step.candidates[prompt]]
    sources = sorted(set(step.parents[prompt]))
    moved = [j for j in range(k) if step.beam_idx[prompt * k + j] != prompt * k + j]
    what = "the prefill" if step.step == 0 else f"step {step.step}"
    parts = [f"At {what}, the {len(fates)} best of the k·V continuations were ranked: {fates.count('running')} go "
             f"on as the {k} beams"]
    if fates.count("finished"):
        parts.append(f"{fates.count('finished')} ended and joined the finished hypotheses")
    if fates.count("ended"):
        parts.append(f"{fates.count('ended')} ended below every kept hypothesis")
    if fates.count("dropped"):
        parts.append(f"{fates.count('dropped')} were dropped")
    sentence = ", ".join(parts) + "."
    if not fates.count("running"):  # every candidate ended: the running scores are transformers' −1e9 placeholders
        return sentence + (" No candidate goes on: every continuation ended (an end-of-sequence token or the last "
                           "allowed position), so the search ends here and no forward reads the cache again.")
    if step.done:
        sentence += (" The search stops after this step: transformers' early-stopping rule finds that no running "
                     "beam can beat the finished hypotheses any more.")
    if step.step == 0:
        return sentence + (f" Every beam starts from the same prompt, so the {k} beams are its {k} best next "
                           f"tokens; the cache rows are copies of one another and the reorder moves "
                           f"{len(moved)} of them.")
    if len(sources) < k:
        missing = sorted(set(range(k)) - set(sources))
        sentence += (f" The beams now continue {len(sources)} of the {k} histories ({_beams(sources)}); "
                     f"{_beams(missing)} left no continuation among the best.")
    else:
        sentence += f" Every one of the {k} histories goes on."
    if moved:
        copies = ", ".join(f"row {j} ← {step.beam_idx[prompt * k + j] - prompt * k}" for j in moved)
        sentence += f" The cache was reordered: {copies} ({len(moved)} of {k} rows copied from another beam)."
    else:
        sentence += " The cache kept every row where it was: each beam continues its own history."
    best = max(range(k), key=lambda j: step.scores[prompt][j])
    sentence += (f" Best running beam: {best}, {safe_text(label(step.tokens[prompt][best]))!r}, score "
                 f"{step.scores[prompt][best]:.3f}.")
    return sentence


def run_sentence(steps: Sequence[BeamStep], best_text: str, best_score: float, greedy_text: str | None,
                 prompt: int = 0) -> tuple[str, list[tuple[str, str]]]:
    """The beam search's takeaway for one prompt, from its steps: how many forwards, how often the cache was
    reordered and by how many rows, the best hypothesis, and whether it is what greedy decoding (one beam)
    would have said (``greedy_text``; None: not computed)."""
    if not steps:
        raise ValueError("no step has run")
    k = len(steps[0].tokens[prompt])
    moved = [sum(1 for j in range(k) if s.beam_idx[prompt * k + j] != prompt * k + j) for s in steps]
    reordered = sum(1 for m in moved if m)
    finished = sum(1 for s in steps for c in s.candidates[prompt] if c.fate == "finished")
    sentence = (f"{k} beams over {len(steps)} forward(s): the KV cache was reordered at {reordered} of them, "
                f"{sum(moved)} rows copied from one beam to another in all; {finished} hypothesis(es) entered the "
                f"finished list. The best, score {best_score:.3f}: {safe_text(best_text)!r}.")
    if greedy_text is not None:
        sentence += (" Greedy decoding says the same." if greedy_text == best_text else
                     f" Greedy decoding (one beam) says {safe_text(greedy_text)!r} instead: the best continuation "
                     "was not the one that looked best one token at a time.")
    return sentence, [("forwards", str(len(steps))), ("rows copied", str(sum(moved))),
                      ("best score", f"{best_score:.3f}")]


def _beams(ids: Sequence[int]) -> str:
    return ("beam " if len(ids) == 1 else "beams ") + ", ".join(map(str, ids))


def candidates_rows(step: BeamStep, label: Callable[[int], str], prompt: int = 0) -> list[dict]:
    """The step's ranked candidates as table rows."""
    return [{"rank": i, "continues beam": c.parent, "token": label(c.token), "id": c.token,
             "running score": round(c.score, 4), "fate": FATE_WORDS[c.fate]}
            for i, c in enumerate(step.candidates[prompt])]


__all__ = ["FATE_COLOURS", "beam_tree_figure", "candidates_rows", "reorder_figure", "row_norms", "run_sentence",
           "step_sentence", "tree_layout"]
