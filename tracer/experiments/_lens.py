"""What each layer already predicts (the logit lens), and what each head and MLP adds to a logit
(direct logit attribution). Both read a step's recorded residual stream and apply the model's own final
norm and unembedding, so they need the model that made the trace (and check its weights digest).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import overload

import pandas as pd
import torch

from gpt_shape_tracer.model.gpt import GPT, act_name, block_attention, identity_of
from gpt_shape_tracer.model.sources import HFDecoder, input_device_of
from gpt_shape_tracer.tracer.reading import Trace

LENS_COLUMNS = ("layer", "position", "input", "top_token", "top_label", "top_prob", "final_token", "final_label",
                "final_prob", "final_rank", "is_token")


@overload
def _model(trace: Trace, model: GPT | None) -> GPT: ...


@overload
def _model(trace: Trace, model: GPT | HFDecoder | None) -> GPT | HFDecoder: ...


def _model(trace: Trace, model: GPT | HFDecoder | None) -> GPT | HFDecoder:
    """``model``, else the live model that made the trace; refused when there is none, when its weights are
    not the trace's, or when it is a module of your own (its final norm and unembedding are its own code)."""
    model = model if model is not None else trace.live_model
    if model is None:
        raise ValueError("this needs the model that made the trace: pass model=… (a loaded trace has no model)")
    if not isinstance(model, (GPT, HFDecoder)):
        raise ValueError("this reads the model's final norm and unembedding W_U; a module of your own computes "
                         "them in its own code, where the tracer cannot name them")
    if trace.model is not None and trace.model.weights_digest and \
            identity_of(model).weights_digest != trace.model.weights_digest:
        raise ValueError(f"the model given is not the one that made the trace ({trace.model.name}, "
                         f"{trace.model.weights_digest[:19]}): its weights differ")
    return model


def _index(what: str, value: object, count: int) -> int:
    """``value`` as an index in 0 … count − 1, else a ValueError naming the range: a negative row or token would
    otherwise read another row's numbers (Python's index from the end) without a word."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a whole number in 0 … {count - 1}, got {value!r}")
    try:
        i = operator.index(value)  # type: ignore[arg-type]  # int, or NumPy's and torch's integer scalars
    except TypeError:
        raise ValueError(f"{what} must be a whole number in 0 … {count - 1}, got {value!r}") from None
    if not 0 <= i < count:
        raise ValueError(f"{what} {i} is outside 0 … {count - 1}" if count else f"there is no {what} {i}: none was "
                         "recorded")
    return i


def _step_and_row(trace: Trace, step: object, row: object) -> tuple[int, int]:
    """The step and the sequence, each checked against what the trace holds."""
    step = _index("step", step, trace.n_steps)
    return step, _index("row (sequence)", row, trace.record(act_name("logits"), step).shape[0])


def _value(trace: Trace, name: str, step: int) -> torch.Tensor:
    value = trace.get(name, step)
    if value is None:
        raise ValueError(f"the values of {name} at step {step} were not kept (capture values, or raise the budget)")
    return value


def sampled_position(trace: Trace, step: int, row: int) -> int:
    """The query position whose logits chose this step's token (the last real one of a right-padded prompt)."""
    facts = trace.generation
    n = trace.record(act_name("logits"), step).shape[1]
    if facts is not None and step == 0 and facts.info.padding_side == "right":
        return facts.info.prompt_lengths[row] - 1
    return n - 1


