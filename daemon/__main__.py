"""`python -m pagedkv.daemon`: `pagedkvd`, the daemon (see process/cli.py)."""

import sys

from pagedkv.daemon.process.cli import serve_main

sys.exit(serve_main())
