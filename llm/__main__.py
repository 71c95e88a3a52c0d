"""`python -m pagedkv.llm`: `pagedkv generate`."""

import sys

from pagedkv.llm.cli import main

sys.exit(main())
