"""The app's decoding strategies, for the Beam search tab (gui/beams.py): beam search on the live generation's
model and prompts, beside greedy decoding of the same prompts (what one beam would have said); speculative
(assisted) decoding of its first prompt, drafted by a bundled model or by prompt lookup."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpt_shape_tracer.model import generate
from gpt_shape_tracer.tracer import BeamSearch, SpeculativeDecoding

MAX_APP_BEAMS = 8
MAX_APP_NEW_TOKENS = 32
TRACE_BUDGET = 64 * 2**20  # the beam run's own trace: shapes only (the views read its steps, not its values)
# what a Decoding run may hold while it runs, reserved from the server's ledger first: a beam run's trace and its
# key snapshots (BeamSearch keeps at most 64 MiB of them), or a speculative run's two traces
DECODING_RESERVE_BYTES = 3 * TRACE_BUDGET


@dataclass(frozen=True)
class BeamRun:
    """A finished beam search and, per prompt, greedy decoding's continuation cut after its first end-of-sequence
    token (as a beam's hypothesis is)."""

    search: BeamSearch
    greedy_texts: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        """What the run keeps in memory: its trace's values and the steps' key snapshots."""
        snapshots = sum(int(t.numel() * t.element_size()) for s in self.search.steps
                        for t in (s.keys_before, s.keys_after) if t is not None)
        return self.search.trace.log.bytes_kept + snapshots


def beam_run(model, tokenizer, prompts: Sequence[str], num_beams: int, new_tokens: int, length_penalty: float,
             early_stopping: bool | str) -> BeamRun:
    """Beam search to the end (``BeamSearchError`` for settings it cannot run with), and greedy beside it."""
    search = BeamSearch(model, tokenizer, list(prompts), num_beams, max_new_tokens=new_tokens,
                        length_penalty=length_penalty, early_stopping=early_stopping, capture="shapes",
                        budget_bytes=TRACE_BUDGET)
    search.run()
    search.close()
    greedy = []
    for prompt in prompts:
        ids = generate(model, tokenizer.encode(prompt), new_tokens)
        ends = [i for i, t in enumerate(ids) if t in search.eos_ids]
        greedy.append(tokenizer.decode(ids[: ends[0] + 1] if ends else ids))
    return BeamRun(search, tuple(greedy))


MAX_APP_DRAFT_TOKENS = 10


def speculative_run(model, tokenizer, prompt: str, new_tokens: int, draft_tokens: int, *, assistant=None,
                    schedule: str = "constant") -> SpeculativeDecoding:
    """Assisted decoding to the end, drafted by ``assistant`` (a model sharing the vocabulary) or, without one, by
    prompt lookup of ``draft_tokens`` (``SpeculativeError`` for what it cannot run with). Shapes only: the views
    read its steps."""
    search = SpeculativeDecoding(model, tokenizer, prompt, assistant=assistant,
                                 prompt_lookup=None if assistant is not None else draft_tokens,
                                 max_new_tokens=new_tokens, num_assistant_tokens=draft_tokens, schedule=schedule,
                                 capture="shapes", budget_bytes=TRACE_BUDGET)
    search.run()
    search.close()
    return search
