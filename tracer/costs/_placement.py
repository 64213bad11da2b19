"""Where the layers would go: accelerate's own ``infer_auto_device_map`` on the meta model, for the memory a person
names (``{0: "80GiB", 1: "80GiB", "cpu": "200GiB"}``), then what each device has left for the KV cache and so the
longest context that fits.

The KV cache of a layer lives where the layer runs, and that is where accelerate's ``dispatch_model`` executes it:
a layer on an accelerator runs there; a layer offloaded to ``"cpu"`` or ``"disk"`` has its weights brought to the
main device (the first accelerator of the map, or the CPU when there is none) and runs there, so its keys and
values are made, and kept, on that device. A device running L_d layers needs 2·G·d_head·itemsize·batch·L_d bytes
per token; the context that fits is the smallest, over the devices running layers, of what is left there divided
by that. Activations are not counted (a step's peak activation memory is in ``StepCosts``), nor is anything
accelerate's own placement leaves free on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gpt_shape_tracer.model.sources import dry_config


@dataclass(frozen=True)
class Placement:
    device_map: dict[str, str]  # module path (accelerate's naming, from the model that was placed) → device
    weights_by_device: dict[str, int]  # bytes of weights per device
    free_by_device: dict[str, int]  # bytes left per device (its max_memory minus its weights)
    layers_by_device: dict[str, int]  # where each layer's weights are kept
    cache_layers_by_device: dict[str, int]  # where each layer runs, and so keeps its KV cache (module doc)
    kv_bytes_per_token: int  # all layers, for the batch's sequences together
    longest_context: int  # tokens per sequence the KV cache can hold (capped at n_ctx)
    n_ctx: int
    main_device: str = "cpu"  # where accelerate runs the layers offloaded to cpu or disk (module doc)

    def describe(self) -> str:
        places = ", ".join(f"{d}: {n} layer(s), {self.weights_by_device.get(d, 0) / 2**30:.1f} GiB of weights, "
                           f"{self.free_by_device.get(d, 0) / 2**30:.1f} GiB left"
                           for d, n in self.layers_by_device.items())
        capped = " (the model's n_ctx)" if self.longest_context == self.n_ctx else ""
        offloaded = sum(n for d, n in self.layers_by_device.items() if d in OFFLOADED)
        runs = ", ".join(f"{d}: {n} layer(s)" for d, n in self.cache_layers_by_device.items())
        where = (f" The {offloaded} offloaded layer(s) run on {self.main_device}, where accelerate brings their "
                 f"weights, and keep their cache there: the cache is held by {runs}." if offloaded else "")
        return (f"{places}.{where} The KV cache takes {self.kv_bytes_per_token:,} bytes per token: the longest "
                f"context that fits is {self.longest_context:,} tokens{capped}")


OFFLOADED = ("cpu", "disk")  # accelerate's offload targets: a layer kept there runs on the main device


def _memory(spec: dict) -> dict[int | str, int]:
    from accelerate.utils import convert_file_size_to_int

    return {k: convert_file_size_to_int(v) for k, v in spec.items()}


def place(model: nn.Module, max_memory: dict, batch: int = 1) -> Placement:
    """accelerate's device map of ``model`` (a dry run's, or any) within ``max_memory``, and the KV cache's room."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    config = dry_config(model)
    target: nn.Module = getattr(model, "hf", model)
    no_split = list(getattr(target, "_no_split_modules", None) or []) or ["Block"]
    memory = _memory(max_memory)
    device_map = infer_auto_device_map(target, max_memory=memory, no_split_module_classes=no_split)
    sizes = compute_module_sizes(target)
    weights: dict[str, int] = {}
    for path, device in device_map.items():
        weights[str(device)] = weights.get(str(device), 0) + int(sizes[path])
    layer_paths = _layer_paths(target, config.n_layer)
    layers: dict[str, int] = {}
    for lp in layer_paths:
        owner = next((str(d) for p, d in device_map.items() if lp == p or lp.startswith(p + ".") or p == ""), None)
        if owner is not None:
            layers[owner] = layers.get(owner, 0) + 1
    itemsize = next(target.parameters()).element_size()
    per_layer_token = config.cache_width * itemsize * batch
    free = {str(d): max(0, int(m) - weights.get(str(d), 0)) for d, m in memory.items()}
    # accelerate's dispatch_model: the main device is the first accelerator the map uses, else the CPU
    main = next((str(d) for d in device_map.values() if str(d) not in OFFLOADED), "cpu")
    running: dict[str, int] = {}
    for d, n in layers.items():
        where = main if d in OFFLOADED else d
        running[where] = running.get(where, 0) + n
    fits = [free.get(d, 0) // (per_layer_token * n) for d, n in running.items() if n]
    longest = min([config.n_ctx, *fits]) if fits else 0
    return Placement({k: str(v) for k, v in device_map.items()}, weights, free, layers, running,
                     per_layer_token * config.n_layer, int(longest), config.n_ctx, main)


def _layer_paths(target: nn.Module, n_layer: int) -> list[str]:
    """The paths of the decoder layers (a ModuleList of n_layer modules: ``blocks``, ``model.layers``, …)."""
    for path, module in target.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layer and path.rsplit(".", 1)[-1] in (
                "blocks", "layers", "h"):
            return [f"{path}.{i}" for i in range(n_layer)]
    return []
