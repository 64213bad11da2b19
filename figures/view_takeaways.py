"""Say it first: the one-line takeaway and the two or three key numbers of the Shapes, Causal mask, Next token, What
if (head ablation, activation patching), Compare runs, Worked example and Inspector views
(``gui.takeaway.takeaway`` shows them). Each is a function of the numbers it is about, so what the line says holds
at every step and setting; text from outside the app (token labels, record names) is made inert for markdown."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from gpt_shape_tracer.figures.common import facts_of, fed_again, inert, prompt_positions, shape_text
from gpt_shape_tracer.figures.mask import OWN_KEY, MaskFacts, compressed_mask_sentence
from gpt_shape_tracer.figures.worked import Worked
from gpt_shape_tracer.tracer import PatchingResult, Trace


@dataclass(frozen=True)
class Takeaway:
    sentence: str  # markdown, shown bold
    metrics: tuple[tuple[str, str], ...] = ()  # (label, value), plain text
    details: str | None = None  # the longer explanation, folded


def quoted(label: str) -> str:
    return f"“{inert(label)}”"


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


# -- Shapes ----------------------------------------------------------------------------------------------
def shapes_takeaway(trace: Trace, step: int) -> Takeaway:
    """What step ``step`` fed and produced, in [B, n, d] terms, and what its records hold."""
    facts = facts_of(trace)
    forward = facts.step(step).forward
    config = trace.config
    B, n, t = facts.batch_size, forward.n, forward.t
    records = trace.filter(step=step)
    largest = max(records, key=lambda r: r.nbytes, default=None)
    P = prompt_positions(trace)
    if P:  # CPM-Ant: its learned prompt positions run through every block before the tokens, and have no logits
        sentence = (f"Step {step} runs the model's P = {P} learned prompt positions and n = {n} token position"
                    f"{'s' if n != 1 else ''} of each of B = {B} sequence{'s' if B != 1 else ''} through "
                    f"{config.n_layer} blocks: every block takes and gives back [B, P + n, d] = "
                    f"{shape_text((B, P + n, config.d_model))}, its attention weighs P + t = {P + t} key positions, "
                    f"and the logits are the tokens' only, [B, n, V] = {shape_text((B, n, config.vocab_size))}.")
    else:
        # without a cache a step after the prefill feeds every position again: only the newest of them is new
        fed = (f"n = {n} positions (no cache: the newest and, again, the {n - 1} before it)" if fed_again(trace, step)
               else f"n = {n} new position{'s' if n != 1 else ''}")
        sentence = (f"Step {step} runs {fed} of each of B = {B} "
                    f"sequence{'s' if B != 1 else ''} through {config.n_layer} blocks: every block takes and gives "
                    f"back [B, n, d] = {shape_text((B, n, config.d_model))}, its attention weighs t = {t} key "
                    f"positions, and the logits are [B, n, V] = {shape_text((B, n, config.vocab_size))}.")
    metrics: list[tuple[str, str]] = [("records at this step", f"{len(records):,}"),
                                      ("their size", size_text(sum(r.nbytes for r in records)))]
    if largest is not None:  # its name in the sentence: as a metric's value it was cut short at 1600 px
        sentence += f" The largest record is {largest.name} ({size_text(largest.nbytes)})."
        metrics.append(("the largest record", size_text(largest.nbytes)))
    return Takeaway(inert(sentence), tuple(metrics))


# -- Causal mask -----------------------------------------------------------------------------------------
def mask_takeaway(facts: MaskFacts) -> Takeaway:
    """What M does at this step, from its counted cells (``figures.mask.mask_facts``)."""
    cells = facts.n * facts.t
    if facts.compressed_masked >= 0:  # compressed attention: its columns are no positions
        return Takeaway(compressed_mask_sentence(facts.n, facts.t, facts.compressed_masked, facts.compressed_entries),
                        (("query rows n", str(facts.n)), ("key columns t", str(facts.t)),
                         ("−∞ cells", str(facts.compressed_masked))))
    if not facts.counted:
        return Takeaway(f"M is {shape_text(facts.shape)} at this step; its values were not kept, so its cells are "
                        "not counted.", (("query rows n", str(facts.n)), ("key columns t", str(facts.t))))
    if facts.bidirectional:  # CPM-Ant: no causal mask, every position of a forward seeing every other
        fewest, most = facts.keys_seen
        seen = str(fewest) if fewest == most else f"{fewest}–{most}"
        return Takeaway(f"{facts.masked} of the {cells} scores are −∞: this model's mask is not causal, each query row "
                        f"seeing {'all ' if fewest == most == facts.t else ''}{seen} key(s), those after it included.",
                        (("−∞ cells", f"{facts.masked} of {cells}"), ("keys each row sees", seen)),
                        facts.explanation())
    if facts.stream:  # BLT's cross-attention, its patches: rows and columns of its own streams, no cause by place
        fewest, most = facts.keys_seen
        seen = str(fewest) if fewest == most else f"{fewest}–{most}"
        return Takeaway(f"{facts.masked} of the {cells} scores are −∞ by this block's own mask, which lets each query "
                        f"row see {seen} key(s); its rows and columns are positions of its own streams, so no cell is "
                        "hidden for where it sits in the text.",
                        (("−∞ cells", f"{facts.masked} of {cells}"), ("keys each row sees", seen)),
                        facts.explanation())
    if facts.decode:
        sentence = (f"A cached decode step computes one query row, the newest position: causality hides none of its "
                    f"t = {facts.t} keys")
        # only the causes that hid a key at this step are named: a model without a window has no window to blame
        causes = [(count, short, long) for count, short, long in (
            (facts.padding_key, "padding", "because the key is padding"),
            (facts.window, "outside the sliding window", "because the key is outside the sliding window"),
            (facts.indexer, "not chosen by the indexer", "because the indexer did not choose the key"),
            (facts.own, "the query's own key", OWN_KEY)) if count]
        hidden = sum(count for count, _, _ in causes)
        if len(causes) > 1:
            sentence += f"; {hidden} of them are −∞ ({', '.join(f'{c} {short}' for c, short, _ in causes)})."
        elif causes:
            sentence += f"; {hidden} of them are −∞ {causes[0][2]}."
        else:
            sentence += "."
    elif facts.future:
        sentence = (f"{facts.future} of the {cells} scores are −∞ because the key comes after the query: row i "
                    "weighs keys up to its own position only")
        sentence += (f"; {facts.padding_key} more are −∞ because the key is padding, so each real row i of a padded "
                     "sequence weighs only its real keys up to i" if facts.padding_key else "")
        sentence += f"; {facts.own} more are −∞ {OWN_KEY}." if facts.own else "."
    else:
        sentence = f"No score of these {cells} is hidden for coming after its query."
    metrics = [("−∞ cells", f"{facts.masked} of {cells}"), ("future keys", str(facts.future))]
    if facts.padding_key:
        metrics.append(("padding keys", str(facts.padding_key)))
    if facts.window:
        metrics.append(("outside the window", str(facts.window)))
    if facts.indexer:
        metrics.insert(2, ("not chosen by the indexer", str(facts.indexer)))
    return Takeaway(sentence, tuple(metrics[:3]), facts.explanation())


# -- Next token ------------------------------------------------------------------------------------------
def next_token_takeaway(trace: Trace, step: int, row: int) -> Takeaway | None:
    """What step ``step`` chose for sequence ``row``, how sure the final distribution was, and the runner-up;
    None when it chose nothing (its logits were not finite)."""
    facts = facts_of(trace)
    choice = facts.step(step).sampling
    if choice is None:
        return None
    chosen, p = choice.labels[row], choice.probs[row]
    final = choice.stage_probs[row][-1]  # [K] under the final distribution, the candidates' order
    others = [(prob, label) for token, label, prob in zip(choice.candidates[row], choice.candidate_labels[row], final)
              if token != choice.tokens[row]]
    runner = max(others, default=None)
    how = "greedy decoding took the most probable" if facts.info.sampling.greedy else "sampling drew"
    sentence = f"At step {step} {how}: {quoted(chosen)} with p = {p:.3f}"
    sentence += f"; the runner-up {quoted(runner[1])} had {runner[0]:.3f}." if runner else "."
    metrics = [("p of the chosen token", f"{p:.3f}")]
    if runner:
        metrics.append(("p of the runner-up", f"{runner[0]:.3f}"))
    metrics.append(("tokens left to choose from", f"{choice.kept[row][-1]:,}"))
    return Takeaway(sentence, tuple(metrics))


# -- What if ---------------------------------------------------------------------------------------------
def chosen_from(trace: Trace, step: int, row: int) -> int:
    """The position, among the step's n query rows, whose logits chose sequence ``row``'s token: its last real
    token (before any right padding)."""
    return facts_of(trace).last_token_column(row, step) - first_query(trace, step)


def first_query(trace: Trace, step: int) -> int:
    """The position of the step's first query row: t − n."""
    forward = facts_of(trace).step(step).forward
    return forward.t - forward.n


