"""`python -m pagedkv.cli`: the `pagedkv` command (see main.py)."""

import sys

from pagedkv.cli.main import main

sys.exit(main())
