"""Entry point for `python -m labkit`: see labkit.cli."""

import sys

from labkit.cli import main

sys.exit(main())
