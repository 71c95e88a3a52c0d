"""Typed async clients of the daemon (PoolClient, Session) and of the runner (RunnerClient):
records in, records out, the retry rules of kvpool.proto.
"""
