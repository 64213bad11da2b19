"""XLNet traced through its own relative attention (model/sources/_hf_own_attention.py): its scores are a sum of
two query–key products — the content term (queries plus r_w_bias, times the keys: recorded as Q·Kᵀ) and the position
term (queries plus r_r_bias, times keys made from sinusoidal encodings of the query–key distance, shifted to key
positions: recorded as the score bias B, times the scale) — and what it keeps between steps is each layer's input
hidden states (its ``mems``), not K and V: the cache holds them (``hook_mems``) and every step computes K and V
again from them.

Built as the sweep builds it (tests/hf_every_architecture.py) with attn_type "uni", XLNet's causal attention. Checked
against transformers' own eager forward (logits, ``output_attentions``, the mems it returns), against the pattern
recomputed from the recorded tensors, against the position term recomputed from XLNet's own parameters, and the
cache view's sentence against the records."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import HFDecoder
from tests.hf_every_architecture import DECODE_STEPS, PROMPT, TOLERANCE, build, check
from tests.model.test_hf_own_attention import recomputed_pattern, recorded

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def xlnet() -> Path:
    """XLNet's causal attn_type "uni" (its checkpoints' "bi", which the sweep builds, is tested below)."""
    return build("xlnet", Path(tempfile.mkdtemp(prefix="hf-xlnet-")) / "xlnet", attn_type="uni")


def _ids() -> torch.Tensor:
    return torch.randint(0, 200, (1, PROMPT + DECODE_STEPS), generator=torch.Generator().manual_seed(5))


def _steps(ids: torch.Tensor) -> list[torch.Tensor]:
    return [ids[:, :PROMPT]] + [ids[:, i:i + 1] for i in range(PROMPT, PROMPT + DECODE_STEPS)]


def _theirs(directory: Path, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple], list[tuple]]:
    """transformers' eager forward, its mems handed back at each step: logits, the mems after each step, and the
    attention weights it returns."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    logits, mems_after, weights = [], [], []
    mems = None
    with torch.no_grad():
        for step in _steps(ids):
            out = hf(input_ids=step, mems=mems, use_mems=True, output_attentions=True)
            mems = out.mems
            logits.append(out.logits)
            mems_after.append(tuple(out.mems))
            weights.append(tuple(out.attentions))
    return logits, mems_after, weights


def test_the_default_bidirectional_xlnet_is_traced_without_a_cache_every_step_transformers_forward(tmp_path):
    """XLNet's checkpoints' attn_type "bi" lets every position of the text see every other (a permutation LM): traced
    as CPM-Ant is, without a cache, every step a full forward of the whole text equal to transformers' own; the
    recorded pattern is transformers' attention weights, row 0 attending to the positions after it; the mask view
    says the mask is not causal; the model says why there is no cache and what its generate() does instead."""
    from transformers import AutoModelForCausalLM

    from gpt_shape_tracer.figures.mask import mask_facts
    from gpt_shape_tracer.figures.view_takeaways import mask_takeaway
    from gpt_shape_tracer.tracer import TracedGeneration
    from tests.model.test_every_architecture import _first_sees_second
    from tests.model.test_hf_reach_more import with_tokenizer

    directory = with_tokenizer("xlnet", tmp_path)  # the sweep's config (attn_type "bi"), the bundled tokenizer
    assert _first_sees_second(directory)
    model, tok = load_hf(directory)
    assert model.config.bidirectional and 'attn_type "bi"' in model.no_cache_reason
    assert model.reference_note is not None and "query stream" in model.reference_note
    with pytest.raises(Exception, match="every step recomputes all positions"):
        model.new_cache(1)
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom"], temperature=0, use_cache=False)  # padded
    gen.run(DECODE_STEPS)
    facts = gen.facts
    for step in range(gen.n_steps):
        ids = torch.tensor([facts.columns(b, step) for b in range(2)])
        mask = torch.tensor([[int(c) for c in facts.is_token(b, step)] for b in range(2)])
        assert not bool(mask.all())  # "Tom" is left-padded
        with torch.no_grad():
            out = hf(input_ids=ids, attention_mask=mask, use_mems=False, output_attentions=True)
        ours = gen.trace.get("hook_logits", step)
        real = mask.bool()
        assert ours.shape == out.logits.shape and float((ours - out.logits)[real].abs().max()) <= TOLERANCE, step
        pattern = gen.trace.get("blocks.0.attn.hook_pattern", step)
        torch.testing.assert_close(pattern[1], out.attentions[0][1], rtol=0, atol=1e-6)  # the unpadded prompt
        assert float(pattern[1, :, 0, 1:].sum()) > 0  # position 0 attends to the positions after it
    said = mask_takeaway(mask_facts(gen.trace, gen.n_steps - 1, 0)).sentence
    assert "not causal" in said, said


