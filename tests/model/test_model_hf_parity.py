"""Our GPT against Hugging Face's GPT2LMHeadModel on the same random weights."""

from __future__ import annotations

import torch

TOL = 1e-4


def test_full_forward_matches_hf(hf_pair):
    hf, ours, _ = hf_pair
    tokens = torch.randint(0, 211, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == (3, 40, 211)
    assert (got - expected).abs().max().item() < TOL


def test_cached_decoding_matches_hf_cached_decoding(hf_pair):
    hf, ours, _ = hf_pair
    tokens = torch.randint(0, 211, (2, 30), generator=torch.Generator().manual_seed(1))
    prompt = 7
    cache = ours.new_cache(2)
    with torch.no_grad():
        hf_out = hf(tokens[:, :prompt], use_cache=True)
        past = hf_out.past_key_values
        hf_rows, our_rows = [hf_out.logits], [ours(tokens[:, :prompt], cache)]
        for i in range(prompt, tokens.size(1)):
            out = hf(tokens[:, i : i + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            hf_rows.append(out.logits)
            our_rows.append(ours(tokens[:, i : i + 1], cache))
            assert cache.length == i + 1
    hf_logits, our_logits = torch.cat(hf_rows, 1), torch.cat(our_rows, 1)
    assert (hf_logits - our_logits).abs().max().item() < TOL
    # the cache holds exactly Hugging Face's keys and values, in the same [B, H, t, d_head] layout
    for layer in range(3):
        assert torch.allclose(cache.keys[layer], past.layers[layer].keys, atol=TOL)
        assert torch.allclose(cache.values[layer], past.layers[layer].values, atol=TOL)


def test_cached_decoding_equals_full_recompute(hf_pair):
    """The seed's claim: with K, V cached, computing only the newest row gives the same logits."""
    _, ours, _ = hf_pair
    tokens = torch.randint(0, 211, (1, 48), generator=torch.Generator().manual_seed(2))
    cache = ours.new_cache(1)
    with torch.no_grad():
        full = ours(tokens)
        rows = [ours(tokens[:, :1], cache)] + [ours(tokens[:, i : i + 1], cache) for i in range(1, 48)]
    stepped = torch.cat(rows, dim=1)
    assert stepped.shape == full.shape
    assert (stepped - full).abs().max().item() < 1e-5


def test_left_padded_batch_matches_hf_and_unpadded_runs(hf_pair):
    hf, ours, _ = hf_pair
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(0, 211, (12,), generator=g), torch.randint(0, 211, (5,), generator=g)
    pad = 0
    tokens = torch.stack([long, torch.cat([torch.full((7,), pad), short])])
    mask = torch.stack([torch.ones(12, dtype=torch.bool), torch.arange(12) >= 7])
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours_batch = ours(tokens, padding_mask=mask)
        hf_batch = hf(tokens, attention_mask=mask.long(), position_ids=positions).logits
        alone = ours(short[None])
    assert (ours_batch[mask] - hf_batch[mask]).abs().max().item() < TOL
    assert (ours_batch[1, 7:] - alone[0]).abs().max().item() < TOL
    assert torch.isfinite(ours_batch).all()


def test_padded_batch_decodes_with_cache_like_single_sequences(hf_pair):
    """Right padding: each row continues from its own last real token; pads stay masked."""
    _, ours, _ = hf_pair
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(1, 211, (9,), generator=g), torch.randint(1, 211, (4,), generator=g)
    tokens = torch.stack([a, torch.cat([b, torch.zeros(5, dtype=torch.long)])])
    mask = torch.stack([torch.ones(9, dtype=torch.bool), torch.arange(9) < 4])
    nxt = torch.randint(1, 211, (2, 3), generator=g)
    cache = ours.new_cache(2)
    with torch.no_grad():
        ours(tokens, cache, padding_mask=mask)
        steps = [ours(nxt[:, i : i + 1], cache) for i in range(3)]
        alone_a = ours(torch.cat([a, nxt[0]])[None])
        alone_b = ours(torch.cat([b, nxt[1]])[None])
    assert cache.length == 12
    assert cache.key_is_token.tolist()[1] == [True] * 4 + [False] * 5 + [True] * 3
    got = torch.cat(steps, dim=1)
    assert (got[0] - alone_a[0, -3:]).abs().max().item() < TOL
    assert (got[1] - alone_b[0, -3:]).abs().max().item() < TOL


def test_hugging_face_reads_what_we_save(tmp_path, hf_pair):
    from transformers import GPT2LMHeadModel

    from gpt_shape_tracer.model import save_hf_gpt2

    _, ours, _ = hf_pair
    save_hf_gpt2(ours, tmp_path)
    reread = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 211, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (reread(tokens).logits - ours(tokens)).abs().max().item() < TOL
