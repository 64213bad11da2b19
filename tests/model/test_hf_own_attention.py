"""Attention computed in a family's own code (model/sources/_hf_own_attention.py): the 17 causal-LM types of
transformers whose attention modules compute the softmax themselves instead of calling transformers' attention
function (OpenAI GPT, which keeps no cache, in tests/model/test_hf_reach_more.py; CPM-Ant, traced without one, in
tests/model/test_hf_cpmant.py). Each is a tiny random-weight directory built from its own config class
(tests/hf_every_architecture.py).

Traced types: logits equal to transformers' eager forward at the prefill and 3 cached steps; the recorded pattern
equal to one recomputed here from the recorded Q, K, scale, bias and mask, and to the weights transformers' own eager
forward returns (``output_attentions``); z equal to the pattern times the recorded V; the records' shapes as the hook
table writes them; the cache on and off giving the same logits and patterns; a forward hook that replaces the pattern
changing what the module computes. Refused types: refused, with the reason each one's ops show."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import ModelLoadError, load_hf
from gpt_shape_tracer.model.sources import HFDecoder, HFDecoderError
from tests.hf_every_architecture import DECODE_STEPS, PROMPT, TOLERANCE, build, check

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRACED = ["bloom", "mpt", "codegen", "xglm", "gpt_neox_japanese", "trocr", "mvp", "big_bird", "roformer", "rembert",
          "megatron-bert", "xlm"]  # XLM built causal (its CLM); OpenAI GPT (no cache): test_hf_reach_more.py
# the reason each refused type's ops (or its forward's signature) show, and words its message must hold
REFUSED = {
    "prophetnet": ("several attentions per layer", "2 softmax attentions"),
}
WITH_BIAS = {"bloom", "mpt"}  # ALiBi: a bias beside the mask
NAMES = ("hook_q", "hook_k", "hook_v", "hook_k_all", "hook_v_all", "hook_qk", "hook_attn_scores", "hook_mask",
         "hook_masked_scores", "hook_pattern", "hook_z", "hook_score_bias")


@pytest.fixture(scope="module")
def directories():
    root = Path(tempfile.mkdtemp(prefix="hf-own-"))
    return {}, root


def directory_of(directories, model_type: str) -> Path:
    built, root = directories
    if model_type not in built:
        built[model_type] = build(model_type, root / model_type)
    return built[model_type]


def tokens() -> torch.Tensor:
    return torch.randint(0, 200, (1, PROMPT + DECODE_STEPS), generator=torch.Generator().manual_seed(3))


Records = list[dict[int, dict[str, torch.Tensor]]]


def recorded(model: HFDecoder, steps: list[torch.Tensor], cache: bool = True) -> tuple[Records, list[torch.Tensor]]:
    """Per forward, per layer, every attention record (taps: what the model went on to use), and the logits."""
    out: Records = []
    handles = []
    for L, block in enumerate(model.blocks):
        for name in NAMES:
            point = getattr(block.attn, name, None)
            if point is not None:
                handles.append(point.add_tap(lambda x, L=L, name=name: out[-1].setdefault(L, {}).__setitem__(
                    name, x.detach().clone())))
    kv = model.new_cache() if cache else None
    logits = []
    try:
        with torch.no_grad():
            for step in steps:
                out.append({})
                logits.append(model(step, kv))
    finally:
        for h in handles:
            h.remove()
    return out, logits


def recomputed_pattern(r: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """softmax(Q·Kᵀ·scale + bias + M) from the records, in float64 (each query head h reads key head h // (H/G))."""
    q, k = r["hook_q"].double(), r["hook_k_all"].double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if "hook_score_bias" in r:
        scores = scores + r["hook_score_bias"].double()
    if "hook_mask" in r:
        scores = scores + r["hook_mask"].double()
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("model_type", TRACED)
def test_logits_equal_transformers_at_the_prefill_and_cached_steps(directories, model_type):
    result = check(model_type, directory_of(directories, model_type))
    assert result.outcome == "traced", result
    assert len(result.deltas) == 1 + DECODE_STEPS and max(result.deltas) <= TOLERANCE, result


@pytest.mark.parametrize("model_type", TRACED)
def test_pattern_is_recomputed_from_the_recorded_q_k_and_mask(directories, model_type):
    directory = directory_of(directories, model_type)
    model, _ = load_hf(directory)
    assert isinstance(model, HFDecoder)
    ids = tokens()
    steps = [ids[:, :PROMPT]] + [ids[:, i:i + 1] for i in range(PROMPT, PROMPT + DECODE_STEPS)]
    per_step, _ = recorded(model, steps)
    H, G, d = model.config.n_head, model.config.n_kv_heads, model.config.d_head
    for s, step in enumerate(per_step):
        n, t = (PROMPT, PROMPT) if s == 0 else (1, PROMPT + s)
        assert sorted(step) == list(range(model.config.n_layer))
        for L, r in step.items():
            assert tuple(r["hook_q"].shape) == (1, H, n, d)
            assert tuple(r["hook_k"].shape) == (1, G, n, d) and tuple(r["hook_v"].shape)[:3] == (1, G, n)
            assert tuple(r["hook_k_all"].shape) == (1, G, t, d) and tuple(r["hook_v_all"].shape)[:3] == (1, G, t)
            for name in ("hook_qk", "hook_attn_scores", "hook_masked_scores", "hook_pattern"):
                assert tuple(r[name].shape) == (1, H, n, t), name
            assert tuple(r["hook_mask"].shape) == (1, 1, n, t)
            assert tuple(r["hook_z"].shape)[:3] == (1, H, n)
            assert ("hook_score_bias" in r) == (model_type in WITH_BIAS)
            # the new keys are the cache's last rows; the mask hides exactly the keys after each query
            assert torch.equal(r["hook_k"], r["hook_k_all"][:, :, t - n:])
            hidden = r["hook_mask"][0, 0] == float("-inf")
            assert torch.equal(hidden, torch.ones(n, t, dtype=torch.bool).triu(t - n + 1)), (L, s)
            pattern = r["hook_pattern"].double()
            torch.testing.assert_close(recomputed_pattern(r, model.config.attn_scale), pattern, atol=1e-5, rtol=0)
            v = r["hook_v_all"].double().repeat_interleave(H // G, dim=1)
            torch.testing.assert_close(pattern @ v, r["hook_z"].double(), atol=1e-5, rtol=0)


def _transformers_weights(directory: Path, ids: torch.Tensor) -> tuple:
    """The attention weights transformers' own eager forward returns (``output_attentions``); BigBird's causal LM
    returns none, so for it the weights its self-attention modules return beside their output."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    if hf.config.model_type == "big_bird":  # a forward this short switches it to full attention, new modules and all
        with torch.no_grad():
            hf(input_ids=ids)
    returned: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda m, a, out: returned.append(out[1])) for name, m in hf.named_modules()
               if name.endswith("attention.self")] if hf.config.model_type == "big_bird" else []
    with torch.no_grad():
        weights = hf(input_ids=ids, output_attentions=True).attentions or ()
    for h in handles:
        h.remove()
    return tuple(weights) or tuple(returned)


@pytest.mark.parametrize("model_type", TRACED)
def test_pattern_is_transformers_own_attention_weights(directories, model_type):
    """Where the family returns its weights (``output_attentions``), they are the recorded pattern of each layer."""
    directory = directory_of(directories, model_type)
    model, _ = load_hf(directory)
    ids = tokens()[:, :PROMPT]
    per_step, _ = recorded(model, [ids])
    theirs = _transformers_weights(directory, ids)
    assert len(theirs) == model.config.n_layer  # every one of these families returns them
    for L, weights in enumerate(theirs):
        ours = per_step[0][L]["hook_pattern"]
        torch.testing.assert_close(ours, weights.reshape(ours.shape), atol=1e-6, rtol=0)


# ALiBi, heads flattened, BERT-style, a cache under its own keyword filled with the whole text
@pytest.mark.parametrize("model_type", ["bloom", "xglm", "roformer", "xlm"])
def test_cache_on_and_off_give_the_same_logits_and_patterns(directories, model_type):
    model, _ = load_hf(directory_of(directories, model_type))
    ids = tokens()
    steps = [ids[:, :PROMPT]] + [ids[:, i:i + 1] for i in range(PROMPT, PROMPT + DECODE_STEPS)]
    cached, cached_logits = recorded(model, steps)
    whole = [ids[:, :i] for i in range(PROMPT, PROMPT + DECODE_STEPS + 1)]
    uncached, uncached_logits = recorded(model, whole, cache=False)
    for s in range(1 + DECODE_STEPS):
        n = cached_logits[s].shape[1]
        torch.testing.assert_close(cached_logits[s], uncached_logits[s][:, -n:], atol=1e-5, rtol=0)
        for L in range(model.config.n_layer):
            torch.testing.assert_close(cached[s][L]["hook_pattern"], uncached[s][L]["hook_pattern"][:, :, -n:],
                                       atol=1e-6, rtol=0)


@pytest.mark.parametrize("model_type", ["bloom", "roformer"])
def test_the_fused_attention_setting_leaves_the_familys_own_attention_masked(directories, model_type):
    """The attention-path setting "fused" has our mask function leave transformers' mask unbuilt; a family whose own
    code reads that mask would then see every key. After load_hf (whose guard switches the model to transformers'
    eager attention and back) the model runs transformers' eager path, mask included, under either setting."""
    from gpt_shape_tracer.model.gpt import attention_path

    model, _ = load_hf(directory_of(directories, model_type))
    assert model.hf.config._attn_implementation == "eager"
    ids = tokens()[:, :PROMPT]
    (eager,), eager_logits = recorded(model, [ids], cache=False)
    with attention_path("fused"):
        (fused,), fused_logits = recorded(model, [ids], cache=False)
        model.hf.config._attn_implementation = "shape_tracer"  # as it was loaded, or as something might leave it
        (again,), again_logits = recorded(model, [ids], cache=False)
    for logits in (fused_logits, again_logits):
        torch.testing.assert_close(logits[0], eager_logits[0], atol=0, rtol=0)
    for records in (fused, again):
        assert torch.equal(records[0]["hook_pattern"], eager[0]["hook_pattern"])
    assert float(eager[0]["hook_pattern"][0, 0, 0, 1]) == 0.0  # the first query sees only itself


def test_a_hook_that_replaces_the_pattern_changes_what_the_module_computes(directories):
    """Uniform weights over the keys each query sees, put in by a forward hook on hook_pattern: z is then the mean of
    the values seen, and the logits change."""
    model, _ = load_hf(directory_of(directories, "bloom"))
    ids = tokens()[:, :PROMPT]
    with torch.no_grad():
        before = model(ids)
    point = model.blocks[0].attn.hook_pattern

    def uniform(module, args, out):
        seen = (out > 0).to(out.dtype)
        return seen / seen.sum(-1, keepdim=True)

    handle = point.register_forward_hook(uniform)
    try:
        per_step, logits = recorded(model, [ids], cache=False)
    finally:
        handle.remove()
    r = per_step[0][0]
    v = r["hook_v_all"]
    means = torch.stack([v[:, :, :i + 1].mean(dim=2) for i in range(PROMPT)], dim=2)  # [B,H,n,d]
    torch.testing.assert_close(r["hook_z"], means, atol=1e-5, rtol=0)
    assert float((logits[0] - before).abs().max()) > 1e-3


def test_switching_a_head_off_at_hook_z_is_transformers_with_that_head_zeroed_before_w_o(directories):
    """A head switched off (zero at ``hook_z``, as the app's head ablation does) on Bloom equals transformers' own
    model with that head's slice of the merged heads zeroed on the way into its output projection (``dense``)."""
    from transformers import AutoModelForCausalLM

    directory = directory_of(directories, "bloom")
    model, _ = load_hf(directory)
    ids = tokens()[:, :PROMPT]

    def zero_z(module, args, z):  # what the app's "Switch heads off" puts on hook_z: [B, H, n, d_head]
        z = z.clone()
        z[:, 1] = 0
        return z

    handle_z = model.blocks[0].attn.hook_z.register_forward_hook(zero_z)
    with torch.no_grad():
        ours = model(ids)
    handle_z.remove()
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    d = model.config.d_head

    def zero_head(module, args):
        merged = args[0].clone()
        merged[..., d:2 * d] = 0
        return (merged, *args[1:])

    handle = hf.transformer.h[0].self_attention.dense.register_forward_pre_hook(zero_head)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        handle.remove()
        plain = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    assert float((theirs - plain).abs().max()) > 1e-3  # the head mattered


def test_a_hook_that_replaces_an_earlier_stage_is_refused_with_a_clear_error(directories):
    model, _ = load_hf(directory_of(directories, "mpt"))
    handle = model.blocks[0].attn.hook_q.register_forward_hook(lambda m, a, out: out * 2)
    try:
        with pytest.raises(HFDecoderError, match="cannot be applied"), torch.no_grad():
            model(tokens()[:, :PROMPT])
    finally:
        handle.remove()
    with torch.no_grad():  # the model is left as it was: the next forward runs
        model(tokens()[:, :PROMPT])


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_with_the_reason_its_ops_show(directories, model_type):
    reason, words = REFUSED[model_type]
    with pytest.raises(ModelLoadError) as raised:
        load_hf(directory_of(directories, model_type))
    assert getattr(raised.value, "reason", None) == reason, str(raised.value)
    assert words in str(raised.value)


def test_an_encoder_configured_bert_type_keeps_its_config_refusal(tmp_path):
    """roformer with is_decoder = false: refused by its config, before any op is read."""
    from transformers import RoFormerConfig, RoFormerForCausalLM

    from gpt_shape_tracer.model.sources._hf_refusals import refusal_by_config

    config = RoFormerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64, is_decoder=False)
    refusal = refusal_by_config(config, "roformer")
    assert refusal is not None and refusal.reason == "encoder"
    with pytest.raises(HFDecoderError, match="is_decoder = false"):
        HFDecoder(RoFormerForCausalLM(config))


def test_the_app_opens_such_a_model_and_draws_its_attention():
    """The real app (AppTest) on a tiny Bloom directory (ALiBi, its softmax in its own code): "Local Hugging Face
    directory", Load, Step, the Attention tab, Step — no error, and the tab's softmax heatmap is the recorded
    pattern."""
    from html import unescape

    from transformers import BloomConfig, BloomForCausalLM

    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from tests.app.test_app import new_app, page_text, panels, press, press_reset, show_tab
    from tests.app.test_app_architectures import choose_directory, every_tab_without_error
    from tests.hf_every_architecture import tiny_config

    values = tiny_config("bloom").to_dict()
    values["vocab_size"] = 1024  # the bundled tokenizer's ids
    torch.manual_seed(0)
    directory = Path(tempfile.mkdtemp(prefix="app-bloom-")) / "bloom"
    BloomForCausalLM(BloomConfig(**values)).save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    at = new_app()
    choose_directory(at, directory)
    press(at, "load_model")
    press_reset(at)
    press(at, "step_button")
    show_tab(at, "Attention")
    press(at, "step_button")
    assert not at.error, [e.value for e in at.error]
    assert any("bloom (hf:bloom)" in unescape(c.value) for c in at.caption)
    gen = at.session_state["app"].live.generation
    pattern = gen.trace.get("blocks.0.attn.hook_pattern", 1)  # [1, H, 1, t]: layer 0 at the step shown
    drawn = panels(at)[0]  # the Stages, drawn on the canvas (gui/panels.js)
    assert ["".join(r["t"] for r in line) for line in drawn["title"]["lines"]] == ["layer 0, head 0, step 1"]
    softmaxed = torch.tensor(drawn["panels"][-1]["z"], dtype=torch.float64)  # the last panel: the softmax
    torch.testing.assert_close(softmaxed, pattern[0, 0].double(), atol=1e-6, rtol=0)
    share = f"{float(pattern[0, 0, -1].max()):.3f}"  # the Stages takeaway's own rounding, as its metric's
    assert f"puts {share} of its weight on key {int(pattern[0, 0, -1].argmax())}" in page_text(at)
    every_tab_without_error(at)  # and the rest of the app, the what-if views among them
    for sub in ("Switch heads off", "Activation patching", "Logit lens"):
        show_tab(at, "What if", ("whatif_view", sub))
        assert not at.error, (sub, [e.value for e in at.error])


@pytest.mark.parametrize("model_type", ["bloom", "xglm", "mpt"])
def test_a_dry_run_on_the_meta_device_records_the_same_shapes(tmp_path, model_type):
    """Built from its config alone (no weights, no values): the ops are read by their shapes, and the records of a
    prefill and a cached step have the shapes the weighted model's have."""
    from gpt_shape_tracer.model.sources._dry_run import build_dry
    from tests.hf_every_architecture import tiny_config

    tiny_config(model_type).save_pretrained(tmp_path)
    model = build_dry(tmp_path / "config.json")[0]
    ids = torch.zeros(1, PROMPT + 1, dtype=torch.long, device="meta")
    per_step, logits = recorded(model, [ids[:, :PROMPT], ids[:, PROMPT:]])
    H, G, d = model.config.n_head, model.config.n_kv_heads, model.config.d_head
    assert [tuple(x.shape)[:2] for x in logits] == [(1, PROMPT), (1, 1)]
    for s, (n, t) in enumerate([(PROMPT, PROMPT), (1, PROMPT + 1)]):
        r = per_step[s][0]
        assert r["hook_pattern"].is_meta and tuple(r["hook_pattern"].shape) == (1, H, n, t)
        assert tuple(r["hook_q"].shape) == (1, H, n, d) and tuple(r["hook_k_all"].shape) == (1, G, t, d)
        assert tuple(r["hook_mask"].shape) == (1, 1, n, t)
        assert ("hook_score_bias" in r) == (model_type in WITH_BIAS)


@pytest.mark.parametrize("model_type", sorted(WITH_BIAS))
def test_the_views_recompute_the_pattern_with_the_alibi_bias(directories, model_type):
    """ALiBi is recorded where Inkling's learned bias is (hook_score_bias), so every view that recomputes the
    pattern from the records adds it: the Pitfalls' "as the model does it" equals the recorded pattern at the prefill
    and a cached step, the Stages list B as its own stage named for what it is, and the bias sentence counts it."""
    from gpt_shape_tracer.figures.attention import attention_stages, score_bias_sentence
    from gpt_shape_tracer.figures.pitfalls import pitfall_patterns
    from gpt_shape_tracer.model.gpt import act_name
    from gpt_shape_tracer.tracer import Tracer

    model, _ = load_hf(directory_of(directories, model_type), implementation="transformers")
    ids = tokens()
    cache = model.new_cache(1)
    with Tracer(model) as tracer:  # the prefill, step 0
        model(ids[:, :PROMPT], cache)
    with Tracer(model, trace=tracer.trace) as tracer:  # one cached step, step 1
        model(ids[:, PROMPT:PROMPT + 1], cache)
    trace = tracer.trace
    for step in (0, 1):
        for head in range(model.config.n_head):
            ours = pitfall_patterns(trace, step, 0, head)["as the model does it"]
            torch.testing.assert_close(ours, trace.get(act_name("pattern", 0), step)[0, head].double(),
                                       atol=1e-5, rtol=0)
        stages = attention_stages(trace, step, 0, 0)
        assert any(s.hook == "score_bias" and "ALiBi" in s.shapes for s in stages)
        said = score_bias_sentence(trace, step, 0, 0)
        assert said is not None and "ALiBi: a fixed slope per head" in said and "beyond its reach" not in said
