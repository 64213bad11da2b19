"""load_hf_gpt2: what loads, and the clear error for everything that should not."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from model import ModelLoadError, load_hf_gpt2


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


def test_not_a_gpt2_directory(checkpoint):
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


def test_symlink_loop(tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    assert "cannot resolve" in error_of(loop)


def test_corrupt_tokenizer_json(checkpoint):
    (checkpoint / "tokenizer.json").write_text("{}")
    msg = error_of(checkpoint)
    assert "tokenizer.json" in msg and "not a readable tokenizer" in msg


def test_tokenizer_larger_than_model_vocab(checkpoint, bundled):
    _, tok = bundled  # 1024 tokens, but this model knows only 211
    tok.save(checkpoint / "tokenizer.json")
    assert "the tokenizer has 1024 tokens" in error_of(checkpoint)


def test_shards_must_stay_inside_the_directory(checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "../../etc/passwd"}})
    )
    assert "outside the checkpoint directory" in error_of(checkpoint)
