"""Module-level and op-level capture on our GPT and on models we did not write."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from gpt_shape_tracer.model import GPT, GPTConfig, HookPoint
from gpt_shape_tracer.model.gpt import attention_path, dims_of, resolve, spec_for
from gpt_shape_tracer.tracer import Tracer, hooks_installed, tensor_stats

CONFIG = GPTConfig(vocab_size=64, n_ctx=24, d_model=32, n_layer=2, n_head=4)


@pytest.fixture()
def gpt():
    torch.manual_seed(0)
    return GPT(CONFIG).eval()


def no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks and not getattr(m, "taps", ())
               for m in model.modules())


def test_every_hook_point_is_a_record_with_its_documented_name_and_shape(gpt):
    tokens = torch.randint(0, 64, (2, 7))
    with torch.no_grad(), Tracer(gpt, capture="shapes") as tr:
        gpt(tokens)
    frame = tr.trace.to_frame()
    hooks = frame[frame.kind == "hook"]
    names = {n for n, m in gpt.named_modules() if isinstance(m, HookPoint)}
    assert set(hooks.name) == names
    dims = dims_of(CONFIG, 2, 7, 7)
    dims["B|1"] = 1
    for row in hooks.itertuples():
        assert row.shape == tuple(resolve(s, dims) for s in spec_for(row.name).shape), row.name
    assert (frame.step == 0).all()
    assert no_hooks_left(gpt) and hooks_installed(gpt) == 0


def test_records_carry_module_type_params_dtype_and_bytes(gpt):
    with torch.no_grad(), Tracer(gpt, capture="shapes") as tr:
        gpt(torch.randint(0, 64, (1, 5)))
    rec = tr.trace.record("blocks.0.attn.c_attn:out")
    assert rec.module_type == "Projection"
    assert rec.module_params == 32 * 96 + 96
    assert rec.shape == (1, 5, 96) and rec.dtype == "float32" and rec.device == "cpu"
    assert rec.numel == 480 and rec.nbytes == 480 * 4
    assert rec.layer == 0 and rec.kind == "output"
    tokens_in = tr.trace.record("model:in[0]")
    assert tokens_in.shape == (1, 5) and tokens_in.dtype == "int64" and tokens_in.kind == "input"
    assert tr.trace.record("model:out").module_params == gpt.num_parameters


def test_values_equal_what_a_plain_forward_hook_sees(gpt):
    seen = {}
    h = gpt.blocks[1].attn.hook_pattern.register_forward_hook(lambda m, i, o: seen.setdefault("p", o.clone()))
    tokens = torch.randint(0, 64, (1, 6))
    with torch.no_grad(), Tracer(gpt, capture="values") as tr:
        logits = gpt(tokens)
    h.remove()
    assert torch.equal(tr.trace.get("blocks.1.attn.hook_pattern"), seen["p"])
    assert torch.equal(tr.trace.get("hook_logits", step=0), logits)
    assert tr.trace.get("model:in[0]").tolist() == tokens.tolist()


def test_a_user_hook_that_patches_a_hook_point_is_traced_as_patched(gpt):
    # an ablation made by a forward hook is what the model uses downstream, so it is what the trace shows
    def zero_head_2(module, args, z):
        z = z.clone()
        z[:, 2] = 0.0
        return z

    h = gpt.blocks[0].attn.hook_z.register_forward_hook(zero_head_2)
    try:
        with torch.no_grad(), Tracer(gpt, capture="values") as tr:
            gpt(torch.randint(0, 64, (1, 6)))
    finally:
        h.remove()
    z = tr.trace.get("blocks.0.attn.hook_z")
    assert torch.count_nonzero(z[:, 2]) == 0 and torch.count_nonzero(z[:, 1]) > 0
    merged = tr.trace.get("blocks.0.attn.hook_merged")  # [B,n,d]: head 2 owns columns 16..23
    assert torch.equal(merged[..., 16:24], torch.zeros_like(merged[..., 16:24]))


def test_user_hooks_on_modules_still_run_in_their_order_and_the_trace_shows_what_they_made(gpt):
    """Tracing a model that carries a user's hooks: their pre-hooks and forward hooks still run, in the order
    they were registered; the trace's input of a module is what it was called with and its output what its
    caller got back (a hook's replacement included); the logits are those of the same hooked model untraced;
    and nothing is left on the modules afterwards but the user's own hooks."""
    order: list[str] = []
    block, proj = gpt.blocks[0], gpt.blocks[1].mlp.c_fc
    handles = [
        block.register_forward_pre_hook(lambda m, args: order.append("pre a")),
        block.register_forward_hook(lambda m, args, out: (order.append("post a"), out * 2)[1]),
        block.register_forward_pre_hook(lambda m, args: order.append("pre b")),
        block.register_forward_hook(lambda m, args, out: (order.append("post b"), out + 1)[1]),
        proj.register_forward_hook(lambda m, args, out: (order.append("proj"), out.neg())[1]),
    ]
    tokens = torch.randint(0, 64, (1, 6))
    try:
        # one attention path both ways (under "auto" an untraced forward runs the fused kernel, a traced one this
        # short the eager stages: the same logits to rounding, not bit for bit), so the hooks' work is compared
        with torch.no_grad(), attention_path("eager"):
            untraced = gpt(tokens)
        assert order == ["pre a", "pre b", "post a", "post b", "proj"]
        order.clear()
        with torch.no_grad(), attention_path("eager"), Tracer(gpt, capture="values") as tr:
            logits = gpt(tokens)
        assert order == ["pre a", "pre b", "post a", "post b", "proj"]
        assert torch.equal(logits, untraced)
        trace = tr.trace
        embedded = trace.get("blocks.0.hook_resid_pre")
        assert torch.equal(trace.get("blocks.0:in[0]"), embedded)  # what the block was called with
        out0 = trace.get("blocks.0:out")  # (block(x) * 2) + 1: what the next block received
        assert torch.equal(out0, trace.get("blocks.1:in[0]"))
        assert torch.equal(out0, (trace.get("blocks.0.hook_resid_post") * 2) + 1)
        fc_out = trace.get("blocks.1.mlp.c_fc:out")  # negated by the user's hook: what the MLP went on with
        assert torch.equal(fc_out, trace.get("blocks.1.mlp.hook_pre"))
        assert torch.allclose(fc_out, -(trace.get("blocks.1.mlp.c_fc:in[0]") @ proj.weight + proj.bias))
        assert len(block._forward_hooks) == 2 and len(proj._forward_hooks) == 1  # the user's, and no more
    finally:
        for h in handles:
            h.remove()
    assert no_hooks_left(gpt)


def test_nested_inputs_and_outputs_get_readable_slots():
    class Fancy(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 2)

        def forward(self, pair, extra=None):
            a, b = pair
            return {"sum": self.inner(a + b), "parts": (a, [b * 2])}

    model = Fancy()
    with torch.no_grad(), Tracer(model, capture="values") as tr:
        model((torch.ones(4, 3), torch.zeros(4, 3)), extra=torch.arange(5))
    names = tr.trace.names()
    for expected in ("model:in[0][0]", "model:in[0][1]", "model:in.extra", "model:out.sum",
                     "model:out.parts[0]", "model:out.parts[1][0]", "inner:in[0]", "inner:out"):
        assert expected in names
    assert tr.trace.get("model:out.parts[1][0]").shape == (4, 3)
    assert tr.trace.record("model:in.extra").dtype == "int64"


def test_a_plain_conv_model_with_in_place_relu_keeps_the_pre_relu_values():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)
    ).eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        expected_conv = model[0](x)
        with Tracer(model, capture="values") as tr:
            out = model(x)
    t = tr.trace
    conv_out = t.get("0:out")
    assert conv_out.shape == (2, 4, 8, 8)
    assert (conv_out < 0).any(), "the conv output must not have been overwritten by the in-place ReLU"
    assert torch.equal(conv_out, expected_conv)
    assert torch.equal(t.get("1:out"), expected_conv.clamp(min=0))
    assert t.record("4:out").shape == (2, 3) and torch.equal(t.get("model:out"), out)
    assert t.record("2:out").shape == (2, 4, 4, 4)
    assert [r.module_type for r in t.filter(kind="output")] == [
        "Conv2d", "ReLU", "MaxPool2d", "Flatten", "Linear", "Sequential"
    ]


