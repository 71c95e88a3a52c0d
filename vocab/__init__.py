"""pagedkv.vocab: the words every pagedkv process shares, torch-free (KV geometry and presets,
dtype names, byte units, block arithmetic, runtime paths, error causes); imports nothing else of
pagedkv.
"""
