"""nanoGPT ``ckpt.pt`` checkpoints: built here in nanoGPT's own layout, loaded, and compared with a forward
written below in plain torch ops (exact GELU, LayerNorm with or without β, causal attention).

The reference takes nanoGPT's ``nn.Linear`` weights as they are stored, ``[d_out, d_in]``, and computes
``x·Wᵀ + b``; our model holds them transposed. A tanh-GELU variant of the reference is checked to differ, so the
comparison would catch the wrong GELU.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import ModelLoadError, load_model, load_nanogpt, save_hf
from gpt_shape_tracer.model.sources import ASSETS, COMPILED_PREFIX
from gpt_shape_tracer.tracer import TracedGeneration

BUNDLED_TOKENIZER = ASSETS / "story-gpt" / "tokenizer.json"  # vocab 1024, GPT-2-style byte-level BPE
V, D, H, L, N_CTX = 1024, 32, 4, 2, 24


def nanogpt_checkpoint(bias: bool, seed: int = 0, tied: bool = True) -> dict:
    """What nanoGPT's train.py saves: the model's state dict (nn.Linear [out, in]), model_args, and the rest."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    sd: dict[str, torch.Tensor] = {"transformer.wte.weight": rand(V, D), "transformer.wpe.weight": rand(N_CTX, D)}

    def linear(name: str, d_out: int, d_in: int) -> None:
        sd[name + ".weight"] = rand(d_out, d_in, std=1 / math.sqrt(d_in))
        if bias:
            sd[name + ".bias"] = rand(d_out, std=0.1)

    def layer_norm(name: str) -> None:
        sd[name + ".weight"] = 1 + rand(D, std=0.1)
        if bias:
            sd[name + ".bias"] = rand(D, std=0.1)

    for i in range(L):
        p = f"transformer.h.{i}."
        layer_norm(p + "ln_1")
        linear(p + "attn.c_attn", 3 * D, D)
        linear(p + "attn.c_proj", D, D)
        sd[p + "attn.bias"] = torch.ones(N_CTX, N_CTX).tril().view(1, 1, N_CTX, N_CTX)  # the non-flash causal mask
        layer_norm(p + "ln_2")
        linear(p + "mlp.c_fc", 4 * D, D)
        linear(p + "mlp.c_proj", D, 4 * D)
    layer_norm("transformer.ln_f")
    sd["lm_head.weight"] = sd["transformer.wte.weight"] if tied else rand(V, D)  # tied: one storage, as nanoGPT
    return {
        "model": sd,
        "model_args": {"n_layer": L, "n_head": H, "n_embd": D, "block_size": N_CTX, "bias": bias, "vocab_size": V,
                       "dropout": 0.0},
        "iter_num": 250, "best_val_loss": torch.tensor(1.25),
        "config": {"dataset": "shakespeare", "learning_rate": 1e-3, "compile": True},
        "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1]}]},
    }


