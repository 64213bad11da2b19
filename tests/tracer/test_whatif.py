"""Ask "what if": interventions, the logit lens, attribution, the diff of two runs, activation patching."""

from __future__ import annotations

import pytest
import torch

from gpt_shape_tracer.model.analysis import repeated_random_tokens
from gpt_shape_tracer.tracer import (
    InterventionError,
    TracedGeneration,
    Tracer,
    ablate,
    diff_traces,
    direct_logit_attribution,
    load_trace,
    logit_lens,
    patch,
    save_trace,
)
from gpt_shape_tracer.tracer.experiments._whatif import activation_patching, pattern_changes, replay, text_loss

PROMPT = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="module")
def repeated(bundled):
    """A random token sequence repeated twice (after an end-of-text token): only induction predicts the
    second half, and the bundled model's induction heads read its previous-token head L0 H0."""
    _, tok = bundled
    ids = repeated_random_tokens(1024, 50, 1, seed=7, prefix=tok.eos_id)[0].tolist()
    return ids, len(ids) - 50 + 1  # the tokens, and the first position of the second half's predictions


def test_ablating_the_previous_token_head_breaks_induction_and_an_idle_head_does_not(bundled, repeated):
    model, _ = bundled
    ids, start = repeated
    base = text_loss(model, ids, start=start)
    assert text_loss(model, ids, [ablate("blocks.0.attn.hook_z", head=0)], start=start) - base > 2.0
    # L1 H1: no previous-token or induction score in training.json, and (measured) no use to the repeat
    assert abs(text_loss(model, ids, [ablate("blocks.1.attn.hook_z", head=1)], start=start) - base) < 0.2
    mean = text_loss(model, ids, [ablate("blocks.0.attn.hook_z", head=0, how="mean")], start=start)
    assert mean - base > 1.0  # mean ablation removes the head's position-specific signal too


def test_an_ablation_is_applied_recorded_saved_and_only_where_asked(bundled, tmp_path):
    model, tok = bundled
    gen = TracedGeneration(model, tok, PROMPT, temperature=0, interventions=[ablate("blocks.1.attn.hook_z", head=2)])
    gen.run(2)
    z = gen.trace.get("blocks.1.attn.hook_z", 1)
    assert not z[0, 2].any() and z[0, [0, 1, 3]].abs().sum() > 0  # the tracer recorded the value used
    assert [i.describe() for i in gen.trace.steps[1].interventions] == ["blocks.1.attn.hook_z head 2 zeroed"]
    back = load_trace(save_trace(gen.trace, tmp_path / "t.zip"))
    assert back.steps[1].interventions == gen.trace.steps[1].interventions
    plain = TracedGeneration(model, tok, PROMPT, temperature=0)
    plain.run(2)  # the same model, afterwards, untouched
    assert plain.trace.get("blocks.1.attn.hook_z", 1)[0, 2].abs().sum() > 0


@pytest.mark.parametrize("make, message", [
    (lambda: ablate("blocks.0.attn.hook_zz"), "not a hook point"),
    (lambda: ablate("blocks.0.attn.hook_z", head=4), "head 4 is out of range"),
    (lambda: ablate("blocks.0.hook_resid_pre", head=0), "no head axis"),
    (lambda: ablate("blocks.0.attn.hook_k_all", how="nope"), "choose 'zero' or 'mean'"),
    (lambda: patch("blocks.0.hook_resid_pre", torch.zeros(1, 3, 7)), "shape"),
    (lambda: patch("blocks.0.hook_resid_pre", torch.zeros(1, 1, 128), positions=[40]), "position 40"),
])
def test_a_bad_intervention_is_refused_before_any_forward(bundled, make, message):
    model, tok = bundled
    with pytest.raises(InterventionError, match=message):
        gen = TracedGeneration(model, tok, "Tom had a kite.", temperature=0, interventions=[make()])
        gen.step()
    assert TracedGeneration(model, tok, "Tom had a kite.").trace.n_steps == 0


