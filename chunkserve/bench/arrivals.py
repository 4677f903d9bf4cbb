"""When each request is sent: Poisson, bursty (gamma) or all at once.

As in `vllm bench serve`: inter-arrival gaps are gamma-distributed with shape
`burstiness` and mean 1 / `request_rate`. Shape 1.0 is the exponential distribution (a
Poisson process); below 1 the arrivals come in bursts with long gaps between them, above
1 they are more evenly spaced. An infinite rate sends every request at time 0 (use it with
--max-concurrency for a fixed-concurrency closed loop).
"""

from __future__ import annotations

import math
import random


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds from the start of the run, non-decreasing, first one 0."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf for all at once), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    scale = 1.0 / (request_rate * burstiness)  # mean = shape * scale = 1 / rate
    times, now = [], 0.0
    for i in range(n):
        if i:
            now += rng.gammavariate(burstiness, scale)
        times.append(now)
    return times