def reference_logits(sd: dict[str, torch.Tensor], idx: torch.Tensor, exact_gelu: bool = True) -> torch.Tensor:
    """nanoGPT's GPT.forward in plain ops, for token ids [B, n] -> logits [B, n, V]."""
    B, n = idx.shape

    def layer_norm(x: torch.Tensor, name: str) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + 1e-5) * sd[name + ".weight"]
        return y + sd[name + ".bias"] if name + ".bias" in sd else y

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ sd[name + ".weight"].T  # [B,n,d_in] @ [d_in,d_out]
        return y + sd[name + ".bias"] if name + ".bias" in sd else y

    def gelu(x: torch.Tensor) -> torch.Tensor:
        if exact_gelu:
            return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:n]  # [B,n,d]
    causal = torch.ones(n, n).tril().bool()  # [n, t]
    d_head = D // H
    for i in range(L):
        p = f"transformer.h.{i}."
        q, k, v = linear(layer_norm(x, p + "ln_1"), p + "attn.c_attn").split(D, dim=2)  # 3 × [B,n,d]
        q, k, v = (t.view(B, n, H, d_head).transpose(1, 2) for t in (q, k, v))  # [B,H,n,d_head]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d_head)  # [B,H,n,t]
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        z = (weights @ v).transpose(1, 2).reshape(B, n, D)  # [B,n,d]
        x = x + linear(z, p + "attn.c_proj")
        x = x + linear(gelu(linear(layer_norm(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return layer_norm(x, "transformer.ln_f") @ sd["lm_head.weight"].T  # [B,n,d] @ [d,V]


def save(ckpt: dict, path: Path, prefix: str = "") -> Path:
    if prefix:
        ckpt = {**ckpt, "model": {prefix + k: v for k, v in ckpt["model"].items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


TOKENS = torch.tensor([[5, 99, 870, 3, 3, 41, 1000, 7], [0, 1, 2, 3, 4, 5, 6, 1023]])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("prefix", ["", COMPILED_PREFIX], ids=["plain", "compiled"])
def test_logits_match_a_reference_forward(tmp_path, bias, prefix):
    ckpt = nanogpt_checkpoint(bias)
    file = save(ckpt, tmp_path / "out" / "ckpt.pt", prefix)
    model, tok = load_nanogpt(file, tokenizer=BUNDLED_TOKENIZER)
    c = model.config
    assert (c.activation, c.norm_bias, c.qkv_bias, c.attn_out_bias, c.mlp_bias) == ("gelu", bias, bias, bias, bias)
    assert c.tie_embeddings and c.n_ctx == N_CTX and c.family == "gpt2"
    assert (model.blocks[0].ln1.bias is None) == (not bias)
    expected = reference_logits(ckpt["model"], TOKENS)
    got = model(TOKENS)
    assert (got - expected).abs().max() <= 1e-5
    # the comparison tells the two GELUs apart: GPT-2's tanh form is visibly off on these weights
    assert (got - reference_logits(ckpt["model"], TOKENS, exact_gelu=False)).abs().max() > 1e-4
    # cached decoding agrees with the full forward
    cache = model.new_cache(2)
    model(TOKENS[:, :5], cache)
    assert (model(TOKENS[:, 5:], cache) - got[:, 5:]).abs().max() <= 1e-5
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    assert model.identity.weights_digest == "sha256:" + digest and model.identity.name == "out"
    assert tok is not None and tok.decode(tok.encode("Lily had a ball.")) == "Lily had a ball."


def test_an_untied_lm_head_gets_its_own_unembedding(tmp_path):
    ckpt = nanogpt_checkpoint(bias=True, seed=3, tied=False)
    model, tok = load_nanogpt(save(ckpt, tmp_path / "untied.pt"))
    assert not model.config.tie_embeddings and tok is None and model.identity.name == "untied"
    assert (model(TOKENS) - reference_logits(ckpt["model"], TOKENS)).abs().max() <= 1e-5


def test_the_tokenizer_beside_the_checkpoint_and_every_way_to_name_it(tmp_path):
    ckpt = nanogpt_checkpoint(bias=False, seed=1)
    out = tmp_path / "out-stories"
    file = save(ckpt, out / "ckpt.pt")
    model, tok = load_nanogpt(file)
    assert tok is None  # nanoGPT's tiktoken BPE is not here, and nothing lies beside the checkpoint
    shutil.copy(BUNDLED_TOKENIZER, out / "tokenizer.json")
    expected = reference_logits(ckpt["model"], TOKENS)
    for spec in (out, file, str(file)):
        model, tok = load_model(spec)
        assert tok is not None and tok.eos_ids == ()  # no config declares an end-of-sequence id
        assert (model(TOKENS) - expected).abs().max() <= 1e-5
    ids = tok.encode("Once upon a time, Lily had a red ball.")
    assert tok.decode(ids) == "Once upon a time, Lily had a red ball."
    # a trace runs on it
    gen = TracedGeneration(model, tok, "Lily had a", temperature=0)
    assert gen.run(3) == 3 and gen.text().startswith("Lily had a")
    # an explicit tokenizer that knows more ids than the model is refused
    small = nanogpt_checkpoint(bias=False)
    small["model_args"]["vocab_size"] = 1000
    small["model"]["transformer.wte.weight"] = small["model"]["transformer.wte.weight"][:1000]
    small["model"]["lm_head.weight"] = small["model"]["transformer.wte.weight"]
    with pytest.raises(ModelLoadError, match="the tokenizer has 1024 tokens"):
        load_nanogpt(save(small, tmp_path / "small.pt"), tokenizer=BUNDLED_TOKENIZER)


class Payload:
    """Unpickling this would run Path.touch(marker)."""

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_holding_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    payload = Payload()
    payload.marker = marker
    ckpt = nanogpt_checkpoint(bias=True)
    ckpt["config"] = payload
    file = tmp_path / "ckpt.pt"
    torch.save(ckpt, file)
    with pytest.raises(ModelLoadError) as info:
        load_nanogpt(file)
    msg = str(info.value)
    assert "ckpt.pt" in msg and "refused" in msg and "weights_only=True" in msg and "Unsupported global" in msg, msg
    assert not marker.exists()
    for protocol in (2, pickle.HIGHEST_PROTOCOL):  # a plain pickle (not torch.save's zip) holding the same
        with open(file, "wb") as f:
            pickle.dump({"model": payload}, f, protocol=protocol)
        with pytest.raises(ModelLoadError, match="refused|not a readable PyTorch checkpoint"):
            load_nanogpt(file)
        assert not marker.exists()


def test_a_pickle_that_breaks_an_allowed_call_is_a_load_error(tmp_path):
    from tests.model.test_model_loading import rebuild_with_no_arguments

    file = tmp_path / "ckpt.pt"
    file.write_bytes(rebuild_with_no_arguments())
    with pytest.raises(ModelLoadError, match=r"not a readable PyTorch checkpoint \(TypeError"):
        load_nanogpt(file)


@pytest.mark.parametrize("change, expected", [
    (lambda c: c.pop("model_args"), "not a nanoGPT checkpoint"),
    (lambda c: c["model_args"].pop("n_head"), "model_args lacks n_head"),
    (lambda c: c["model_args"].update(bias="yes"), "model_args['bias'] must be True or False"),
    (lambda c: c["model_args"].update(n_head=5), "must be divisible by n_head"),
    (lambda c: c["model_args"].update(n_layer=3), "n_layer = 3, but the state dict holds blocks [0, 1]"),
    (lambda c: c["model_args"].update(bias=False), "unexpected tensor 'transformer.h.0.ln_1.bias'"),
    (lambda c: c["model"].update({"transformer.wpe.weight": torch.zeros(7, D)}), "has shape [7, 32]"),
    (lambda c: c["model"].pop("transformer.h.1.mlp.c_fc.weight"), "lacks 1 tensor(s)"),
    (lambda c: c["model"].update({"transformer.h.0.attn.c_attn.weight": torch.zeros(3 * D, D, dtype=torch.int32)}),
     "not floating point"),
    (lambda c: c["model"].update({"transformer.wte.weight": torch.zeros(1).expand(2**20, 2**12)}),
     "transformer.wte.weight declares shape [1048576, 4096] (17179869184 bytes) over 4 bytes"),  # 16 GiB, stride 0
    (lambda c: c["model"].update({COMPILED_PREFIX + "transformer.wte.weight": torch.ones(V, D)}),
     "holds 'transformer.wte.weight' both with and without '_orig_mod.'"),
])
def test_broken_checkpoints_are_refused_by_name(tmp_path, change, expected):
    ckpt = nanogpt_checkpoint(bias=True)
    change(ckpt)
    with pytest.raises(ModelLoadError) as info:
        load_nanogpt(save(ckpt, tmp_path / "ckpt.pt"))
    assert expected in str(info.value), str(info.value)


def test_unreadable_files_and_paths_are_refused(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ModelLoadError, match="not a readable PyTorch checkpoint"):
        load_nanogpt(tmp_path / "garbage.pt")
    with pytest.raises(ModelLoadError, match="holds no ckpt.pt"):
        load_nanogpt(tmp_path)
    with pytest.raises(ModelLoadError, match="no such file"):
        load_nanogpt(tmp_path / "missing.pt")
    torch.save({"transformer.wte.weight": torch.zeros(2, 2)}, tmp_path / "bare.pt")  # a bare state dict
    with pytest.raises(ModelLoadError, match="expected a dict with 'model'"):
        load_nanogpt(tmp_path / "bare.pt")


def test_a_checkpoint_directory_linking_out_is_refused(tmp_path):
    elsewhere = save(nanogpt_checkpoint(bias=True), tmp_path / "elsewhere" / "real.pt")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere, out / "ckpt.pt")
    with pytest.raises(ModelLoadError, match="outside the checkpoint directory"):
        load_nanogpt(out)


def test_exact_gelu_cannot_be_saved_as_a_gpt2_checkpoint(tmp_path):
    model, _ = load_nanogpt(save(nanogpt_checkpoint(bias=True), tmp_path / "ckpt.pt"))
    with pytest.raises(ValueError, match="exact GELU"):
        save_hf(model, tmp_path / "hf")


def test_the_cli_traces_a_nanogpt_checkpoint(tmp_path, capsys):
    from gpt_shape_tracer.trace_command import main

    file = save(nanogpt_checkpoint(bias=False), tmp_path / "out" / "ckpt.pt")
    trace = tmp_path / "t.zip"
    code = main(["--prompt", "Lily had", "--steps", "2", "--model-dir", str(file), "--out", str(trace)])
    assert code == 2 and "give one with --tokenizer" in capsys.readouterr().err
    code = main(["--prompt", "Lily had", "--steps", "2", "--model-dir", str(file.parent), "--tokenizer",
                 str(BUNDLED_TOKENIZER), "--out", str(trace)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "step 1: n = 1, t = 3" in out.out and trace.exists()
