"""What a model does, measured: the roles of attention heads (previous-token, induction, …: ``_heads.py``) and
what one forward costs in multiply-adds and bytes (``_costs.py``)."""

from gpt_shape_tracer.model.analysis._costs import (
    PARTS,
    ForwardCost,
    attention_overtakes_mlp,
    forward_cost,
    forward_parts,
)
from gpt_shape_tracer.model.analysis._heads import (
    HEAD_ROLES,
    ablated,
    ablation_effects,
    attention_patterns,
    induction_scores,
    previous_token_scores,
    repeat_loss,
    repeated_random_tokens,
    role_scores,
)

__all__ = ["HEAD_ROLES", "PARTS", "ForwardCost", "ablated", "ablation_effects", "attention_overtakes_mlp",
           "attention_patterns", "forward_cost", "forward_parts", "induction_scores", "previous_token_scores",
           "repeat_loss", "repeated_random_tokens", "role_scores"]
