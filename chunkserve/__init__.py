"""chunkserve: an LLM inference server built around chunked prefill.

This package is the top layer: the `chunkserve` command line, the client helpers, the
launcher and the bench. What the processes share (generated stubs, flags, tokens) is in
chunkserve_contracts, beneath scheduler_svc and executor_svc. It imports no torch.
"""

from chunkserve_contracts import __version__

__all__ = ["__version__"]
