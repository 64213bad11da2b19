"""Tracing never changes whether a forward works, and never shows a value it cannot vouch for."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpt_shape_tracer.tracer import Tracer
from gpt_shape_tracer.tracer.capture._nested import MAX_TENSORS

LEVELS = ("shapes", "values", "ops")


class Wrap(nn.Module):
    """A linear layer followed by ``inner``: a model whose last module returns something unusual."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x: torch.Tensor):
        return self.inner(self.lin(x))


class Sparse(nn.Module):
    def forward(self, x):
        return x.to_sparse()


class Nested(nn.Module):
    def forward(self, x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested tensors are a prototype API
            return torch.nested.nested_tensor([x[0], x[1, :2]])


class ManyTensors(nn.Module):
    def forward(self, x):
        return [x + i for i in range(5000)]


def same(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if a.is_nested:
        return all(x.equal(y) for x, y in zip(a.unbind(), b.unbind()))
    if a.layout is not torch.strided:
        return a.to_dense().equal(b.to_dense())
    return a.equal(b)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("inner, what", [(Sparse(), "sparse_coo tensor"), (Nested(), "nested tensor")])
def test_sparse_and_nested_outputs_are_recorded_as_far_as_they_can_be(level, inner, what):
    torch.manual_seed(0)
    model, x = Wrap(inner), torch.randn(2, 4)
    expected = model(x)
    with Tracer(model, capture=level) as tracer:
        got = model(x)
    assert same(got, expected)  # tracing changed nothing
    trace = tracer.trace
    rec = trace.record("inner:out")
    assert trace.value(rec) is None
    if level != "shapes":
        assert f"a {what}" in trace.value_note(rec)
    if what.startswith("sparse"):
        assert rec.shape == (2, 4)
    assert trace.record("lin:out").shape == (2, 4)


@pytest.mark.parametrize("level", LEVELS)
def test_a_flat_list_of_5000_tensors_is_capped_with_a_note(level):
    model, x = Wrap(ManyTensors()), torch.randn(2, 4)
    with Tracer(model, capture=level) as tracer:
        out = model(x)
    assert len(out) == 5000 and out[4999].equal(x @ model.lin.weight.T + model.lin.bias + 4999)
    names = tracer.trace.names(0)
    from_inner = [n for n in names if n.startswith("inner:out")]
    assert len(from_inner) == MAX_TENSORS
    assert len(names) <= 2 * MAX_TENSORS + 4  # the root's output is the same list, capped the same way
    last = tracer.trace.record(from_inner[-1])
    assert "at most 256 per call" in tracer.trace.log.note(last.index)


def test_a_value_changed_in_place_under_inference_mode_is_shown_as_it_was():
    """Inference tensors have no version counter to catch a later write: the tracer copies them when kept."""
    model = Wrap(nn.Identity())
    with torch.inference_mode():
        x = torch.ones(2, 4)
        with Tracer(model) as tracer:
            out = model(x)
        before = out.clone()
        out.mul_(-5.0)  # the user's own write, after the forward
    assert tracer.trace.get("inner:out").equal(before)
    assert tracer.trace.get("lin:out").equal(before)


WRITES = {"mul_": lambda y: y.mul_(-5.0), "index": lambda y: y.__setitem__(0, 7.0), "relu_": torch.relu_,
          "copy_": lambda y: y.copy_(torch.full_like(y, 3.0)), "through a view": lambda y: y[:, :2].zero_()}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_value_changed_in_place_in_a_normal_forward_is_dropped_with_a_note(write):
    """Each write docs/security.md lists as caught (the tensor's version counter counts it)."""
    model = Wrap(nn.Identity())
    with Tracer(model) as tracer:
        out = model(torch.ones(2, 4) - 2)
    with torch.no_grad():
        WRITES[write](out)
    rec = tracer.trace.record("lin:out")
    assert tracer.trace.value(rec) is None and "changed in place" in tracer.trace.value_note(rec)


def test_a_write_through_dot_data_is_not_caught_as_the_docs_say():
    """``.data`` has a version counter of its own, so the tracer cannot see such a write; the capture
    module's documentation and docs/security.md say so. This pins that limitation: if it ever starts failing,
    the writes are caught and the documentation must change."""
    import gpt_shape_tracer.tracer.capture._tracer as capture_module

    model = Wrap(nn.Identity())
    with Tracer(model) as t:
        out = model(torch.ones(2, 4))
    out.data.mul_(-5.0)
    assert t.trace.get("lin:out").equal(out)  # the mutated values: not caught
    out.detach().numpy()[0, 0] = 123.0  # a NumPy view of the storage: not counted either
    assert t.trace.get("lin:out")[0, 0] == 123.0
    assert "Not caught: writes through\n  ``.data``" in capture_module.__doc__


@pytest.mark.parametrize("order", ["tracer first", "user hook first"])
def test_a_user_forward_hook_that_raises_is_blamed_on_its_module_and_line(order):
    model = Wrap(nn.Linear(4, 4))

    def broken_hook(module, args, output):
        raise RuntimeError("the user's hook broke")

    handle = model.inner.register_forward_hook(broken_hook) if order == "user hook first" else None
    tracer = Tracer(model)
    with pytest.raises(RuntimeError, match="the user's hook broke") as info, tracer:
        handle = handle or model.inner.register_forward_hook(broken_hook)
        model(torch.randn(2, 4))
    handle.remove()
    error = tracer.trace.error
    assert error.module == "inner" and "in its forward hook broken_hook()" in error.module_type
    assert __file__ in error.source and "raise RuntimeError" in error.source
    assert any("module 'inner'" in note for note in info.value.__notes__)


def hook_counts(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_refused_second_tracer_leaves_no_hooks_even_while_its_exception_is_kept():
    model = Wrap(nn.Linear(4, 4))
    before = hook_counts(model)
    with Tracer(model):
        during = hook_counts(model)
        assert during > before
        with pytest.raises(RuntimeError, match="already active") as info, Tracer(model):
            pass
        kept = info.value  # the exception, and its traceback's frames, stay referenced
        gc.collect()
        assert hook_counts(model) == during
    assert hook_counts(model) == before
    assert kept is not None


def _view(base: torch.Tensor, spec: tuple) -> torch.Tensor:
    """A view of ``base``: a slice (start, length, step) per dimension, then an optional permutation."""
    slices, perm = spec
    v = base[tuple(slice(s, s + n * k, k) for s, n, k in slices)]
    return v.permute(perm) if perm else v


def _slices(draw_shape=(6, 8, 10), steps=(1, 2, 3)):
    return st.tuples(*[st.tuples(st.integers(0, size - 1), st.integers(0, size), st.sampled_from(steps))
                       for size in draw_shape])


@settings(max_examples=300, deadline=None)
@given(a=_slices(), b=_slices(), perm=st.one_of(st.none(), st.permutations([0, 1, 2]).map(tuple)),
       expand=st.booleans())
def test_overlaps_never_misses_a_shared_element_and_is_exact_for_same_stride_boxes(a, b, perm, expand):
    """The in-place guard asks ``overlaps(written, kept)``: it may over-report for interleaved strided
    views (then a value is copied needlessly) but must never miss a shared element (then a kept value
    would change unnoticed). Truth is counted element by element from the storage offsets."""
    from gpt_shape_tracer.tracer.storage._store import overlaps

    ids = torch.arange(6 * 8 * 10).view(6, 8, 10)  # each element's storage offset, as its value
    va, vb = _view(ids, (a, perm)), _view(ids, (b, perm))
    if expand and va.dim() and va.shape[0] == 1:
        va = va.expand(3, *va.shape[1:])  # stride 0: the same elements read three times
    truth = bool(set(va.flatten().tolist()) & set(vb.flatten().tolist()))
    said = overlaps(va, vb)
    assert said or not truth, "a shared element was missed"
    same_box = all(k == 1 for _, _, k in a) and all(k == 1 for _, _, k in b) and not expand
    if same_box:  # two rectangular windows of one buffer with the same strides: exact
        assert said == truth
    if va.numel() == 0 or vb.numel() == 0:
        assert not said


class _Accumulator(nn.Module):
    """Returns the same buffer every call, added to in place first: like a cache a model writes into."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(64))

    def forward(self, x):
        self.total.add_(x)
        return self.total


def test_a_value_evicted_after_it_was_changed_in_place_keeps_no_wrong_statistics():
    """Step 0 keeps the buffer by reference; later steps add to it in place, and the budget (three 256 B
    values) evicts step 0's output at step 3. The evicted record must say why, and show no statistics
    rather than the changed numbers'."""
    model = _Accumulator()
    with Tracer(model, capture="values", budget_bytes=800) as tr, torch.no_grad():
        for _ in range(4):
            model(torch.ones(64))
    trace = tr.trace
    first = trace.record("model:out", 0)
    assert trace.get(first.name, 0) is None and "changed in place" in trace.value_note(first)
    assert trace.stats(first) is None  # stats of the changed buffer would say 2.0, the value was 1.0
    evicted = [r.name for r in trace.records if trace.value_note(r).startswith("evicted")]
    assert evicted == ["model:in[0]", "model:in[0]"]  # steps 0 and 1, oldest first
    assert trace.log.evicted_count == 3  # those two and step 0's output


def test_a_cache_refuses_a_copy_length_that_is_not_a_count_and_a_wrong_batch():
    from gpt_shape_tracer.model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=32, n_ctx=16, d_model=16, n_layer=1, n_head=2)).eval()
    cache = model.new_cache(2)
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long), cache)
    for bad in (True, 1.0, -1, 4):
        with pytest.raises(ValueError, match=r"a copy can hold 0 … 3 positions"):
            cache.copy(bad)
    with pytest.raises(ValueError, match=r"this cache holds 2 sequence\(s\) but the tokens have batch size 1"):
        model(torch.zeros(1, 1, dtype=torch.long), cache)


