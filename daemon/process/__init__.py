"""The pagedkvd process: settings (defaults, TOML, flags), server bring-up and drain, metrics and
probes, the command line.
"""
