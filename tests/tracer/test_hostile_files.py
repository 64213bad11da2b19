"""Trace files built to hurt: every one is generated here from a real trace, then bent.

What must hold for each: ``load_trace`` either loads the file or raises ``TraceFileError`` naming what is
wrong (never another exception), and a small file never costs memory out of proportion to its size.
"""

from __future__ import annotations

import copy
import io
import json
import math
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from gpt_shape_tracer.tracer import TracedGeneration, TraceFileError, load_trace
from gpt_shape_tracer.tracer.files import LIMITS, archive_bytes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def archive(bundled) -> bytes:
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Lily had a red ball.", temperature=0)
    gen.run(3)
    return archive_bytes(gen.trace)


def members(archive: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def build(parts: dict[str, bytes], deflate: tuple[str, ...] = ("manifest.json",)) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in parts.items():
            zf.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED)
    return out.getvalue()


def with_manifest(archive: bytes, change) -> bytes:
    parts = members(archive)
    manifest = json.loads(parts["manifest.json"])
    change(manifest)
    parts["manifest.json"] = json.dumps(manifest).encode()
    return build(parts)


def million_rows() -> bytes:
    """records.parquet with a million rows, about 30 KiB: runs of equal values compress to nothing."""
    n = 1_000_000
    frame = pd.DataFrame({"index": np.zeros(n, dtype=np.int64), "step": 0, "module": 0, "kind": "output",
                          "slot": "", "call": 0, "dtype": "float32", "shape": [[1]] * n})
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False, compression="zstd")
    return buf.getvalue()


def refused(data: bytes, match: str) -> TraceFileError:
    with pytest.raises(TraceFileError, match=match) as info:
        load_trace(data)
    return info.value


# -- memory out of proportion to the input ----------------------------------------------------------
def test_a_deflate_bomb_is_refused_from_its_declared_sizes(archive):
    parts = members(archive)
    parts["values.safetensors"] = b"\0" * (64 * 2**20)  # 64 MiB of zeros deflate to about 64 KiB
    bomb = build(parts, deflate=("manifest.json", "values.safetensors"))
    assert len(bomb) < 2**20
    err = refused(bomb, r"would inflate \d+ bytes to 67108864, over .*200")
    assert "values.safetensors" in str(err)


def test_a_member_that_inflates_past_its_declared_size_is_refused(archive):
    parts = members(archive)
    big = b"\0" * (8 * 2**20)
    honest = build({**parts, "values.safetensors": big}, deflate=("manifest.json", "values.safetensors"))
    # rewrite the declared (uncompressed) size of values.safetensors to 1000 bytes in both headers
    lying = bytearray(honest)
    for sig, size_at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        start = 0
        while (at := lying.find(sig, start)) >= 0:
            name_len = struct.unpack_from("<H", lying, at + (26 if sig == b"PK\x03\x04" else 28))[0]
            name_at = at + (30 if sig == b"PK\x03\x04" else 46)
            if bytes(lying[name_at:name_at + name_len]) == b"values.safetensors":
                struct.pack_into("<I", lying, at + size_at, 1000)
            start = at + 4
    with pytest.raises(TraceFileError):
        load_trace(bytes(lying))


def test_a_million_records_in_a_small_file_are_refused_before_decoding(archive):
    parts = members(archive)
    parts["records.parquet"] = million_rows()
    assert len(parts["records.parquet"]) < 2**20
    refused(build(parts), r"records.parquet: 1000000 rows, but the manifest says \d+")

    def claim_too_many(manifest):
        manifest["counts"]["records"] = LIMITS.records + 1
    manifest_says = with_manifest(build(parts), claim_too_many)
    refused(manifest_says, f"counts.records: {LIMITS.records + 1} is outside \\[0, {LIMITS.records}\\]")


