"""A step of a trace, or a whole run, as one HTML file that opens offline in any browser:
``report_html(trace, step)``, ``run_report_html(trace)``.

For a colleague with nothing installed: the model and the text, the shape flow, the attention stages of the
chosen heads, every head at once, the causal mask, the KV cache over the steps, the next-token distribution
and the table of every hook point — the app's own figures (pooled as in the app, so the size stays bounded
by the views, not the context), with plotly.js written into the file once. Every text the model, a prompt or
a file wrote is escaped: nothing in it can run.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from gpt_shape_tracer.figures import attention, cache, flow, mask, tokens
from gpt_shape_tracer.figures.common import (
    attention_layers,
    bidirectional,
    facts_of,
    no_attention,
    positions,
    prompt_sentence,
)
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import Trace, pattern_digest

STYLE = ("body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#1a1a1a}"
         "h1{font-size:1.6em}h2{font-size:1.2em;margin-top:2em}table{border-collapse:collapse;font-size:.85em}"
         "td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}code{font-size:.95em}.note{color:#666}")


def report_html(trace: Trace, step: int | None = None, heads: tuple[tuple[int, int], ...] = ((0, 0),),
                batch: int = 0) -> str:
    """The report of ``step`` (default: the last) for the (layer, head) pairs in ``heads``, sequence ``batch``."""
    facts = facts_of(trace)
    step = trace.n_steps - 1 if step is None else step
    if not 0 <= step < trace.n_steps:
        raise ValueError(f"the trace has steps 0…{trace.n_steps - 1}, not {step}")
    config = trace.config
    for layer, head in heads if config is not None else ():
        if not (0 <= layer < config.n_layer and 0 <= head < config.n_head):
            raise ValueError(f"(layer {layer}, head {head}) is outside layers 0 … {config.n_layer - 1}, heads 0 … "
                             f"{config.n_head - 1}")
    rows = trace.record("hook_logits", step).shape[0] if trace.has("hook_logits", step) else None
    if rows is not None and not 0 <= batch < rows:
        raise ValueError(f"batch {batch} is outside 0 … {rows - 1}")
    sections: list[tuple[str, go.Figure | None, str]] = [
        ("The shapes, stage by stage (block 0)", flow.shape_flow_figure(trace, step, 0), "")]
    for layer, head in heads:
        said = no_attention(trace, layer)  # a state layer (a hybrid's, or every layer of Mamba): no stages to draw
        sections.append((f"Attention, layer {layer} head {head}: QKᵀ, scaled, + M, softmax",
                         None if said else attention.attention_stages_figure(trace, step, layer, head, batch),
                         said[0].upper() + said[1:] + "." if said else ""))
    attending = attention_layers(trace)
    if attending:
        first = act_name("pattern", attending[0])  # a hybrid model's layer 0 may have no attention
        grid = attention.all_heads_figure(trace, step, batch) if trace.get(first, step) is not None \
            or pattern_digest(trace, trace.record(first, step)) is not None else None
        sections.append(("Every head at once", grid.figure if grid is not None else None, grid.note if grid else
                         "The attention patterns of this step were not kept (capture shapes, or evicted)."))
        sections.append(("The mask M" if bidirectional(trace) else "The causal mask M",  # CPM-Ant's is not causal
                         mask.mask_figure(trace, step, attending[0], batch),
                         mask.mask_facts(trace, step, attending[0], batch).explanation()))
    else:  # a state-space model (Mamba): said once, instead of an empty grid and mask
        sections.append(("Every head at once and the causal mask M", None, "No layer of this model has softmax "
                         "attention (every layer keeps a fixed-size state): there are no heads, patterns or mask."))
    sections.append(("The KV cache over the steps", cache.cache_steps_figure(trace, step), ""))
    if facts.step(step).sampling is not None:
        sections.append(("The next token", tokens.next_token_figure(trace, step, batch),
                         facts.info.sampling.describe()))
    n, t = positions(trace, step)  # CPM-Ant's learned prompt positions included
    prompt = prompt_sentence(trace, step)
    header = (f"<h1>Step {step} of {trace.n_steps}</h1>{_who(trace)}<p>n = {n} new position(s), "
              f"t = {t} key position(s); capture {trace.capture}.</p>"
              + (f"<p>{html.escape(prompt)}</p>" if prompt else ""))
    return _page(f"step {step}", header, sections, "<h2>Every hook point of this step</h2>" + trace.html_table(step))


def run_report_html(trace: Trace, heads: tuple[tuple[int, int], ...] = ((0, 0),), batch: int = 0) -> str:
    """The whole run: the text with each chosen token's probability, every step's sizes and choices in one
    table, the KV cache over the steps, the attention of the chosen heads row by row over the steps (with the
    cache), the shape flow of the prefill and the next-token distribution of every step."""
    facts = facts_of(trace)
    if not trace.n_steps:
        raise ValueError("the trace has no step to report")
    last = trace.n_steps - 1
    sections: list[tuple[str, go.Figure | None, str]] = [
        ("The KV cache over the steps", cache.cache_steps_figure(trace, last), "")]
    for layer, h in heads:
        said = no_attention(trace, layer)
        if said:  # a state layer: no attention rows to follow over the steps
            sections.append((f"Attention over the steps, layer {layer} head {h}", None,
                             said[0].upper() + said[1:] + "."))
        elif facts.info.use_cache:
            sections.append((f"Attention over the steps, layer {layer} head {h}: one new row per step",
                             attention.attention_history_figure(trace, layer, h, last, batch), ""))
        else:
            sections.append((f"Attention over the steps, layer {layer} head {h}", None,
                             "The run recomputed every position at every step (the cache off): each step's "
                             "attention is in its own step report."))
    sections.append(("The shapes, stage by stage (block 0), at the prefill", flow.shape_flow_figure(trace, 0, 0), ""))
    for s in range(trace.n_steps):
        if facts.step(s).sampling is not None:
            sections.append((f"The next token at step {s}", tokens.next_token_figure(trace, s, batch), ""))
    rows = []
    for s in range(trace.n_steps):
        step_facts = facts.step(s)
        chosen = step_facts.sampling
        picks = ", ".join(f"<code>{html.escape(label)}</code> (p = {p:.3f})"
                          for label, p in zip(chosen.labels, chosen.probs)) if chosen is not None else "none"
        n, t = positions(trace, s)
        rows.append(f"<tr><td>{s}</td><td>{n}</td><td>{t}</td>"
                    f"<td>{step_facts.forward.cache_after if facts.info.use_cache else 0}</td><td>{picks}</td>"
                    f"<td>{trace.steps[s].seconds * 1000:.1f}</td></tr>")
    table = ("<table><tr><th>step</th><th>n</th><th>t</th><th>cached after</th><th>chosen (per sequence)</th>"
             "<th>traced forward, ms</th></tr>" + "".join(rows) + "</table>")
    texts = "".join(f"<h3>Sequence {r}</h3>{tokens.generated_text_html(trace, r)}" for r in range(facts.batch_size))
    texts += tokens.text_legend()
    header = (f"<h1>A run of {trace.n_steps} steps</h1>{_who(trace)}<p>{html.escape(facts.info.sampling.describe())}; "
              f"the KV cache {'on' if facts.info.use_cache else 'off'}; capture {trace.capture}.</p>"
              f"<h2>The text (each chosen token shaded by its probability)</h2>{texts}<h2>Every step</h2>{table}")
    return _page(f"a run of {trace.n_steps} steps", header, sections, "")


def _who(trace: Trace) -> str:
    """The model and the prompts, escaped."""
    facts = facts_of(trace)
    model = html.escape(trace.model.describe()) if trace.model is not None else "a model"
    texts = "".join(f"<li><code>{html.escape(facts.info.prompts[r])}</code></li>" for r in range(facts.batch_size))
    return f"<p>{model}</p><p>prompts:</p><ol start='0'>{texts}</ol>"


def _page(title: str, head: str, sections: list[tuple[str, go.Figure | None, str]], tail: str) -> str:
    """One self-contained page: plotly.js written in once, each section a title, a note and a figure."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>GPT shape tracer: {html.escape(title)}"
             f"</title><script>{get_plotlyjs()}</script><style>{STYLE}</style></head><body>", head]
    for name, figure, note in sections:
        parts.append(f"<h2>{html.escape(name)}</h2>")
        if note:
            parts.append(f"<p class='note'>{html.escape(note)}</p>")
        if figure is not None:
            parts.append(figure.to_html(full_html=False, include_plotlyjs=False,
                                        config={"displaylogo": False, "responsive": True}))
    parts.append(tail + "<p class='note'>Written by GPT shape tracer; opens offline.</p></body></html>")
    return "".join(parts)
