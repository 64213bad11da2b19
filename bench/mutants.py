"""One-line mutations of the critical paths, each run against the tests that should notice it.

mutmut (docs/testing.md) is not installed everywhere; this needs nothing but pytest. Each mutant is one plausible
one-line bug — a comparison off by one, a term left out, the wrong tensor, an escape dropped — written as an
exact text replacement (the text must occur once in its file). The tree is copied once (without .git) to a
temporary folder; for each mutant the one file is edited there, the mutant's tests run (``pytest -x``: the first
failure kills it), and the file is put back. A mutant whose tests all pass survives; one whose tests run past
``--timeout`` is counted apart (on a loaded machine that is slowness, not a kill).

    python bench/mutants.py                 # every mutant (about 20 min on two shared cores)
    python bench/mutants.py --only spill    # those whose name contains "spill"
    python bench/mutants.py --check         # only check that every replacement applies (no tests run)

Before the mutants, each test selection runs once on the unmutated copy: a selection that fails there would
"kill" everything, so the run stops. Results go to stdout and, as JSON, to bench/results/mutants.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # occurs exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments (files, -k expressions)


# the tests each critical path is watched by (the fastest first: -x stops at the first failure)
ATTENTION = ("tests/model/test_seed_examples.py", "tests/model/test_model_hooks.py",
             "tests/model/test_model_hf_parity.py")
ROPE = ("tests/model/test_model_families.py",)
CACHE = ("tests/tracer/test_tracer_generation.py",)
STORE = ("tests/tracer/test_tracer_capture.py", "tests/tracer/test_spill.py")
SCHEMA = ("tests/tracer/test_schema.py", "tests/tracer/test_tracer_io.py")
LABELS = ("tests/figures/test_figures.py", "-k", "label or inert or escape or stays or crafted")
VERDICT = ("tests/figures/test_figures.py", "-k", "verdict")
HF = ("tests/model/test_hf_decoder.py", "-k", "new_values or logits_equal or views_recompute or architecture_adds")
GRADIENTS = ("tests/tracer/test_gradients.py::test_both_losses_of_a_padded_batch_equal_transformers",
             "tests/tracer/test_gradients.py")
FLASH = ("tests/figures/test_flash.py",)
DIFF = ("tests/tracer/test_tracer_robustness.py", "tests/model/test_hf_decoder.py",
        "-k", "bfloat16 or cache_on_and_off or diff")
SERVER = ("tests/app/test_server_limits.py", "-k", "not real_server")
REPORT = ("tests/package/test_report.py", "-k", "label_a_trace or holds_plotly")

# this round's survivors: the test written for each first (it kills the mutant at once), then the selection
NEW_TESTS = {
    "spill": ("tests/tracer/test_spill.py::"
              "test_a_failed_step_retried_with_the_spill_on_saves_a_file_holding_the_retrys_values"),
    "probs": "tests/tracer/test_tracer_io.py::test_a_probability_outside_0_to_1_is_refused_naming_the_field",
    "hook_v": "tests/model/test_hf_decoder.py::test_the_new_values_are_transformers_own_value_projections_not_the_keys",
    "server": "tests/app/test_server_limits.py::test_the_app_refuses_recording_gradients_past_the_servers_budget",
    "flash": ("tests/figures/test_flash.py::"
              "test_after_each_tile_the_output_is_the_softmax_of_the_keys_read_times_their_values"),
    "kv": "tests/tracer/test_tracer_generation.py::"
          "test_the_bytes_of_cached_keys_and_values_read_are_the_cache_tensors_own_bytes",
    # round 5: the five survivors of round 4 (the first was killed all along, by a test outside its selection)
    "store": "tests/tracer/test_tracer_robustness.py::"
             "test_a_value_evicted_after_it_was_changed_in_place_keeps_no_wrong_statistics",
    "schema": "tests/tracer/test_tracer_io.py::"
              "test_a_stage_whose_probabilities_add_up_to_more_than_1_is_refused_and_rounding_is_not",
    "verdict": "tests/figures/test_figures.py::"
               "test_the_verdict_reports_cached_rows_that_differ_even_when_the_logits_agree",
    "hook_k": ("tests/model/test_hf_decoder.py::"
               "test_the_new_keys_are_the_last_n_rows_of_all_keys_the_ones_the_cache_keeps"),
    "diff": "tests/tracer/test_tracer_robustness.py::"
            "test_diff_traces_flags_nan_in_different_places_and_not_in_the_same_places",
}
GPT, LONG, CACHE_PY = "model/gpt/_gpt.py", "model/gpt/_long_attention.py", "model/gpt/_cache.py"
MUTANTS = (
    # -- attention, masks, RoPE
    Mutant("attention: scores ÷ d_k, not √d_k", GPT, "qk / math.sqrt(d_k) if scale", "qk / d_k if scale", ATTENTION),
    Mutant("attention: softmax over the queries", GPT, "weights = torch.softmax(scores, dim=-1)  # rows",
           "weights = torch.softmax(scores, dim=-2)  # rows", ATTENTION),
    Mutant("attention: soft-cap without ÷ c", GPT, "torch.tanh(scores / softcap) * softcap",
           "torch.tanh(scores) * softcap", HF),
    Mutant("mask: a query sees only earlier keys, not itself", LONG, "ok = k_pos <= q_pos", "ok = k_pos < q_pos",
           ATTENTION),
    Mutant("mask: window one key too wide", LONG, "ok = ok & (k_pos > q_pos - self.window)",
           "ok = ok & (k_pos >= q_pos - self.window)", ATTENTION + ("tests/tracer/test_long_attention.py",)),
    Mutant("mask: padding keys visible", LONG, "ok = ok[None] & kit[:, None, cols.start:cols.stop]",
           "ok = ok[None] | kit[:, None, cols.start:cols.stop]", ATTENTION + CACHE),
    Mutant("RoPE: rotate_half without the sign", GPT, "torch.cat((-x[..., half:], x[..., :half])",
           "torch.cat((x[..., half:], x[..., :half])", ROPE),
    Mutant("RoPE: x·cos − rotate_half(x)·sin", GPT, "return x * cos + rotate_half(x) * sin",
           "return x * cos - rotate_half(x) * sin", ROPE),
    # -- the KV cache
    Mutant("cache: growth copies K into V", CACHE_PY,
           "grown.write(0, buf.keys[:, :, :start], buf.values[:, :, :start])",
           "grown.write(0, buf.keys[:, :, :start], buf.keys[:, :, :start])", CACHE),
    Mutant("cache: commit counts one position", CACHE_PY, "self._length += n", "self._length += 1", CACHE),
    Mutant("cache: values property returns keys", CACHE_PY,
           "return [b.values[:, :, : self._length] if b is not None",
           "return [b.keys[:, :, : self._length] if b is not None", CACHE),
    Mutant("cache: copy keeps every padding flag", CACHE_PY,
           "twin.key_is_token = self.key_is_token[:, :length].clone()",
           "twin.key_is_token = self.key_is_token.clone()", CACHE),
    Mutant("cache: rollback keeps the staged layers", CACHE_PY,
           "        self._staged.clear()\n        self._staged_positions = None\n\n    @property",
           "        self._staged_positions = None\n\n    @property",
           CACHE + ("tests/model/test_hf_decoder.py", "-k", "fails or cache")),
    Mutant("costs: kv bytes with H heads, not G", "model/analysis/_costs.py", "kv_bytes = 2 * La * batch * G * cached",
           "kv_bytes = 2 * La * batch * H * cached", (NEW_TESTS["kv"], *CACHE)),
    # -- the value store, the spill
    Mutant("store: a value of the whole budget evicts", "tracer/storage/_store.py",
           "while self._nbytes + size > self.budget_bytes and (self._entries or self._digests):\n"
           "                self._evict_oldest()\n            self._storages",
           "while self._nbytes + size >= self.budget_bytes and (self._entries or self._digests):\n"
           "                self._evict_oldest()\n            self._storages", STORE),
    Mutant("store: bytes not given back on release", "tracer/storage/_store.py", "            self._nbytes -= key[1]",
           "            pass", STORE),
    Mutant("store: a changed value keeps its statistics", "tracer/storage/_store.py",
           "note, stats = MUTATED, False", "note, stats = note, stats", (NEW_TESTS["store"], *STORE)),
    Mutant("store: the newest evicted first", "tracer/storage/_store.py",
           "plain = next(iter(self._plain), None)",
           "plain = next(reversed(self._plain), None)", STORE),
    Mutant("spill: a failed attempt's values left behind", "tracer/storage/_log.py",
           "                self._spill.forget(index)", "                pass", (NEW_TESTS["spill"], *STORE)),
    Mutant("spill: each value written over the last", "tracer/storage/_spill.py", "self._end += nbytes",
           "self._end = nbytes", STORE),
    # -- trace-file validation
    Mutant("schema: no upper bound", "tracer/files/_schema.py", "not self.lo <= value <= self.hi",
           "not self.lo <= value", SCHEMA),
    Mutant("schema: a probability of 1.5 loads", "tracer/files/_format.py", "prob = Float(0, 1, finite=False)",
           "prob = Float(0, finite=False)", (NEW_TESTS["probs"], *SCHEMA)),
    Mutant("schema: probabilities adding up to 2 load", "tracer/files/_format.py", "if math.fsum(probs) > 1 + 1e-3:",
           "if math.fsum(probs) > 2:", (NEW_TESTS["schema"], *SCHEMA)),
    Mutant("schema: a list one entry over the limit", "tracer/files/_schema.py",
           "if len(value) > self.max_len:\n            raise TraceFileError(f\"{len(value)} entries",
           "if len(value) > self.max_len + 1:\n            raise TraceFileError(f\"{len(value)} entries", SCHEMA),
    # -- escaping and labels
    Mutant("labels: safe_text escapes nothing", "figures/common.py", "return html.escape(label, quote=False)",
           "return label", LABELS),
    Mutant("labels: links not broken", "figures/common.py",
           "unlinked = AUTOLINK.sub(lambda m: m.group(0) + WORD_JOINER, str(text))", "unlinked = str(text)", LABELS),
    Mutant("labels: key label of the position before", "figures/common.py", 'f"{j} · {labels[j]}"',
           'f"{j} · {labels[j - 1]}"', LABELS),
    Mutant("labels: query labels are the first n", "figures/common.py",
           "return keys[len(keys) - positions(trace, step)[0]:]", "return keys[:positions(trace, step)[0]]", LABELS),
    Mutant("labels: scale √d_k, not 1/√d_k", "figures/common.py", "is not None else d_k**-0.5",
           "is not None else d_k**0.5", FLASH),
    Mutant("report: chosen labels unescaped", "figures/report.py",
           'picks = ", ".join(f"<code>{html.escape(label)}</code>', 'picks = ", ".join(f"<code>{label}</code>', REPORT),
    Mutant("report: prompts unescaped", "figures/report.py", "<li><code>{html.escape(facts.info.prompts[r])}</code>",
           "<li><code>{facts.info.prompts[r]}</code>", REPORT),
    # -- the cache verdict
    Mutant("verdict: × fewer the other way round", "figures/cache.py",
           "fewer = c.full.macs / c.cached.macs if", "fewer = c.cached.macs / c.full.macs if", VERDICT),
    Mutant("verdict: cached rows not checked", "figures/cache.py", "if rows and not c.cached_rows_equal:",
           "if False and rows and not c.cached_rows_equal:", (NEW_TESTS["verdict"], *VERDICT)),
    # -- this round's survivors and their neighbours
    Mutant("hf: hook_v holds the keys", "model/sources/_hf_attention.py", "self.hook_v(value[..., end - n:end, :])",
           "self.hook_v(key[..., end - n:end, :])", (NEW_TESTS["hook_v"], *HF)),
    Mutant("hf: hook_k holds the first n rows", "model/sources/_hf_attention.py",
           "self.hook_k(key[..., end - n:end, :])",
           "self.hook_k(key[..., :n, :])", (NEW_TESTS["hook_k"], *HF)),
    Mutant("gradients: −log p at the last column", "tracer/experiments/_gradients.py",
           "logp[r, facts.last_token_column(r, step), choice.tokens[r]]", "logp[r, -1, choice.tokens[r]]", GRADIENTS),
    Mutant("gradients: cross-entropy counts padding", "tracer/experiments/_gradients.py",
           "where = real[r].nonzero()[:, 0]", "where = torch.arange(real.shape[1])", GRADIENTS),
    Mutant("gradients: cross-entropy pairs adjacent columns", "tracer/experiments/_gradients.py",
           "picked.append(logp[r, where[:-1], columns[r, where[1:]]])",
           "picked.append(logp[r, where[:-1], columns[r, where[:-1] + 1]])", GRADIENTS),
    Mutant("server: gradients left out of the budget", "gui/server.py",
           "reserve(this_session(), generation_bytes + file_bytes + gradient_bytes,",
           "reserve(this_session(), generation_bytes + file_bytes,", (NEW_TESTS["server"], *SERVER)),
    Mutant("server: other sessions not counted", "session/server_limits.py",
           "if others + nbytes > limits.budget_bytes:", "if nbytes > limits.budget_bytes:", SERVER),
    Mutant("diff: float32's tolerance for bfloat16", "tracer/experiments/_diff.py", '"bfloat16": (1e-2, 2e-2)',
           '"bfloat16": (1e-5, 1e-4)', DIFF),
    Mutant("diff: NaN in different places not flagged", "tracer/experiments/_diff.py",
           "diverged=mismatch or max_delta > tol)", "diverged=max_delta > tol)", (NEW_TESTS["diff"], *DIFF)),
    Mutant("flash: running output not rescaled", "figures/flash.py", "acc = correction[:, None] * acc + p @ vh",
           "acc = acc + p @ vh", (NEW_TESTS["flash"], *FLASH)),
    Mutant("flash: running sum not rescaled", "figures/flash.py", "l = correction * l + p.sum(dim=-1)",
           "l = l + p.sum(dim=-1)", FLASH),
    Mutant("flash: running max forgets earlier tiles", "figures/flash.py",
           "m_new = torch.maximum(m, s.max(dim=-1).values)", "m_new = s.max(dim=-1).values", FLASH),
    # -- issue 52, round 5: each once left the suite green; the test named beside it reads the behaviour
    Mutant("costs: an embedding reads its whole table", "tracer/costs/_counter.py",
           "gathers = packet in (torch.ops.aten.index, torch.ops.aten.embedding, torch.ops.aten.index_select)",
           "gathers = packet in (torch.ops.aten.index, torch.ops.aten.index_select)",
           ("tests/tracer/test_costs.py", "-k", "totals_equal")),
    Mutant("costs: the cache's copy_ writes nothing", "tracer/costs/_counter.py",
           "if key in in_storages and not inplace:", "if key in in_storages:",
           ("tests/tracer/test_costs.py", "-k", "totals_equal")),
    Mutant("roofline: every dtype at the FP32 peak", "tracer/costs/_roofline.py",
           'return self.peak_flops.get(dtype, self.peak_flops["float32"])', 'return self.peak_flops["float32"]',
           ("tests/tracer/test_costs.py", "-k", "roofline")),
    Mutant("roofline: a step's floor the max of its ops", "tracer/costs/_roofline.py",
           "return StepFloor(accelerator.name, compute + memory,",
           "return StepFloor(accelerator.name, max(f.seconds for f in floors),",
           ("tests/tracer/test_costs.py", "-k", "roofline")),
    Mutant("placement: KV bytes per token without the batch", "tracer/costs/_placement.py",
           "per_layer_token = config.cache_width * itemsize * batch", "per_layer_token = config.cache_width * itemsize",
           ("tests/tracer/test_costs.py", "-k", "accelerate_runs")),
    Mutant("placement: offloaded layers' cache counted where they are kept", "tracer/costs/_placement.py",
           "fits = [free.get(d, 0) // (per_layer_token * n) for d, n in running.items() if n]",
           'fits = [free.get(d, 0) // (per_layer_token * n) for d, n in layers.items() if n and d != "disk"]',
           ("tests/tracer/test_costs.py", "-k", "accelerate_runs")),
    Mutant("tensor parallel: the lm_head kept whole", "model/sources/_tensor_parallel.py",
           '"colwise_gather_output": ("out", "all-gather")', '"colwise_gather_output": ("none", "all-gather")',
           ("tests/model/test_tensor_parallel.py", "-k", "hand_arithmetic")),
    Mutant("meta ops: the key drops the argument's type", "model/sources/_meta_ops.py",
           "out.append((type(value), value))", "out.append(value)",
           ("tests/tracer/test_dry_run.py", "-k", "argument_types")),
    Mutant("meta ops: the key drops the default dtype", "model/sources/_meta_ops.py",
           "parts: list = [func, torch.get_default_dtype()]", "parts: list = [func]",
           ("tests/tracer/test_dry_run.py", "-k", "argument_types")),
    Mutant("long attention: sequence b read with sequence 0's padding", "tracer/reading/_regions.py",
           "_one(src.spec, batch)", "_one(src.spec, 0)", ("tests/tracer/test_long_attention.py", "-k", "read_by_hand")),
    Mutant("long attention: distances without the cached past", "tracer/reading/_regions.py",
           "q_pos = past + torch.arange(rows.start, rows.stop)", "q_pos = torch.arange(rows.start, rows.stop)",
           ("tests/tracer/test_long_attention.py", "-k", "read_by_hand")),
    Mutant("residual: a fixed absolute tolerance", "model/sources/_hf_residual.py", "<= 8 * eps * scale", "<= 8 * eps",
           ("tests/model/test_residual_sums.py", "-k", "scales_its")),
    Mutant("runs: an owner token checked by its prefix", "session/runs.py",
           "return raw if isinstance(raw, str) and RUN_ID.fullmatch(raw) else None",
           "return raw if isinstance(raw, str) and RUN_ID.match(raw) else None",
           ("tests/app/test_runs.py", "-k", "owners_runs")),
    Mutant("hybrid cache: a copy restores the latest state", "model/sources/_hf_cache.py",
           "twin._restore(self._snapshots[length])", "twin._restore(self._save())",
           ("tests/model/test_hf_hybrid.py", "-k", "that_lengths_state")),
    Mutant("hybrid cache: a failed step's state not rolled back", "model/sources/_hf_cache.py",
           "self._restore(self._snapshots[self.length])", "pass",
           ("tests/model/test_hf_hybrid.py", "-k", "that_lengths_state")),
)


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float]:
    """("passed" | "failed" | "timeout", seconds) of ``pytest -x`` over ``tests`` in ``tree``."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0", *tests]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(command, cwd=tree, capture_output=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - started
    return ("passed" if done.returncode == 0 else "failed"), time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutants whose name contains this")
    parser.add_argument("--start", type=int, default=0, help="begin at this mutant of the list (0: the first)")
    parser.add_argument("--first", default="", help="comma-separated name parts: those mutants run first")
    parser.add_argument("--check", action="store_true", help="only check that every replacement applies")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's tests")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip running each selection on the unmutated tree first (when the suite just passed)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "mutants.json"))
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS[args.start:] if args.only in m.name]
    first = [part for part in args.first.split(",") if part]
    chosen.sort(key=lambda m: not any(part in m.name for part in first))  # stable: the list's order otherwise
    for m in chosen:
        found = (ROOT / m.path).read_text(encoding="utf-8").count(m.old)
        if found != 1:
            raise SystemExit(f"{m.name}: {m.old!r} occurs {found} times in {m.path}, not once")
    if args.check:
        print(f"{len(chosen)} mutants, each replacement found once")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        tree = Path(tmp) / "tree"
        # symlinks kept as links: gpt_shape_tracer/model -> ../model must reach the copy being mutated, not a duplicate
        skipped = shutil.ignore_patterns(".git", "__pycache__", ".hypothesis", "mutants", ".ruff_cache", ".mypy_cache",
                                         "results")
        shutil.copytree(ROOT, tree, symlinks=True, ignore=skipped)
        for tests in [] if args.no_baseline else sorted({m.tests for m in chosen}):  # unmutated: all pass
            outcome, seconds = run_tests(tree, tests, args.timeout)
            print(f"baseline {' '.join(tests)}: {outcome} ({seconds:.0f} s)", flush=True)
            if outcome != "passed":
                raise SystemExit("a test selection fails without any mutant: fix that first")
        results = []
        for m in chosen:
            target = tree / m.path
            original = target.read_text(encoding="utf-8")
            target.write_text(original.replace(m.old, m.new), encoding="utf-8")
            try:
                # a test named by its node first, on its own (pytest would fold it back into its file's order)
                quick = [t for t in m.tests if "::" in t][:1]
                outcome, seconds = run_tests(tree, tuple(quick), args.timeout) if quick else ("passed", 0.0)
                if outcome == "passed":
                    rest = tuple(t for t in m.tests if t not in quick)
                    outcome, more = run_tests(tree, rest, args.timeout)
                    seconds += more
            finally:
                target.write_text(original, encoding="utf-8")
            state = {"failed": "killed", "timeout": "timed out", "passed": "SURVIVED"}[outcome]
            results.append({**asdict(m), "result": state, "seconds": round(seconds, 1)})
            print(f"{state:17} {seconds:6.0f} s  {m.name}", flush=True)
            write(args.out, results)  # after each mutant: a run stopped part-way keeps what it found
    killed = sum(r["result"] == "killed" for r in results)
    timed_out = sum(r["result"] == "timed out" for r in results)
    print(f"\n{killed}/{len(results)} killed ({100 * killed / max(1, len(results)):.0f}%), {timed_out} timed out; "
          "machine: "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    return 0


def write(out: str, results: list[dict]) -> None:
    killed = sum(r["result"] == "killed" for r in results)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                     "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                                     "killed": killed, "mutants": len(results), "results": results},
                                    ensure_ascii=False, indent=1), encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