def test_logits_equal_transformers_at_the_prefill_and_cached_steps(xlnet):
    result = check("xlnet", xlnet)
    assert result.outcome == "traced" and len(result.deltas) == 1 + DECODE_STEPS, result
    assert max(result.deltas) <= TOLERANCE, result
    model, _ = load_hf(xlnet)
    ids = _ids()
    _, ours = recorded(model, _steps(ids))
    theirs, _, _ = _theirs(xlnet, ids)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0)
    _, whole = recorded(model, [ids[:, :i] for i in range(PROMPT, PROMPT + DECODE_STEPS + 1)], cache=False)
    for a, b in zip(ours, whole):  # causal: the cached step is the whole text's last row
        torch.testing.assert_close(a, b[:, -a.shape[1]:], atol=1e-5, rtol=0)


def test_the_pattern_is_the_softmax_of_content_plus_position_scores_and_transformers_own(xlnet):
    model, _ = load_hf(xlnet)
    assert isinstance(model, HFDecoder)
    ids = _ids()
    per_step, _ = recorded(model, _steps(ids))
    _, _, weights = _theirs(xlnet, ids)
    hf = model.hf
    H, d = model.config.n_head, model.config.d_head
    assert model.config.attn_scale == pytest.approx(d ** -0.5)
    for s, step in enumerate(per_step):
        n, t = (PROMPT, PROMPT) if s == 0 else (1, PROMPT + s)
        mlen = t - n
        for L, r in step.items():
            attn = hf.transformer.layer[L].rel_attn
            assert tuple(r["hook_pattern"].shape) == (1, H, n, t) and tuple(r["hook_score_bias"].shape) == (1, H, n, t)
            # the total score as the model has it: content scores × scale + position term + mask
            total = r["hook_attn_scores"].double() + r["hook_score_bias"].double() + r["hook_mask"].double()
            seen = torch.isfinite(r["hook_mask"][0, 0])
            assert torch.equal(~seen, torch.ones(n, t, dtype=torch.bool).triu(mlen + 1))  # causal
            torch.testing.assert_close(total[..., seen], r["hook_masked_scores"].double()[..., seen], atol=1e-4,
                                       rtol=1e-6)
            torch.testing.assert_close(torch.softmax(total, -1), r["hook_pattern"].double(), atol=1e-6, rtol=0)
            torch.testing.assert_close(recomputed_pattern(r, model.config.attn_scale), r["hook_pattern"].double(),
                                       atol=1e-6, rtol=0)
            torch.testing.assert_close(r["hook_pattern"], weights[s][L], atol=1e-6, rtol=0)  # transformers' own
            # the content term: Q (the queries plus r_w_bias) times the keys of every position
            torch.testing.assert_close(r["hook_qk"], r["hook_q"] @ r["hook_k_all"].transpose(-1, -2), atol=1e-5,
                                       rtol=0)
            # the position term, from XLNet's own parameters: (q + r_r_bias) · R[distance] W_r, × scale, at the
            # keys each query sees (distance mlen + i − j ≥ 0)
            q = r["hook_q"][0].double() - attn.r_w_bias.double()[:, None, :]  # [H, n, d]: the plain queries
            pos = hf.transformer.relative_positional_encoding(n, t, bsz=1)[:, 0].double()  # [t + 1, d_model]
            k_r = torch.einsum("ph,hnd->npd", pos, attn.r.double())  # [H, t + 1, d]
            raw = torch.einsum("nid,npd->nip", q + attn.r_r_bias.double()[:, None, :], k_r)  # [H, n, t + 1]
            i, j = torch.meshgrid(torch.arange(n), torch.arange(t), indexing="ij")
            index = (t - (mlen + i - j)).clamp(0, t)  # pos_seq runs from t down to 0: entry t − distance
            expected = raw.gather(2, index[None].expand(H, n, t)) * attn.scale
            torch.testing.assert_close(r["hook_score_bias"][0].double()[:, seen], expected[:, seen], atol=1e-5,
                                       rtol=0)


