"""`chunkserve tune`: replay a request log through the real scheduler with a simulated clock.

    cost.py     step-time cost model fitted from a `--step-trace-file` JSON-lines trace
    replay.py   request log (bench --result-json or step trace) and the replay itself
    cli.py      the grid of settings, the SLO filter, the table and the recommended flags

No torch and no numpy: the scheduler's own dependencies only (docs/tuning.md teaches it).
"""
