"""The guided tour's plan (figures/tour.py): the heads it names are the best-scoring ones, and their scores are
what transformers' own attention weights give on the same probe; every stop's sentence is made of the trace's
numbers; a stop a model or generation cannot show is skipped with its reason, over a matrix of settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.figures.tour import (
    CLEAR_SCORE,
    HeadPick,
    clearest_head,
    shown_stops,
    skipped_sentence,
    tour_context,
    tour_stops,
)
from gpt_shape_tracer.model import load_bundled
from gpt_shape_tracer.model.analysis import repeated_random_tokens
from gpt_shape_tracer.session import first_token
from gpt_shape_tracer.tracer import TracedGeneration, head_scores

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Tom had a big red kite. One day, Tom went to the park."


def reference_scores(model, tokenizer, directory) -> dict[str, torch.Tensor]:
    """Previous-token and induction scores from transformers' eager attention weights on the probe
    ``tracer.head_scores`` documents (4 random sequences of ``length`` tokens, each repeated twice, after the
    first token; seed 7), computed here without our code: ``[n_layer, n_head]`` each."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    length = max(2, min(50, (model.config.n_ctx - 1) // 2))
    tokens = repeated_random_tokens(model.config.vocab_size, length, 4, seed=7, prefix=first_token(tokenizer))
    with torch.no_grad():
        attentions = hf(tokens, output_attentions=True).attentions  # per layer [B, H, n, n]
    previous, induction = [], []
    n = tokens.shape[1]
    for pattern in attentions:
        pattern = pattern.double()
        rows = torch.arange(1, n)
        previous.append(pattern[:, :, rows, rows - 1].mean(dim=(0, 2)))
        second = torch.arange(n - length, n)  # the repeat: key after the earlier occurrence is q − length + 1
        induction.append(pattern[:, :, second, second - length + 1].mean(dim=(0, 2)))
    return {"previous-token": torch.stack(previous), "induction": torch.stack(induction)}


@pytest.mark.parametrize("name", ["story-gpt", "story-llama"])
def test_the_tours_heads_are_the_best_scoring_and_their_scores_are_transformers(name, tmp_path):
    from gpt_shape_tracer.model.sources import save_hf

    model, tokenizer = load_bundled(name)
    reference = reference_scores(model, tokenizer, save_hf(model, tmp_path / name))
    ours = head_scores(model, first_token=first_token(tokenizer))
    for role in ("previous-token", "induction"):
        pick = clearest_head(ours, role)
        assert pick is not None
        best = int(reference[role].argmax())
        assert (pick.layer, pick.head) == divmod(best, reference[role].shape[1]), role
        assert pick.score == pytest.approx(float(reference[role].flatten()[best]), abs=1e-4)
        assert pick.clear  # each bundled model has a clear example of both (what the tour presets)
        assert f"{pick.score:.2f}" in pick.sentence() and pick.label in pick.sentence()
        # docs/views.md quotes each bundled model's heads and scores
        assert f"{pick.label} ({role}, {pick.score:.2f})" in (ROOT / "docs" / "views.md").read_text(encoding="utf-8")


def test_a_head_below_the_bar_is_not_called_clear():
    scores = {"previous-token": torch.tensor([[0.1, 0.25], [0.05, 0.2]])}
    pick = clearest_head(scores, "previous-token")
    assert pick == HeadPick("previous-token", 0, 1, pytest.approx(0.25))
    assert not pick.clear and pick.score < CLEAR_SCORE
    assert pick.sentence().startswith("No head of this model is a clear previous-token head")
    assert clearest_head(scores, "induction") is None
    with pytest.raises(ValueError, match="unknown head role"):
        clearest_head(scores, "copying")


def generation(name: str = "story-gpt", steps: int = 3, **kwargs) -> TracedGeneration:
    model, tokenizer = load_bundled(name)
    gen = TracedGeneration(model, tokenizer, kwargs.pop("prompt", PROMPT), **kwargs)
    for _ in range(steps):
        gen.step()
    return gen


