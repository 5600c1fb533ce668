"""`python -m hyspec.cli ...` (what the --pp launcher and the tests run)."""

import sys

from hyspec.cli.dispatch import main

sys.exit(main())
