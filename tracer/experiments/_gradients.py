"""Backpropagation through attention, on a real head: ``attention_gradients(generation, step, layer, head, loss)``.

One forward of the step's token columns with gradients on, then the gradients of the loss the person picked:
the next-token cross-entropy over every position that has a next token, or −log p of the token the step
chose. Autograd's ∂L/∂x is read at the head's hook points, and each gradient is computed again from its
formula (O = P·V, P = softmax(S), S = s·QKᵀ + M, s = 1/√d_k unless the model has its own):

    G_V = Pᵀ·G_O        G_P = G_O·Vᵀ        G_S,r = (diag(P_r) − P_r P_rᵀ)·G_P,r
    G_Q = s·G_S·K       G_K = s·G_Sᵀ·Q

For a grouped-query model K and V serve H/G query heads, so autograd's ∂L/∂K and ∂L/∂V of a key/value head are
the sums over those heads; the formulas are summed the same way before they are compared. A soft-capped model
(Gemma 2) has one more factor inside G_S; it is refused rather than drawn without it. Also returned: ‖∂L/∂x‖
of the residual stream, the attention and the MLP outputs of every layer, where vanishing or exploding
gradients show. The generation is not touched: the forward runs untraced, on this thread only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch

from model.hook_table import act_name
from tracer.generation._traced import TracedGeneration

GradientLoss = Literal["next-token cross-entropy", "−log p(chosen token)"]
GRADIENT_LOSSES: tuple[str, ...] = ("next-token cross-entropy", "−log p(chosen token)")
NORMED = ("resid_pre", "attn_out", "mlp_out")  # the per-layer gradient norms drawn


@dataclass(frozen=True)
class HeadGradients:
    """One head's gradients by formula and by autograd (each [t, ·] of sequence ``batch``), with the loss."""

    loss_name: str
    loss: float
    layer: int
    head: int
    batch: int
    formula: dict[str, torch.Tensor]  # "G_O", "G_V", "G_P", "G_S", "G_Q", "G_K"
    autograd: dict[str, torch.Tensor]  # the same names, read from the backward pass
    norms: dict[str, list[float]]  # NORMED name → ‖∂L/∂x‖ per layer

    def max_abs_delta(self, name: str) -> float:
        return float((self.formula[name] - self.autograd[name]).abs().max())


