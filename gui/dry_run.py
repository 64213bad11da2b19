"""The "Config only (no weights)" source: a model built from its config.json alone on the meta device
(model.sources), traced for a prefill and a few decode steps with every op's cost counted (tracer.costs), and
shown as its shapes, its KV cache's growth, its costs, its time floor on each accelerator of the table and where
accelerate would place it. Every number shown is computed from the dry run; every sentence with a number comes
from a function of those numbers."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import streamlit as st

from gpt_shape_tracer.figures.common import positions
from gpt_shape_tracer.figures.flow import shape_flow_figure
from gpt_shape_tracer.gui.common import diagram, plain
from gpt_shape_tracer.model import GPT, HFDecoder, ModelLoadError
from gpt_shape_tracer.model.sources import parameters_by_dtype, shapes_available
from gpt_shape_tracer.session import ModelChoice, load, no_cache_reason
from gpt_shape_tracer.tracer import (
    ACCELERATORS,
    StepCosts,
    Trace,
    collectives,
    collectives_sentence,
    costed_dry_run,
    costs_frame,
    kv_cache_bytes,
    latent_cache,
    place,
    step_floor,
)

LABEL = "Config only (no weights)"
RESULT = "dry_run_result"  # st.session_state key: this session's dry run
MAX_PROMPT_TOKENS = 32768
MAX_DECODE_STEPS = 16


@dataclass
class DryRun:
    name: str
    model: GPT | HFDecoder  # the meta model (kept for accelerate's placement: it holds no weights)
    trace: Trace
    costs: list[StepCosts]
    parameters: dict[str, int]
    dtype: str
    cache_note: str
    ranks: int = 1


def dry_run_sidebar(sb) -> None:
    """The source's inputs and its button (the result is this session's, in ``st.session_state``)."""
    shipped = list(shapes_available())
    choice = sb.selectbox("Shipped shape config", shipped, key="dry_shapes",
                          index=shipped.index("llama-3.1-8b") if "llama-3.1-8b" in shipped else 0,
                          help="config.json files written from the published hyperparameters (assets/shapes/README.md "
                               "cites each number); or give your own below")
    path = sb.text_input("…or a config.json, or a directory holding one", key="dry_path",
                         placeholder="/path/to/config.json, a directory, or org/name in the local cache")
    cols = sb.columns(2)
    n = cols[0].number_input("Prompt tokens", value=512, min_value=1, max_value=MAX_PROMPT_TOKENS, key="dry_tokens")
    steps = cols[1].number_input("Decode steps", value=2, min_value=0, max_value=MAX_DECODE_STEPS, key="dry_steps")
    ranks = sb.number_input("Tensor-parallel ranks", value=1, min_value=1, max_value=1024, key="dry_ranks",
                            help="trace one GPU's share of the model, split as transformers' own tensor-parallel "
                                 "plan splits it (1: the whole model)")
    if sb.button("Trace shapes", key="dry_trace", type="primary"):
        spec = path.strip() or f"shapes:{choice}"
        with st.spinner(f"building {spec} on the meta device and tracing {int(n)} tokens + {int(steps)} step(s)"):
            st.session_state[RESULT] = run_dry(spec, int(n), int(steps), int(ranks))


def run_dry(spec: str, n: int, steps: int, ranks: int = 1) -> DryRun | str:
    """The dry run of ``spec`` (one rank of ``ranks``), or the reason it could not be made (shown as an error)."""
    try:
        model, _ = load(ModelChoice("directory", spec, dry_run=True, tensor_parallel=ranks))
        assert isinstance(model, (GPT, HFDecoder))  # a dry run builds ours or transformers' decoder, never a module
        n = min(n, model.config.n_ctx - 1 - steps)
        reason = no_cache_reason(model)  # OpenAI GPT keeps no cache: every step a full forward, as it runs
        gen, costs = costed_dry_run(model, n=n, steps=steps, use_cache=reason is None)
    except (ModelLoadError, ValueError, RuntimeError, OSError) as e:
        return f"Could not build a dry run of {plain(spec)}: {plain(e)}"
    note = ("This model uses multi-head latent attention: its cache holds the compressed latent c_KV and the rotary "
            "key k_R of every position, and K and V are expanded from them at every step."
            if latent_cache(model) else f"{reason[:1].upper()}{reason[1:]}: every step of this dry run is a full "
            "forward over all positions." if reason else "")
    dtype = next(iter(parameters_by_dtype(model)), "float32")
    return DryRun(model.identity.name, model, gen.trace, costs, parameters_by_dtype(model), dtype, note, ranks)


def dry_run_page() -> None:
    result: DryRun | str | None = st.session_state.get(RESULT)  # run_dry's
    if result is None:
        st.info("Choose a shape config (or a config.json) in the sidebar and press **Trace shapes**: the model is "
                "built on the meta device — no weights, no memory — and its prefill and decode steps are traced, "
                "every op's cost counted.")
        return
    if isinstance(result, str):
        st.error(result)
        return
    trace = result.trace
    plan = getattr(result.model, "tensor_parallel", None)
    st.subheader(f"{result.name}: a dry run" + (f", one rank of {result.ranks}" if plan is not None else ""))
    share = " (this rank's share)" if plan is not None else ""
    st.caption(describe_parameters(result.parameters)[:-1] + share + ". No values exist in a dry run: every shape, "
               "dtype and cost below is what the real run would have, and no view shows a number of a tensor.")
    if result.cache_note:
        st.warning(result.cache_note)
    step = st.select_slider("Step", options=list(range(trace.n_steps)), value=0, key="dry_step",
                            format_func=lambda s: f"{s} (prefill)" if s == 0 else str(s))
    tabs = st.tabs(["Shapes", "KV cache", "Costs", "Where it would run"])
    with tabs[0]:
        n_layer = result.model.config.n_layer
        layer = st.number_input("Layer", value=0, min_value=0, max_value=n_layer - 1, key="dry_layer",
                                help="the shape flow of one block (every block has the same shapes)")
        diagram(shape_flow_figure(trace, step, int(layer)), key="dry-flow")
        frame = trace.to_frame(step=step, kind="hook", stats=False)
        shown = frame[["name", "shape", "axes", "dtype", "summary"]].copy()
        shown["shape"] = ["[" + ", ".join(map(str, s)) + "]" for s in shown["shape"]]
        st.dataframe(shown, hide_index=True, width="stretch")
    with tabs[1]:
        st.markdown("**What grows with n**: per step, the positions fed (n), the keys attended over (t), the cache's "
                    "bytes after the step, the multiply-adds and the weight bytes read.")
        st.dataframe(growth_frame(result), hide_index=True, width="stretch")
        st.caption(describe_cache(result, step))
    with tabs[2]:
        costs = result.costs[step]
        st.caption(describe_costs(costs))
        if plan is not None:
            st.markdown(collectives_sentence(plan, collectives(trace, step, plan)))
        st.dataframe(costs_frame(costs).sort_values("multiply-adds", ascending=False), hide_index=True,
                     width="stretch")
    with tabs[3]:
        costs = result.costs[step]
        for acc in ACCELERATORS.values():
            st.markdown("- " + step_floor(costs.ops, acc, result.dtype).describe())
        st.caption("Sources: " + " · ".join(f"{a.name}: {a.source}" for a in ACCELERATORS.values()))
        gpus = st.number_input("GPUs", value=2, min_value=0, max_value=64, key="dry_gpus")
        gib = st.number_input("GiB per GPU", value=80.0, min_value=1.0, key="dry_gib")
        cpu = st.number_input("CPU GiB", value=200.0, min_value=0.0, key="dry_cpu")
        memory: dict[int | str, str] = {i: f"{gib}GiB" for i in range(int(gpus))}
        if cpu:
            memory["cpu"] = f"{cpu}GiB"
        if memory:
            try:
                st.markdown(place(result.model, memory).describe())
            except (ValueError, RuntimeError) as e:
                st.error(f"accelerate could not place it: {plain(e)}")


def describe_parameters(by_dtype: dict[str, int]) -> str:
    parts = ", ".join(f"{n / 1e9:,.2f}B in {dtype}" for dtype, n in by_dtype.items())
    return f"Parameters: {parts}."


def growth_frame(result: DryRun) -> pd.DataFrame:
    rows = []
    facts = result.trace.generation.steps if result.trace.generation else ()
    for s, (costs, _) in enumerate(zip(result.costs, facts)):
        n, t = positions(result.trace, s)  # CPM-Ant: with its learned prompt positions, which every step runs
        rows.append({"step": s, "n": n, "t": t,
                     "KV cache bytes": kv_cache_bytes(result.trace, s), "multiply-adds": costs.macs,
                     "weight bytes read": costs.weight_bytes, "peak activation bytes": costs.peak_activation_bytes})
    return pd.DataFrame(rows)


def describe_cache(result: DryRun, step: int) -> str:
    held = kv_cache_bytes(result.trace, step)
    if not held:
        return f"Step {step} keeps no KV cache."
    return f"After step {step} the KV cache holds {held:,} bytes ({held / 2**20:,.1f} MiB)."


def describe_costs(costs: StepCosts) -> str:
    return (f"Step {costs.step}: {costs.macs:,} multiply-adds in {len(costs.ops):,} ops, {costs.weight_bytes:,} "
            f"bytes of weights read, {costs.written_bytes:,} bytes written, at most "
            f"{costs.peak_activation_bytes:,} bytes of activations alive at once.")