def test_the_logit_lens_ends_at_the_models_own_logits(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, PROMPT, temperature=0)
    gen.run(3)
    for step in (0, 2):
        lens = logit_lens(gen.trace, step, label=tok.token_label)
        logits = gen.trace.get("hook_logits", step)[0]
        last = lens[lens.layer == model.config.n_layer - 1]
        probs = torch.softmax(logits, dim=-1)
        assert torch.allclose(torch.tensor(last.top_prob.tolist()), probs.max(-1).values, atol=1e-5)
        assert last.top_token.tolist() == probs.argmax(-1).tolist()
        assert (last.final_rank == 0).all()  # greedy: the chosen token is the last layer's top token
        assert lens.layer.nunique() == model.config.n_layer and len(lens) == model.config.n_layer * logits.shape[0]
        # early layers disagree with the final answer more often than the last one does
        assert (lens[lens.layer == 0].final_rank > 0).sum() >= (last.final_rank > 0).sum()


def test_direct_logit_attribution_adds_up_to_the_logit(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, ["Tom had a big red kite.", "Mia said,"], temperature=0, padding_side="right")
    gen.run(2)
    for step, row in ((0, 1), (1, 0)):
        frame = direct_logit_attribution(gen.trace, step, row)
        assert abs(frame.attrs["total"] - frame.attrs["logit"]) < 1e-4
        assert len(frame[frame.kind == "head"]) == model.config.n_layer * model.config.n_head
    with pytest.raises(ValueError, match="not the one that made the trace"):
        torch.manual_seed(0)
        from gpt_shape_tracer.model import GPT

        direct_logit_attribution(gen.trace, 0, model=GPT(model.config).eval())



@pytest.fixture()  # per test: a generation kept alive keeps its hooks on the shared model (head_scores' check)
def two_rows(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, ["Tom had a big red kite.", "Mia said,"], temperature=0)
    gen.run(2)
    return gen


@pytest.mark.parametrize("call", ["lens", "attribution"])
@pytest.mark.parametrize("where, message", [
    ({"step": 2}, r"step 2 is outside 0 … 1"),
    ({"step": -1}, r"step -1 is outside 0 … 1"),
    ({"row": 2}, r"row \(sequence\) 2 is outside 0 … 1"),
    ({"row": -1}, r"row \(sequence\) -1 is outside 0 … 1"),  # Python would read the last row, silently
    ({"row": 0.5}, r"row \(sequence\) must be a whole number in 0 … 1, got 0.5"),
    ({"row": True}, r"row \(sequence\) must be a whole number"),
    ({"step": "1"}, r"step must be a whole number in 0 … 1, got '1'"),
])
def test_the_lens_and_the_attribution_refuse_a_step_or_row_outside_the_trace_naming_the_range(
        bundled, two_rows, call, where, message):
    model, _ = bundled
    args = {"step": 0, "row": 0, **where}
    run = logit_lens if call == "lens" else direct_logit_attribution
    with pytest.raises(ValueError, match=message):
        run(two_rows.trace, args["step"], args["row"], model=model)


@pytest.mark.parametrize("token, message", [
    (-1, r"token -1 is outside 0 … (\d+)"),  # W_U[-1]: the last token's logit, without a word
    ("vocab", r"token (\d+) is outside 0 … (\d+)"),
    (2.0, r"token must be a whole number"),
])
def test_the_attribution_refuses_a_token_outside_the_vocabulary_naming_it(bundled, two_rows, token, message):
    model, _ = bundled
    V = model.w_u.shape[0]
    with pytest.raises(ValueError, match=message) as refused:
        direct_logit_attribution(two_rows.trace, 0, 0, V if token == "vocab" else token, model=model)
    assert f"0 … {V - 1}" in str(refused.value)
    import numpy as np

    frame = direct_logit_attribution(two_rows.trace, 0, np.int64(1), np.int64(V - 1), model=model)  # NumPy ints do
    assert frame.attrs["token"] == V - 1 and abs(frame.attrs["total"] - frame.attrs["logit"]) < 1e-4

