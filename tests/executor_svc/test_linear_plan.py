"""The CPU linear plan measured at start-up (models/linear_plan.py, `--cpu-linear-plan`) and
the Plan every linear computes through (models/kernel_plan.py).

Nothing here depends on timing: the measurement's clock is replaced by one that returns
chosen costs (and still runs every candidate), so the tests assert which plan a set of
costs gives, that every kernel computes the product it names, that a model follows its
plan, that load() measures by default (once per machine, model and mode: the plan is kept in
the cache folder) and keeps the tables with `table`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve_kernels import cpu_native
from executor_svc.config import ExecutorConfig
from executor_svc.models import get_model_class
from executor_svc.models import kernel_plan as kp
from executor_svc.models import linear_plan as lp
from executor_svc.models.kernel_plan import padded_rows
from executor_svc.models.layers import Linear, prepack_measured, prepack_weight
from executor_svc.models.quant import default_rules, half_weights_model, quantize_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
# the native library's few-row product ("gemv") is a candidate where it builds (a C++ compiler)
NATIVE = cpu_native.load() is None


@st.composite
def plans(draw):
    buckets = sorted(draw(st.sets(st.integers(1, 300), min_size=1, max_size=8)))
    kernels = draw(st.lists(st.sampled_from(kp.KERNELS), min_size=len(buckets), max_size=len(buckets)))
    return kp.Plan(tuple(buckets), tuple(kernels))


@given(plans(), st.integers(1, 1000))
def test_a_step_takes_the_kernel_of_the_smallest_bucket_at_or_above_it(plan, m):
    above = [i for i, b in enumerate(plan.buckets) if b >= m]
    want = plan.kernels[above[0]] if above else plan.kernels[-1]
    assert plan(m) == want


def test_plan_text_and_validation():
    plan = kp.Plan((1, 2, 4, 8, 16), ("mm", "packed", "packed", "reduced", "reduced"))
    assert str(plan) == "1: mm, 2-4: packed, 5+: reduced"
    assert str(kp.Plan((1, 3), ("mm", "mm"))) == "1+: mm"
    for buckets, kernels in (((), ()), ((1, 2), ("mm",)), ((2, 1), ("mm", "mm")), ((0, 2), ("mm", "mm"))):
        with pytest.raises(ValueError):
            kp.Plan(buckets, kernels)


@given(
    st.dictionaries(st.sampled_from(kp.KERNELS), st.floats(1e-4, 1.0), min_size=1), st.sampled_from([0.0, 0.05, 0.2])
)
def test_choose_prefers_the_earlier_kernel_unless_a_later_one_wins_by_the_margin(costs, margin):
    best = kp.choose(costs, margin)
    order = sorted(costs, key=kp.KERNELS.index)
    assert best in costs and costs[best] <= costs[order[0]]
    # nothing is more than the margin faster than the choice
    assert all(costs[k] >= costs[best] * (1 - margin) for k in costs)
    if margin == 0.0:  # the fastest, the earliest among equals
        assert best == min(order, key=lambda k: costs[k])


def test_candidates_follow_the_copies_and_the_caps():
    base = dict(padding=True, packed=False, reduced=None, reduced_max_rows=None)
    assert [m for m in range(1, 40) if "mm-pad" in kp.candidates(m, **base)] == [
        m for m in range(1, 40) if padded_rows(m) != m
    ]
    assert kp.candidates(1, **{**base, "padding": False}) == ["mm"]
    assert "packed" in kp.candidates(2, **{**base, "packed": True})
    int4 = {**base, "reduced": "int4"}
    assert [m for m in (1, 8, 32, 33, 128) if "reduced" in kp.candidates(m, **int4)] == [1, 8, 32]
    assert "half-onednn" not in kp.candidates(16, **int4)  # int4 has one reduced kernel
    bf16 = {**base, "reduced": "bfloat16"}
    assert "reduced" in kp.candidates(512, **bf16)
    assert [m for m in (1, 11, 12, 64) if "half-onednn" in kp.candidates(m, **bf16)] == [12, 64]
    assert "reduced" not in kp.candidates(5, **{**bf16, "reduced_max_rows": 4})
    assert not any("gemv" in kp.candidates(m, **base) for m in range(1, 9))  # not loaded: never
    with_gemv = [m for m in range(1, 40) if "gemv" in kp.candidates(m, **{**base, "gemv": True})]
    assert with_gemv == list(range(1, kp.GEMV_MAX_ROWS + 1))
    # one row of x with or without the software prefetch: the two differ at one row only
    streamed = [m for m in range(1, 40) if "gemv-stream" in kp.candidates(m, **{**base, "gemv": True})]
    assert streamed == [1] and not any("gemv-stream" in kp.candidates(m, **base) for m in range(1, 9))
    assert kp.KERNELS.index("gemv") < kp.KERNELS.index("reduced")  # float32 before a reduced copy
    # the plain stream stays unless the prefetch is MARGIN faster (what the AVX2 build always did)
    assert kp.KERNELS.index("gemv-stream") < kp.KERNELS.index("gemv")
    assert kp.choose({"gemv-stream": 1.0, "gemv": 0.97}) == "gemv-stream"
    assert kp.choose({"gemv-stream": 1.0, "gemv": 0.9}) == "gemv"


def test_at_one_row_a_tie_goes_to_the_native_product_not_the_padded_one():
    """MKL's padded product tops out at a lower read rate than the native one-row product, so
    a tie measured while memory is slow must not keep it (kernel_plan.ONE_ROW_ORDER): at one
    row "mm-pad" or "packed" must win by the margin; at more rows the order is KERNELS'."""
    tie = {"mm-pad": 1.0, "packed": 1.01, "gemv-stream": 1.02, "gemv": 1.03}
    assert kp.choose(tie, rows=1) == "gemv-stream"
    assert kp.choose(tie) == kp.choose(tie, rows=2) == "mm-pad"
    assert kp.choose({"mm-pad": 0.9, "gemv-stream": 1.0}, rows=1) == "mm-pad"
    assert kp.choose({"mm": 1.0, "gemv-stream": 0.97}, rows=1) == "mm"  # exact, unpadded, unpacked first
    assert set(kp.ONE_ROW_ORDER) == set(kp.KERNELS)


