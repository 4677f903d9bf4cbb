"""`chunkserve tune`: replay a request log through the real scheduler with a simulated clock.

    cost.py     step-time cost model fitted from a `--step-trace-file` JSON-lines trace
    replay.py   request log (bench --result-json or step trace) and the replay itself
    calibrate.py  `--calibrate`: a designed run against a live server (the bench's runner)
                  that records a step trace whose steps spread the cost model's features
    plot.py     `--plot`: predicted P99 ITL vs short-request P99 TTFT per setting (matplotlib)
    cli.py      the grid of settings, the SLO filter, the table and the recommended flags

No torch and no numpy: the scheduler's own dependencies only (docs/tuning.md teaches it).
"""
