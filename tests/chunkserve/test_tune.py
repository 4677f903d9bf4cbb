"""`chunkserve tune`: the cost model, the replay through the real scheduler, the SLO choice, the CLI."""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.bench.metrics import per_request_lists
from chunkserve.bench.runner import RequestRecord
from chunkserve.bench.workloads import WorkloadSpec, build_workload
from chunkserve.cli import _serve_parser, main
from chunkserve.tune.calibrate import Limits, design
from chunkserve.tune.cli import Setting, best, parse_slo, summarize
from chunkserve.tune.cost import CostModel, TraceStep, features, fit_with_error, load_trace
from chunkserve.tune.replay import RequestSpec, load_requests, replay, requests_from_bench, requests_from_trace
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.policy import FCFS

TRUE = [2e-3, 1e-4, 5e-4, 2e-7, 3e-8]  # const, prefill, decode, decode context, prefill attention


def true_cost(seqs) -> float:
    return sum(c * x for c, x in zip(TRUE, features(seqs)))


def synthetic_trace(path, n_steps=200, seed=0, noise=0.0):
    """A step trace in the server's JSON-lines format (protobuf JSON: camelCase, int64 as
    strings, zero fields left out) whose step times follow TRUE."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n_steps):
            seqs = []
            for _ in range(rng.randint(0, 12)):  # decodes
                ctx = rng.randint(20, 3000)
                seqs.append((1, ctx, rng.randint(10, ctx)))
            for _ in range(rng.randint(0, 2)):  # prefill chunks
                prompt = rng.randint(50, 3000)
                c = rng.randint(0, prompt - 1)
                seqs.append((rng.randint(1, prompt - c), c, prompt))
            if not seqs:
                seqs.append((1, 100, 50))
            t = true_cost(seqs) * (1 + rng.uniform(-noise, noise))
            line = {
                "stepId": str(i),
                "timestamp": 1000.0 + i * 0.1,
                "stepNs": str(int(t * 1e9)),
                "executorNs": str(int(t * 0.9e9)),
                "seqs": [
                    {
                        "requestId": f"r{i}-{j}",
                        "numTokens": n,
                        **({"numComputedTokens": c} if c else {}),
                        "numPromptTokens": p,
                        **({"isPrefill": True} if c < p else {}),
                    }
                    for j, (n, c, p) in enumerate(seqs)
                ],
            }
            f.write(json.dumps(line) + "\n")


def linear_cost(const=1e-3, per_token=1e-4):
    return lambda seqs: const + per_token * sum(n for n, _, _ in seqs)


# ---- cost model ----------------------------------------------------------------------------


def test_fit_recovers_known_coefficients(tmp_path):
    synthetic_trace(tmp_path / "steps.jsonl")
    steps = load_trace(tmp_path / "steps.jsonl")
    assert len(steps) == 200
    model = CostModel.fit(steps)
    for got, want in zip(model.coef, TRUE):
        assert got == pytest.approx(want, rel=1e-3)
    _, median, p90, n_test = fit_with_error(steps)
    assert n_test == 40 and median < 1e-3 and p90 < 1e-3


def test_fit_error_reflects_noise_and_executor_target(tmp_path):
    synthetic_trace(tmp_path / "steps.jsonl", noise=0.1, seed=3)
    _, median, p90, _ = fit_with_error(load_trace(tmp_path / "steps.jsonl"))
    assert 0.01 < median < 0.1 and p90 < 0.2
    executor = CostModel.fit(load_trace(tmp_path / "steps.jsonl", target="executor"))
    assert executor.coef[1] == pytest.approx(TRUE[1] * 0.9, rel=0.1)


def test_fit_never_keeps_a_negative_coefficient(tmp_path):
    steps = load_trace_from([[(1, 100, 50)] * k for k in range(1, 30)], lambda seqs: 1e-3 + 1e-4 * len(seqs))
    model = CostModel.fit(steps)
    assert all(c >= 0 for c in model.coef)
    assert model.predict([(1, 100, 50)] * 10) == pytest.approx(2e-3, rel=0.05)


def load_trace_from(step_seqs, cost):
    return [TraceStep(features(s), cost(s)) for s in step_seqs]


# ---- replay --------------------------------------------------------------------------------


def test_replay_obeys_budget_and_decodes_first_and_returns_every_block():
    specs = [
        RequestSpec(0.0, 10, 6, "short"),
        RequestSpec(0.0, 7, 9, "short"),
        RequestSpec(0.003, 60, 4, "long"),
        RequestSpec(0.010, 5, 3, "short"),
    ]
    budget = 8
    config = SchedulerConfig(max_num_batched_tokens=budget)
    seen = []

    def check(sched, plan):
        assert plan.num_tokens <= budget
        kinds = [
            "d" if s.num_new_tokens == 1 and s.num_computed_tokens >= r.num_prompt_tokens else "p"
            for s, r in zip(plan.seqs, sched.step_stats.requests)
        ]
        assert "".join(kinds) == "d" * kinds.count("d") + "p" * kinds.count("p"), "a prefill before a decode"
        # Every request that is decoding gets its token in every step (nothing stalls it).
        decoding = {r.request_id for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens}
        assert decoding <= {s.request_id for s in plan.seqs}
        seen.append(kinds)

    result = replay(specs, config, linear_cost(), num_blocks=64, block_size=4, on_plan=check)
    assert [len(r.token_times) for r in result.requests] == [6, 9, 4, 3]
    assert result.free_blocks_at_end == result.num_blocks == 64
    assert result.num_preemptions == 0
    assert any(k.count("d") and k.count("p") for k in seen), "no step mixed decodes with a prefill chunk"
    # The long prompt (60 tokens) is chunked: its prefill takes several steps under the budget.
    assert sum(s.num_prefill_tokens for s in result.steps) == 10 + 7 + 60 + 5
    assert max(s.num_prefill_tokens for s in result.steps) <= budget
    # The clock is the cost model's: each step lasts 1 ms + 0.1 ms per token.
    for s in result.steps:
        assert s.seconds == pytest.approx(1e-3 + 1e-4 * (s.num_prefill_tokens + s.num_decode_tokens))


def test_replay_follows_the_real_scheduler(monkeypatch):
    """A change to scheduling changes the replay: with FCFS's waiting order reversed, of two
    requests queued together the later one gets its first token first."""
    specs = [RequestSpec(0.0, 12, 3), RequestSpec(0.0, 12, 3), RequestSpec(0.0, 12, 3)]
    config = SchedulerConfig(max_num_batched_tokens=12, max_num_partial_prefills=1, max_long_partial_prefills=1)

    def first_token_order():
        r = replay(specs, config, linear_cost(), num_blocks=64, block_size=4)
        return sorted(range(3), key=lambda i: r.requests[i].token_times[0])

    assert first_token_order() == [0, 1, 2]
    monkeypatch.setattr(FCFS, "order_waiting", lambda self, waiting, step: sorted(waiting, key=lambda r: -r.seq_id))
    assert first_token_order() == [2, 1, 0]


def test_replay_steps_equal_a_direct_run_of_the_scheduler():
    """With every request there at once, the replay's steps are exactly the scheduler's own
    (schedule, then one sampled token per sampling sequence), driven by hand."""
    from chunkserve.tune.replay import build_scheduler
    from scheduler_svc.plan import Sampled, StepResult
    from scheduler_svc.request import Request, SamplingParams

    specs = [RequestSpec(0.0, p, o) for p, o in [(30, 5), (9, 7), (50, 2), (3, 4)]]
    config = SchedulerConfig(max_num_batched_tokens=16)
    got = [(s.num_prefill_tokens, s.num_decode_tokens) for s in replay(specs, config, linear_cost(), 64, 4).steps]
    sched = build_scheduler(config, 64, 4, 80)
    for i, s in enumerate(specs):
        sched.add_request(
            Request(f"x{i}", i + 1, [5000 + i] * s.prompt_len, SamplingParams(max_tokens=s.output_len, ignore_eos=True))
        )
    want = []
    while sched.has_work():
        plan = sched.schedule()
        d = sum(
            1
            for s, r in zip(plan.seqs, sched.step_stats.requests)
            if s.num_new_tokens == 1 and s.num_computed_tokens >= r.num_prompt_tokens
        )
        want.append((plan.num_tokens - d, d))
        sched.update(plan, StepResult(plan.step_id, [Sampled(s.seq_id, 1) for s in plan.seqs if s.sample]))
    assert got == want


def test_a_smaller_budget_lowers_predicted_p99_itl():
    """The property the design is about: short requests decode while a long prompt arrives; a
    small budget cuts its prefill into short steps, so the decodes' gaps stay short."""
    specs = [RequestSpec(0.01 * i, 32, 64, "short") for i in range(6)] + [RequestSpec(0.15, 6000, 4, "long")]
    cost = linear_cost(const=2e-3, per_token=1e-4)
    itl = {}
    for budget in (256, 8192):
        result = replay(specs, SchedulerConfig(max_num_batched_tokens=budget), cost, num_blocks=1024, block_size=16)
        itl[budget] = summarize(result)["classes"]["short"]["itl_p99_ms"]
    assert itl[256] < itl[8192] / 5


