"""docs/trace-format.md is enough to read a trace: a saved trace read with json, pyarrow and safetensors alone,
following the document (no code of ours), gives back an attention pattern that the document's formula
recomputes from Q, K and M; every column and code it describes is checked against what was saved."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load as load_safetensors

from gpt_shape_tracer.model.gpt import attention_path
from gpt_shape_tracer.tracer import TracedGeneration, save_trace
from tests.tolerance import assert_close_across_cpus

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "trace-format.md").read_text(encoding="utf-8")


def test_a_saved_trace_read_with_the_document_alone(bundled, tmp_path):
    model, tok = bundled
    # eager: every n × t stage in values.safetensors (a fused layer's are derived, recomputed from Q and K)
    with attention_path("eager"):
        gen = TracedGeneration(model, tok, ["Tom had a big red kite.", "Lily ran"], temperature=0)  # left padding
        gen.run(3)
    save_trace(gen.trace, tmp_path / "t.zip")

    with zipfile.ZipFile(tmp_path / "t.zip") as archive:
        assert sorted(archive.namelist()) == sorted(["manifest.json", "records.parquet", "ops.parquet",
                                                     "values.safetensors"])
        manifest = json.loads(archive.read("manifest.json"))
        rows = pq.read_table(io.BytesIO(archive.read("records.parquet"))).to_pylist()
        tensors = load_safetensors(archive.read("values.safetensors"))
    assert (manifest["format"], manifest["version"], manifest["capture"]) == ("gpt-shape-trace", 3, "values")
    assert f"# The trace file format (version {manifest['version']})" in DOC
    assert manifest["counts"] == {"records": len(rows), "ops": 0, "storages": len(tensors)}
    assert all(t.dim() == 1 for t in tensors.values())  # flat storages, s0, s1, …
    assert set(tensors) == {f"s{k}" for k in range(len(tensors))}

    # steps: a step's rows are [first_record, end_record)
    for entry in manifest["steps"]:
        assert set(entry) == {"step", "first_record", "end_record", "seconds", "interventions"}
        assert {r["step"] for r in rows[entry["first_record"]:entry["end_record"]]} == {entry["step"]}
        assert entry["seconds"] > 0 and entry["interventions"] == []
    # modules, indexed by module_index
    for r in rows:
        module = manifest["modules"][r["module_index"]]
        assert (module["path"] or "model", module["type"], module["params"]) == (r["module"], r["module_type"],
                                                                                  r["params"])
        assert module["is_hook"] == (r["kind"] == "hook")

    def value(name: str, step: int) -> torch.Tensor:
        row = next(r for r in rows if r["name"] == name and r["step"] == step)
        assert row["has_value"] and row["storage"] >= 0
        flat = tensors[f"s{row['storage']}"]
        return torch.as_strided(flat, row["shape"], row["strides"], row["storage_offset"])

    def row_of(name: str, step: int) -> dict:
        return next(r for r in rows if r["name"] == name and r["step"] == step)

    d_head = manifest["model"]["config"]["d_model"] // manifest["model"]["config"]["n_head"]
    for step in (0, 2):  # the prefill (a causal mask over the padded batch) and a cached decode step
        q, k = value("blocks.1.attn.hook_q", step), value("blocks.1.attn.hook_k_all", step)
        mask = value("blocks.1.attn.hook_mask", step)  # [B, 1, n, t]: 0 or −∞
        recomputed = torch.softmax(q @ k.transpose(-1, -2) / d_head**0.5 + mask, dim=-1)
        assert torch.allclose(recomputed, value("blocks.1.attn.hook_pattern", step), atol=1e-6)
        assert row_of("blocks.1.attn.hook_pattern", step)["axes"] == ["B", "H", "n", "t"]
    # the generation: the prompts, and each step's forward (n, t) agreeing with the records' shapes
    generation = manifest["generation"]
    assert generation["info"]["prompts"] == ["Tom had a big red kite.", "Lily ran"]
    for entry in generation["steps"]:
        forward = entry["forward"]
        assert row_of("blocks.0.attn.hook_pattern", entry["step"])["shape"][-2:] == [forward["n"], forward["t"]]
        assert len(entry["sampling"]["tokens"]) == 2
    # finite, as words: the mask holds −∞ on purpose
    assert row_of("blocks.1.attn.hook_mask", 0)["finite"] == "finite and -inf"
    assert row_of("blocks.1.attn.hook_pattern", 0)["finite"] == "finite"
    assert {r["finite"] for r in rows} <= {"finite", "finite and -inf", "nan or +inf", "unchecked"}
    assert '`"finite and -inf"` −∞ and finite numbers only' in DOC
    # tensor_id: a module's output and its parent's output are the same tensor; ids, not addresses
    out = row_of("blocks.1.attn.c_proj:out", 2)
    assert out["tensor_id"] != 0 and out["tensor_id"] == row_of("blocks.1.attn:out", 2)["tensor_id"]
    assert max(r["tensor_id"] for r in rows) <= len(rows)
    # every column the document lists is in the file, and every column in the file is in the document
    documented = {name.strip("` ") for line in DOC.split("## `records.parquet`")[1].split("## ")[0].splitlines()
                  if line.startswith("| `") for name in line.split("|")[1].split(",")}
    assert documented == set(rows[0]), documented ^ set(rows[0])


def test_the_activation_dict_holds_every_hook_points_value_of_a_step(bundled):
    from gpt_shape_tracer.tracer import Tracer

    model, tok = bundled
    with Tracer(model, capture="values") as tr:
        model(torch.tensor([tok.encode("Lily had a red ball.")]))
    activations = tr.trace.to_activation_dict(0)
    hooks = [r.name for r in tr.trace.filter(step=0, kind="hook")]
    assert list(activations) == hooks
    assert all(torch.equal(activations[name], tr.trace.get(name, 0)) for name in hooks)


def test_a_file_of_format_version_2_still_loads(bundled):
    """tests/data/trace-v2.zip was written by the tracer before version 3 (positional arrays in the manifest,
    finite as codes, axes as strings, data_ptr): it loads, and its values are what the model computes."""
    from gpt_shape_tracer.tracer import load_trace

    model, tok = bundled
    with zipfile.ZipFile(ROOT / "tests" / "data" / "trace-v2.zip") as archive:
        assert json.loads(archive.read("manifest.json"))["version"] == 2
    old = load_trace(ROOT / "tests" / "data" / "trace-v2.zip")
    assert old.generation.info.prompts == ("Lily had", "Tom") and old.n_steps == 2
    again = TracedGeneration(model, tok, ["Lily had", "Tom"], temperature=0)
    again.run(2)
    assert [old.generation.step(s).sampling.tokens for s in range(2)] == \
        [again.facts.step(s).sampling.tokens for s in range(2)]
    mask = old.record("blocks.0.attn.hook_mask", 0)
    assert old.finite_flag(mask) == again.trace.finite_flag(again.trace.record("blocks.0.attn.hook_mask", 0))
    kept = [r for r in old.filter(step=1) if old.value(r) is not None]
    assert kept
    for r in kept:  # written on another machine: equal up to that CPU's float32 rounding (tests/tolerance.py)
        assert_close_across_cpus(again.trace.get(r.name, 1), old.value(r), r.name)


def test_a_trace_written_in_parts_read_with_the_document_alone(bundled, tmp_path):
    """The section "A trace written in parts", followed by hand: the storages numbered over the files, a part's
    empty storage standing for an earlier one grown, its slabs copied into their views — every value of every
    step then equals the trace's own, the KV cache's K of the last step included."""
    from gpt_shape_tracer.tracer import save_trace_part

    model, tok = bundled
    gen = TracedGeneration(model, tok, ["Tom had a big red kite.", "Lily ran"], temperature=0)  # left padding
    after, paths = None, []
    for _ in range(4):
        gen.run(1)
        paths.append(tmp_path / f"{len(paths)}.zip")
        after = save_trace_part(gen.trace, paths[-1], after)
    storages: list[torch.Tensor] = []  # over the files, in file order
    rows: list[dict] = []
    stands: dict[int, int] = {}  # an empty storage → the one it stands for, grown
    for path in paths:
        with zipfile.ZipFile(path) as archive:
            manifest = json.loads(archive.read("manifest.json"))
            part_rows = pq.read_table(io.BytesIO(archive.read("records.parquet"))).to_pylist()
            tensors = load_safetensors(archive.read("values.safetensors"))
        shift = len(storages)
        said = manifest.get("continues")
        assert (said is None) == (path == paths[0])
        if said is not None:
            assert said["storages"] == shift and said["records"] == len(rows)
            assert part_rows[0]["index"] == len(rows) and manifest["steps"][0]["step"] == said["steps"]
        storages += [tensors[f"s{k}"].clone() for k in range(len(tensors))]
        for own, earlier, length, slabs in (said or {}).get("extends", []):
            assert tensors[f"s{own}"].numel() == 0
            grown = torch.zeros(length, dtype=storages[earlier].dtype)
            grown[:storages[earlier].numel()] = storages[earlier]
            for slab, offset, shape, strides in slabs:
                torch.as_strided(grown, shape, strides, offset).copy_(tensors[f"s{slab}"].view(shape))
            storages[earlier] = grown
            stands[shift + own] = earlier
        for r in part_rows:
            for column in ("storage", "digest_storage"):
                if r[column] >= 0:
                    r[column] += shift
        rows += part_rows
    assert stands, "the KV cache's buffer was extended, not written again"
    checked = 0
    for r in rows:
        if r["storage"] < 0:
            continue
        flat = storages[stands.get(r["storage"], r["storage"])]
        value = torch.as_strided(flat, r["shape"], r["strides"], r["storage_offset"])
        assert torch.equal(value, gen.trace.get(r["name"], r["step"])), (r["step"], r["name"])
        checked += 1
    assert checked > 100 and any(r["name"].endswith("hook_k_all") and r["step"] == 3 and r["storage"] in stands
                                 for r in rows)