def test_the_budget_is_checked_and_a_value_of_exactly_the_budget_is_kept():
    model = _Accumulator()
    for bad in (True, 1.5, -1, "512"):
        with pytest.raises(ValueError, match=r"budget_bytes must be a whole number ≥ 0"):
            Tracer(model, capture="values", budget_bytes=bad)
    with Tracer(model, capture="values", budget_bytes=0) as tr, torch.no_grad():
        model(torch.ones(64))
    assert tr.trace.bytes_kept == 0 and tr.trace.stats("model:out", 0) is not None  # nothing kept, stats still
    assert tr.trace.log.peak_bytes_kept == 0
    identity = nn.Identity()
    with Tracer(identity, capture="values", budget_bytes=256) as tr, torch.no_grad():
        identity(torch.ones(64))  # input and output are one 256 B storage: exactly the budget
    assert tr.trace.bytes_kept == 256 and tr.trace.log.evicted_count == 0
    with Tracer(identity, capture="values", budget_bytes=512) as tr, torch.no_grad():
        identity(torch.ones(64))
        identity(torch.zeros(64))  # 256 B held + 256 B new = exactly the budget: nothing is evicted for it
    assert tr.trace.bytes_kept == 512 and tr.trace.log.evicted_count == 0 and tr.trace.log.peak_bytes_kept == 512


