"""``trace_engine``: transformers' own continuous batching, one engine step at a time, with the pool and every
request's attention recorded.

How it runs. transformers 5.23 drives continuous batching from a background thread (``generate_batch``,
``ContinuousBatchingManager.start``) and has no public synchronous step. This module makes the manager's batch
processor without the thread (``manager._create_batch_processor()``) and runs, per engine step, the three calls the
thread's loop body makes — ``prepare_next_batch`` (schedule, allocate pages, build the packed inputs),
``_generation_step`` (one forward and the greedy choice) and ``update_batch`` (append tokens, finish, free and
de-duplicate pages) — reading the pool between them. The two private calls are pinned by
tests/tracer/test_engine.py::test_the_private_step_calls_of_transformers_are_still_there.

What it records. The paged attention is transformers' ``paged|eager`` function; for the run, the name is given to a
wrapper that calls it and then keeps, per request, its query rows and pattern (sliced from the packed batch through
``cu_seq_lens_q`` / ``cu_seq_lens_k``) and its K and V gathered from the pool's pages through its block table. The
model's attention implementation and the registry's entry are restored afterwards, also when the run fails.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gpt_shape_tracer.model import GPT, HFDecoder, TextTokenizer
from gpt_shape_tracer.tracer.engine._records import (
    Contribution,
    EngineRequest,
    EngineStep,
    FinishReason,
    PoolFacts,
    RequestAttention,
    RequestInStep,
)
from gpt_shape_tracer.tracer.storage import DEFAULT_BUDGET_BYTES

PAGED = "paged|eager"  # transformers builds the packed block-diagonal mask only for this name
FULL = "full_attention"  # the allocator of full-attention layers (the only kind traced here)
MAX_REQUESTS = 64
MAX_ENGINE_STEPS = 4096
MAX_ARRIVAL = 1024
MAX_POOL_BYTES = 2**30  # the pool a traced run may hold (the server's budget; the CLI and the app stay under it)
# transformers' eager paged attention builds a mask of [max_batch_tokens, pool tokens + max_batch_tokens]: the
# 13.6 GB it took once without sizes came mostly from there, so its size is bounded before anything is built
MAX_MASK_BYTES = 256 * 2**20
_RUN_LOCK = threading.Lock()  # the attention registry is global: one traced engine run at a time per process


class EngineError(ValueError):
    """A run refused or stopped, with the reason and the numbers."""


def pages_for(prompt_tokens: int, max_new_tokens: int, page_size: int) -> int:
    """Pages a request holds at its longest: its prompt and every generated token but the last, which is sampled
    and returned without being written to the cache."""
    return math.ceil((prompt_tokens + max_new_tokens - 1) / page_size)


def _transformers_model(model: nn.Module) -> Any:
    """The transformers model behind ``model``, or an ``EngineError`` saying why there is none."""
    if isinstance(model, GPT):
        raise EngineError(
            "our GPT cannot take the paged path: it runs its own forward over its own contiguous KVCache "
            "([B, G, t, d_head] per layer) and never calls transformers' attention interface, where the paged "
            "cache, the block tables and the packed batch live. Load the directory through transformers instead "
            "(load_hf(path, implementation='transformers'), or the CLI's --model-dir)")
    hf = model.hf if isinstance(model, HFDecoder) else model
    if not callable(getattr(hf, "init_continuous_batching", None)):
        raise EngineError(f"{type(model).__name__} is not a transformers model: continuous batching is "
                          "transformers' (give an HFDecoder or a PreTrainedModel)")
    if hf.device.type == "meta":
        raise EngineError("a dry run (meta device) has no values to run: engine sizing needs no run (engine_sizing)")
    return hf


def _prompt_ids(requests: Sequence[str | Sequence[int]], tokenizer: TextTokenizer | None,
                vocab: int) -> list[tuple[str | None, list[int]]]:
    out = []
    for i, request in enumerate(requests):
        if isinstance(request, str):
            if tokenizer is None:
                raise EngineError(f"request {i} is text but no tokenizer was given")
            ids = tokenizer.encode(request)
            text: str | None = request
        else:
            ids, text = [int(t) for t in request], None
        if not ids:
            raise EngineError(f"request {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"request {i}: token id {bad[0]} is outside the vocabulary (0 … {vocab - 1})")
        out.append((text, ids))
    return out


class _Values:
    """Kept attention values under a byte budget: adding past it drops the oldest steps first (as the trace's
    value store does), and every drop is noted. Never over the budget, not even within a step."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[tuple[int, str, int], RequestAttention] = OrderedDict()
        self.nbytes = 0
        self.dropped_steps: set[int] = set()
        self.too_large = 0

    def put(self, value: RequestAttention) -> None:
        size = value.nbytes
        if size > self.budget_bytes:
            self.too_large += 1
            self.dropped_steps.add(value.step)
            return
        while self.nbytes + size > self.budget_bytes and self.entries:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.dropped_steps.add(old.step)
        self.entries[(value.step, value.request_id, value.layer)] = value
        self.nbytes += size

    def notes(self) -> list[str]:
        if not self.dropped_steps:
            return []
        steps = sorted(self.dropped_steps)
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]} … {steps[-1]} ({len(steps)} steps)"
        note = (f"attention values of {span} were dropped to stay within the {self.budget_bytes:,} B budget "
                "(the oldest go first; the records of every step are kept)")
        if self.too_large:
            note += f"; {self.too_large} request-layer value(s) were larger than the whole budget"
        return [note]


