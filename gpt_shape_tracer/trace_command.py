"""Headless tracing: ``gpt-shape-tracer trace --prompt "…" --steps N [--model NAME | --model-dir DIR] [--out PATH]``.

Writes the trace (a directory, or a .zip when PATH ends in .zip) and prints the
shape table of the chosen step (or, with ``--json``, one JSON object). The arguments are read and checked
before torch is imported (a mistyped option is answered at once, not after seconds of imports); what only
the model can check is checked before it runs. A run of several steps shows its progress on stderr when
stderr is a terminal (not with --quiet).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpt_shape_tracer.session import ModelChoice

from gpt_shape_tracer import beam_command, cache_command, engine_command, speculative_command

# The library's limits and defaults, written here as plain numbers so that the arguments are checked without
# importing torch (which takes seconds). tests/package/test_cli.py checks that each equals the library's own.
MAX_RUN_STEPS = 256  # tracer.MAX_RUN_STEPS
MAX_BATCH = 16  # tracer.MAX_BATCH
FORWARD_CAPTURES = ("shapes", "values", "ops")  # tracer.FORWARD_CAPTURES
DEFAULT_BUDGET_MB = 512.0  # tracer.DEFAULT_BUDGET_BYTES / 2**20
MAX_BUDGET_MB = 8192  # session.MAX_BUDGET_MB
MAX_SPILL_MB = 65536  # session.MAX_SPILL_MB
BUNDLED = ("story-gpt", "story-llama")  # model.BUNDLED_MODELS
TABLE_WIDTH = 120  # the shape table fits a 120-column terminal unless --wide

EXAMPLES = """examples:
  gpt-shape-tracer trace --prompt "Once upon a time" --steps 8 --out trace.zip
  gpt-shape-tracer trace --prompt "Lily had" --prompt "Tom" --model story-llama --json
  gpt-shape-tracer trace --prompt "Hello" --model-dir ~/models/Qwen3-0.6B --dtype bfloat16 --steps 4
  gpt-shape-tracer trace --prompt "Hi" --steps 3 --html report.html --out run.zip"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' lines and writes each option's default after its help; an option off by default
    (a flag, or one whose absence means something) says in its own words what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is False or action.default == argparse.SUPPRESS or action.required or "(default:" in text:
            return text
        if action.default is None:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def _checked_out(raw: str) -> Path:
    """The output path, refused now (not after the whole generation ran) if it cannot be written."""
    # The same nearest-folder-and-probe check as model.sources._load.check_offload's for offload_folder, written again
    # on purpose: this one runs before torch is imported (an argument error in a second, not after 13 s of
    # imports), and everything under model/ imports torch.
    if not raw.strip():
        raise ValueError("--out is empty: give a .zip file or a directory to write the trace to")
    path = Path(raw).expanduser()
    target_dir = path.parent if path.suffix == ".zip" else path
    probe_dir = target_dir
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ValueError(f"--out {raw!r}: {probe_dir} is a file, so nothing can be written below it")
    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir):
            pass
    except OSError as e:
        raise ValueError(f"--out {raw!r}: cannot write in {probe_dir} ({e.strerror})") from None
    if path.exists() and path.is_dir() != (path.suffix != ".zip"):
        raise ValueError(f"--out {raw!r} exists and is {'a directory' if path.is_dir() else 'a file'}")
    return path


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpt-shape-tracer trace", description=__doc__.splitlines()[0],
                                 epilog=EXAMPLES, formatter_class=_HelpFormatter)
    ap.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    ap.add_argument("--steps", type=int, default=1, help=f"generation steps (1…{MAX_RUN_STEPS}); step 0 is the prefill")
    ap.add_argument("--model", default="story-gpt", help=f"a bundled model ({', '.join(BUNDLED)}); see --model-dir")
    ap.add_argument("--model-dir", help="instead of a bundled model: a local Hugging Face directory (GPT-2, Llama, "
                    "Mistral, Qwen2, …), a Hugging "
                    "Face cache folder (models--org--name or its snapshots/<hash>), a repo id org/name already in "
                    "the local cache (nothing is downloaded), or a nanoGPT ckpt.pt (the file or its out_dir)")
    ap.add_argument("--model-factory", metavar="PACKAGE.MODULE:FUNCTION",
                    help="instead of a bundled model, your own module: a function returning the model, or "
                    "(model, tokenizer); imported from "
                    "the Python path and this directory, only from files nobody else can write")
    ap.add_argument("--tokenizer", help="a tokenizer.json (or a directory with one, or vocab.json + merges.txt) "
                    "for --model-dir: needed by a nanoGPT ckpt.pt without one beside it")
    ap.add_argument("--chat", action="store_true",
                    help="wrap each prompt in the model's chat template as a user message (transformers' "
                    "apply_chat_template with add_generation_prompt=True)")
    ap.add_argument("--no-stop-at-eos", action="store_true",
                    help="go on after every sequence has chosen an end-of-sequence token")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="weights and activations of a --model-dir model (default: float32; with --dry-run, the "
                         "config's torch_dtype)")
    ap.add_argument("--dry-run", action="store_true",
                    help="config only, no weights: build the --model-dir model (a directory with config.json, a "
                         "config.json, or shapes:NAME such as shapes:llama-3.1-405b) on the meta device and trace "
                         "its shapes; without a tokenizer the prompt is --dry-run-tokens placeholder ids")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="K",
                    help="with --dry-run: trace one rank of K, split by transformers' own tensor-parallel plan "
                         "(each record's shape on one GPU, and the all-reduces each forward sends)")
    ap.add_argument("--dry-run-tokens", type=int, default=16,
                    help="placeholder prompt ids of a --dry-run without a tokenizer")
    ap.add_argument("--device", default="cpu",
                    help="where the model runs: cpu, cuda or cuda:N (refused with a message where PyTorch sees no "
                    "such device); the trace's values come back to the host")
    ap.add_argument("--max-memory", metavar="SIZE",
                    help="run a --model-dir model larger than SIZE of memory (e.g. 2GiB): transformers runs it and "
                    "accelerate keeps the layers that do not fit on disk, reading them in for each forward")
    ap.add_argument("--out", help="where to write the trace: a directory, or a .zip (default: none, nothing is "
                    "written)")
    ap.add_argument("--capture", choices=FORWARD_CAPTURES, default="values",
                    help="shapes: names, shapes and dtypes only; values: also every tensor's values within the "
                    "budget; ops: also every torch operation inside each module")
    ap.add_argument("--no-cache", action="store_true", help="recompute all positions at every step")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="τ of the sampling softmax; 0 = greedy, as in Python and in the app")
    ap.add_argument("--top-k", type=int, default=None,
                    help="sample among the k most probable tokens (default: off, all of them)")
    ap.add_argument("--top-p", type=float, default=None,
                    help="sample among the fewest tokens whose probability reaches p, 0 < p ≤ 1 (default: off)")
    ap.add_argument("--seed", type=int, default=0, help="the sampler's seed: the same seed chooses the same tokens")
    ap.add_argument("--budget-mb", type=float, default=DEFAULT_BUDGET_MB,
                    help=f"MB of tensor values kept in memory (1…{MAX_BUDGET_MB}); beyond it the oldest values keep "
                    "only their statistics")
    ap.add_argument("--spill-mb", type=float, default=0,
                    help="keep every value: what the budget evicts goes to a private temporary file, up to this "
                    "many MB, and is saved with the trace (0: evicted values keep their statistics)")
    ap.add_argument("--show-step", type=int, default=None,
                    help="the step whose shape table is printed (default: the last)")
    ap.add_argument("--html", metavar="PATH",
                    help="also write a one-file HTML report of the shown step (opens offline)")
    ap.add_argument("--html-run", metavar="PATH",
                    help="also write a one-file HTML report of the whole run: the text, every step's sizes and "
                    "choices, the KV cache and the attention over the steps, every step's next token")
    ap.add_argument("--all-records", action="store_true", help="print inputs/outputs too, not only hook points")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (the run, the texts and the shown step's records) instead of tables")
    ap.add_argument("--wide", action="store_true",
                    help=f"print the shape table's summaries whole (default: cut to fit {TABLE_WIDTH} columns)")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr (it is shown only on a terminal)")
    engine_command.add_arguments(ap)
    beam_command.add_arguments(ap)
    speculative_command.add_arguments(ap)
    cache_command.add_arguments(ap)
    return ap


def check_arguments(args: argparse.Namespace) -> Path | None:
    """What can be checked without the model, checked before torch is imported: a ``ValueError`` naming the
    argument. Returns the output path (None: write no file). The library checks again, with the same rules."""
    for i, text in enumerate(args.prompt):
        which = f"prompt {i + 1}" if len(args.prompt) > 1 else "the prompt"
        if not text.strip():
            raise ValueError(f"--prompt: {which} is empty" if not text else f"--prompt: {which} is only whitespace")
    if len(args.prompt) > MAX_BATCH:
        raise ValueError(f"{len(args.prompt)} prompts: at most {MAX_BATCH} fit in one batch")
    if not 1 <= args.steps <= MAX_RUN_STEPS:
        raise ValueError(f"--steps takes 1 … {MAX_RUN_STEPS}, got {args.steps}")
    if args.show_step is not None and not 0 <= args.show_step < args.steps:
        raise ValueError(f"--show-step must name one of the steps 0 … {args.steps - 1}, got {args.show_step}")
    if not 1 <= args.budget_mb <= MAX_BUDGET_MB:  # also refuses NaN
        raise ValueError(f"the value budget must be between 1 and {MAX_BUDGET_MB} MB, got {args.budget_mb:g}")
    if not 0 <= args.spill_mb <= MAX_SPILL_MB:
        raise ValueError(f"keeping values on disk takes 0 (off) to {MAX_SPILL_MB} MB, got {args.spill_mb:g}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"temperature must be ≥ 0 (0 = greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer or None (0 = off), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {args.top_p}")
    if args.model not in BUNDLED:
        raise ValueError(f"--model {args.model!r}: bundled models are {', '.join(BUNDLED)}")
    if args.tokenizer and not (args.model_dir or args.model_factory):
        raise ValueError("--tokenizer goes with --model-dir or --model-factory (a bundled model has its own)")
    if args.max_memory and not args.model_dir:
        raise ValueError("--max-memory goes with --model-dir (a Hugging Face directory to offload)")
    if args.model_dir and args.model_factory:
        raise ValueError("give --model-dir or --model-factory, not both")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise ValueError(f"--device {args.device!r}: give cpu, cuda or cuda:N")
    if args.device != "cpu" and (args.dry_run or args.max_memory or args.model_factory):
        raise ValueError("--device goes with a bundled model or --model-dir (a dry run runs on the meta device, "
                         "--max-memory places the layers itself, and your own factory places its module)")
    if args.dry_run and not args.model_dir:
        raise ValueError("--dry-run goes with --model-dir (a directory with config.json, a config.json, or "
                         "shapes:NAME)")
    if args.dry_run and args.max_memory:
        raise ValueError("--dry-run builds the model on the meta device: no --max-memory to place it in")
    if args.tensor_parallel != 1 and not args.dry_run:
        raise ValueError("--tensor-parallel goes with --dry-run (one rank's shapes and costs, from the config)")
    if not 1 <= args.tensor_parallel <= 1024:
        raise ValueError(f"--tensor-parallel takes 1 … 1024 ranks, got {args.tensor_parallel}")
    if not 1 <= args.dry_run_tokens <= 1 << 20:
        raise ValueError(f"--dry-run-tokens takes 1 … {1 << 20}, got {args.dry_run_tokens}")
    out = _checked_out(args.out) if args.out is not None else None
    for flag, report in (("--html", args.html), ("--html-run", args.html_run)):
        if report is not None:
            _check_report_path(flag, report, out)
    if args.html is not None and args.html_run is not None and \
            Path(args.html).expanduser().resolve() == Path(args.html_run).expanduser().resolve():
        raise ValueError(f"--html and --html-run name one file ({args.html!r}): the second report would overwrite "
                         "the first")
    return out


def _check_device(device: str) -> None:
    """A CUDA device that PyTorch can see, or a ``ValueError`` saying what it sees (after torch is imported)."""
    import torch

    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: PyTorch sees no CUDA device on this machine (torch {torch.__version__}"
                         f"{', a CPU-only build' if torch.version.cuda is None else ''}): use --device cpu")
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: PyTorch sees {torch.cuda.device_count()} CUDA device(s), 0 … "
                         f"{torch.cuda.device_count() - 1}")


def model_choice(args: argparse.Namespace) -> ModelChoice:
    """The model the arguments name, as the app names one (``session.ModelChoice``: checked as the app checks it;
    imports torch)."""
    from gpt_shape_tracer.session import ModelChoice, gib_of

    if args.model_factory:
        return ModelChoice("factory", args.model_factory, tokenizer=args.tokenizer or "")
    if args.model_dir:
        memory = gib_of(args.max_memory, "--max-memory") if args.max_memory else 0.0
        return ModelChoice("directory", args.model_dir, dtype=args.dtype, memory_gib=memory, device=args.device,
                           tokenizer=args.tokenizer or "", dry_run=args.dry_run, tensor_parallel=args.tensor_parallel)
    return ModelChoice("bundled", args.model, device=args.device)


def _check_report_path(flag: str, raw: str, out: Path | None) -> None:
    path = Path(raw).expanduser()
    if out is not None and path.resolve() == out.resolve():
        raise ValueError(f"{flag} {raw!r} is the path of --out: the report would overwrite the trace")
    if out is not None and out.suffix != ".zip" and out.resolve() in path.resolve().parents:
        raise ValueError(f"{flag} {raw!r} is inside the trace directory --out {str(out)!r}: the report would "
                         "overwrite or join the trace's own files")
    if path.is_dir():
        raise ValueError(f"{flag} {raw!r} is a directory: give the report's file name")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {raw!r}: the directory {path.parent} does not exist")


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        out = check_arguments(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if engine_command.wanted(args):  # --continuous-batching: gpt_shape_tracer/engine_command.py
        return engine_command.main(args)
    if speculative_command.wanted(args):  # --assistant-model, --prompt-lookup: gpt_shape_tracer/speculative_command.py
        from gpt_shape_tracer.session import load

        return speculative_command.main(args, lambda: load(model_choice(args)))
    if cache_command.wanted(args):  # --cache: gpt_shape_tracer/cache_command.py
        return cache_command.main(args)
    if beam_command.wanted(args):  # --num-beams: gpt_shape_tracer/beam_command.py
        from gpt_shape_tracer.session import load

        return beam_command.main(args, lambda: load(model_choice(args)))

    from gpt_shape_tracer.session.memory import reuse_freed_memory

    reuse_freed_memory()  # a long prompt frees gigabytes: keep them for the next tensors (session/memory.py)
    import pandas as pd

    from gpt_shape_tracer.model import ModelLoadError, SamplingError
    from gpt_shape_tracer.model.sources import OwnModuleError
    from gpt_shape_tracer.session import build_settings, load, new_generation
    from gpt_shape_tracer.tracer import save_trace

    try:
        _check_device(args.device)
        settings = build_settings(  # the app's rules, limits and defaults
            tuple(args.prompt), greedy=args.temperature == 0, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache, capture=args.capture,
            padding_side="left", budget_mb=args.budget_mb, chat=args.chat, stop_at_eos=not args.no_stop_at_eos,
            spill_mb=args.spill_mb)
        model, tokenizer = load(model_choice(args))  # the app's one loader
        if args.dry_run:
            from gpt_shape_tracer.session import caches
            from gpt_shape_tracer.tracer import prepare_dry_run

            if tokenizer is None and not args.quiet:
                print(f"note: {args.model_dir} has no tokenizer: the prompt is {args.dry_run_tokens} placeholder ids",
                      file=sys.stderr)
            gen = prepare_dry_run(model, tokenizer, args.prompt[0] if tokenizer is not None else None,
                                  n=args.dry_run_tokens, steps=args.steps - 1, batch=len(args.prompt),
                                  use_cache=not args.no_cache and caches(model))  # OpenAI GPT keeps none
        elif tokenizer is None and args.model_factory:
            raise ValueError(f"{args.model_factory} returned no tokenizer: return (model, tokenizer), or give "
                             "--tokenizer")
        elif tokenizer is None:
            raise ValueError(f"{args.model_dir} has no tokenizer (tokenizer.json or vocab.json + merges.txt): "
                             "give one with --tokenizer")
        else:
            gen = new_generation(model, tokenizer, settings)  # the chat template and a module without a cache, too
        for warning in gen.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        progress = _progress(args.steps, quiet=args.quiet)
        if args.dry_run:
            from gpt_shape_tracer.tracer import no_cyclic_collection

            with no_cyclic_collection():  # as tracer.dry_run runs its steps
                done = gen.run(args.steps, on_step=progress)
        else:
            done = gen.run(args.steps, on_step=progress)
        if progress is not None and done < args.steps:  # stopped early: end the progress line
            print(file=sys.stderr)
    except (ModelLoadError, OwnModuleError, SamplingError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if gen.stopped or done < args.steps:
        print(f"note: stopped after {gen.n_steps} step(s): {gen.stopped or 'the context is full'}", file=sys.stderr)
    if out is not None:
        try:
            save_trace(gen.trace, out)  # refuses, before writing, a trace load_trace would not read back
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            gen.close()
            return 2
    if args.html:
        from gpt_shape_tracer.figures.report import report_html

        shown_step = args.show_step if args.show_step is not None else gen.n_steps - 1
        Path(args.html).write_text(report_html(gen.trace, shown_step), encoding="utf-8")
        print(f"wrote {args.html}: a report of step {shown_step}", file=sys.stderr if args.json else sys.stdout)
    if args.html_run:
        from gpt_shape_tracer.figures.report import run_report_html

        Path(args.html_run).write_text(run_report_html(gen.trace), encoding="utf-8")
        print(f"wrote {args.html_run}: a report of the {gen.n_steps} steps",
              file=sys.stderr if args.json else sys.stdout)
    gen.close()

    step = min(args.show_step if args.show_step is not None else gen.n_steps - 1, gen.n_steps - 1)
    frame = gen.trace.to_frame(step=step, kind=None if args.all_records else "hook")
    shown = frame[["name", "shape", "axes", "dtype", "summary"]].copy()
    shown["shape"] = ["[" + ", ".join(map(str, s)) + "]" for s in shown["shape"]]
    forward = gen.facts.step(step).forward
    prompt = getattr(model.config, "prompt_positions", 0)  # CPM-Ant: every forward runs them before the tokens
    plan = getattr(model, "tensor_parallel", None)
    parallel = None
    if plan is not None:
        from gpt_shape_tracer.tracer import collectives, collectives_sentence

        sent = collectives(gen.trace, step, plan)
        parallel = {"ranks": plan.ranks, "plan": plan.source, "sentence": collectives_sentence(plan, sent),
                    "collectives": [{"module": c.module, "kind": c.kind, "shape": list(c.shape), "bytes": c.bytes}
                                    for c in sent]}
    if args.json:
        print(json.dumps({
            "out": str(out) if out is not None else None, "steps": gen.n_steps, "stopped": gen.stopped or None,
            "records": len(gen.trace.records), "bytes_kept": gen.trace.bytes_kept,
            "texts": [gen.text(row) for row in range(gen.batch_size)],
            "shown_step": {"step": step, "n": forward.n, "t": forward.t, "prompt_positions": prompt,
                           "records": [{"name": r.name, "shape": list(r.shape), "axes": list(r.axes or ()),
                                        "dtype": r.dtype} for r in gen.trace.filter(
                                            step=step, kind=None if args.all_records else "hook")]},
            **({"tensor_parallel": parallel} if parallel is not None else {}),
        }, ensure_ascii=False))
        return 0
    print(f"step {step}: n = {forward.n}, t = {forward.t}" + (f", after the model's {prompt} learned prompt positions "
                                                              f"(its records hold P + n = {prompt + forward.n} rows)"
                                                              if prompt else ""))
    print(_table(shown, wide=args.wide, pd=pd))
    if parallel is not None:
        print(parallel["sentence"])
    for row in range(gen.batch_size):
        print(f"text[{row}]: {gen.text(row)!r}")
    written = f"wrote {out}" if out is not None else "nothing written (no --out)"
    print(f"{written}: {gen.n_steps} steps, {len(gen.trace.records)} records, {gen.trace.bytes_kept} bytes of values")
    return 0


def _progress(total: int, quiet: bool):
    """``on_step`` for ``TracedGeneration.run``: "step k of N" rewritten in place on stderr, only where a person
    watches it (a terminal) and only for a run of several steps; None otherwise."""
    if quiet or total < 2 or not sys.stderr.isatty():
        return None

    def show(done: int) -> bool:
        sys.stderr.write(f"\rstep {done} of {total}" + ("\n" if done == total else ""))
        sys.stderr.flush()
        return True

    return show


def _table(shown, wide: bool, pd) -> str:
    """The shape table as text: within ``TABLE_WIDTH`` columns, the summary column cut with "…" to what is left
    (every other column is short); ``wide``: every summary whole."""
    if wide:
        with pd.option_context("display.max_rows", None, "display.max_colwidth", None, "display.width", None):
            return shown.to_string(index=False)
    shown = shown.copy()
    # the summary opens with the shape and dtype again ("tensor[1, 4, 1, 6] f32 n=24 …"): the columns say them
    shown["summary"] = shown["summary"].astype(str).str.replace(r"^tensor\[[^\]]*\] \S+ ", "", regex=True)
    others = [c for c in shown.columns if c != "summary"]
    used = sum(max(len(c), int(shown[c].astype(str).str.len().max() or 0)) + 2 for c in others)
    room = max(12, TABLE_WIDTH - used - 2)
    shown["summary"] = [text if len(text) <= room else textwrap.shorten(text, room, placeholder=" …")
                        if " " in text[:room] else text[:room - 1] + "…" for text in shown["summary"].astype(str)]
    with pd.option_context("display.max_rows", None, "display.max_colwidth", None, "display.width", None):
        return shown.to_string(index=False, justify="left")
