"""Device hygiene without a GPU: every tensor a step creates follows the model's device.

Code that creates a tensor without saying where (``torch.zeros(n)``, ``torch.tensor(rows)``) puts it on the default
device — the CPU — and then mixes it with a model on a GPU: an error there, or a silent copy per record. On a CPU-only
machine such code runs, so a plain test cannot see it. Here the *default* device is the meta device for the whole
step: a tensor created without a device lands on meta, and a dispatch mode writes down every operation that produced
a meta tensor, with the line of our code that called it. A model on the CPU, whose code names its devices, produces
none. (The meta device needs no GPU; the step's real values are still computed on the CPU.)

A step also reads nothing back to the host per record: on a GPU each read (``float(t)``, ``.item()``, ``.tolist()``,
``.cpu()``) waits for the device, and one per record of every layer would serialise the forward. The CPU stands in
for the device here: a mode counts every host read a traced step makes, and a model with twice the layers (twice the
records) must make the same number."""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpt_shape_tracer.model import GPT, GPTConfig, load_bundled
from gpt_shape_tracer.tracer import Finite, TracedGeneration, ablate, tensor_stats
from gpt_shape_tracer.tracer.experiments import (
    attention_gradients,
    cache_precision,
    direct_logit_attribution,
    gradient_trace,
    logit_lens,
    replay,
)

ROOT = Path(__file__).resolve().parents[2]
# frames name our files as imported: through the package (gpt_shape_tracer/model -> ../model)
OURS = (*(str(ROOT / "gpt_shape_tracer" / part) for part in ("model", "tracer", "figures", "session")),
        str(ROOT / "tests/model/test_device_hygiene.py"))