def test_the_diff_of_two_runs(bundled):
    model, tok = bundled
    a = TracedGeneration(model, tok, PROMPT, temperature=0)
    off = TracedGeneration(model, tok, PROMPT, temperature=0, use_cache=False)
    a.run(4)
    off.run(4)
    self_diff = diff_traces(a.trace, a.trace)
    ids = self_diff.name.isin(["model:in[0]", "embed:in[0]", "pos_embed:in[0]"])  # token ids: equal or not
    assert self_diff.compared.all() and (self_diff[~ids].max_abs_delta == 0).all() and not self_diff.diverged.any()
    assert self_diff[ids].max_abs_delta.isna().all() and (self_diff[ids].note == "all equal").all()
    other = TracedGeneration(model, tok, PROMPT.replace("Lily", "Tom"), temperature=0)
    other.run(1)
    fed = diff_traces(a.trace, other.trace)
    tokens_row = fed[(fed.name == "model:in[0]") & (fed.step == 0)].iloc[0]
    assert tokens_row.diverged and tokens_row.first_divergence and " entries differ" in tokens_row.note
    on_off = diff_traces(a.trace, off.trace)
    assert on_off.compared.all() and on_off.max_abs_delta.max() < 1e-4 and not on_off.diverged.any()
    assert (on_off.shape_a != on_off.shape_b).any()  # decode records hold one position, the recompute all
    ablated = TracedGeneration(model, tok, PROMPT, temperature=0,
                               interventions=[ablate("blocks.2.attn.hook_z", head=1)])
    ablated.run(1)
    d = diff_traces(a.trace, ablated.trace)
    first = d[d.first_divergence].iloc[0]
    assert first["name"] == "blocks.2.attn.hook_z" and first["step"] == 0 and d.first_divergence.sum() == 1
    assert not d[d.index < first.name].diverged.any()  # nothing before it diverged
    assert "only in a" in set(d[d.step > 0].note)  # a ran 4 steps, the ablated run 1


def test_diffing_against_many_empty_steps_costs_the_records_not_the_steps(bundled, monkeypatch):
    """A trace of 20,000 steps that hold no record (a few KiB as a file) against a real run: the diff builds its
    table once, and reads each run's token columns once, not once per step."""
    import pandas as pd

    from gpt_shape_tracer.tracer.experiments import _diff
    from gpt_shape_tracer.tracer.reading._facts import GenerationFacts
    from gpt_shape_tracer.tracer.reading._trace import Trace
    from gpt_shape_tracer.tracer.storage._log import TraceLog

    model, tok = bundled
    real = TracedGeneration(model, tok, PROMPT, temperature=0)
    real.run(3)
    log = TraceLog("values", 2**20)
    for _ in range(20_000):
        log.begin_step()
        log.end_step(0.0)
    empty = Trace(log)
    frames, chosen = [], []
    make_frame = pd.DataFrame
    monkeypatch.setattr(_diff.pd, "DataFrame", lambda *a, **k: frames.append(1) or make_frame(*a, **k))
    original = GenerationFacts._chosen
    monkeypatch.setattr(GenerationFacts, "_chosen", lambda self, step: chosen.append(step) or original(self, step))
    frame = diff_traces(real.trace, empty)
    assert len(frames) == 1 and not chosen
    assert len(frame) == len(real.trace.records) and (frame.note == "only in a").all()
    other = TracedGeneration(model, tok, PROMPT, temperature=0, use_cache=False)
    other.run(3)
    chosen.clear()
    assert not diff_traces(real.trace, other.trace).diverged.any() and not chosen  # the same tokens, read once


def test_patching_the_whole_residual_stream_restores_the_clean_logits(bundled):
    model, tok = bundled
    clean = torch.tensor([tok.encode("Lily had a red ball.")])
    corrupt = torch.tensor([tok.encode("Tom had a big cat.")])
    assert clean.shape == corrupt.shape
    with Tracer(model, capture="values") as tr:
        clean_logits = model(clean)
    with Tracer(model, interventions=[patch("blocks.0.hook_resid_pre", tr.trace)]) as patched:
        logits = model(corrupt)
    assert torch.equal(logits, clean_logits)
    assert torch.equal(patched.trace.get("blocks.0.hook_resid_pre", 0), tr.trace.get("blocks.0.hook_resid_pre", 0))


def test_activation_patching_finds_where_the_answer_is_decided(bundled):
    model, tok = bundled
    clean = tok.encode("Mia had a cat. Mia gave the cat to Ben. Ben loved the cat. Ben said, \"Thank you,")
    corrupt = tok.encode("Mia had a cat. Mia gave the cat to Sam. Sam loved the cat. Sam said, \"Thank you,")
    res = activation_patching(model, clean, corrupt)
    assert res.clean_answer != res.corrupted_answer and res.clean_diff > res.corrupted_diff
    same = [p for p in range(len(clean)) if clean[p] == corrupt[p]]
    changed = [p for p in range(len(clean)) if clean[p] != corrupt[p]]
    # entering layer 0 the stream is the token and its position only: where they agree, patching is a no-op
    assert torch.equal(res.restored[0, same], torch.zeros(len(same)))
    assert float(res.restored[0, changed].sum()) > 0.5  # the names carry the answer in…
    assert float(res.restored.max()) > 0.5  # …and one (layer, position) carries most of it


