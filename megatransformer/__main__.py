"""``python -m megatransformer``: the ``megatransformer`` command, where its script is not on PATH."""

import sys

from megatransformer.cli import main

sys.exit(main())
