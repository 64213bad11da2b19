"""Backpropagation through attention on a real head (tracer.attention_gradients): every gradient computed from
its formula equals autograd's on the same forward, for both bundled models (the Llama-style one grouped),
both losses, a padded batch, and a model run by transformers; the generation and the weights are untouched."""

from __future__ import annotations

import re

import pytest
import torch

from gpt_shape_tracer.figures import gradients as grad_views
from gpt_shape_tracer.model import load_bundled
from gpt_shape_tracer.tracer import GRADIENT_LOSSES, TracedGeneration, attention_gradients, gradient_trace

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
    from gpt_shape_tracer.figures.common import key_labels

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
    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.sources import ASSETS
    from tests.hf_architectures import build

    directory = build("qwen3", tmp_path / "qwen3", ASSETS / "story-gpt" / "tokenizer.json")
    model, tok = load_hf(directory)
    gen = TracedGeneration(model, tok, PROMPTS[0], temperature=0)
    gen.run(2)
    result = attention_gradients(gen, 1, 1, 3, loss=GRADIENT_LOSSES[1])
    assert max(result.max_abs_delta(g) for g in result.formula) <= 1e-5


# -- the gradients capture level: ∂L/∂x at every hook point (tracer.gradient_trace) ----------------------------
def transformers_gradients(directory, tokens: list[int]):
    """transformers' own backward pass of the next-token cross-entropy (its labels= loss) on the same weights:
    (∂L/∂hidden state entering each block, ∂L/∂logits)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor([tokens])
    out = reference(ids, labels=ids, output_hidden_states=True)
    entering = out.hidden_states[:-1]  # the last one has the final norm applied
    for h in (*entering, out.logits):
        h.retain_grad()
    out.loss.backward()
    return [h.grad[0] for h in entering], out.logits.grad[0], float(out.loss.detach())


def test_gradient_trace_equals_transformers_backward_pass(tmp_path):
    from gpt_shape_tracer.model.sources import ASSETS
    from gpt_shape_tracer.tracer import load_trace, save_trace

    model, tok = load_bundled("story-gpt")
    gen = TracedGeneration(model, tok, PROMPTS[0], temperature=0)
    gen.run(2)
    trace = gradient_trace(gen, 0)  # the prefill: the prompt, next-token cross-entropy
    assert trace.capture == "gradients" and trace.n_steps == 1
    grads = trace.filter(kind="grad")
    points = {path for path, m in model.named_modules() if type(m).__name__ == "HookPoint"}
    assert {r.name for r in grads} == points  # every hook point, the masks and positions as leaves too
    assert [r.index for r in grads] == sorted(r.index for r in grads)
    entering, d_logits, reference_loss = transformers_gradients(ASSETS / "story-gpt", gen.facts.columns(0, 0))
    for layer, expected in enumerate(entering):
        got = trace.value(trace.record(f"blocks.{layer}.hook_resid_pre", 0))[0]
        assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4), layer
    assert torch.allclose(trace.value(trace.record("hook_logits", 0))[0], d_logits, atol=1e-7, rtol=1e-4)
    said = re.search(r"L = next-token cross-entropy = ([-0-9.e]+), over the (\d+) positions of generation step 0",
                     trace.value_note(trace.record("hook_embed", 0)))
    assert said and float(said.group(1)) == pytest.approx(reference_loss, abs=1e-5)
    assert int(said.group(2)) == len(gen.facts.columns(0, 0))
    # the same file format as values, and the same budget: a small one keeps statistics of what it evicts
    path = save_trace(trace, tmp_path / "grads.zip")
    back = load_trace(path)
    assert back.capture == "gradients" and [r.name for r in back.filter(kind="grad")] == [r.name for r in grads]
    q = trace.record("blocks.2.attn.hook_q", 0)
    assert torch.equal(back.value(back.record(q.name, 0)), trace.value(q))
    small = gradient_trace(gen, 0, budget_bytes=64 * 1024)
    assert small.log.bytes_kept <= 64 * 1024 < trace.log.bytes_kept
    evicted = [r for r in small.filter(kind="grad") if small.value(r) is None]
    assert evicted and all(small.stats(r).max == pytest.approx(float(trace.value(
        trace.record(r.name, 0)).max()), rel=1e-6) for r in evicted)


def test_gradient_trace_of_a_decode_step_and_a_model_run_by_transformers(tmp_path):
    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.sources import ASSETS
    from tests.hf_architectures import build

    directory = build("qwen3", tmp_path / "qwen3", ASSETS / "story-gpt" / "tokenizer.json")
    model, tok = load_hf(directory)
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0)
    gen.run(2)
    trace = gradient_trace(gen, 1, GRADIENT_LOSSES[1])  # −log p of the tokens step 1 chose, a padded batch
    logits = gen.trace.record("hook_logits", 1)
    d_logits = trace.value(trace.record("hook_logits", 0))  # [B, t, V]: only each row's last real column
    t = gen.facts.width(1)
    assert d_logits.shape == (2, t, logits.shape[-1])
    choice = gen.facts.step(1).sampling
    chosen_from = gen.trace.value(logits)[:, -1].float()  # [B, V]: the decode step's own logits (cache on)
    for row in range(2):
        column = gen.facts.last_token_column(row, 1)
        p = torch.softmax(chosen_from[row], dim=-1)
        # L = −(log p_0 + log p_1)/2, so ∂L/∂z = (p − onehot(chosen))/2 at each row's chosen column, 0 elsewhere
        expected = (p - torch.nn.functional.one_hot(torch.tensor(choice.tokens[row]), p.numel())) / 2
        assert torch.allclose(d_logits[row, column], expected, atol=1e-5)
        assert d_logits[row, [c for c in range(t) if c != column]].abs().max() == 0
    # transformers' layers seen through our points; K and V before the cache are copies its cache hands on
    points = {path for path, m in model.named_modules() if type(m).__name__ == "HookPoint"}
    unreached = points - {r.name for r in trace.filter(kind="grad")}
    assert unreached == {f"blocks.{i}.attn.hook_{x}" for i in range(2) for x in "kv"}
    note = trace.value_note(trace.record("hook_embed", 0))
    assert note.endswith(f"No gradient reaches {', '.join(sorted(unreached))}: values the model reads but does not "
                         "go on to use (a copy is used instead).")
    with pytest.raises(ValueError, match="a Tracer records forwards"):
        from gpt_shape_tracer.tracer import Tracer

        Tracer(model, capture="gradients")


# -- the two losses against transformers on padded batches (left and right padding, prefill and decode) ---------
def real_tokens(gen, row: int, step: int) -> list[int]:
    """Sequence ``row``'s real tokens as step ``step`` saw them, in order, its padding left out."""
    return [c for c, real in zip(gen.facts.columns(row, step), gen.facts.is_token(row, step)) if real]