def test_a_replayed_step_shows_what_an_ablation_changed(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, PROMPT, temperature=0)
    gen.run(3)
    same = replay(gen, 2, [])
    assert torch.allclose(same.logits, same.original, atol=1e-5)
    assert pattern_changes(gen, same)[0][2] < 1e-5
    changed = replay(gen, 2, [ablate("blocks.0.attn.hook_z", head=0)])
    assert (changed.logits - changed.original).abs().max() > 0.1
    layers = {layer for layer, _, delta in pattern_changes(gen, changed) if delta > 1e-3}
    assert 0 not in layers and layers  # the ablated head's own pattern is unchanged; later ones move
    assert gen.trace.n_steps == 3 and gen.cache_length == len(tok.encode(PROMPT)) + 2  # the run is untouched


def test_mean_ablation_at_a_decode_step_averages_every_position_fed_so_far(bundled):
    """"mean" replaces a head's output by its mean over the positions the run has fed — at a one-token decode
    step that is every position up to it, not the one new position (which would leave the value as it was)."""
    import torch

    from gpt_shape_tracer.tracer import TracedGeneration, Tracer, ablate, replay

    model, tok = bundled
    name = "blocks.0.attn.hook_z"
    gen = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0, interventions=[ablate(name, 0, "mean")])
    gen.run(3)
    t = gen.info.prompt_width + 2  # positions fed by step 2
    with torch.no_grad(), Tracer(model) as clean:  # layer 0's z before any ablation, for the same tokens
        model(torch.tensor([gen.tokens(0)[:t]]))
    before = clean.trace.get(name, 0)[:, 0]  # [1, t, d_head]
    kept = gen.trace.get(name, 2)[:, 0, -1]  # the value step 2 went on with
    assert torch.allclose(kept, before.mean(dim=1)[:, :], atol=1e-5)
    assert not torch.allclose(kept, before[:, -1], atol=1e-3)  # not the one new position's own value

    plain = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0)
    plain.run(3)
    again = replay(plain, 2, [ablate(name, 0, "mean")])  # one decode step alone, seeded with the run's values
    seen = torch.cat([plain.trace.get(name, s)[:, 0] for s in range(3)], dim=1)  # [1, t, d_head]
    assert torch.allclose(again.trace.get(name, 0)[:, 0, -1], seen.mean(dim=1), atol=1e-5)


def test_head_scores_stop_the_probe_after_the_last_pattern_and_score_what_a_full_forward_shows(bundled):
    """The probe stops once the last layer's pattern is recorded (the unembedding after it was most of its
    time): the scores equal those read off a whole forward under a plain Tracer, the model keeps no tap of it,
    and the next forward runs to its logits."""
    from gpt_shape_tracer.model import GPT
    from gpt_shape_tracer.model.analysis import HEAD_ROLES, role_scores
    from gpt_shape_tracer.model.gpt import act_name
    from gpt_shape_tracer.tracer import head_scores

    shared, tok = bundled
    # a model of its own: the shared one may carry the taps of other modules' live generations (their tracers
    # stay attached while a module-scoped fixture keeps them), which this test's "no tap left" would count
    model = GPT(shared.config).eval()
    model.load_state_dict(shared.state_dict())
    scores = head_scores(model, first_token=tok.eos_id)
    length = 50
    tokens = repeated_random_tokens(model.config.vocab_size, length, 4, seed=7, prefix=tok.eos_id)
    with torch.no_grad(), Tracer(model, capture="values", budget_bytes=2**31) as tr:
        logits = model(tokens)
    assert logits.shape == (4, 2 * length + 1, model.config.vocab_size)
    for role in HEAD_ROLES:
        want = torch.stack([role_scores(tr.trace.get(act_name("pattern", L), 0).double(), length)[role]
                            for L in range(model.config.n_layer)]).float()
        assert torch.equal(scores[role], want), role
    assert not any(getattr(m, "taps", ()) for m in model.modules())  # the probe's stop is gone
