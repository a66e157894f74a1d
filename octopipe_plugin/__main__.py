"""`python -m octopipe_plugin` runs the CLI."""

import sys

from .cli import main

sys.exit(main())
