"""Every cache class transformers has, run one greedy step at a time (tracer/experiments/_cache_classes.py), against
transformers' own ``generate()`` with that class on the same weights: the tokens, every step's logits, and what
each class holds (rows reserved, dropped, overwritten, stored in fp8, where they live), with the figures and
sentences built from those numbers (figures/cache_classes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.tracer import CACHE_CLASSES, CacheClassError, CacheEvent, cache_class_run
from tests.hf_architectures import build

TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "story-gpt" / "tokenizer.json"
PROMPT = "Once upon a time there was"  # 6 tokens: past mistral's window of 4 at the prefill
STEPS = 5


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """llama (full attention) and mistral (sliding_window = 4), both run by transformers."""
    loaded = {}
    for arch in ("llama", "mistral"):
        directory = build(arch, tmp_path_factory.mktemp(arch), TOKENIZER, seed=1)
        loaded[arch] = load_hf(str(directory), implementation="transformers")
    return loaded


@pytest.fixture(scope="module")
def runs(models):
    """Each class on the model it is about: sliding on mistral, the others on llama, and static on mistral too
    (its sliding layers overwrite)."""
    plan = {"dynamic": "llama", "static": "llama", "quantized-fp8": "llama", "offloaded": "llama",
            "sliding": "mistral", "static-sliding": "mistral"}
    out = {}
    for name, arch in plan.items():
        model, tok = models[arch]
        out[name] = cache_class_run(model, tok, PROMPT, name.removesuffix("-sliding"), STEPS)
    return out


def generated(model, run):
    """transformers' generate with the run's settings: (new tokens, logits per step [steps, V])."""
    ids = torch.tensor([list(run.prompt_ids)])
    out = model.hf.generate(ids, max_new_tokens=len(run.steps), do_sample=False, output_logits=True,
                            return_dict_in_generate=True, **run.generate_settings)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack([row[0] for row in out.logits]).float()


@pytest.mark.parametrize("name", ["dynamic", "static", "quantized-fp8", "offloaded", "sliding", "static-sliding"])
def test_tokens_and_logits_equal_generate_with_the_same_class(models, runs, name):
    run = runs[name]
    model, _ = models["mistral" if name in ("sliding", "static-sliding") else "llama"]
    tokens, logits = generated(model, run)
    assert list(run.tokens) == tokens
    ours = torch.stack([s.logits for s in run.steps])
    assert ours.shape == logits.shape
    torch.testing.assert_close(ours, logits, rtol=0, atol=1e-5)


def test_the_classes_built_are_transformers_own(runs):
    assert runs["dynamic"].class_name == "DynamicCache" and set(runs["dynamic"].kinds()) == {"DynamicLayer"}
    assert runs["static"].class_name == "StaticCache" and set(runs["static"].kinds()) == {"StaticLayer"}
    assert set(runs["static-sliding"].kinds()) == {"StaticSlidingWindowLayer"}
    assert set(runs["sliding"].kinds()) == {"DynamicSlidingWindowLayer"}
    assert runs["quantized-fp8"].class_name == "QuantizedCache"
    assert set(runs["quantized-fp8"].kinds()) == {"Fp8QuantizedLayer"}
    assert runs["quantized-fp8"].generate_settings == {"cache_implementation": "quantized",
                                                       "cache_config": {"backend": "fp8"}}


@pytest.mark.parametrize("name", ["dynamic", "static", "offloaded", "sliding", "static-sliding"])
def test_full_precision_classes_match_the_dynamic_reference(runs, name):
    for step in runs[name].steps:
        assert step.max_abs_delta < 1e-4
        assert step.token == step.reference_token


def test_fp8_differs_from_full_precision_and_says_by_how_much(runs):
    run = runs["quantized-fp8"]
    deltas = [s.max_abs_delta for s in run.steps]
    assert deltas[0] == 0.0  # the prefill attends to the rows it was given, before they are stored in fp8
    assert all(d > 0 for d in deltas[1:])  # every later step reads the dequantized rows back
    p = len(run.prompt_ids)
    for s in run.steps:
        for h in s.layers:
            assert h.dtype == "float8_e4m3fn" and len(h.row_error) == h.held == p + s.step
            assert all(0 < e < 0.1 for e in h.row_error)
            # 1 byte a number for K and V plus two float32 scales
            assert h.nbytes == 2 * h.keys_shape[1] * h.held * h.keys_shape[3] + 2 * 4
        assert s.nbytes * 4 == s.reference_bytes + 4 * 2 * 4 * len(s.layers)  # a quarter of float32's, + scales
        kinds = [e.kind for e in s.events]
        assert kinds.count("quantize") == len(s.layers)  # each layer its own scale, so its own event
        assert all(e.indices == tuple(range(p + s.step - s.fed, p + s.step)) for e in s.events
                   if e.kind == "quantize")


def test_fp8_rows_past_the_frozen_scale_are_found_and_said(runs):
    """The scale is set by the prefill's amplitude; a later row larger than that is past fp8's range: the CPU's
    cast clips it to ±448 · scale (CUDA's makes it NaN: bench/gpu_cache_classes.py). On these weights one is."""
    from gpt_shape_tracer.figures.cache_classes import cache_class_takeaway

    run = runs["quantized-fp8"]
    p = len(run.prompt_ids)
    last = run.steps[-1]
    over = [(h.layer, q) for h in last.layers for q in h.overflowed]
    assert over and all(q >= p for _, q in over)  # the prompt's rows set the scale, so never past it
    for layer, q in over:  # a clipped row is the layer's worst: its error is the part cut off
        errors = last.layers[layer].row_error
        assert errors[q] == max(errors)
    assert f"{len(over)} stored row(s) held values past the range" in cache_class_takeaway(run)[0]
    assert not any(h.overflowed for s in run.steps for h in s.layers if s.step == 0)


def test_static_reserves_up_front_and_fills(runs):
    run = runs["static"]
    p = len(run.prompt_ids)
    assert run.max_cache_len == p + STEPS - 1  # generate's length
    for s in run.steps:
        for h in s.layers:
            assert h.reserved == run.max_cache_len and h.held == p + s.step and h.keys_shape[2] == h.reserved
        assert s.nbytes == run.steps[0].nbytes  # every slot allocated at the prefill
        assert [e.kind for e in s.events] == ["grow"]
    assert run.steps[-1].layers[0].free == 0


def test_sliding_drops_and_static_sliding_overwrites(runs, models):
    window = models["mistral"][0].hf.config.sliding_window
    p = len(runs["sliding"].prompt_ids)
    for s in runs["sliding"].steps:
        seen = p + s.step
        for h in s.layers:  # DynamicSlidingWindowLayer keeps the last window − 1 rows
            assert (h.seen, h.held, h.first_held) == (seen, window - 1, seen - window + 1)
        drops = [e for e in s.events if e.kind == "drop"]
        assert len(drops) == 1 and drops[0].layer is None  # both layers alike: one event
        assert drops[0].indices == (tuple(range(seen - window + 1)) if s.step == 0 else (seen - window,))
    for s in runs["static-sliding"].steps:
        seen = p + s.step
        for h in s.layers:  # StaticSlidingWindowLayer reserves the window and keeps its last `window` rows
            assert (h.held, h.reserved, h.first_held) == (window, window, seen - window)
        kinds = [e.kind for e in s.events]
        if s.step == 0:  # the prompt arrives longer than the window: its first rows are never kept
            assert kinds == ["grow", "drop"] and "never kept" in s.events[1].detail
        else:
            assert kinds == ["grow", "overwrite"] and s.events[1].indices == (seen - window - 1,)


def test_offloaded_on_the_cpu_runs_the_dynamic_cache_and_says_so(runs):
    run = runs["offloaded"]
    assert run.device == "cpu" and "CUDA" in run.note and run.generate_settings == {}
    assert all(h.device == "cpu" for s in run.steps for h in s.layers)
    assert not [e for e in run.events if e.kind == "move"]


def test_refusals(models):
    llama, tok = models["llama"]
    with pytest.raises(CacheClassError, match="no sliding-window layer"):
        cache_class_run(llama, tok, PROMPT, "sliding", 2)
    with pytest.raises(CacheClassError, match="only full attention"):
        cache_class_run(models["mistral"][0], tok, PROMPT, "quantized-fp8", 2)
    with pytest.raises(CacheClassError, match="one of"):
        cache_class_run(llama, tok, PROMPT, "paged", 2)
    with pytest.raises(CacheClassError, match="shorter"):
        cache_class_run(llama, tok, PROMPT, "static", 4, max_cache_len=3)
    with pytest.raises(CacheClassError, match="steps"):
        cache_class_run(llama, tok, PROMPT, "dynamic", 0)


def test_our_own_gpt_is_refused_with_the_reason(tmp_path):
    directory = build("llama", tmp_path / "ours", TOKENIZER, seed=1)
    ours, tok = load_hf(str(directory), implementation="ours")
    with pytest.raises(CacheClassError, match="our own KV cache"):
        cache_class_run(ours, tok, PROMPT, "dynamic", 2)


def test_a_longer_static_cache_reserves_more_and_decodes_the_same(models, runs):
    model, tok = models["llama"]
    run = cache_class_run(model, tok, PROMPT, "static", STEPS, max_cache_len=32)
    assert run.tokens == runs["static"].tokens
    assert all(h.reserved == 32 and h.free == 32 - h.held for s in run.steps for h in s.layers)


def test_new_event_kinds_say_their_numbers():
    drop = CacheEvent("drop", 3, 4, 3, (5,), layer=1)
    assert drop.changed == 1 and "layer 1" in drop.sentence() and "dropped 1 position(s) (5 … 5)" in drop.sentence()
    move = CacheEvent("move", 2, 9, 9, (), detail="cuda:0 → cpu")
    assert move.changed == 9 and "cuda:0 → cpu" in move.sentence()
    assert set(CACHE_CLASSES) == {"dynamic", "static", "sliding", "quantized-fp8", "offloaded"}


# the figures and sentences (figures/cache_classes.py), built from the runs' numbers


@pytest.mark.parametrize("name", ["dynamic", "static", "quantized-fp8", "offloaded", "sliding", "static-sliding"])
@pytest.mark.parametrize("steps", [2, STEPS])
def test_each_class_has_a_figure_and_a_sentence_from_its_numbers(runs, name, steps):
    from dataclasses import replace

    from gpt_shape_tracer.figures.cache_classes import cache_class_figure, cache_class_takeaway

    run = replace(runs[name], steps=runs[name].steps[:steps], tokens=runs[name].tokens[:steps])
    last, n = run.steps[-1], len(run.steps)
    fig = cache_class_figure(run)
    assert fig.data and fig.layout.title.text
    sentence, metrics = cache_class_takeaway(run)
    assert f"{n} forward(s)" in sentence
    assert dict(metrics)["cache after the last"] == f"{last.nbytes:,} B"
    if name == "dynamic":
        assert f"grew from {len(run.prompt_ids)} to {len(run.prompt_ids) + n - 1} positions" in sentence
    if name in ("static", "static-sliding"):
        reserved = sum(h.reserved for h in last.layers)
        filled = sum(h.held for h in last.layers)
        assert f"reserved {reserved} rows" in sentence and f"holds {filled} of them" in sentence
        assert f"{filled / reserved:.0%} full" in sentence
    if name == "static-sliding":
        assert f"overwrote {n - 1} slot(s)" in sentence  # one a decode step, once the prompt filled the window
    if name == "sliding":
        assert f"{n - 1} position(s) dropped as they left the window" in sentence
        assert "3 of the prompt's never kept" in sentence  # 6 prompt tokens, 3 kept
    if name == "quantized-fp8":
        worst = max(s.max_abs_delta for s in run.steps)
        top = max(e for h in last.layers for e in h.row_error)
        assert f"by up to {worst:.3g}" in sentence and f"stored row is {top:.3g}" in sentence
        assert f"{last.nbytes:,} B against {last.reference_bytes:,} B" in sentence
        assert "equal the full-precision" not in sentence  # its difference is said, not hidden
    else:
        assert "equal the full-precision dynamic cache's" in sentence
    if name == "offloaded":
        assert "nothing moved" in sentence and fig.layout.title.text.count("nothing moved") == 1


def test_position_map_marks_what_each_class_did(runs):
    from gpt_shape_tracer.figures.cache_classes import POSITION_STATES, position_states

    held, free, dropped, over, never = (POSITION_STATES.index(s) for s in
                                        ("held", "reserved, free", "dropped", "overwritten", "never kept"))
    static = position_states(runs["static"])
    assert static[0].count(held) == 6 and static[0].count(free) == STEPS - 1 and static[-1].count(free) == 0
    sliding = position_states(runs["sliding"])
    assert sliding[0][:3] == [never] * 3 and sliding[-1][3:3 + STEPS - 1] == [dropped] * (STEPS - 1)
    overwritten = position_states(runs["static-sliding"])
    assert overwritten[0][:2] == [never] * 2 and overwritten[-1][2:2 + STEPS - 1] == [over] * (STEPS - 1)
    assert all(row.count(held) == 4 for row in overwritten)


# the app: the KV cache tab's "transformers' cache classes"


CLASSES_TAB = ("kv_view", "transformers' cache classes")


def test_the_app_runs_a_class_on_a_model_transformers_runs_and_says_why_not_on_ours(tmp_path):
    from tests.app.test_app import charts, new_app, page_text, press, press_reset, run, show_tab
    from tests.app.test_app_architectures import choose_directory

    at = new_app()
    press(at, "step_button")  # the bundled model: our own GPT and our own cache
    show_tab(at, "KV cache", CLASSES_TAB)
    assert "not transformers' cache classes" in page_text(at) and not at.error
    choose_directory(at, build("qwen3", tmp_path / "qwen3", TOKENIZER, seed=1))
    press(at, "load_model")
    press_reset(at)
    press(at, "step_button")
    show_tab(at, "KV cache", CLASSES_TAB)
    assert "Choose a class" in page_text(at)
    at.selectbox(key="kv_class").set_value("static")
    at.number_input(key="kv_class_steps").set_value(3)
    at.button(key="kv_class_run").click()
    run(at)
    assert not at.error, [e.value for e in at.error]
    result = at.session_state["app"].live.cache_class
    assert result.class_name == "StaticCache" and len(result.steps) == 3
    from gpt_shape_tracer.figures.cache_classes import cache_class_takeaway

    assert cache_class_takeaway(result)[0] in page_text(at) and len(charts(at)) == 1


# the command line: gpt-shape-tracer trace --cache


def test_the_trace_command_runs_a_cache_class(runs, tmp_path, capsys):
    import json

    from gpt_shape_tracer.trace_command import main

    directory = build("mistral", tmp_path / "mistral", TOKENIZER, seed=1)  # the same weights as the runs'
    assert main(["--model-dir", str(directory), "--prompt", PROMPT, "--cache", "sliding", "--steps", str(STEPS),
                 "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    run = runs["sliding"]
    assert said["class"] == "DynamicCache" and said["tokens"] == list(run.tokens)
    assert [[e["kind"] for e in s["events"]] for s in said["steps"]] == [[e.kind for e in s.events] for s in run.steps]
    assert [s["layers"][0]["held"] for s in said["steps"]] == [s.layers[0].held for s in run.steps]


@pytest.mark.parametrize("args, message", [
    (["--cache", "static", "--temperature", "0.7"], "no --temperature, --top-k or --top-p"),
    (["--cache", "static", "--no-cache"], "--no-cache does not go with --cache"),
    (["--cache", "static", "--prompt", "two"], "--cache runs one prompt, got 2"),
])
def test_the_trace_command_refuses_cache_options_that_do_not_go_together(args, message, capsys):
    from gpt_shape_tracer.trace_command import main

    assert main(["--prompt", "Once upon a time", *args]) == 2
    assert message in capsys.readouterr().err
