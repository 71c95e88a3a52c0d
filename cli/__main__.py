"""`python -m pagedkv.cli`: the `pagedkv` command (see main.py)."""

from pagedkv.cli.main import main
from pagedkv.process.lifecycle import exit_now

exit_now(main())
