"""``python -m model.training``: train a bundled story model (``_train.py`` says how)."""

from model.training._train import main

main()