def test_mutation_outside_known_in_place_modules_is_detected_not_shown_wrong():
    class SneakyAdd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            y = self.lin(x)
            y += 100  # functional in-place: changes the tensor the Linear's output record points at
            return y

    model = SneakyAdd()
    with torch.no_grad(), Tracer(model, capture="values") as tr:
        model(torch.ones(1, 2))
    rec = tr.trace.record("lin:out")
    assert tr.trace.get("lin:out") is None and "changed in place" in tr.trace.value_note(rec)
    with torch.no_grad(), Tracer(model, capture="values", copy="all") as tr2:
        y = model(torch.ones(1, 2))
    assert torch.allclose(tr2.trace.get("lin:out") + 100, y)
    with torch.no_grad(), Tracer(model, capture="ops") as tr3:  # op level sees `+=` coming and copies first
        y = model(torch.ones(1, 2))
    assert torch.allclose(tr3.trace.get("lin:out") + 100, y)


def test_hugging_face_gpt2_is_traced_like_any_module(hf_pair):
    hf, ours, _ = hf_pair
    tokens = torch.randint(0, 211, (1, 9))
    with torch.no_grad(), Tracer(hf, capture="values") as tr:
        out = hf(tokens)
    t = tr.trace
    assert torch.equal(t.get("model:out.logits"), out.logits)
    assert t.record("transformer.h.0.attn.c_attn:out").shape == (1, 9, 192)
    assert t.record("transformer.h.2.mlp.c_fc:out").shape == (1, 9, 256)
    assert t.record("lm_head:out").shape == (1, 9, 211)
    assert {r.layer for r in t.filter(module="transformer.h")} == {0, 1, 2}
    assert no_hooks_left(hf)