def test_preemption_under_a_small_pool_still_finishes_everything():
    specs = [RequestSpec(0.0, 40, 40) for _ in range(6)]
    result = replay(specs, SchedulerConfig(max_num_batched_tokens=64), linear_cost(), num_blocks=30, block_size=4)
    assert result.num_preemptions > 0
    assert [len(r.token_times) for r in result.requests] == [40] * 6
    assert result.free_blocks_at_end == 30


@settings(max_examples=40, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(st.tuples(st.floats(0, 0.05), st.integers(1, 60), st.integers(1, 20)), min_size=1, max_size=8),
    budget=st.integers(1, 80),
    spare_blocks=st.integers(2, 40),
    policy=st.sampled_from(["fcfs", "sjf", "priority", "fair"]),
    caching=st.booleans(),
)
def test_every_request_finishes_and_every_block_returns(reqs, budget, spare_blocks, policy, caching):
    specs = [RequestSpec(a, p, o, prefix_group=i % 2, prefix_len=8) for i, (a, p, o) in enumerate(reqs)]
    block_size = 4
    num_blocks = max(-(-(s.prompt_len + s.output_len) // block_size) for s in specs) + spare_blocks
    config = SchedulerConfig(max_num_batched_tokens=budget, scheduling_policy=policy, enable_prefix_caching=caching)
    result = replay(specs, config, linear_cost(), num_blocks=num_blocks, block_size=block_size)
    assert [len(r.token_times) for r in result.requests] == [s.output_len for s in specs]
    assert all(r.token_times[0] >= r.spec.arrival for r in result.requests)
    assert all(b >= a for r in result.requests for a, b in zip(r.token_times, r.token_times[1:]))
    assert result.free_blocks_at_end == num_blocks


# ---- request logs --------------------------------------------------------------------------


def test_request_log_from_a_bench_report_and_from_a_trace(tmp_path):
    report = {
        "input_lens": [100, 2000, 50],
        "output_lens": [32, 32, 0],
        "arrivals": [0.0, 1.5, 2.0],
        "classes": ["short", "long", "short"],
        "errors": ["", "", "UNAVAILABLE: gone"],
        "server_info": {"block_size": 16, "num_device_blocks": 500},
    }
    (tmp_path / "r.json").write_text(json.dumps(report))
    specs, info = requests_from_bench(tmp_path / "r.json")
    assert specs == [RequestSpec(0.0, 100, 32, "short"), RequestSpec(1.5, 2000, 32, "long")]
    assert info["num_device_blocks"] == 500
    # A trace: request a prefills 6 tokens in two chunks then decodes twice (3 tokens out).
    lines = [
        {"timestamp": 10.0, "seqs": [{"requestId": "a", "numTokens": 4, "numPromptTokens": 6}]},
        {"timestamp": 10.5, "seqs": [{"requestId": "a", "numTokens": 2, "numComputedTokens": 4, "numPromptTokens": 6}]},
        {"timestamp": 11.0, "seqs": [{"requestId": "a", "numTokens": 1, "numComputedTokens": 6, "numPromptTokens": 6}]},
        {
            "timestamp": 11.5,
            "seqs": [
                {"requestId": "a", "numTokens": 1, "numComputedTokens": 7, "numPromptTokens": 6},
                {"requestId": "b", "numTokens": 3, "numPromptTokens": 3},
            ],
        },
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = requests_from_trace(tmp_path / "t.jsonl")
    assert [(s.arrival, s.prompt_len, s.output_len) for s in got] == [(0.0, 6, 3), (1.5, 3, 1)]


# ---- choosing and the command --------------------------------------------------------------


def _summary(tp, itl99, ttft99=100.0):
    figures = {"n": 1, "ttft_p50_ms": 1.0, "ttft_p99_ms": ttft99, "itl_p50_ms": 1.0, "itl_p99_ms": itl99}
    figures.update(e2e_p50_ms=1.0, e2e_p99_ms=1.0)
    return {"classes": {"all": figures, "short": dict(figures)}, "output_throughput": tp, "preemptions": 0}


def test_slo_filter_picks_the_best_throughput_among_feasible_settings():
    rows = [
        (Setting(128), _summary(tp=50.0, itl99=100)),
        (Setting(512), _summary(tp=80.0, itl99=300)),
        (Setting(2048), _summary(tp=99.0, itl99=900)),  # best throughput, breaks the ITL SLO
        (Setting(1024), _summary(tp=79.9, itl99=250)),  # within the tie band of 512, lower ITL
    ]
    slo = parse_slo(["itl_p99_ms=500", "short.ttft_p99_ms=1000"])
    assert best(rows, slo)[0].budget == 1024
    assert best(rows, {})[0].budget == 2048
    assert best(rows, parse_slo(["itl_p99_ms=50"])) is None
    with pytest.raises(ValueError):
        parse_slo(["tpot_p99_ms=5"])


def test_cli_prints_the_fit_a_table_and_flags_serve_accepts(tmp_path, capsys):
    synthetic_trace(tmp_path / "steps.jsonl", n_steps=60)
    rng = random.Random(1)
    arrivals = sorted(rng.uniform(0, 20) for _ in range(12))
    lens = [rng.randint(1024, 2048) if i % 3 == 0 else rng.randint(16, 128) for i in range(12)]
    report = {
        "input_lens": lens,
        "output_lens": [32] * 12,
        "arrivals": arrivals,
        "classes": ["long" if n > 1000 else "short" for n in lens],
        "server_info": {"block_size": 16, "num_device_blocks": 2000, "max_model_len": 4096, "max_num_seqs": 128},
    }
    (tmp_path / "r.json").write_text(json.dumps(report))
    argv = ["tune", "--trace", str(tmp_path / "steps.jsonl"), "--requests", str(tmp_path / "r.json")]
    argv += ["--budgets", "256,2048", "--slo", "itl_p99_ms=100000", "--json", str(tmp_path / "out.json")]
    argv += ["--noise", "resample", "--seed", "3"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "fit error on 12 held-out steps" in out
    assert "B=256" in out and "B=2048" in out and "| short |" in out and "| long |" in out
    line = next(x for x in out.splitlines() if x.startswith("recommended: chunkserve serve "))
    flags = line.removeprefix("recommended: chunkserve serve ").split()
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["serve", *flags])
    assert parsed.max_num_batched_tokens in (256, 2048)
    assert len(json.loads((tmp_path / "out.json").read_text())) == 2


def test_auto_budget_settings_replay_through_the_servers_controller(tmp_path, capsys):
    """`--target-itl-ms none,X` puts the auto budget in the grid: the replay feeds the real
    controller the simulated step times, so its decoding steps meet the target where the
    fixed upper bound's do not, and the recommendation is a flag set serve accepts."""
    synthetic_trace(tmp_path / "steps.jsonl", n_steps=80)
    rng = random.Random(2)
    arrivals = sorted(rng.uniform(0, 20) for _ in range(16))
    lens = [rng.randint(1024, 2048) if i % 4 == 0 else rng.randint(16, 128) for i in range(16)]
    report = {
        "input_lens": lens,
        "output_lens": [32] * 16,
        "arrivals": arrivals,
        "classes": ["long" if n > 1000 else "short" for n in lens],
        "server_info": {"block_size": 16, "num_device_blocks": 2000, "max_model_len": 4096, "max_num_seqs": 128},
    }
    (tmp_path / "r.json").write_text(json.dumps(report))
    model = CostModel.fit(load_trace(tmp_path / "steps.jsonl"))
    specs, _ = requests_from_bench(tmp_path / "r.json")
    target_ms = 1e3 * model.predict([(1, 500, 100)] * 4 + [(256, 0, 1500)])  # room for ~256 tokens of prefill
    results = {}
    for target in (None, target_ms):
        config = SchedulerConfig(max_num_batched_tokens=2048, target_itl_ms=target)
        seen: list[tuple[int, str]] = []

        def watch(sched, plan, seen=seen):
            seen.append((sum(1 for e in plan.seqs if e.token_ids == []), sched.step_stats.budget_reason))

        results[target] = (replay(specs, config, model.predict, 2000, 16, 4096, on_plan=watch), seen)
    fixed_steps, (auto_result, auto_seen) = results[None][0].steps, results[target_ms]
    worst = lambda steps, seen: max(st.seconds for st, (dec, _) in zip(steps, seen) if dec)  # noqa: E731
    assert {r for _, r in auto_seen} >= {"no decodes", "target"}
    assert worst(auto_result.steps, auto_seen) <= target_ms / 1e3 * 1.05 < worst(fixed_steps, results[None][1])
    argv = ["tune", "--trace", str(tmp_path / "steps.jsonl"), "--requests", str(tmp_path / "r.json")]
    argv += ["--budgets", "2048", "--target-itl-ms", f"none,{target_ms:.3f}", "--slo", "itl_p99_ms=100000"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "auto<=" in out
    line = next(x for x in out.splitlines() if x.startswith("recommended: chunkserve serve "))
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    parser.parse_args(["serve", *line.removeprefix("recommended: chunkserve serve ").split()])


def test_cli_says_when_no_setting_meets_the_slo(tmp_path, capsys):
    synthetic_trace(tmp_path / "steps.jsonl", n_steps=30)
    report = {"input_lens": [100, 300], "output_lens": [8, 8], "arrivals": [0.0, 0.5], "classes": ["short", "long"]}
    (tmp_path / "r.json").write_text(json.dumps(report))
    argv = ["tune", "--trace", str(tmp_path / "steps.jsonl"), "--requests", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--budgets", "64", "--slo", "ttft_p99_ms=0.001"])
    assert exit_.value.code == 1
    assert "no setting meets the SLO" in capsys.readouterr().out


def test_fit_ignores_warm_up_outliers(tmp_path):
    synthetic_trace(tmp_path / "steps.jsonl", n_steps=100)
    steps = load_trace(tmp_path / "steps.jsonl")
    for s in steps[:3]:  # a server's first steps: seconds of warm-up
        s.seconds += 5.0
    model = CostModel.fit(steps)
    for got, want in zip(model.coef, TRUE):
        assert got == pytest.approx(want, rel=1e-2)


def test_noisy_predictions_resample_the_traces_spread_with_a_seed(tmp_path):
    synthetic_trace(tmp_path / "steps.jsonl", noise=0.3, seed=5)
    model = CostModel.fit(load_trace(tmp_path / "steps.jsonl"))
    assert len(model.ratios) == 190 and min(model.ratios) < 1 < max(model.ratios)  # warm-up: first 10 out
    shape = [(1, 500, 100)] * 8
    draws = [model.noisy(7) for _ in range(2)]
    a, b = ([f(shape) for _ in range(50)] for f in draws)
    assert a == b  # the same seed, the same step times
    assert min(a) < model.predict(shape) < max(a)
    assert all(model.predict(shape) * min(model.ratios) <= x <= model.predict(shape) * max(model.ratios) for x in a)


def test_no_coefficient_is_negative_on_a_trace_that_mixes_two_regimes():
    """Two traces of different servers concatenated (small steps cheap, big steps slow per
    token): whatever the fit, it never predicts that more work takes less time."""
    rng = random.Random(2)
    steps = []
    for _ in range(150):
        d = rng.randint(1, 20)
        seqs = [(1, rng.randint(100, 2000), 50)] * d + [(rng.randint(1, 256), 0, 2000)]
        steps.append((seqs, 0.05 + 0.003 * sum(n for n, _, _ in seqs)))
    for _ in range(50):
        seqs = [(rng.randint(1000, 2048), 0, 2048), (1, 1500, 100)]
        steps.append((seqs, 0.5 + 0.017 * seqs[0][0]))
    model = CostModel.fit([TraceStep(features(s), t) for s, t in steps])
    assert all(c >= 0 for c in model.coef)


# ---- shared prefixes, calibration design, plot ---------------------------------------------


def _shared_prefix_trace(path, with_structure=True):
    """A step trace of 2 system prompts (128 tokens) x 3 users, each prompt 128 + 20 tokens:
    the first user of each prefix computes it, the others find it cached (the new
    numCachedTokens / prefixHash fields; left out when with_structure is False)."""
    lines = []
    for i in range(6):
        g, first = i % 2, i < 2
        entry = {"requestId": f"r{i}", "numTokens": 148 if first else 20, "numPromptTokens": 148, "isPrefill": True}
        if not first:
            entry["numComputedTokens"] = 128
        if with_structure:
            entry["prefixHash"] = f"{g:016x}"
            if not first:
                entry["numCachedTokens"] = 128
        decode = {"requestId": f"r{i}", "numTokens": 1, "numComputedTokens": 148, "numPromptTokens": 148}
        lines.append({"timestamp": 100.0 + i, "stepNs": "2000000", "seqs": [entry]})
        lines.append({"timestamp": 100.5 + i, "stepNs": "1000000", "seqs": [decode]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_shared_prefixes_recovered_from_a_trace_replay_as_cache_hits(tmp_path):
    _shared_prefix_trace(tmp_path / "t.jsonl")
    specs = requests_from_trace(tmp_path / "t.jsonl")
    assert [(s.prefix_group, s.prefix_len) for s in specs] == [(0, 128), (1, 128)] * 3
    config = SchedulerConfig(max_num_batched_tokens=512)
    hits = replay(specs, config, linear_cost(), num_blocks=200).num_cached_tokens
    assert hits == 4 * 128  # every later user of a prefix finds all of it cached
    # The same log without the structure (an older trace): no sharing, no hits.
    _shared_prefix_trace(tmp_path / "old.jsonl", with_structure=False)
    old = requests_from_trace(tmp_path / "old.jsonl")
    assert all(s.prefix_group is None for s in old)
    assert replay(old, config, linear_cost(), num_blocks=200).num_cached_tokens == 0
    # With prefix caching off the scheduler finds nothing: the replay follows the scheduler.
    off = replace(config, enable_prefix_caching=False)
    assert replay(specs, off, linear_cost(), num_blocks=200).num_cached_tokens == 0


def test_shared_prefixes_from_a_bench_report_and_an_older_one(tmp_path):
    base = {
        "input_lens": [150, 140, 150, 30],
        "output_lens": [8, 8, 8, 8],
        "arrivals": [0.0, 0.1, 0.2, 0.3],
        "classes": ["prefix-0", "prefix-1", "prefix-0", "prefix-1"],
    }
    report = {**base, "prefix_groups": [0, 1, 0, 1], "prefix_lens": [128, 128, 128, 128]}
    (tmp_path / "r.json").write_text(json.dumps(report))
    specs, _ = requests_from_bench(tmp_path / "r.json")
    assert [(s.prefix_group, s.prefix_len) for s in specs] == [(0, 128), (1, 128), (0, 128), (1, 30)]
    config = SchedulerConfig(max_num_batched_tokens=512)
    assert replay(specs, config, linear_cost(), num_blocks=200).num_cached_tokens == 128 + 16
    # Before the lists existed: the shared-prefix workload's class labels and its --prefix-len.
    (tmp_path / "old.json").write_text(json.dumps({**base, "bench": {"prefix_len": 128}}))
    old, _ = requests_from_bench(tmp_path / "old.json")
    assert [(s.prefix_group, s.prefix_len) for s in old] == [(s.prefix_group, s.prefix_len) for s in specs]
    # --requests takes either kind of log.
    _shared_prefix_trace(tmp_path / "t.jsonl")
    assert load_requests(tmp_path / "t.jsonl")[0] == requests_from_trace(tmp_path / "t.jsonl")
    assert load_requests(tmp_path / "r.json")[0] == specs


def test_bench_reports_its_workloads_prefix_structure():
    spec = WorkloadSpec("shared-prefix", num_prefixes=2, users_per_prefix=2, prefix_len=40, suffix_len=(4, 8))
    reqs = build_workload(spec, list(range(1000)), seed=1)
    assert sorted((r.prefix_group, r.prefix_len) for r in reqs) == [(0, 40), (0, 40), (1, 40), (1, 40)]
    assert all(r.prompt_ids[:40] == reqs[0].prompt_ids[:40] for r in reqs if r.prefix_group == reqs[0].prefix_group)
    recs = [
        RequestRecord(r.index, r.cls, len(r.prompt_ids), 2, 0.0, prefix_group=r.prefix_group, prefix_len=40)
        for r in reqs
    ]
    lists = per_request_lists(recs)
    assert lists["prefix_groups"] == [r.prefix_group for r in reqs] and lists["prefix_lens"] == [40] * 4
    assert build_workload(WorkloadSpec("mixed", num_prompts=3), list(range(1000)), 1)[0].prefix_group is None


def test_calibration_design_spreads_the_features_within_the_servers_limits():
    limits = Limits(budget=256, max_model_len=2048, max_num_seqs=32, kv_tokens=16 * 400, vocab_size=1000)
    waves = design(limits, output_len=16, seed=0, step_seconds=0.01, fixed_ids=True)
    reqs = [r for w in waves for r in w.requests]
    assert all(len(r.prompt_ids) + r.output_len <= limits.max_model_len for r in reqs)
    assert all(100 <= t < 1000 for r in reqs for t in r.prompt_ids)
    prompts = {len(r.prompt_ids) for w in waves if w.name.startswith("prefill") for r in w.requests}
    assert min(prompts) == 16 and max(prompts) == 1024  # from 16 tokens to 4 budgets
    counts = [len(w.requests) for w in waves if w.name.startswith("decode")]
    assert counts == [1, 4, 16, 32]  # 64 capped by max_num_seqs
    for w in waves:  # nothing is preempted: every wave fits in 80% of the KV pool
        assert sum(len(r.prompt_ids) + r.output_len for r in w.requests) <= 0.8 * limits.kv_tokens
    mixed = waves[-1]
    assert mixed.name.startswith("mixed") and max(mixed.arrivals) > 0  # prompts arrive while others decode
    # No two requests share a first block, so no prefix-cache hit blurs the measured steps.
    assert len({r.prompt_ids[:16] for r in reqs}) == len(reqs)
    assert design(limits, fixed_ids=True) == design(limits, fixed_ids=True)
    assert design(limits)[0].requests != design(limits)[0].requests  # fresh ids per run
    with pytest.raises(ValueError):
        design(Limits(max_model_len=20), output_len=16)


def _tune_inputs(tmp_path):
    synthetic_trace(tmp_path / "steps.jsonl", n_steps=40)
    report = {"input_lens": [100, 300, 50], "output_lens": [8, 8, 8], "arrivals": [0.0, 0.5, 0.6]}
    report["classes"] = ["short", "long", "short"]
    (tmp_path / "r.json").write_text(json.dumps(report))
    return ["tune", "--trace", str(tmp_path / "steps.jsonl"), "--requests", str(tmp_path / "r.json")]


def test_plot_draws_the_settings_the_slo_and_the_recommendation(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = _tune_inputs(tmp_path) + ["--budgets", "64,512", "--slo", "itl_p99_ms=100000", "short.ttft_p99_ms=1e6"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--plot", str(tmp_path / "plots" / "tune.png"), "--noise", "none"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"plot: {tmp_path / 'plots' / 'tune.png'}" in out
    assert (tmp_path / "plots" / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as exit_:
        main([*_tune_inputs(tmp_path), "--plot", str(tmp_path / "tune.png")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--plot needs matplotlib" in err and "chunkserve[bench]" in err
    assert not (tmp_path / "tune.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--trace FILE"),
        (["--calibrate"], "--calibrate needs --address"),
        (["--trace", "x.jsonl", "--save-trace", "y.jsonl"], "go with --calibrate"),
        (["--calibrate", "--address", "http://127.0.0.1:8000"], "not an http:// URL"),
        (["--trace", "x.jsonl", "--budgets", "256,lots"], "--budgets takes comma-separated integers"),
        (["--trace", "x.jsonl", "--target-itl-ms", "100,-5"], "--target-itl-ms takes comma-separated positive"),
        (["--trace", "x.jsonl", "--target-itl-ms", "fast"], "--target-itl-ms takes comma-separated positive"),
    ],
)
def test_tune_refuses_flag_combinations_that_cannot_work(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["tune", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_calibrate_against_no_server_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--calibrate", "--address", "127.0.0.1:1", "--calibration-timeout", "5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("chunkserve tune: ") and "127.0.0.1:1" in err[0]