@torch.no_grad()
def logit_lens(trace: Trace, step: int, row: int = 0, *, model: GPT | HFDecoder | None = None,
               label: Callable[[int], str] | None = None) -> pd.DataFrame:
    """One row per (layer, position): the residual stream after block ``layer`` put through the final norm
    and W_U — its top token and probability — and the rank and probability it gives the token the model
    finally chose (the step's chosen token at the position it was chosen from; elsewhere the final layer's
    top token). The last layer is the model's own logits."""
    model = _model(trace, model)
    step, row = _step_and_row(trace, step, row)
    paths = getattr(model.config, "block_paths", ())
    if paths:  # BLT: the patcher's, the encoder's, the global transformer's outputs are not the stream W_U reads
        lists = sorted({p.rpartition(".")[0] for p in paths})
        raise ValueError(f"this model's blocks lie in {len(lists)} lists of layers ({', '.join(lists)}), over "
                         "different streams: only the last list's output is the stream its final norm and W_U read, "
                         "so a lens over every block would read the others as what they are not")
    label = label or (lambda i: f"⟨{i}⟩")
    n_layer = model.config.n_layer
    device = input_device_of(model)  # recorded values are on the host; the final norm and W_U may not be
    lens = [model.unembed_residual(_value(trace, act_name("resid_post", L), step)[row].to(device)).float().cpu()
            for L in range(n_layer)]  # n_layer × [n, V]
    recorded = _value(trace, act_name("logits"), step)[row].float()
    if not torch.allclose(lens[-1], recorded, atol=1e-3, rtol=1e-3):  # the lens must end at the model's logits
        raise ValueError(
            f"the final norm and W_U applied to the last block's output give logits up to "
            f"{float((lens[-1] - recorded).abs().max()):.3g} away from the ones the model returned: its last steps "
            "are code the lens does not reproduce, so no layer's reading here would be this model's")
    final = lens[-1].argmax(-1)
    facts = trace.generation
    choice = facts.step(step).sampling if facts is not None else None
    chosen_at = sampled_position(trace, step, row)
    if choice is not None:
        final[chosen_at] = choice.tokens[row]
    n = final.numel()
    inputs = facts.labels(row, step)[-n:] if facts is not None else [""] * n
    is_token = facts.is_token(row, step)[-n:] if facts is not None else (True,) * n  # False: a padding position
    first = facts.step(step).forward.t - n if facts is not None else 0  # the rows are the step's last n columns
    rows = []
    for layer, logits in enumerate(lens):
        probs = torch.softmax(logits, dim=-1)  # [n, V]
        top_p, top = probs.max(dim=-1)
        final_p = probs.gather(1, final[:, None])[:, 0]
        final_rank = (probs > final_p[:, None]).sum(dim=-1)
        for p in range(n):
            rows.append({"layer": layer, "position": first + p, "input": inputs[p], "top_token": int(top[p]),
                         "top_label": label(int(top[p])), "top_prob": float(top_p[p]), "final_token": int(final[p]),
                         "final_label": label(int(final[p])), "final_prob": float(final_p[p]),
                         "final_rank": int(final_rank[p]), "is_token": bool(is_token[p])})
    return pd.DataFrame(rows, columns=list(LENS_COLUMNS))


@torch.no_grad()
def direct_logit_attribution(trace: Trace, step: int, row: int = 0, token: int | None = None, *,
                             model: GPT | None = None) -> pd.DataFrame:
    """Each component's direct share of one logit at the position the step's token was chosen from: the
    embeddings, every head (O_h·W_O^h), each W_O bias and each MLP, through the final norm with its scale
    frozen at this position, dotted with W_U's column for ``token`` (default: the chosen token). The shares
    plus the norm's constant add up to the logit; ``frame.attrs`` holds both."""
    model = _model(trace, model)
    if not isinstance(model, GPT):
        raise ValueError("direct logit attribution freezes the final norm's scale at a position, which needs the "
                         "norm written out as ours are; this model's final norm is transformers' code"
                         + ("" if getattr(model.config, "block_paths", ()) or getattr(model, "ln_final", 1) is None
                            else " (the logit lens works on it)"))  # a final norm not found: the lens says so
    step, row = _step_and_row(trace, step, row)
    facts = trace.generation
    if token is not None:
        token = _index("token", token, model.w_u.shape[0])
    if token is None:
        choice = facts.step(step).sampling if facts is not None else None
        if choice is None:
            raise ValueError("give token=…: this step chose no token")
        token = choice.tokens[row]
    p = sampled_position(trace, step, row)
    device = input_device_of(model)

    def on_model(name: str, at: int) -> torch.Tensor:  # a recorded value (on the host) where the weights are
        return _value(trace, name, at).to(device)

    w = model.w_u[token].float()  # [d]: W_U's column for the token
    n_layer = model.config.n_layer
    final = on_model(act_name("resid_post", n_layer - 1), step)[row, p].float()
    linear, constant = model.ln_final.linearized(final)

    def share(c: torch.Tensor) -> float:
        return float((linear(c.float()) * w).sum())

    parts: list[tuple[str, int | None, int | None, str, torch.Tensor]] = [
        ("embeddings", None, None, "embed", on_model(act_name("embed"), step)[row, p])]
    if trace.has(act_name("pos_embed"), step):
        parts[0] = ("embeddings", None, None, "embed", parts[0][4] + on_model(act_name("pos_embed"), step)[row, p])
    for layer in range(n_layer):
        attn = block_attention(model, layer)
        z = on_model(act_name("z", layer), step)[row:row + 1].float()
        heads = attn.head_outputs(z)[0, :, p]  # [H, d]
        for h in range(heads.shape[0]):
            parts.append((f"L{layer} H{h}", layer, h, "head", heads[h]))
        if attn.c_proj.bias is not None:
            parts.append((f"L{layer} W_O bias", layer, None, "bias", attn.c_proj.bias))
        parts.append((f"L{layer} MLP", layer, None, "mlp", on_model(act_name("mlp_out", layer), step)[row, p]))
    frame = pd.DataFrame([{"component": name, "layer": layer, "head": head, "kind": kind, "contribution": share(c)}
                          for name, layer, head, kind, c in parts])
    const = float((constant.float() * w).sum()) if constant is not None else 0.0
    frame.attrs.update(token=token, position=p, norm_constant=const, total=float(frame["contribution"].sum()) + const,
                       logit=float(_value(trace, act_name("logits"), step)[row, p, token]))
    return frame