def test_what_it_keeps_between_steps_is_its_mems(xlnet):
    """hook_mems after each step is the hidden states transformers' own forward hands back, [B, m, d] per layer,
    growing by the step's tokens; the cache holds no K, V rows."""
    model, _ = load_hf(xlnet)
    ids = _ids()
    kept: list[dict[int, torch.Tensor]] = []
    handles = [block.hook_mems.add_tap(lambda x, L=L: kept[-1].__setitem__(L, x.clone()))
               for L, block in enumerate(model.blocks)]
    cache = model.new_cache()
    try:
        with torch.no_grad():
            for step in _steps(ids):
                kept.append({})
                model(step, cache)
    finally:
        for h in handles:
            h.remove()
    _, mems_after, _ = _theirs(xlnet, ids)
    for s, (ours, theirs) in enumerate(zip(kept, mems_after)):
        assert sorted(ours) == list(range(model.config.n_layer))
        for L, m in ours.items():
            assert tuple(m.shape) == (1, PROMPT + s, model.config.d_model)
            torch.testing.assert_close(m, theirs[L].transpose(0, 1), atol=1e-5, rtol=0)
    assert cache.length == PROMPT + DECODE_STEPS


@pytest.mark.parametrize("model_type", ["xlnet", "reformer"])
def test_the_cache_view_says_it_keeps_hidden_states_not_k_and_v(tmp_path, model_type):
    """The KV-cache view of a generation: every layer's row holds no K, V bytes and its held hidden states with
    their bytes; the memory sentence counts them from the records (and the cache itself) beside the K and V the
    model computes again; the bytes over the steps are the held hidden states; the recompute check says why it has
    no cached K, V rows to compare. A padded batch is refused with the reason."""
    from gpt_shape_tracer.figures import cache
    from gpt_shape_tracer.model.sources import HFDecoderError
    from gpt_shape_tracer.tracer import TracedGeneration
    from gpt_shape_tracer.tracer.costs import kv_cache_bytes
    from tests.model.test_hf_state_space import build_state_space

    model, tok = load_hf(build_state_space(model_type, tmp_path / model_type), implementation="transformers")
    gen = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0)
    gen.run(3)
    gen.compare_with_recompute()
    trace, config = gen.trace, model.config
    last = gen.n_steps - 1
    prompt = trace.record("blocks.0.attn.hook_q", 0).shape[2]
    t = prompt + last
    table = cache.cache_table(trace, last)
    assert list(table["layer"]) == list(range(config.n_layer))
    assert set(table["bytes (K+V)"]) == {0} and set(table["rows from the cache"]) == {0}
    assert set(table["rows computed this step"]) == {t}
    held = [trace.record(f"blocks.{L}.hook_mems", last) for L in range(config.n_layer)]
    assert all(tuple(rec.shape) == (1, t, config.d_model) for rec in held)
    assert list(table["bytes held"]) == [rec.nbytes for rec in held]
    carried = gen.cache.carried[:config.n_layer]  # Reformer's empty LSH buckets after them
    assert sum(x.nbytes for x in carried) == sum(rec.nbytes for rec in held) == kv_cache_bytes(trace, last)
    assert all(x.numel() == 0 for x in gen.cache.carried[config.n_layer:])
    latex, sentence = cache.memory_formula(trace, last)
    numbers = t * config.d_model
    kv = 2 * config.n_kv_heads * t * config.d_head
    assert sentence.startswith(f"{config.n_layer} layers × {numbers:,} numbers × 4 bytes")
    assert "this model's cache holds no K and V" in sentence and f"{t} position(s) of width d = {config.d_model}" \
        in sentence
    assert ("XLNet's mems" if model_type == "xlnet" else "Reformer's past_buckets_states") in sentence
    assert f"all t = {t} positions again" in sentence and f"= {kv:,} numbers per layer" in sentence
    assert f"= {numbers:,}" in latex
    assert cache.state_sentence(trace, last) is None
    growth = cache.cache_growth(trace)
    assert list(growth["K+V bytes (all layers)"]) == [(prompt + s) * config.d_model * 4 * config.n_layer
                                                      for s in range(gen.n_steps)]
    assert "hidden states" in cache.cache_steps_figure(trace, last).layout.annotations[0].text
    level, text = cache.verdict(cache.facts_of(trace).comparisons[last], trace)
    assert level == "success" and "no cached K, V rows to check" in text
    assert cache.cached_rows_table(cache.facts_of(trace).comparisons[last], trace).empty
    with pytest.raises(HFDecoderError, match="padded batch is not traced"):
        TracedGeneration(model, tok, ["Lily had a red kite.", "Tom said"], temperature=0,
                         padding_side="left").run(1)


