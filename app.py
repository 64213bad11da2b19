"""Placeholder page until the app issue lands: `streamlit run app.py`."""

import streamlit as st

st.set_page_config(page_title="GPT shape tracer", layout="wide")
st.title("GPT shape tracer")
st.write("The step-through debugger is being built; see the README.")
