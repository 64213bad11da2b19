"""What to load (issue 48 item 2): one frozen ``session.ModelChoice`` that the sidebar, the command line and a saved
run all build, checked when it is made; one ``session.load``; one ``describe()``; one serialisation for run.json
that also reads the model keys of runs saved before. (A saved run of the version before reopening in the app:
tests/app/test_runs.py; the sidebar's device choice: tests/app/test_app_device.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpt_shape_tracer.model import ModelLoadError
from gpt_shape_tracer.session import DEFAULT_MODEL, ModelChoice, SettingsError, gib_of, load

CHOICES = [
    ModelChoice(),
    ModelChoice("bundled", "story-llama", device="cuda:1"),
    ModelChoice("directory", "/models/a:b|c", dtype="bfloat16", memory_gib=1.5),
    ModelChoice("directory", "org/name", dtype="float16", device="mps", tokenizer="/t/tokenizer.json"),
    ModelChoice("directory", "shapes:llama-3.1-8b", dry_run=True, tensor_parallel=4),
    ModelChoice("factory", "pkg.mod:make", tokenizer="/t"),
]


@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c.describe())
def test_a_choice_is_written_to_json_and_read_back_as_itself(choice):
    text = json.dumps(choice.to_json(), allow_nan=False)  # as run.json holds it
    assert ModelChoice.from_json(json.loads(text)) == choice
    assert hash(ModelChoice.from_json(json.loads(text))) == hash(choice)  # a cache key: st.cache_resource's


@pytest.mark.parametrize("key, choice", [
    ("bundled:story-gpt", DEFAULT_MODEL),
    ("cuda:0|bundled:story-llama", ModelChoice("bundled", "story-llama", device="cuda:0")),
    ("dir:float32:/tmp/x|y", ModelChoice("directory", "/tmp/x|y", dtype="float32")),  # a bar in a path is a path
    ("dir:bfloat16@1.5:/m/a:b", ModelChoice("directory", "/m/a:b", dtype="bfloat16", memory_gib=1.5)),
    ("mps|dir:float16:/m", ModelChoice("directory", "/m", dtype="float16", device="mps")),
    ("factory:pkg.mod:make", ModelChoice("factory", "pkg.mod:make")),
])
def test_the_model_key_of_a_run_saved_before_reads_as_its_choice(key, choice):
    assert ModelChoice.from_json(key) == choice


@pytest.mark.parametrize("raw, message", [
    ("nope", "is not a model key"),
    ("dir:float32", "is not a model key"),
    ("tpu|bundled:story-gpt", "is not a model key"),  # not a device: the whole of it is the key
    ("dir:float32@lots:/m", "'lots' is not an amount of GiB"),
    ("bundled:gpt-5", "no bundled model is called 'gpt-5'; bundled: story-gpt, story-llama"),
    ("cuda:0|factory:pkg.mod:make", "your own factory places its module"),
    ([1], "a model choice is an object of its fields"),
    ({"kind": "bundled"}, "names its kind and where it is"),
    ({"kind": "bundled", "where": "story-gpt", "colour": "red"}, "has no field 'colour'"),
    ({"kind": "directory", "where": "/m", "memory_gib": True}, "field 'memory_gib' is of the wrong type"),
    ({"kind": "directory", "where": "/m", "tensor_parallel": 2.0}, "field 'tensor_parallel' is of the wrong type"),
])
def test_what_is_not_a_choice_is_refused_by_what_is_wrong(raw, message):
    with pytest.raises(SettingsError, match=message):
        ModelChoice.from_json(raw)


@pytest.mark.parametrize("fields, message", [
    ({"kind": "hub"}, "a model is bundled, a directory or a factory, not 'hub'"),
    ({"where": "story-gpt2"}, "no bundled model is called 'story-gpt2'"),
    ({"kind": "directory", "where": "  "}, "Type the directory of a checkpoint first."),
    ({"kind": "directory", "where": "/a\x00b"}, "NUL character"),
    ({"kind": "factory", "where": ""}, "'': give the factory as package.module:function"),
    ({"device": "tpu"}, "device 'tpu': give cpu, cuda, cuda:N or mps"),
    ({"device": "cuda:-1"}, "give cpu, cuda, cuda:N or mps"),
    ({"dtype": "float16"}, "a dtype goes with a directory"),
    ({"kind": "directory", "where": "/m", "dtype": "int8"}, "dtype 'int8': give float32, bfloat16, float16"),
    ({"kind": "directory", "where": "/m", "memory_gib": -1}, "memory for the weights takes 0 .* got -1"),
    ({"kind": "directory", "where": "/m", "memory_gib": math.nan}, "memory for the weights takes 0 .* got nan"),
    ({"kind": "directory", "where": "/m", "memory_gib": 5000}, "to 4096 GiB"),
    ({"memory_gib": 2}, "memory for the weights goes with a directory"),
    ({"kind": "directory", "where": "/m", "memory_gib": 2, "device": "cuda:0"},
     "“Memory for the weights” lets accelerate place the layers .* Set it to 0 to load on cuda:0; the previous "
     "model stays loaded"),
    ({"kind": "directory", "where": "/m", "memory_gib": 2, "dry_run": True}, "a dry run builds the model on the meta"),
    ({"kind": "directory", "where": "/m", "dry_run": True, "device": "cuda:0"}, "a dry run builds the model on the"),
    ({"kind": "factory", "where": "p.m:f", "device": "cuda:0"}, "device cuda:0: your own factory places its module"),
    ({"dry_run": True}, "a dry run builds a model from its config: it goes with a directory"),
    ({"kind": "directory", "where": "/m", "tensor_parallel": 2}, "tensor-parallel ranks go with a dry run"),
    ({"kind": "directory", "where": "/m", "dry_run": True, "tensor_parallel": 0}, "tensor-parallel takes 1 … 1024"),
    ({"tokenizer": "/t"}, "a bundled model has its own tokenizer"),
])
def test_a_choice_is_checked_when_it_is_made_with_a_message(fields, message):
    with pytest.raises(SettingsError, match=message):
        ModelChoice(**fields)


def test_a_choice_is_frozen_and_written_one_way():
    choice = ModelChoice("directory", "/m")
    with pytest.raises(AttributeError):
        choice.where = "/elsewhere"  # type: ignore[misc]
    assert choice.dtype == "float32" and choice == ModelChoice("directory", "/m", dtype="float32")  # load_model's
    assert ModelChoice("directory", "/m", memory_gib=2) == ModelChoice("directory", "/m", memory_gib=2.0)
    assert ModelChoice(device=" cuda ").device == "cuda:0"
    assert ModelChoice("directory", "shapes:x", dry_run=True).dtype is None  # a dry run keeps its config's


@pytest.mark.parametrize("choice, described", [
    (ModelChoice(), "the bundled story-gpt"),
    (ModelChoice(device="cuda:0"), "the bundled story-gpt on cuda:0"),
    (ModelChoice("directory", "/tmp/a:b", dtype="bfloat16"), "the directory /tmp/a:b (bfloat16)"),
    (ModelChoice("directory", "/tmp/a:b", memory_gib=1.5), "the directory /tmp/a:b (float32, weights beyond 1.5 GiB "
                                                           "on disk)"),
    (ModelChoice("directory", "/m", dtype="float16", device="mps"), "the directory /m (float16) on mps"),
    (ModelChoice("factory", "pkg.mod:make"), "your module pkg.mod:make"),
    (ModelChoice("directory", "shapes:llama-3.1-8b", dry_run=True, tensor_parallel=4),
     "the config of shapes:llama-3.1-8b (no weights, one rank of 4)"),
])
def test_a_choice_describes_itself_as_the_app_says_it(choice, described):
    assert choice.describe() == described


@pytest.mark.parametrize("amount, gib, max_memory", [
    ("2GiB", 2.0, "2GiB"), ("1.5gib", 1.5, "1.5GiB"), ("2147483648", 2.0, "2GiB"), ("12345", 12345 / 2**30, "12345"),
    ("500MB", 500e6 / 2**30, "500000000"), ("5Gb", 5e9 / 8 / 2**30, "625000000"),  # lowercase b: bits, as accelerate
])
def test_an_amount_of_memory_is_read_in_gib_and_given_to_the_loader_exactly(amount, gib, max_memory):
    assert gib_of(amount) == gib
    assert ModelChoice("directory", "/m", memory_gib=gib_of(amount)).max_memory == max_memory


@pytest.mark.parametrize("amount", ["lots", "0", "-1GB", "1.5", "", "2 parsecs"])
def test_an_amount_that_is_not_memory_is_refused_by_name(amount):
    with pytest.raises(SettingsError, match=f"--max-memory {amount!r} is not an amount of memory"):
        gib_of(amount, "--max-memory")


# -- the one load ------------------------------------------------------------------------------------------
def test_load_gives_the_bundled_model_and_its_tokenizer(bundled):
    model, tok = load(DEFAULT_MODEL)
    assert model.identity.weights_digest == bundled[0].identity.weights_digest
    assert tok is not None and tok.encode("Lily had") == bundled[1].encode("Lily had")
    assert next(model.parameters()).device.type == "cpu"


def test_load_gives_a_directory_in_its_dtype_with_its_tokenizer(hf_dir_with_tokenizer):
    model, tok = load(ModelChoice("directory", str(hf_dir_with_tokenizer), dtype="bfloat16"))
    assert model.config.n_layer == 2 and next(model.parameters()).dtype == torch.bfloat16
    assert tok is not None and model.identity.weights_digest  # named by its files' hash at once


def test_load_gives_a_dry_run_of_one_rank_without_weights():
    model, _ = load(ModelChoice("directory", "shapes:llama-3.1-8b", dry_run=True, tensor_parallel=4))
    assert next(model.parameters()).device.type == "meta"
    assert model.tensor_parallel.ranks == 4


def test_load_refuses_a_device_this_machine_lacks_as_a_model_that_cannot_load():
    """A run saved on a machine with a GPU reads here; loading it says what this machine offers."""
    lacking = "cuda:0" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ModelLoadError, match="this machine offers cpu"):
        load(ModelChoice(device=lacking))


def test_load_refuses_a_directory_that_is_not_there(tmp_path):
    with pytest.raises(ModelLoadError, match="no such directory"):
        load(ModelChoice("directory", str(tmp_path / "gone")))