class _ImplicitDevice(TorchDispatchMode):
    """Writes down each operation that produced a tensor on the meta device, and our line that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.device.type == "meta":
                ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(OURS)]
                where = f"{ours[-1].filename[len(str(ROOT)) + 1:]}:{ours[-1].lineno} {ours[-1].line}" if ours else "?"
                self.found.setdefault(where, str(func))
        return out


@contextmanager
def implicit_device_is_meta() -> Iterator[_ImplicitDevice]:
    mode = _ImplicitDevice()
    torch.set_default_device("meta")
    try:
        with mode:
            yield mode
    finally:
        torch.set_default_device(None)


def created_on_meta(work: Callable[[], object]) -> dict[str, str]:
    with implicit_device_is_meta() as mode:
        work()
    return mode.found


@pytest.fixture(scope="module", params=["story-gpt", "story-llama"])
def bundled_model(request):
    return load_bundled(request.param)


@pytest.mark.parametrize(("padding_side", "use_cache", "capture"), [
    ("left", True, "values"), ("right", True, "values"), ("left", False, "values"), ("right", False, "values"),
    ("right", True, "ops"), ("left", True, "shapes")])
def test_a_step_creates_every_tensor_where_the_model_is(bundled_model, padding_side, use_cache, capture):
    model, tok = bundled_model
    gen = TracedGeneration(model, tok, ["Tom had a red kite.", "Lily ran."], use_cache=use_cache, capture=capture,
                           padding_side=padding_side, temperature=0.8, top_k=20, seed=3)
    assert created_on_meta(lambda: gen.run(3)) == {}
    assert gen.facts.n_steps == 3  # the steps really ran, on the CPU


def test_every_experiment_creates_its_tensors_where_the_model_is(bundled_model):
    model, tok = bundled_model
    gen = TracedGeneration(model, tok, ["Tom had a red kite.", "Lily ran."], padding_side="right", seed=3)
    gen.run(2)
    experiments = {
        "replay with an ablation": lambda: replay(gen, 1, [ablate("blocks.0.attn.hook_z", head=0)]),
        "logit lens": lambda: logit_lens(gen.trace, 1, 1, model=model),
        "direct logit attribution": lambda: direct_logit_attribution(gen.trace, 1, 1, model=model),
        "attention gradients": lambda: attention_gradients(gen, 1, 1, 0, 1),
        "gradient trace": lambda: gradient_trace(gen, 1),
        "a cheaper cache": lambda: cache_precision(gen, "int8", steps=2),
    }
    found = {name: created_on_meta(work) for name, work in experiments.items()}
    assert found == dict.fromkeys(experiments, {})


def test_the_check_sees_a_tensor_created_without_a_device(bundled_model):
    """The check itself: a line that forgets the device is found, with where it is."""
    model, tok = bundled_model

    def forgetful() -> None:
        torch.ones(model.config.d_model)  # no device: the default one

    found = created_on_meta(forgetful)
    assert any("torch.ones(model.config.d_model)" in where for where in found)


# -- host reads: a number per step, not per record ------------------------------------------------------
class _HostReads(TorchFunctionMode):
    """Counts what reads a tensor's numbers on the host: Python scalars (``float``, ``int``, ``bool``, ``.item()``:
    ``aten._local_scalar_dense`` on every device), lists and arrays, and copies to the CPU from elsewhere — each one
    a wait for the device on a GPU — with our line that asked for it."""

    READS = frozenset({"tolist", "numpy", "item", "__float__", "__int__", "__bool__", "__index__"})

    def __init__(self) -> None:
        super().__init__()
        self.where: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name in ("cpu", "to") and isinstance(args[0], torch.Tensor) and not args[0].is_cpu and (
            name == "cpu" or any(str(a).startswith("cpu") for a in (*args[1:], kwargs.get("device"))))
        if name in self.READS or to_host:
            ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(OURS)]
            where = f"{ours[-1].filename[len(str(ROOT)) + 1:]}:{ours[-1].lineno}" if ours else "?"
            self.where[f"{name} {where}"] = self.where.get(f"{name} {where}", 0) + 1
        return func(*args, **kwargs)


def host_reads(work: Callable[[], object]) -> dict[str, int]:
    with _HostReads() as mode:
        work()
    return mode.where


def _random_gpt(n_layer: int, vocab_size: int, **options) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, n_ctx=128, d_model=32, n_layer=n_layer, n_head=4, **options)).eval()


@pytest.mark.parametrize("capture", ["shapes", "values", "ops"])
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_a_traced_step_reads_to_the_host_per_step_not_per_record(capture, style):
    """Prefill and a decode step of a 2-layer and a 4-layer model: the same host reads, where a read per record
    (the NaN/∞ flag of each residual-stream record, before they were batched) adds one per record."""
    _, tok = load_bundled("story-gpt")
    options = {"family": "llama", "positions": "rope", "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2,
               "qkv_bias": False, "attn_out_bias": False, "mlp_bias": False,
               "tie_embeddings": False} if style == "llama" else {}
    reads, records = {}, {}
    for n_layer in (2, 4):
        gen = TracedGeneration(_random_gpt(n_layer, tok.vocab_size, **options), tok,
                               ["Tom had a red kite.", "Lily ran."], capture=capture, seed=3)
        reads[n_layer] = [host_reads(gen.step) for _ in range(2)]  # the prefill, then one decode step
        records[n_layer] = len(gen.trace.filter(step=1))
    assert records[4] > records[2]  # twice the layers: more records to flag and keep
    assert reads[4] == reads[2]
    assert sum(reads[2][1].values()) > 0  # the step does read its token back: the mode sees reads


@contextmanager
def counted_host_copies(monkeypatch) -> Iterator[list[str]]:
    """Every kept value's copy to host memory ("copy") and every wait for such copies ("wait"), in order, through
    the two functions the log calls for them (tracer/storage/_host.py), each still doing its work."""
    import gpt_shape_tracer.tracer.storage._log as log_module

    events: list[str] = []
    start, wait = log_module.start_host_copy, log_module.wait_for_host_copies

    def counted_start(t: torch.Tensor) -> torch.Tensor:
        events.append("copy")
        return start(t)

    def counted_wait(devices) -> None:
        events.append("wait")
        wait(devices)

    monkeypatch.setattr(log_module, "start_host_copy", counted_start)
    monkeypatch.setattr(log_module, "wait_for_host_copies", counted_wait)
    yield events


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_a_step_waits_for_its_value_copies_once_not_per_record(monkeypatch, style):
    """The values capture's copies to the host: one started per kept tensor, one wait per step — the same for a
    2-layer and a 4-layer model, prefill and decode — where a blocking copy per record (the tracer before) is a wait
    per record. On the CPU the copies are those of ``copy="all"`` (on a GPU: every kept value), through the same
    code; they hold exactly the values a trace keeping the model's own tensors holds."""
    _, tok = load_bundled("story-gpt")
    options = {"family": "llama", "positions": "rope", "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2,
               "qkv_bias": False, "attn_out_bias": False, "mlp_bias": False,
               "tie_embeddings": False} if style == "llama" else {}
    prompts = ["Tom had a red kite.", "Lily ran."]
    per_step: dict[int, list[dict[str, int]]] = {}
    kept: dict[int, list[int]] = {}
    for n_layer in (2, 4):
        model = _random_gpt(n_layer, tok.vocab_size, **options)
        copied = TracedGeneration(model, tok, prompts, copy="all", seed=3)
        with counted_host_copies(monkeypatch) as events:
            per_step[n_layer] = []
            for _ in range(2):  # the prefill, then one decode step
                events.clear()
                copied.step()
                assert events[-1] == "wait"  # the step ends by waiting: nothing is read before its copy landed
                per_step[n_layer].append({"copy": events.count("copy"), "wait": events.count("wait")})
        monkeypatch.undo()
        referenced = TracedGeneration(model, tok, prompts, copy="auto", seed=3)
        referenced.run(2)
        log, reference = copied.trace.log, referenced.trace.log
        assert log.n_records == reference.n_records
        # the values the log holds (a derived attention stage has none to copy: it is recomputed from the kept Q and
        # K when read), one copy per tensor: a module's output and the next module's input, one tensor, one copy
        held = [[log.value(r.index) for r in copied.trace.filter(step=s) if log.has_value(r.index)] for s in range(2)]
        kept[n_layer] = [len({id(v) for v in values}) for values in held]
        assert all(k < len(values) for k, values in zip(kept[n_layer], held))
        for index in range(log.n_records):
            value, expected = log.value(index), reference.value(index)
            assert (value is None) == (expected is None), index
            if value is not None and expected is not None:
                assert value.dtype == expected.dtype and value.shape == expected.shape, index
                assert torch.equal(value, expected), index
    assert kept[4][0] > kept[2][0] and kept[4][1] > kept[2][1]  # twice the layers: more records to copy
    for n_layer in (2, 4):
        assert [s["copy"] for s in per_step[n_layer]] == kept[n_layer]  # every value copied once, …
    assert [s["wait"] for s in per_step[2]] == [s["wait"] for s in per_step[4]] == [1, 1]  # … and waited for once


