"""An engine run on disk: one .zip holding ``engine.json`` (the pool, the requests, the steps: plain JSON) and
``values.safetensors`` (the kept attention values).

Read back as a trace file is (``tracer.files``): no pickle; each archive member checked against its limit and its
compression ratio before it is inflated, and read no further than it declares; ``engine.json`` checked field by
field against one schema (``tracer.files._schema``: types, ranges, list lengths); then the run checked against
itself — every request a step names exists, every page lies in the pool, the steps are numbered 0 … n-1, every
kept value belongs to a request of its step and has the shape the pool's heads give — so that a file that loads
is one every view of the Engine tab can draw. Anything else is a ``TraceFileError`` that names it. The files it
reads: one a person opens in the app or the CLI, and the app's runs folder (``session.runs``)."""

from __future__ import annotations

import json
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch

from gpt_shape_tracer.tracer.engine._engine import (
    MAX_ARRIVAL,
    MAX_ENGINE_STEPS,
    MAX_POOL_BYTES,
    MAX_REQUESTS,
    EngineRun,
)
from gpt_shape_tracer.tracer.engine._records import (
    CONTRIBUTIONS,
    FINISH_REASONS,
    EngineRequest,
    EngineStep,
    PoolFacts,
    RequestAttention,
    RequestInStep,
)
from gpt_shape_tracer.tracer.files import (
    LIMITS,
    Bool,
    Int,
    Limits,
    ListOf,
    Maybe,
    Obj,
    OneOf,
    Str,
    Then,
    TraceFileError,
    TupleOf,
    read_zip_members,
)

FORMAT = "gpt-shape-tracer engine run"
VERSION = 1
_PARTS = ("q", "k", "v", "pattern")


def save_engine_run(run: EngineRun, path: str | Path) -> Path:
    """Write ``run`` to ``path`` (a .zip); returns the path."""
    from safetensors.torch import save

    target = Path(path)
    if target.suffix != ".zip":
        raise ValueError(f"{target}: an engine run is written to a .zip")
    tensors: dict[str, torch.Tensor] = {}
    kept = []
    for n, a in enumerate(run.attentions()):
        kept.append({"step": a.step, "request_id": a.request_id, "layer": a.layer, "past": a.past})
        for part in _PARTS:
            tensors[f"{n}.{part}"] = getattr(a, part).contiguous()
    manifest = {
        "format": FORMAT, "version": VERSION, "pool": asdict(run.pool),
        "requests": [asdict(r) for r in run.requests], "steps": [asdict(s) for s in run.steps],
        "budget_bytes": run.budget_bytes, "notes": list(run.notes), "values": kept,
    }
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("engine.json", json.dumps(manifest, ensure_ascii=False))
        z.writestr("values.safetensors", save(tensors) if tensors else save({}))
    return target


MANIFEST, VALUES = "engine.json", "values.safetensors"
_MAX_PAGES = 1 << 22  # page ids and counts: a pool within MAX_POOL_BYTES has far fewer pages
_MAX_VALUES = 1 << 20  # kept (step, request, layer) values a run may list
_MAX_NOTES = 64


