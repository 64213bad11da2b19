"""Issue 52 (first part): sentences that were false for a left-padded batch. Each is run over a left-padded batch
of two on story-llama (no sliding window), at the prefill and at a decode step, and checked against counts taken
here from the trace's own records: the mask's causes (padding is named where it hides keys, a window never is),
the tour's mask stop (which keys query i of sequence 0 weighs), What grows with n (the step's B sequences, as This
step counts them), the gradients' loss (pooled over the batch, and said so) and the Stages takeaway (one rounding
of one weight)."""

from __future__ import annotations

import re

import pytest
import torch

from gpt_shape_tracer.figures import attention, cache, gradients
from gpt_shape_tracer.figures.mask import mask_facts
from gpt_shape_tracer.figures.tour import tour_context, tour_stops
from gpt_shape_tracer.figures.view_takeaways import mask_takeaway
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import TracedGeneration, attention_gradients
from tests.settings_matrix import PROMPTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 2  # the prefill, then one cached decode step


def generation(prompts):
    from gpt_shape_tracer.model import load_bundled

    model, tok = load_bundled("story-llama")
    gen = TracedGeneration(model, tok, prompts, temperature=0, padding_side="left")
    gen.run(STEPS)
    assert gen.trace.config.sliding_window is None  # the model these sentences once blamed a window for
    return gen


@pytest.fixture(scope="module")
def padded():
    """Sequence 0 the short prompt, so that it is the one left padding pads."""
    return generation([PROMPTS[1], PROMPTS[0]])


def block(trace, step, batch, layer=0):
    """Sequence ``batch``'s [n, t] block of M, and which of its cells are −∞."""
    mask = trace.get(act_name("mask", layer), step)
    values = mask[min(batch, mask.shape[0] - 1), 0]
    return values, torch.isinf(values)


def padding_keys(trace, step, batch):
    """The key columns that are padding: −∞ in the last query row (a real token with left padding, and no key
    comes after it), so hidden for no reason but padding."""
    _, hidden = block(trace, step, batch)
    return [j for j in range(hidden.shape[1]) if bool(hidden[-1, j])]


def test_the_mask_takeaway_names_only_the_causes_that_hid_keys(padded):
    trace = padded.trace
    seen_padding = set()
    for step in range(STEPS):
        for batch in range(2):
            values, hidden = block(trace, step, batch)
            n, t = values.shape
            pads = padding_keys(trace, step, batch)
            query = torch.arange(t - n, t)[:, None]
            future = torch.arange(t)[None, :] > query
            padding_cells = int((hidden & ~future & torch.tensor([j in pads for j in range(t)])[None, :]).sum())
            facts = mask_facts(trace, step, 0, batch)
            said = mask_takeaway(facts)
            assert "sliding window" not in said.sentence, (step, batch, said.sentence)  # story-llama has none
            if step > 0:  # a cached decode step: one row, causality hides nothing
                assert n == 1 and not bool(future.any())
                if padding_cells:
                    seen_padding.add(step)
                    assert f"; {padding_cells} of them are −∞ because the key is padding." in said.sentence
                else:
                    assert said.sentence.endswith(f"t = {t} keys.")
            else:
                assert f"{int((hidden & future).sum())} of the {n * t} scores are −∞ because" in said.sentence
                if padding_cells:
                    seen_padding.add(step)
                    assert f"; {padding_cells} more are −∞ because the key is padding" in said.sentence
                    assert f"and so are the {padding_cells} cells of padding keys" in facts.explanation()
                else:
                    assert "padding" not in said.sentence and "padding keys" not in facts.explanation()
    assert seen_padding == {0, 1}  # the batch really is padded at both steps


def test_the_tour_says_which_keys_query_i_of_sequence_0_weighs(padded):
    trace = padded.trace
    context = tour_context(trace, None, live=True, caches=True)
    stop = next(s for s in tour_stops(context) if s.key == "mask")
    values, hidden = block(trace, 0, 0)
    last = hidden[-1]  # the last query weighs every real key: the first it sees is where sequence 0 starts
    first = int((~last).nonzero().min())
    assert first > 0  # sequence 0 is the padded one
    assert f"so its query i weighs only keys {first} … i" in stop.look, stop.look
    assert "keys 0 … i" not in stop.look
    # the same batch the other way round: sequence 0 has no padding, and its query i weighs keys 0 … i
    other = generation(PROMPTS).trace
    _, hidden = block(other, 0, 0)
    assert not bool(hidden[-1].any())
    look = next(s for s in tour_stops(tour_context(other, None, live=True, caches=True)) if s.key == "mask").look
    assert "keys 0 … i" in look and "padding" not in look, look