def test_a_reader_during_the_step_waits_for_the_copies_first(monkeypatch):
    """A value read while its step is still running (a forward hook reading the trace) is read after a wait for
    the copies so far, never while its copy may still be landing; the step's end waits for the rest."""
    model, tok = load_bundled("story-gpt")
    gen = TracedGeneration(model, tok, "Tom had a red kite.", copy="all", seed=3)
    seen: list[torch.Tensor | None] = []

    def read_the_first_record(module, args, output) -> None:
        events.append("read")
        seen.append(gen.trace.log.value(0))

    handle = model.blocks[0].register_forward_hook(read_the_first_record)
    try:
        with counted_host_copies(monkeypatch) as events:
            gen.step()
    finally:
        handle.remove()
    read = events.index("read")
    assert events[:read].count("copy") > 0 and events[read + 1] == "wait"  # copies in flight: waited for, then read
    assert events[-1] == "wait" and events.count("wait") == 2 and seen[0] is not None


def test_a_step_larger_than_the_budget_evicts_its_own_copies_after_they_land(monkeypatch):
    """A budget smaller than one step: the step evicts values it copied itself, and their statistics are taken from
    the copies once landed (a wait before the eviction), equal to those of the same values kept whole."""
    model, tok = load_bundled("story-gpt")
    small = TracedGeneration(model, tok, "Tom had a red kite.", copy="all", budget_bytes=64 * 2**10, seed=3)
    with counted_host_copies(monkeypatch) as events:
        small.step()
    monkeypatch.undo()
    whole = TracedGeneration(model, tok, "Tom had a red kite.", copy="all", seed=3)
    whole.step()
    log = small.trace.log
    evicted = [i for i in range(log.n_records) if not log.has_value(i) and log.has_stats(i)]
    assert len(evicted) > 10 and events.count("wait") > 1  # evicted within the step, each after a wait
    for index in evicted:
        value = whole.trace.log.value(index)
        assert value is not None and log.stats(index) == tensor_stats(value), index


