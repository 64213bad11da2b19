"""The takeaways of Shapes, Causal mask, Next token, What if, Compare runs, Worked example and Inspector
(figures/view_takeaways.py): each line and metric is recomputed here from the recorded tensors with plain torch,
over a matrix of settings — prefill and decode steps, the cache off, left and right padding, a batch, sampling,
shapes capture, story-llama, and Gemma 2's sliding window run by transformers — and the app shows them first."""

from __future__ import annotations

from html import unescape

import pytest
import torch

from gpt_shape_tracer.figures import worked as worked_views
from gpt_shape_tracer.figures.mask import mask_facts
from gpt_shape_tracer.figures.view_takeaways import (
    ablation_takeaway,
    chosen_from,
    compare_takeaway,
    inspector_takeaway,
    mask_takeaway,
    next_token_takeaway,
    shapes_takeaway,
    worked_takeaway,
)
from gpt_shape_tracer.model import load_bundled
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import TracedGeneration, diff_traces

PROMPT = "Tom had a big red kite. One day, Tom went to the park."
SHORT = "Lily saw a cat."

SETTINGS = {
    "cached": {},
    "cache off": {"use_cache": False},
    "left-padded batch": {"prompt": [PROMPT, SHORT]},
    "right-padded batch, sampled": {"prompt": [SHORT, PROMPT], "padding_side": "right", "temperature": 0.9,
                                    "top_k": 20, "seed": 5},
    "shapes capture": {"capture": "shapes"},
    "llama": {"name": "story-llama"},
}


def generation(name: str = "story-gpt", steps: int = 3, **kwargs) -> TracedGeneration:
    model, tokenizer = load_bundled(name)
    gen = TracedGeneration(model, tokenizer, kwargs.pop("prompt", PROMPT), **kwargs)
    for _ in range(steps):
        gen.step()
    return gen


@pytest.fixture(scope="module", params=list(SETTINGS))
def gen(request):
    kwargs = dict(SETTINGS[request.param])
    return generation(kwargs.pop("name", "story-gpt"), **kwargs)


def text(sentence: str) -> str:
    return unescape(sentence)