def ablation_takeaway(loss_before: float, loss_after: float, described: tuple[str, ...], loss_text: str,
                      moved: int, heads: int) -> Takeaway:
    change = loss_after - loss_before
    verb = "raises" if change > 0 else "lowers" if change < 0 else "leaves"
    sentence = (f"With {inert('; '.join(described))}, the loss on {inert(loss_text)} {verb} "
                + (f"from {loss_before:.3f} to {loss_after:.3f} nats ({change:+.3f})." if change else
                   f"unchanged at {loss_before:.3f} nats."))
    return Takeaway(sentence, (("loss with these heads off", f"{loss_after:.3f} nats"),
                               ("loss as the model is", f"{loss_before:.3f} nats"),
                               ("heads whose pattern moved", f"{moved} of {heads}")))


def patching_takeaway(result: PatchingResult, columns: tuple[str, ...] | list[str], clean_label: str,
                      corrupted_label: str) -> Takeaway:
    """Activation patching in one line, from its result: the cell whose clean activation restores the largest share
    of the logit difference between the two answers, and how many cells restore at least half of it. ``columns``:
    the result's columns (the clean prompt's positions, or the heads); the labels are the answers' tokens."""
    clean, corrupted = quoted(clean_label), quoted(corrupted_label)
    if result.clean_answer == result.corrupted_answer:
        return Takeaway(f"Both prompts' top token is {clean}: there is no logit difference for patching to restore; "
                        "change the corrupted prompt until its answer differs.",
                        (("clean answer", clean_label), ("corrupted answer", corrupted_label)))
    restored = result.restored.double()  # [n_layer, positions or heads]
    width = restored.shape[1]
    patched = ~restored.isnan()  # a hybrid model's layers without attention have no heads: their rows are NaN
    best = int(restored.masked_fill(~patched, float("-inf")).argmax())
    layer, column = divmod(best, width)
    share = float(restored[layer, column])
    cells = int(patched.sum())
    half = int((restored >= 0.5).sum())
    cell = (f"the residual stream entering block {layer} at position {inert(columns[column])}"
            if result.kind == "resid_pre" else f"head L{layer} {inert(columns[column])}'s output")
    span = (f"the logit difference z[{clean}] − z[{corrupted}] ({result.corrupted_diff:.2f} on the corrupted prompt, "
            f"{result.clean_diff:.2f} on the clean one)")
    if share > 0:
        sentence = (f"Patching {cell} from the clean run restores {share:.0%} of {span}; no other of the {cells} "
                    f"cells restores more, and {half} of them restore at least half.")
    else:
        sentence = (f"No single patch moves {span} towards the clean answer: of the {cells} cells, the largest share "
                    f"restored is {share:.0%}, at {cell}.")
    return Takeaway(sentence, (("largest share restored", f"{share:.0%}"),
                               ("cells restoring half or more", f"{half} of {cells}"),
                               ("logit difference, clean → corrupted",
                                f"{result.clean_diff:.2f} → {result.corrupted_diff:.2f}")))


