"""Scheduling policies on the real scheduler with the fake executor; live reconfiguration."""

from __future__ import annotations

import sys
import textwrap
from collections import Counter

import grpc
import pytest

from chunkserve_contracts.v1 import chunkserve_pb2 as pb
from chunkserve_contracts.v1 import chunkserve_pb2_grpc as pb_grpc
from scheduler_svc.admin import Controls, apply_update
from scheduler_svc.policy import FCFS, PriorityPolicy, ShortestJobFirst, create_policy


def reqs(fakes, specs):
    out = []
    for i, (prompt_len, kw) in enumerate(specs):
        r = fakes.make_request(i, prompt_len=prompt_len)
        for k, v in kw.items():
            setattr(r, k, v)
        out.append(r)
    return out


def test_orderings_and_victims(fakes):
    a, b, c = reqs(fakes, [(50, {"priority": 1}), (10, {"priority": 0}), (30, {"priority": 1})])
    assert FCFS().order_waiting([c, a, b], 0) == [a, b, c] and FCFS().pick_victim([a, b, c]) is c
    assert PriorityPolicy().order_waiting([a, b, c], 0) == [b, a, c]
    assert PriorityPolicy().pick_victim([a, b, c]) is c  # lowest priority, latest arrival
    assert ShortestJobFirst().order_waiting([a, b, c], 0) == [b, c, a]
    assert ShortestJobFirst().pick_victim([a, b, c]) is a  # most work left


def test_sjf_aging_bounds_the_wait_of_a_long_prompt(fakes):
    sched = fakes.make_scheduler(
        num_blocks=4096, block_size=16, max_num_batched_tokens=256, scheduling_policy="sjf", max_num_partial_prefills=1
    )
    fake = fakes.FakeExecutor(4096, 16)
    long = fakes.make_request(0, prompt_len=4000, max_tokens=1)
    sched.add_request(long)
    next_id = 1
    started = None
    for step in range(400):
        for _ in range(2):  # a stream of short prompts that exactly fills every step's budget
            sched.add_request(fakes.make_request(next_id, prompt_len=128, max_tokens=1))
            next_id += 1
        plan = sched.schedule()
        if started is None and any(e.seq_id == 0 for e in plan.seqs):
            started = step
        sched.update(plan, fake.execute(plan))
        if started is not None:
            break
    bound = (4000 - 128) // ShortestJobFirst.aging_tokens_per_step + 2
    assert started is not None and bound - 10 < started <= bound, (started, bound)  # aging, not luck


def test_fair_share_across_three_tenants(fakes):
    sched = fakes.make_scheduler(
        num_blocks=8192, block_size=16, max_num_batched_tokens=128, scheduling_policy="fair", max_num_seqs=4
    )
    fake = fakes.FakeExecutor(8192, 16)
    next_id = 0
    # Tenant a floods 3x as many requests as b and c.
    for tenant, count in (("a", 60), ("b", 20), ("c", 20)):
        for _ in range(count):
            r = fakes.make_request(next_id, prompt_len=64, max_tokens=8)
            r.tenant = tenant
            sched.add_request(r)
            next_id += 1
    served = Counter()
    for _ in range(60):  # all three stay backlogged over this window
        plan = sched.schedule()
        for e in plan.seqs:
            served[sched._by_seq[e.seq_id].tenant] += e.num_new_tokens
        sched.update(plan, fake.execute(plan))
    total = sum(served.values())
    for tenant in "abc":
        assert abs(served[tenant] / total - 1 / 3) < 0.05, served


def test_user_policy_loaded_by_dotted_path_from_outside_the_package(tmp_path, fakes, monkeypatch):
    (tmp_path / "my_policies.py").write_text(
        textwrap.dedent("""
        from scheduler_svc.policy import Policy

        class NotAPolicy:
            def order_waiting(self, waiting, step):
                return list(waiting)

        class Incomplete(Policy):
            def order_waiting(self, waiting, step):
                return list(waiting)

        class LongestFirst(Policy):
            name = "longest-first"
            def order_waiting(self, waiting, step):
                return sorted(waiting, key=lambda r: -r.num_prompt_tokens)
            def pick_victim(self, candidates):
                return min(candidates, key=lambda r: r.num_prompt_tokens)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_policies", None)
    policy = create_policy("my_policies:LongestFirst")
    a, b = reqs(fakes, [(10, {}), (90, {})])
    assert policy.order_waiting([a, b], 0) == [b, a]
    with pytest.raises(ValueError, match="known: fair, fcfs, priority, sjf"):
        create_policy("nope")
    with pytest.raises(ValueError, match="cannot load"):
        create_policy("my_policies.Missing")
    with pytest.raises(ValueError, match="not a subclass"):
        create_policy("my_policies:NotAPolicy")
    with pytest.raises(ValueError, match="abstract method"):  # no pick_victim
        create_policy("my_policies:Incomplete")
    assert policy.on_scheduled(a, 3) is None  # the base class's default hook


def test_live_update_is_validated_whole_and_atomic(fakes):
    sched = fakes.make_scheduler(num_blocks=256, block_size=16, max_num_batched_tokens=512, max_model_len=1024)
    controls = Controls(sched, fakes.fake_handshake(num_device_blocks=256, max_position_embeddings=1024))
    before = (sched.config, sched.policy)
    for bad in (
        pb.SchedulingConfig(policy="sjf", max_num_batched_tokens=4096),  # over the executor's
        pb.SchedulingConfig(policy="sjf", max_num_seqs=0),
        pb.SchedulingConfig(enable_chunked_prefill=False),  # 512 < max_model_len 1024
        pb.SchedulingConfig(max_num_batched_tokens=256, policy="no.such.Policy"),
    ):
        with pytest.raises(ValueError):
            apply_update(controls, bad)
        assert (sched.config, sched.policy) == before  # nothing moved
    out = apply_update(controls, pb.SchedulingConfig(policy="priority", max_num_batched_tokens=1024))
    assert out.policy == "priority" and sched.config.max_num_batched_tokens == 1024
    assert isinstance(sched.policy, PriorityPolicy) and sched.config.max_num_seqs == before[0].max_num_seqs
    sched.schedule()
    assert sched.step_stats.token_budget == 1024


@pytest.mark.slow  # a real server pair
def test_documented_user_policy_serves_requests_end_to_end(tiny_model_path, tmp_path, monkeypatch):
    """The policy from docs/policies.md, as a file outside the package, loaded by dotted path."""
    import pathlib
    import re

    from chunkserve.client import build_request
    from chunkserve.launch import start_server

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "policies.md").read_text()
    source = re.search(r"```python\n(# my_policies.py.*?)```", doc, re.S).group(1)
    assert len(source.strip().splitlines()) <= 30
    (tmp_path / "my_policies.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    server = start_server(
        tmp_path,
        ["--model", str(tiny_model_path), "--dtype", "float32"],
        ["--scheduling-policy", "my_policies:FewestOutputTokensLeft"],
    )
    try:
        stub = server.stub()
        for n in (3, 5):
            out = list(stub.Generate(build_request([5, 6, 7, 8], temperature=0.0, max_tokens=n, ignore_eos=True)))
            assert sum(len(m.token_ids) for m in out) == n and out[-1].finished
        admin = pb_grpc.AdminStub(grpc.insecure_channel(server.admin_address))
        assert admin.GetConfig(pb.GetConfigRequest(), timeout=10).policy == "fewest-output-left"
    finally:
        server.stop()
