"""load_hf_gpt2: what loads, and the clear error for everything that should not."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import ModelLoadError, load_hf_gpt2


@pytest.fixture()
def checkpoint(hf_pair, tmp_path) -> Path:
    _, _, directory = hf_pair
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    return target


def test_loads_safetensors_and_reports_no_tokenizer(checkpoint):
    model, tok = load_hf_gpt2(checkpoint)
    assert tok is None
    assert model.config.n_layer == 3 and model.config.vocab_size == 211
    assert not any(p.requires_grad for p in model.parameters())


def test_loads_pytorch_model_bin_with_weights_only(checkpoint, hf_pair):
    hf, ours, _ = hf_pair
    (checkpoint / "model.safetensors").unlink()
    torch.save(hf.state_dict(), checkpoint / "pytorch_model.bin")
    model, _ = load_hf_gpt2(checkpoint)
    tokens = torch.arange(10)[None]
    assert torch.allclose(model(tokens), ours(tokens), atol=1e-6)


def test_a_small_bin_of_stride_0_views_declaring_16_gib_is_refused_before_allocating(checkpoint, hf_pair):
    """A few kilobytes of pytorch_model.bin whose embedding is one float expanded (stride 0) to 2³² elements: its
    copy would allocate 16 GiB (an untyped RuntimeError, or the memory); refused naming the tensor and the bytes."""
    hf, _, _ = hf_pair
    (checkpoint / "model.safetensors").unlink()
    state = dict(hf.state_dict())
    state["transformer.wte.weight"] = torch.zeros(1).expand(2**20, 2**12)
    torch.save(state, checkpoint / "pytorch_model.bin")
    assert (checkpoint / "pytorch_model.bin").stat().st_size < 2**20
    with pytest.raises(ModelLoadError, match=r"transformer.wte.weight declares shape \[1048576, 4096\] "
                                             r"\(17179869184 bytes\) over 4 bytes"):
        load_hf_gpt2(checkpoint)


def test_loads_tokenizer_json_and_vocab_merges(hf_dir_with_tokenizer, bundled, tmp_path):
    _, tok = bundled
    checkpoint = tmp_path / "with-tokenizer"
    shutil.copytree(hf_dir_with_tokenizer, checkpoint)
    _, loaded = load_hf_gpt2(checkpoint)
    assert loaded is not None and loaded.encode("Lily had a ball.") == tok.encode("Lily had a ball.")
    # GPT-2's original two files: vocab.json + merges.txt
    (checkpoint / "tokenizer.json").unlink()
    tok.backend.model.save(str(checkpoint))
    assert (checkpoint / "vocab.json").exists() and (checkpoint / "merges.txt").exists()
    _, loaded = load_hf_gpt2(checkpoint)
    text = "Once upon a time, Tom had a kite."
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text


def error_of(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_hf_gpt2(path)
    return str(info.value)


def test_missing_directory(tmp_path):
    assert "no such directory" in error_of(tmp_path / "nope")


def test_file_instead_of_directory(checkpoint):
    msg = error_of(checkpoint / "config.json")
    assert "is a file, not a directory" in msg


def test_directory_without_config(tmp_path):
    msg = error_of(tmp_path)
    assert "config.json" in msg and "missing" in msg


def test_config_not_json(checkpoint):
    (checkpoint / "config.json").write_text("{ not json")
    msg = error_of(checkpoint)
    assert "config.json" in msg and "not valid JSON" in msg


def test_load_hf_gpt2_refuses_other_families(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["model_type"] = "llama"
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    assert "model_type is 'llama'" in error_of(checkpoint)


def test_config_weights_shape_mismatch(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["n_embd"] = 128  # still divisible by 4 heads, but the stored weights are 64 wide
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    msg = error_of(checkpoint)
    assert "model.safetensors" in msg and "has shape" in msg and "config.json implies" in msg


def test_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    assert "no weights found" in error_of(checkpoint)


def test_truncated_safetensors(checkpoint):
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    msg = error_of(checkpoint)
    assert "model.safetensors" in msg and "not a readable safetensors file" in msg


def test_garbage_safetensors_with_huge_header(checkpoint):
    (checkpoint / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    assert "not a readable safetensors file" in error_of(checkpoint)


class Payload:
    """Unpickling this would create a file: the loader must never run it."""

    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_payload_in_bin_is_refused_and_never_runs(checkpoint, tmp_path):
    (checkpoint / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    payload = Payload()
    payload.marker = marker
    with open(checkpoint / "pytorch_model.bin", "wb") as f:
        pickle.dump({"transformer.wte.weight": payload}, f)
    msg = error_of(checkpoint)
    assert "pytorch_model.bin" in msg and "refused" in msg
    assert not marker.exists()


def rebuild_with_no_arguments() -> bytes:
    """A torch.save zip whose pickle calls torch._utils._rebuild_tensor_v2 (an allowed function) with no
    arguments: weights_only lets the call through, and it raises TypeError."""
    import io
    import zipfile

    saved = io.BytesIO()
    torch.save({"transformer.wte.weight": torch.ones(2)}, saved)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved.getvalue())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n)R." if info.filename.endswith("data.pkl")
                         else src.read(info))
    return out.getvalue()


def test_a_pickle_that_breaks_an_allowed_call_is_a_load_error_not_a_traceback(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "pytorch_model.bin").write_bytes(rebuild_with_no_arguments())
    msg = error_of(checkpoint)
    assert "pytorch_model.bin" in msg and "not a readable PyTorch weights file (TypeError" in msg


def test_symlink_loop(tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    assert "cannot resolve" in error_of(loop)


def test_corrupt_tokenizer_json(checkpoint):
    (checkpoint / "tokenizer.json").write_text("{}")
    msg = error_of(checkpoint)
    assert "tokenizer.json" in msg and "not a readable tokenizer" in msg



@pytest.mark.parametrize("implementation", ["ours", "transformers"])
def test_a_corrupt_tokenizer_json_is_refused_before_any_weight_is_read(checkpoint, implementation, monkeypatch):
    """A tokenizer.json beside gigabytes of weights: named before the weights are read, not after."""
    import gpt_shape_tracer.model.sources._hf_ours as ours
    import gpt_shape_tracer.model.sources._load as loading
    from gpt_shape_tracer.model import load_hf

    def weights_read(*args, **kwargs):
        raise AssertionError("the weights were read before the tokenizer was checked")

    monkeypatch.setattr(ours, "BackgroundDigest", weights_read)  # the first reader of the weight files
    monkeypatch.setattr(loading, "load_hf_decoder", weights_read)
    (checkpoint / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": [')  # cut short
    with pytest.raises(ModelLoadError, match="tokenizer.json: not a readable tokenizer"):
        load_hf(checkpoint, implementation=implementation)

def test_tokenizer_larger_than_model_vocab(checkpoint, bundled):
    _, tok = bundled  # 1024 tokens, but this model knows only 211
    tok.save(checkpoint / "tokenizer.json")
    assert "the tokenizer has 1024 tokens" in error_of(checkpoint)


def test_shards_must_stay_inside_the_directory(checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "../../etc/passwd"}})
    )
    assert "outside the checkpoint directory" in error_of(checkpoint)


# ---- every family: load_hf, and the hostile inputs it must refuse clearly ---------------------------------------


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory) -> Path:
    """A tiny random Llama (4 layers, 4 query heads sharing 2 key/value heads) saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    directory = tmp_path_factory.mktemp("llama-src")
    LlamaForCausalLM(cfg).eval().save_pretrained(directory)
    return directory


