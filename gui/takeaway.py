"""Say it first, then explain: a view opens with its one-line takeaway in bold and its two or three key numbers
as metrics; the long text goes into an expander. One function, used by every view, so they all read alike."""

from __future__ import annotations

from collections.abc import Sequence

import streamlit as st

__all__ = ["takeaway"]


def takeaway(sentence: str, metrics: Sequence[tuple[str, str]] = (), details: str | None = None,
             details_label: str = "Why, and how to read it") -> None:
    """``sentence``: the view's takeaway (markdown, shown bold); ``metrics``: (label, value) pairs, values
    already formatted by the function that computed them; ``details``: the longer explanation, folded."""
    st.markdown(f"**{sentence}**")
    if metrics:
        for column, (label, value) in zip(st.columns(len(metrics)), metrics):
            column.metric(label, value)
    if details:
        with st.expander(details_label):
            st.markdown(details)
