from __future__ import annotations

import pytest
import torch

from gpt_shape_tracer.model import SamplingConfig, SamplingError, generate, sample
from gpt_shape_tracer.model.sampling import STAGES


def logits_row(values):
    return torch.tensor([values], dtype=torch.float32)


def test_greedy_is_argmax_and_temperature_zero_means_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    res = sample(logits, SamplingConfig(temperature=0))
    assert torch.equal(res.token, logits.argmax(-1))
    assert torch.allclose(res.probs, torch.softmax(logits, -1))


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = torch.zeros(1, 1000)  # uniform: every draw depends only on the generator
    cfg = SamplingConfig(temperature=1.0, seed=42)
    a = [int(sample(logits, cfg, g).token) for g in [cfg.generator()] for _ in range(20)]
    b = [int(sample(logits, cfg, g).token) for g in [cfg.generator()] for _ in range(20)]
    c = [int(sample(logits, SamplingConfig(seed=43), g).token) for g in [SamplingConfig(seed=43).generator()]
         for _ in range(20)]
    assert a == b
    assert a != c


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.arange(10.0)[None]
    cfg = SamplingConfig(temperature=1.0, top_k=3, seed=0)
    g = cfg.generator()
    res = sample(logits, cfg, g)
    assert (res.probs > 0).sum().item() == 3
    assert set(torch.nonzero(res.probs[0]).flatten().tolist()) == {7, 8, 9}
    assert torch.isclose(res.probs.sum(), torch.tensor(1.0))
    draws = {int(sample(logits, cfg, g).token) for _ in range(200)}
    assert draws <= {7, 8, 9}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    res = sample(probs.log()[None], SamplingConfig(temperature=1.0, top_p=0.8))
    assert (res.probs[0] > 0).tolist() == [True, True, False, False]
    assert torch.allclose(res.probs[0, :2], torch.tensor([0.625, 0.375]))
    res = sample(probs.log()[None], SamplingConfig(temperature=1.0, top_p=0.81))
    assert (res.probs[0] > 0).sum().item() == 3


def test_temperature_sharpens_and_flattens():
    logits = logits_row([2.0, 1.0, 0.0])
    cold = sample(logits, SamplingConfig(temperature=0.5)).stage_probs[0, 1]
    hot = sample(logits, SamplingConfig(temperature=2.0)).stage_probs[0, 1]
    base = torch.softmax(logits, -1)[0]
    assert cold.max() > base.max() > hot.max()


def test_stages_record_how_the_distribution_was_reshaped():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(1))
    cfg = SamplingConfig(temperature=0.7, top_k=10, top_p=0.5, seed=3)
    res = sample(logits, cfg, cfg.generator())
    assert res.stage_probs.shape == (2, len(STAGES), 20)
    assert res.kept[:, 0].tolist() == [300, 300]
    assert (res.kept[:, 2] == 10).all() and (res.kept[:, 3] <= 10).all()
    for row in range(2):  # the chosen token is a candidate and has non-zero final probability
        assert res.token[row] in res.candidates[row]
    assert (res.token_prob > 0).all()


def test_top_k_larger_than_vocab_keeps_everything_and_zero_is_off():
    logits = torch.randn(1, 30)
    assert (sample(logits, SamplingConfig(top_k=10_000)).probs > 0).sum() == 30
    assert (sample(logits, SamplingConfig(top_k=0)).probs > 0).sum() == 30


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "≥ 0"),
        ({"temperature": float("nan")}, "finite"),
        ({"temperature": 1e9}, "maximum"),
        ({"temperature": "hot"}, "finite number"),
        ({"top_k": -1}, "non-negative"),
        ({"top_k": 2.5}, "integer"),
        ({"top_p": 0.0}, r"\(0, 1\]"),
        ({"top_p": 1.5}, r"\(0, 1\]"),
        ({"seed": 1.5}, "integer"),
        ({"seed": "abc"}, "integer"),
    ],
)
def test_bad_parameters_raise_the_documented_error(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        SamplingConfig(**kwargs)


def test_generate_with_and_without_cache_agree(bundled):
    model, tok = bundled
    prompt = tok.encode("Once upon a time, there was a little girl named Lily.")
    with_cache = generate(model, prompt, 25, SamplingConfig(temperature=0.8, top_k=40, seed=5), use_cache=True)
    without = generate(model, prompt, 25, SamplingConfig(temperature=0.8, top_k=40, seed=5), use_cache=False)
    assert with_cache == without
    assert len(with_cache) == 25


def test_greedy_is_the_default_in_python_on_the_command_line_and_in_the_app(bundled):
    """TracedGeneration without sampling arguments decodes greedily, as `gpt-shape-tracer trace` and the app do."""
    import json
    import tempfile
    from contextlib import redirect_stdout
    from io import StringIO

    from gpt_shape_tracer.session import DEFAULTS
    from gpt_shape_tracer.trace_command import main
    from gpt_shape_tracer.tracer import TracedGeneration

    model, tok = bundled
    prompts = ["Once upon a time", "Tom said,"]
    default = TracedGeneration(model, tok, prompts)
    default.run(6)
    argmax = TracedGeneration(model, tok, prompts, temperature=0)
    argmax.run(6)
    assert default.facts.info.sampling.greedy
    assert [default.text(r) for r in range(2)] == [argmax.text(r) for r in range(2)]
    assert DEFAULTS.decoding == "greedy"

    with tempfile.TemporaryDirectory() as where, redirect_stdout(StringIO()) as printed:
        assert main(["--prompt", prompts[1], "--steps", "6", "--json", "--out", f"{where}/t.zip"]) == 0
    alone = TracedGeneration(model, tok, prompts[1], temperature=0)
    alone.run(6)
    assert json.loads(printed.getvalue())["texts"] == [alone.text(0)]


def test_the_generator_is_made_where_the_logits_are_and_a_mismatch_is_refused():
    """A draw is made on the logits' device: the generator is asked for there (the CPU's is today's, token for
    token), and one on another device is refused with a message before anything is drawn (meta logits: no GPU
    needed to see it)."""
    cfg = SamplingConfig(temperature=1.0, seed=42)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    on_cpu = cfg.generator("cpu")
    assert on_cpu.device.type == "cpu"
    today = torch.Generator().manual_seed(42)  # the generator every run drew on before
    assert sample(logits, cfg, on_cpu).token.tolist() == sample(logits, cfg, today).token.tolist()
    with pytest.raises(ValueError, match="the generator draws on cpu but the logits are on meta"):
        sample(logits.to("meta"), cfg, cfg.generator())