def _model(tiny_configs, hf_model_factory, name="llama", seed=0):
    torch.manual_seed(seed)
    config = tiny_configs[name]()
    hf = hf_model_factory(config)
    model = get_model_class(config)(config, "torch", torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict().items())
    return model


def _with_copies(model, mode):
    if mode == "int4":
        quantize_model(model, "int4")
    elif mode in ("bfloat16", "float16"):
        half_weights_model(model, mode)
    if torch.backends.mkldnn.is_available():
        model.prepack()
    return model


@needs_onednn
@pytest.mark.parametrize("mode", [None, "int4", "bfloat16", "float16"])
@pytest.mark.parametrize("m", [1, 3, 12, 40])
def test_every_kernel_computes_the_product_it_names(tiny_configs, hf_model_factory, mode, m):
    model = _with_copies(_model(tiny_configs, hf_model_factory, "llama_bias_headdim"), mode)
    tol = {None: 1e-5, "int4": 0.15, "bfloat16": 0.03, "float16": 0.005}[mode]
    cands = kp.candidates(m, padding=True, packed=True, reduced=mode, reduced_max_rows=None, gemv=NATIVE)
    assert ("gemv" in cands) == (NATIVE and m <= kp.GEMV_MAX_ROWS)
    for lin in model.decoder_linears():
        x = torch.randn(m, lin.weight.shape[1])
        want = x.double() @ lin.weight.double().t() + lin.bias.double()
        scale = want.abs().max().item()
        for k in cands:
            got = lin.apply_kernel(x, k)
            assert got.dtype == torch.float32 and got.shape == want.shape
            err = (got.double() - want).abs().max().item() / scale
            assert err <= (tol if k in ("reduced", "half-onednn") else 1e-5), (k, err)
    head = model.lm_head.weight.double()
    h = torch.randn(m, model.config.hidden_size)
    head_cands = kp.candidates(
        m, padding=True, packed=True, reduced=None if mode is None else "bfloat16", reduced_max_rows=None, gemv=NATIVE
    )
    for k in head_cands:
        want = h.double() @ head.t()
        err = (model.lm_head.apply_kernel(h, k).double() - want).abs().max().item() / want.abs().max().item()
        assert err <= (0.03 if k in ("reduced", "half-onednn") else 1e-5), (k, err)


