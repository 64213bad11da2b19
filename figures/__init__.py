"""Pure view builders: traces in, plotly figures / pandas tables / escaped HTML out.

No streamlit here, so every view is tested directly; ``app.py`` only wires
widgets to these functions.
"""