def _schema(limits: Limits) -> Obj:
    token = Int(0, 2**31)
    tokens = ListOf(token, limits.n_ctx)
    step_no = Int(0, MAX_ENGINE_STEPS)
    page = Int(0, _MAX_PAGES)
    pages = ListOf(page, _MAX_PAGES)
    rid = Str(64)
    rids = ListOf(rid, MAX_REQUESTS)
    pool = Then(Obj({"page_size": Int(1, 1 << 16), "pages": Int(1, _MAX_PAGES), "pages_asked": Int(0, _MAX_PAGES),
                     "max_batch_tokens": Int(1, 1 << 24), "bytes_per_page": Int(1, MAX_POOL_BYTES),
                     "n_layer": Int(1, limits.layers), "n_head": Int(1, 1 << 16), "n_kv_head": Int(1, 1 << 16),
                     "head_dim": Int(1, 1 << 16), "dtype": Str(40), "prefix_sharing": Bool()}),
                lambda d: PoolFacts(**d))
    request = Then(Obj({"request_id": rid, "prompt": Maybe(Str(1_000_000)), "prompt_ids": tokens,
                        "arrival": Int(0, MAX_ARRIVAL), "max_new_tokens": Int(0, limits.n_ctx),
                        "generated_ids": tokens, "first_step": Maybe(step_no), "finished_step": Maybe(step_no),
                        "finish_reason": Maybe(OneOf(FINISH_REASONS)),
                        "preempted_at": ListOf(step_no, MAX_ENGINE_STEPS),
                        "prefix_hit_tokens": Int(0, limits.n_ctx)}),
                   lambda d: EngineRequest(**d))
    part = Then(Obj({"request_id": rid, "contribution": OneOf(CONTRIBUTIONS), "past": Int(0, limits.n_ctx),
                     "tokens": Int(0, limits.n_ctx), "block_table": pages, "new_token": Maybe(token),
                     "prefix_hit": Int(0, limits.n_ctx), "recompute": Bool()}),
                lambda d: RequestInStep(**d))
    step = Then(Obj({"step": step_no, "requests": ListOf(part, MAX_REQUESTS), "arrived": rids, "finished": rids,
                     "preempted": rids, "allocated": pages, "freed": pages, "cached": pages,
                     "shared": ListOf(TupleOf((page, Int(2, MAX_REQUESTS * _MAX_PAGES))), _MAX_PAGES),
                     "tables": ListOf(TupleOf((rid, pages)), MAX_REQUESTS), "pages_in_use": page,
                     "pages_free": page, "pages_total": page}),
                lambda d: EngineStep(**d))
    value = Obj({"step": step_no, "request_id": rid, "layer": Int(0, limits.layers), "past": Int(0, limits.n_ctx)})
    return Obj({"format": OneOf((FORMAT,)), "version": Int(0, 1 << 16), "pool": pool,
                "requests": ListOf(request, MAX_REQUESTS), "steps": ListOf(step, MAX_ENGINE_STEPS),
                "budget_bytes": Int(0, 2**62), "notes": ListOf(Str(10_000), _MAX_NOTES),
                "values": ListOf(value, _MAX_VALUES)})


def _members(source: Path | bytes, limits: Limits) -> dict[str, bytes]:
    """engine.json and values.safetensors, each within its limit (``tracer.files.read_zip_members``: checked from
    the archive's directory before inflating, then again while reading)."""
    allowed = {MANIFEST: limits.manifest_bytes, VALUES: limits.value_bytes + limits.manifest_bytes}
    files = read_zip_members(source, allowed, limits, kind="engine run")
    for required in (MANIFEST, VALUES):
        if required not in files:
            raise TraceFileError(f"the engine run has no {required}")
    return {name: bytes(data) for name, data in files.items()}


def _consistent(pool: PoolFacts, requests: tuple[EngineRequest, ...], steps: tuple[EngineStep, ...]) -> None:
    """The run against itself: what the views look up must be there."""
    if pool.n_head % pool.n_kv_head:
        raise TraceFileError(f"{pool.n_head} query heads do not share {pool.n_kv_head} key/value heads", "pool")
    if pool.pool_bytes > MAX_POOL_BYTES:
        raise TraceFileError(f"a pool of {pool.pool_bytes:,} B, over the {MAX_POOL_BYTES:,} B a run may hold", "pool")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise TraceFileError("two requests have the same id", "requests")
    known, n = set(ids), len(steps)
    for i, r in enumerate(requests):
        at = [x for x in (r.first_step, r.finished_step, *r.preempted_at) if x is not None]
        if any(x >= n for x in at):
            raise TraceFileError(f"names engine step {max(at)}, but the run has {n}", f"requests[{i}]")
    for i, s in enumerate(steps):
        where = f"steps[{i}]"
        if s.step != i:
            raise TraceFileError(f"is numbered {s.step}: steps are numbered 0 … {n - 1} in order", where)
        named = {p.request_id for p in s.requests} | {rid for rid, _ in s.tables}
        named |= set(s.arrived) | set(s.finished) | set(s.preempted)
        if named - known:
            raise TraceFileError(f"names request {sorted(named - known)[0]!r}, which the run does not hold", where)
        if len({p.request_id for p in s.requests}) != len(s.requests):
            raise TraceFileError("holds a request twice", where)
        if s.pages_total > pool.pages or s.pages_in_use + s.pages_free > s.pages_total:
            raise TraceFileError(f"counts {s.pages_in_use} held and {s.pages_free} free of {s.pages_total} pages "
                                 f"in a pool of {pool.pages}", where)
        # page ids are transformers' block ids (they need not start at 0): a step names no more pages than the pool
        used = {*s.allocated, *s.freed, *s.cached, *(p for p, _ in s.shared), *(p for _, t in s.tables for p in t),
                *(p for r in s.requests for p in r.block_table)}
        if len(used) > pool.pages:
            raise TraceFileError(f"names {len(used)} pages, more than the pool's {pool.pages}", where)


