"""python -m labkit.course: see labkit/course/__init__.py."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