def test_hostile_files_do_not_cost_memory_out_of_proportion(archive, tmp_path):
    """Peak memory of loading every bomb above, in a fresh process: what a 2 MiB file may cost."""
    parts = members(archive)
    bombs = {
        "deflate": build({**parts, "values.safetensors": b"\0" * (256 * 2**20)},
                         deflate=("manifest.json", "values.safetensors")),
        "manifest": build({**parts, "manifest.json": b'{"format": "' + b" " * (200 * 2**20) + b'"}'}),
    }
    bombs["rows"] = build({**parts, "records.parquet": million_rows()})
    for name, data in bombs.items():
        (tmp_path / f"{name}.zip").write_bytes(data)
    script = (
        "import resource, sys\n"
        "from gpt_shape_tracer.tracer import TraceFileError, load_trace\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        load_trace(path)\n"
        "        print('LOADED', path)\n"
        "    except TraceFileError as e:\n"
        "        print('REFUSED', path, e)\n"
        "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, *map(str, sorted(tmp_path.glob("*.zip")))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("REFUSED") == 3, proc.stdout
    peak_mib = int(proc.stdout.split("PEAK_KIB")[1]) / 1024
    assert peak_mib < 150, f"{peak_mib:.0f} MiB to refuse three files of ≤ 2 MiB"


def full_million_rows(table: bytes) -> bytes:
    """records.parquet of a real trace's columns with a million rows (its first row repeated): a few hundred KiB
    that pandas decodes into more than a GiB of Python objects."""
    frame = pd.read_parquet(io.BytesIO(table)).iloc[[0] * 1_000_000].reset_index(drop=True)
    frame["index"] = np.arange(len(frame))
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False, compression="zstd")
    return buf.getvalue()


@pytest.mark.parametrize("where", ["in one step", "after the last step"])
def test_a_million_records_declared_by_the_manifest_are_refused_before_the_table_is_decoded(archive, tmp_path,
                                                                                          where):
    """The manifest's counts and step ranges agree with the table's million rows, so only the per-step limit
    refuses them: from the manifest, before decoding (once +1,245 MiB), in a fresh process whose peak is measured.
    "after the last step": the records a failed attempt at a next step leaves, which no step range bounds."""
    parts = members(archive)
    parts["records.parquet"] = full_million_rows(parts["records.parquet"])
    manifest = json.loads(parts["manifest.json"])
    manifest["counts"]["records"] = 1_000_000
    manifest["steps"] = manifest["steps"][:1]
    manifest["steps"][0]["end_record"] = 1_000_000 if where == "in one step" else 10
    manifest["generation"]["steps"] = manifest["generation"]["steps"][:1]
    parts["manifest.json"] = json.dumps(manifest).encode()
    crafted = tmp_path / "million.zip"
    crafted.write_bytes(build(parts, deflate=("manifest.json", "records.parquet")))
    assert crafted.stat().st_size < 2**20
    script = (
        "import resource, sys\n"
        "from gpt_shape_tracer.tracer import TraceFileError, load_trace\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    load_trace(sys.argv[1])\n"
        "    print('LOADED')\n"
        "except TraceFileError as e:\n"
        "    print('REFUSED', e)\n"
        "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(crafted)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = {"in one step": "1000000 records, over the limit of 100000 per step",
            "after the last step": "999990 records after the last step, over the limit of 100000 per step"}[where]
    assert "REFUSED" in proc.stdout and said in proc.stdout, proc.stdout
    peak_mib = int(proc.stdout.split("PEAK_KIB")[1]) / 1024
    assert peak_mib < 64, f"{peak_mib:.0f} MiB to refuse a file of < 1 MiB"


def test_a_values_header_nested_too_deeply_is_refused(archive):
    import struct as _struct

    header = b"[" * 200_000 + b"]" * 200_000
    parts = members(archive)
    parts["values.safetensors"] = _struct.pack("<Q", len(header)) + header
    refused(build(parts), "values.safetensors: header is not JSON \\(RecursionError")


# -- numbers read from the file that would size allocations -----------------------------------------
@pytest.mark.parametrize("change, match", [
    (lambda m: m["model"]["config"].update(n_layer=10**7), r"n_layer"),
    (lambda m: m["model"]["config"].update(n_head=10**6), r"n_head|heads|d_model"),
    (lambda m: m["model"]["config"].update(vocab_size=2**64), r"vocab_size"),
    (lambda m: m["model"]["config"].update(layer_norm_eps=-1.0), r"layer_norm_eps"),
    (lambda m: m["generation"]["steps"][2]["forward"].update(t=2 * 10**7), r"t|key positions"),
    (lambda m: m["generation"]["steps"][1]["forward"].update(n=10**6), r"\bn\b|new positions"),
    (lambda m: m["generation"]["info"].update(n_ctx=2**62), r"n_ctx"),
    (lambda m: m["generation"]["info"]["prompt_tokens"][0].extend([5] * 10**5), r"prompt"),
    (lambda m: m["generation"]["steps"][0]["sampling"].update(candidates=[list(range(10**5))]), r"candidates"),
])
def test_sizes_in_the_metadata_are_checked_against_the_contents(archive, change, match):
    err = refused(with_manifest(archive, change), match)
    assert err.field or str(err)


