"""Run by tests/model/test_tensor_parallel.py under ``torch.distributed.run`` (2 processes, gloo, CPU): transformers'
own tensor parallelism on each saved model given, one prefill each, and every module's input and output shapes and
every parameter's local shape on this rank, written as JSON to ``OUT/<model folder name>/rank{R}.json``. Several
models share one launch: starting the two processes and importing transformers in each costs more than the models'
runs. Not a test module itself."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM


def main(directory: str, n: int, out: str) -> None:
    out = os.path.join(out, os.path.basename(os.path.normpath(directory)))
    os.makedirs(out, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", attn_implementation="eager")
    shapes: dict[str, dict[str, list[int]]] = {}

    def record(name):
        def hook(module, args, output):
            entry = {}
            if args and isinstance(args[0], torch.Tensor):
                entry["in[0]"] = list(args[0].shape)
            if isinstance(output, torch.Tensor):
                entry["out"] = list(output.shape)
            shapes[name] = entry
        return hook

    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(record(name))
    with torch.no_grad():
        logits = model(torch.arange(1, n + 1)[None]).logits
    shapes[""] = {"out": list(logits.shape)}
    # what this rank holds of each parameter: a DTensor's local share (a replicated one holds it whole)
    shapes["#parameters"] = {name: list(getattr(p, "to_local", lambda p=p: p)().shape)
                             for name, p in model.named_parameters()}
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(shapes, f)


if __name__ == "__main__":
    for directory in sys.argv[3:]:
        main(directory, int(sys.argv[1]), sys.argv[2])