def test_op_level_shows_view_transpose_matmul_in_the_attention(gpt):
    tokens = torch.randint(0, 64, (1, 5))
    with torch.no_grad(), Tracer(gpt, capture="ops") as fused:  # the defaults: the model's own fused kernel
        gpt(tokens)
    assert any("scaled_dot_product_attention" in op for op in fused.trace.ops_frame(module="blocks.0.attn").op)
    assert "torch.softmax" not in set(fused.trace.ops_frame(module="blocks.0.attn").op)
    with torch.no_grad(), attention_path("eager"), Tracer(gpt, capture="ops") as tr:  # every stage an op
        gpt(tokens)
    ops = tr.trace.ops_frame(module="blocks.0.attn")
    sequence = list(ops.op)
    i_split = sequence.index("Tensor.split")
    assert sequence[i_split + 1 : i_split + 3] == ["Tensor.view", "Tensor.transpose"]
    qk = ops[(ops.op == "Tensor.matmul")].iloc[0]
    assert qk.input_shapes == ((1, 4, 5, 8), (1, 4, 8, 5)) and qk.output_shapes == ((1, 4, 5, 5),)
    assert qk.module == "blocks.0.attn"
    softmax = ops[ops.op == "torch.softmax"].iloc[0]
    assert softmax.output_shapes == ((1, 4, 5, 5),)
    assert "torch.addmm" in set(tr.trace.ops_frame(module="blocks.0.attn.c_attn").op)
    assert "F.layer_norm" in set(tr.trace.ops_frame(module="blocks.0.ln1").op)
    assert "F.gelu" in set(tr.trace.ops_frame(module="blocks.0.mlp").op)
    # call order: inside the attention QKᵀ comes after the split and before the softmax, then A·V; and every
    # op of block 0 comes before every op of block 1
    assert i_split < sequence.index("Tensor.matmul") < sequence.index("torch.softmax") < \
        len(sequence) - 1 - sequence[::-1].index("Tensor.matmul")
    modules = list(tr.trace.ops_frame().module.fillna(""))
    last_0 = max(i for i, m in enumerate(modules) if m.startswith("blocks.0."))
    first_1 = min(i for i, m in enumerate(modules) if m.startswith("blocks.1."))
    assert last_0 < first_1