class EngineRun:
    """A traced engine run: the pool, the requests, every engine step, and the attention values kept."""

    def __init__(self, pool: PoolFacts, requests: tuple[EngineRequest, ...], steps: tuple[EngineStep, ...],
                 values: dict[tuple[int, str, int], RequestAttention], budget_bytes: int,
                 notes: tuple[str, ...] = ()) -> None:
        self.pool = pool
        self.requests = requests
        self.steps = steps
        self.budget_bytes = budget_bytes
        self.notes = notes
        self._values = dict(values)

    def __repr__(self) -> str:
        return (f"EngineRun({len(self.requests)} requests, {len(self.steps)} engine steps, pool of "
                f"{self.pool.pages} pages × {self.pool.page_size}, {self.bytes_kept:,} B of values)")

    @property
    def bytes_kept(self) -> int:
        return sum(v.nbytes for v in self._values.values())

    def request(self, request_id: str) -> EngineRequest:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise KeyError(f"no request {request_id!r} (requests: {', '.join(r.request_id for r in self.requests)})")

    def attention(self, step: int, request_id: str, layer: int) -> RequestAttention | None:
        """The request's attention at that layer and engine step, or None (not in the step, or dropped: ``notes``)."""
        return self._values.get((step, request_id, layer))

    def attentions(self) -> Iterator[RequestAttention]:
        """Every kept value, in (step, request, layer) order."""
        for key in sorted(self._values):
            yield self._values[key]


