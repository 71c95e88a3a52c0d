"""pagedkv.process: what every pagedkv process shares (the daemon and the runner): one logging
setup (structlog), the systemd notify protocol, and `launch` (starting them as systemd would, for
the demo, the tests and the LLM). Imports neither torch nor grpc."""