def _fake_clock(cost, calls):
    """A clock that runs the candidate (and what precedes it) and returns cost(part, kernel, m)."""

    def clock(part, kernel, m, run, before):
        before()
        run()
        calls.append((part, kernel, m))
        return cost(part, kernel, m)

    return clock


@needs_onednn
def test_measure_picks_by_cost_and_times_every_candidate_of_every_bucket(tiny_configs, hf_model_factory):
    model = _with_copies(_model(tiny_configs, hf_model_factory), "bfloat16")

    def cost(part, kernel, m):  # packed wins from 3 rows, the 16-bit copy from 16, mm at 1-2
        table = {"mm": 1.0, "mm-pad": 1.2, "packed": 0.5 if m >= 3 else 1.5, "reduced": 0.2 if m >= 16 else 2.0}
        return table.get(kernel, 3.0) if part == "linears" else (0.1 if kernel == "reduced" else 1.0)

    calls: list = []
    measured = lp.measure(model, reduced="bfloat16", budget=32, clock=_fake_clock(cost, calls))
    buckets = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    assert lp.buckets_for(32, "linears") == lp.buckets_for(32, "head") == buckets
    want = tuple("mm" if m < 3 else "packed" if m < 16 else "reduced" for m in buckets)
    assert measured.body == kp.Plan(buckets, want)
    assert measured.head == kp.Plan(buckets, ("reduced",) * len(buckets))
    for part in ("linears", "head"):
        for m in buckets:
            want = kp.candidates(m, padding=True, packed=True, reduced="bfloat16", reduced_max_rows=None)
            assert [k for p, k, b in calls if p == part and b == m] == want * 5  # 5 rounds, taking turns
    # each round runs every candidate of every bucket before the next round starts
    per_round = len(calls) // 5
    assert len(set(calls[:per_round])) == per_round and set(calls[:per_round]) == set(calls[-per_round:])
    assert set(measured.costs) == {(p, m) for p in ("linears", "head") for m in buckets}
    assert "packed*" in measured.table() and "reduced*" in measured.table()


@needs_onednn
def test_the_plan_reaches_the_budget_and_times_large_steps_on_one_layer(tiny_configs, hf_model_factory, monkeypatch):
    """A prefill chunk takes a kernel measured at its own size, not one extrapolated from
    decode sizes; from LARGE_FROM rows one layer's linears stand for the model's, fewer rounds."""
    model = _with_copies(_model(tiny_configs, hf_model_factory), "bfloat16")
    assert lp.buckets_for(300, "linears")[-3:] == (128, 256, 300) and lp.buckets_for(300, "head")[-1] == 128
    assert lp.buckets_for(8192, "linears")[-1] == lp.LARGE_BUCKETS[-1]
    ran: dict = {}
    real = Linear.apply_kernel

    def spy(self, x, kernel, *args, **kw):
        ran.setdefault(x.shape[0], set()).add(id(self))
        return real(self, x, kernel, *args, **kw)

    monkeypatch.setattr(Linear, "apply_kernel", spy)

    def cost(part, kernel, m):  # the 16-bit copy wins at decode sizes only; float32 from 256 rows
        return {"reduced": 0.1 if m < 256 else 2.0, "mm": 1.0}.get(kernel, 1.5)

    calls: list = []
    measured = lp.measure(model, reduced="bfloat16", budget=512, clock=_fake_clock(cost, calls))
    assert measured.body(128) == "reduced" and measured.body(200) == "mm" and measured.body(512) == "mm"
    first_layer = {id(m) for m in model.model.layers[0].modules() if isinstance(m, Linear)}
    assert ran[512] == first_layer  # the head's buckets stop at 128: it computes sampled rows only
    assert ran[128] == {id(m) for m in [*model.decoder_linears(), model.lm_head]}
    assert [k for p, k, b in calls if b == 512] == ["mm", "packed", "reduced", "half-onednn"] * lp.LARGE_REPS