def test_shapes_says_the_recorded_shapes(gen):
    trace = gen.trace
    for step in range(trace.n_steps):
        said = shapes_takeaway(trace, step)
        resid = trace.record(act_name("resid_pre", 0), step).shape  # [B, n, d] as recorded
        logits = trace.record(act_name("logits"), step).shape  # [B, n, V]
        line = text(said.sentence)
        assert f"[B, n, d] = [{', '.join(map(str, resid))}]" in line
        assert f"[B, n, V] = [{', '.join(map(str, logits))}]" in line
        t = trace.record(act_name("k_all", 0), step).shape[2]  # the keys attended over: [B, G, t, d_head]
        assert f"t = {t} key positions" in line
        records = trace.to_frame(step=step)
        metrics = dict(said.metrics)
        assert metrics["records at this step"] == f"{len(records):,}"
        largest = records.loc[records["nbytes"].idxmax()]
        size = next(f"{largest['nbytes'] / scale:.1f} {unit}" for unit, scale in
                    (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if largest["nbytes"] >= scale)
        assert f"The largest record is {largest['name']} ({size.replace('.0 B', ' B')})." in line
        assert metrics["the largest record"] == size.replace(".0 B", " B")


def reference_mask_counts(trace, step: int, batch: int) -> tuple[int, int]:
    """(−∞ cells, of which the key comes after the query) of sequence ``batch``'s block of M, counted here."""
    mask = trace.get(act_name("mask", 0), step)
    block = mask[min(batch, mask.shape[0] - 1), 0]  # [n, t]
    n, t = block.shape
    query = torch.arange(t - n, t)[:, None]
    future = torch.arange(t)[None, :] > query
    return int(torch.isinf(block).sum()), int((torch.isinf(block) & future).sum())


def test_the_mask_line_counts_the_cells_of_m(gen):
    trace = gen.trace
    for step in range(trace.n_steps):
        for batch in range(gen.info.batch_size):
            said = mask_takeaway(mask_facts(trace, step, 0, batch))
            line = text(said.sentence)
            if trace.get(act_name("mask", 0), step) is None:
                assert "not counted" in line
                continue
            masked, future = reference_mask_counts(trace, step, batch)
            n, t = trace.record(act_name("mask", 0), step).shape[-2:]
            metrics = dict(said.metrics)
            assert metrics["−∞ cells"] == f"{masked} of {n * t}" and metrics["future keys"] == str(future)
            if n == 1 and gen.info.use_cache and step:
                assert "causality hides none" in line and future == 0
            else:
                assert line.startswith(f"{future} of the {n * t} scores are −∞")
            assert said.details and "M has shape" in said.details  # the long explanation, folded


def test_a_sliding_window_is_counted_in_the_mask_line(tmp_path):
    """Gemma 2 run by transformers: its layer 0 attends to at most 4 keys back, so a decode step's one row has
    −∞ keys that causality does not explain, and the line says so."""
    from gpt_shape_tracer.model import load_model
    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from tests.hf_architectures import build

    model, tokenizer = load_model(str(build("gemma2", tmp_path / "gemma2", BUNDLED_DIR / "tokenizer.json")))
    gen = TracedGeneration(model, tokenizer, PROMPT)
    gen.step()
    gen.step()
    facts = mask_facts(gen.trace, 1, 0, 0)
    masked, future = reference_mask_counts(gen.trace, 1, 0)
    assert future == 0 and masked == facts.window > 0
    line = mask_takeaway(facts).sentence
    assert f"; {masked} of them are −∞ because the key is outside the sliding window." in line
    assert ("outside the window", str(masked)) in mask_takeaway(facts).metrics


def test_the_next_token_line_is_the_sampled_distribution(gen):
    trace, info = gen.trace, gen.info
    for step in range(trace.n_steps):
        choice = trace.generation.step(step).sampling
        for row in range(info.batch_size):
            said = next_token_takeaway(trace, step, row)
            logits = trace.get(act_name("logits"), step)
            if logits is None:  # shapes capture: the numbers come from the generation's own record
                assert f"p = {choice.probs[row]:.3f}" in said.sentence
                continue
            z = logits[row, chosen_from(trace, step, row)].double()  # [V] the row that chose the token
            sampling = info.sampling
            if sampling.greedy:
                probs = torch.softmax(z, dim=-1)
            else:  # temperature, then top-k (these settings have no top-p)
                z = z / sampling.temperature
                kth = torch.topk(z, sampling.top_k).values[-1]
                probs = torch.softmax(z.masked_fill(z < kth, float("-inf")), dim=-1)
            token = choice.tokens[row]
            runner = torch.topk(probs.masked_fill(torch.arange(len(probs)) == token, -1), 1)
            metrics = dict(said.metrics)
            assert metrics["p of the chosen token"] == f"{float(probs[token]):.3f}"
            assert metrics["p of the runner-up"] == f"{float(runner.values[0]):.3f}"
            assert metrics["tokens left to choose from"] == f"{int((probs > 0).sum()):,}"
            assert ("greedy decoding took the most probable" in said.sentence) == sampling.greedy
            if sampling.greedy:
                assert token == int(probs.argmax())


def test_compare_line_says_where_runs_part_or_that_none_does():
    gen = generation(steps=2)
    off = generation(steps=2, use_cache=False)
    frame = diff_traces(gen.trace, off.trace)
    said = compare_takeaway(frame, "the cache off", None)
    compared = frame[frame["compared"]]
    assert "no record diverges" in said.sentence
    assert dict(said.metrics)["records compared"] == f"{len(compared)} of {len(frame)}"
    assert dict(said.metrics)["largest |Δ|"] == f"{compared['max_abs_delta'].max():.3g}"
    said = compare_takeaway(frame, "x", "The runs first diverge at step 0 in y.")
    assert said.sentence == "Compared with x: The runs first diverge at step 0 in y."


def test_ablation_line_says_the_loss_change():
    said = ablation_takeaway(2.0, 2.5, ("L0 H0 zeroed",), "a random sequence", 3, 16)
    assert said.sentence == ("With L0 H0 zeroed, the loss on a random sequence raises from 2.000 to 2.500 nats "
                             "(+0.500).")
    assert "lowers from 2.500 to 2.000 nats (-0.500)" in ablation_takeaway(2.5, 2.0, ("a",), "b", 0, 1).sentence
    assert "unchanged at 2.000 nats" in ablation_takeaway(2.0, 2.0, ("a",), "b", 0, 1).sentence


@pytest.mark.parametrize("causal", [False, True])
def test_the_worked_line_is_the_softmax_and_autograds_gradient(causal):
    q, k, v, g = (worked_views.DEFAULT_Q, worked_views.DEFAULT_K, worked_views.DEFAULT_V, worked_views.DEFAULT_GRAD_O)
    w = worked_views.compute(*(list(map(list, x)) for x in (q, k, v, g)), causal=causal)
    Q, K, V = (torch.tensor(list(map(list, x)), dtype=torch.float64) for x in (q, k, v))
    scores = Q @ K.T / K.shape[1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores).triu(1).bool(), float("-inf"))
    a = torch.softmax(scores, dim=-1)
    said = worked_takeaway(w)
    assert dict(said.metrics)["A row q0"] == ", ".join(f"{x:.3f}" for x in a[0].tolist())
    assert dict(said.metrics)["o row q0"] == ", ".join(f"{x:.3f}" for x in (a @ V)[0].tolist())
    assert float(dict(said.metrics)["max |formula − autograd|"]) < 1e-5


def test_the_inspector_line_is_the_values_statistics(gen):
    trace = gen.trace
    step = trace.n_steps - 1
    for name in (act_name("pattern", 1), act_name("mask", 0), act_name("logits")):
        said = inspector_takeaway(trace, step, name)
        value = trace.get(name, step)
        line = text(said.sentence)
        if value is None:
            assert "not kept" in line
            continue
        finite = value[torch.isfinite(value)].double()
        assert f"{value.numel():,} {str(value.dtype).removeprefix('torch.')} values" in line
        if finite.numel():
            assert f"{float(finite.min()):.4g} to {float(finite.max()):.4g}, mean {float(finite.mean()):.4g}" in line
        neg = int(torch.isneginf(value).sum())
        assert (f"{neg:,} −∞" in line) == bool(neg)


def test_the_app_shows_each_takeaway_first():
    """In the running app the bold line comes before anything else the view says, on each of the views."""
    from tests.app.test_app import new_app, press, run, show_tab

    at = new_app()
    for _ in range(2):
        press(at, "step_button")
    for tab, sub, start in [("Shapes", None, "Step 1 runs"), ("Causal mask", None, "A cached decode step"),
                            ("Next token", None, "At step 1 greedy"),
                            ("Worked example", None, "Query q0 weighs"),
                            ("Inspector", None, "blocks.0.attn.hook_pattern")]:
        show_tab(at, tab, sub)
        lines = [unescape(m.value) for m in at.markdown if m.value.startswith("**")
                 and not m.value.startswith("**Guided")]
        assert lines and lines[0].startswith("**" + start), (tab, lines[:2])
    at.button(key="tour_start").click()  # the tour does not hide a view's takeaway
    run(at)
    assert any(unescape(m.value).startswith("**Step 0 runs") for m in at.markdown)
