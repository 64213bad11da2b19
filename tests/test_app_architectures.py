"""Every tab of the real app (AppTest) for every architecture the generic Hugging Face path is tested on,
opened as a user does — "Local Hugging Face directory", Load, Step, Step — with no exception and no error
message, and the page naming the model it runs."""

from __future__ import annotations

import tempfile
from html import unescape
from pathlib import Path

import pytest

from model.loading import BUNDLED_DIR
from tests.hf_architectures import ARCHITECTURES, build
from tests.test_app import TABS, new_app, press, run, show_tab

NOT_OURS = [name for name in ARCHITECTURES if name not in ("gpt2", "llama", "mistral", "qwen2")]


@pytest.fixture(scope="module")
def app():
    """One app session that loads each directory in turn (the app keeps the two latest models)."""
    return new_app()


@pytest.mark.parametrize("model_type", NOT_OURS)
def test_every_tab_renders_for(app, model_type):
    directory = build(model_type, Path(tempfile.mkdtemp(prefix="app-arch-")) / model_type,
                      BUNDLED_DIR / "tokenizer.json")
    at = app
    show_tab(at, "Shapes")
    at.sidebar.radio(key="source").set_value("Local Hugging Face directory")
    run(at)
    at.sidebar.text_input(key="model_dir").set_value(str(directory))
    press(at, "load_model")
    press(at, "reset_button")
    press(at, "step_button")
    show_tab(at, "Attention")
    press(at, "step_button")
    for tab in TABS:
        show_tab(at, tab)
        assert not at.error, (tab, [e.value for e in at.error])
    assert any(f"{model_type} (hf:{model_type})" in unescape(c.value) for c in at.caption)  # the model it runs
    gen = at.session_state["app"].generation
    assert gen.n_steps == 2 and gen.model.identity.family == f"hf:{model_type}"
