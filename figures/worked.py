"""A tiny attention forward and backward with numbers a person can edit and check by hand.

The defaults are the classic two-token example (d_k = d_v = 3): Q = [[1,0,1],[0,1,1]], K = [[1,1,0],
[1,0,1]], V = [[2,0,1],[1,1,0]], which give A ≈ [[0.359, 0.641], [0.5, 0.5]] and O = A·V; with
∂L/∂O = [[1,0,1],[0,1,0]] the gradient ∂L/∂V = Aᵀ·∂L/∂O. Every stage runs through ``model.attention`` —
the function the model itself runs — and the gradient is checked against autograd's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.heatmap import add, grid, style_axes
from gpt_shape_tracer.figures.plot import fitted, subplots
from gpt_shape_tracer.model.gpt import attention

DEFAULT_Q = [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]
DEFAULT_K = [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
DEFAULT_V = [[2.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
DEFAULT_GRAD_O = [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
MAX_SIDE = 12


class WorkedInputError(ValueError):
    """Matrices that do not fit together; the message says which and why."""


@dataclass(frozen=True)
class Worked:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_o: torch.Tensor
    qk: torch.Tensor  # QKᵀ
    scores: torch.Tensor  # QKᵀ/√d_k
    masked: torch.Tensor  # + M (equal to scores without the causal mask)
    a: torch.Tensor  # softmax
    o: torch.Tensor  # A·V
    grad_v: torch.Tensor  # Aᵀ·∂L/∂O, the formula
    grad_v_autograd: torch.Tensor  # what autograd computes for L = Σ O ⊙ ∂L/∂O
    causal: bool

    @property
    def gradient_agrees(self) -> float:
        return float((self.grad_v - self.grad_v_autograd).abs().max())


def _matrix(rows: list[list[float]], name: str) -> torch.Tensor:
    try:
        m = torch.tensor(rows, dtype=torch.float64)
    except (TypeError, ValueError):
        raise WorkedInputError(f"{name} must be a table of numbers") from None
    if m.dim() != 2 or 0 in m.shape or max(m.shape) > MAX_SIDE:
        raise WorkedInputError(f"{name} must have 1 … {MAX_SIDE} rows and columns, got {list(m.shape)}")
    if not bool(torch.isfinite(m).all()):
        raise WorkedInputError(f"{name} holds an empty or non-finite cell: every cell needs a number")
    return m


class _Stages:
    """Stands in for the attention module's hook points: keeps a copy of every stage that passes."""

    def __init__(self) -> None:
        self.stages: dict[str, torch.Tensor] = {}

    def __getattr__(self, name: str):
        if not name.startswith("hook_"):
            raise AttributeError(name)

        def keep(x: torch.Tensor) -> torch.Tensor:
            self.stages[name] = x.detach().clone()
            return x

        return keep


def compute(q: list[list[float]], k: list[list[float]], v: list[list[float]], grad_o: list[list[float]],
            causal: bool = False) -> Worked:
    Q, K, V, G = (_matrix(x, name) for x, name in ((q, "Q"), (k, "K"), (v, "V"), (grad_o, "∂L/∂O")))
    if Q.shape[1] != K.shape[1]:
        raise WorkedInputError(f"Q and K need the same number of columns (d_k): Q has {Q.shape[1]}, K {K.shape[1]}")
    if K.shape[0] != V.shape[0]:
        raise WorkedInputError(f"K and V need one row per key: K has {K.shape[0]} rows, V {V.shape[0]}")
    if G.shape != (Q.shape[0], V.shape[1]):
        raise WorkedInputError(f"∂L/∂O has the shape of O = [n, d_v] = {[Q.shape[0], V.shape[1]]}, got {list(G.shape)}")
    if causal and Q.shape[0] != K.shape[0]:
        raise WorkedInputError("the causal mask needs as many queries as keys")
    taps = _Stages()
    Vg = V.clone().requires_grad_(True)
    mask = None
    if causal:
        n = Q.shape[0]
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf)
    out, weights = attention(Q, K, Vg, mask, hooks=taps)
    stages = taps.stages
    (out * G).sum().backward()  # L = Σ O ⊙ ∂L/∂O, so ∂L/∂O is what the person typed
    assert Vg.grad is not None  # V requires grad and O depends on it: backward filled it
    return Worked(q=Q, k=K, v=V, grad_o=G, qk=stages["hook_qk"], scores=stages["hook_attn_scores"],
                  masked=stages.get("hook_masked_scores", stages["hook_attn_scores"]), a=weights.detach(),
                  o=out.detach(), grad_v=weights.detach().T @ G, grad_v_autograd=Vg.grad.detach(), causal=causal)


def _panel(fig: go.Figure, m: torch.Tensor, col: int, row: int, kind: str, x: str, y: str) -> None:
    g = grid(m, [f"{x}{j}" for j in range(m.shape[1])], [f"{y}{i}" for i in range(m.shape[0])])
    add(fig, g, kind, row=row, col=col, showscale=False)
    style_axes(fig, g, x_title="", y_title="", row=row, col=col, max_ticks=MAX_SIDE)


@fitted
def forward_figure(w: Worked) -> go.Figure:
    d_k = w.q.shape[1]
    titles = ("QKᵀ", f"S = QKᵀ/√{d_k}" + (" + M" if w.causal else ""), "A = softmax(S), row-wise", "O = A·V")
    fig = subplots(rows=1, cols=4, subplot_titles=titles, horizontal_spacing=0.06)
    _panel(fig, w.qk, 1, 1, "signed", "k", "q")
    _panel(fig, w.masked if w.causal else w.scores, 2, 1, "signed", "k", "q")
    _panel(fig, w.a, 3, 1, "amount", "k", "q")
    _panel(fig, w.o, 4, 1, "signed", "d", "q")
    fig.update_layout(height=max(220, 120 + 40 * w.q.shape[0]), margin={"t": 40, "l": 10, "r": 10, "b": 10})
    return fig


@fitted
def backward_figure(w: Worked) -> go.Figure:
    titles = ("∂L/∂O (given)", "Aᵀ", "∂L/∂V = Aᵀ·∂L/∂O", f"autograd's ∂L/∂V (max |Δ| {w.gradient_agrees:.1e})")
    fig = subplots(rows=1, cols=4, subplot_titles=titles, horizontal_spacing=0.06)
    _panel(fig, w.grad_o, 1, 1, "signed", "d", "q")
    _panel(fig, w.a.T, 2, 1, "amount", "q", "k")
    _panel(fig, w.grad_v, 3, 1, "signed", "d", "k")
    _panel(fig, w.grad_v_autograd, 4, 1, "signed", "d", "k")
    fig.update_layout(height=max(220, 120 + 40 * w.v.shape[0]), margin={"t": 40, "l": 10, "r": 10, "b": 10})
    return fig
