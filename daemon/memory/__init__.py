"""The daemon's device memory: the pool tensor, what holds a CPU pool's tmpfs, and capacity
planning.
"""
