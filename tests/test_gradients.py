"""Backpropagation through attention on a real head (tracer.attention_gradients): every gradient computed from
its formula equals autograd's on the same forward, for both bundled models (the Llama-style one grouped),
both losses, a padded batch, and a model run by transformers; the generation and the weights are untouched."""

from __future__ import annotations

import pytest
import torch

from figures import gradients as grad_views
from model import load_bundled
from tracer import GRADIENT_LOSSES, TracedGeneration, attention_gradients

PROMPTS = ["Tom had a big red kite. One day, Tom went to the park.", "Lily ran"]


@pytest.mark.parametrize("name", ["story-gpt", "story-llama"])
@pytest.mark.parametrize("loss", GRADIENT_LOSSES)
def test_every_formula_equals_autograd(name, loss):
    model, tok = load_bundled(name)
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0)
    gen.run(3)
    before = [p.detach().clone() for p in model.parameters()]
    steps = gen.n_steps
    for batch in (0, 1):
        for layer, head in ((0, 0), (model.config.n_layer - 1, model.config.n_head - 1)):
            result = attention_gradients(gen, 2, layer, head, batch, loss)
            assert set(result.formula) == {"G_O", "G_V", "G_P", "G_S", "G_Q", "G_K"}
            for grad in result.formula:
                assert result.max_abs_delta(grad) <= 1e-5, (name, loss, batch, layer, head, grad)
            assert result.autograd["G_P"].abs().max() > 0  # a real gradient, not zeros compared with zeros
    t = gen.facts.step(2).forward.t
    assert result.formula["G_P"].shape == (t, t) and result.formula["G_Q"].shape == (t, model.config.d_head)
    assert all(len(v) == model.config.n_layer and all(x > 0 for x in v) for v in result.norms.values())
    assert gen.n_steps == steps and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient was filled


def test_the_figures_draw_the_formulas_with_their_shapes(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, PROMPTS[0], temperature=0)
    gen.run(2)
    result = attention_gradients(gen, 1, 1, 2)
    from figures.common import key_labels

    fig = grad_views.gradients_figure(result, key_labels(gen.trace, 1))
    titles = [a.text for a in fig.layout.annotations]
    t = gen.facts.step(1).forward.t
    assert any(x.startswith(f"G_S,r = (diag(P_r) − P_r P_rᵀ)·G_P,r [{t}, {t}]") for x in titles)
    norms = grad_views.gradient_norms_figure(result)
    assert [d.name for d in norms.data] == ["residual stream entering block L", "attention output of block L",
                                            "MLP output of block L"]
    with pytest.raises(ValueError, match="loss must be one of"):
        attention_gradients(gen, 1, 1, 2, loss="mse")


def test_a_model_run_by_transformers(tmp_path):
    from model import load_hf
    from model.loading import ASSETS
    from tests.hf_architectures import build

    directory = build("qwen3", tmp_path / "qwen3", ASSETS / "story-gpt" / "tokenizer.json")
    model, tok = load_hf(directory)
    gen = TracedGeneration(model, tok, PROMPTS[0], temperature=0)
    gen.run(2)
    result = attention_gradients(gen, 1, 1, 3, loss=GRADIENT_LOSSES[1])
    assert max(result.max_abs_delta(g) for g in result.formula) <= 1e-5
