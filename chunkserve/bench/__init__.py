"""`chunkserve bench`: a load generator and report for a running server, over gRPC.

    workloads.py    prompts of exact token lengths from real text: fixed, mixed, shared-prefix
    arrivals.py     send times: Poisson / gamma (burstiness) / all at once
    runner.py       the async gRPC client: per-request send, token and end times
    trace.py        optional Admin.WatchSteps step trace
    session.py      one measured run: check, warm up, trace, send
    metrics.py      TTFT / TPOT / ITL / E2EL, throughputs, goodput (vLLM's names)
    report.py       JSON reports, pooled rounds, headline ratios
    table.py        terminal tables
    plots.py        PNG plots (matplotlib, only when asked)
    servers.py      server flag strings -> executor / scheduler processes
    compare.py      --compare: configurations in alternating rounds
    capacity.py     --capacity: Sarathi-Serve's rate search under SLOs
    hf_baseline.py  --hf-baseline: HF generate, static batching (the only torch import)
    modes.py        the modes wired together
    cli.py          flags and the entry point

Nothing here imports torch unless the HF baseline runs.
"""