def attention_gradients(generation: TracedGeneration, step: int, layer: int, head: int, batch: int = 0,
                        loss: str = GRADIENT_LOSSES[0]) -> HeadGradients:
    """The backward pass of ``loss`` over the token columns step ``step`` saw, read at one head."""
    if loss not in GRADIENT_LOSSES:
        raise ValueError(f"loss must be one of {GRADIENT_LOSSES}, got {loss!r}")
    model, facts = generation.model, generation.facts
    config = model.config
    if getattr(config, "attn_softcap", None):
        raise ValueError("this model soft-caps its scores (c·tanh(S/c)): G_S has one more factor there, which these "
                         "formulas leave out, so they are not drawn for it")
    if not 0 <= step < facts.n_steps:
        raise ValueError(f"the generation has no step {step}")
    columns = torch.tensor([facts.columns(r, step) for r in range(facts.batch_size)])
    real = torch.tensor([facts.is_token(r, step) for r in range(facts.batch_size)])
    rope = config.positions == "rope" and getattr(config, "family", "") not in ("hf", "module")
    names = {"Q": act_name("rot_q" if rope else "q", layer), "K": act_name("k_all", layer),
             "V": act_name("v_all", layer), "S": act_name("masked_scores", layer), "P": act_name("pattern", layer),
             "O": act_name("z", layer)}
    normed = {(kind, L): act_name(kind, L) for kind in NORMED for L in range(config.n_layer)}
    seen: dict[str, torch.Tensor] = {}
    me = threading.get_ident()

    def keep(name: str):
        def hook(module, args, output):  # noqa: ARG001 - a forward hook's signature
            if threading.get_ident() == me and isinstance(output, torch.Tensor) and output.requires_grad:
                seen[name] = output
            return None
        return hook

    def start_graph(module, args, output):  # noqa: ARG001 - the embeddings: where the graph starts
        if threading.get_ident() == me and isinstance(output, torch.Tensor) and not output.requires_grad:
            return output.detach().requires_grad_()
        return None

    handles = []
    try:
        for name in {*names.values(), *normed.values()}:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                continue  # a hook point this architecture does not have (a parallel block has no resid_mid)
            handles.append(module.register_forward_hook(keep(name)))
        handles.append(model.get_submodule(act_name("embed")).register_forward_hook(start_graph))
        with torch.enable_grad():
            logits = model(columns, padding_mask=None if bool(real.all()) else real)
            value = _loss(logits, columns, real, facts, step, loss)
            # gradients of the recorded tensors only: no parameter's .grad is filled (or allocated)
            wanted = list(seen)
            grads = torch.autograd.grad(value, [seen[n] for n in wanted], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    got = {n: g for n, g in zip(wanted, grads) if g is not None}
    missing = [n for n in names.values() if n not in got]
    if missing:
        raise ValueError(f"the backward pass reached no gradient at {', '.join(missing)}")
    return _head({n: t.detach() for n, t in seen.items()}, got, names, normed, config, layer, head, batch, loss,
                 float(value.detach()))


def _loss(logits: torch.Tensor, columns: torch.Tensor, real: torch.Tensor, facts, step: int, loss: str) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, t, V]
    if loss == GRADIENT_LOSSES[0]:  # every real position predicting the next real one
        pairs = real[:, :-1] & real[:, 1:]
        picked = logp[:, :-1].gather(-1, columns[:, 1:, None])[..., 0]  # [B, t − 1]
        return -(picked[pairs]).mean()
    choice = facts.step(step).sampling
    if choice is None:
        raise ValueError(f"step {step} chose no token: there is no log-probability to differentiate")
    rows = [logp[r, facts.last_token_column(r, step), choice.tokens[r]] for r in range(columns.shape[0])]
    return -torch.stack(rows).mean()


def _head(seen, got, names, normed, config, layer: int, head: int, batch: int, loss: str,
          value: float) -> HeadGradients:
    H = seen[names["Q"]].shape[1]
    G = seen[names["K"]].shape[1]
    group = H // G
    g = head // group
    q, k, v = (seen[names[x]][batch].double() for x in ("Q", "K", "V"))  # [H|G, t, d]
    p = seen[names["P"]][batch].double()  # [H, n, t]
    scale = getattr(config, "attn_scale", None) or q.shape[-1] ** -0.5
    grad = {x: got[names[x]][batch].double() for x in names}
    members = range(g * group, (g + 1) * group)  # the query heads sharing key/value head g

    def per_head(h: int) -> dict[str, torch.Tensor]:
        g_o = grad["O"][h]
        g_p = g_o @ v[g].T  # G_P = G_O·Vᵀ
        g_s = p[h] * (g_p - (p[h] * g_p).sum(dim=-1, keepdim=True))  # (diag(P_r) − P_r P_rᵀ)·G_P,r, row by row
        return {"G_O": g_o, "G_V": p[h].T @ g_o, "G_P": g_p, "G_S": g_s, "G_Q": scale * g_s @ k[g],
                "G_K": scale * g_s.T @ q[h]}

    mine = per_head(head)
    shared = [per_head(h) for h in members]
    formula = dict(mine)
    formula["G_V"] = sum((x["G_V"] for x in shared), torch.zeros_like(mine["G_V"]))  # K, V serve the whole group
    formula["G_K"] = sum((x["G_K"] for x in shared), torch.zeros_like(mine["G_K"]))
    autograd = {"G_O": grad["O"][head], "G_V": grad["V"][g], "G_P": grad["P"][head], "G_S": grad["S"][head],
                "G_Q": grad["Q"][head], "G_K": grad["K"][g]}
    norms: dict[str, list[float]] = {kind: [] for kind in NORMED}
    for (kind, _), name in sorted(normed.items(), key=lambda item: (item[0][0], item[0][1])):
        g_x = got.get(name)
        norms[kind].append(float(g_x.norm()) if g_x is not None else float("nan"))
    return HeadGradients(loss, value, layer, head, batch, formula, autograd, norms)
