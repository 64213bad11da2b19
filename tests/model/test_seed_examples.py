"""The seed's worked examples (002 §13.1 and §13.2), run through the model's own ``attention``.

The seed rounds its intermediates to three decimals, so its printed figures can
differ from the exact values in the third decimal: we assert within ±0.001.
"""

from __future__ import annotations

import torch

from gpt_shape_tracer.model import attention

Q = torch.tensor([[1.0, 0, 1], [0, 1, 1]])
K = torch.tensor([[1.0, 1, 0], [1, 0, 1]])
V = torch.tensor([[2.0, 0, 1], [1, 1, 0]])
SEED_TOL = 1e-3


def test_13_1_attention_weights_and_output():
    out, weights = attention(Q, K, V)
    assert torch.allclose(weights, torch.tensor([[0.359, 0.641], [0.500, 0.500]]), atol=SEED_TOL)
    assert torch.allclose(out, torch.tensor([[1.359, 0.641, 0.359], [1.500, 0.500, 0.500]]), atol=SEED_TOL)


def test_13_1_intermediate_stages_via_hooks():
    """QKᵀ = [[1,2],[1,1]] and S = QKᵀ/√3 = [[0.577, 1.155], [0.577, 0.577]]."""
    from torch import nn

    from gpt_shape_tracer.model import HookPoint

    seen: dict[str, torch.Tensor] = {}

    class Hooks(nn.Module):
        def __init__(self):
            super().__init__()
            for name in ("hook_qk", "hook_attn_scores", "hook_mask", "hook_masked_scores", "hook_pattern"):
                setattr(self, name, HookPoint())
                getattr(self, name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o))

    attention(Q, K, V, hooks=Hooks())
    assert torch.equal(seen["hook_qk"], torch.tensor([[1.0, 2.0], [1.0, 1.0]]))
    assert torch.allclose(seen["hook_attn_scores"], torch.tensor([[0.577, 1.155], [0.577, 0.577]]), atol=SEED_TOL)
    assert "hook_mask" not in seen  # no mask given, so no mask stage


def test_13_2_gradient_with_respect_to_values():
    v = V.clone().requires_grad_(True)
    out, weights = attention(Q, K, v)
    grad_out = torch.tensor([[1.0, 0, 1], [0, 1, 0]])
    out.backward(grad_out)
    seed_dv = torch.tensor([[0.359, 0.500, 0.359], [0.641, 0.500, 0.641]])
    assert torch.allclose(v.grad, seed_dv, atol=SEED_TOL)
    assert torch.allclose(v.grad, weights.detach().T @ grad_out, atol=1e-6)  # ∂L/∂V = Aᵀ·∂L/∂O


def test_causal_mask_zeroes_future_weights_like_the_seed_says():
    """Eq. (24): M_ij = −∞ for j > i gives exactly zero weight on future keys."""
    from gpt_shape_tracer.model import additive_mask

    mask = additive_mask(2, 0, None, torch.device("cpu"), torch.float32)[0, 0]
    _, weights = attention(Q, K, V, mask)
    assert weights[0, 1].item() == 0.0
    assert weights[0, 0].item() == 1.0
    assert torch.allclose(weights[1], torch.tensor([0.5, 0.5]), atol=SEED_TOL)
