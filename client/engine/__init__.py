"""The scheduler engine: requests in, one runner step per iteration, outputs out; continuous
batching, parallel sampling and beam search, torch-free.
"""
