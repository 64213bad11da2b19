"""The engine view drawn from an engine run (``tracer.engine.EngineRun``): the page pool over engine steps with a
request's block table, the requests' timeline, the pool's memory against a padded contiguous cache of the same
requests, a request's attention over its logical positions with the page boundaries — and every sentence that
says what they show, each produced from the run's own numbers.

Words as the engine uses them (``tracer.engine._records``): a *page* holds ``page_size`` positions of K and V for
every layer; a request's *block table* lists the pages of its logical positions in order; a page *shared* by a
common prefix is read by several requests; a *cached* page is held by no request but kept for its content."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from gpt_shape_tracer.figures.palette import ACCENT, AMOUNT, NEUTRAL
from gpt_shape_tracer.figures.plot import figure, fitted, text_trace
from gpt_shape_tracer.figures.view_takeaways import Takeaway, size_text
from gpt_shape_tracer.tracer import EngineRun, EngineStep

# one colour per request (cycled), none of them the accent, the alarm red or the masked grey
REQUEST_COLOURS = ("#4c78a8", "#54a24b", "#b279a2", "#72b7b2", "#eeca3b", "#9d755d", "#ff9da6", "#2f4b7c",
                   "#8cd17d", "#a0cbe8")
CACHED_COLOUR = "#c9c9c9"  # held by no request, kept for its prefix
# the colour scale as plotly's check writes the name out: a trace given as a dict is not checked
AMOUNT_SCALE = [list(stop) for stop in go.Heatmap(colorscale=AMOUNT).colorscale]
CONTRIBUTION_COLOURS = {"prefill": "#4c78a8", "decode": "#54a24b", "recompute": "#b279a2"}


def request_colour(index: int) -> str:
    return REQUEST_COLOURS[index % len(REQUEST_COLOURS)]


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


def _ids(ids: Iterable[object]) -> str:
    return ", ".join(map(str, ids))


def _order(run: EngineRun) -> dict[str, int]:
    return {r.request_id: i for i, r in enumerate(run.requests)}


def _step(run: EngineRun, step: int) -> EngineStep:
    if not 0 <= step < len(run.steps):
        raise ValueError(f"engine step {step}: the run has steps 0 … {len(run.steps) - 1}")
    return run.steps[step]


# -- the pool ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolGrid:
    """The pool after each engine step, as the grid draws it: one row per page the run touched (in id order), one
    column per engine step. ``holders[row][col]``: the requests whose block table lists the page after the step
    (in request order); ``cached[row][col]``: held by none, kept for its content; neither: free."""

    pages: tuple[int, ...]
    steps: tuple[int, ...]
    holders: tuple[tuple[tuple[str, ...], ...], ...]
    cached: tuple[tuple[bool, ...], ...]
    untouched: int  # pages of the pool no step handed out: free throughout, not drawn
    pages_total: int

    def held(self, col: int) -> int:
        """Pages some request holds after step ``col`` (the step's ``pages_in_use``)."""
        return sum(1 for row in self.holders if row[col])

    def shared(self, col: int) -> list[tuple[int, int]]:
        """(page, requests holding it) for each page held by 2 or more after step ``col``."""
        return [(page, len(row[col])) for page, row in zip(self.pages, self.holders) if len(row[col]) > 1]

    def cached_count(self, col: int) -> int:
        return sum(1 for row in self.cached if row[col])


def pool_grid(run: EngineRun) -> PoolGrid:
    order = _order(run)
    touched: set[int] = set()
    for s in run.steps:
        touched.update(p for _, table in s.tables for p in table)
        touched.update(s.cached, s.allocated, s.freed)
        touched.update(p for r in s.requests for p in r.block_table)
    pages = tuple(sorted(touched))
    row_of = {p: i for i, p in enumerate(pages)}
    holders: list[list[tuple[str, ...]]] = [[() for _ in run.steps] for _ in pages]
    cached = [[False for _ in run.steps] for _ in pages]
    for col, s in enumerate(run.steps):
        for rid, table in sorted(s.tables, key=lambda t: order.get(t[0], len(order))):
            for p in dict.fromkeys(table):
                holders[row_of[p]][col] += (rid,)
        for p in s.cached:
            cached[row_of[p]][col] = True
    total = run.steps[0].pages_total if run.steps else run.pool.pages
    return PoolGrid(pages, tuple(s.step for s in run.steps), tuple(tuple(r) for r in holders),
                    tuple(tuple(r) for r in cached), max(0, total - len(pages)), total)


def _discrete_scale(colours: Sequence[str]) -> list[list]:
    """A colorscale that gives value i (of 0 … len-1, with zmin 0 and zmax len-1) the colour ``colours[i]``."""
    n = len(colours)
    if n == 1:
        return [[0.0, colours[0]], [1.0, colours[0]]]
    scale = []
    for i, c in enumerate(colours):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


@fitted
def pool_grid_figure(run: EngineRun, step: int | None = None, request_id: str | None = None) -> go.Figure:
    """The page pool over engine steps: x = engine step, y = page; a cell is coloured by the request holding the
    page after the step, grey when cached, empty when free; "×k" marks a page shared by k requests. ``step`` is
    outlined; ``request_id``'s pages at that step are ringed."""
    grid = pool_grid(run)
    order = _order(run)
    # value 0: cached; value i + 1: request i (its first holder when shared); NaN: free, a gap. Numpy arrays, and
    # traces given as dicts to figure(): plotly validated and deep-copied the nested lists cell by cell, 0.1 s of
    # a 32-request run's 0.13 s (bench/bench_engine_views.py)
    colours = [CACHED_COLOUR, *(request_colour(i) for i in range(len(run.requests)))]
    rows, cols = len(grid.pages), len(grid.steps)
    z = np.full((rows, cols), np.nan)
    custom = np.empty((rows, cols, 2), dtype=object)
    for r, (page, row, cached) in enumerate(zip(grid.pages, grid.holders, grid.cached)):
        custom[r, :, 0] = page
        for c, (who, kept) in enumerate(zip(row, cached)):
            if who:
                z[r, c] = order[who[0]] + 1
                custom[r, c, 1] = f"held by {', '.join(who)}" + (" (shared prefix)" if len(who) > 1 else "")
            elif kept:
                z[r, c] = 0
                custom[r, c, 1] = "cached: no request holds it; kept for its prefix"
            else:
                custom[r, c, 1] = "free"
    ys = list(range(rows))
    traces: list[dict] = [{
        "type": "heatmap", "z": z, "x": list(grid.steps), "y": ys, "zmin": 0, "zmax": len(colours) - 1,
        "colorscale": _discrete_scale(colours), "showscale": False, "xgap": 1, "ygap": 1, "customdata": custom,
        "hovertemplate": "page %{customdata[0]} after engine step %{x}: %{customdata[1]}<extra></extra>"}]
    shared = [(s, r, len(grid.holders[r][c])) for c, s in enumerate(grid.steps) for r in ys
              if len(grid.holders[r][c]) > 1]
    if shared:
        traces.append(text_trace([x for x, _, _ in shared], [y for _, y, _ in shared],
                                 [f"×{k}" for _, _, k in shared], size=9, color="#ffffff").to_plotly_json())
    legend = [(r.request_id, request_colour(i)) for i, r in enumerate(run.requests)]  # one entry per request
    if any(any(row) for row in grid.cached):
        legend.append(("cached", CACHED_COLOUR))
    traces += [{"type": "scatter", "x": [None], "y": [None], "mode": "markers", "name": name,
                "marker": {"symbol": "square", "size": 10, "color": colour}} for name, colour in legend]
    if step is not None and request_id is not None:
        table, _ = block_table_of(run, step, request_id)
        row_of = {p: i for i, p in enumerate(grid.pages)}
        ringed = [row_of[p] for p in table if p in row_of]
        if ringed:
            traces.append({"type": "scatter", "x": [step] * len(ringed), "y": ringed, "mode": "markers",
                           "name": f"{request_id}'s pages", "hoverinfo": "skip",
                           "marker": {"symbol": "square-open", "size": 14, "color": ACCENT, "line": {"width": 2}}})
    fig = figure(traces)
    if step is not None:
        fig.add_vrect(x0=step - 0.5, x1=step + 0.5, line={"color": ACCENT, "width": 2}, fillcolor=ACCENT,
                      opacity=0.12)
    height = min(900, max(260, 90 + 18 * len(ys)))
    fig.update_layout(height=height + 30, title_text="the page pool after each engine step",
                      legend={"orientation": "h", "y": -0.32}, margin={"t": 50, "l": 10, "r": 10, "b": 100})
    fig.update_xaxes(title_text="engine step", dtick=1 if len(grid.steps) <= 40 else None)
    fig.update_yaxes(title_text="page", tickvals=ys, ticktext=[str(p) for p in grid.pages], autorange="reversed")
    return fig


def pool_caption(run: EngineRun, step: int) -> str:
    """What the grid's column at ``step`` holds, and how to read the grid, from the numbers."""
    grid = pool_grid(run)
    s = _step(run, step)
    col = grid.steps.index(step)
    shared = grid.shared(col)
    held = grid.held(col)
    verb = "is" if held == 1 else "are"
    parts = [f"After engine step {step}, {_plural(held, 'page')} of the {grid.pages_total} {verb} held by requests, "
             f"{grid.cached_count(col)} cached and {s.pages_free} free."]
    if shared:
        parts.append(f"{_plural(len(shared), 'page')} ({_ids(p for p, _ in shared)}) "
                     f"{'is' if len(shared) == 1 else 'are'} read by more than one request: a common prompt prefix "
                     "stored once (×k on the cell: k requests hold it).")
    parts.append(f"Rows: the {_plural(len(grid.pages), 'page')} the run touched"
                 + (f"; the other {grid.untouched} were never handed out and stay free." if grid.untouched else ".")
                 + " Colour: the request holding the page after the step; grey: cached (no request holds it, kept "
                   "for a later prompt with the same prefix); empty: free.")
    return " ".join(parts)


# -- a block table -----------------------------------------------------------------------------------------------
def block_table_of(run: EngineRun, step: int, request_id: str) -> tuple[tuple[int, ...], str]:
    """The request's block table at ``step`` and what it is: the one held after the step, or — for a request that
    finished or was preempted at the step — the one its attention read during it ("" when it holds none)."""
    s = _step(run, step)
    held = dict(s.tables).get(request_id)
    if held:
        return held, "held"
    part = s.request(request_id)
    if part is not None:
        return part.block_table, "read"
    return (), ""


def request_length(run: EngineRun, step: int, request_id: str) -> int:
    """Logical positions of K and V the request has in its pages after ``step`` (0 when it holds none)."""
    if request_id not in dict(_step(run, step).tables):
        return 0
    for s in reversed(run.steps[:step + 1]):
        part = s.request(request_id)
        if part is not None:
            return part.length
    return 0


def block_table_rows(run: EngineRun, step: int, request_id: str) -> list[dict]:
    """The block table as rows: logical block j, the positions it holds, the physical page, who else holds it."""
    table, _ = block_table_of(run, step, request_id)
    page = run.pool.page_size
    part = _step(run, step).request(request_id)
    length = request_length(run, step, request_id) or (part.length if part else 0)
    others = {p: [rid for rid, t in _step(run, step).tables if p in t and rid != request_id] for p in table}
    rows = []
    for j, p in enumerate(table):
        stop = min(length, (j + 1) * page)
        rows.append({"logical block": j, "positions": f"{j * page} … {stop - 1}" if stop > j * page else "—",
                     "→ page": p, "filled": f"{max(0, stop - j * page)} of {page}",
                     "shared with": ", ".join(others[p]) or ""})
    return rows


def block_table_sentence(run: EngineRun, step: int, request_id: str) -> str:
    table, which = block_table_of(run, step, request_id)
    if not table:
        req = run.request(request_id)
        if req.arrival > step:
            why = f"it arrives before engine step {req.arrival}"
        elif req.finished_step is not None and req.finished_step < step:
            why = f"it finished at engine step {req.finished_step} and gave its pages back"
        elif step in req.preempted_at or any(p <= step for p in req.preempted_at):
            why = "it was preempted and waits to be scheduled again"
        else:
            why = "it waits in the queue: no page was given to it yet"
        return f"{request_id} holds no page after engine step {step}: {why}."
    page = run.pool.page_size
    part = _step(run, step).request(request_id)
    length = request_length(run, step, request_id) or (part.length if part else 0)
    when = "after" if which == "held" else "read during"
    sentence = (f"{request_id}'s block table {when} engine step {step}: logical blocks 0 … {len(table) - 1} → "
                f"pages {_ids(table)}. Position p lies in page table[p // {page}] at row p % {page}")
    if length:
        last = length - 1
        sentence += (f": its newest position, {last}, is row {last % page} of page {table[last // page]}; "
                     + (f"{_plural(len(table) * page - length, 'slot')} of its last page still empty"
                        if len(table) * page > length else "its last page is full"))
    sentence += "."
    if which == "read":
        sentence += " It ended with this step, and its pages went back to the pool."
    others = {rid: t for rid, t in _step(run, step).tables if rid != request_id}
    common = [j for j, p in enumerate(table) if any(p in t for t in others.values())]
    if common:
        with_ = sorted({rid for rid, t in others.items() if any(table[j] in t for j in common)})
        sentence += (f" Block(s) {_ids(common)} are shared with {_ids(with_)}: the same prompt prefix, stored once "
                     "and read through both tables.")
    return sentence


# -- the timeline ------------------------------------------------------------------------------------------------
def timeline_events(run: EngineRun) -> list[dict]:
    """What each request did at each engine step it was in: {request, step, what (prefill, decode or recompute),
    tokens}."""
    events = []
    for s in run.steps:
        for r in s.requests:
            what = "recompute" if r.recompute else r.contribution
            events.append({"request": r.request_id, "step": s.step, "what": what, "tokens": r.tokens,
                           "past": r.past})
    return events


@fitted
def timeline_figure(run: EngineRun, step: int | None = None) -> go.Figure:
    """One row per request: queued from its arrival (dotted), a square per engine step it was in (prefill chunks
    with their token counts, decode tokens, prefills that recompute after a preemption), a cross where it was
    preempted, a star where it finished and gave its pages back."""
    ids = [r.request_id for r in run.requests]
    y = {rid: i for i, rid in enumerate(ids)}
    events = timeline_events(run)
    # traces as dicts given to figure() at once: a go.Scatter each, checked by plotly, cost a 32-request run ~1 ms
    # a trace (bench/bench_engine_views.py)
    traces: list[dict] = []
    for r in run.requests:
        start = r.first_step if r.first_step is not None else (len(run.steps) - 1)
        if start > r.arrival:
            traces.append({"type": "scatter", "x": [r.arrival - 0.4, start - 0.4], "y": [y[r.request_id]] * 2,
                           "mode": "lines", "line": {"color": NEUTRAL, "dash": "dot", "width": 2},
                           "showlegend": False, "hoverinfo": "skip"})
    arrivals = [r for r in run.requests]
    traces.append({"type": "scatter", "x": [r.arrival - 0.4 for r in arrivals],
                   "y": [y[r.request_id] for r in arrivals], "mode": "markers", "name": "arrives",
                   "marker": {"symbol": "triangle-right", "size": 10, "color": NEUTRAL},
                   "customdata": [[r.request_id, r.arrival] for r in arrivals],
                   "hovertemplate": "%{customdata[0]} arrives before engine step %{customdata[1]}<extra></extra>"})
    words = {"prefill": "prefill chunk", "decode": "decode token", "recompute": "recompute after preemption"}
    for what, colour in CONTRIBUTION_COLOURS.items():
        mine = [e for e in events if e["what"] == what]
        if not mine:
            continue
        trace = {"type": "scatter", "x": [e["step"] for e in mine], "y": [y[e["request"]] for e in mine],
                 "mode": "markers+text" if what != "decode" else "markers", "name": words[what],
                 "textposition": "middle center", "textfont": {"size": 9, "color": "#ffffff"},
                 "marker": {"symbol": "square", "size": 16, "color": colour},
                 "customdata": [[e["request"], e["tokens"], e["past"]] for e in mine],
                 "hovertemplate": "%{customdata[0]}, engine step %{x}: " + words[what] + " of %{customdata[1]} "
                                  "token(s) at positions %{customdata[2]}…<extra></extra>"}
        if what != "decode":
            trace["text"] = [str(e["tokens"]) for e in mine]
        traces.append(trace)
    preempted = [(p, rid) for r in run.requests for rid, p in ((r.request_id, p) for p in r.preempted_at)]
    if preempted:
        traces.append({"type": "scatter", "x": [p for p, _ in preempted], "y": [y[rid] for _, rid in preempted],
                       "mode": "markers", "name": "preempted: pages taken back",
                       "marker": {"symbol": "x", "size": 13, "color": "#1a1a1a"},
                       "hovertemplate": "preempted at engine step %{x}<extra></extra>"})
    done = [r for r in run.requests if r.finished_step is not None]
    if done:
        traces.append({"type": "scatter", "x": [(r.finished_step or 0) + 0.45 for r in done],
                       "y": [y[r.request_id] for r in done], "mode": "markers", "name": "finished: pages returned",
                       "marker": {"symbol": "star", "size": 13, "color": ACCENT},
                       "customdata": [[r.request_id, r.finished_step, r.finish_reason] for r in done],
                       "hovertemplate": "%{customdata[0]} finished at engine step %{customdata[1]} "
                                        "(%{customdata[2]})<extra></extra>"})
    fig = figure(traces)
    if step is not None:
        fig.add_vrect(x0=step - 0.5, x1=step + 0.5, fillcolor=ACCENT, opacity=0.1, line_width=0)
    fig.update_layout(height=max(220, 110 + 34 * len(ids)), title_text="the requests over engine steps",
                      legend={"orientation": "h", "y": -0.3}, margin={"t": 50, "l": 10, "r": 10, "b": 80})
    fig.update_xaxes(title_text="engine step", dtick=1 if len(run.steps) <= 40 else None,
                     range=[-0.8, len(run.steps) - 0.2])
    fig.update_yaxes(tickvals=list(range(len(ids))), ticktext=ids, autorange="reversed")
    return fig


def request_sentence(run: EngineRun, request_id: str) -> str:
    """A request's life, from its records: arrival, first step, prefill chunks, decode tokens, preemptions, end."""
    r = run.request(request_id)
    parts = [e for e in timeline_events(run) if e["request"] == request_id]
    if r.first_step is None:
        return (f"{request_id} arrived before engine step {r.arrival} and was never scheduled: the run ended with it "
                "still waiting.")
    waited = r.first_step - r.arrival
    sentence = f"{request_id} arrived before engine step {r.arrival} and was first scheduled at step {r.first_step}"
    sentence += f" (it waited {_plural(waited, 'step')} for room)" if waited else ""
    first = [e for e in parts if e["what"] == "prefill"]
    sentence += (f"; its {len(r.prompt_ids)} prompt tokens went in {_plural(len(first), 'prefill chunk')} "
                 f"({_ids(e['tokens'] for e in first)} tokens)")
    if r.prefix_hit_tokens:
        sentence += f", {r.prefix_hit_tokens} of them found in the pool already (a prefix-cache hit)"
    decodes = sum(1 for e in parts if e["what"] == "decode")
    sentence += f", then {_plural(decodes, 'decode token')}."
    if r.preempted_at:
        redo = [e for e in parts if e["what"] == "recompute"]
        sentence += (f" It was preempted at step(s) {_ids(r.preempted_at)} — its pages taken back for other requests "
                     f"— and recomputed {sum(e['tokens'] for e in redo)} position(s) in "
                     f"{_plural(len(redo), 'prefill')} when it came back.")
    if r.finished_step is not None:
        pages = len(block_table_of(run, r.finished_step, request_id)[0])
        why = "its end-of-sequence token" if r.finish_reason == "eos" else f"its {r.max_new_tokens} new tokens"
        sentence += (f" It finished at step {r.finished_step} ({why}) and its {_plural(pages, 'page')} went back to "
                     "the pool.")
    return sentence


# -- memory ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryAt:
    """The pool against a padded contiguous cache of the same requests, after one engine step, in positions of K and
    V (every layer: one position is ``bytes_per_position`` bytes).

    Paged: ``paged = live − shared + slack`` — the positions its requests hold (``live``, a shared prefix counted for
    each sharer), less what sharing stores once (``shared``), plus the empty slots of pages not yet full (``slack``).
    Contiguous: ``contiguous = live + padding + reserved`` — one ``[R, G, T, d_head]`` per layer for all R requests,
    T = the longest request's full length (prompt + new tokens − 1), held for the whole run: ``padding``, rows
    shorter than the longest; ``reserved``, room for tokens not generated yet and rows of requests not arrived
    yet or finished already."""

    step: int
    live: int
    shared: int
    slack: int
    paged: int
    contiguous: int
    padding: int
    reserved: int
    bytes_per_position: int
    requests_live: int

    @property
    def paged_bytes(self) -> int:
        return self.paged * self.bytes_per_position

    @property
    def contiguous_bytes(self) -> int:
        return self.contiguous * self.bytes_per_position


def full_length(run: EngineRun, request_id: str) -> int:
    """Positions a request's K and V take at its longest (its prompt and every generated token but the last)."""
    r = run.request(request_id)
    return len(r.prompt_ids) + r.max_new_tokens - 1


def memory_at(run: EngineRun, step: int) -> MemoryAt:
    s = _step(run, step)
    page = run.pool.page_size
    lengths = {rid: request_length(run, step, rid) for rid, _ in s.tables}
    live = sum(lengths.values())
    filled: dict[int, int] = {}  # positions stored in each held page, counted once whoever reads it
    for rid, table in s.tables:
        for j, p in enumerate(table):
            filled[p] = max(filled.get(p, 0), min(page, max(0, lengths[rid] - j * page)))
    distinct = sum(filled.values())
    paged = s.pages_in_use * page
    longest = max(full_length(run, r.request_id) for r in run.requests)
    padding = sum(longest - full_length(run, r.request_id) for r in run.requests)
    contiguous = longest * len(run.requests)
    return MemoryAt(step=step, live=live, shared=live - distinct, slack=paged - distinct, paged=paged,
                    contiguous=contiguous, padding=padding, reserved=contiguous - padding - live,
                    bytes_per_position=run.pool.bytes_per_page // page, requests_live=len(lengths))


@fitted
def memory_figure(run: EngineRun, step: int | None = None) -> go.Figure:
    """Bytes of K and V over engine steps: the pages held, the positions the live requests have, a padded
    contiguous cache of the same requests, and the pool's size."""
    mem = [memory_at(run, s.step) for s in run.steps]
    xs = [m.step for m in mem]
    fig = figure([  # dicts, not go.Scatter: plotly checks these property by property (figures/plot.py)
        {"type": "scatter", "x": xs, "y": [m.contiguous_bytes for m in mem], "mode": "lines",
         "name": "padded contiguous cache", "line": {"color": NEUTRAL, "width": 2, "dash": "dash"},
         "hovertemplate": "contiguous: %{y:,} B<extra></extra>"},
        {"type": "scatter", "x": xs, "y": [m.paged_bytes for m in mem], "mode": "lines+markers", "name": "pages held",
         "line": {"color": REQUEST_COLOURS[0], "width": 3, "shape": "hv"},
         "hovertemplate": "pages held after step %{x}: %{y:,} B<extra></extra>"},
        {"type": "scatter", "x": xs, "y": [m.live * m.bytes_per_position for m in mem], "mode": "lines",
         "name": "positions the live requests have", "line": {"color": REQUEST_COLOURS[1], "width": 2, "shape": "hv"},
         "hovertemplate": "live positions after step %{x}: %{y:,} B<extra></extra>"},
        {"type": "scatter", "x": xs, "y": [run.pool.pool_bytes] * len(xs), "mode": "lines", "name": "the pool",
         "line": {"color": "#1a1a1a", "width": 1, "dash": "dot"}, "hovertemplate": "the pool: %{y:,} B<extra></extra>"},
    ])
    if step is not None:
        fig.add_vline(x=step, line={"color": ACCENT, "width": 2})
    fig.update_layout(height=320, title_text="K and V held over engine steps, every layer",
                      legend={"orientation": "h", "y": -0.3}, margin={"t": 50, "l": 10, "r": 10, "b": 80})
    fig.update_xaxes(title_text="engine step", dtick=1 if len(xs) <= 40 else None)
    fig.update_yaxes(title_text="bytes", rangemode="tozero")
    return fig


def memory_sentence(run: EngineRun, step: int) -> str:
    m = memory_at(run, step)
    page = run.pool.page_size
    pages = m.paged // page
    b = m.bytes_per_position
    if not m.requests_live:
        sentence = f"After engine step {step} no request holds a page: the pool's K and V are all free or cached."
    else:
        sentence = (f"After engine step {step} the pool holds {_plural(pages, 'page')} × {page} = {m.paged} "
                    f"positions ({size_text(m.paged_bytes)}) for the {m.live} positions of K and V "
                    + (f"its {m.requests_live} live requests have" if m.requests_live != 1 else
                       "its live request has"))
        why = []
        if m.shared:
            why.append(f"a shared prefix stores {m.shared} of them once for several requests")
        if m.slack:
            why.append(f"{_plural(m.slack, 'slot')} of pages not yet full {'is' if m.slack == 1 else 'are'} empty")
        sentence += (": " + " and ".join(why) + "." if why else ", exactly.")
    longest = m.contiguous // len(run.requests)
    sentence += (f" A padded contiguous cache of the same {_plural(len(run.requests), 'request')} — one "
                 f"[{len(run.requests)}, {run.pool.n_kv_head}, {longest}, {run.pool.head_dim}] per layer, every row as "
                 f"long as the longest request — would hold {m.contiguous} positions ({size_text(m.contiguous * b)}): "
                 f"{m.live} live, {m.padding} padding (rows shorter than the longest) and {m.reserved} reserved (for "
                 "tokens not generated yet, and rows of requests not arrived yet or finished already).")
    if m.paged:
        sentence += f" That is ×{m.contiguous / m.paged:.1f} the pages held."
    return sentence


# -- attention ---------------------------------------------------------------------------------------------------
@fitted
def attention_figure(run: EngineRun, step: int, request_id: str, layer: int, head: int = 0) -> go.Figure:
    """The request's attention at one layer and head of an engine step: its query rows over its own logical
    positions, with a line at every page boundary and each page's id above its columns."""
    a = run.attention(step, request_id, layer)
    if a is None:
        raise ValueError(f"no attention of {request_id} at engine step {step}, layer {layer}")
    pattern = a.pattern[head].float()
    n, length = pattern.shape
    table, _ = block_table_of(run, step, request_id)
    page = run.pool.page_size
    fig = figure([{"type": "heatmap", "z": pattern.numpy(), "x": list(range(length)),
                   "y": list(range(a.past, a.past + n)), "zmin": 0, "zmax": 1, "colorscale": AMOUNT_SCALE,
                   "colorbar": {"title": {"text": "weight"}, "thickness": 12},
                   "hovertemplate": "query position %{y} → key position %{x}: %{z:.3f}<extra></extra>"}])
    # the page boundaries and the page ids set once: add_vline and add_annotation each cost ~1 ms in plotly
    boundaries = [{"type": "line", "x0": j * page - 0.5, "x1": j * page - 0.5, "xref": "x", "y0": 0, "y1": 1,
                   "yref": "y domain", "line": {"color": "#ffffff", "width": 2}}
                  for j in range(1, (length - 1) // page + 1)]
    labels = [{"x": (j * page + min(length, (j + 1) * page) - 1) / 2, "y": 1.0, "yref": "paper", "yanchor": "bottom",
               "text": f"page {table[j]}", "showarrow": False, "font": {"size": 10}}
              for j in range((length - 1) // page + 1) if j < len(table)]
    marks = {name: items for name, items in (("shapes", boundaries), ("annotations", labels)) if items}
    fig.update_layout(**marks, height=max(220, 120 + 14 * n),
                      margin={"t": 60, "l": 10, "r": 10, "b": 10},
                      title_text=f"{request_id}, engine step {step}, layer {layer}, head {head}: its attention over "
                                 "its logical positions", title_y=0.98)
    fig.update_xaxes(title_text="key position (logical)", dtick=page if length > 24 else 1)
    fig.update_yaxes(title_text="query position", autorange="reversed")
    return fig


def attention_caption(run: EngineRun, step: int, request_id: str, layer: int) -> str:
    a = run.attention(step, request_id, layer)
    part = _step(run, step).request(request_id)
    if part is None:
        return f"{request_id} is not in engine step {step}: it computed no attention there."
    if a is None:
        return (f"The attention values of {request_id} at engine step {step} were not kept: "
                + ("; ".join(run.notes) if run.notes else "no values were recorded") + ".")
    table, _ = block_table_of(run, step, request_id)
    page = run.pool.page_size
    n, length = a.pattern.shape[1], a.pattern.shape[2]
    pages = table[:(length - 1) // page + 1]
    kind = "a prefill chunk" if part.contribution == "prefill" else "one decode token"
    return (f"{request_id} brings {kind} at engine step {step}: {_plural(n, 'query row')} (positions {a.past} … "
            f"{a.past + n - 1}) over its {length} logical positions, which lie in "
            f"{_plural(len(pages), 'page')} ({_ids(pages)}; a white line every {page} positions). Its K and V were "
            "gathered from those pages through its block table: the pattern is over logical positions, whatever "
            "page holds them, and equals a single-sequence run's at the same positions.")


# -- takeaways ---------------------------------------------------------------------------------------------------
def run_takeaway(run: EngineRun) -> Takeaway:
    """The run in one line: requests, engine steps, the pool at its fullest, sharing, preemptions, and the padded
    contiguous cache it is held against."""
    if not run.steps:
        return Takeaway(f"{_plural(len(run.requests), 'request')}, no engine step ran.")
    mem = [memory_at(run, s.step) for s in run.steps]
    peak = max(s.pages_in_use for s in run.steps)
    at = next(s.step for s in run.steps if s.pages_in_use == peak)
    shared_pages = {p for s in run.steps for p, _ in s.shared}
    preemptions = sum(len(s.preempted) for s in run.steps)
    total = run.pool.pages
    sentence = (f"{_plural(len(run.requests), 'request')} in {_plural(len(run.steps), 'engine step')} on a pool of "
                f"{total} pages of {run.pool.page_size} positions: at most {peak} pages ({peak / total:.0%}) were "
                f"held at once (after step {at}), ")
    sentence += (f"{_plural(len(shared_pages), 'page')} were shared by a common prefix, " if shared_pages else
                 "no page was shared, ")
    sentence += (f"{_plural(preemptions, 'preemption')} (a request lost its pages when the pool ran out)."
                 if preemptions else "no request was preempted.")
    peak_bytes = peak * run.pool.bytes_per_page
    if peak_bytes:
        sentence += (f" A padded contiguous cache of the same requests would hold "
                     f"{size_text(mem[0].contiguous_bytes)}, ×{mem[0].contiguous_bytes / peak_bytes:.1f} the pages "
                     "held at their peak.")
    return Takeaway(sentence, (("engine steps", str(len(run.steps))), ("peak pages held", f"{peak} of {total}"),
                               ("shared pages", str(len(shared_pages))), ("preemptions", str(preemptions))))


def step_sentence(run: EngineRun, step: int) -> str:
    """What one engine step ran and what it did to the pool."""
    s = _step(run, step)
    if not s.requests:
        pending = [r for r in run.requests
                   if r.arrival <= step and (r.finished_step is None or r.finished_step > step)]
        later = sorted((r for r in run.requests if r.arrival > step), key=lambda r: r.arrival)
        if pending:
            why = f"{_ids(r.request_id for r in pending)} wait(s), but no page could be given to them"
        elif later:
            why = f"no request had arrived yet (next: {later[0].request_id}, before step {later[0].arrival})"
        else:
            why = "no request was left to run"
        return f"Engine step {step} ran nothing: {why}. The pool holds {s.pages_in_use} of {s.pages_total} pages."
    prefill = [r for r in s.requests if r.contribution == "prefill"]
    decode = [r for r in s.requests if r.contribution == "decode"]
    bits = []
    for r in prefill:
        what = "recomputing after its preemption" if r.recompute else (
            f"positions {r.past} … {r.past + r.tokens - 1}")
        bits.append(f"a prefill chunk of {r.tokens} for {r.request_id} ({what})")
    if decode:
        bits.append(f"{_plural(len(decode), 'decode token')} ({_ids(r.request_id for r in decode)})")
    sentence = (f"Engine step {step} ran {_plural(s.query_tokens, 'query token')} (of {run.pool.max_batch_tokens} "
                "allowed) in one forward: " + "; ".join(bits) + ".")
    if s.arrived:
        sentence += f" Arrived before it: {_ids(s.arrived)}."
    sentence += (f" It took {_plural(len(s.allocated), 'page')} from the free pool and gave "
                 f"{len(s.freed)} back; the pool now holds {s.pages_in_use} of {s.pages_total} pages")
    sentence += f", {len(s.shared)} of them shared" if s.shared else ""
    sentence += f", {s.pages_free} free."
    if s.preempted:
        sentence += (f" Preempted: {_ids(s.preempted)} — the pool ran out, so its pages were taken back and it "
                     "waits to be recomputed.")
    if s.finished:
        sentence += f" Finished: {_ids(s.finished)}, whose pages went back."
    return sentence


__all__ = ["CACHED_COLOUR", "CONTRIBUTION_COLOURS", "REQUEST_COLOURS", "MemoryAt", "PoolGrid", "attention_caption",
           "attention_figure", "block_table_of", "block_table_rows", "block_table_sentence", "full_length",
           "memory_at", "memory_figure", "memory_sentence", "pool_caption", "pool_grid", "pool_grid_figure",
           "request_colour", "request_length", "request_sentence", "run_takeaway", "step_sentence",
           "timeline_events", "timeline_figure"]
