"""Backpropagation through attention, on a real head: ``attention_gradients(generation, step, layer, head, loss)``.

One forward of the step's token columns with gradients on, then the gradients of the loss the person picked:
the next-token cross-entropy over every pair of consecutive real tokens of a row (padding skipped, on either
side), or −log p of the token the step chose. Autograd's ∂L/∂x is read at the head's hook points, and each
gradient is computed again from its formula (O = P·V, P = softmax(S), S = s·QKᵀ + M, s = 1/√d_k unless the
model has its own):

    G_V = Pᵀ·G_O        G_P = G_O·Vᵀ        G_S,r = (diag(P_r) − P_r P_rᵀ)·G_P,r
    G_Q = s·G_S·K       G_K = s·G_Sᵀ·Q

G_O itself is autograd's (the formulas start from it: what comes after O is the rest of the model). For a
grouped-query model K and V serve H/G query heads, so autograd's ∂L/∂K and ∂L/∂V of a key/value head are the
sums over those heads; the formulas are summed the same way before they are compared. A soft-capped model
(Gemma 2: S = c·tanh(s·QKᵀ/c) + M) has one more factor between QKᵀ and the capped scores, the derivative of the
cap, so there G_Q = s·(G_S ⊙ (1 − tanh²(s·QKᵀ/c)))·K and G_K likewise. Also returned: ‖∂L/∂x‖
of the residual stream, the attention and the MLP outputs of every layer, where vanishing or exploding
gradients show. The generation is not touched: the forward runs untraced, on this thread only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer.capture import module_table
from gpt_shape_tracer.tracer.generation import TracedGeneration
from gpt_shape_tracer.tracer.reading import Trace
from gpt_shape_tracer.tracer.storage import TraceLog

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
    softcap: float | None = None  # c of a soft-capped model: its G_Q and G_K carry the cap's derivative
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # the forward's "P" [t, t] and "V" [t, d_head]
    pooled_over: int = 1  # the sequences ``loss`` is the mean over: every one of the batch, not ``batch``'s alone

    def loss_words(self) -> str:
        """What ``loss`` is the mean of, in words that hold for the batch it was computed over."""
        over = (f"over all {self.pooled_over} sequences of the batch, not sequence {self.batch}'s alone"
                if self.pooled_over > 1 else "over the one sequence")
        what = ("every pair of consecutive real tokens" if self.loss_name == GRADIENT_LOSSES[0]
                else "the token each sequence's step chose")
        return f"{self.loss_name}: the mean over {what}, {over}"

    GIVEN = ("G_O",)  # taken from autograd: the formulas start there

    def max_abs_delta(self, name: str) -> float:
        return float((self.formula[name] - self.autograd[name]).abs().max())

    @property
    def computed(self) -> tuple[str, ...]:
        """The gradients computed from their formulas (all but G_O, which is autograd's own)."""
        return tuple(name for name in self.formula if name not in self.GIVEN)


def attention_gradients(generation: TracedGeneration, step: int, layer: int, head: int, batch: int = 0,
                        loss: str = GRADIENT_LOSSES[0]) -> HeadGradients:
    """The backward pass of ``loss`` over the token columns step ``step`` saw, read at one head."""
    config = generation.model.config
    for what, index, count in (("step", step, generation.n_steps), ("layer", layer, config.n_layer),
                               ("head", head, config.n_head), ("batch", batch, len(generation.info.prompts))):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"{what} {index!r} is outside 0 … {count - 1}")
    rope = config.positions == "rope" and getattr(config, "family", "") not in ("hf", "module")
    names = {"Q": act_name("rot_q" if rope else "q", layer), "K": act_name("k_all", layer),
             "V": act_name("v_all", layer), "S": act_name("masked_scores", layer), "P": act_name("pattern", layer),
             "O": act_name("z", layer)}
    normed = {(kind, L): act_name(kind, L) for kind in NORMED for L in range(config.n_layer)}
    no_grad: set[str] = set()
    seen, got, value = _backward(generation, step, loss, {*names.values(), *normed.values()}, no_grad)
    missing = [n for n in names.values() if n not in got]
    if missing and all(n in no_grad for n in missing):  # HRM: all but its last low-level cycles run under no_grad
        raise ValueError(f"the model's own forward computes layer {layer} without gradients (torch.no_grad: it "
                         "trains through its last recurrent cycles only), so no backward pass reaches its attention")
    if missing:
        raise ValueError(f"the backward pass reached no gradient at {', '.join(missing)}")
    return _head(seen, got, names, normed, config, layer, head, batch, loss, value)


def gradient_trace(generation: TracedGeneration, step: int, loss: str = GRADIENT_LOSSES[0],
                   budget_bytes: int | None = None) -> Trace:
    """The gradients capture level: ∂L/∂x at every hook point of the model, for the backward pass of ``loss``
    over the token columns step ``step`` saw (all its positions, recomputed without the cache), as a trace of
    one step whose records are of kind "grad", named by their hook point, one per hook point the gradient reaches
    (in the order the forward reached them; the first record's note names the loss and any point not reached).
    Values are kept within ``budget_bytes`` (the generation's budget by default) and evicted to statistics past
    it, like a values trace; ``save_trace`` writes it in the same format."""
    model = generation.model
    modules = module_table(model)
    points = [info.path for info in modules if info.is_hook]
    started = time.perf_counter()
    _, got, value = _backward(generation, step, loss, set(points))
    seconds = time.perf_counter() - started
    log = TraceLog("gradients", generation.trace.log.budget_bytes if budget_bytes is None else budget_bytes)
    log.set_modules(modules)
    log.set_model(generation.trace.log.model)
    index_of = {info.path: i for i, info in enumerate(modules)}
    log.begin_step()
    for path in got:  # in the order the forward reached them, as a values trace lists them
        log.add_record(index_of[path], got[path], "grad", "", 0)
    unreached = [path for path in points if path not in got]
    if got:
        t = generation.facts.width(step)
        prompt = getattr(model.config, "prompt_positions", 0)  # CPM-Ant: its learned prompt positions run too
        log.add_note(0, f"∂L/∂x at every hook point the backward pass reaches: L = {loss} = {value:.6g}, over the "
                        f"{t} positions of generation step {step}"
                        + (f" (after the model's {prompt} learned prompt positions)" if prompt else "")
                        + ", recomputed without the KV cache."
                        + (f" No gradient reaches {', '.join(unreached)}: values the model reads but does not go "
                           "on to use (a copy is used instead)." if unreached else ""))
    log.end_step(seconds)
    trace = Trace(log)
    trace.attach_model(model)
    return trace


