"""The `pagedkv` command: one entry on top of every part (main.py)."""