def test_gaps_and_inconsistencies_between_steps_are_refused(archive):
    def gap(manifest):
        manifest["steps"][1]["step"] = 5
    refused(with_manifest(archive, gap), "without gaps")

    def drop_generation_step(manifest):
        del manifest["generation"]["steps"][1]
    refused(with_manifest(archive, drop_generation_step), r"step")

    def cache_grows_wrong(manifest):
        manifest["generation"]["steps"][2]["forward"]["cache_before"] = 99
    refused(with_manifest(archive, cache_grows_wrong), r"cache")


def test_an_encrypted_member_is_refused(archive):
    data = bytearray(archive)
    for sig, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = data.find(sig)
        while at >= 0:
            struct.pack_into("<H", data, at + flag_at, struct.unpack_from("<H", data, at + flag_at)[0] | 1)
            at = data.find(sig, at + 4)
    refused(bytes(data), "encrypted")


# -- every field, every wrong type --------------------------------------------------------------------
def leaves(obj, path=()):
    """Every dict leaf and the first element of every list (enough to reach every field's type)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield path + (key,)
            yield from leaves(value, path + (key,))
    elif isinstance(obj, list) and obj:
        yield path + (0,)
        yield from leaves(obj[0], path + (0,))


def replaced(manifest: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(manifest)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


WRONG_VALUES = ["seven", -3, 2**70, math.nan, None, [1, [2]], {"a": 1}, True, 0]


def test_every_field_with_a_wrong_value_loads_or_is_refused_by_name(archive):
    """Each manifest field (dicts' keys, lists' first elements) set to each of nine wrong values: the
    file loads, or ``TraceFileError`` is raised — never another exception. Whatever loads can be read."""
    parts = members(archive)
    manifest = json.loads(parts["manifest.json"])
    paths = sorted(set(leaves(manifest)), key=str)
    assert len(paths) > 60
    outcomes = {"loaded": 0, "refused": 0}
    for path in paths:
        for value in WRONG_VALUES:
            text = json.dumps(replaced(manifest, path, value)).encode()
            try:
                trace = load_trace(build({**parts, "manifest.json": text}))
            except TraceFileError as e:
                outcomes["refused"] += 1
                assert str(e), path
                continue
            except Exception as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"{'.'.join(map(str, path))} = {value!r}: {type(e).__name__}: {e}")
            outcomes["loaded"] += 1
            trace.to_frame()
            if trace.generation is not None:
                for step in range(trace.n_steps):
                    facts = trace.generation
                    facts.step(step)
                    facts.labels(0, step)
    assert outcomes["refused"] > outcomes["loaded"]


@pytest.mark.parametrize("shape", [[0, "4"], ["4"], [-1, 4], [1.5, 2], [2**40, 2**40], list(range(1, 12))])
def test_bad_sizes_in_the_record_table_are_refused(archive, shape):
    parts = members(archive)
    frame = pd.read_parquet(io.BytesIO(parts["records.parquet"]))
    frame["shape"] = frame["shape"].map(list).astype(object)
    frame.at[frame.index[3], "shape"] = shape
    buf = io.BytesIO()
    try:
        frame.to_parquet(buf, index=False)
    except Exception:  # noqa: BLE001 - pyarrow refuses mixed types itself: then store them as text
        frame["shape"] = frame["shape"].map(lambda v: json.dumps([int(x) for x in v] if v is not shape else v))
        buf = io.BytesIO()
        frame.to_parquet(buf, index=False)
    with pytest.raises(TraceFileError):
        load_trace(build({**parts, "records.parquet": buf.getvalue()}))


# -- export never multiplies what was kept ------------------------------------------------------------
def test_a_saved_trace_is_no_larger_than_what_was_kept_plus_its_tables(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Once upon a time, there was a little girl named Lily.", temperature=0)
    gen.run(60)
    kept = gen.trace.bytes_kept
    data = archive_bytes(gen.trace)
    parts = members(data)
    values = parts["values.safetensors"]
    header = 8 + struct.unpack_from("<Q", values)[0]  # safetensors: length, JSON table of the storages, data
    tables = header + sum(len(parts[name]) for name in parts if name != "values.safetensors")
    assert len(values) - header <= kept  # each storage once, however many steps' records view it
    assert len(data) <= kept + tables + 4096  # plus the zip's own headers
    back = load_trace(data)
    assert back.bytes_kept <= kept  # a loaded storage holds only the span its records view
    name = "blocks.3.attn.hook_k_all"
    assert back.get(name, 59).equal(gen.trace.get(name, 59)) and back.get(name, 5).equal(gen.trace.get(name, 5))


# -- views are sized by what was kept, never by what a file claims --------------------------------------
def claiming(archive_of_shapes: bytes, n: int, claimed: int) -> bytes:
    """A shapes-only trace of an ``n``-token prompt rewritten to claim ``claimed`` tokens: every record
    dimension of size n, the prompt, its labels, the step's facts and the model's n_ctx (a few KiB on disk)."""
    parts = members(archive_of_shapes)
    frame = pd.read_parquet(io.BytesIO(parts["records.parquet"]))
    shapes = [[claimed if d == n else int(d) for d in shape] for shape in frame["shape"]]
    frame["shape"] = shapes
    sizes = [int(torch.tensor(s).prod()) if s else 1 for s in shapes]
    frame["nbytes"] = [size * (nbytes // max(numel, 1)) for size, nbytes, numel in
                       zip(sizes, frame["nbytes"], frame["numel"])]
    frame["numel"] = sizes
    if "derived" in frame:  # a derived attention stage's mask description claims the same length
        frame["derived"] = [_claimed_mask(text, n, claimed) for text in frame["derived"]]
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    parts["records.parquet"] = buf.getvalue()
    manifest = json.loads(parts["manifest.json"])
    info = manifest["generation"]["info"]
    info["prompt_tokens"] = [[5] * claimed]
    info["prompt_labels"] = [["x"] * claimed]
    info["n_ctx"] = manifest["model"]["config"]["n_ctx"] = claimed + 16
    manifest["generation"]["steps"][0]["forward"].update(n=claimed, t=claimed, cache_after=claimed,
                                                         fed_tokens=[[5] * claimed])
    parts["manifest.json"] = json.dumps(manifest).encode()
    return build(parts, deflate=("manifest.json", "records.parquet"))


def _claimed_mask(text: object, n: int, claimed: int) -> object:
    """A derived record's mask description (JSON) with its n, t and key padding of n tokens claiming ``claimed``."""
    if not isinstance(text, str) or not text:
        return text
    data = json.loads(text)
    mask = data["mask"]
    mask.update({k: claimed if mask[k] == n else mask[k] for k in ("n", "t")})
    if mask.get("key_is_token_runs") is not None:
        mask["key_is_token_runs"] = [[claimed if r == n else r for r in runs] for runs in mask["key_is_token_runs"]]
    return json.dumps(data)