def test_what_grows_with_n_gives_the_steps_figures_for_the_batch(padded):
    trace = padded.trace
    config = trace.config
    for step in range(STEPS):
        forward = trace.generation.step(step).forward
        line, metrics = cache.growth_takeaway(config, forward.t, 4, forward.n, 2)
        numbers = dict(metrics)
        # This step's cache: the bytes of every layer's recorded K and V, both sequences
        held = sum(trace.record(act_name(kind, layer), step).nbytes
                   for layer in range(config.n_layer) for kind in ("k_all", "v_all"))
        assert numbers["KV cache, all layers, B = 2"] == cache._size(held), (step, numbers)
        scores = trace.record(act_name("pattern", 0), step).nbytes  # [B, H, n, t] of one layer
        assert numbers["this step's scores, one layer, B = 2"] == cache._size(scores)
        # QKᵀ and A·V of every layer, both sequences: 2 products of Q [B, H, n, d] against t keys
        q = trace.record(act_name("q", 0), step).shape
        products = config.n_layer * 2 * q[0] * q[1] * q[2] * forward.t * q[3]
        assert f"({products:,} against" in line and "its B = 2 sequences together" in line, line
        assert "In bytes, per sequence," in cache.growth_sentence(config, forward.t, 4, forward.n)


def test_the_gradients_loss_is_said_to_be_pooled_over_the_batch(padded):
    results = [attention_gradients(padded, 1, 0, 0, batch) for batch in range(2)]
    assert results[0].loss == pytest.approx(results[1].loss)  # one number for both: it is the batch's
    for batch, result in enumerate(results):
        _, text = gradients.agreement(result)
        assert f"L = {result.loss:.4f} (next-token cross-entropy" in text
        assert f"over all 2 sequences of the batch, not sequence {batch}'s alone" in text, text


def test_the_stages_takeaway_rounds_its_weight_once(padded):
    trace = padded.trace
    for step in range(STEPS):
        for batch in range(2):
            sentence, metrics = attention.stages_takeaway(trace, step, 0, 0, batch)
            shown = dict(metrics)["largest weight of that row"]
            said = re.search(r"puts (\S+) of its weight", sentence)
            assert said is not None and said.group(1) == shown, (sentence, shown)
            a = trace.get(act_name("pattern", 0), step)[batch, 0]
            columns = trace.generation.is_token(batch, step)[a.shape[1] - a.shape[0]:]  # the query rows' positions
            real = [r for r in range(a.shape[0]) if columns[r]]
            assert shown == f"{float(a[real[-1]].max()):.3f}"


def test_the_padding_sentence_speaks_of_the_real_rows_only(padded):
    """"…because the key is padding, so each real row i … weighs only its real keys up to i": true of every real
    query row of the padded sequence at the prefill (its finite keys are the real ones up to it), while a padding
    row still sees its own (padding) key — which is why the sentence names the real rows (it said "row i")."""
    trace = padded.trace
    said = mask_takeaway(mask_facts(trace, 0, 0, batch=0)).sentence
    assert "so each real row i of a padded sequence weighs only its real keys up to i" in said, said
    explained = mask_facts(trace, 0, 0, batch=0).explanation()
    assert "each real row i of sequence 0 weighs only its real keys up to i" in explained, explained
    _, hidden = block(trace, 0, 0)
    pads = padding_keys(trace, 0, 0)
    real = [i for i in range(hidden.shape[0]) if i not in pads]
    for i in real:
        assert [j for j in range(hidden.shape[1]) if not hidden[i, j]] == [j for j in real if j <= i]
    assert pads and any(not hidden[i, i] for i in pads)  # a padding row sees its own key: "row i" was not true
