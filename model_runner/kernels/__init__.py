"""Paged attention: Triton kernels, their launchers, host checks and torch twins, and the
transformers attention implementation over them.
"""