@pytest.fixture()
def llama_dir(llama_source, tmp_path) -> Path:
    target = tmp_path / "llama"
    shutil.copytree(llama_source, target)
    return target


def load_error(path, **kwargs) -> str:
    from gpt_shape_tracer.model import load_hf

    with pytest.raises(ModelLoadError) as info:
        load_hf(path, **kwargs)
    return str(info.value)


def edit_config(directory: Path, **changes) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))  # json writes NaN as NaN, as Python reads it


def test_load_hf_reads_a_llama_and_names_it(llama_dir):
    from gpt_shape_tracer.model import load_hf

    model, tok = load_hf(llama_dir)
    assert tok is None and model.config.family == "llama" and model.config.n_kv_heads == 2
    assert model.identity.name == "llama" and model.identity.source == str(llama_dir.resolve())
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("model_type", ["no-such-model", None, 7])
def test_unknown_model_type_lists_the_supported_ones(llama_dir, model_type):
    edit_config(llama_dir, model_type=model_type)
    msg = load_error(llama_dir)
    assert "config.json" in msg and f"model_type is {model_type!r}" in msg
    assert "neither one of the families re-implemented here (gpt2, llama, mistral, qwen2) nor a model type" in msg


def test_an_encoder_is_refused_by_name(llama_dir):
    edit_config(llama_dir, model_type="bert")
    msg = load_error(llama_dir)
    assert "bert is configured as an encoder (is_decoder = false)" in msg
    assert "is_decoder = true it is a causal decoder" in msg