# -- Reformer ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reformer() -> Path:
    return build("reformer", Path(tempfile.mkdtemp(prefix="hf-reformer-")) / "reformer")


def test_reformer_logits_equal_transformers_at_the_prefill_and_cached_steps(reformer):
    """Its local and LSH layers, their weights written out as exp(x − logsumexp x), its cache its own object
    (past_buckets_states) carried from step to step: equal to transformers' cached forward, and — causal — to the
    whole text's last rows."""
    result = check("reformer", reformer)
    assert result.outcome == "traced" and len(result.deltas) == 1 + DECODE_STEPS, result
    assert max(result.deltas) <= TOLERANCE, result
    model, _ = load_hf(reformer)
    ids = _ids()
    _, ours = recorded(model, _steps(ids))
    _, whole = recorded(model, [ids[:, :i] for i in range(PROMPT, PROMPT + DECODE_STEPS + 1)], cache=False)
    for a, b in zip(ours, whole):
        torch.testing.assert_close(a, b[:, -a.shape[1]:], atol=1e-5, rtol=0)


def test_reformer_patterns_are_its_weights_with_the_lsh_self_mask(reformer):
    """Local layer: a causal mask. LSH layer (queries and keys shared): each query's own key hidden as well (its
    −10⁵ fill), except the first query's, which has no other key and keeps all its weight there. The pattern is
    softmax of the recorded scores and mask, and transformers' own returned weights at the prefill."""
    from transformers import AutoModelForCausalLM

    model, _ = load_hf(reformer)
    assert model.config.attn_scale == 1.0  # its keys come scaled: by 1/√d_head (local), normalised (LSH)
    ids = _ids()
    per_step, _ = recorded(model, _steps(ids))
    hf = AutoModelForCausalLM.from_pretrained(reformer, local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids[:, :PROMPT], output_attentions=True).attentions
    kinds = list(hf.config.attn_layers)
    assert kinds == ["local", "lsh"]
    for s, step in enumerate(per_step):
        n, t = (PROMPT, PROMPT) if s == 0 else (1, PROMPT + s)
        for L, r in step.items():
            seen = r["hook_mask"][0, 0] == 0
            causal = torch.ones(n, t, dtype=torch.bool).tril(t - n)
            if kinds[L] == "lsh":
                causal &= torch.arange(t)[None] != (t - n + torch.arange(n))[:, None]  # each query's own key
                if s == 0:
                    causal[0, 0] = True  # the first query: nothing else to see
            assert torch.equal(seen, causal), (s, L)
            torch.testing.assert_close(recomputed_pattern(r, model.config.attn_scale), r["hook_pattern"].double(),
                                       atol=1e-6, rtol=0)
            if s == 0:
                torch.testing.assert_close(r["hook_pattern"], theirs[L], atol=1e-6, rtol=0)