class MissingTranspose(nn.Module):
    """A user's edit of our attention that forgot to transpose K."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x, mask, *rest, **more):  # whatever else the block passes (cache, positions)
        B, n, d = x.shape
        a = self.attn
        q, k, v = a.c_attn(x).split(d, dim=2)
        q = q.view(B, n, a.n_head, a.d_head).transpose(1, 2)
        k = k.view(B, n, a.n_head, a.d_head).transpose(1, 2)
        scores = q @ k  # should be q @ k.transpose(-2, -1)
        return scores


@pytest.mark.parametrize("capture", ["shapes", "values", "ops"])
def test_a_broken_model_keeps_its_trace_and_names_the_failure(gpt, capture):
    gpt.blocks[1].attn = MissingTranspose(gpt.blocks[1].attn)
    tokens = torch.randint(0, 64, (1, 5))
    with pytest.raises(RuntimeError) as info, torch.no_grad(), Tracer(gpt, capture=capture) as tr:
        gpt(tokens)
    t = tr.trace
    err = t.error
    assert err is not None and t.exception is info.value
    assert err.module == "blocks.1.attn" and err.module_type == "MissingTranspose"
    assert ("[0]", (1, 5, 32)) in err.input_shapes
    assert "scores = q @ k" in err.source
    assert err.module_stack == ("model", "blocks.1", "blocks.1.attn")
    assert any("[tracer]" in note and "blocks.1.attn" in note for note in info.value.__notes__)
    # everything up to the failure is still there
    assert t.record("blocks.0.hook_resid_post").shape == (1, 5, 32)
    assert t.record("blocks.1.ln1.hook_normalized").shape == (1, 5, 32)
    if capture == "ops":
        assert err.op == "Tensor.matmul" and err.op_input_shapes == ((1, 4, 5, 8), (1, 4, 5, 8))
        failed = t.ops_frame()
        assert failed.iloc[-1].error.startswith("RuntimeError")
    if capture != "shapes":
        assert t.get("blocks.0.hook_resid_post") is not None
    assert no_hooks_left(gpt) and hooks_installed(gpt) == 0


def test_tracer_removes_its_hooks_when_the_forward_raises(gpt):
    with pytest.raises(ValueError), Tracer(gpt):
        gpt(torch.zeros(1, 99, dtype=torch.long))  # longer than n_ctx
    assert no_hooks_left(gpt)


def test_each_top_level_call_is_a_step(gpt):
    with torch.no_grad(), Tracer(gpt, capture="shapes") as tr:
        gpt(torch.randint(0, 64, (1, 3)))
        gpt(torch.randint(0, 64, (1, 4)))
    t = tr.trace
    assert t.n_steps == 2
    assert t.record("hook_embed", step=0).shape == (1, 3, 32)
    assert t.record("hook_embed", step=1).shape == (1, 4, 32)
    assert set(t.to_frame().step) == {0, 1}


def test_filters_by_layer_module_kind_and_name(gpt):
    with torch.no_grad(), Tracer(gpt, capture="shapes") as tr:
        gpt(torch.randint(0, 64, (1, 4)))
    t = tr.trace
    layer1 = t.to_frame(layer=1)
    assert set(layer1.layer) == {1} and len(layer1) > 20
    attn = t.to_frame(module="blocks.0.attn", kind="hook")
    assert all(n.startswith("blocks.0.attn.hook_") for n in attn.name) and len(attn) == 13
    assert list(t.to_frame(name="*hook_pattern").name) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    with pytest.raises(KeyError, match="did you mean"):
        t.get("blocks.0.attn.hook_patern")


def test_unknown_capture_level_is_refused(gpt):
    with pytest.raises(ValueError, match="capture must be one of"):
        Tracer(gpt, capture="everything")


def test_a_value_changed_in_place_by_a_later_step_is_not_shown_wrong():
    class StaticCacheLike(nn.Module):
        """Writes each call's input into a preallocated buffer in place, like a static KV cache."""

        def __init__(self):
            super().__init__()
            self.buffer = torch.zeros(4, 2)
            self.slot = 0

        def forward(self, x):
            self.buffer[self.slot] = x  # in place, into the tensor an earlier step returned
            self.slot += 1
            return self.buffer

    model = StaticCacheLike()
    with torch.no_grad(), Tracer(model, capture="values") as tr:
        model(torch.ones(2))
        model(torch.full((2,), 2.0))
    t = tr.trace
    assert t.get("model:out", step=1) is not None and t.get("model:out", step=1)[1].tolist() == [2.0, 2.0]
    assert t.get("model:out", step=0) is None  # step 0's buffer now holds step 1's row too
    assert "changed in place" in t.value_note(t.record("model:out", step=0))
    with torch.no_grad(), Tracer(StaticCacheLike(), capture="values", copy="all") as tr2:
        tr2.model(torch.ones(2))
        tr2.model(torch.full((2,), 2.0))
    assert tr2.trace.get("model:out", step=0)[1].tolist() == [0.0, 0.0]


