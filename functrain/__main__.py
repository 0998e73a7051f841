"""``python -m functrain`` is the ``functrain`` command."""

import sys

from functrain.cli import main

sys.exit(main())
