"""One rank of a tensor-parallel model (load_model(..., weights=False, tensor_parallel=k)) against transformers'
own tensor parallelism run for real: two processes, the gloo backend, on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpt_shape_tracer.model import ModelLoadError, load_bundled, load_model
from gpt_shape_tracer.tracer import TracedGeneration
from tests.app_in_browser import free_port
from tests.hf_architectures import build

HERE = Path(__file__).resolve().parent
PROMPT = "Once upon a time there was a kite"


@pytest.fixture(scope="module")
def tokenizer():
    return load_bundled("story-llama")[1]


MODEL_TYPES = ("qwen3", "llama")


def real_tensor_parallel(directories: list[Path], n: int, out: Path) -> dict[str, list[dict]]:
    """transformers' tensor parallelism, 2 ranks, one launch for every model: per model folder name, each rank's
    module input and output shapes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), str(HERE.parent / "tensor_parallel_worker.py"), str(n), str(out),
               *map(str, directories)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {d.name: [json.loads((out / d.name / f"rank{r}.json").read_text()) for r in range(2)]
            for d in directories}


@pytest.fixture(scope="module")
def tensor_parallel_runs(tokenizer, tmp_path_factory) -> tuple[dict[str, Path], dict[str, list[dict]]]:
    root = tmp_path_factory.mktemp("tensor-parallel")
    directories = {t: build(t, root / t) for t in MODEL_TYPES}
    return directories, real_tensor_parallel(list(directories.values()), len(tokenizer.encode(PROMPT)), root / "out")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_one_rank_has_the_shapes_transformers_tensor_parallelism_gives_each_rank(model_type, tokenizer,
                                                                                 tensor_parallel_runs):
    directory, ranks = tensor_parallel_runs[0][model_type], tensor_parallel_runs[1][model_type]
    model, _ = load_model(directory, weights=False, tensor_parallel=2)
    gen = TracedGeneration(model, tokenizer, PROMPT, capture="shapes")
    gen.run(1)
    trace = gen.trace
    compared = 0
    for module, entry in ranks[0].items():
        if not module or module == "#parameters":
            continue
        for where, shape in entry.items():
            name = f"hf.{module}:{where}"
            if name in trace.names():
                assert list(trace.record(name, 0).shape) == shape == ranks[1][module][where], name
                compared += 1
    assert compared > 20  # every Linear, norm and layer of two layers, in and out
    # the heads on one rank: H/2 query heads, G/2 key/value heads, in our hook points too
    assert model.config.n_head * 2 == 4 and model.config.n_kv_head * 2 == 2
    assert trace.record("blocks.0.attn.hook_q", 0).shape[1] == 2
    assert list(trace.record("hook_logits", 0).shape) == ranks[0][""]["out"]
    # every parameter as one rank holds it: the lm_head's V/2 rows too (colwise_gather_output shards its weight;
    # only its output is gathered), the embedding split or whole as transformers' plan for this family has it
    held = {name.removeprefix("hf."): list(p.shape) for name, p in model.named_parameters()}
    assert held == ranks[0]["#parameters"] == ranks[1]["#parameters"]


def test_the_plan_lists_each_split_and_its_collective(tmp_path):
    directory = build("qwen3", tmp_path / "qwen3")
    model, _ = load_model(directory, weights=False, tensor_parallel=2)
    plan = model.tensor_parallel
    styles = {m.path.split(".")[-1]: (m.style, m.whole, m.per_rank) for m in plan.modules if ".0." in m.path}
    assert styles["q_proj"] == ("colwise", (64, 64), (32, 64))
    assert styles["o_proj"] == ("rowwise", (64, 64), (64, 32))
    assert styles["down_proj"] == ("rowwise", (64, 128), (64, 64))
    # per forward: o_proj and down_proj of each layer, and the embedding, all-reduce; the logits are gathered
    assert plan.collectives() == {"all-reduce": 2 * 2 + 1, "all-gather": 1}


def test_counts_that_do_not_divide_are_refused_with_the_numbers(tmp_path):
    directory = build("qwen3", tmp_path / "qwen3")  # 2 key/value heads
    with pytest.raises(ModelLoadError, match="2 key/value heads G cannot be shared equally by 4 ranks"):
        load_model(directory, weights=False, tensor_parallel=4)
    with pytest.raises(ModelLoadError, match="tensor-parallel ranks must be an integer"):
        load_model(directory, weights=False, tensor_parallel=0)
    with pytest.raises(ModelLoadError, match="dry run"):
        load_model(directory, tensor_parallel=2)


def test_one_rank_of_llama_holds_and_computes_its_share_by_hand_arithmetic(tmp_path):
    """Issue 52: what one rank holds and does, from the config by hand. transformers' plan for Llama
    (LlamaConfig.base_model_tp_plan, LlamaForCausalLM._tp_plan and the embedding's entry) splits q/k/v/gate/up by
    rows and o/down by columns, the embedding by its V rows, and the lm_head as a colwise module whose output is
    gathered: each rank holds V/k of its rows and computes V/k logits, then an all-gather makes all V. Only the
    norms are whole. (Before, the lm_head was kept whole: 52.57B parameters for Llama 405B on 8 ranks where a rank
    holds 50.74B, and a gather of logits counted that did not happen.)"""
    from gpt_shape_tracer.tracer.costs import collectives, costed_dry_run

    directory = build("llama", tmp_path / "llama")
    config = json.loads((directory / "config.json").read_text())
    k, d, V, L, d_ff = 2, config["hidden_size"], config["vocab_size"], config["num_hidden_layers"], \
        config["intermediate_size"]
    d_head = d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d_head
    per_layer = (d * d + 2 * d * kv + d * d) // k + 3 * d * d_ff // k + 2 * d  # attention, MLP, two norms
    held = L * per_layer + V * d // k + V * d // k + d  # layers, embedding, lm_head, final norm
    model, tok = load_model(directory, weights=False, tensor_parallel=k)
    assert sum(p.numel() for p in model.parameters()) == held
    gen, costs = costed_dry_run(model, tok, PROMPT, steps=1)
    n = gen.facts.steps[0].forward.n
    head = [op for op in costs[1].ops if op.module == "hf.lm_head" and op.macs]
    assert [op.macs for op in head] == [d * V // k]  # one row at the decode step, V/k logits
    assert list(gen.trace.record("hook_logits", 0).shape) == [1, n, V]  # gathered: every rank holds all V
    gathers = [c for c in collectives(gen.trace, 1, model.tensor_parallel) if c.kind == "all-gather"]
    assert [(c.module, c.bytes) for c in gathers] == [("lm_head", V * 4)]  # float32: [1, 1, V] at the decode step