class _Recorder:
    """The wrapper that stands in for ``paged|eager`` during a run: calls transformers' function, then keeps what
    each request of the step saw."""

    def __init__(self, inner: Callable[..., Any], values: _Values | None) -> None:
        self.inner = inner
        self.values = values
        self.step = 0
        self.batch: list[tuple[str, int, int, torch.Tensor]] = []  # (request, past, tokens, pool rows of positions)
        self.layers_seen: set[int] = set()

    def begin(self, step: int, batch: list[tuple[str, int, int, torch.Tensor]]) -> None:
        self.step, self.batch, self.layers_seen = step, batch, set()

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float, **kwargs: Any) -> Any:
        out, weights = self.inner(module, query, key, value, attention_mask, scaling, **kwargs)
        layer: int = module.layer_idx  # type: ignore[assignment]  # transformers' attention modules carry it
        self.layers_seen.add(layer)
        if self.values is not None and weights is not None:
            self._keep(layer, query, key, weights, kwargs)
        return out, weights

    def _keep(self, layer: int, query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor,
              kwargs: dict[str, Any]) -> None:
        cache = kwargs["cache"]
        allocator = cache.layer_to_allocator[layer]
        page = allocator.tokens_per_page
        G, d = key.shape[1], key.shape[-1]
        # the pool as rows of [G, d]: per block, each layer's page of keys then its page of values
        flat = allocator.cache_tensor.view(-1, G, d)
        k_offset = 2 * allocator.layer_indices.index(layer) * page
        cu_q = kwargs["cu_seq_lens_q"].tolist()
        cu_k = kwargs["cu_seq_lens_k"][FULL].tolist()
        assert self.values is not None
        for i, (rid, past, tokens, rows) in enumerate(self.batch):
            length = past + tokens
            if cu_k[i + 1] - cu_k[i] != length or cu_q[i + 1] - cu_q[i] != tokens:
                raise EngineError(f"engine step {self.step}, layer {layer}: request {rid}'s slice of the packed batch "
                                  f"({cu_q[i + 1] - cu_q[i]} queries, {cu_k[i + 1] - cu_k[i]} keys) is not its "
                                  f"{tokens} new and {past} cached positions")
            q0, k0 = cu_q[i], cu_k[i]
            keys = (rows + k_offset).to(flat.device)  # the block table's rows, where the pool is (a GPU's)
            host = torch.device("cpu")  # kept on the host, as the tracer keeps values: the pool's memory is the GPU's
            self.values.put(RequestAttention(
                step=self.step, request_id=rid, layer=layer, past=past,
                q=query[0, :, q0:q0 + tokens].to(host, copy=True),
                k=flat.index_select(0, keys).transpose(0, 1).to(host),
                v=flat.index_select(0, keys + page).transpose(0, 1).to(host),
                pattern=weights[0, :, q0:q0 + tokens, k0:k0 + length].to(host, copy=True)))


