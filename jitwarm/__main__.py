"""``python -m jitwarm`` runs the ``jitwarm`` command line (the package is a namespace: precompile, kernels, cache)."""

import sys

from jitwarm.precompile.cli import main

sys.exit(main())
