"""Op costs (tracer/costs): the multiply-adds a dry run counts on the meta device equal what PyTorch's own
FlopCounterMode counts on the real run of the same model, module by module and op by op; the totals equal
model/costs.py's formula for our GPT."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from gpt_shape_tracer.model import load_model
from gpt_shape_tracer.model.analysis import forward_cost
from gpt_shape_tracer.model.gpt import attention_path
from gpt_shape_tracer.model.sources import ASSETS
from gpt_shape_tracer.tracer import TracedGeneration
from gpt_shape_tracer.tracer.costs import costed_dry_run, costs_frame, kv_cache_bytes
from tests.hf_architectures import build

PROMPT = "Once upon a time"


def _flop_counter_view(model, tokens) -> dict[str, dict[str, int]]:
    """FlopCounterMode on the real model: per module (inclusive, named from the root's class), per op."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens)
    # a module reachable at two paths (HFDecoder's w_o is the model's o_proj) is named by its first path, as in
    # named_modules and the trace
    root = type(model).__name__
    canonical = {id(m): path for path, m in model.named_modules()}

    def path(name: str) -> str:
        inner = name.removeprefix(root).removeprefix(".")
        return ".".join(filter(None, [root, canonical[id(model.get_submodule(inner))]]))

    return {path(name): {str(op): int(n) for op, n in ops.items() if n}
            for name, ops in counter.get_flop_counts().items() if name != "Global" and any(ops.values())}


def _our_view(costs, model) -> dict[str, dict[str, int]]:
    """Our ops' FLOPs in FlopCounterMode's naming: every module that ran around the op (a ModuleList never runs)."""
    root = type(model).__name__
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for op in costs.ops:
        if not op.macs:
            continue
        parts = op.module.split(".") if op.module else []
        for i in range(len(parts) + 1):
            if isinstance(model.get_submodule(".".join(parts[:i])), torch.nn.ModuleList):
                continue
            name = ".".join([root, *parts[:i]])
            out[name][op.op] += op.flops
    return {k: dict(v) for k, v in out.items()}


@pytest.mark.parametrize("source", ["story-gpt", "story-llama", "qwen3", "mixtral"])
def test_dry_run_flops_equal_flop_counter_mode_on_the_real_run(source, tmp_path):
    if source.startswith("story"):
        directory = ASSETS / source
    else:
        directory = build(source, tmp_path / source, ASSETS / "story-gpt" / "tokenizer.json")
    real, tok = load_model(directory)
    if source == "mixtral":
        # transformers runs the experts with torch._grouped_mm here, which flop_counter has no formula for (it
        # counts 0); the dry run runs them as batched matrix products (sources/_dry_run.py): compared like for like
        real.hf.set_experts_implementation("batched_mm")
    dry, dry_tok = load_model(directory, weights=False)
    # FlopCounterMode's module hooks may write any hook point, so the real run under it runs attention eager (its
    # matrix products): op by op, the dry run is compared on the same path
    with attention_path("eager"):
        gen, costs = costed_dry_run(dry, dry_tok, PROMPT, steps=2)
    prefill = torch.tensor([tok.encode(PROMPT)])
    theirs = _flop_counter_view(real, prefill)
    assert _our_view(costs[0], dry) == theirs
    # a decode step with the cache: one new row over t = n + 1 keys, counted the same way
    cache = real.new_cache(1)
    real(prefill, cache)
    with FlopCounterMode(display=False) as counter:
        real(torch.tensor([[0]]), cache)
    assert sum(op.flops for op in costs[1].ops) == counter.get_total_flops()
    # the dry run's own path, the fused kernel (one op per attention, torch's SDPA formula): the same FLOPs in every
    # module, prefill and decode
    _, fused = costed_dry_run(dry, dry_tok, PROMPT, steps=2)
    assert any(op.op == "aten._scaled_dot_product_flash_attention_for_cpu" for op in fused[0].ops)
    assert not any(op.op == "aten.bmm" for op in fused[0].ops if op.module.endswith("attn"))
    totals = {module: sum(ops.values()) for module, ops in theirs.items()}
    assert {module: sum(ops.values()) for module, ops in _our_view(fused[0], dry).items()} == totals
    assert [c.macs for c in fused] == [c.macs for c in costs]


@pytest.mark.parametrize("name", ["story-gpt", "story-llama"])
def test_totals_equal_the_formula_for_our_gpt(name):
    dry, tok = load_model(ASSETS / name, weights=False)
    gen, costs = costed_dry_run(dry, tok, PROMPT, steps=2)
    n = gen.facts.steps[0].forward.n
    assert costs[0].macs == forward_cost(dry.config, 1, n, n).macs
    assert costs[2].macs == forward_cost(dry.config, 1, 1, n + 2, cached=n + 1).macs
    # the KV cache grows by one row per layer and step: 2 (K, V) · L · G · d_head · itemsize bytes
    c = dry.config
    row = 2 * c.n_layer * (c.n_kv_head or c.n_head) * c.d_head * 4
    assert kv_cache_bytes(gen.trace, 2) - kv_cache_bytes(gen.trace, 1) == row
    assert kv_cache_bytes(gen.trace, 0) == n * row
    # the cache's in-place copy_ of the new K and V rows writes those bytes (an in-place op writes its output)
    assert sum(op.written_bytes for op in costs[2].ops if op.op == "aten.copy_") == row
    # an embedding lookup reads the rows of its tokens, not the table: one float32 row of d_model at a decode step
    embeds = [op for op in costs[1].ops if op.op == "aten.embedding"]
    assert len(embeds) == (2 if name == "story-gpt" else 1)  # GPT-2 style: tokens and positions
    assert all(op.weight_bytes == c.d_model * 4 for op in embeds)
    assert all(op.weight_bytes == n * c.d_model * 4 for op in costs[0].ops if op.op == "aten.embedding")
    # a decode step reads every weight matrix once: at least the formula's weight bytes (which leaves out norms)
    assert costs[1].weight_bytes >= forward_cost(c, 1, 1, n + 1).weight_bytes
    frame = costs_frame(costs[0])
    assert frame["multiply-adds"].sum() == costs[0].macs


def test_roofline_decode_is_memory_bound_and_floors_are_the_max_of_two_terms():
    from gpt_shape_tracer.tracer.costs import ACCELERATORS, op_floors, step_floor

    dry, _ = load_model("shapes:llama-3.1-8b", weights=False)
    _, costs = costed_dry_run(dry, n=512, steps=1)
    for acc in ACCELERATORS.values():
        decode = step_floor(costs[1].ops, acc, "bfloat16")
        assert decode.bound == "memory" and decode.memory_seconds > 0.9 * decode.seconds
        # reading every weight once at the memory's bandwidth is the least a decode step can take
        assert decode.seconds >= costs[1].weight_bytes / acc.bandwidth
        for f in op_floors(costs[0].ops[:50], acc, "bfloat16"):
            assert f.seconds == max(f.op.flops / acc.peak("bfloat16"),
                                    (f.op.read_bytes + f.op.written_bytes) / acc.bandwidth)
        assert all(acc.source.startswith("https://") for acc in ACCELERATORS.values())
    # against NVIDIA's H100 SXM datasheet, read here and not from ACCELERATORS: 989.5 TFLOPS dense BF16 tensor,
    # 3.35 TB/s. A step's floor is the sum of its ops' floors (they run one after another), each the larger term
    h100 = ACCELERATORS["H100 SXM"]
    for step in costs:
        by_hand = sum(max(op.flops / 989.5e12, (op.read_bytes + op.written_bytes) / 3.35e12) for op in step.ops)
        assert step_floor(step.ops, h100, "bfloat16").seconds == pytest.approx(by_hand, rel=1e-9)
    # the prefill of n = 512 tokens is compute-bound: its floor is at least its matrix products' 2·n·(weights)
    # FLOPs at the bf16 peak, and below that plus every byte moved at the bandwidth (float32's 67 TFLOPS would
    # make it 15 times longer)
    c = dry.config
    kv = c.n_kv_head * c.d_head
    matrices = c.n_layer * (2 * c.d_model * c.n_head * c.d_head + 2 * c.d_model * kv + 3 * c.d_model * c.d_ff) \
        + c.d_model * c.vocab_size
    prefill = step_floor(costs[0].ops, h100, "bfloat16")
    assert prefill.bound == "compute"
    at_peak = 2 * 512 * matrices / 989.5e12
    assert at_peak <= prefill.seconds <= at_peak + prefill.bytes_moved / 3.35e12


def test_a_moe_floor_counts_the_experts_a_real_run_reads_and_no_dry_run_copies(tmp_path):
    """Issue 52: a mixture-of-experts step's floor counts what a real run's kernels move — each routed expert's
    matrices once when a token picks it, nothing for views (t, view, expand, slice) and nothing for the dry run's
    own copies of the chosen experts' matrices. A decode step of one sequence reads the active weights: every
    parameter once, k of the E experts of each MoE layer, one row of the embedding; its floor is within 10 % of
    those bytes at the memory's bandwidth. A prefill's floor is a range: every token on the same k experts, up to
    every expert hit."""
    from transformers import MixtralConfig

    from gpt_shape_tracer.tracer.costs import ACCELERATORS, step_floor

    E, k = 8, 2
    MixtralConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=k,
                  max_position_embeddings=512, torch_dtype="bfloat16").save_pretrained(tmp_path)
    dry, _ = load_model(tmp_path, weights=False)
    n = 64
    _, costs = costed_dry_run(dry, n=n, steps=1)
    params = dict(dry.named_parameters())
    experts = {name: p for name, p in params.items() if p.dim() == 3 and p.shape[0] == E}
    assert len(experts) == 2 * 2  # gate_up_proj and down_proj of each layer
    one_expert = sum(p[0].numel() * p.element_size() for p in experts.values())  # of all layers
    embedding = next(p for name, p in params.items() if name.endswith("embed_tokens.weight"))
    row = embedding.shape[1] * embedding.element_size()
    everything = sum(p.numel() * p.element_size() for p in params.values())
    active = everything - sum(p.numel() * p.element_size() for p in experts.values()) + k * one_expert \
        - embedding.numel() * embedding.element_size() + row
    decode = costs[1]
    assert decode.weight_bytes == active
    assert not any(op.spread_bytes for op in decode.ops)  # one token: its k experts, nothing to spread over
    for acc in ACCELERATORS.values():
        floor = step_floor(decode.ops, acc, "bfloat16")
        assert abs(floor.seconds - active / acc.bandwidth) <= 0.1 * active / acc.bandwidth, (acc.name, floor)
        assert floor.spread_seconds == 0 and "same k experts" not in floor.describe()
    # views move nothing; the dry run's copies of expert matrices write nothing
    views = [op for op in decode.ops if op.op in ("aten.t", "aten.view", "aten.expand", "aten.slice")]
    assert views and all(op.read_bytes == op.written_bytes == op.weight_bytes == 0 for op in views)
    copies = [op for op in decode.ops if op.op == "aten.index" and len(op.output_shape) == 3]
    assert len(copies) == 4 and all(op.written_bytes == 0 for op in copies)
    # the prefill: n·k = 128 choices can hit all E experts, so the range runs from k experts to E
    prefill = costs[0]
    assert prefill.weight_bytes == active - row + n * row
    assert sum(op.spread_bytes for op in prefill.ops) == (E - k) * one_expert
    h100 = step_floor(prefill.ops, ACCELERATORS["H100 SXM"], "bfloat16")
    assert h100.spread_seconds > h100.seconds
    assert "with every token on the same k experts" in h100.describe()


