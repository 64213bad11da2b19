"""An engine run on disk: one .zip holding ``engine.json`` (the pool, the requests, the steps: plain JSON) and
``values.safetensors`` (the kept attention values). No pickle; every field is checked when it is read back."""

from __future__ import annotations

import json
import zipfile
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from gpt_shape_tracer.tracer.engine._engine import EngineRun
from gpt_shape_tracer.tracer.engine._records import (
    CONTRIBUTIONS,
    FINISH_REASONS,
    EngineRequest,
    EngineStep,
    PoolFacts,
    RequestAttention,
    RequestInStep,
)
from gpt_shape_tracer.tracer.files import LIMITS, TraceFileError

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


def _read(z: zipfile.ZipFile, name: str, limit: int) -> bytes:
    try:
        info = z.getinfo(name)
    except KeyError:
        raise TraceFileError(f"the engine run has no {name}") from None
    if info.file_size > limit:
        raise TraceFileError(f"{name} claims {info.file_size:,} B, over the {limit:,} B limit")
    return z.read(name)


def _tuple(value: Any, what: str) -> tuple:
    if not isinstance(value, list):
        raise TraceFileError(f"{what}: expected a list, got {type(value).__name__}")
    return tuple(value)


def _record(cls: Any, raw: Any, what: str) -> Any:
    if not isinstance(raw, dict) or set(raw) != {f.name for f in fields(cls)}:
        raise TraceFileError(f"{what}: expected the fields {', '.join(f.name for f in fields(cls))}")
    return raw


def load_engine_run(path: str | Path) -> EngineRun:
    """Read back what ``save_engine_run`` wrote; a ``TraceFileError`` names anything missing or malformed."""
    from safetensors.torch import load

    try:
        z = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise TraceFileError(f"{path}: not an engine run ({e})") from None
    with z:
        try:
            manifest = json.loads(_read(z, "engine.json", LIMITS.manifest_bytes))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TraceFileError(f"engine.json is not JSON ({e})") from None
        except RecursionError:  # nested deeper than Python's recursion limit
            raise TraceFileError("engine.json is nested too deeply to be one") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise TraceFileError(f"{path}: not a {FORMAT}")
        if manifest.get("version") != VERSION:
            raise TraceFileError(f"{path}: version {manifest.get('version')!r}; this reads version {VERSION}")
        try:
            tensors = load(_read(z, "values.safetensors", LIMITS.value_bytes))
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise TraceFileError(f"values.safetensors cannot be read ({e})") from None
    try:
        pool = PoolFacts(**_record(PoolFacts, manifest["pool"], "pool"))
        requests = []
        for raw in _tuple(manifest["requests"], "requests"):
            r = dict(_record(EngineRequest, raw, "a request"))
            for key in ("prompt_ids", "generated_ids", "preempted_at"):
                r[key] = _tuple(r[key], key)
            if r["finish_reason"] not in (*FINISH_REASONS, None):
                raise TraceFileError(f"finish_reason {r['finish_reason']!r}")
            requests.append(EngineRequest(**r))
        steps = []
        for raw in _tuple(manifest["steps"], "steps"):
            s = dict(_record(EngineStep, raw, "a step"))
            parts = []
            for part in _tuple(s["requests"], "a step's requests"):
                p = dict(_record(RequestInStep, part, "a request in a step"))
                if p["contribution"] not in CONTRIBUTIONS:
                    raise TraceFileError(f"contribution {p['contribution']!r}")
                p["block_table"] = _tuple(p["block_table"], "block_table")
                parts.append(RequestInStep(**p))
            s["requests"] = tuple(parts)
            for key in ("arrived", "finished", "preempted", "allocated", "freed", "cached"):
                s[key] = _tuple(s[key], key)
            s["shared"] = tuple(tuple(_tuple(x, "shared")) for x in _tuple(s["shared"], "shared"))
            s["tables"] = tuple((rid, _tuple(t, "a table")) for rid, t in _tuple(s["tables"], "tables"))
            steps.append(EngineStep(**s))
        values = {}
        for n, raw in enumerate(_tuple(manifest["values"], "values")):
            missing = [part for part in _PARTS if f"{n}.{part}" not in tensors]
            if missing:
                raise TraceFileError(f"value {n}: no {', '.join(missing)} in values.safetensors")
            q, k, v, pattern = (tensors[f"{n}.{part}"] for part in _PARTS)
            a = RequestAttention(step=int(raw["step"]), request_id=str(raw["request_id"]), layer=int(raw["layer"]),
                                 past=int(raw["past"]), q=q, k=k, v=v, pattern=pattern)
            values[(a.step, a.request_id, a.layer)] = a
        notes = tuple(str(x) for x in _tuple(manifest["notes"], "notes"))
        return EngineRun(pool, tuple(requests), tuple(steps), values, int(manifest["budget_bytes"]), notes)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, TraceFileError):
            raise
        raise TraceFileError(f"{path}: malformed engine run ({type(e).__name__}: {e})") from None