# -- Compare runs ----------------------------------------------------------------------------------------
def compare_takeaway(frame: pd.DataFrame, label: str, first_divergence: str | None) -> Takeaway:
    """``tracer.diff_traces``'s frame in one line: where the runs first part, or that none does."""
    compared = frame[frame["compared"]]
    diverged = int(compared["diverged"].sum()) if len(compared) else 0
    largest = float(compared["max_abs_delta"].max()) if len(compared) else float("nan")
    if not len(compared):
        sentence = f"Compared with {inert(label)}: no record could be compared value by value."
    elif first_divergence is not None:
        sentence = f"Compared with {inert(label)}: {first_divergence}"
    else:
        sentence = (f"Compared with {inert(label)}: no record diverges beyond its dtype's tolerance (largest |Δ| "
                    f"{largest:.3g}).")
    return Takeaway(sentence, (("records compared", f"{len(compared)} of {len(frame)}"),
                               ("diverged", str(diverged)),
                               ("largest |Δ|", f"{largest:.3g}" if len(compared) else "—")))


# -- Worked example --------------------------------------------------------------------------------------
def worked_takeaway(w: Worked) -> Takeaway:
    """Row q0 of A, and the gradient formula against autograd."""
    row = ", ".join(f"{x:.3f}" for x in w.a[0].tolist())
    delta = float((w.grad_v - w.grad_v_autograd).abs().max())
    sentence = (f"Query q0 weighs the keys ({row}): the softmax of its scores"
                + (" after the mask" if w.causal else "")
                + f"; ∂L/∂V = Aᵀ·∂L/∂O equals autograd's within {delta:.1e}.")
    return Takeaway(sentence, (("A row q0", row), ("o row q0", ", ".join(f"{x:.3f}" for x in w.o[0].tolist())),
                               ("max |formula − autograd|", f"{delta:.1e}")))


# -- Inspector -------------------------------------------------------------------------------------------
def inspector_takeaway(trace: Trace, step: int, name: str) -> Takeaway:
    rec = trace.record(name, step)
    stats = trace.stats(rec)
    shape = shape_text(rec.shape) + (f" = [{', '.join(rec.axes)}]" if rec.axes else "")
    sentence = f"{inert(name)} at step {step}: {shape}, {rec.numel:,} {rec.dtype} values"
    if stats is None:
        return Takeaway(sentence + "; its values were not kept, so only its shape is known.",
                        (("shape", shape_text(rec.shape)), ("size", size_text(rec.nbytes))))
    others = [f"{count:,} {what}" for count, what in ((stats.neg_inf, "−∞"), (stats.pos_inf, "+∞"),
                                                       (stats.nan, "NaN")) if count]
    finite = rec.numel - stats.neg_inf - stats.pos_inf - stats.nan
    if finite:
        sentence += ("; the " + (f"{finite:,} finite ones" if others else "values") + f" run from {stats.min:.4g} to "
                     f"{stats.max:.4g}, mean {stats.mean:.4g}")
    sentence += ("; " + ", ".join(others) if others else "") + "."
    return Takeaway(sentence, (("shape", shape_text(rec.shape)), ("mean ± std", f"{stats.mean:.4g} ± {stats.std:.4g}"),
                               ("size", size_text(rec.nbytes))))
