"""Finding a model on this machine: a directory, a Hugging Face cache folder or snapshot, a repo id in the cache.

The cache is built here in huggingface_hub's layout — ``models--org--name/{refs/main, snapshots/<hash>/<file> ->
../../blobs/<sha256>, blobs/<sha256>}`` — around a tiny GPT-2 saved by transformers, and transformers'
``from_pretrained(repo_id, local_files_only=True)`` on the same cache is the reference.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import ModelLoadError, hub_cache_dir, load_hf, load_model, resolve_model_path
from gpt_shape_tracer.model.sources import ASSETS

REPO_ID = "acme/tiny-gpt2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKENS = torch.tensor([[1, 50, 300, 999, 7, 7, 2]])


def tiny_gpt2(directory: Path, seed: int) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=1024, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    GPT2LMHeadModel(config).eval().save_pretrained(directory)
    shutil.copy(ASSETS / "story-gpt" / "tokenizer.json", directory / "tokenizer.json")
    return directory


def add_snapshot(hub: Path, staged: Path, commit: str, repo_id: str = REPO_ID) -> Path:
    """``staged``'s files as a snapshot of ``repo_id`` in the cache ``hub``: blobs named by their sha256, and
    relative symlinks to them from snapshots/<commit>/, as huggingface_hub writes them."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(staged.iterdir()):
        sha = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blobs / sha)
        os.symlink(Path("..") / ".." / "blobs" / sha, snapshot / file.name)
    return snapshot


@pytest.fixture()
def hub(tmp_path, monkeypatch) -> Path:
    hub = tmp_path / "hub"
    add_snapshot(hub, tiny_gpt2(tmp_path / "staged", seed=5), COMMIT)
    refs = hub / "models--acme--tiny-gpt2" / "refs"
    refs.mkdir()
    (refs / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


def reference_logits(hub: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(REPO_ID, local_files_only=True, cache_dir=str(hub)).eval()
    with torch.no_grad():
        return hf(TOKENS).logits


def test_a_repo_id_its_cache_folder_and_its_snapshot_all_load(hub):
    expected = reference_logits(hub)
    repo = hub / "models--acme--tiny-gpt2"
    snapshot = repo / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").is_symlink()
    for spec in (REPO_ID, repo, str(repo), snapshot):
        assert resolve_model_path(spec) == snapshot
        model, tok = load_model(spec)
        assert model.identity.name == REPO_ID and model.identity.source == str(snapshot)
        assert (model(TOKENS) - expected).abs().max() <= 1e-4
        assert tok is not None and tok.eos_ids == (0,)  # config.json's eos_token_id


def test_refs_main_chooses_the_snapshot_else_the_newest(hub, tmp_path):
    repo = hub / "models--acme--tiny-gpt2"
    newer = add_snapshot(hub, tiny_gpt2(tmp_path / "staged-2", seed=6), "fedcba9876543210fedcba9876543210fedcba98")
    os.utime(newer, (2e9, 2e9))
    assert resolve_model_path(REPO_ID) == repo / "snapshots" / COMMIT  # refs/main names the older one
    (repo / "refs" / "main").write_text("../../../etc")  # not a commit: ignored
    assert resolve_model_path(REPO_ID) == newer
    (repo / "refs" / "main").unlink()
    assert resolve_model_path(repo) == newer
    shutil.rmtree(repo / "snapshots")
    (repo / "snapshots").mkdir()
    with pytest.raises(ModelLoadError, match="holds no snapshot"):
        resolve_model_path(REPO_ID)


@pytest.mark.parametrize("kind", ["sparse 2 GiB file", "fifo", "/dev/zero"])
def test_a_refs_main_that_is_huge_a_fifo_or_endless_is_refused_without_reading_it(hub, kind):
    """A ref holds one commit hash: a sparse 2 GiB file was read whole (2.3 GiB peak); a FIFO would block the
    open or the read; /dev/zero never ends. Each is refused by what it is, reading at most a few hundred bytes."""
    ref = hub / "models--acme--tiny-gpt2" / "refs" / "main"
    ref.unlink()
    if kind == "fifo":
        os.mkfifo(ref)
        expected = "not a regular file"
    elif kind == "/dev/zero":
        ref.symlink_to("/dev/zero")
        expected = "not a regular file"
    else:
        with open(ref, "wb") as f:
            f.write(COMMIT.encode())
            f.truncate(2 * 2**30)  # sparse: no disk used
        expected = f"holds {2 * 2**30} bytes"
    with pytest.raises(ModelLoadError, match=expected):
        resolve_model_path(REPO_ID)


def test_the_cache_is_found_where_huggingface_hub_looks(tmp_path, monkeypatch):
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hub_cache_dir() == tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "explicit"))
    assert hub_cache_dir() == tmp_path / "explicit"


def test_an_unknown_model_names_every_place_it_looked(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load_model("acme/absent-model")
    msg = str(info.value)
    assert "acme/absent-model (no such directory or file)" in msg
    assert str(hub / "models--acme--absent-model") in msg and "Nothing is downloaded" in msg
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path("../not/a-repo/id")  # not a repo id: only the path is tried
    assert "local Hugging Face cache" not in str(info.value)
    for bad, expected in (("", "no model named"), ("a\x00b", "NUL byte"), (17, "not a int")):
        with pytest.raises(ModelLoadError, match=expected):
            resolve_model_path(bad)


def test_a_plain_directory_still_loads(hub, tmp_path):
    plain = tiny_gpt2(tmp_path / "plain", seed=5)
    model, _ = load_model(plain)
    assert model.identity.name == "plain"
    assert (model(TOKENS) - reference_logits(hub)).abs().max() <= 1e-4


def test_links_into_the_repos_blobs_are_fine_and_links_elsewhere_are_refused(hub, tmp_path):
    snapshot = hub / "models--acme--tiny-gpt2" / "snapshots" / COMMIT
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(snapshot / "config.json", outside / "config.json")
    (snapshot / "config.json").unlink()
    os.symlink(outside / "config.json", snapshot / "config.json")
    with pytest.raises(ModelLoadError, match="outside the checkpoint directory or its Hugging Face cache blobs"):
        load_model(REPO_ID)
    # another repository's blobs are elsewhere too
    other = add_snapshot(hub, tiny_gpt2(tmp_path / "staged-other", seed=7), COMMIT, repo_id="evil/other")
    (snapshot / "config.json").unlink()
    os.symlink(os.path.relpath(other / "config.json", snapshot), snapshot / "config.json")
    with pytest.raises(ModelLoadError, match="outside the checkpoint directory"):
        load_hf(snapshot)
    # a plain directory whose weights link out of it
    plain = tiny_gpt2(tmp_path / "plain", seed=5)
    (plain / "model.safetensors").rename(outside / "model.safetensors")
    os.symlink(outside / "model.safetensors", plain / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.safetensors: a symlink to .* outside the checkpoint directory"):
        load_hf(plain)


def test_the_cli_takes_a_repo_id(hub, tmp_path, capsys):
    from gpt_shape_tracer.trace_command import main

    out = tmp_path / "t.zip"
    code = main(["--prompt", "Lily had", "--steps", "2", "--model-dir", REPO_ID, "--no-stop-at-eos",
                 "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert out.exists() and "step 1: n = 1, t = 3" in captured.out
    code = main(["--prompt", "Lily", "--model-dir", "acme/nothing-here", "--out", str(out)])
    assert code == 2 and "no model found" in capsys.readouterr().err