def test_a_tracer_collected_while_another_installs_does_not_deadlock(gpt):
    """Garbage collection can run a dropped tracer's finalizer in the middle of installing hooks."""
    import gc

    from gpt_shape_tracer.tracer.capture import _hooks as hooks

    other = GPT(CONFIG).eval()
    first, second = Tracer(other).install(), Tracer(other).install()
    assert hooks_installed(other) == 2
    gc.disable()
    try:
        with hooks._installed_lock:  # a finalizer running while this thread holds the lock
            hooks.release(id(other))  # must not wait for the lock (that was a deadlock)
        assert hooks_installed(other) == 1  # the deferred release was applied by the next lock holder
        first._finalizer.detach()  # its claim was just released above
        second.close()
        assert hooks_installed(other) == 0 and no_hooks_left(other)
    finally:
        gc.enable()
    with Tracer(gpt, capture="shapes") as tr:
        gpt(torch.randint(0, 64, (1, 3)))
    assert tr.trace.n_steps == 1 and no_hooks_left(gpt)


def test_the_in_place_guard_knows_which_writes_touch_a_kept_view():
    from gpt_shape_tracer.tracer.storage._store import overlaps

    buf = torch.zeros(2, 4, 16, 8)  # a KV-cache-like buffer: rows appended along dim 2
    kept = buf[:, :, :10]
    assert not overlaps(buf[:, :, 10:11], kept)  # the next row: the kept view is untouched
    assert overlaps(buf[:, :, 9:11], kept) and overlaps(buf, kept)
    assert overlaps(buf[1], kept) and not overlaps(buf[:, :, 12:], kept)
    flat = torch.zeros(10)
    assert not overlaps(flat[2:4], flat[4:6]) and overlaps(flat[2:5], flat[4:6])


