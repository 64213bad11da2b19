"""The device choice (issue 42 item 1) under AppTest and in ``session``: the sidebar lists what PyTorch sees on this
machine, the CPU runs end to end, and a device this machine lacks — asked for in the address (``?device=``) or by a
saved run's model key — is refused with a message while everything computed stays. (The command line's
``--device cuda`` refusal: tests/package/test_cli.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from streamlit.testing.v1 import AppTest

from gpt_shape_tracer import session
from gpt_shape_tracer.gui.runs import tokens_of
from gpt_shape_tracer.session.runs import new_run_id
from tests.app.test_app import APP, page_text, press, run
from tests.app.test_runs import record, runs_store


def lacking_device() -> str:
    """A CUDA device this machine does not have: any, on a machine without CUDA; else the one past the last."""
    return "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


def what_torch_sees() -> list[str]:
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return ["cpu", *cuda, *(["mps"] if torch.backends.mps.is_available() else [])]


def errors(at: AppTest) -> str:
    return " | ".join(str(e.value) for e in at.error)


def test_the_sidebar_offers_what_torch_sees_and_the_cpu_runs_end_to_end():
    at = run(AppTest.from_file(APP, default_timeout=240))
    device = at.sidebar.selectbox(key="model_device")
    assert device.options == what_torch_sees() and device.value == "cpu"
    device.set_value("cpu")
    run(at)
    press(at, "step_button")
    press(at, "step_button")
    app = at.session_state["app"]
    assert app.model == session.ModelChoice("bundled", "story-gpt", device="cpu") == session.DEFAULT_MODEL
    assert app.live.generation.n_steps == 2 and not at.exception
    assert {rec.device for rec in app.live.generation.trace.filter(step=1)} == {"cpu"}
    assert next(app.live.generation.model.parameters()).device.type == "cpu"


def test_a_device_this_machine_lacks_is_refused_and_the_steps_stay():
    at = run(AppTest.from_file(APP, default_timeout=240))
    press(at, "step_button")
    press(at, "step_button")
    app = at.session_state["app"]
    before = tokens_of(app.live.generation.trace)
    at.query_params["device"] = lacking_device()  # a link that asks for a GPU, followed in this session
    run(at)
    said = errors(at)
    assert "Device refused" in said and ("PyTorch sees no CUDA device" in said or "CUDA device(s)" in said)
    assert "the current generation and its steps are kept" in said
    assert at.sidebar.selectbox(key="model_device").value == "cpu"
    assert app.model == session.DEFAULT_MODEL and app.live.generation.n_steps == 2
    assert tokens_of(app.live.generation.trace) == before
    press(at, "step_button")  # and the generation goes on
    assert app.live.generation.n_steps == 3 and "Device refused" not in errors(at)


def test_a_device_asked_for_in_the_address_is_refused_once():
    at = AppTest.from_file(APP, default_timeout=240)
    at.query_params["device"] = lacking_device()
    run(at)
    assert "Device refused" in errors(at) and "this machine offers" in errors(at)
    assert at.sidebar.selectbox(key="model_device").value == "cpu" and "device" not in at.query_params
    press(at, "step_button")
    assert at.session_state["app"].live.generation.n_steps == 1 and "Device refused" not in errors(at)


def test_a_saved_run_on_a_device_this_machine_lacks_opens_its_written_trace(bundled):
    """A run saved by a server with a GPU, opened where there is none: its written trace is shown, and why."""
    from gpt_shape_tracer.tracer import TracedGeneration

    model, tok = bundled
    gen = TracedGeneration(model, tok, "Tom had a kite.", temperature=0)
    gen.run(2)
    run_id = new_run_id()
    choice = session.ModelChoice(device="cuda:0" if not torch.cuda.is_available() else lacking_device())
    runs_store().save(record(run_id, model=choice, n_steps=2, step=1), gen.trace)
    at = AppTest.from_file(APP, default_timeout=240)
    at.query_params["run"] = run_id
    run(at)
    app = at.session_state["app"]
    assert app.viewing_file and tokens_of(app.loaded.trace) == tokens_of(gen.trace)
    assert any("cannot be loaded" in w.value and "CUDA device" in w.value for w in at.warning), page_text(at)
    assert app.model == session.DEFAULT_MODEL


# -- session: choices, names, dtypes -----------------------------------------------------------------------
def test_a_model_choice_carries_its_device_and_old_keys_mean_the_cpu():
    for key, kind in (("bundled:story-llama", "bundled"), ("dir:bfloat16:/tmp/a:b|c", "directory"),
                      ("factory:pkg.mod:make", "factory")):
        choice = session.ModelChoice.from_json(key)  # a run saved before: its key names no device
        assert choice.kind == kind and choice.device == "cpu"
        if kind != "factory":  # your own factory places its module itself
            moved = session.ModelChoice.from_json(f"cuda:1|{key}")
            assert moved.device == "cuda:1" and replace(moved, device="cpu") == choice
    assert session.ModelChoice.from_json("dir:float32:/tmp/x|y").where == "/tmp/x|y"  # a bar in a path is a path
    assert session.ModelChoice.from_json("dir:float32:/tmp/x|y").device == "cpu"
    assert session.ModelChoice(device="cuda").device == "cuda:0"  # as check_device writes it
    assert session.ModelChoice.from_json("cuda:0|bundled:story-gpt").describe() == "the bundled story-gpt on cuda:0"
    assert session.ModelChoice().describe() == "the bundled story-gpt"


@pytest.mark.parametrize("raw", ["tpu", "cuda:x", "gpu", "", "cuda:-1", "cpu:0"])
def test_a_device_name_that_is_none_is_refused(raw):
    with pytest.raises(session.SettingsError, match="give cpu, cuda, cuda:N or mps"):
        session.check_device(raw)


def test_the_devices_and_dtypes_offered_are_what_torch_supports():
    assert list(session.available_devices()) == what_torch_sees()
    assert session.check_device(" cpu ") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(session.SettingsError, match="PyTorch sees no CUDA device on this machine"):
            session.check_device("cuda:0")
    offered, why = session.compute_dtypes("cpu")
    assert offered == ("float32", "bfloat16", "float16") and why == ""
    for dtype in offered:  # each one really computes on the CPU
        x = torch.randn(4, 8, dtype=getattr(torch, dtype))
        assert torch.isfinite(torch.nn.functional.layer_norm(x @ x.T, (4,))).all()
