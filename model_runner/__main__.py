"""`python -m pagedkv.model_runner`: the runner process (see cli.py)."""

import sys

from .cli import main

sys.exit(main())
