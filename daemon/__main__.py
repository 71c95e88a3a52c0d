"""`python -m pagedkv.daemon`: `pagedkvd`, the daemon (see process/cli.py)."""

from pagedkv.daemon.process.cli import serve_main
from pagedkv.process.lifecycle import exit_now

exit_now(serve_main())