@needs_onednn
def test_apply_routes_every_linear_and_the_head_and_drops_unchosen_packed_copies(tiny_configs, hf_model_factory):
    """Routing made visible: each kernel's copy holds *other* weights, so a result says which
    copy the step used."""
    model = _with_copies(_model(tiny_configs, hf_model_factory), None)
    lin = model.model.layers[1].self_attn.o_proj
    other = torch.randn_like(lin.weight)
    lin.packed = prepack_weight(other)
    # not what the tables would do (they pack from 3 rows on)
    freed = model.use_plan(kp.Plan((1, 4, 8), ("packed", "mm", "packed")), kp.Plan((1,), ("mm",)))
    assert freed == model.lm_head.weight.nbytes  # the head's packed copy: chosen for no step
    assert model.lm_head.packed is None
    assert all(x.packed is not None and x.plan is model.model.plan for x in model.decoder_linears())
    for m in range(1, 12):
        x = torch.randn(m, lin.weight.shape[1])
        want = x @ (lin.weight if 2 <= m <= 4 else other).t()
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    model.use_plan(kp.Plan((1,), ("mm",)), kp.Plan((1,), ("mm",)))
    assert all(x.packed is None for x in model.decoder_linears())
    other_head = torch.randn_like(model.lm_head.weight)
    model.lm_head.packed = prepack_weight(other_head)
    model.use_plan(kp.Plan((1,), ("mm",)), kp.Plan((1, 2), ("mm", "packed")))
    for m in (1, 2, 5):
        h = torch.randn(m, model.config.hidden_size)
        want = h @ (model.lm_head.weight if m == 1 else other_head).t()
        torch.testing.assert_close(model.compute_logits(h), want, rtol=1e-5, atol=1e-5)


@needs_onednn
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_plan_gives_the_float32_logits(tiny_configs, hf_model_factory, paged_runner, data):
    """Whatever the measurement picks among float32 kernels, a step's logits are the float32
    ones to rounding: the plan changes speed, not the result (the fixtures are factories)."""
    model = _with_copies(_model(tiny_configs, hf_model_factory, "smollm_tied", seed=3), None)
    kernels = ("mm", "mm-pad", "packed") + (("gemv", "gemv-stream") if NATIVE else ())
    buckets = (1, 2, 4, 8)
    body = kp.Plan(buckets, tuple(data.draw(st.sampled_from(kernels)) for _ in buckets))
    head = kp.Plan(buckets, tuple(data.draw(st.sampled_from(kernels)) for _ in buckets))
    m = data.draw(st.integers(1, 12))
    tokens = torch.randint(0, model.config.vocab_size, (m,)).tolist()

    def logits():
        hidden = paged_runner(model, block_size=4).step({0: tokens})[0]
        with torch.inference_mode():
            return model.compute_logits(hidden)

    want = logits()
    model.use_plan(body, head)
    torch.testing.assert_close(logits(), want, rtol=1e-4, atol=1e-4)


def test_load_measures_by_default_and_keeps_the_tables_with_table(tiny_model_path, tmp_path, monkeypatch):
    from executor_svc import worker

    common = dict(model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path))
    seen = {}
    calls = []

    def fake_measure(model, **kw):  # the real one, with a clock that says "mm" always wins
        seen.update(kw)
        calls.append(dict(kw))
        return real(model, clock=_fake_clock(lambda p, k, m: 0.1 if k == "mm" else 1.0, []), **kw)

    real = lp.measure
    monkeypatch.setattr(lp, "measure", fake_measure)
    model = worker.load(ExecutorConfig(quantization="int4", **common)).runner.model
    # float32's plan first (what a float32 executor keeps), then int4's copies timed against it
    both = {"padding": True, "gemv": NATIVE, "budget": 2048}
    assert calls[0] == {"reduced": None, "reduced_max_rows": None, **both}
    base = calls[1].pop("base")
    assert calls[1] == {"reduced": "int4", "reduced_max_rows": None, **both} and len(calls) == 2
    assert set(base[0].kernels) == set(base[1].kernels) == {"mm"}
    assert set(model.lm_head.plan.kernels) == {"mm"} and model.lm_head.packed is None  # unchosen: dropped
    assert all(lin.plan is model.model.plan for lin in model.decoder_linears())
    seen.clear()
    worker.load(ExecutorConfig(cpu_kernels="torch", **common))
    assert seen["gemv"] is False  # --cpu-kernels torch: aten and the BLAS kernels only
    seen.clear()
    table = worker.load(ExecutorConfig(cpu_linear_plan="table", quantization="int4", **common)).runner.model
    assert not seen  # the tables: no measurement, a plan all the same (int4: the rule per CPU class)
    rows, _ = default_rules("int4")
    assert [table.model.plan(m) == "reduced" for m in range(1, 65)] == [rows(m) for m in range(1, 65)]
    with pytest.raises(ValueError, match="--cpu-linear-plan"):
        ExecutorConfig(cpu_linear_plan="fastest")


