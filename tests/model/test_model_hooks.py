"""Every hook point exists, is documented, and has the documented shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import GPT, GPTConfig, HookPoint, additive_mask
from gpt_shape_tracer.model.gpt import (
    HOOKS,
    PathNote,
    TappedModule,
    act_name,
    dims_of,
    hooks_for,
    markdown_table,
    resolve,
    spec_for,
)

CONFIG = GPTConfig(vocab_size=97, n_ctx=32, d_model=48, n_layer=2, n_head=3)
# grouped-query Llama: 6 query heads share 2 key/value heads, head_dim ≠ d/H, a sliding window, untied W_U
LLAMA = GPTConfig.for_family("llama", vocab_size=97, n_ctx=32, d_model=48, n_layer=2, n_head=6, n_kv_head=2,
                             head_dim=10, d_mlp=40, sliding_window=4)
CONFIGS = {"gpt2": CONFIG, "llama-gqa": LLAMA}
PER_BLOCK = {"gpt2": 22, "llama-gqa": 25}  # Llama: + rot_q, rot_k, mlp.hook_pre_linear
OUTSIDE = {"gpt2": 4, "llama-gqa": 3}  # embed, (pos_embed), ln_final, logits


def capture_shapes(model, tokens, cache=None, padding_mask=None) -> dict[str, tuple]:
    shapes: dict[str, tuple] = {}
    handles = [
        module.register_forward_hook(lambda m, i, o, name=name: shapes.__setitem__(name, tuple(o.shape)))
        for name, module in model.named_modules()
        if isinstance(module, HookPoint)
    ]
    try:
        with torch.no_grad():
            model(tokens, cache, padding_mask=padding_mask)
    finally:
        for h in handles:
            h.remove()
    return shapes


def expected_shape(name: str, batch: int, new: int, keys: int, mask_batch: int, config: GPTConfig = CONFIG) -> tuple:
    spec = spec_for(name, config)
    assert spec is not None, f"{name} is not in the hook table"
    dims = dims_of(config, batch, new, keys)
    dims["B|1"] = mask_batch
    return tuple(resolve(s, dims) for s in spec.shape)


@pytest.mark.parametrize("which", CONFIGS)
def test_every_hook_point_is_in_the_table_and_every_row_exists(which):
    config = CONFIGS[which]
    model = GPT(config)
    names = {n for n, m in model.named_modules() if isinstance(m, HookPoint)}
    assert {n for n in names if spec_for(n, config) is None} == set()
    generic = {spec_for(n, config).name for n in names}
    assert generic == {s.name for s in hooks_for(config)}
    assert len(names) == OUTSIDE[which] + PER_BLOCK[which] * config.n_layer
    assert len(hooks_for(config)) == OUTSIDE[which] + PER_BLOCK[which]


def test_every_row_belongs_to_gpt2_or_llama_and_together_they_cover_the_table():
    rows = {(s.name, s.needs) for s in HOOKS}
    soft_capped = GPTConfig(family="hf", n_layer=1, d_model=64, n_head=4, attn_softcap=50.0)  # a Gemma 2, described
    latent = GPTConfig(family="hf", n_layer=1, d_model=64, n_head=4, head_dim=24, v_head_dim=8, kv_latent_dim=16,
                       rope_key_dim=8, attn_sinks=True)  # a DeepSeek-V3 with gpt-oss's sinks, described
    hybrid = GPTConfig(family="hf", n_layer=2, d_model=64, n_head=4, mixers=("Gated DeltaNet", ""),
                       state_layers=(0,))  # a Qwen3-Next, described
    indexed = GPTConfig(family="hf", n_layer=2, d_model=64, n_head=4, indexed_layers=(0, 1),
                        indexer_key_dim=16)  # a DeepSeek-V3.2, described
    covered = {(s.name, s.needs) for config in (*CONFIGS.values(), soft_capped, latent, hybrid, indexed)
               for s in HOOKS if s in _rows_of(config)}
    assert covered == rows
    # only the RoPE family has the rotated q/k and the linear half of SwiGLU; only GPT-2 the position table
    assert spec_for("blocks.0.attn.hook_rot_q", LLAMA) is not None and spec_for("blocks.0.attn.hook_rot_q") is None
    assert spec_for("hook_pos_embed", LLAMA) is None and spec_for("hook_pos_embed") is not None
    assert spec_for("blocks.1.mlp.hook_pre_linear", LLAMA).shape == ("B", "n", "d_ff")
    assert "x·W_gate" in spec_for("blocks.0.mlp.hook_pre", LLAMA).meaning
    assert "GELU" in spec_for("blocks.0.mlp.hook_pre").meaning


def _rows_of(config):
    from gpt_shape_tracer.model.gpt._hook_table import _has

    return [s for s in HOOKS if _has(s, config)]


def test_gpt2_rows_keep_their_names_and_grouped_rows_say_how_heads_are_shared():
    # GPT-2 (G = H) is written as before: [B, H, t, d_head], [B, n, 3d], [B, n, 4d], [B, n, d]
    assert spec_for("blocks.1.attn.hook_k_all").shape == ("B", "H", "t", "d_head")
    assert spec_for("blocks.1.attn.hook_qkv").shape == ("B", "n", "3d")
    assert spec_for("blocks.1.mlp.hook_pre").shape == ("B", "n", "4d")
    assert spec_for("blocks.1.attn.hook_merged").shape == ("B", "n", "d")
    k_all = spec_for("blocks.1.attn.hook_k_all", LLAMA)
    assert k_all.shape == ("B", "G", "t", "d_head") and "h // (H/G)" in k_all.note
    assert spec_for("blocks.1.attn.hook_qkv", LLAMA).shape == ("B", "n", "d_qkv")
    assert spec_for("blocks.1.attn.hook_merged", LLAMA).shape == ("B", "n", "H·d_head")  # 6·10 ≠ d = 48
    dims = dims_of(LLAMA, 2, 5, 9)
    assert (dims["G"], dims["d_qkv"], dims["H·d_head"], dims["d_ff"]) == (2, 100, 60, 40)


def test_act_name_knows_the_new_short_names():
    assert act_name("rot_q", 3) == "blocks.3.attn.hook_rot_q"
    assert act_name("rot_k", 0) == "blocks.0.attn.hook_rot_k"
    assert act_name("mlp_pre_linear", 1) == "blocks.1.mlp.hook_pre_linear"
    assert act_name("ln1", 2) == "blocks.2.ln1.hook_normalized" and act_name("ln_final") == "ln_final.hook_normalized"
    model = GPT(LLAMA)
    for kind in ("rot_q", "rot_k", "mlp_pre_linear", "k_all", "pattern"):
        assert isinstance(model.get_submodule(act_name(kind, 1)), HookPoint)


def test_readme_shows_the_table_from_the_code():
    readme = (Path(__file__).resolve().parents[2] / "model" / "README.md").read_text(encoding="utf-8")
    assert markdown_table() in readme
    assert "Llama-style (RoPE)" in markdown_table() and "GPT-2 (learned positions)" in markdown_table()


@pytest.mark.parametrize("which", CONFIGS)
@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_decode_shapes_match_the_table(batch, which):
    config = CONFIGS[which]
    model = GPT(config).eval()
    n0 = 5
    tokens = torch.randint(0, 97, (batch, n0 + 3))
    cache = model.new_cache(batch)
    shapes = capture_shapes(model, tokens[:, :n0], cache)
    assert len(shapes) == OUTSIDE[which] + PER_BLOCK[which] * config.n_layer
    for name, shape in shapes.items():
        assert shape == expected_shape(name, batch, n0, n0, 1, config), name
    for step in range(1, 4):  # decode: n = 1, t = n0 + step
        shapes = capture_shapes(model, tokens[:, n0 + step - 1 : n0 + step], cache)
        for name, shape in shapes.items():
            assert shape == expected_shape(name, batch, 1, n0 + step, 1, config), (step, name)
        assert shapes["blocks.1.attn.hook_pattern"] == (batch, config.n_head, 1, n0 + step)
        assert shapes["blocks.0.attn.hook_k_all"] == (batch, config.n_kv_heads, n0 + step, config.d_head)
        assert tuple(cache.keys[0].shape) == (batch, config.n_kv_heads, n0 + step, config.d_head)


def test_padding_makes_the_mask_per_row():
    model = GPT(CONFIG).eval()
    tokens = torch.randint(0, 97, (2, 6))
    mask = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    shapes = capture_shapes(model, tokens, padding_mask=mask)
    assert shapes["blocks.0.attn.hook_mask"] == (2, 1, 6, 6)
    assert shapes["blocks.0.attn.hook_pattern"] == (2, 3, 6, 6)


def test_the_mask_offsets_query_rows_by_the_cache_length():
    model = GPT(CONFIG).eval()
    masks = []
    h = model.blocks[0].attn.hook_mask.register_forward_hook(lambda m, i, o: masks.append(o.clone()))
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 4)), cache)
        model(torch.randint(0, 97, (1, 3)), cache)  # three new queries at positions 4, 5, 6
    h.remove()
    prefill, chunk = masks[0][0, 0], masks[1][0, 0]
    assert torch.equal(torch.isinf(prefill), torch.ones(4, 4).triu(1).bool())
    assert chunk.shape == (3, 7)
    for i in range(3):
        allowed = ~torch.isinf(chunk[i])
        assert allowed.tolist() == [j <= 4 + i for j in range(7)]


def test_exceeding_n_ctx_is_a_clear_value_error():
    model = GPT(CONFIG).eval()
    with pytest.raises(ValueError, match="n_ctx is 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = model.new_cache(1)
    model(torch.zeros(1, 32, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"32 cached \+ 1 new = 33"):
        model(torch.zeros(1, 1, dtype=torch.long), cache)
    assert cache.length == 32  # the refused step changed nothing


def test_a_failing_forward_leaves_the_cache_unchanged():
    model = GPT(CONFIG).eval()
    cache = model.new_cache(1)
    model(torch.randint(0, 97, (1, 4)), cache)
    before = [k.clone() for k in cache.keys]

    def explode(module, args, output):
        raise RuntimeError("boom")

    h = model.blocks[1].mlp.register_forward_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randint(0, 97, (1, 1)), cache)
    h.remove()
    assert cache.length == 4
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys))
    model(torch.randint(0, 97, (1, 1)), cache)
    assert cache.length == 5 and cache.keys[1].shape[2] == 5


def test_a_cache_copy_replays_a_step_from_an_earlier_point_without_touching_the_original():
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    tokens = torch.randint(0, 97, (2, 7))
    padding = torch.tensor([[False, False, True, True, True, True, True], [True] * 7])
    cache = model.new_cache(2)
    with torch.no_grad():
        model(tokens[:, :6], cache, padding_mask=padding[:, :6])
        last = model(tokens[:, 6:], cache)[:, -1]
        keys = [k.clone() for k in cache.keys]
        replay = cache.copy(6)
        assert replay.length == 6 and torch.equal(replay.key_is_token, padding[:, :6])
        again = model(tokens[:, 6:], replay)[:, -1]
    assert torch.allclose(again, last, atol=1e-6)
    assert replay.length == 7 and cache.length == 7
    assert all(torch.equal(a, b) for a, b in zip(keys, cache.keys))  # the original's rows are untouched
    replay.keys[0].data.zero_()
    assert torch.equal(cache.keys[0], keys[0])  # separate storage
    assert cache.copy(0).length == 0 and cache.copy().length == 7
    with pytest.raises(ValueError, match="0 … 7 positions"):
        cache.copy(8)


@pytest.mark.parametrize(
    "tokens, message",
    [
        (torch.zeros(4, dtype=torch.long), r"\[B, n\]"),
        (torch.zeros(1, 3), "integer"),
        (torch.full((1, 3), 97), r"\[0, 97\)"),
        (torch.zeros(1, 0, dtype=torch.long), "n = 0"),
    ],
)
def test_bad_token_tensors_are_refused_clearly(tokens, message):
    with pytest.raises(ValueError, match=message):
        GPT(CONFIG)(tokens)


def test_config_is_validated():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=50, n_head=3)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)
    assert GPTConfig().d_head == 64 and GPTConfig().d_ff == 3072


@pytest.mark.parametrize("fields, message", [
    ({"n_head": 6, "n_kv_head": 4}, "head counts that do not divide"),
    ({"layer_norm_eps": float("nan")}, "layer_norm_eps must be a finite number > 0"),
    ({"layer_norm_eps": -1e-5}, "layer_norm_eps must be a finite number > 0"),
    ({"layer_norm_eps": 0.0}, "layer_norm_eps must be a finite number > 0"),
    ({"vocab_size": 2**64}, "vocab_size = 18446744073709551616 is absurdly large"),
    ({"vocab_size": "1024"}, "vocab_size must be a positive integer"),
    ({"n_kv_head": 0}, "n_kv_head must be a positive integer"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number"),
    ({"norm": "batchnorm"}, "norm must be one of layernorm, rmsnorm"),
    ({"family": "bert"}, "family must be one of"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"head_dim": 7, "positions": "rope"}, "d_head = 7 must be even"),
    ({"qkv_bias": 1}, "qkv_bias must be True or False"),
])
def test_bad_configs_name_the_problem(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{"d_model": 48, "n_head": 6, **fields})


def test_config_properties_and_round_trip():
    c = GPTConfig.for_family("qwen2", d_model=64, n_head=8, n_kv_head=2, head_dim=16, d_mlp=96,
                             rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert (c.n_kv_heads, c.d_head, c.d_ff, c.d_qkv) == (2, 16, 96, (8 + 4) * 16)
    assert c.qkv_bias and not c.attn_out_bias and not c.mlp_bias and not c.tie_embeddings
    assert GPTConfig(**c.to_dict()) == c
    assert GPTConfig().n_kv_heads == 12


def test_a_global_module_hook_sees_every_hook_point():
    """Hook points and our other modules skip nn.Module.__call__ when nothing hooks them, reading torch's private
    record of global hooks; a hook registered through the public API must still see every one of them (every
    module but the ModuleList, which is never called)."""
    model = GPT(CONFIG).eval()
    seen: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(names.get(id(m), "?")))
    try:
        with torch.no_grad():
            model(torch.randint(0, 97, (1, 4)))
    finally:
        handle.remove()
    every = {n for n, m in model.named_modules() if not isinstance(m, torch.nn.ModuleList)}
    assert set(seen) == every
    assert any(isinstance(m, TappedModule) for m in model.modules())


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the root's input, token ids, needs no grad
@pytest.mark.parametrize("name", ["blocks.0.hook_resid_mid", "blocks.0.mlp", "blocks.1.attn.c_proj"])
def test_a_backward_hook_on_a_hook_point_or_a_module_fires(name):
    """The straight path past nn.Module.__call__ is taken only when torch would run nothing else: a full backward
    hook (or a global one) takes the full path, so it fires, with the gradient autograd computes."""
    model = GPT(CONFIG)
    grads: list[torch.Tensor] = []
    handle = model.get_submodule(name).register_full_backward_hook(lambda m, gin, gout: grads.append(gout[0]))
    model(torch.randint(0, 97, (1, 4))).sum().backward()
    handle.remove()
    assert len(grads) == 1 and grads[0] is not None and grads[0].abs().sum() > 0
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda m, gin, gout: seen.append("x"))
    try:
        model(torch.randint(0, 97, (1, 4))).sum().backward()
    finally:
        handle.remove()
    assert len(seen) > len(list(model.modules())) // 2


def test_a_module_tap_sees_its_arguments_and_the_output_after_forward_hooks():
    """A tracer reads our modules through taps: ``enter`` with the arguments the module was called with,
    ``leave`` with the output the model goes on to use (after a forward hook replaced it); removed, it sees nothing."""
    model = GPT(CONFIG).eval()
    mlp = model.get_submodule("blocks.0.mlp")
    calls: list[tuple] = []

    class Tap:
        def enter(self, module, args, kwargs):
            calls.append(("enter", module, args[0].clone()))

        def leave(self, module, output):
            calls.append(("leave", module, output.clone()))

    hook = mlp.register_forward_hook(lambda m, i, o: o * 0 + 7)
    handle = mlp.add_tap(Tap())
    after: list[torch.Tensor] = []
    model.blocks[0].hook_mlp_out.add_tap(after.append)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 4)))
    assert [c[0] for c in calls] == ["enter", "leave"] and calls[0][1] is mlp
    assert calls[0][2].shape == (1, 4, CONFIG.d_model)
    assert torch.equal(calls[1][2], torch.full((1, 4, CONFIG.d_model), 7.0)) and torch.equal(after[0], calls[1][2])
    handle.remove()
    handle.remove()
    hook.remove()
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 4)))
    assert len(calls) == 2


def test_taps_see_the_value_after_forward_hooks_and_can_be_removed():
    model = GPT(CONFIG).eval()
    point = model.get_submodule("blocks.0.attn.hook_pattern")
    seen: list[torch.Tensor] = []
    hook = point.register_forward_hook(lambda m, i, o: torch.zeros_like(o))  # an ablation
    tap = point.add_tap(seen.append)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 4)))
    # the tap saw what the model went on to use; then the note that this layer ran eager (the forward hook may write
    # the pattern: the settings would have run it fused)
    assert len(seen) == 2 and isinstance(seen[0], torch.Tensor) and not seen[0].any()
    assert isinstance(seen[1], PathNote) and "ran eager, not fused" in seen[1].text
    tap.remove()
    tap.remove()  # removing twice is harmless
    hook.remove()
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 4)))
    assert len(seen) == 2  # the removed tap saw nothing more


def test_a_padding_query_row_sees_only_itself_and_real_queries_never_see_padding():
    """Left padding of two: keys 0 and 1 are padding. Written out by hand, which keys each query may see
    (0 where it may, −∞ where it may not), at the prefill and at a decode step over a cache."""
    key_is_token = torch.tensor([[False, False, True, True, True]])
    allowed = additive_mask(5, 0, key_is_token, torch.device("cpu"), torch.float32)[0, 0] == 0
    expected = torch.tensor([[1, 0, 0, 0, 0],   # padding query 0: itself only (its output is never used)
                             [0, 1, 0, 0, 0],   # padding query 1: itself only
                             [0, 0, 1, 0, 0],   # the first real token: itself
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    decode = additive_mask(1, 5, torch.cat([key_is_token, torch.tensor([[True]])], 1), torch.device("cpu"),
                           torch.float32)[0, 0, 0] == 0
    assert decode.tolist() == [False, False, True, True, True, True]


def test_a_cache_commit_with_a_layer_not_written_is_refused_and_changes_nothing():
    """A forward that wrote keys for some layers only (a bug in a custom block) must not grow the cache."""
    model = GPT(CONFIG).eval()
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 4)), cache)
    k = torch.zeros(1, CONFIG.n_head, 1, CONFIG.d_model // CONFIG.n_head)
    cache.append(0, k, k)  # layer 0 only
    with pytest.raises(RuntimeError, match=r"layers \[1\] not updated"):
        cache.commit(1, None)
    assert cache.length == 4


def test_grouped_attention_without_a_batch_axis_and_in_bf16():
    """``attention`` takes ``[..., H, n, d_k]``: a 3-D grouped call (no batch axis) reads key/value head
    h // (H/G) for query head h, as Hugging Face's repeat_kv does; in bf16 the softmax runs in float32 and is
    cast back (the weights are exactly softmax(float32 scores) rounded once)."""
    from gpt_shape_tracer.model import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, 8, generator=g) for s in ((4, 3), (2, 5), (2, 5)))  # H = 4, G = 2, n = 3, t = 5
    out, weights = attention(q, k, v)
    kk, vv = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)  # [H, t, d]
    expected = torch.softmax(q @ kk.transpose(-2, -1) / 8 ** 0.5, dim=-1)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(out, expected @ vv)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    _, wb = attention(qb, kb, vb)
    scores = (qb @ kb.repeat_interleave(2, dim=0).transpose(-2, -1)) / 8 ** 0.5
    assert wb.dtype == torch.bfloat16
    assert torch.equal(wb, torch.softmax(scores.float(), dim=-1).to(torch.bfloat16))


def test_a_fused_attention_tells_each_stage_to_plain_taps_and_to_a_group_at_once_in_order():
    """A fused layer's n × t hook points are asked whether they are listened and told their derived stages
    together: a tap of a group (a tracer's) is answered and told through its group — one question and one call
    per layer — while a plain tap still hears each stage at its own point, after whatever was told before it."""
    from gpt_shape_tracer.model.gpt import DerivedAttention
    from gpt_shape_tracer.model.gpt._gpt import attention_points

    model = GPT(CONFIG).eval()
    events: list[tuple] = []

    class Group:
        def listening(self) -> bool:
            events.append(("asked",))
            return True

        def hear(self, told) -> None:
            events.append(("heard", [(tap.name, what.stage) for tap, what in told]))

    class GroupTap:
        def __init__(self, group: Group, name: str) -> None:
            self.group, self.name = group, name

        def __call__(self, value) -> None:  # what a tap without the group's help would hear
            events.append(("alone", self.name))

    group = Group()
    attn = model.blocks[0].attn
    points = attention_points(attn)
    for stage, point in points:
        point.add_tap(GroupTap(group, stage))
    pattern = attn.hook_pattern
    pattern.add_tap(lambda value: events.append(("plain", type(value) is DerivedAttention and value.stage)))
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 5)))
    layer = [e for e in events if e != ("asked",)]
    stages = [stage for stage, _ in points]
    assert len(stages) == 5 and events.count(("asked",)) == 1  # once for the layer's five points
    # the group hears every stage (its taps never one by one) before the plain tap on the pattern hears its own
    assert layer == [("heard", [(s, s) for s in stages]), ("plain", "pattern")]  # the other blocks have no taps


def test_listened_each_asks_each_group_once_and_each_plain_tap_itself():
    from gpt_shape_tracer.model.gpt._hook_point import listened_each

    asked: list[str] = []

    class Group:
        def __init__(self, answer: bool) -> None:
            self.answer = answer

        def listening(self) -> bool:
            asked.append("group")
            return self.answer

    class Tap:
        def __init__(self, group=None, answer=None) -> None:
            self.group = group
            if answer is not None:
                self.listening = lambda: asked.append("tap") or answer

        def __call__(self, value) -> None: ...

    quiet, loud = Group(False), Group(True)
    a, b, c, d = HookPoint(), HookPoint(), HookPoint(), HookPoint()
    a.add_tap(Tap(quiet))
    b.add_tap(Tap(quiet))
    b.add_tap(Tap(answer=True))  # a tap with its own listening(): listened
    c.add_tap(Tap(quiet))
    c.add_tap(Tap(loud))
    d.add_tap(lambda value: None)  # a plain function: always listening
    assert listened_each([a, b, c, d, HookPoint()]) == [False, True, True, True, False]
    assert asked == ["group", "tap", "group"]  # quiet asked once for three points, loud once
    assert [p.listened for p in (a, b, c, d)] == [False, True, True, True]
