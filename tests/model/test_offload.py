"""A model larger than the memory it is given (``load_hf(dir, max_memory=…)``): transformers runs it and
Hugging Face accelerate keeps the layers that do not fit on disk, reading them in for each forward. Traced, it
must give the logits of transformers' own in-memory model and exactly the records of the same model held in
memory — the offload moves weights, never numbers — and every reading that needs a weight (the logit lens's
W_U, the identity digest) must read the offloaded copy."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import ModelLoadError, load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR, HFDecoder, weights_size
from gpt_shape_tracer.tracer import (
    GRADIENT_LOSSES,
    TracedGeneration,
    gradient_trace,
    load_trace,
    logit_lens,
    save_trace,
)
from tests.hf_architectures import build

PROMPTS = ["Lily had a red kite.", "Tom said"]
STEPS = 3


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def directory(request):
    root = Path(tempfile.mkdtemp(prefix="offload-"))
    return build(request.param, root / request.param, BUNDLED_DIR / "tokenizer.json")


def third_of_the_weights(directory: Path) -> int:
    return weights_size(directory)[1] // 3


def run(model, tok) -> TracedGeneration:
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0, padding_side="left", capture="values")
    gen.run(STEPS)
    return gen


def test_an_offloaded_model_traces_the_logits_and_every_record_of_the_model_in_memory(directory):
    from transformers import AutoModelForCausalLM

    offloaded, tok = load_hf(directory, max_memory=third_of_the_weights(directory))
    assert isinstance(offloaded, HFDecoder)
    assert "disk" in offloaded.offloaded.values(), offloaded.offloaded  # it really did not fit
    assert any(p.device.type == "meta" for p in offloaded.hf.parameters())
    in_memory, _ = load_hf(directory, implementation="transformers")
    assert in_memory.offloaded == {}
    gen, ref_gen = run(offloaded, tok), run(in_memory, tok)
    assert [gen.text(r) for r in range(2)] == [ref_gen.text(r) for r in range(2)]
    for step in range(STEPS):
        names = [r.name for r in ref_gen.trace.filter(step=step)]
        assert [r.name for r in gen.trace.filter(step=step)] == names
        for rec in ref_gen.trace.filter(step=step):
            if rec.kind == "hook" and ref_gen.trace.has_value(rec):
                assert torch.equal(gen.trace.get(rec.name, step), ref_gen.trace.get(rec.name, step)), (step, rec.name)
    # and against transformers' own model, all in memory, run without our code
    ref = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    B, last = len(PROMPTS), STEPS - 1
    ids = torch.tensor([gen.facts.columns(r, last) for r in range(B)])
    real = torch.tensor([gen.facts.is_token(r, last) for r in range(B)])
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=real.long(),
                       position_ids=(real.long().cumsum(-1) - 1).clamp(min=0)).logits
    width = gen.info.prompt_width
    for step in range(STEPS):
        got = gen.trace.get("hook_logits", step)
        want = expected[:, :width] if step == 0 else expected[:, width + step - 1:width + step]
        rows = real[:, :width] if step == 0 else torch.ones(B, 1, dtype=torch.bool)
        assert (got - want)[rows].abs().max() <= 1e-4, step


def test_readings_that_need_a_weight_read_the_offloaded_copy(directory):
    from transformers import AutoModelForCausalLM

    offloaded, tok = load_hf(directory, max_memory=third_of_the_weights(directory))
    in_memory, _ = load_hf(directory, implementation="transformers")
    assert offloaded.hf.get_output_embeddings().weight.device.type == "meta"  # W_U is on disk
    assert torch.equal(offloaded.w_u, in_memory.w_u)
    gen, ref_gen = run(offloaded, tok), run(in_memory, tok)
    for step in (0, STEPS - 1):
        lens = logit_lens(gen.trace, step, 1, model=offloaded)
        assert lens.equals(logit_lens(ref_gen.trace, step, 1, model=in_memory))
    grads = gradient_trace(gen, 1, GRADIENT_LOSSES[1])
    ref_grads = gradient_trace(ref_gen, 1, GRADIENT_LOSSES[1])
    for rec in ref_grads.records:
        if ref_grads.has_value(rec):
            assert torch.allclose(grads.get(rec.name, 0), ref_grads.get(rec.name, 0), atol=1e-6), rec.name
    # the identity: a loaded model's is its files' digest; a model offloaded in Python hashes its tensors,
    # reading each offloaded one back, and so agrees with the same weights in memory
    assert offloaded.identity == in_memory.identity
    hf_off = AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, device_map="auto", max_memory={"cpu": third_of_the_weights(directory)},
        offload_folder=tempfile.mkdtemp(prefix="offload-py-"))
    hf_mem = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    assert HFDecoder(hf_off).identity.weights_digest == HFDecoder(hf_mem).identity.weights_digest
    with torch.no_grad():
        hf_mem.get_output_embeddings().weight[0, 0] += 1  # a changed weight changes the digest
    assert HFDecoder(hf_off).identity.weights_digest != HFDecoder(hf_mem).identity.weights_digest
    path = save_trace(gen.trace, Path(tempfile.mkdtemp(prefix="offload-trace-")) / "t.zip")
    assert load_trace(path).model == gen.trace.model


def test_offloaded_weights_are_read_from_the_directory_and_the_offload_folder_is_private(directory):
    model, _ = load_hf(directory, max_memory=third_of_the_weights(directory))
    hook = next(h for m in model.hf.modules() if (h := getattr(m, "_hf_hook", None)) is not None
                and getattr(h, "weights_map", None) is not None)
    loader = hook.weights_map.dataset
    # safetensors weights are read in place, memory-mapped, from the directory's own files at each forward
    assert {Path(entry["safetensors_file"]).parent for entry in loader.index.values()} == {directory}
    folder = Path(loader.save_folder)  # where accelerate would write weights it had to convert
    assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700
    del model, hook, loader
    gc.collect()
    assert not folder.exists()
    chosen = Path(tempfile.mkdtemp(prefix="offload-mine-")) / "weights"
    model, _ = load_hf(directory, max_memory=third_of_the_weights(directory), offload_folder=chosen)
    assert "disk" in model.offloaded.values()
    del model
    gc.collect()
    assert chosen.is_dir()  # a folder the user named is theirs to keep


@pytest.mark.parametrize("amount", ["lots", "-1GB", 0, True, {"cpu": "2 parsecs"}])
def test_an_amount_that_is_not_memory_is_refused_by_name(directory, amount, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the private offload folder would go
    with pytest.raises(ModelLoadError, match="is not an amount of memory"):
        load_hf(directory, max_memory=amount)
    assert list(tmp_path.iterdir()) == []  # refused before any offload folder was made



@pytest.mark.parametrize("amount, message", [
    ("80XB", "'80XB' is not an amount of memory"),
    ("-5GB", "'-5GB' is not an amount of memory"),
    (-5, "-5 is not an amount of memory"),
    (10**30, "is 1,000,000,000,000,000,000,000,000,000,000 bytes, more than the [0-9,]+ bytes of this machine"),
    ({"gpu": "1GB"}, "keys are GPU numbers .* and 'cpu', not 'gpu'"),
    ({4096: "1GB"}, "names GPU 4096, but this machine has"),
])
def test_max_memory_is_refused_with_the_reason_before_any_weight_is_read(directory, amount, message, monkeypatch):
    import gpt_shape_tracer.model.sources._load as loading
    from gpt_shape_tracer.model import load_model

    def weights_read(*args, **kwargs):
        raise AssertionError("the weights were read before max_memory was checked")

    monkeypatch.setattr(loading, "load_hf_decoder", weights_read)
    for load in (load_hf, load_model):
        with pytest.raises(ModelLoadError, match=message):
            load(directory, max_memory=amount)


@pytest.mark.parametrize("where, message", [
    ("under a file", "is not a folder"),
    ("a file", "is not a folder"),
    ("read-only", "cannot be written"),
    ("without max_memory", "give max_memory too"),
])
def test_an_offload_folder_that_cannot_be_used_is_refused_before_any_weight_is_read(directory, tmp_path, where,
                                                                                    message, monkeypatch):
    import gpt_shape_tracer.model.sources._load as loading
    from gpt_shape_tracer.model import load_model

    def weights_read(*args, **kwargs):
        raise AssertionError("the weights were read before the offload folder was checked")

    monkeypatch.setattr(loading, "load_hf_decoder", weights_read)
    (tmp_path / "file").write_text("not a folder")
    folder = {"under a file": tmp_path / "file" / "offload", "a file": tmp_path / "file",
              "read-only": Path("/proc/gpt-shape-tracer-offload"),  # a read-only file system: root cannot either
              "without max_memory": tmp_path / "offload"}[where]
    amount = None if where == "without max_memory" else third_of_the_weights(directory)
    for load in (load_hf, load_model):
        with pytest.raises(ModelLoadError, match=message):
            load(directory, max_memory=amount, offload_folder=folder)
    assert not (tmp_path / "offload").exists()

def test_offloading_is_refused_where_it_cannot_happen(directory, tmp_path):
    with pytest.raises(ModelLoadError, match="needs transformers to run the model"):
        load_hf(directory, max_memory="1GiB", implementation="ours")
    done = subprocess.run([sys.executable, "-m", "gpt_shape_tracer", "trace", "--prompt", "Hi", "--max-memory",
                           "1GiB", "--out", str(tmp_path / "t.zip")], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONPATH": "."})
    assert done.returncode == 2 and "--max-memory goes with --model-dir" in done.stderr


def test_the_cli_traces_an_offloaded_model_to_a_file_that_loads(directory, tmp_path):
    out = tmp_path / "t.zip"
    done = subprocess.run([sys.executable, "-m", "gpt_shape_tracer", "trace", "--prompt", PROMPTS[0], "--steps", "2",
                           "--model-dir", str(directory), "--max-memory", str(third_of_the_weights(directory)),
                           "--out", str(out), "--json"], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2],
                          # as many threads as this process (a pytest-xdist worker runs one): compared bit for bit
                          env={**os.environ, "PYTHONPATH": ".", "OMP_NUM_THREADS": str(torch.get_num_threads())})
    assert done.returncode == 0, done.stderr
    in_memory, tok = load_hf(directory, implementation="transformers")
    gen = TracedGeneration(in_memory, tok, [PROMPTS[0]], temperature=0)
    gen.run(2)
    loaded = load_trace(out)
    for step in range(2):
        assert torch.equal(loaded.get("hook_logits", step), gen.trace.get("hook_logits", step))
