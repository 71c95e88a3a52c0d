"""pagedkv.vocab: the words every pagedkv process shares, torch-free (KV geometry and presets,
dtype names, byte units, pool sizing, block arithmetic, runtime paths, error causes, the
vocabulary check of token ids); imports nothing else of pagedkv.
"""
