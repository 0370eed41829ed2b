"""`python -m ft`: the `ft` command."""

import sys

from ft.cli import main

sys.exit(main())