def test_reformer_keeps_its_hidden_states_and_refuses_past_its_plain_attention(reformer):
    """hook_mems after each step is the states transformers' own cache object holds; the model is traced up to its
    shortest chunk length less one (beyond, its layers chunk and hash), and a longer text is refused clearly."""
    from transformers import AutoModelForCausalLM

    model, _ = load_hf(reformer)
    hf = AutoModelForCausalLM.from_pretrained(reformer, local_files_only=True, attn_implementation="eager").eval()
    assert model.config.n_ctx == min(hf.config.local_attn_chunk_length, hf.config.lsh_attn_chunk_length) - 1
    ids = _ids()
    kept: list[dict[int, torch.Tensor]] = []
    handles = [block.hook_mems.add_tap(lambda x, L=L: kept[-1].__setitem__(L, x.clone()))
               for L, block in enumerate(model.blocks)]
    cache = model.new_cache()
    past = None
    try:
        with torch.no_grad():
            for step in _steps(ids):
                kept.append({})
                model(step, cache)
                past = hf(input_ids=step, past_buckets_states=past, use_cache=True).past_buckets_states
                for L, m in kept[-1].items():
                    torch.testing.assert_close(m, past.states_cache[L], atol=1e-5, rtol=0)
    finally:
        for h in handles:
            h.remove()
    assert len(kept[-1]) == model.config.n_layer and kept[-1][0].shape[1] == PROMPT + DECODE_STEPS
    with pytest.raises(ValueError, match=str(model.config.n_ctx)), torch.no_grad():
        model(torch.zeros(1, model.config.n_ctx + 1, dtype=torch.long))


@pytest.mark.parametrize("model_type", ["xlnet", "reformer"])
def test_the_app_runs_every_tab_and_its_kv_cache_tab_says_what_is_kept(tmp_path, model_type):
    """The real app (AppTest): the directory loaded, two steps, every tab without error; the KV cache tab's
    sentence is the one counted from this run's records (hidden states, not K and V)."""
    from gpt_shape_tracer.figures import cache
    from tests.app.test_app import page_text, show_tab
    from tests.app.test_app_architectures import every_tab_without_error, opened_and_stepped
    from tests.model.test_hf_state_space import build_state_space

    directory = build_state_space(model_type, tmp_path / model_type)
    at = opened_and_stepped(directory)
    every_tab_without_error(at)
    show_tab(at, "KV cache")
    assert not at.error, [e.value for e in at.error]
    gen = at.session_state["app"].live.generation
    step = gen.n_steps - 1
    _, sentence = cache.memory_formula(gen.trace, step)
    assert "this model's cache holds no K and V" in sentence
    assert sentence in page_text(at)


def test_the_mask_view_names_the_lsh_layers_own_key_cause(tmp_path):
    """Every −∞ cell of Reformer's masks has a cause the view names: in its LSH layer, the key after the query, and
    the query's own key (all rows but the first at the prefill; the one query's at a cached step); none unexplained.
    Its local layer hides no own key."""
    from gpt_shape_tracer.figures.mask import OWN_KEY, mask_facts
    from gpt_shape_tracer.figures.view_takeaways import mask_takeaway
    from gpt_shape_tracer.tracer import TracedGeneration
    from tests.model.test_hf_state_space import build_state_space

    model, tok = load_hf(build_state_space("reformer", tmp_path / "reformer"), implementation="transformers")
    gen = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0)
    gen.run(2)
    n = gen.trace.record("blocks.1.attn.hook_q", 0).shape[2]
    for step, own in ((0, n - 1), (1, 1)):
        local, lsh = mask_facts(gen.trace, step, 0), mask_facts(gen.trace, step, 1)
        assert local.unexplained == lsh.unexplained == 0 and local.own == 0
        assert lsh.own == own and lsh.masked == lsh.future + own
        assert f"{own} {OWN_KEY}" in lsh.explanation()
        assert OWN_KEY in mask_takeaway(lsh).sentence and OWN_KEY not in mask_takeaway(local).sentence


def test_the_app_runs_the_bidirectional_xlnet_without_a_cache_every_tab(tmp_path):
    """The real app (AppTest) on XLNet's checkpoints' attn_type "bi": loaded, stepped without a cache (the sidebar's
    cache off, the reason said), every tab without an error; the mask tab says the mask is not causal."""
    from tests.app.test_app import page_text, show_tab
    from tests.app.test_app_architectures import every_tab_without_error, opened_and_stepped
    from tests.model.test_hf_reach_more import with_tokenizer

    at = opened_and_stepped(with_tokenizer("xlnet", tmp_path))
    app = at.session_state["app"]
    assert app.live.generation is not None and not app.live.generation.use_cache
    every_tab_without_error(at)
    show_tab(at, "Attention mask")
    assert not at.error, [e.value for e in at.error]
    assert "not causal" in page_text(at)
    labels = [t.label for t in at.tabs]
    assert "Attention mask" in labels and "Causal mask" not in labels, labels
