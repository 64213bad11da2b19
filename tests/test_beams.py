"""Beam search traced one forward per step (tracer/generation/_beams.py), against transformers' own
``generate(num_beams=k)`` on the same weights: the returned sequences, their scores and every step's cache
reorder (``beam_idx``, caught on the DynamicCache transformers reorders); the reorder itself against each
surviving beam's history recomputed from scratch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_model
from gpt_shape_tracer.tracer import BeamSearch, BeamSearchError
from tests.hf_architectures import build
from tests.tolerance import close_across_cpus

TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "story-gpt" / "tokenizer.json"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    """(ours, tokenizer, transformers' eager model) on one random-weight directory: llama runs as our own GPT,
    qwen3 as transformers' model through our attention function."""
    from transformers import AutoModelForCausalLM

    directory = build(request.param, tmp_path_factory.mktemp(request.param), TOKENIZER, seed=3)
    ours, tok = load_model(str(directory))
    reference = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    return ours, tok, reference


def reference_run(reference, tok, prompts, k, new, *, eos=(), **settings):
    """transformers' generate with the same settings, and the beam_idx of every reorder it made."""
    from transformers import DynamicCache

    rows = [tok.encode(p) for p in prompts]
    width, pad = max(map(len, rows)), eos[0] if eos else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    cache, reorders = DynamicCache(config=reference.config), []
    reorder = cache.reorder_cache
    cache.reorder_cache = lambda beam_idx: (reorders.append(beam_idx.tolist()), reorder(beam_idx))[1]
    out = reference.generate(ids, attention_mask=attention, num_beams=k, max_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, output_scores=True, eos_token_id=list(eos) or None,
                             pad_token_id=pad, past_key_values=cache, **settings)
    return out, reorders


CASES = [  # (prompts, length_penalty, early_stopping, num_return_sequences)
    (["Once upon a time"], 1.0, False, 1),
    (["Once upon a time"], 2.0, True, 3),
    (["Lily had a red ball and", "Tom"], 0.5, "never", 2),  # a batch: the second prompt left-padded
]


@pytest.mark.parametrize("prompts, length_penalty, early_stopping, returned", CASES)
def test_sequences_scores_and_reorders_equal_transformers(pair, prompts, length_penalty, early_stopping, returned):
    ours, tok, reference = pair
    search = BeamSearch(ours, tok, prompts, 4, max_new_tokens=7, length_penalty=length_penalty,
                        early_stopping=early_stopping, num_return_sequences=returned, eos_ids=())
    search.run()
    out, reorders = reference_run(reference, tok, prompts, 4, 7, length_penalty=length_penalty,
                                  early_stopping=early_stopping, num_return_sequences=returned)
    result = search.result()
    assert [list(s) for s in result.sequences] == out.sequences.tolist()
    assert close_across_cpus(torch.tensor(result.scores), out.sequences_scores)
    assert [list(s.beam_idx) for s in search.steps] == reorders  # one reorder per step, the same rows
    assert len(search.steps) == 7 and search.done
    assert any(s.moved_rows for s in search.steps)  # the case really copies one beam's history onto another


def test_a_hypothesis_that_ends_early_is_kept_as_transformers_keeps_it(pair):
    """An end-of-sequence token chosen mid-run: taken from the second step's best candidates of a run without
    one, so a beam really finishes there."""
    ours, tok, reference = pair
    probe = BeamSearch(ours, tok, "Once upon a time", 3, max_new_tokens=6, eos_ids=())
    probe.run(2)
    eos = (probe.steps[1].candidates[0][0].token,)
    search = BeamSearch(ours, tok, "Once upon a time", 3, max_new_tokens=6, eos_ids=eos, num_return_sequences=3)
    search.run()
    finished_at = [s.step for s in search.steps for c in s.candidates[0] if c.fate == "finished"]
    assert finished_at and min(finished_at) == 1 < len(search.steps) - 1
    out, reorders = reference_run(reference, tok, ["Once upon a time"], 3, 6, eos=eos, num_return_sequences=3)
    assert [list(s) for s in search.result().sequences] == out.sequences.tolist()
    assert close_across_cpus(torch.tensor(search.result().scores), out.sequences_scores)
    assert [list(s.beam_idx) for s in search.steps] == reorders


def test_the_reordered_cache_holds_each_beams_own_history(pair):
    """After every step, the rows the snapshot kept are the rows before gathered by beam_idx, and the cache
    equals each running beam's tokens run again from scratch (the history it now continues)."""
    ours, tok, _ = pair
    search = BeamSearch(ours, tok, "Once upon a time", 4, max_new_tokens=5, eos_ids=(), snapshot_layer=1)
    for _ in range(4):
        step = search.step()
        assert torch.equal(step.keys_after, step.keys_before[list(step.beam_idx)])
    width = search.prompt_width
    for beam in range(4):
        history = search._running[0, beam, : search.cur_len - 1]  # what the next forward's cache must hold
        fresh = ours.new_cache(1)
        ours(history[None, :], fresh)
        assert close_across_cpus(search.cache.keys[1][beam], fresh.keys[1][0])
        assert close_across_cpus(search.cache.values[0][beam], fresh.values[0][0])
    assert search.cache.length == width + 3


def test_the_trace_holds_one_step_per_forward_with_every_beam_as_a_row(pair):
    ours, tok, _ = pair
    search = BeamSearch(ours, tok, ["Once upon a time", "Tom"], 3, max_new_tokens=3, eos_ids=())
    search.run()
    trace = search.trace
    assert trace.n_steps == 3
    names = [name for name in trace.names(0) if name.endswith("hook_logits")]
    assert names and trace.record(names[0], 0).shape[0] == 6  # B·k rows: each prompt repeated k times (the prefill)
    assert trace.record(names[0], 2).shape[:2] == (6, 1)  # then one new token per beam


@pytest.mark.parametrize("settings, message", [
    (dict(num_beams=1), "num_beams must be a whole number from 2"),
    (dict(num_beams=17), "from 2 to 16"),
    (dict(num_beams=3, num_return_sequences=4), "num_return_sequences must be from 1 to num_beams = 3"),
    (dict(early_stopping="sometimes"), "early_stopping must be False, True or 'never'"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(max_new_tokens=0), "max_new_tokens must be from 1"),
    (dict(max_new_tokens=200), "positions; this model has n_ctx = 256"),
])
def test_bad_settings_are_refused_with_the_numbers(bundled, settings, message):
    model, tok = bundled
    with pytest.raises(BeamSearchError, match=message.replace("(", r"\(")):
        BeamSearch(model, tok, "Once upon a time, there was a little girl. " * 6, **{"num_beams": 4, **settings})


def test_a_finished_search_refuses_another_step(bundled):
    model, tok = bundled
    search = BeamSearch(model, tok, "Once upon a time", 2, max_new_tokens=2)
    assert search.run() == 2 and search.done
    with pytest.raises(BeamSearchError, match="the beam search is done"):
        search.step()