def test_a_changed_native_library_measures_the_plan_anew(tiny_configs, hf_model_factory, monkeypatch):
    """A plan that timed the native few-row product is not reused once that product's sources
    (or flags, torch, CPU) change: an upgrade that makes "gemv" faster or slower re-measures."""
    model = _model(tiny_configs, hf_model_factory)
    kw = dict(reduced=None, reduced_max_rows=None, padding=True, budget=8, gemv=True)
    key = lp.plan_key(model, **kw)
    assert key["native_build"] == cpu_native.build_name()
    monkeypatch.setattr(cpu_native, "build_name", lambda: "chunkserve_cpu_another")
    assert lp.plan_key(model, **kw) != key
    assert lp.plan_key(model, **{**kw, "gemv": False})["native_build"] is None


def test_a_kept_plan_is_read_back_for_its_key_only(tiny_configs, hf_model_factory, tmp_path):
    model = _with_copies(_model(tiny_configs, hf_model_factory), "bfloat16")
    kw = dict(reduced="bfloat16", reduced_max_rows=None, padding=True, budget=8)
    key = lp.plan_key(model, **kw)
    measured = lp.measure(model, **kw, clock=_fake_clock(lambda p, k, m: m if k == "mm" else 1, []))
    path = lp.plan_file(tmp_path, key)
    assert lp.load_plan(path, key) is None  # nothing kept yet
    lp.store_plan(path, key, measured)
    assert lp.load_plan(path, key) == (measured.body, measured.head)
    assert set(measured.body.kernels) != {"mm"}  # the fake costs made a plan that is not the default
    # whatever the key holds names another file, and a file is used for its own key only
    changes = ({"reduced": "int4"}, {"padding": False}, {"buckets": [1, 2]}, {"threads": key["threads"] + 1})
    for change in (*changes, {"gemv": True}):
        other = {**key, **change}
        assert lp.plan_file(tmp_path, other) != path
        assert lp.load_plan(path, other) is None
    assert lp.plan_key(model, **{**kw, "reduced_max_rows": 4}) != key
    doc = json.loads(path.read_text())
    assert key["native_build"] is None  # without the native product the library's build is not asked
    for edit in ({"body": ["mm", "fastest", *doc["body"][2:]]}, {"buckets": [1, 2, 9]}, {"head": None}):
        path.write_text(json.dumps({**doc, **edit}))
        assert lp.load_plan(path, key) is None, edit
    path.write_text("{not json")
    assert lp.load_plan(path, key) is None
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write left nothing behind


def test_load_keeps_the_measured_plan_for_the_next_start(tiny_model_path, tmp_path, monkeypatch):
    from executor_svc import worker

    common = dict(model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path))
    calls = []
    winner = ["packed"]

    def fake_measure(model, **kw):  # the real one; the fake clock makes `winner` the fastest kernel
        calls.append(kw)
        return real(model, clock=_fake_clock(lambda p, k, m: 0.1 if k == winner[0] else 1.0, []), **kw)

    real = lp.measure
    monkeypatch.setattr(lp, "measure", fake_measure)

    def plans(**kw):
        model = worker.load(ExecutorConfig(**common, **kw)).runner.model
        return model.model.plan, model.lm_head.plan

    first = plans()
    assert len(calls) == 1 and len(list((tmp_path / "linear-plans").glob("*.json"))) == 1
    winner[0] = "mm"  # a second measurement would now pick another plan
    assert plans() == first and len(calls) == 1  # read back, not measured
    again = plans(cpu_linear_plan="remeasure")
    assert len(calls) == 2 and again != first and set(again[0].kernels) == {"mm"}
    assert plans() == again and len(calls) == 2  # remeasure replaced the kept plan
    plans(quantization="int4")  # another mode: its own measurement and file
    assert len(calls) == 3 and len(list((tmp_path / "linear-plans").glob("*.json"))) == 2


