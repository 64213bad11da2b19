"""Export: download the trace, or load one back (validated before anything is allocated)."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.figures.report import report_html, run_report_html
from gpt_shape_tracer.gui.common import UPLOAD_MB, plain, read_uploaded_trace, state
from gpt_shape_tracer.gui.server import reserve_memory
from gpt_shape_tracer.session import LoadedTrace
from gpt_shape_tracer.tracer import LIMITS, Trace, archive_bytes


def export_tab(trace: Trace | None, step: int = 0) -> None:
    app = state()
    if trace is not None:
        st.download_button(f"Download a one-file HTML report of step {step} (opens offline in any browser; about "
                           "5 MB, most of it plotly.js, written in once)",
                           data=lambda: report_html(trace, step).encode(), file_name=f"trace-step-{step}.html",
                           mime="text/html", key="download_report", on_click="ignore")
        st.download_button(f"Download a one-file HTML report of the whole run ({trace.n_steps} steps: the text, every "
                           "step's choices, the KV cache and attention over the steps)",
                           data=lambda: run_report_html(trace).encode(), file_name="trace-run.html",
                           mime="text/html", key="download_run_report", on_click="ignore")
        st.download_button("Download this trace (.zip: manifest.json, records.parquet, ops.parquet, "
                           "values.safetensors)", data=lambda: archive_bytes(trace),
                           file_name="trace.zip", mime="application/zip", key="download_trace", on_click="ignore")
    upload = st.file_uploader(f"Load a trace (.zip, up to {UPLOAD_MB // 1024} GiB; checked against limits of "
                              f"{LIMITS.records:,} records and {LIMITS.value_bytes // 2**30} GiB of values before "
                              "anything is allocated)", type=["zip"], max_upload_size=UPLOAD_MB,
                              key="upload_trace")
    if upload is not None and app.last_upload_id != upload.file_id:
        app.last_upload_id = upload.file_id
        loaded = read_uploaded_trace(upload)
        if loaded is None:
            return
        if not loaded.steps or loaded.generation is None:
            st.error(f"{plain(upload.name)} is a valid trace but not of a generation this app can show.")
            return
        refusal = reserve_memory(file_bytes=loaded.log.bytes_kept)
        if refusal:
            st.error(f"{plain(upload.name)} was not opened: {refusal}")
            return
        app.open_file(LoadedTrace(loaded, upload.name, upload.file_id))
        st.session_state["pending_step_view"] = loaded.n_steps - 1  # the slider exists already: apply next run
        st.rerun()
