"""pagedkv.process: what every pagedkv process shares (the daemon and the runner): one logging
setup (structlog) and the systemd notify protocol. Imports neither torch nor grpc."""
