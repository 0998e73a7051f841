"""``python -m functrain`` is the ``functrain`` command."""

import sys

from functrain.commands.cli import main

sys.exit(main())
