"""Suite-wide setup."""

# Decide TRITON_INTERPRET before any test module imports triton (transformers imports it too):
# without CUDA, Triton kernels run only under the interpreter.
import pagedkv.model_runner.triton_env  # noqa: F401