@needs_onednn
def test_the_step_profile_script_times_and_zeroes_the_planned_kernels(tiny_configs, hf_model_factory, paged_runner):
    """benchmarks/decode_step_profile.py splits a step into GEMM and the rest: under a plan
    its "linears alone" must run the planned kernels and its no-GEMM step must zero every
    one of them (it missed oneDNN's packed product once and reported a -13% share)."""
    bench = _bench("decode_step_profile")
    model = _with_copies(_model(tiny_configs, hf_model_factory, "smollm_tied"), "int4")
    buckets = (1, 2, 3, 64)
    few = "gemv" if NATIVE else "mm"  # the native product, where it builds
    model.use_plan(
        kp.Plan(buckets, ("reduced", few, "packed", "mm")), kp.Plan(buckets, ("reduced", few, "packed", "mm-pad"))
    )
    for batch in (1, 2, 3, 40):
        ms, calls = bench.gemm_alone(model, batch, repeats=1)
        assert calls == 4 * len(model.model.layers) + 1 and ms > 0
    tokens = [5, 6]  # a step of 2 rows: the `few` kernel
    with bench.NoGemm():
        hidden = paged_runner(model, block_size=4).step({0: tokens})[0]
        with torch.inference_mode():
            logits = model.compute_logits(hidden)
            # every GEMM zero: the residual stream is the embedding alone, the logits zero
            want = model.model.norm(model.model.embed_tokens(torch.tensor(tokens)))
    torch.testing.assert_close(hidden, want)
    assert not logits.any()