def transformers_losses(reference, rows: list[list[int]], chosen: list[int]) -> tuple[float, float]:
    """transformers' own numbers for the two losses over ``rows`` (each sequence's real tokens):
    the next-token cross-entropy is its ``labels=`` loss over the rows right-padded, −100 on the padding (so every
    real token predicts the next real one, and nothing predicts or is predicted by padding); −log p(chosen) is
    computed by hand from each row's own unpadded forward, at its last position."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        cross_entropy = float(reference(input_ids=ids, attention_mask=mask, labels=labels).loss)
        nll = [-float(torch.log_softmax(reference(input_ids=torch.tensor([r])).logits[0, -1].double(), -1)[c])
               for r, c in zip(rows, chosen)]
    return cross_entropy, sum(nll) / len(nll)


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_both_losses_of_a_padded_batch_equal_transformers(tmp_path, padding_side):
    """Left padding puts the padding before each prompt; right padding puts it between a short prompt and its
    first generated token. Either way the cross-entropy is the mean over every pair of consecutive real tokens
    (as many pairs however the batch is padded), and −log p is read at each row's last real token, not at the
    last column."""
    from transformers import AutoModelForCausalLM

    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.sources import ASSETS
    from tests.hf_architectures import build

    directory = build("llama", tmp_path / "llama", ASSETS / "story-gpt" / "tokenizer.json")
    model, tok = load_hf(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0, padding_side=padding_side)
    gen.run(3)
    for step in (0, 2):
        rows = [real_tokens(gen, r, step) for r in range(2)]
        assert len(rows[0]) != len(rows[1])  # a padded batch: the short row has padding
        choice = gen.facts.step(step).sampling
        cross_entropy, nll = transformers_losses(reference, rows, list(choice.tokens))
        ours = {loss: attention_gradients(gen, step, 0, 0, 1, loss).loss for loss in GRADIENT_LOSSES}
        assert ours[GRADIENT_LOSSES[0]] == pytest.approx(cross_entropy, abs=1e-5), (padding_side, step)
        assert ours[GRADIENT_LOSSES[1]] == pytest.approx(nll, abs=1e-5), (padding_side, step)
        grads = gradient_trace(gen, step)  # the capture level's backward pass is of the same loss
        said = re.search(r"L = next-token cross-entropy = ([-0-9.e]+),", grads.value_note(grads.records[0]))
        assert said and float(said.group(1)) == pytest.approx(cross_entropy, abs=1e-5)
