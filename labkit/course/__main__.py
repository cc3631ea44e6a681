"""python -m labkit.course: see labkit/course/__init__.py."""

import sys

from . import main

sys.exit(main())