def _rows(table: Sequence[int], length: int, page: int, stride: int) -> torch.Tensor:
    """Pool rows (of the first layer's keys) of logical positions 0 … length-1 through a block table."""
    positions = torch.arange(length)
    return torch.tensor(table, dtype=torch.long)[positions // page] * stride + positions % page


def trace_engine(model: nn.Module, tokenizer: TextTokenizer | None, requests: Sequence[str | Sequence[int]], *,
                 page_size: int, pages: int, max_batch_tokens: int = 256, max_new_tokens: int | Sequence[int] = 16,
                 arrivals: Sequence[int] | None = None, share_prefixes: bool = True,
                 eos_token_id: int | Sequence[int] | None = None,
                 values: bool = True, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 max_steps: int = MAX_ENGINE_STEPS) -> EngineRun:
    """Run ``requests`` through transformers' continuous batching (greedy), one engine step at a time, recording
    the pool and every request's attention.

    ``model``: an ``HFDecoder`` (``load_hf(path, implementation="transformers")``) or a transformers causal LM;
    our own GPT is refused (it cannot take the paged path: the message says why). ``requests``: texts (with a
    ``tokenizer``) or token-id lists. The pool is always sized here: ``pages`` pages of ``page_size`` positions,
    ``max_batch_tokens`` query tokens per engine step; a request that could not fit the pool even alone is
    refused with the numbers. ``arrivals[i]``: the engine step before which request i is handed to the engine
    (default: all at step 0). ``max_new_tokens``: one for all or one per request; ``eos_token_id`` ends a
    request early: one id or several (default: none). ``share_prefixes``: identical full pages of prompts are
    shared (transformers' block sharing). ``values``: keep each request's Q, K, V and pattern per layer, within
    ``budget_bytes``."""
    hf = _transformers_model(model)
    text_config = hf.config.get_text_config()
    vocab = int(getattr(text_config, "vocab_size", 0) or 0) or 1 << 31
    prompts = _prompt_ids(requests, tokenizer, vocab)
    n = len(prompts)
    if not 1 <= n <= MAX_REQUESTS:
        raise EngineError(f"{n} requests: give 1 … {MAX_REQUESTS}")
    arrival = [0] * n if arrivals is None else [int(a) for a in arrivals]
    if len(arrival) != n:
        raise EngineError(f"{len(arrival)} arrivals for {n} requests: give one engine step per request")
    if any(not 0 <= a <= MAX_ARRIVAL for a in arrival):
        raise EngineError(f"arrivals are engine steps 0 … {MAX_ARRIVAL}, got {arrival}")
    new_tokens = [int(max_new_tokens)] * n if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    if len(new_tokens) != n or any(m < 1 for m in new_tokens):
        raise EngineError(f"max_new_tokens: one count ≥ 1, or one per request ({n}), got {max_new_tokens!r}")
    for name, v in (("page_size", page_size), ("pages", pages), ("max_batch_tokens", max_batch_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise EngineError(f"{name} must be a whole number ≥ 1, got {v!r}")
    if budget_bytes < 0:
        raise EngineError(f"budget_bytes must be ≥ 0, got {budget_bytes}")

    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    n_layer = int(text_config.num_hidden_layers)
    G, d_head = int(find_num_key_value_heads(text_config)), int(find_head_dim(text_config))
    itemsize = hf.dtype.itemsize
    bytes_per_page = 2 * n_layer * G * d_head * itemsize * page_size
    if pages * bytes_per_page > MAX_POOL_BYTES:
        raise EngineError(f"a pool of {pages} pages × {bytes_per_page:,} B = {pages * bytes_per_page:,} B is over the "
                          f"{MAX_POOL_BYTES:,} B a traced run may hold: give fewer pages or a smaller page size")
    mask_bytes = max_batch_tokens * (pages * page_size + max_batch_tokens) * itemsize
    if mask_bytes > MAX_MASK_BYTES:
        raise EngineError(f"the packed attention mask would be {max_batch_tokens} × ({pages} × {page_size} + "
                          f"{max_batch_tokens}) positions = {mask_bytes:,} B, over {MAX_MASK_BYTES:,} B: give a "
                          "smaller --max-batch-tokens or fewer pages")
    for i, ((_, ids), m) in enumerate(zip(prompts, new_tokens)):
        need = pages_for(len(ids), m, page_size)
        if need > pages:
            raise EngineError(f"request {i} cannot fit the pool: it needs {need} pages of {page_size} positions "
                              f"({len(ids)} prompt + {m - 1} generated positions kept) and the pool holds {pages}")
    eos = () if eos_token_id is None else (int(eos_token_id),) if isinstance(eos_token_id, int) else tuple(
        int(t) for t in eos_token_id)
    with _RUN_LOCK:
        return _run(hf, prompts, arrival, new_tokens, page_size=page_size, pages=pages,
                    max_batch_tokens=max_batch_tokens, share_prefixes=share_prefixes, eos=eos,
                    values=_Values(budget_bytes) if values else None, budget_bytes=budget_bytes,
                    max_steps=max_steps, dims=(n_layer, G, d_head, bytes_per_page))


def _run(hf: Any, prompts: list[tuple[str | None, list[int]]], arrival: list[int], new_tokens: list[int], *,
         page_size: int, pages: int, max_batch_tokens: int, share_prefixes: bool, eos: tuple[int, ...],
         values: _Values | None, budget_bytes: int, max_steps: int,
         dims: tuple[int, int, int, int]) -> EngineRun:
    from transformers import AttentionInterface, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.requests import RequestStatus
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    n_layer, G, d_head, bytes_per_page = dims
    original_impl = hf.config._attn_implementation
    previous = ALL_ATTENTION_FUNCTIONS[PAGED]
    recorder = _Recorder(previous, values)
    AttentionInterface.register(PAGED, recorder)
    manager = None
    try:
        hf.set_attn_implementation(PAGED)  # the manager then keeps it (it switches only eager and sdpa)
        gc = GenerationConfig(max_new_tokens=max(new_tokens), do_sample=False,
                              eos_token_id=list(eos) if eos else -1)
        cbc = ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=max_batch_tokens, page_size=page_size,
                                       allow_block_sharing=share_prefixes, use_async_batching=False,
                                       use_cuda_graph=False, auto_switch_to_flash=False, max_blocks_per_request=0,
                                       cpu_offload_space=0.0)
        manager = hf.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
        # no public synchronous step in transformers 5.23: the batch processor the background thread would make,
        # driven here one step at a time (see the module's docstring)
        processor = manager._create_batch_processor()
        manager.batch_processor = processor
        cache = processor.cache
        if set(cache.cache_allocators) != {FULL}:
            raise EngineError(f"this model's layers are {', '.join(sorted(cache.cache_allocators))}: the engine trace "
                              "follows full-attention layers only (a sliding window's pages are recycled in a ring "
                              "that a block table does not describe)")
        allocator = cache.cache_allocators[FULL]
        pool = PoolFacts(page_size=page_size, pages=int(allocator.num_blocks), pages_asked=pages,
                         max_batch_tokens=int(cache.max_batch_tokens), bytes_per_page=bytes_per_page,
                         n_layer=n_layer, n_head=int(hf.config.get_text_config().num_attention_heads), n_kv_head=G,
                         head_dim=d_head, dtype=str(hf.dtype).removeprefix("torch."),
                         prefix_sharing=bool(cache.use_prefix_sharing))
        steps = _drive(manager, processor, allocator, recorder, prompts, arrival, new_tokens, n_layer,
                       eos, max_steps, RequestStatus)
    finally:
        AttentionInterface.register(PAGED, previous)
        hf.set_attn_implementation(original_impl)
        if manager is not None:
            manager.batch_processor = None
    step_records, requests = steps
    kept = dict(values.entries) if values is not None else {}
    notes = tuple(values.notes()) if values is not None else ("attention values were not kept (values=False)",)
    return EngineRun(pool, requests, step_records, kept, budget_bytes, notes)


def _drive(manager: Any, processor: Any, allocator: Any, recorder: _Recorder,
           prompts: list[tuple[str | None, list[int]]], arrival: list[int], new_tokens: list[int], n_layer: int,
           eos: tuple[int, ...], max_steps: int,
           RequestStatus: Any) -> tuple[tuple[EngineStep, ...], tuple[EngineRequest, ...]]:
    scheduler, pool = processor.scheduler, processor.cache.pool
    ids = [f"r{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    generated: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, int] = {}
    finished: dict[str, tuple[int, FinishReason]] = {}
    preempted_at: dict[str, list[int]] = {rid: [] for rid in ids}
    prefix_hit: dict[str, int] = {}
    records: list[EngineStep] = []
    last_arrival = max(arrival)
    stalled = 0

    def tables() -> dict[str, tuple[int, ...]]:
        return {rid: tuple(t) for rid, t in allocator.block_table.items() if t}

    def held(ts: dict[str, tuple[int, ...]]) -> set[int]:
        return {p for t in ts.values() for p in t}

    before, cached_before = tables(), set(allocator.ledger.cached_blocks)
    for step in range(max_steps + 1):
        if len(finished) == len(ids):
            break
        if step == max_steps:
            raise EngineError(f"the run did not end within {max_steps} engine steps "
                              f"({len(ids) - len(finished)} requests unfinished)")
        arrived = [rid for rid in ids if arrival[index[rid]] == step]
        for rid in arrived:
            i = index[rid]
            manager.add_request(prompts[i][1], request_id=rid, max_new_tokens=new_tokens[i])
        active_before = set(scheduler.active_requests)
        ran = processor.prepare_next_batch()
        preempted = sorted(rid for rid in active_before
                           if rid not in scheduler.active_requests and rid in scheduler.waiting_requests)
        for rid in preempted:
            preempted_at[rid].append(step)
        if not ran:
            if step < last_arrival or processor.has_pending_requests():
                stalled = 0 if step < last_arrival else stalled + 1
                if stalled > 2:
                    raise EngineError(f"engine step {step}: requests wait but none can be scheduled "
                                      f"({pool.num_free_sectors} free sectors, pool of {allocator.num_blocks} pages)")
                records.append(_step_record(step, [], arrived, [], preempted, before, before, before,
                                            cached_before, cached_before, allocator, pool))
                continue
            break
        stalled = 0
        batch = list(processor.inputs_and_outputs.requests_in_batch)
        mid = tables()
        rows = []
        parts: list[tuple[str, Contribution, int, int, tuple[int, ...], int, bool, int, Any]] = []
        for fs in batch:
            state, rid, tokens = fs.state, fs.state.request_id, int(fs.query_length)
            past = int(state.position_offset) - tokens
            rows.append((rid, past, tokens, _rows(mid[rid], past + tokens, allocator.tokens_per_page,
                                                  allocator.block_physical_stride)))
            # a decode token lies past the tokens the request was (re)admitted with; a prefill chunk within them
            decoding = past >= len(state.initial_tokens)
            hit = past if rid not in active_before and not decoding else 0
            if rid not in first:
                first[rid] = step
                prefix_hit[rid] = hit
            kind: Contribution = "decode" if decoding else "prefill"
            parts.append((rid, kind, past, tokens, mid[rid], hit,
                          bool(preempted_at[rid]) and not decoding, len(state.generated_tokens), state))
        recorder.begin(step, rows)
        processor._generation_step(manager.model)
        missed = sorted(set(range(n_layer)) - recorder.layers_seen)
        if missed:
            raise EngineError(f"the attention of layer(s) {', '.join(map(str, missed))} did not go through "
                              f"transformers' {PAGED} function: this family computes attention its own way, so its "
                              "pages and patterns cannot be read")
        processor.update_batch()
        in_step = []
        ended = []
        for rid, kind, past, tokens, table, hit, recompute, had, state in parts:
            token = state.generated_tokens[-1] if len(state.generated_tokens) > had else None
            if token is not None:
                generated[rid].append(int(token))
            if state.status == RequestStatus.FINISHED:
                reason: FinishReason = "eos" if token in eos else "length"
                finished[rid] = (step, reason)
                ended.append(rid)
            in_step.append(RequestInStep(request_id=rid, contribution=kind, past=past, tokens=tokens,
                                         block_table=table, new_token=None if token is None else int(token),
                                         prefix_hit=hit, recompute=recompute))
        after, cached_after = tables(), set(allocator.ledger.cached_blocks)
        preempted_pages = held({r: before[r] for r in preempted if r in before}) - held(
            {r: t for r, t in before.items() if r not in preempted})
        records.append(_step_record(step, in_step, arrived, ended, preempted, before, mid, after, cached_before,
                                    cached_after, allocator, pool, preempted_pages))
        before, cached_before = after, cached_after
    out = []
    for rid in ids:
        i = index[rid]
        end = finished.get(rid)
        out.append(EngineRequest(
            request_id=rid, prompt=prompts[i][0], prompt_ids=tuple(prompts[i][1]), arrival=arrival[i],
            max_new_tokens=new_tokens[i], generated_ids=tuple(generated[rid]), first_step=first.get(rid),
            finished_step=end[0] if end else None, finish_reason=end[1] if end else None,
            preempted_at=tuple(preempted_at[rid]), prefix_hit_tokens=prefix_hit.get(rid, 0)))
    return tuple(records), tuple(out)


def _step_record(step: int, in_step: list[RequestInStep], arrived: list[str], ended: list[str], preempted: list[str],
                 before: dict[str, tuple[int, ...]], mid: dict[str, tuple[int, ...]],
                 after: dict[str, tuple[int, ...]], cached_before: set[int], cached_after: set[int], allocator: Any,
                 pool: Any, preempted_pages: set[int] | None = None) -> EngineStep:
    def held(ts: dict[str, tuple[int, ...]]) -> set[int]:
        return {p for t in ts.values() for p in t}

    held_before, held_mid, held_after = held(before), held(mid), held(after)
    gone = preempted_pages or set()
    # taken from the free pool: held now, neither held nor cached before (or freed by a preemption and given again)
    allocated = {p for p in held_mid if p not in held_before | cached_before or p in gone}
    # back to the free pool: held or cached before, neither held nor cached after (and preempted pages given again)
    freed = {p for p in held_before | cached_before | held_mid if p not in held_after | cached_after}
    freed |= gone & held_mid
    free = pool.num_free_sectors * allocator.blocks_per_sector + pool.count_free_blocks(allocator.index)
    return EngineStep(
        step=step, requests=tuple(in_step), arrived=tuple(arrived), finished=tuple(ended),
        preempted=tuple(preempted), allocated=tuple(sorted(allocated)), freed=tuple(sorted(freed)),
        cached=tuple(sorted(cached_after)),
        shared=tuple(sorted((int(p), int(c)) for p, c in allocator.ledger.shared_ref_counts.items())),
        tables=tuple(sorted(after.items())), pages_in_use=len(held_after), pages_free=int(free),
        pages_total=int(allocator.num_blocks))
