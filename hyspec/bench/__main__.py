"""`python -m hyspec.bench ...` (same as `hyspec bench ...`)."""

import sys

from hyspec.bench.cli import main

sys.exit(main())