def test_a_config_claiming_20000_layers_is_refused_before_anything_is_built(llama_dir):
    edit_config(llama_dir, num_hidden_layers=20000)
    msg = load_error(llama_dir)
    assert "says n_layer = 20000, but the weights hold 4 layers (blocks 0–3)" in msg


@pytest.mark.parametrize("changes, expected", [
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "head counts that do not divide"),
    ({"rms_norm_eps": float("nan")}, "layer_norm_eps must be a finite number > 0, got nan"),
    ({"rms_norm_eps": -1e-6}, "layer_norm_eps must be a finite number > 0"),
    ({"rms_norm_eps": 0}, "layer_norm_eps must be a finite number > 0"),
    ({"vocab_size": 2**64}, "vocab_size = 18446744073709551616 is absurdly large"),
    ({"vocab_size": "many"}, "vocab_size must be a positive integer"),
    ({"hidden_size": None}, "d_model must be a positive integer"),
    ({"num_hidden_layers": [4]}, "n_layer must be a positive integer"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not SiLU"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not implemented"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn' is not implemented"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type 'longrope' is not implemented"),
    ({"rope_parameters": {"rope_type": "linear"}}, "missing key 'factor'"),
    ({"rope_parameters": "fast"}, "must be an object"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    ({"intermediate_size": 64}, "mlp."),  # the first of gate/up/down_proj in the header: all three disagree
    ({"model_type": "mistral", "sliding_window": -3}, "sliding_window must be a positive integer"),
])
def test_bad_configs_are_refused_with_the_file_and_the_problem(llama_dir, changes, expected):
    edit_config(llama_dir, **changes)
    msg = load_error(llama_dir)
    assert expected in msg, msg
    assert str(llama_dir.resolve()) in msg
    if "intermediate_size" in changes:
        assert "but config.json implies" in msg and "64" in msg


def test_a_tied_llama_ignores_a_stored_lm_head_like_hugging_face(tmp_path):
    """The converse of the last case above: tied, with no lm_head stored, is the normal tied layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpt_shape_tracer.model import load_hf

    torch.manual_seed(4)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=101, tie_word_embeddings=True)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    model, _ = load_hf(tmp_path)
    tokens = torch.arange(1, 9)[None]
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
    assert not hasattr(model, "unembed")
    edit_config(tmp_path, tie_word_embeddings=False)  # now the weights lack the W_U the config implies
    assert "the weights lack 1 tensor(s) config.json implies: lm_head.weight" in load_error(tmp_path)


def test_sharded_safetensors_load_and_hash_every_shard(llama_source, tmp_path):
    from transformers import LlamaForCausalLM

    from gpt_shape_tracer.model import load_hf

    hf = LlamaForCausalLM.from_pretrained(llama_source).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    model, _ = load_hf(tmp_path)
    tokens = torch.arange(1, 11)[None]
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
    import hashlib

    h = hashlib.sha256()
    for shard in shards:  # the digest: every shard's bytes, in name order
        h.update(shard.read_bytes())
    assert model.identity.weights_digest == "sha256:" + h.hexdigest()


def test_a_missing_shard_is_named(llama_source, tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(llama_source).save_pretrained(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    msg = load_error(tmp_path)
    assert victim.name in msg and "missing (listed by the index)" in msg


@pytest.mark.parametrize("index, expected", [
    ([1, 2, 3], "expected a JSON object, got list"),
    ({"weight_map": ["model.safetensors"]}, "no \"weight_map\" object"),
    ({"weight_map": {"model.embed_tokens.weight": 5}}, "shard names must be strings, got 5"),
    ({"weight_map": {"model.embed_tokens.weight": None}}, "shard names must be strings, got None"),
    ({"weight_map": {"model.embed_tokens.weight": "/etc/passwd"}}, "lies outside the checkpoint directory"),
    ({"weight_map": {"model.embed_tokens.weight": "sub/../../x.safetensors"}}, "lies outside"),
])
def test_hostile_indexes_are_refused(llama_dir, index, expected):
    (llama_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = load_error(llama_dir)
    assert "model.safetensors.index.json" in msg and expected in msg, msg


def test_a_hugging_face_cache_snapshot_loads_through_its_symlinks(llama_source, tmp_path):
    """models--org--name/snapshots/<hash>/ holds symlinks into ../../blobs/: they are inside as written."""
    import hashlib

    from transformers import LlamaForCausalLM

    from gpt_shape_tracer.model import load_hf

    staged = tmp_path / "staged"
    LlamaForCausalLM.from_pretrained(llama_source).save_pretrained(staged, max_shard_size="20KB")
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in staged.iterdir():
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        (blobs / blob).write_bytes(file.read_bytes())
        os.symlink(Path("..") / ".." / "blobs" / blob, snapshot / file.name)
    assert (snapshot / "config.json").is_symlink()
    model, _ = load_hf(snapshot)
    assert model.identity.name == "acme/tiny-llama" and model.config.n_layer == 4
    # an index that itself names a path outside is still refused
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../blobs/" + os.readlink(snapshot / "config.json").split("/")[-1]
    (snapshot / "model.safetensors.index.json").unlink()
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "lies outside the checkpoint directory" in load_error(snapshot)


@pytest.mark.parametrize("path, expected", [
    ("~nosuchuser-xyz/model", "cannot expand the home directory"),
    ("models/with\x00nul", "not a usable path"),
    (12345, "must be a string or a path"),
])
def test_hostile_paths_are_refused(path, expected):
    assert expected in load_error(path)


def test_dtype_and_device_are_checked(llama_dir):
    from gpt_shape_tracer.model import load_hf

    assert "dtype 'int8' is not supported" in load_error(llama_dir, dtype="int8")
    assert "not supported" in load_error(llama_dir, dtype=torch.int64)
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in load_error(llama_dir, device="cuda")
    assert "is not supported: use 'cpu' or 'cuda'" in load_error(llama_dir, device="meta")
    model, _ = load_hf(llama_dir, dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("header, expected", [
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, "declares bytes 0–8 for 16 bytes"),
    ({"x": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, "malformed entry"),
    ({"x": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, "malformed entry"),
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "y": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, "overlaps"),
])
def test_inconsistent_safetensors_headers_are_refused(llama_dir, header, expected):
    from gpt_shape_tracer.model.sources import SafetensorsFile

    raw = json.dumps(header).encode()
    path = llama_dir / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(32))

    with pytest.raises(ModelLoadError, match="not a readable safetensors file") as info:
        SafetensorsFile(path)
    assert expected in str(info.value)


def test_our_gpt_is_returned_before_its_files_are_hashed_and_its_identity_waits_for_the_hash(llama_dir,
                                                                                             monkeypatch):
    """load_hf does not wait for the identity's hash of the weight files: the first reader of model.identity
    does, and gets the sha256 of the files' bytes. A hash that fails (files moved or changed after the load)
    is a clear error naming the directory, raised where the identity is asked for."""
    import hashlib
    import threading

    import gpt_shape_tracer.model.gpt._identity as identity_module
    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.gpt import IdentityUnavailable

    real = identity_module.files_digest
    gate, waited_out = threading.Event(), []

    def held_back(files, **kwargs):  # the hash cannot finish before the test lets it
        waited_out.append(not gate.wait(30))
        return real(files, **kwargs)

    monkeypatch.setattr(identity_module, "files_digest", held_back)
    model, _ = load_hf(llama_dir)  # would wait out the 30 s if it waited for the hash
    gate.set()
    copied = copy.deepcopy(model)  # copied (and pickled) while the identity is pending: it comes resolved
    unpickled = pickle.loads(pickle.dumps(model))
    digest = model.identity.weights_digest
    assert waited_out == [False]
    assert digest == "sha256:" + hashlib.sha256((llama_dir / "model.safetensors").read_bytes()).hexdigest()
    assert copied.identity == unpickled.identity == model.identity

    def unreadable(files, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", str(files[0]))

    monkeypatch.setattr(identity_module, "files_digest", unreadable)
    model, _ = load_hf(llama_dir)
    with pytest.raises(IdentityUnavailable, match=f"{llama_dir}: its weight files could not be read again"):
        model.identity  # noqa: B018 - the read is the test


def test_a_released_tensor_reads_the_file_again(tmp_path):
    """The loader lets a weight's mapped pages go once its copy exists (SafetensorsFile.release): the mapping
    is private and never written, so a tensor read after its release still holds the file's values."""
    from safetensors.torch import save_file

    from gpt_shape_tracer.model.sources import SafetensorsFile

    tensors = {"a": torch.randn(1000, 37), "b": torch.arange(5000, dtype=torch.float32)}
    save_file(tensors, tmp_path / "w.safetensors")
    st = SafetensorsFile(tmp_path / "w.safetensors")
    for name, expected in tensors.items():
        assert torch.equal(st.tensor(name), expected)
        st.release(name)
        assert torch.equal(st.tensor(name), expected)


def test_a_view_that_outlives_its_file_object_still_reads_its_values(tmp_path):
    """A view can outlive the loader's SafetensorsFile (kept in an error's traceback, for one): reading it must
    give the file's values, not crash the process on unmapped memory. Run in a child process: a crash there is a
    failed test here, not a dead test run."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    save_file({"a": torch.arange(70000, dtype=torch.float32)}, tmp_path / "w.safetensors")
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); "
            "from gpt_shape_tracer.model.sources import SafetensorsFile; "
            "st = SafetensorsFile(__import__('pathlib').Path(sys.argv[2])); view = st.tensor('a'); "
            "del st; import gc; gc.collect(); print(float(view.double().sum()))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[2]),
                           str(tmp_path / "w.safetensors")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert float(done.stdout.split()[-1]) == float(torch.arange(70000, dtype=torch.float64).sum())


def test_qwen2_sliding_window_on_some_layers_only_is_refused(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=101, use_sliding_window=True, sliding_window=4,
                      max_window_layers=1)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    assert "a sliding window on some layers only (1 of 2" in load_error(tmp_path)


def test_load_bundled_names_its_models():
    from gpt_shape_tracer.model import BUNDLED_MODELS, load_bundled

    assert set(BUNDLED_MODELS) == {"story-gpt", "story-llama"}
    with pytest.raises(ModelLoadError, match="bundled: story-gpt, story-llama"):
        load_bundled("story-bert")


def test_a_tied_config_over_a_distinct_lm_head_loads_as_transformers_does(tmp_path):
    """tie_word_embeddings true, but the file's lm_head.weight is not the embedding: transformers keeps the
    lm_head (it ties only equal or missing weights), so our model must use it too — tying it silently moved
    the logits by ~15."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from gpt_shape_tracer.model import load_hf

    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
                     ).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = torch.randn(64, 32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours, _ = load_hf(tmp_path, implementation="ours")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() <= 1e-4
    assert not ours.config.tie_embeddings


def test_a_model_built_to_be_loaded_draws_nothing_and_one_built_in_python_draws_its_weights():
    """init_normal (model/gpt/_gpt.py): on the meta device (where a loader builds the model to assign the checkpoint's
    weights) nothing is drawn — a meta tensor's normal_ would import torch._dynamo, a second of a first load — and
    the bundled model loads without it; built in Python, W_E is drawn from N(0, 0.02²) and W_pos from N(0, 0.01²)."""
    import subprocess
    import sys

    from gpt_shape_tracer.model.gpt import GPT, GPTConfig

    probe = ("import sys\n"
             "from gpt_shape_tracer.model import load_model\n"
             "from gpt_shape_tracer.model.sources import BUNDLED_DIR\n"
             "load_model(str(BUNDLED_DIR))\n"
             "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, check=True)
    assert done.stdout.split()[-1] == "False", done.stdout
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, n_ctx=1024, d_model=64, n_layer=1, n_head=2))
    embed, positions = model.embed.weight.detach(), model.pos_embed.weight.detach()
    assert abs(float(embed.std()) - 0.02) < 0.001 and abs(float(embed.mean())) < 0.001
    assert abs(float(positions.std()) - 0.01) < 0.0005