def test_the_store_says_when_it_holds_no_view_of_a_storage_any_more():
    """Every way a value leaves (evicted for room, dropped, swapped for a copy) tells the owner when the last
    kept view of a storage is gone — its memory may then be reused by a new tensor at the same address."""
    from gpt_shape_tracer.tracer.storage._store import ValueStore, storage_key

    released: list[tuple[int, int]] = []
    store = ValueStore(budget_bytes=4096, on_release=released.append)
    a = torch.zeros(256)  # 1 KiB
    store.put(0, 0, a)
    store.put(1, 0, a[:128])  # a second view of the same storage
    store.drop(0, note=None)
    assert released == []  # record 1 still views it
    store.drop(1, note="gone")
    assert released == [storage_key(a)]
    b, c = torch.zeros(512), torch.zeros(512)  # 2 KiB each
    store.put(2, 1, b)
    store.put(3, 1, c)
    store.put(4, 1, torch.zeros(512))  # room is made by evicting the oldest, b
    assert released[-1] == storage_key(b) and 2 not in store
    copy = c.clone()
    store.replace(3, copy)
    assert released[-1] == storage_key(c)  # the original left the store …
    assert 3 in store and store.get(3) is copy  # … and its copy is kept in its place


def test_the_store_evicts_preferred_values_last_and_counts_a_storage_once_however_it_is_put():
    """A preferred value (a fused layer's Q, K, V, O: what its derived records are recomputed from) is evicted only
    once no other value is left, oldest first either way; the same tensor put twice in a row, or a view of a held
    storage, counts its storage once; everything kept is listed oldest first, preferred or not."""
    from gpt_shape_tracer.tracer.storage._store import ValueStore

    store = ValueStore(budget_bytes=4 * 1024)  # four 1 KiB storages
    q, k, x, y = (torch.zeros(256) + i for i in range(4))
    store.put(0, 0, q)
    store.put(1, 0, q)  # the same tensor again (a module's input after a hook point's value)
    store.put(2, 0, q[:64])  # a view of it
    store.put(3, 0, k)
    store.put(4, 0, x)
    store.prefer(0)
    store.prefer(3)
    assert store.nbytes == 3 * 1024
    assert [i for i, _ in store.items()] == [0, 1, 2, 3, 4]
    store.put(5, 1, y)  # fits: four storages
    store.put(6, 1, torch.zeros(256))  # room: the oldest plain value's storage (q's, still viewed by 0) is not freed
    assert 4 not in store and 1 not in store and 2 not in store and 0 in store and 3 in store
    assert [i for i, _ in store.items()] == [0, 3, 5, 6] and store.nbytes == 4 * 1024
    store.put(7, 1, torch.zeros(512))  # 2 KiB: both plain ones go (5, 6), the preferred stay
    assert [i for i, _ in store.items()] == [0, 3, 7] and store.nbytes == 4 * 1024
    store.put(8, 2, torch.zeros(768))  # 3 KiB: the plain 7 goes, then, still short, the oldest preferred (0)
    assert [i for i, _ in store.items()] == [3, 8] and store.nbytes == 4 * 1024
    store.drop(3, note=None)
    store.put(9, 2, k)  # put again after its drop: counted afresh
    assert store.get(9) is k and store.nbytes == 4 * 1024 and store.peak_nbytes == 4 * 1024
    assert store.evicted_count == 7  # 1, 2, 4 (only then is a storage freed), then 5, 6, then 7 and 0


