"""The shipped checkpoints are worth looking at: they predict, and they have the textbook heads.

Both bundled models — ``story-gpt`` (GPT-2) and ``story-llama`` (Llama: RoPE,
RMSNorm, SwiGLU, 4 query heads sharing 2 key/value heads) — are measured here,
on stories drawn with the held-out seed (never in the training set): nothing is
read back from training.json. The ablation tables below are the ones docs/bundled-models.md
prints; the test recomputes every entry.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpt_shape_tracer.model import BUNDLED_MODELS, SamplingConfig, generate, load_bundled
from gpt_shape_tracer.model.analysis import (
    ablated,
    ablation_effects,
    induction_scores,
    previous_token_scores,
    repeat_loss,
    repeated_random_tokens,
)
from gpt_shape_tracer.model.training import HELDOUT_SEED, TRAIN_SEED, lexicon, stories, token_stream, unigram_loss

PAGE = Path(__file__).resolve().parents[2] / "docs" / "bundled-models.md"
NAMES = list(BUNDLED_MODELS)

# What zeroing each head's z does to the loss on the second half of 16 random 50-token sequences repeated
# twice (seed 321), in nats, [layer][head]; and the intact loss. docs/bundled-models.md prints these tables.
ABLATION = {
    "story-gpt": (2.373, [[6.52, 0.117, 0.201, 0.01],
                          [0.083, 0.007, 0.607, 0.096],
                          [0.21, 0.925, -0.046, 0.235],
                          [2.369, 2.423, -0.079, 0.019]]),
    "story-llama": (3.159, [[0.006, -0.016, -0.003, 0.007],
                            [0.233, -0.024, 4.215, 0.339],
                            [0.008, 0.066, 0.049, 1.04],
                            [0.0, -0.007, 4.395, 0.051]]),
}
# (layer, head, lowest score the page's figure rounds from): story-gpt's was seeded, story-llama's grew by itself
PREVIOUS_TOKEN_HEAD = {"story-gpt": (0, 0, 0.99), "story-llama": (1, 2, 0.75)}
INDUCTION_HEADS = {"story-gpt": [(3, 0), (3, 1)], "story-llama": [(3, 2)]}


@pytest.fixture(scope="module", params=NAMES)
def bundle(request):
    model, tok = load_bundled(request.param)
    return request.param, model, tok


@pytest.fixture(scope="module")
def heldout():
    _, tok = load_bundled("story-gpt")  # both bundled models share this tokenizer (the same ids)
    return token_stream(tok, stories(HELDOUT_SEED, 200))


def test_both_bundled_models_share_one_tokenizer():
    ids = [load_bundled(name)[1].encode("Once upon a time, Lily had a red kite.") for name in NAMES]
    assert all(i == ids[0] for i in ids)
    llama, _ = load_bundled("story-llama")
    c = llama.config
    assert (c.family, c.norm, c.positions, c.mlp) == ("llama", "rmsnorm", "rope", "swiglu")
    assert (c.n_head, c.n_kv_heads, c.d_model, c.n_layer, c.n_ctx) == (4, 2, 128, 4, 256)
    assert llama.identity.name == "story-llama" and llama.identity.weights_digest.startswith("sha256:")


def test_hugging_face_reads_the_bundled_llama():
    from transformers import LlamaForCausalLM

    from gpt_shape_tracer.model.sources import ASSETS

    ours, _ = load_bundled("story-llama")
    hf = LlamaForCausalLM.from_pretrained(ASSETS / "story-llama", dtype=torch.float32).eval()
    tokens = torch.randint(1, 1024, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() < 1e-4


def test_heldout_loss_is_far_below_a_unigram_baseline(bundle, heldout):
    _, model, tok = bundle
    windows = heldout[: (heldout.numel() - 1) // 128 * 128 + 1]
    x = windows[:-1].view(-1, 128)[:48]
    y = windows[1:].view(-1, 128)[:48]
    with torch.no_grad():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    train = token_stream(tok, stories(TRAIN_SEED, 2000))
    baseline = unigram_loss(train, y.flatten(), tok.vocab_size)
    assert baseline > 4.0
    assert loss < 0.25 * baseline, (loss, baseline)


def test_the_named_previous_token_head_is_one(bundle, heldout):
    name, model, _ = bundle
    x = heldout[: 32 * 128].view(32, 128)
    scores = previous_token_scores(model, x)  # [layer, head]: mean weight on position i−1
    layer, head, lowest = PREVIOUS_TOKEN_HEAD[name]
    assert scores[layer, head].item() >= lowest, scores
    assert divmod(int(scores.argmax()), model.config.n_head) == (layer, head)


def test_the_named_induction_heads_are_induction_heads(bundle):
    name, model, tok = bundle
    tokens = repeated_random_tokens(tok.vocab_size, 50, 16, seed=123, prefix=tok.eos_id)
    scores = induction_scores(model, tokens, 50)
    for layer, head in INDUCTION_HEADS[name]:
        assert scores[layer, head].item() >= 0.5, scores


def test_greedy_continuation_is_fluent_corpus_like_text(bundle):
    _, model, tok = bundle
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


def test_sampled_continuations_stay_in_the_corpus_language(bundle):
    _, model, tok = bundle
    prompt = "Tom had a friend named Ben."
    known = lexicon()
    for seed in range(3):
        out = tok.decode(generate(model, tok.encode(prompt), 40, SamplingConfig(temperature=0.8, seed=seed)))
        words = re.findall(r"[A-Za-z]+", out)
        assert sum(w.lower() in known for w in words) / max(1, len(words)) >= 0.8, out


def test_every_heads_ablation_effect_is_the_documented_table(bundle):
    """Each entry of docs/bundled-models.md's table, recomputed: zero one head, measure the loss on the repeat."""
    name, model, tok = bundle
    tokens = repeated_random_tokens(tok.vocab_size, 50, 16, seed=321, prefix=tok.eos_id)
    intact, effects = ablation_effects(model, tokens, 50)
    table_intact, table = ABLATION[name]
    assert intact == pytest.approx(table_intact, abs=0.01)
    assert (effects - torch.tensor(table)).abs().max().item() < 0.01, effects
    page = PAGE.read_text(encoding="utf-8")
    for layer, row in enumerate(table):
        cells = " | ".join(f"{v:+.2f}" for v in row)
        assert f"| {name} L{layer} | {cells} |" in page, (name, layer)


