"""chunkserve_contracts: what the processes agree on, and the bottom layer of the code.

The generated gRPC stubs (`chunkserve_contracts.v1` for the public chunkserve.v1 API,
`chunkserve_contracts.executor.v1` for the internal step protocol), the flag and
environment-variable plumbing of the config dataclasses, the one registry shape, the bearer
tokens and the executor-ownership rules. scheduler_svc, executor_svc and kernels import
from here and from nothing above them; `chunkserve` (CLI, client, launcher, bench) sits on
top of all of them. No torch here.
"""

__version__ = "0.1.0"
