"""docs/notebook.ipynb executed end to end in a real Jupyter kernel (nbclient): every cell runs, and what it
shows is what a notebook displays — plotly figures as their mime bundle, traces and records as HTML tables."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
PLOTLY = "application/vnd.plotly.v1+json"


def test_the_notebook_runs_and_every_view_displays():
    nb = nbformat.read(ROOT / "docs" / "notebook.ipynb", as_version=4)
    assert not any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code")  # kept without outputs
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    shown = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source
        shown[cell.source.splitlines()[-1]] = [o for o in cell.outputs if o.output_type in ("execute_result",
                                                                                                "display_data")]

    def data(last_line: str) -> dict:
        outputs = shown[last_line]
        assert len(outputs) == 1, (last_line, outputs)
        return outputs[0]["data"]

    assert "<table" in data("trace")["text/html"] and "hook_pattern" in data("trace")["text/html"]
    assert "<table" in data("gen")["text/html"] and "Once upon a time" in data("gen")["text/html"]
    record = data('trace.record("blocks.1.attn.hook_pattern")  # a record: its shape, axes and dtype')
    assert "<td>[1, 4, 7, 7]</td><td>[B, H, n, t]</td><td>float32</td>" in record["text/html"]
    gradient = data('grads.record("blocks.0.attn.hook_q")')["text/html"]
    assert "<td>blocks.0.attn.hook_q</td><td>grad</td><td>[1, 4, 4, 32]</td><td>[B, H, n, d_head]</td>" in gradient
    figures = [line for line in shown if any(PLOTLY in o["data"] for o in shown[line])]
    assert len(figures) == 5, figures  # the flow, the stages, all heads, the cache over the steps, the lens
    stages = next(o["data"][PLOTLY] for o in shown["attention.attention_stages_figure(trace, step=0, layer=1, head=0)"])
    heatmaps = [t for t in stages["data"] if t["type"] == "heatmap"]
    assert len(heatmaps) >= 4
    assert "max_abs_delta" in data("diff[diff.max_abs_delta > 0].head()")["text/html"]
    grid = data("attention.all_heads_figure(trace, step=0, scores=scores)  # layers × heads, a clear role written "
                "on its head")[PLOTLY]
    written = " ".join(a.get("text", "") for a in grid["layout"].get("annotations", []))
    assert "prev" in written and "induction" in written, written[:300]  # the cell's comment is true
