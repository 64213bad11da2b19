"""Issue 41: "x + attention", "x + MLP" and the dashed "skip: x" arrows only where a model's blocks really add
each sublayer's output to x. Measured at load on transformers' own forward (``GPTConfig.plain_residual``): MiniMax
adds the attention output to the *normed* x, each scaled by α/β factors; Granite scales the sublayer's output by
``residual_multiplier``. Llama and Qwen3 run by transformers, and our own GPT, are plain sums."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.figures import flow
from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.gpt import hooks_for, residual_sums
from gpt_shape_tracer.model.sources import BUNDLED_DIR, build_dry
from gpt_shape_tracer.model.sources._hf_residual import _plain_residual
from gpt_shape_tracer.tracer import TracedGeneration, dry_run
from tests.hf_architectures import build
from tests.model.test_hf_hybrid import build_hybrid

PROMPT = ["Lily had a red kite.", "Tom said"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("residual")


def built(model_type: str, root: Path) -> Path:
    directory = root / model_type
    if not directory.exists():
        if model_type == "minimax":
            build_hybrid(model_type, directory)
        else:
            build(model_type, directory, tokenizer_file=BUNDLED_DIR / "tokenizer.json")
    return directory


def traced(directory: Path) -> TracedGeneration:
    model, tok = load_hf(directory, implementation="transformers")
    g = TracedGeneration(model, tok, PROMPT, temperature=0, padding_side="left")
    g.run(2)
    return g


def texts(fig) -> list[str]:
    return [str(t) for d in fig.data if d.mode == "text" for t in d.text]


def residual_rows(config) -> dict[str, str]:
    return {s.name: s.meaning for s in hooks_for(config) if s.name.endswith(("resid_mid", "mixer_out"))}


@pytest.mark.parametrize("model_type", ["minimax", "granite"])
def test_a_block_that_is_not_a_plain_sum_is_never_drawn_as_one(root, model_type):
    g = traced(built(model_type, root))
    assert g.trace.config.plain_residual is False and residual_sums(g.trace.config) is False
    for layer in range(g.trace.config.n_layer):  # MiniMax: a linear-attention layer, then a softmax one
        fig = flow.shape_flow_figure(g.trace, 1, layer)
        shown = texts(fig)
        assert not any("x + attention" in t or "x + mixer" in t or "x + MLP" in t for t in shown), shown
        assert "skip: x" not in shown
        assert not [sh for sh in fig.layout.shapes if sh.type == "path" and sh.line.dash == "dash"]
        assert any("do not simply add each sublayer's output to x" in t for t in shown)  # said in words instead
    for meaning in residual_rows(g.trace.config).values():
        assert not meaning.startswith("x + ") and " adds " not in meaning


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_plain_transformers_block_is_drawn_as_x_plus_attention(root, model_type):
    g = traced(built(model_type, root))
    assert g.trace.config.plain_residual is True
    shown = texts(flow.shape_flow_figure(g.trace, 1, 0))
    assert any(t.startswith("<b>x + attention</b>") for t in shown) and any(t.startswith("<b>x + MLP</b>")
                                                                           for t in shown)
    assert residual_rows(g.trace.config)["blocks.{L}.hook_resid_mid"].startswith("x + attention output")


def test_our_gpt_is_always_plain_and_keeps_its_skips(bundled):
    model, tok = bundled
    g = TracedGeneration(model, tok, PROMPT, temperature=0)
    g.run(2)
    assert residual_sums(g.trace.config) is True
    shown = texts(flow.shape_flow_figure(g.trace, 1, 0))
    assert shown.count("skip: x") == 2 and any(t.startswith("<b>x + attention</b>") for t in shown)


def test_the_verdict_is_read_from_the_numbers(root):
    """The same check on tensors we make: a plain sum passes, a scaled or normed one fails, zeros tell nothing."""
    torch.manual_seed(0)
    pre, attn, mlp = (torch.randn(1, 2, 8) for _ in range(3))

    def seen(mid: torch.Tensor, post: torch.Tensor) -> dict:
        return {(0, "hook_resid_pre"): pre, (0, "hook_attn_out"): attn, (0, "hook_resid_mid"): mid,
                (0, "hook_mlp_out"): mlp, (0, "hook_resid_post"): post}

    assert _plain_residual(seen(pre + attn, pre + attn + mlp), 1) is True
    assert _plain_residual(seen(pre + 0.5 * attn, pre + 0.5 * attn + mlp), 1) is False  # Granite's kind
    normed = pre / pre.norm(dim=-1, keepdim=True)
    assert _plain_residual(seen(normed + attn, normed + attn + mlp), 1) is False  # MiniMax's kind
    flat = {**seen(pre + attn, pre + attn + mlp), (0, "hook_mlp_out"): mlp.reshape(2, 8)}  # OPT: [B·n, d]
    assert _plain_residual(flat, 1) is True
    zero = torch.zeros_like(attn)
    assert _plain_residual({**seen(pre, pre + mlp), (0, "hook_attn_out"): zero}, 1) is None
    parallel = {(0, "hook_resid_pre"): pre, (0, "hook_attn_out"): attn, (0, "hook_mlp_out"): mlp}
    assert _plain_residual({**parallel, (0, "hook_resid_post"): pre + attn + mlp}, 1) is True


@pytest.mark.parametrize("model_type", ["minimax", "llama"])
def test_a_dry_run_claims_no_sum(root, model_type):
    """On the meta device there are no values to add up: the verdict is None, and the flow claims neither
    "x + attention" nor the skips, whatever the model."""
    model, _ = build_dry(built(model_type, root), implementation="transformers")
    assert model.config.plain_residual is None and residual_sums(model.config) is None
    g = dry_run(model, n=4, steps=1)
    shown = texts(flow.shape_flow_figure(g.trace, 1, 0))
    assert not any("x + " in t for t in shown) and "skip: x" not in shown
    assert any(t.startswith("<b>after attention</b>") or t.startswith("<b>after mixer</b>") for t in shown)
    assert any("was not measured for this trace" in t for t in shown)


def test_the_sum_check_scales_its_tolerance_to_the_sums_size():
    """Issue 52: a sum of float32 parts of magnitude ~100 rounds by ~1e-5, far above any fixed absolute tolerance
    of a few float32 ulps of 1: the check must scale with the numbers. A plain sum of large parts holds, each
    sum of a block's parts is read as one, and a sum off by 1 % of one part does not hold."""
    from gpt_shape_tracer.model.sources._hf_residual import _sum_holds

    torch.manual_seed(0)
    pre, mix, mlp = torch.randn(3, 1, 4, 64) * 30
    mid = pre + mix
    post = mid + mlp
    assert float((mid.double() - pre.double() - mix.double()).abs().max()) > 8 * torch.finfo(torch.float32).eps
    assert _sum_holds(mid, [pre, mix]) is True
    seen = {(0, "hook_resid_pre"): pre, (0, "hook_attn_out"): mix, (0, "hook_resid_mid"): mid,
            (0, "hook_mlp_out"): mlp, (0, "hook_resid_post"): post}
    assert _plain_residual(seen, 1) is True
    assert _sum_holds(mid + 0.01 * mix, [pre, mix]) is False
