"""Every tab of the real app (AppTest) for every architecture the generic Hugging Face path is tested on,
opened as a user does — "Local Hugging Face directory", Load, Step, Step — with no exception and no error
message, and the page naming the model it runs."""

from __future__ import annotations

import tempfile
from html import unescape
from pathlib import Path

import pytest

from gpt_shape_tracer.model.sources import BUNDLED_DIR
from tests.app.test_app import TABS, new_app, press, press_reset, run, show_tab
from tests.hf_architectures import ARCHITECTURES, build

NOT_OURS = [name for name in ARCHITECTURES if name not in ("gpt2", "llama", "mistral", "qwen2")]


@pytest.fixture(scope="module")
def app():
    """One app session that loads each directory in turn (the app keeps the two latest models)."""
    return new_app()


def choose_directory(at, directory: Path) -> None:
    """"Local Hugging Face directory" chosen in the sidebar and ``directory`` typed, as a person does."""
    show_tab(at, "Shapes")
    at.sidebar.radio(key="source").set_value("Local Hugging Face directory")
    run(at)
    at.sidebar.text_input(key="model_dir").set_value(str(directory))


def opened_and_stepped(directory: Path, steps: int = 2):
    """A new page that opens ``directory`` from the sidebar as a person does (choose, Load, Reset) and Steps
    ``steps`` times; the AppTest."""
    at = new_app()
    choose_directory(at, directory)
    press(at, "load_model")
    press_reset(at)
    for _ in range(steps):
        press(at, "step_button")
    return at


def every_tab_without_error(at) -> None:
    for tab in TABS:
        show_tab(at, tab)
        assert not at.error, (tab, [e.value for e in at.error])


@pytest.mark.parametrize("model_type", NOT_OURS)
def test_every_tab_renders_for(app, model_type):
    directory = build(model_type, Path(tempfile.mkdtemp(prefix="app-arch-")) / model_type,
                      BUNDLED_DIR / "tokenizer.json")
    at = app
    choose_directory(at, directory)
    press(at, "load_model")
    press_reset(at)
    press(at, "step_button")
    show_tab(at, "Attention")
    press(at, "step_button")
    every_tab_without_error(at)
    for sub in ("Switch heads off", "Activation patching", "Logit attribution", "Logit lens"):
        show_tab(at, "What if", ("whatif_view", sub))  # run() fails on any exception the page raised
        assert not at.error, (sub, [e.value for e in at.error])
    show_tab(at, "What if", ("whatif_view", "Logit lens"))
    lens = [c for c in at.get("plotly_chart")]
    refused = [i.value for i in at.info if "the lens does not reproduce" in i.value]
    assert lens or refused  # drawn, or refused because its last steps are not reproduced — never wrong
    assert any(f"{model_type} (hf:{model_type})" in unescape(c.value) for c in at.caption)  # the model it runs
    gen = at.session_state["app"].live.generation
    assert gen.n_steps == 2 and gen.model.identity.family == f"hf:{model_type}"


def test_a_directory_given_less_memory_than_its_weights_runs_with_them_on_disk(app):
    """"Memory for the weights" below the model's size: the caption says how much stays on disk before Load, the
    load message says what went there, every tab renders, and the steps are the in-memory model's exactly."""
    import torch

    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.sources import weights_size
    from gpt_shape_tracer.tracer import TracedGeneration

    directory = build("llama", Path(tempfile.mkdtemp(prefix="app-offload-")) / "llama", BUNDLED_DIR / "tokenizer.json")
    gib = weights_size(directory)[1] / 3 / 2**30
    at = app
    choose_directory(at, directory)
    at.sidebar.number_input(key="model_memory_gib").set_value(gib)
    run(at)
    assert any("the rest stays on disk and is read at every forward" in c.value for c in at.sidebar.caption)
    press(at, "load_model")
    assert any("parts on disk, read at every forward" in s.value for s in at.success), [s.value for s in at.success]
    press_reset(at)
    press(at, "step_button")
    press(at, "step_button")
    every_tab_without_error(at)
    gen = at.session_state["app"].live.generation
    assert "disk" in gen.model.offloaded.values()
    in_memory, tok = load_hf(directory, implementation="transformers")
    ref = TracedGeneration(in_memory, tok, list(gen.info.prompts), temperature=0)
    ref.run(2)
    for step in range(2):
        assert torch.equal(gen.trace.get("hook_logits", step), ref.trace.get("hook_logits", step))


def test_a_model_whose_transformers_forwards_disagree_says_which_one_the_trace_follows(app):
    """Moshi past its sliding window: transformers' own cached forward differs from its uncached one; the model's
    reference_note (numbers from load_hf's guard) is shown under the model's line, as load_hf says it."""
    import torch
    from transformers import MoshiConfig, MoshiForCausalLM

    from gpt_shape_tracer.model import load_hf
    from tests.hf_every_architecture import tiny_config

    values = tiny_config("moshi").to_dict()
    values["vocab_size"] = 1024  # the bundled tokenizer's ids
    torch.manual_seed(0)
    directory = Path(tempfile.mkdtemp(prefix="app-moshi-")) / "moshi"
    MoshiForCausalLM(MoshiConfig(**values)).save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    note = load_hf(directory)[0].reference_note
    assert note and "the trace follows the uncached forward" in note  # the case this test is about
    at = app
    choose_directory(at, directory)
    press(at, "load_model")
    press_reset(at)
    assert f"Reference: {note}" in [unescape(c.value) for c in at.caption]  # the chosen model, before a step
    press(at, "step_button")
    every_tab_without_error(at)
    assert f"Reference: {note}" in [unescape(c.value) for c in at.caption]  # the generation's model