def _backward(generation: TracedGeneration, step: int, loss: str, keep: set[str],
              no_grad: set[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """One forward of step ``step``'s token columns with gradients on (untraced, on this thread only), and
    autograd's gradient of ``loss`` at each hook point in ``keep`` that the model has and the graph reaches:
    (values seen, gradients, L). No parameter's .grad is filled (or allocated). ``no_grad``, when given, collects
    the hook points the model's own forward reached with gradients turned off."""
    if loss not in GRADIENT_LOSSES:
        raise ValueError(f"loss must be one of {GRADIENT_LOSSES}, got {loss!r}")
    model, facts = generation.model, generation.facts
    if not 0 <= step < facts.n_steps:
        raise ValueError(f"the generation has no step {step}")
    device = generation.device  # the columns go where the weights are; the results come back to the host
    columns = torch.tensor([facts.columns(r, step) for r in range(facts.batch_size)], device=device)
    real = torch.tensor([facts.is_token(r, step) for r in range(facts.batch_size)], device=device)
    seen: dict[str, torch.Tensor] = {}
    me = threading.get_ident()

    def keeper(name: str):
        def hook(module, args, output):  # noqa: ARG001 - a forward hook's signature
            if threading.get_ident() != me or not isinstance(output, torch.Tensor):
                return None
            if no_grad is not None and not torch.is_grad_enabled():  # the model's own no_grad: nothing flows back
                no_grad.add(name)
            if not output.requires_grad and output.is_floating_point():
                # a value no earlier value flows into (the embeddings, the positions, the mask): a leaf of the
                # graph, so that its ∂L/∂x exists too. One that has earlier values in it is left as it is: a leaf
                # there would cut the paths through it out of every earlier gradient
                output = output.detach().requires_grad_()
                seen[name] = output
                return output
            if output.requires_grad:
                seen[name] = output
            return None
        return hook

    handles = []
    try:
        for name in {*keep, act_name("embed")}:  # the embeddings start the graph when the weights need no grad
            try:
                module = model.get_submodule(name)
            except AttributeError:
                continue  # a hook point this architecture does not have (a parallel block has no resid_mid)
            handles.append(module.register_forward_hook(keeper(name)))
        with torch.enable_grad():
            logits = model(columns, padding_mask=None if bool(real.all()) else real)
            value = _loss(logits, columns, real, facts, step, loss)
            wanted = list(seen)
            grads = torch.autograd.grad(value, [seen[n] for n in wanted], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    got = {n: g.cpu() for n, g in zip(wanted, grads) if g is not None}
    return {n: t.detach().cpu() for n, t in seen.items()}, got, float(value.detach())


def _loss(logits: torch.Tensor, columns: torch.Tensor, real: torch.Tensor, facts, step: int, loss: str) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, t, V]
    if loss == GRADIENT_LOSSES[0]:  # every real token predicting the next real token of its row
        # the next real token, not the next column: right padding puts a short prompt's padding between its
        # last token and the first generated one, and that pair is one of the sequence's next-token pairs
        picked = []
        for r in range(columns.shape[0]):
            where = real[r].nonzero()[:, 0]  # [k] the row's real columns, in order
            picked.append(logp[r, where[:-1], columns[r, where[1:]]])  # [k − 1]
        return -torch.cat(picked).mean()
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
    cap = getattr(config, "attn_softcap", None)
    grad = {x: got[names[x]][batch].double() for x in names}
    members = range(g * group, (g + 1) * group)  # the query heads sharing key/value head g

    def per_head(h: int) -> dict[str, torch.Tensor]:
        g_o = grad["O"][h]
        g_p = g_o @ v[g].T  # G_P = G_O·Vᵀ
        g_s = p[h] * (g_p - (p[h] * g_p).sum(dim=-1, keepdim=True))  # (diag(P_r) − P_r P_rᵀ)·G_P,r, row by row
        g_raw = g_s  # the gradient at s·QKᵀ: G_S itself, unless a soft-cap sits between
        if cap:  # S = c·tanh(s·QKᵀ/c) + M: ∂S/∂(s·QKᵀ) = 1 − tanh²(s·QKᵀ/c), element by element
            g_raw = g_s * (1 - torch.tanh(scale * (q[h] @ k[g].T) / cap) ** 2)
        return {"G_O": g_o, "G_V": p[h].T @ g_o, "G_P": g_p, "G_S": g_s, "G_Q": scale * g_raw @ k[g],
                "G_K": scale * g_raw.T @ q[h]}

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
    return HeadGradients(loss, value, layer, head, batch, formula, autograd, norms, softcap=cap,
                         values={"P": p[head], "V": v[g]}, pooled_over=int(seen[names["Q"]].shape[0]))