SETTINGS = {
    "cached, values": {},
    "prefill only": {"steps": 1},
    "cache off": {"use_cache": False},
    "shapes capture": {"capture": "shapes"},
    "right-padded batch, sampled": {"prompt": ["Lily saw a cat.", PROMPT], "padding_side": "right",
                                    "temperature": 0.8, "seed": 3},
    "llama": {"name": "story-llama"},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_stop_says_the_traces_numbers_and_skips_only_with_a_reason(setting):
    kwargs = dict(SETTINGS[setting])
    name = kwargs.pop("name", "story-gpt")
    gen = generation(name, **kwargs)
    trace, info = gen.trace, gen.info
    scores = head_scores(gen.model, first_token=first_token(gen.tokenizer))
    stops = tour_stops(tour_context(trace, scores, live=True, caches=True))
    by_key = {s.key: s for s in stops}
    assert list(by_key) == ["shapes", "stages", "mask", "av", "step", "cache", "history", "next", "flash",
                            "gradients", "engine"]
    assert by_key["engine"].waiting.startswith("Press **Run the engine**")  # no engine run on view yet
    width = info.prompt_width  # the prefill's n: the padded prompt's columns
    assert len(gen.tokenizer.encode(PROMPT)) == width
    assert f"[{info.batch_size}, {width}, {gen.model.config.d_model}]" in by_key["shapes"].look
    assert f"[{info.batch_size}, {width}, {gen.model.config.vocab_size}]" in by_key["shapes"].look
    assert f"M is {width} × {width}" in by_key["mask"].look
    last = trace.n_steps - 1
    if last:
        t = width + last  # every decode step adds one key position
        assert f"t = {t} keys" in by_key["step"].look and not by_key["step"].waiting
        assert by_key["step"].step == last
    else:
        assert by_key["step"].waiting.startswith("Press Step")
    chosen = trace.generation.step(last).sampling
    assert f"“{chosen.labels[0]}”" in by_key["next"].look and f"p = {chosen.probs[0]:.3f}" in by_key["next"].look
    assert ("greedy" in by_key["next"].look) == info.sampling.greedy
    if info.use_cache:
        assert f"holds {width + last} positions" in by_key["cache"].look
    # skipped exactly where the generation lacks what the view needs, each with its reason
    expected_skips = set()
    if not info.use_cache:
        expected_skips |= {"cache", "history"}
    if trace.capture == "shapes":
        expected_skips |= {"stages", "av", "step", "history", "flash"}
    assert {s.key for s in stops if s.skipped} == expected_skips
    assert all(len(s.skipped) > 20 for s in stops if s.skipped)
    assert len(shown_stops(stops)) == len(stops) - len(expected_skips)
    assert (skipped_sentence(stops) == "") == (not expected_skips)
    # the presets: the previous-token head where a head is shown, the induction head for History
    prev, ind = clearest_head(scores, "previous-token"), clearest_head(scores, "induction")
    assert by_key["stages"].head == (prev.layer, prev.head) and by_key["history"].head == (ind.layer, ind.head)
    assert prev.sentence() in by_key["stages"].look and ind.sentence() in by_key["history"].look
    pattern = trace.get(f"blocks.{prev.layer}.attn.hook_pattern", 0)
    if pattern is not None:  # the O = A·V sentence reads the weight from the trace's own pattern, on the last
        # real query of sequence 0: the end of its prompt with right padding, the last column with left
        own = len(gen.tokenizer.encode(info.prompts[0]))
        query = own - 1 if info.padding_side == "right" else width - 1
        weight = float(pattern[0, prev.head, query, query - 1])
        assert f"query {query} of sequence 0 (its last token) puts {weight:.2f}" in by_key["av"].look
        assert by_key["av"].query == query


def test_no_live_model_skips_gradients_and_names_no_head():
    gen = generation(steps=2)
    stops = {s.key: s for s in tour_stops(tour_context(gen.trace, None, live=False, caches=True))}
    assert "not loaded" in stops["gradients"].skipped
    assert all(s.head is None for s in stops.values())
    assert "clearest" not in stops["stages"].look
    assert (stops["mask"].title, stops["mask"].tab) == ("The causal mask", "Causal mask")  # a causal model's


def test_a_module_of_your_own_has_no_cache_stops():
    gen = generation(steps=2)
    stops = {s.key: s for s in tour_stops(tour_context(gen.trace, None, live=True, caches=False))}
    assert "own forward" in stops["cache"].skipped and stops["history"].skipped == stops["cache"].skipped


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """A small engine run on a tiny random Llama: two requests sharing an 8-token prefix, one arriving at step 2."""
    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from gpt_shape_tracer.tracer.engine import trace_engine
    from tests.hf_architectures import build

    directory = build("llama", tmp_path_factory.mktemp("tour-engine") / "llama", BUNDLED_DIR / "tokenizer.json")
    model, tokenizer = load_hf(directory, implementation="transformers")
    prefix = list(range(100, 108))
    return trace_engine(model, tokenizer, [prefix + [1, 2, 3], prefix + [4, 5], [7, 8, 9, 10, 11]], page_size=4,
                        pages=32, max_batch_tokens=64, max_new_tokens=5, arrivals=[0, 0, 2])


def test_the_engine_stop_says_the_runs_pool_at_its_fullest(engine_run):
    from gpt_shape_tracer.figures.engine import memory_at

    gen = generation(steps=2)
    run = engine_run
    stop = tour_stops(tour_context(gen.trace, None, live=True, caches=True, engine=run))[-1]
    assert (stop.key, stop.tab, stop.skipped, stop.waiting) == ("engine", "Engine", "", "")
    peak = max(s.pages_in_use for s in run.steps)
    at = min(s.step for s in run.steps if s.pages_in_use == peak)
    assert stop.engine_step == at
    fullest = run.steps[at]
    assert fullest.shared  # the prefix's pages are shared at the fullest step of this run
    assert (f"After engine step {at}, the fullest, {peak} of the 32 pages are held by {len(fullest.tables)} "
            f"requests, {len(fullest.shared)} of them shared by a common prefix") in stop.look
    page_size = run.pool.page_size
    longest = max(len(r.prompt_ids) + r.max_new_tokens - 1 for r in run.requests)
    assert f"{peak * page_size} positions, where a padded contiguous cache of the same 3 requests would hold " \
           f"{longest * 3}" in stop.look
    assert memory_at(run, at).contiguous == longest * 3
    # no run yet: the idea and a wait; a model that cannot run the engine: skipped with the reason
    waiting = tour_stops(tour_context(gen.trace, None, live=True, caches=True))[-1]
    assert waiting.waiting and not waiting.skipped and "block table" in waiting.look and waiting.engine_step is None
    refused = tour_stops(tour_context(gen.trace, None, live=True, caches=True, engine_refused="Mine is your own "
                                      "module"))[-1]
    assert refused.skipped == "the sidebar's model cannot run the engine: Mine is your own module"
    assert "The KV cache in a serving engine" in skipped_sentence(
        tour_stops(tour_context(gen.trace, None, live=True, caches=True, engine_refused="Mine is your own module")))


def test_the_tour_in_the_app_opens_each_stops_view_step_and_head(engine_run):
    """The real app under AppTest: three Steps and an engine run on view, then the tour from its first stop to its
    last; at each stop the tab, the sub-view, the step slider, the head pickers and the engine step are the stop's,
    and Back returns."""
    from gpt_shape_tracer.figures.tour import tour_context as context
    from gpt_shape_tracer.session.engine import view_of
    from tests.app.test_app import gen_of, new_app, press, run

    at = new_app()
    for _ in range(3):
        press(at, "step_button")
    gen = gen_of(at)
    at.session_state["app"].engine.view = view_of(engine_run, None, "a tiny Llama")
    stops = shown_stops(tour_stops(context(gen.trace, head_scores(gen.model, first_token=first_token(gen.tokenizer)),
                                           live=True, caches=True, engine=engine_run)))
    assert len(stops) == 11 and stops[-1].key == "engine"  # a cached values generation of the bundled model has
    # every stop
    at.button(key="tour_start").click()
    run(at)
    for index, stop in enumerate(stops):
        titles = [m.value for m in at.markdown if m.value.startswith("**Guided tour")]
        assert titles == [f"**Guided tour · stop {index + 1} of {len(stops)}: {stop.title}**"]
        state = at.session_state
        assert state["view"] == stop.tab
        if stop.sub:
            assert state[stop.sub[0]] == stop.sub[1]
        if stop.step is not None:
            assert state["step_view"] == stop.step
        if stop.head is not None:
            prefix = {"Attention": "attn", "Causal mask": "mask", "Attention mask": "mask"}[stop.tab]
            assert (state[f"{prefix}_layer"], state[f"{prefix}_head"]) == stop.head
        if stop.query is not None:
            assert state["app"].live.query_picks[(stop.step, 0)] == stop.query
        if stop.engine_step is not None:  # the engine stop opens the pool at its fullest step, as its sentence says
            assert state["engine_step"] == stop.engine_step
            assert at.slider(key="engine_step").value == stop.engine_step
            assert not any("Run the engine" in i.value for i in at.info)  # a run is on view: no wait
        next_button = at.button(key="tour_next")
        assert next_button.disabled == (index == len(stops) - 1)
        if not next_button.disabled:
            next_button.click()
            run(at)
    at.button(key="tour_back").click()
    run(at)
    assert at.session_state["view"] == stops[-2].tab
    at.button(key="tour_end").click()
    run(at)
    assert not [m for m in at.markdown if m.value.startswith("**Guided tour")]
    assert at.button(key="tour_start")


def test_a_soft_capped_transformers_model_shows_every_stop(tmp_path):
    """Gemma 2, run by transformers: its scores are soft-capped, a stage the stages stop names; the Gradients view
    applies the cap's derivative (tests/tracer/test_gradients.py), so no stop is skipped."""
    from gpt_shape_tracer.model import load_model
    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from gpt_shape_tracer.session import caches
    from tests.hf_architectures import build

    model, tokenizer = load_model(str(build("gemma2", tmp_path / "gemma2", BUNDLED_DIR / "tokenizer.json")))
    gen = TracedGeneration(model, tokenizer, PROMPT)
    gen.step()
    gen.step()
    scores = head_scores(model, first_token=first_token(tokenizer))
    stops = tour_stops(tour_context(gen.trace, scores, live=True, caches=caches(model)))
    assert [s.key for s in stops if s.skipped] == []
    assert "QKᵀ, scaled, soft-capped, plus the mask M" in stops[1].look