def test_a_kept_value_leaves_no_container_for_full_collections_to_walk():
    """Python's full garbage collection walks every tracked object, and how often it runs grows with how many a
    process keeps: the store's own bookkeeping of a kept value is untracked once the collector has seen it (only
    the tensor itself and its storage's object stay tracked; a storage's viewers are a dict of ints, which the
    collector never tracks, where a set always is)."""
    from gpt_shape_tracer.tracer.storage._store import ValueStore

    values = [torch.zeros(4) + i for i in range(2000)]  # made, and their storages' objects, before counting
    for v in values:
        v.untyped_storage()
    store = ValueStore(budget_bytes=2**20)
    gc.collect()
    before = len(gc.get_objects())
    for i, v in enumerate(values):
        store.put(i, 0, v)
    gc.collect()
    added = len(gc.get_objects()) - before
    assert len(store) == len(values)
    assert added <= len(values) * 0.05, f"{added} tracked objects for {len(values)} kept values"  # a set each: 2000


def test_a_values_decode_step_leaves_the_collector_its_kept_tensors_and_little_else():
    """What a values trace's decode step leaves tracked after a collection: the tensors it keeps, the tensors they
    view (a kept view holds its base, and torch keeps the base's Python object alive with it), their storages'
    objects (kept alive with the storage once it has been asked for), and a few
    objects for the step itself — not a container per record or per storage, nor a pair per derived attention
    record (the same mask description shared), each of which a full collection would walk for the trace's life."""
    from gpt_shape_tracer.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_ctx=64, d_model=32, n_layer=4, n_head=2)).eval()
    tokens = torch.randint(0, 64, (1, 12))
    tr = Tracer(model, capture="values", budget_bytes=2**30)
    cache = model.new_cache(1)
    with torch.no_grad(), tr:
        model(tokens[:, :10], cache)
        model(tokens[:, 10:11], cache)
        gc.collect()
        before = {id(o) for o in gc.get_objects()}
        model(tokens[:, 11:], cache)
        gc.collect()
        gc.collect()  # a record made with a new shape is untracked once its shape is (a collection later)
        left = [o for o in gc.get_objects() if id(o) not in before and o is not before]
    log = tr.trace.log
    step = log.steps[-1]
    values = [v for i in range(step.first_record, step.end_record) if (v := log._values.get(i)) is not None]
    kept = {id(v) for v in values} | {id(v._base) for v in values if v._base is not None}
    tensors = [o for o in left if isinstance(o, torch.Tensor)]
    storages = [o for o in left if isinstance(o, torch.UntypedStorage)]
    others = [type(o).__name__ for o in left if not isinstance(o, (torch.Tensor, torch.UntypedStorage))
              and type(o).__name__ != "function"]  # a comprehension of this test's
    derived = sum(1 for i in range(step.first_record, step.end_record) if log.derived(i) is not None)
    assert derived >= 16  # 4 stages × 4 layers: a pair each would show below
    assert {id(t) for t in tensors} <= kept and len(storages) <= len(tensors)
    assert len(others) <= 12, others  # the step, its mask description and its 4 stages, the last call's arguments


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    """gpt_shape_tracer.session.memory.reuse_freed_memory(): a third forward-like pass (48 and 12 MiB tensors made and
    freed in turn, two alive at a time) takes the memory the earlier ones freed, where glibc's default hands it
    fresh pages to fault in. (The second pass measured 0, 12, 48 or 144 MiB from run to run, as the heap
    settled; from the third on it is 0 every time — a test on the second failed one run in three.) Each side in
    a process of its own (the setting holds for a whole process)."""
    import subprocess
    import sys

    probe = (
        "import resource, sys, torch\n"
        "from gpt_shape_tracer.session.memory import reuse_freed_memory\n"
        "took = reuse_freed_memory() if sys.argv[1] == 'reuse' else False\n"
        "def forward():\n"
        "    held = []\n"
        "    for i in range(8):\n"
        "        held.append(torch.ones((12 if i % 2 else 3) * 2**20))\n"
        "        if len(held) > 2:\n"
        "            held.pop(0)\n"
        "    return float(held[-1].sum())\n"
        "forward()\n"
        "forward()\n"  # the heap reaches its steady layout over two passes (after one, 0-144 MiB, by luck)
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "forward()\n"
        "print(took, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 // 2**20)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = {}
    for mode in ("reuse", "default"):
        done = subprocess.run([sys.executable, "-c", probe, mode], cwd=root, capture_output=True, text=True, check=True)
        took, mib = done.stdout.split()
        out[mode] = (took == "True", int(mib))  # MiB the second pass had the kernel map
    assert out["reuse"][0] and not out["default"][0]
    assert out["default"][1] > 100 and out["reuse"][1] < out["default"][1] / 4, out


def test_the_imports_are_frozen_out_of_full_collections_and_later_garbage_is_still_collected():
    """gpt_shape_tracer.session.memory.freeze_imports(): the garbage there is is collected first, every object the
    imports made is left out of later collections (so a full collection walks the few made since), and a cycle
    made afterwards is collected as ever. In a process of its own (the freeze holds for the whole process)."""
    import subprocess
    import sys

    probe = (
        "import gc, weakref\n"
        "import torch, plotly.graph_objects\n"
        "from gpt_shape_tracer.session.memory import freeze_imports\n"
        "class Node: pass\n"
        "a = Node(); a.me = a; earlier = weakref.ref(a); del a\n"
        "frozen = freeze_imports()\n"
        "print(earlier() is None, frozen, len(gc.get_objects()))\n"
        "b = Node(); b.me = b; later = weakref.ref(b); del b\n"
        "gc.collect()\n"
        "print(later() is None)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True)
    first, second = done.stdout.splitlines()
    collected_before, frozen, tracked = first.split()
    assert collected_before == "True" and second == "True", done.stdout
    assert int(frozen) > 100_000 and int(tracked) < int(frozen) // 20, done.stdout


def one_rounding_step(archive: bytes, steps: int = 1) -> bytes:
    """The trace file ``archive`` with every finite floating value moved ``steps`` rounding steps of its own dtype
    away from zero (the next representable number: the bit pattern + steps), each stored number once."""
    from safetensors.torch import load, save

    from tests.tracer.test_tracer_io import member, rewrite

    as_int = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    values = load(member(archive, "values.safetensors"))
    for value in values.values():
        if value.dtype in as_int:
            bits = value.view(as_int[value.dtype])
            bits += torch.isfinite(value).to(bits.dtype) * steps  # ±∞ of the masks stay as they are
    return rewrite(archive, "values.safetensors", save(values))


def test_two_bfloat16_runs_a_rounding_step_apart_do_not_diverge():
    """bfloat16 keeps 8 significant bits: two runs that differ by one rounding step everywhere are the same run
    within bfloat16's tolerance (float32's would call most records diverged); 20 steps apart they diverge."""
    from gpt_shape_tracer.model import load_bundled
    from gpt_shape_tracer.tracer import TracedGeneration, diff_traces, load_trace
    from tests.tracer.test_tracer_io import archive_bytes

    model, tok = load_bundled()
    model = model.to(torch.bfloat16)  # a model of its own: load_bundled loads anew each time
    gen = TracedGeneration(model, tok, "Tom had a big red kite.", temperature=0)
    gen.run(2)
    archive = archive_bytes(gen.trace)
    assert {r.dtype for r in gen.trace.records if gen.trace.value(r) is not None} >= {"bfloat16"}
    near = diff_traces(load_trace(archive), load_trace(one_rounding_step(archive)))
    bf16 = near[near.name.isin({r.name for r in gen.trace.records if r.dtype == "bfloat16"})]
    assert bf16.compared.all() and (bf16.max_abs_delta > 0).any()  # compared, and not equal
    assert not near.diverged.any(), near[near.diverged][["step", "name", "max_abs_delta", "tolerance"]]
    far = diff_traces(load_trace(archive), load_trace(one_rounding_step(archive, 20)))
    assert far[far.name.isin(set(bf16.name))].diverged.any()


def test_diff_traces_flags_nan_in_different_places_and_not_in_the_same_places():
    """Two runs whose numbers agree wherever both are finite, but with a NaN at different positions, have
    diverged (the NaN moved): the row says so and is the first divergence. The same NaN in the same place is
    no divergence."""
    from gpt_shape_tracer.tracer import diff_traces

    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    def traced(values: list[float]):
        model = Double()
        with Tracer(model, capture="values") as tr, torch.no_grad():
            model(torch.tensor(values))
        return tr.trace

    nan = float("nan")
    a, moved, same = traced([1.0, nan, 3.0, 4.0]), traced([1.0, 2.0, nan, 4.0]), traced([1.0, nan, 3.0, 4.0])
    frame = diff_traces(a, moved)
    assert len(frame) == 2 and frame.compared.all()  # the input and the output
    assert (frame.max_abs_delta == 0).all()  # where both are finite the numbers agree
    assert frame.diverged.all() and frame.first_divergence.tolist() == [True, False]
    assert all("NaN/±∞ in different places" in note for note in frame.note)
    unchanged = diff_traces(a, same)
    assert unchanged.compared.all() and not unchanged.diverged.any() and not unchanged.note.str.contains("NaN").any()
