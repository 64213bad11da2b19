"""The difference of two runs, record by record: ``diff_traces(a, b) -> DataFrame``.

One row per (step, record name) present in either trace: both shapes, the
largest absolute and relative difference where both values are kept, and
whether this is the first record (in a's call order) where the runs diverge
beyond a tolerance that follows the dtype.

Records of a step with the KV cache on hold only the new positions (n = 1 at a
decode step) while the same step without it holds all t; when two records
differ only along their n axis and the runs fed the same tokens, the shorter
is compared with the last positions of the longer — so "cache on vs off" is
compared record by record, not refused for its shapes.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from gpt_shape_tracer.tracer.reading import Trace

TOLERANCE = {"float32": (1e-5, 1e-4), "float64": (1e-9, 1e-7), "bfloat16": (1e-2, 2e-2), "float16": (1e-3, 1e-2)}
COLUMNS = ("step", "name", "shape_a", "shape_b", "compared", "max_abs_delta", "rel_delta", "tolerance", "diverged",
           "first_divergence", "note")


def tolerance(dtype: str, scale: float) -> float:
    """|Δ| above which two values of ``dtype`` with magnitudes up to ``scale`` count as different."""
    atol, rtol = TOLERANCE.get(dtype, (0.0, 0.0))
    return atol + rtol * scale


def _same_tokens(a: Trace, b: Trace, step: int) -> bool:
    return _same_tokens_by_step(a, b, step + 1)[step]


def _same_tokens_by_step(a: Trace, b: Trace, n_steps: int) -> list[bool]:
    """Per step, whether both runs fed the same token columns: the same padded prompts and, before it, the same
    choices — a prefix property, read once over the steps (not a rebuild of every step's columns, which is
    work quadratic in the step count a file claims)."""
    fa, fb = a.generation, b.generation
    if fa is None or fb is None or fa.batch_size != fb.batch_size:
        return [False] * n_steps
    same = all(fa.info.padded_prompt(r)[0] == fb.info.padded_prompt(r)[0] for r in range(fa.batch_size))
    out = []
    for step in range(n_steps):
        if step >= min(fa.n_steps, fb.n_steps):
            out.append(False)
            continue
        out.append(same)
        ca, cb = fa.steps[step].sampling, fb.steps[step].sampling  # what this step feeds the next
        if ca is None or cb is None:
            same = same and ca is cb  # a step that chose nothing feeds nothing
        else:
            same = same and tuple(ca.tokens) == tuple(cb.tokens)
    return out


def _positions_dim(ra, rb, fed: tuple[int, int] | None) -> int | None:
    """The dimension along which two records of one step hold different numbers of positions: their named n
    axis; for a record without named axes (a transformers module's inputs), the one dimension whose sizes are
    the positions each run fed at that step (1 with the cache, t without). None when the shapes do not line
    up so, or the runs did not feed the same tokens (``fed`` None)."""
    if fed is None or len(ra.shape) != len(rb.shape):
        return None
    differing = [i for i, (sa, sb) in enumerate(zip(ra.shape, rb.shape)) if sa != sb]
    if len(differing) != 1:
        return None
    d = differing[0]
    if ra.axes is not None and "n" in ra.axes:
        return d if ra.axes.index("n") == d else None
    return d if {ra.shape[d], rb.shape[d]} == set(fed) else None


def _aligned(x: torch.Tensor, y: torch.Tensor, d: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two values over the positions both hold (the last ones along ``d``), or None when they do not
    line up."""
    if x.shape == y.shape:
        return x, y
    if d is None:
        return None
    k = min(x.shape[d], y.shape[d])  # the new positions are the last ones
    return x.narrow(d, x.shape[d] - k, k), y.narrow(d, y.shape[d] - k, k)


def _fed(a: Trace, step_a: int, b: Trace, step_b: int, same_tokens: bool) -> tuple[int, int] | None:
    """(positions a fed at ``step_a``, positions b fed at ``step_b``) when both fed the same tokens, else
    None."""
    fa, fb = a.generation, b.generation
    if not same_tokens or fa is None or fb is None or step_a >= fa.n_steps or step_b >= fb.n_steps:
        return None
    return fa.steps[step_a].forward.n, fb.steps[step_b].forward.n


def aligned_values(a: Trace, b: Trace, name: str, step: int) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """Record ``name`` at ``step`` of both traces over the positions both computed, as ``diff_traces`` compares
    them, with a note saying which ("" when the shapes are equal); None when either value is missing or the
    shapes do not line up (a cached step's new rows line up with the last rows of an uncached one)."""
    if step >= a.n_steps or step >= b.n_steps:
        return None
    ra, rb = a.record(name, step), b.record(name, step)
    va, vb = a.value(ra), b.value(rb)
    if va is None or vb is None:
        return None
    if ra.shape == rb.shape:
        return va, vb, ""
    d = _positions_dim(ra, rb, _fed(a, step, b, step, _same_tokens(a, b, step)))
    pair = _aligned(va, vb, d)
    if pair is None or d is None:
        return None
    return pair[0], pair[1], f"the last {pair[0].shape[d]} position(s), which both runs computed"


def diff_traces(a: Trace, b: Trace) -> pd.DataFrame:
    """Compare every record two traces share, step by step, in a's call order (then b's extra records). The
    work is the records', not the steps': a step holding no record costs nothing."""
    n_steps = max(a.n_steps, b.n_steps)
    same = _same_tokens_by_step(a, b, n_steps)
    rows: list[dict] = []
    for step in range(n_steps):
        rows += _rows(a, step, b, step, same[step])
    return _mark_first(pd.DataFrame(rows, columns=list(COLUMNS)))


def diff_steps(a: Trace, step_a: int, b: Trace, step_b: int, same_tokens: bool = True) -> pd.DataFrame:
    """The records of step ``step_a`` of ``a`` against step ``step_b`` of ``b`` (a step replayed, say)."""
    return _mark_first(pd.DataFrame(_rows(a, step_a, b, step_b, same_tokens), columns=list(COLUMNS)))


def _rows(a: Trace, step_a: int, b: Trace, step_b: int, same_tokens: bool) -> list[dict]:
    recs_a = {r.name: r for r in a.filter(step=step_a)} if step_a < a.n_steps else {}
    recs_b = {r.name: r for r in b.filter(step=step_b)} if step_b < b.n_steps else {}
    rows = []
    for name in list(recs_a) + [n for n in recs_b if n not in recs_a]:
        ra, rb = recs_a.get(name), recs_b.get(name)
        row = {"step": step_a, "name": name, "shape_a": ra.shape if ra else None, "shape_b": rb.shape if rb else None,
               "compared": False, "max_abs_delta": math.nan, "rel_delta": math.nan, "tolerance": math.nan,
               "diverged": False, "first_divergence": False, "note": ""}
        if ra is None or rb is None:
            row["note"] = f"only in {'b' if ra is None else 'a'}"
        else:
            _compare(a, b, ra, rb, _fed(a, step_a, b, step_b, same_tokens), row)
        rows.append(row)
    return rows


def _mark_first(frame: pd.DataFrame) -> pd.DataFrame:
    frame["first_divergence"] = False
    diverged = frame.index[frame["diverged"].astype(bool)]
    if len(diverged):
        frame.loc[diverged[0], "first_divergence"] = True
    return frame


def _compare(a: Trace, b: Trace, ra, rb, fed: tuple[int, int] | None, row: dict) -> None:
    if ra.dtype != rb.dtype:
        row["note"] = f"dtypes differ ({ra.dtype} vs {rb.dtype})"
        row["diverged"] = True
        return
    va, vb = a.value(ra), b.value(rb)
    if va is None or vb is None:
        row["note"] = "values not kept in " + ("both" if va is None and vb is None else ("a" if va is None else "b"))
        return
    d = _positions_dim(ra, rb, fed) if ra.shape != rb.shape else None
    pair = _aligned(va, vb, d)
    if pair is None:
        row["note"] = "shapes differ"
        row["diverged"] = True
        return
    if not (pair[0].is_floating_point() or pair[0].is_complex()):  # token ids, flags: equal or not, no distance
        differ = int((pair[0] != pair[1]).sum())
        where = f"on the last {pair[0].shape[d]} position(s), " if d is not None else ""
        row.update(compared=True, tolerance=0.0, diverged=differ > 0,
                   note=where + (f"{differ:,} of {pair[0].numel():,} entries differ" if differ else "all equal"))
        return
    x, y = (t.detach().double() for t in pair)
    finite = torch.isfinite(x) & torch.isfinite(y)
    gaps_x, gaps_y = x[~finite], y[~finite]  # where either is NaN or ±∞
    same_gap = (gaps_x == gaps_y) | (gaps_x.isnan() & gaps_y.isnan())  # NaN ≠ NaN, yet the same NaN is no change
    mismatch = bool((torch.isfinite(x) != torch.isfinite(y)).any() or not same_gap.all())
    delta = (x[finite] - y[finite]).abs()
    max_delta = float(delta.max()) if delta.numel() else 0.0
    scale = float(x[finite].abs().max()) if delta.numel() else 0.0
    tol = tolerance(ra.dtype, scale)
    row.update(compared=True, max_abs_delta=max_delta, rel_delta=max_delta / scale if scale else 0.0,
               tolerance=tol, diverged=mismatch or max_delta > tol)
    if d is not None:
        row["note"] = f"compared on the last {x.shape[d]} position(s)"
    if mismatch:
        row["note"] = (row["note"] + "; " if row["note"] else "") + "NaN/±∞ in different places"