def _bench(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_executor_modes_interleaved_steps_give_each_mode_its_own_tokens(tiny_model_path, tmp_path):
    """benchmarks/executor_modes.py --interleave: modes loaded side by side take turns without
    sharing state (a table and a measured float32 plan give the same greedy tokens), and every
    mode gets a time per batch size and a prefill time."""
    from executor_svc import worker

    bench = _bench("executor_modes")
    common = dict(model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.02, cache_dir=str(tmp_path))
    runners = {
        plan: worker.load(ExecutorConfig(cpu_linear_plan=plan, swap_space=0.0, **common)).runner
        for plan in ("table", "measure")
    }
    with torch.inference_mode():
        out = bench.run_interleaved(runners, [1, 3], ctx=16, steps=4)
    assert set(out) == {"table", "measure"}
    for r in out.values():
        assert set(r["decode_ms"]) == {1, 3} and all(ms > 0 for ms in r["decode_ms"].values())
        assert r["prefill_512_ms"] > 0 and len(r["tokens"]) == 4 + 3
    assert out["table"]["tokens"] == out["measure"]["tokens"]


def test_a_linear_no_plan_was_applied_to_computes_float32():
    lin = Linear(32, 16, False, torch.float32, "cpu")
    assert lin.plan is kp.DEFAULT_PLAN
    lin.weight.data.normal_()
    x = torch.randn(3, 32)
    torch.testing.assert_close(lin(x), x @ lin.weight.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown linear kernel"):
        lin.apply_kernel(x, "fastest")


def test_a_disturbed_measurement_is_not_kept_and_the_tables_serve(tiny_model_path, tmp_path, monkeypatch, caplog):
    """Issue 32: a plan measured while other work shared the CPU (its repeats disagree, or other
    processes used our CPUs meanwhile) would serve every later start with the load's choices.
    It is not kept: this start serves the tables, the next one measures again."""
    import logging

    from chunkserve_contracts.cpu import CpuTimes
    from executor_svc import worker

    busy = iter([CpuTimes(0.0, 0.0, 0.0, 2), CpuTimes(1.0, 0.5, 1.0, 2)])  # others: 0.5 of 2 CPU-seconds
    quiet = dict(cpu=lambda: None)
    real = lp.measure
    modes = {"load": dict(cpu=lambda: next(busy)), "bursts": {}, "fair": quiet}

    def fake_measure(model, **kw):
        burst = mode[0] == "bursts"
        seen = {}

        def cost(p, k, m):  # "packed" wins; with bursts every run of a candidate after its first is 1.5x
            n = seen[(p, k, m)] = seen.get((p, k, m), -1) + 1
            return (0.1 if k == "packed" else 1.0) * (1.5 if burst and n else 1.0)

        return real(model, clock=_fake_clock(cost, []), **(modes[mode[0]] | kw))

    monkeypatch.setattr(lp, "measure", fake_measure)
    common = dict(model=str(tiny_model_path), device="cpu", kv_cache_memory_gib=0.01, cache_dir=str(tmp_path))
    folder = tmp_path / "linear-plans"
    for name in ("load", "bursts"):
        mode = [name]
        with caplog.at_level(logging.INFO, logger="executor_svc.worker"):
            model = worker.load(ExecutorConfig(**common)).runner.model
        assert not folder.exists() or not list(folder.glob("*.json"))  # nothing kept
        assert "not kept" in caplog.text and "the tables" in caplog.text
        tables = kp.table_plan(None, packed=prepack_measured(), padding=True, upto=2048)
        assert model.model.plan == tables and model.lm_head.plan == tables
        caplog.clear()
    mode = ["fair"]
    model = worker.load(ExecutorConfig(**common)).runner.model
    assert len(list(folder.glob("*.json"))) == 1 and "packed" in model.model.plan.kernels


def test_disturbance_reads_the_load_and_the_spread():
    fair = {("linears", 1): {"mm": [1.0, 1.02, 1.01], "packed": [0.5, 0.51, 0.5]}}
    assert lp.disturbance(fair, 0.05) is None and lp.disturbance(fair, None) is None
    assert "other processes used 50%" in lp.disturbance(fair, 0.5)
    bursty = {("linears", m): {"mm": [1.0, 1.6, 2.0]} for m in (1, 2, 4)}
    assert "repeats disagree" in lp.disturbance(bursty, 0.0)


def test_the_suite_keeps_out_of_the_users_cache():
    """Issue 32: tests wrote tiny-model and loaded-machine plans into ~/.cache/chunkserve, which
    every later start of the user's server then read. tests/conftest.py points every default
    cache folder (this process's and every server child's) at the suite's own."""
    import os
    from pathlib import Path

    from executor_svc.config import default_cache_dir

    assert Path(default_cache_dir()) != Path.home() / ".cache" / "chunkserve"
    assert default_cache_dir() == os.environ["CHUNKSERVE_CACHE_DIR"]
    # plans measured here live only as long as the run; the converted models are the kept ones
    assert Path(default_cache_dir()).name.startswith("chunkserve-test-cache-")
    kept = Path(os.environ.get("CHUNKSERVE_TEST_CACHE_DIR") or Path(__file__).resolve().parents[2] / ".test-cache")
    assert (Path(default_cache_dir()) / "models").resolve() == (kept / "models").resolve()
    assert not (Path(default_cache_dir()) / "linear-plans").resolve().is_relative_to(kept.resolve())


@needs_onednn
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_reduced_mode_keeps_float32s_plan_where_no_reduced_copy_wins(tiny_configs, hf_model_factory, tmp_path, data):
    """bfloat16's plan is float32's kept plan, bucket for bucket, except where a reduced copy is
    MARGIN faster than float32's kernel there: never another float32 kernel (two independent
    measurements once gave bfloat16 "mm" and float32 "packed" at 13-16 rows). The float32 plan is
    the very file a float32 executor keeps, read back rather than measured a second time."""
    import tempfile

    model = _with_copies(_model(tiny_configs, hf_model_factory), "bfloat16")
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # a fresh one per example: nothing kept yet
    keys = [(part, k, m) for part in ("linears", "head") for k in kp.KERNELS for m in lp.buckets_for(32, part)]
    # each measurement its own costs: two measurements never agree exactly on a real machine
    tables = [data.draw(st.fixed_dictionaries({key: st.floats(0.1, 2.0) for key in keys})) for _ in range(2)]
    costs = tables[1]  # the reduced mode's measurement

    measured_with: list = []
    real = lp.measure

    def fake_measure(model, **kw):
        table = tables[len(measured_with)]
        measured_with.append(kw.get("reduced"))
        return real(model, clock=_fake_clock(lambda p, k, m: table[(p, k, m)], []), **kw)

    kw = dict(remeasure=False, reduced_max_rows=None, padding=True, budget=32)
    cands = dict(padding=True, packed=True, reduced="bfloat16", reduced_max_rows=None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lp, "measure", fake_measure)
        with lp.float32_only(model):
            (f32_body, f32_head), _ = lp.kept_or_measured(model, folder, reduced=None, **kw)
        assert model.lm_head.reduced is not None  # the copies are back
        (body, head), source = lp.kept_or_measured(model, folder, reduced="bfloat16", **kw)
    assert measured_with == [None, "bfloat16"]  # float32's plan was read back, not measured again
    for plan, f32, part in ((body, f32_body, "linears"), (head, f32_head, "head")):
        for m in plan.buckets:
            k, k32 = plan(m), f32(m)
            if k in lp.REDUCED_KERNELS:
                assert costs[(part, k, m)] < costs[(part, k32, m)] * (1 - kp.MARGIN)
            else:
                assert k == k32
                timed = [r for r in lp.REDUCED_KERNELS if r in kp.candidates(m, **cands)]
                assert all(costs[(part, r, m)] >= costs[(part, k32, m)] * (1 - kp.MARGIN) for r in timed)


@needs_onednn
def test_a_reduced_plan_is_measured_again_when_float32s_plan_changes(tiny_configs, hf_model_factory, tmp_path):
    """float32's plan is part of the reduced plan's key: a new float32 plan (remeasured) makes
    a new reduced one, and a disturbed float32 measurement leaves the reduced mode on the tables."""
    model = _with_copies(_model(tiny_configs, hf_model_factory), "bfloat16")
    winner = ["mm"]
    counted: list = []

    def cost(part, kernel, m):
        counted.append(kernel)
        return 0.1 if kernel == winner[0] else 1.0

    kw = dict(reduced_max_rows=None, padding=True, budget=8)
    real = lp.measure
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lp, "measure", lambda model, **k: real(model, clock=_fake_clock(cost, []), **k))
        first, _ = lp.kept_or_measured(model, tmp_path, remeasure=False, reduced="bfloat16", **kw)
        assert set(first[0].kernels) == {"mm"}
        winner[0] = "packed"
        again, _ = lp.kept_or_measured(model, tmp_path, remeasure=False, reduced="bfloat16", **kw)
        assert again == first  # both kept: read back
        counted.clear()
        new, _ = lp.kept_or_measured(model, tmp_path, remeasure=True, reduced="bfloat16", **kw)
        assert set(new[0].kernels) == {"packed"} and "mm" in counted  # float32 measured again, then bf16
        mp.setattr(lp, "disturbance", lambda samples, others: "a burst of load")
        plans, source = lp.kept_or_measured(model, tmp_path / "other", remeasure=False, reduced="bfloat16", **kw)
    assert plans is None and source.startswith("float32's not kept: a burst of load")


@pytest.mark.parametrize(
    ("mm", "packed", "fused", "want"),
    [
        (1.0, 1.1, True, "packed"),  # a step on "packed" runs fused: 10% slower alone still wins
        (1.0, 1.15, True, "packed"),
        (1.0, 1.3, True, "mm"),  # unless "mm" is FUSED_MARGIN faster alone
        (1.0, 1.1, False, "mm"),  # no fused path loaded: the plain rule (MARGIN)
        (1.0, 0.9, False, "packed"),
    ],
)
def test_at_decode_sizes_a_fused_kernel_keeps_its_bucket_unless_mm_is_much_faster(mm, packed, fused, want):
    costs = {"mm": mm, "packed": packed, "reduced": 5.0}
    assert kp.choose(lp._fused_bias(costs, fused)) == want
    assert lp._fused_bias(costs, fused)["packed"] == packed  # the fused kernels' costs are as measured


@needs_onednn
@pytest.mark.skipif(not NATIVE, reason="the native library (gemv, fused decode) did not load here")
def test_measure_biases_decode_buckets_only_with_the_fused_path(tiny_configs, hf_model_factory):
    model = _with_copies(_model(tiny_configs, hf_model_factory), None)

    def cost(part, kernel, m):  # "mm" 10% faster alone everywhere; gemv never
        return {"mm": 1.0, "packed": 1.1}.get(kernel, 3.0)

    fused = lp.measure(model, gemv=True, budget=512, clock=_fake_clock(cost, []))
    plain = lp.measure(model, gemv=False, budget=512, clock=_fake_clock(cost, []))
    assert [fused.body(m) for m in (3, 16, 128, 256, 512)] == ["packed"] * 3 + ["mm"] * 2
    assert set(plain.body.kernels) == {"mm"} and set(fused.head.kernels) == {"mm"}  # the head is never fused