def test_op_level_capture_does_not_copy_the_cache_on_every_append(gpt):
    cache = gpt.new_cache(1)
    tokens = torch.randint(0, 64, (1, 12))
    tr = Tracer(gpt, capture="ops").install()
    with torch.no_grad():
        with tr.active():
            gpt(tokens[:, :4], cache)
        kept_after_prefill = tr.trace.bytes_kept
        for i in range(4, 12):
            with tr.active():
                gpt(tokens[:, i : i + 1], cache)
    k_views = [tr.trace.get("blocks.0.attn.hook_k_all", s) for s in range(9)]
    tr.close()
    assert all(v is not None for v in k_views)  # earlier views of the cache stay valid…
    assert torch.equal(k_views[3], k_views[8][:, :, :7])
    storages = {v.untyped_storage().data_ptr() for v in k_views}
    assert len(storages) == 1  # …and all still view the cache's one buffer: nothing was copied
    assert tr.trace.bytes_kept > kept_after_prefill


def test_a_step_retried_after_a_failure_shows_the_statistics_of_the_retry(gpt):
    """The failed attempt's records are discarded and their indices reused by the retry: the statistics
    (and the flags) shown for the retry must be the retry's own, not the failed attempt's."""
    tokens = torch.randint(0, 64, (1, 5))
    attempts = []

    def shift_then_fail(module, args, out):
        if not attempts:
            attempts.append("failed")
            return out + 100.0  # the failed attempt's block-0 output is far off …
        return out

    def fail_once(module, args, out):
        if len(attempts) == 1:
            attempts.append("raised")
            raise RuntimeError("boom")  # … and it never finishes
        return out

    h1 = gpt.blocks[0].hook_resid_post.register_forward_hook(shift_then_fail)
    h2 = gpt.blocks[1].hook_resid_post.register_forward_hook(fail_once)
    try:
        with torch.no_grad(), Tracer(gpt, capture="values") as tr:
            trace = tr.trace
            with pytest.raises(RuntimeError, match="boom"):
                gpt(tokens)
            trace.stats("blocks.0.hook_resid_post", 0)  # looked at while the failure is on screen
            gpt(tokens)
    finally:
        h1.remove()
        h2.remove()
    clean = gpt.blocks[0].hook_resid_post  # the retry's real value, recomputed without hooks
    with torch.no_grad():  # the path the traced forward took: fused, as untraced
        expected = []
        h = clean.register_forward_hook(lambda m, a, o: expected.append(o.clone()))
        gpt(tokens)
        h.remove()
    shown, truth = trace.stats("blocks.0.hook_resid_post", 0), tensor_stats(expected[0])
    assert shown.max < 50  # not the failed attempt's +100
    # the same numbers (a sum's last bit may depend on how many threads reduced it)
    assert dataclasses.astuple(shown) == pytest.approx(dataclasses.astuple(truth), rel=1e-6, abs=1e-9)
    assert torch.equal(trace.get("blocks.0.hook_resid_post", 0), expected[0])


def test_a_failed_step_whose_values_were_not_kept_is_discarded_and_retried(gpt):
    """Discarding a failed attempt forgets every one of its records, kept values or not (shapes capture
    keeps none; a budget of 0 keeps none either): the retry must run, and record what a clean step does."""
    tokens = torch.randint(0, 64, (1, 5))
    failed = []

    def fail_once(module, args, out):
        if not failed:
            failed.append(True)
            raise RuntimeError("boom")
        return out

    for capture, budget in (("shapes", None), ("values", 0)):
        failed.clear()
        handle = gpt.blocks[1].hook_resid_post.register_forward_hook(fail_once)
        options = {} if budget is None else {"budget_bytes": budget}
        try:
            with torch.no_grad(), Tracer(gpt, capture=capture, **options) as tr:
                with pytest.raises(RuntimeError, match="boom"):
                    gpt(tokens)
                gpt(tokens)
        finally:
            handle.remove()
        with torch.no_grad(), Tracer(gpt, capture=capture, **options) as clean:
            gpt(tokens)
        assert [r.name for r in tr.trace.records] == [r.name for r in clean.trace.records], capture
        assert tr.trace.n_steps == 1 and tr.trace.bytes_kept == 0


