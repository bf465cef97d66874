"""``python -m stree.cli``: the same as the ``stree`` console script."""

import sys

from stree.cli import main

sys.exit(main())
