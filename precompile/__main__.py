"""``python -m jitwarm.precompile`` runs the CLI."""

import sys

from jitwarm.precompile.cli import main

sys.exit(main())
