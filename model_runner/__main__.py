"""`python -m pagedkv.model_runner`: the runner process (see process/cli.py)."""

from pagedkv.model_runner.process.cli import main
from pagedkv.process.lifecycle import exit_now

exit_now(main())
