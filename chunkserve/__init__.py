"""chunkserve: an LLM inference server built around chunked prefill.

This package holds the generated gRPC stubs (chunkserve.v1, chunkserve.executor.v1), the
flag helpers and the `chunkserve` command line. It imports no torch.
"""
__version__ = "0.1.0"
