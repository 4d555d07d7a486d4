"""``python -m sco.cli``: the ``sco`` command."""

import sys

from sco.cli import main

sys.exit(main())
