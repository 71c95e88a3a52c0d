"""`python -m pagedkv.model_runner`: the runner process (see process/cli.py)."""

import sys

from pagedkv.model_runner.process.cli import main

sys.exit(main())
