"""`python -m pagedkv.llm`: `pagedkv generate`."""

import sys

from .cli import main

sys.exit(main())