@pytest.mark.parametrize("capture", ["shapes", "values", "ops"])
def test_a_failure_caught_inside_the_traced_block_leaves_the_next_block_free_to_trace(gpt, capture):
    """A notebook cell catches a forward's error inside ``tr.active()`` and the next cell traces again: the
    failed step is closed when its block ends (its records kept, as a failure's are, until the next step), not
    left open for the next block's first forward to trip over ("step 0 is still in progress")."""
    tokens = torch.randint(0, gpt.config.vocab_size, (1, 5))
    tr = Tracer(gpt, capture=capture)
    with torch.no_grad():
        with tr.active(), pytest.raises(ValueError, match="token ids must lie in"):
            gpt(torch.tensor([[1, gpt.config.vocab_size + 5]]))  # a token id past the vocabulary
        assert tr.trace.n_steps == 0 and tr.trace.log.n_records > 0  # the failed attempt's records, kept
        with tr.active():
            gpt(tokens)
    tr.close()
    with torch.no_grad(), Tracer(gpt, capture=capture) as clean:
        gpt(tokens)
    assert tr.trace.n_steps == 1
    assert [(r.name, r.shape) for r in tr.trace.records] == [(r.name, r.shape) for r in clean.trace.records]


@pytest.mark.parametrize("capture", ["shapes", "values", "ops"])
def test_a_finished_trace_goes_with_its_last_reference_not_at_the_next_collection(gpt, capture):
    """A notebook traces cell after cell: each finished trace (up to the budget of values) must be freed when
    nothing refers to it, not wait for the cyclic collector (which left several budgets alive at once)."""
    import gc
    import weakref

    tokens = torch.randint(0, gpt.config.vocab_size, (1, 6))
    gc.collect()
    gc.disable()
    try:
        with Tracer(gpt, capture=capture) as tracer:
            gpt(tokens)
        kept = tracer.trace.get("blocks.0.attn.hook_pattern")
        assert (kept is None) == (capture == "shapes")
        log, value = weakref.ref(tracer.trace.log), weakref.ref(kept if kept is not None else tokens)
        del tracer, kept
        assert log() is None
        if capture != "shapes":
            assert value() is None  # the kept value went too
    finally:
        gc.enable()


def test_a_module_output_takes_the_axes_of_the_hook_point_beside_it_not_of_a_later_tensor_at_its_address():
    """A module's output has no axes of its own: it takes those of the hook point that saw the same tensor (the same
    address and shape). The allocator hands a freed tensor's memory to a later tensor within a step, so an address
    and a shape can come back on another one: with V = d_qkv, a layer's W_QKV output was labelled [B, n, V], from
    the logits that later took its memory (in the traces after the first, in a shapes capture: nothing kept)."""
    torch.manual_seed(0)
    config = GPTConfig.for_family("llama", vocab_size=64, n_ctx=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2)
    assert config.vocab_size == (config.n_head + 2 * config.n_kv_heads) * config.d_head  # both [B, n, 64]
    model = GPT(config).eval()
    tokens = torch.randint(0, 64, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :3] = False
    want = {"c_attn:out": ("B", "n", "d_qkv"), "c_attn:in[0]": ("B", "n", "d"), "unembed:out": ("B", "n", "V")}
    for _ in range(4):
        cache = model.new_cache(2)
        with torch.no_grad(), Tracer(model, capture="shapes") as tracer:  # no value kept: memory is reused
            model(tokens[:, :9], cache, padding_mask=padding[:, :9])
            for i in range(9, 12):
                model(tokens[:, i:i + 1], cache)
        seen = 0
        for record in tracer.trace.records:
            for suffix, axes in want.items():
                if record.name.endswith(suffix):
                    assert record.axes == axes, (record.step, record.name)
                    seen += 1
        assert seen == 4 * (2 * 2 + 1)  # four steps: two layers' W_QKV in and out, the unembedding's output
