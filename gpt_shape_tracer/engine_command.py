"""``gpt-shape-tracer trace --continuous-batching``: several prompts through transformers' continuous batching, one
engine step at a time (``tracer.engine.trace_engine``): per step, the requests in it and what each brings, the
pages allocated and freed, the pool's occupancy, shared pages and preemptions; per request, its tokens and the
engine steps it arrived and finished at. The options are read and checked before torch is imported."""

from __future__ import annotations

import argparse
import json
import sys

from gpt_shape_tracer.path_checks import load_through_transformers

MAX_REQUESTS = 64  # tracer.engine.MAX_REQUESTS
DEFAULT_MAX_BATCH_TOKENS = 256  # trace_engine's default
ENGINE_FLAGS = ("page_size", "pages", "max_batch_tokens", "arrivals")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The engine's options, added to the trace command's parser."""
    ap.add_argument("--continuous-batching", action="store_true",
                    help="run the prompts as requests through transformers' continuous batching (a paged KV cache), "
                         "one engine step at a time; --steps is then the tokens each request generates")
    ap.add_argument("--page-size", type=int, help="with --continuous-batching: token positions per page")
    ap.add_argument("--pages", type=int, help="with --continuous-batching: pages in the pool (always sized)")
    ap.add_argument("--max-batch-tokens", type=int,
                    help=f"with --continuous-batching: query tokens per engine step (default: "
                         f"{DEFAULT_MAX_BATCH_TOKENS})")
    ap.add_argument("--arrivals", help="with --continuous-batching: the engine step each prompt arrives at, "
                                       "comma-separated (0,0,3); default: all at step 0")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the engine path is asked for (its flag, or any of its options)."""
    return bool(args.continuous_batching) or any(getattr(args, f) is not None for f in ENGINE_FLAGS)


def check(args: argparse.Namespace) -> list[int]:
    """The engine options checked without torch: a ``ValueError`` naming the option. Returns the arrivals."""
    if not args.continuous_batching:
        given = [f"--{f.replace('_', '-')}" for f in ENGINE_FLAGS if getattr(args, f) is not None]
        raise ValueError(f"{', '.join(given)} go(es) with --continuous-batching")
    if args.page_size is None or args.pages is None:
        raise ValueError("--continuous-batching needs --page-size and --pages: the pool is always sized")
    for flag, value in (("--page-size", args.page_size), ("--pages", args.pages),
                        ("--max-batch-tokens", args.max_batch_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} takes a whole number ≥ 1, got {value}")
    if len(args.prompt) > MAX_REQUESTS:
        raise ValueError(f"{len(args.prompt)} prompts: at most {MAX_REQUESTS} requests")
    for flag, given in (("--dry-run", args.dry_run), ("--model-factory", args.model_factory), ("--html", args.html),
                        ("--html-run", args.html_run), ("--chat", args.chat), ("--no-cache", args.no_cache),
                        ("--max-memory", args.max_memory)):
        if given:
            raise ValueError(f"{flag} does not go with --continuous-batching")
    if args.temperature != 0 or args.top_k or args.top_p is not None:
        raise ValueError("--continuous-batching is traced greedy: no --temperature, --top-k or --top-p")
    if args.out is not None and not args.out.endswith(".zip"):
        raise ValueError("--out with --continuous-batching writes an engine run: give a .zip")
    if args.arrivals is None:
        return [0] * len(args.prompt)
    try:
        arrivals = [int(x) for x in args.arrivals.split(",")]
    except ValueError:
        raise ValueError(f"--arrivals {args.arrivals!r}: give whole engine steps separated by commas (0,0,3)") from None
    if len(arrivals) != len(args.prompt):
        raise ValueError(f"--arrivals gives {len(arrivals)} steps for {len(args.prompt)} prompts: one per --prompt")
    if any(a < 0 for a in arrivals):
        raise ValueError(f"--arrivals: engine steps are ≥ 0, got {args.arrivals}")
    return arrivals


def main(args: argparse.Namespace) -> int:
    """The engine path of ``gpt-shape-tracer trace``: 0, or 2 with the reason on stderr."""
    try:
        arrivals = check(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from gpt_shape_tracer.model import ModelLoadError
    from gpt_shape_tracer.tracer import DEFAULT_BUDGET_BYTES, EngineError, save_engine_run, trace_engine

    try:
        model, tokenizer = load_through_transformers(args)
        run = trace_engine(model, tokenizer, args.prompt, page_size=args.page_size, pages=args.pages,
                           max_batch_tokens=args.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS,
                           max_new_tokens=args.steps, arrivals=arrivals,
                           eos_token_id=None if args.no_stop_at_eos else tuple(tokenizer.eos_ids),
                           budget_bytes=int(args.budget_mb * 2**20) if args.budget_mb else DEFAULT_BUDGET_BYTES)
        if args.out is not None:
            save_engine_run(run, args.out)
    except (ModelLoadError, EngineError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    requests = [{"request_id": r.request_id, "prompt": r.prompt, "prompt_ids": list(r.prompt_ids),
                 "generated_ids": list(r.generated_ids), "text": tokenizer.decode(list(r.generated_ids)),
                 "arrived_step": r.arrival, "first_step": r.first_step, "finished_step": r.finished_step,
                 "finish_reason": r.finish_reason, "preempted_at": list(r.preempted_at),
                 "prefix_hit_tokens": r.prefix_hit_tokens} for r in run.requests]
    steps = [{"step": s.step, "requests": [[p.request_id, p.contribution, p.past, p.tokens] for p in s.requests],
              "allocated": list(s.allocated), "freed": list(s.freed), "pages_in_use": s.pages_in_use,
              "pages_free": s.pages_free, "shared": [list(x) for x in s.shared], "preempted": list(s.preempted)}
             for s in run.steps]
    pool = {"pages": run.pool.pages, "page_size": run.pool.page_size, "max_batch_tokens": run.pool.max_batch_tokens,
            "bytes_per_page": run.pool.bytes_per_page, "prefix_sharing": run.pool.prefix_sharing}
    if args.json:
        print(json.dumps({"out": args.out, "pool": pool, "engine_steps": len(run.steps), "requests": requests,
                          "steps": steps, "bytes_kept": run.bytes_kept, "notes": list(run.notes)},
                         ensure_ascii=False))
        return 0
    print(f"pool: {run.pool.pages} pages × {run.pool.page_size} positions ({run.pool.pool_bytes:,} B), "
          f"{run.pool.max_batch_tokens} tokens per engine step")
    for s in run.steps:
        parts = " ".join(f"{p.request_id}:{p.contribution}[{p.past}+{p.tokens}]" for p in s.requests) or "idle"
        extra = f" preempted {', '.join(s.preempted)}" if s.preempted else ""
        print(f"step {s.step}: {parts} | +{len(s.allocated)} -{len(s.freed)} pages, {s.pages_in_use} held, "
              f"{len(s.shared)} shared, {s.pages_free} free{extra}")
    for r in requests:
        print(f"{r['request_id']} (arrived {r['arrived_step']}, finished {r['finished_step']}): {r['text']!r}")
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0