def _values(raw: tuple[dict, ...], tensors: dict[str, torch.Tensor], pool: PoolFacts,
            steps: tuple[EngineStep, ...]) -> dict[tuple[int, str, int], RequestAttention]:
    """The kept values, each one the attention of a request of its step, of the shape the pool's heads give."""
    if len(tensors) != len(_PARTS) * len(raw):
        raise TraceFileError(f"holds {len(tensors)} tensors for {len(raw)} values of {len(_PARTS)} parts",
                             "values.safetensors")
    values = {}
    for n, v in enumerate(raw):
        where = f"values[{n}]"
        missing = [part for part in _PARTS if f"{n}.{part}" not in tensors]
        if missing:
            raise TraceFileError(f"no {', '.join(missing)} in values.safetensors", where)
        q, k, val, pattern = (tensors[f"{n}.{part}"] for part in _PARTS)
        step = steps[v["step"]] if v["step"] < len(steps) else None
        part = step.request(v["request_id"]) if step is not None else None
        if part is None or v["layer"] >= pool.n_layer or v["past"] != part.past:
            raise TraceFileError(f"is the attention of {v['request_id']!r} at engine step {v['step']}, layer "
                                 f"{v['layer']}, after {v['past']} positions: no such request part in the run", where)
        length, tokens = part.past + part.tokens, part.tokens
        shapes = {"q": (pool.n_head, tokens, pool.head_dim), "k": (pool.n_kv_head, length, pool.head_dim),
                  "v": (pool.n_kv_head, length, pool.head_dim), "pattern": (pool.n_head, tokens, length)}
        for name, t in zip(_PARTS, (q, k, val, pattern)):
            if tuple(t.shape) != shapes[name] or not t.is_floating_point():
                raise TraceFileError(f"{name} is {t.dtype} {list(t.shape)}; the pool's heads give a float "
                                     f"{list(shapes[name])}", where)
        key = (v["step"], v["request_id"], v["layer"])
        if key in values:
            raise TraceFileError("is listed twice", where)
        values[key] = RequestAttention(step=v["step"], request_id=v["request_id"], layer=v["layer"],
                                       past=v["past"], q=q, k=k, v=val, pattern=pattern)
    return values


def load_engine_run(source: str | Path | bytes, limits: Limits = LIMITS) -> EngineRun:
    """Read back what ``save_engine_run`` wrote (a path, or the file's bytes); a ``TraceFileError`` names anything
    missing, malformed, out of its bounds or inconsistent."""
    from safetensors.torch import load

    name = "the engine run" if isinstance(source, (bytes, bytearray)) else str(source)
    if not isinstance(source, (bytes, bytearray)):
        source = Path(source)
        if not source.is_file():
            raise TraceFileError(f"{name}: no such file")
    files = _members(source, limits)
    try:
        raw = json.loads(files[MANIFEST])
    except (ValueError, UnicodeDecodeError) as e:
        raise TraceFileError(f"{MANIFEST} is not JSON ({e})") from None
    except RecursionError:  # nested deeper than Python's recursion limit
        raise TraceFileError(f"{MANIFEST} is nested too deeply to be one") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise TraceFileError(f"{name}: not a {FORMAT}")
    if raw.get("version") != VERSION:
        raise TraceFileError(f"{name}: version {str(raw.get('version'))[:40]}; this reads version {VERSION}")
    manifest = _schema(limits)(raw, "")
    pool, requests, steps = manifest["pool"], manifest["requests"], manifest["steps"]
    _consistent(pool, requests, steps)
    try:
        tensors = load(files[VALUES])
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a corrupt header
        raise TraceFileError(f"{VALUES} cannot be read ({type(e).__name__}: {e})") from None
    values = _values(manifest["values"], tensors, pool, steps)
    return EngineRun(pool, requests, steps, values, manifest["budget_bytes"], manifest["notes"])