def test_the_induction_heads_depend_on_the_previous_token_head(bundle):
    """The circuit is real: knock out the previous-token head and induction stops working."""
    name, model, tok = bundle
    tokens = repeated_random_tokens(tok.vocab_size, 50, 16, seed=321, prefix=tok.eos_id)
    layer, head, _ = PREVIOUS_TOKEN_HEAD[name]
    intact_loss, intact_score = repeat_loss(model, tokens, 50), induction_scores(model, tokens, 50).max().item()
    with ablated(model, layer, head):
        broken_loss, broken_score = repeat_loss(model, tokens, 50), induction_scores(model, tokens, 50).max().item()
    assert broken_score < 0.5 * intact_score, (intact_score, broken_score)
    assert broken_loss > intact_loss + 2.0, (intact_loss, broken_loss)


@pytest.mark.parametrize("name", NAMES)
def test_the_bundled_models_stop_where_their_stories_end(name):
    """Every training story ends with <|endoftext|> (model.train.token_stream), and the config declares it as
    end-of-sequence: "stop at EOS" (on by default) stops a generation there, and off goes on past it."""
    from gpt_shape_tracer.tracer import TracedGeneration

    model, tok = load_bundled(name)
    assert tok.eos_ids == (tok.encode("<|endoftext|>")[0],) == (0,)
    gen = TracedGeneration(model, tok, ["Once upon a time, Tom had a red ball. He"], temperature=0, capture="shapes")
    steps = gen.run(250)
    assert steps < 250 and "end-of-sequence" in gen.stopped and gen.text(0).endswith("<|endoftext|>")
    going_on = TracedGeneration(model, tok, ["Once upon a time, Tom had a red ball. He"], temperature=0,
                                capture="shapes", stop_at_eos=False)
    assert going_on.run(steps + 3) == steps + 3 and not going_on.stopped
