"""The `pagedkv runner` process: command line, gRPC server and servicer, metrics."""