def test_a_file_claiming_16k_tokens_cannot_make_a_view_allocate_gigabytes(bundled, tmp_path):
    """A few KiB claiming a 16,384-token prefill: every view of the loaded file builds within a bounded
    memory (the History once allocated a 16,384² matrix for it, +2.8 GB), measured in a process of its own."""
    import subprocess
    import sys

    model, tok = bundled
    gen = TracedGeneration(model, tok, "Tom had a kite.", temperature=0, capture="shapes")
    gen.step()
    n = gen.info.prompt_lengths[0]
    crafted = tmp_path / "claims.zip"
    crafted.write_bytes(claiming(archive_bytes(gen.trace), n, 16_384))
    assert crafted.stat().st_size < 64 * 1024
    probe = f"""
import resource, sys
sys.path.insert(0, {str(ROOT)!r})
from gpt_shape_tracer.tracer import load_trace
from gpt_shape_tracer.figures import attention, cache, flow, mask, tokens
trace = load_trace({str(crafted)!r})
assert trace.generation.step(0).forward.t == 16384
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
views = [lambda: attention.attention_history_figure(trace, 0, 0, 0), lambda: mask.mask_figure(trace, 0),
         lambda: mask.mask_facts(trace, 0), lambda: attention.attention_stages(trace, 0, 0, 0),
         lambda: cache.cache_table(trace, 0), lambda: cache.cache_steps_figure(trace, 0),
         lambda: cache.key_heatmap_figure(trace, 0, 0, 0), lambda: flow.shape_flow_figure(trace, 0, 0),
         lambda: tokens.generated_text_html(trace, 0), lambda: attention.all_heads_figure(trace, 0)]
for view in views:
    try:
        view()
    except ValueError:
        pass  # a view may refuse what it cannot draw; what it may not do is allocate for the claim
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip().splitlines()[-1]) < 256  # MiB of new peak memory across all the views
