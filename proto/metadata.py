"""Metadata keys of the wire contract that the daemon, the runner and their clients share."""

# Trailing-metadata key naming the cause of a failed call, e.g. "SequenceNotFound"
# (kvpool.proto, "Retry rules"); a runner relays the daemon's causes under the same key.
ERROR_KEY = "pagedkv-error"
