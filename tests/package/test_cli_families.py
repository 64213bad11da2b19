"""``gpt-shape-tracer trace --model-dir DIR --out PATH`` saves a trace of every family the generic path is tested on
(tests/hf_architectures.py) and of Falcon, and the file loads back with the records and values the command reported.

Falcon's fused QKV output is changed in place after it is recorded, so its value is dropped while the trace is
saved: saving once failed there ("dictionary changed size during iteration" in tracer/storage/_store.py), through
the CLI only, as the library's tests did not save a Falcon trace."""

from __future__ import annotations

import re

import pytest
import torch

from gpt_shape_tracer.trace_command import main
from gpt_shape_tracer.tracer import load_trace
from tests.hf_architectures import ARCHITECTURES, build

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Falcon is not in tests/hf_architectures.py (the app and engine sweeps run those); the crash was found on it
FAMILIES = dict(ARCHITECTURES, falcon=("FalconConfig", dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2,
                                                            num_attention_heads=4, max_position_embeddings=128)))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_cli_saves_a_trace_of_the_family_that_loads_back(capsys, tmp_path, bundled, model_type):
    directory = tmp_path / model_type
    directory.mkdir()
    bundled[1].save(directory / "tokenizer.json")
    build(model_type, directory, table=FAMILIES)
    out = tmp_path / "t.zip"
    code = main(["--model-dir", str(directory), "--prompt", "Once upon a time", "--steps", "2", "--quiet",
                 "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    said = re.search(r"wrote .*: (\d+) steps, (\d+) records, (\d+) bytes of values", captured.out)
    assert said is not None, captured.out
    steps, records, value_bytes = map(int, said.groups())
    back = load_trace(out)
    assert back.n_steps == steps == 2 and len(back.records) == records and value_bytes > 0
    held = [rec for rec in back.records if back.has_value(rec)]
    assert held and all(tuple(back.value(rec).shape) == tuple(rec.shape) for rec in held[:50])
    logits = back.get("hook_logits", 1)
    assert logits is not None and logits.shape[-1] == 1024 and bool(torch.isfinite(logits).all())
