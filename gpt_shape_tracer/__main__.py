"""``python -m gpt_shape_tracer …`` is the ``gpt-shape-tracer`` command."""

import sys

from gpt_shape_tracer.cli import main

sys.exit(main())
