"""`python -m hyspec ...`: the `hyspec` command (hyspec.entry)."""

import sys

from hyspec.entry import main

sys.exit(main())
