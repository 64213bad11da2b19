"""``python -m model.training``: train a bundled story model (``_train.py`` says how)."""

from gpt_shape_tracer.model.training._train import main

main()
