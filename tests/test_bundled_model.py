"""The shipped checkpoint is worth looking at: it predicts, and it has the textbook heads.

Everything is measured here, on stories drawn with the held-out seed (never in
the training set) — nothing is read back from training.json.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from model import SamplingConfig, generate
from model.corpus import lexicon, stories
from model.heads import induction_scores, previous_token_scores, repeated_random_tokens
from model.train import HELDOUT_SEED, TRAIN_SEED, token_stream, unigram_loss


@pytest.fixture(scope="module")
def heldout(bundled):
    _, tok = bundled
    return token_stream(tok, stories(HELDOUT_SEED, 200))


def test_heldout_loss_is_far_below_a_unigram_baseline(bundled, heldout):
    model, tok = bundled
    windows = heldout[: (heldout.numel() - 1) // 128 * 128 + 1]
    x = windows[:-1].view(-1, 128)[:48]
    y = windows[1:].view(-1, 128)[:48]
    with torch.no_grad():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    train = token_stream(tok, stories(TRAIN_SEED, 2000))
    baseline = unigram_loss(train, y.flatten(), tok.vocab_size)
    assert baseline > 4.0
    assert loss < 0.25 * baseline, (loss, baseline)


def test_one_head_is_a_clear_previous_token_head(bundled, heldout):
    model, _ = bundled
    x = heldout[: 32 * 128].view(32, 128)
    scores = previous_token_scores(model, x)  # [layer, head]: mean weight on position i−1
    assert scores.max().item() >= 0.5, scores


def test_one_head_is_an_induction_head(bundled):
    model, tok = bundled
    tokens = repeated_random_tokens(tok.vocab_size, 50, 16, seed=123, prefix=tok.eos_id)
    scores = induction_scores(model, tokens, 50)
    assert scores.max().item() >= 0.3, scores


def test_greedy_continuation_is_fluent_corpus_like_text(bundled):
    model, tok = bundled
    prompt = "Once upon a time, there was a little girl named Mia."
    out = tok.decode(generate(model, tok.encode(prompt), 60, SamplingConfig(temperature=0)))
    words = re.findall(r"[A-Za-z]+", out)
    known = lexicon()
    assert len(words) >= 25
    assert sum(w.lower() in known for w in words) / len(words) >= 0.95, out
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", out.strip()) if s]
    assert len(sentences) >= 3
    assert all(s[0].isupper() or s[0] == '"' for s in sentences[1:]), out
    assert "Mia" in out  # the story keeps its character


def test_sampled_continuations_stay_in_the_corpus_language(bundled):
    model, tok = bundled
    prompt = "Tom had a friend named Ben."
    known = lexicon()
    for seed in range(3):
        out = tok.decode(generate(model, tok.encode(prompt), 40, SamplingConfig(temperature=0.8, seed=seed)))
        words = re.findall(r"[A-Za-z]+", out)
        assert sum(w.lower() in known for w in words) / max(1, len(words)) >= 0.8, out


def test_the_induction_heads_depend_on_the_previous_token_head(bundled):
    """The circuit is real: knock out the previous-token head and induction stops working."""
    from model.heads import ablated, repeat_loss

    model, tok = bundled
    tokens = repeated_random_tokens(tok.vocab_size, 50, 16, seed=321, prefix=tok.eos_id)
    x = torch.stack([torch.arange(1, 129)] * 4)  # any text: locate the previous-token head first
    layer, head = divmod(int(previous_token_scores(model, x).argmax()), model.config.n_head)
    intact_loss, intact_score = repeat_loss(model, tokens, 50), induction_scores(model, tokens, 50).max().item()
    with ablated(model, layer, head):
        broken_loss, broken_score = repeat_loss(model, tokens, 50), induction_scores(model, tokens, 50).max().item()
    assert broken_score < 0.5 * intact_score, (intact_score, broken_score)
    assert broken_loss > intact_loss + 2.0, (intact_loss, broken_loss)
