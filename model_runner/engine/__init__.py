"""The runner's step engine: clients' steps checked against the daemon, prepared with the daemon,
merged into one forward, sampled.
"""