def test_placement_by_accelerate_and_the_longest_context():
    from gpt_shape_tracer.model.sources import parameters_by_dtype
    from gpt_shape_tracer.tracer.costs import place

    dry, _ = load_model("shapes:llama-3.1-70b", weights=False)
    placed = place(dry, {0: "80GiB", 1: "80GiB", "cpu": "200GiB"})
    total = sum(parameters_by_dtype(dry).values()) * 2  # bfloat16
    assert sum(placed.weights_by_device.values()) == total
    assert sum(placed.layers_by_device.values()) == 80
    c = dry.config
    assert placed.kv_bytes_per_token == 2 * c.n_layer * c.n_kv_head * c.d_head * 2
    per_layer = placed.kv_bytes_per_token // c.n_layer
    expected = min(placed.free_by_device[d] // (per_layer * n) for d, n in placed.cache_layers_by_device.items())
    assert placed.longest_context == min(expected, c.n_ctx)
    assert f"{placed.longest_context:,} tokens" in placed.describe()


def test_the_longest_context_counts_every_layers_cache_where_accelerate_runs_it():
    """Issue 52: a layer offloaded to the CPU or the disk runs on the main device (accelerate's dispatch_model
    brings its weights to the first GPU of the map), so its keys and values are made and kept there: one GPU holds
    the cache of every layer, its own and the offloaded ones (before, the disk's layers counted no cache at all
    and the CPU's counted theirs in the CPU's memory). A batch of 4 holds 4 times the bytes per token and fits a
    quarter of the context. By hand from the config and the memory asked for."""
    from gpt_shape_tracer.tracer.costs import place

    dry, _ = load_model("shapes:llama-3.1-70b", weights=False)
    c = dry.config
    memory = {0: "40GiB", "cpu": "30GiB"}  # 141 GB of bf16 weights: most layers go to the CPU and the disk
    per_layer = 2 * c.n_kv_head * c.d_head * 2  # K and V, bf16, one token of one sequence
    contexts = []
    for batch in (1, 4):
        placed = place(dry, memory, batch=batch)
        layers = placed.layers_by_device
        assert layers.get("disk", 0) > 0 and layers.get("cpu", 0) > 0 and sum(layers.values()) == c.n_layer
        assert placed.kv_bytes_per_token == batch * c.n_layer * per_layer
        assert placed.cache_layers_by_device == {"0": c.n_layer}
        left = 40 * 2**30 - placed.weights_by_device["0"]
        assert placed.longest_context == min(left // (batch * per_layer * c.n_layer), c.n_ctx)
        said = placed.describe()
        assert f"The {layers['cpu'] + layers['disk']} offloaded layer(s) run on 0" in said
        assert f"the cache is held by 0: {c.n_layer} layer(s)." in said
        contexts.append(placed.longest_context)
    assert contexts[1] in (contexts[0] // 4, contexts[0] // 4 - 1)  # each rounded down


def _measured_activation_peaks(model, tok, prompt: str, steps: int) -> list[int]:
    """The real run's peak activation memory per step, measured by PyTorch's CPU allocator as its profiler reports
    it (``profile_memory``: one event per allocation and free, with its bytes) — not by our counter.

    Activation memory: the bytes of memory allocated during the step's forward that are still held, at their
    most — the parameters and the KV cache's buffers allocated before the step are not in it (the allocator only
    reports what is allocated while it profiles), the buffers the cache allocates in the step are. The profiler runs
    from the model's forward pre-hook to its forward hook, so the generation's own work around the forward
    (feeding the ids, sampling the next token from the logits) is not in it: the dry run does neither."""
    peaks: list[int] = []
    prof: list[profile] = []

    def start(module, args, kwargs):
        prof.append(profile(activities=[ProfilerActivity.CPU], profile_memory=True))
        prof[-1].start()

    def stop(module, args, kwargs, output):
        prof[-1].stop()

    handles = [model.register_forward_pre_hook(start, with_kwargs=True),
               model.register_forward_hook(stop, with_kwargs=True)]
    try:
        gen = TracedGeneration(model, tok, prompt, capture="shapes", temperature=0.0, stop_at_eos=False)
        for _ in range(1 + steps):
            gen.step()
    finally:
        for h in handles:
            h.remove()
    for p in prof:
        live = peak = 0
        held: set[int] = set()
        for ptr, nbytes in _allocations(p):  # nbytes: + for an allocation, − for a free
            if nbytes > 0:
                held.add(ptr)
            elif ptr in held:
                held.discard(ptr)
            else:  # a block allocated before the step (in an earlier window the profiler watched), freed in it
                continue
            live += nbytes
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _allocations(p: profile) -> list[tuple[int, int]]:
    """The window's allocations and frees in time order, as (address, bytes). The allocator also reports the
    freeing of a block it saw allocated in an earlier window of any profiler in the process — a cache buffer of the
    previous step, or a tensor of an earlier test that a garbage collection frees mid-step; those are not the
    step's activations, and only the address tells them apart."""
    found: list[tuple[int, int, int]] = []
    stack = list(p.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            found.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
        stack.extend(e.children)
    return [(ptr, nbytes) for _, ptr, nbytes in sorted(found)]


@pytest.mark.parametrize("source", ["story-gpt", "story-llama", "qwen3", "mixtral", "deepseek_v3"])
def test_estimated_peak_activation_memory_is_within_15_percent_of_the_measured(source, tmp_path):
    """Prefill and two decode steps. Mixtral and DeepSeek-V3 run their experts with transformers' default
    (``grouped_mm``) in the real run; the dry run with ``batched_mm``, whose copies of the chosen experts' matrices
    are left out of the estimate (tracer/costs/_counter.py); DeepSeek-V3's cache holds the latent c_KV and k_R."""
    directory = ASSETS / source if source.startswith("story") else build(
        source, tmp_path / source, ASSETS / "story-gpt" / "tokenizer.json")
    prompt = "Once upon a time, there was a little girl who lived in a village near the forest."
    real, tok = load_model(directory)
    measured = _measured_activation_peaks(real, tok, prompt, steps=2)
    dry, dry_tok = load_model(directory, weights=False)
    _, costs = costed_dry_run(dry, dry_tok, prompt, steps=2)
    estimated = [c.peak_activation_bytes for c in costs]
    assert len(measured) == len(estimated) == 3 and min(measured) > 0
    for step, (m, e) in enumerate(zip(measured, estimated)):
        assert abs(e - m) <= 0.15 * m, f"step {step}: estimated {e:,} B, measured {m:,} B"