def test_a_sampled_step_reads_to_the_host_per_step_not_per_row():
    """The draw is made where the logits are, and the step reads back whether each row can give a token and what
    its record keeps together: a batch of 3 makes the same host reads as a batch of 1 (a check or a probability
    read per row — the tracer before — adds reads with every row)."""
    _, tok = load_bundled("story-gpt")
    model = _random_gpt(2, tok.vocab_size)
    reads = {}
    for prompts in (["Tom had a red kite."], ["Tom had a red kite.", "Lily ran.", "The sun"]):
        gen = TracedGeneration(model, tok, prompts, capture="shapes", temperature=0.9, top_k=20, top_p=0.9, seed=3)
        reads[len(prompts)] = [host_reads(gen.step) for _ in range(2)]
        assert gen.generator is not None and gen.generator.device.type == "cpu"  # made where the logits are
    assert reads[3] == reads[1]


def test_the_count_sees_a_read_per_record():
    """The check itself: a flag read per tensor is one read each, found where it is read."""
    found = host_reads(lambda: [float(torch.randn(3).sum()) for _ in range(5)])
    assert len(found) == 1 and next(iter(found)).startswith("__float__ tests/model/test_device_hygiene.py:")
    assert sum(found.values()) == 5


def _reference_flag(t: torch.Tensor) -> int:
    x = torch.view_as_real(t) if t.is_complex() else t
    if not (x.is_floating_point()) or bool(torch.isfinite(x).all()):
        return Finite.CLEAN
    return Finite.NEG_INF if bool((torch.isfinite(x) | torch.isneginf(x)).all()) else Finite.BAD


def test_flags_read_together_are_each_tensors_own():
    """Flags read together — tensors of one shape stacked into one reduction, others reduced one by one, all read
    in one transfer per device — come back in order, each its own tensor's, for every dtype mixed; a finite
    tensor whose sum would overflow is clean (its flag comes from its smallest and largest elements)."""
    from gpt_shape_tracer.tracer.storage._stats import flag_range, flags_of_ranges, flags_of_tensors

    tensors = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64):
        clean = torch.randn(3, 5).to(dtype)
        masked, bad, plus, all_masked = clean.clone(), clean.clone(), clean.clone(), torch.full_like(clean, -math.inf)
        masked[0, 1] = -math.inf
        bad[2, 2] = math.nan
        plus[1, 0] = math.inf
        tensors += [clean, masked, bad, plus, all_masked, clean[:, :2], masked.T]
    tensors += [torch.arange(4), torch.empty(0), torch.full((4,), 3e38), torch.full((2,), 6e4, dtype=torch.float16)]
    expected = [_reference_flag(t) for t in tensors]
    assert flags_of_tensors(tensors) == expected
    ranges = [flag_range(t) for t in tensors]
    pending = [r for r in ranges if not isinstance(r, int)]
    read = iter(flags_of_ranges(pending))
    assert [r if isinstance(r, int) else next(read) for r in ranges] == expected
    assert {Finite.CLEAN, Finite.NEG_INF, Finite.BAD} <= set(expected)
    assert flags_of_tensors([torch.empty(2, device="meta")]) == [Finite.UNKNOWN]


def test_a_shapes_trace_flags_what_a_values_trace_measures():
    """The residual stream of a model that makes NaN from layer 1 on: the flags batched at the step's end agree,
    record by record, with the statistics of the same records' kept values — and a reader asking during the step
    gets them too."""
    _, tok = load_bundled("story-gpt")
    model = _random_gpt(3, tok.vocab_size)
    with torch.no_grad():
        model.blocks[1].mlp.c_proj.weight[0, 0] = math.nan
    flags = {}
    for capture in ("shapes", "values"):
        gen = TracedGeneration(model, tok, "Tom had a red kite.", capture=capture, seed=3)
        gen.step()
        trace = gen.trace
        flags[capture] = {r.name: trace.finite_flag(r) for r in trace.filter(step=0)
                          if trace.finite_flag(r) != Finite.UNKNOWN or capture == "shapes"}
    checked = {name: flag for name, flag in flags["shapes"].items() if flag != Finite.UNKNOWN}
    assert checked and {name: flags["values"][name] for name in checked} == checked
    assert Finite.BAD in checked.values() and Finite.CLEAN in checked.values()
