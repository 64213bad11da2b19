"""A generation as the views read it: what it is, what each step fed and chose, and derived tables.

Every fact has one source: ``GenerationInfo`` (fixed at the start) and one
``GenerationStep`` per completed step. The padded token matrix at a step is not
stored a second time; it is the prompt columns plus the tokens chosen before
that step.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpt_shape_tracer.tracer.storage.records import GenerationInfo, GenerationStep, RecomputeComparison, SamplingRecord


@dataclass(frozen=True)
class GenerationFacts:
    info: GenerationInfo
    steps: tuple[GenerationStep, ...]
    comparisons: dict[int, RecomputeComparison]

    @property
    def batch_size(self) -> int:
        return self.info.batch_size

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    def step(self, step: int) -> GenerationStep:
        if not 0 <= step < len(self.steps):
            raise KeyError(f"the generation has no step {step} (it has {len(self.steps)})")
        return self.steps[step]

    def width(self, step: int) -> int:
        """Columns of the padded token matrix when ``step`` ran: the prompt and the tokens chosen before."""
        return self.info.prompt_width + step

    def columns(self, row: int, step: int) -> tuple[int, ...]:
        """Token ids of sequence ``row``'s columns as the forward of ``step`` saw them (padding included)."""
        ids, _, _ = self.info.padded_prompt(row)
        return ids + tuple(choice.tokens[row] for _, choice in self._chosen(step))

    def is_token(self, row: int, step: int) -> tuple[bool, ...]:
        """Which of those columns are real tokens (False: padding)."""
        _, real, _ = self.info.padded_prompt(row)
        return real + (True,) * len(self._chosen(step))

    def last_token_column(self, row: int, step: int) -> int:
        """The column of the last real token ``step`` saw in sequence ``row``: the row its next token is chosen
        from (before any right padding)."""
        return max(j for j, real in enumerate(self.is_token(row, step)) if real)

    def labels(self, row: int, step: int) -> tuple[str, ...]:
        """Display labels of those columns (padding shows as ⟨pad⟩)."""
        _, _, labels = self.info.padded_prompt(row)
        return labels + tuple(choice.labels[row] for _, choice in self._chosen(step))

    def chosen_through(self, row: int, step: int) -> tuple[tuple[str, float, int], ...]:
        """(label, probability, step) of each token chosen at steps 0 … ``step``."""
        return tuple((choice.labels[row], choice.probs[row], number) for number, choice in self._chosen(step + 1))

    def _chosen(self, step: int) -> tuple[tuple[int, SamplingRecord], ...]:
        """(step, its choice) of the steps before ``step`` that chose a token (a step whose logits were not
        finite chose none)."""
        return tuple((s.step, s.sampling) for s in self.steps[:step] if s.sampling is not None)

    def padding_columns(self, row: int, step: int) -> list[int]:
        return [j for j, real in enumerate(self.is_token(row, step)) if not real]
