"""How the bundled story models were made: the story grammar they read (``_corpus.py``) and the training script
(``_train.py``; run it with ``python -m model.training [--family llama]``). Nothing else in model/ imports this."""

from gpt_shape_tracer.model.training._corpus import StoryGrammar, lexicon, stories
from gpt_shape_tracer.model.training._train import (
           HELDOUT_SEED,
           TRAIN_SEED,
           heldout_loss,
           main,
           token_stream,
           unigram_loss,
)

__all__ = ["HELDOUT_SEED", "TRAIN_SEED", "StoryGrammar", "heldout_loss", "lexicon", "main", "stories", "token_stream",
           "unigram_loss"]
