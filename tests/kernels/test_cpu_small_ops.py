"""The native ops that replace aten's small ones between a step's products: silu(gate) * up
(csrc/cpu_silu.cpp) in the fused decode layers, and the greedy argmax (csrc/cpu_argmax.cpp) in
the sampler. Both must give aten's results exactly, bits and indices, on awkward inputs: tails
shorter than a vector, NaN, infinities, signed zeros, ties. Skipped where this machine has no
C++ compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkserve_kernels import cpu_native
from executor_svc import sampler

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")

SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 88.7, -88.7, 104.0, -104.0, 1e-30, -1e-30, 3e38]


@pytest.fixture(scope="module", autouse=True)
def native():
    why = cpu_native.load()
    assert why is None, why


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _with_specials(x: torch.Tensor, gen: torch.Generator, count: int) -> torch.Tensor:
    flat = x.reshape(-1)
    where = torch.randint(0, flat.numel(), (count,), generator=gen)
    flat[where] = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), (count,), generator=gen)]
    return x


def test_silu_matches_aten_on_this_machine():
    """The check the fused layers ask once: true for aten's kernel for this CPU (AVX-512 or
    AVX2 here), so the tests below test the native pass rather than a skip."""
    assert torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2")
    assert torch.ops.chunkserve.silu_mul_matches_aten()


@settings(max_examples=120, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 200),
    scale=st.sampled_from([1e-3, 1.0, 10.0, 100.0]),
    specials=st.integers(0, 6),
    padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_silu_mul_is_aten_silu_times_up_bitwise(rows, width, scale, specials, padded, seed):
    """Every width from 1 (all tail) to 200 (vectors and a tail), rows further apart than the
    width (a projection's rows with room after them), large values where exp(-x) overflows."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, 2 * width + (3 if padded else 0), generator=gen) * scale
    gate_up = _with_specials(wide, gen, specials)[:, : 2 * width]
    gate, up = gate_up.chunk(2, -1)
    assert torch.equal(_bits(torch.ops.chunkserve.silu_mul(gate_up)), _bits(F.silu(gate) * up))


def test_silu_mul_refuses_bad_input():
    op = torch.ops.chunkserve.silu_mul
    for bad in (torch.randn(2, 5), torch.randn(2, 6).double(), torch.randn(6), torch.randn(6, 2).t()):
        with pytest.raises(RuntimeError, match="gate_up must be"):
            op(bad)


def test_another_aten_kernel_turns_the_native_silu_off():
    """ATEN_CPU_CAPABILITY=default makes aten's silu a different computation: the check says no,
    and the fused layers keep aten's ops (their results still equal the Python layers')."""
    code = textwrap.dedent(
        """
        import torch
        from chunkserve_kernels import cpu_native
        assert cpu_native.load() is None
        print("matches", torch.ops.chunkserve.silu_mul_matches_aten())
        layers = torch.classes.chunkserve.DecodeLayers(1e-5, 2, 1, 0.5, 32)
        print("native silu", layers.native_silu())
        """
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "matches False" in out.stdout and "native silu False" in out.stdout
    assert torch.classes.chunkserve.DecodeLayers(1e-5, 2, 1, 0.5, 32).native_silu()  # here: on


def _logits(gen: torch.Generator, rows: int, vocab: int, kind: str) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen)
    if kind == "ties":
        return x.round().clamp_(-1, 1)
    if kind == "zeros":  # +0.0 and -0.0 only: equal, so the first of either sign wins
        return torch.where(x > 0, 0.0, -0.0)
    if kind == "all -inf":
        return x.fill_(float("-inf"))
    if kind == "specials":
        return _with_specials(x, gen, max(1, rows * vocab // 50))
    return x


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.one_of(st.integers(1, 70), st.sampled_from([1000, 49152])),
    kind=st.sampled_from(["random", "ties", "zeros", "all -inf", "specials"]),
    padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_greedy_argmax_is_aten_argmax(rows, vocab, kind, padded, seed):
    """The first index of the largest value; a row with a NaN, the first NaN's index (aten's
    argmax treats NaN as the largest); rows further apart than the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    logits = _logits(gen, rows, vocab + (5 if padded else 0), kind)[:, :vocab]
    want = logits.argmax(dim=-1)
    assert torch.equal(torch.ops.chunkserve.greedy_argmax(logits), want)
    assert torch.equal(sampler.greedy_ids(logits), want)


def test_greedy_ids_keeps_aten_for_strided_rows_and_other_dtypes(monkeypatch):
    """A batch's logits are the head's transposed view (columns contiguous): aten's argmax, as
    for bfloat16 logits; contiguous float32 rows take the native op."""
    calls, real = [], torch.ops.chunkserve.greedy_argmax
    monkeypatch.setattr(torch.ops.chunkserve, "greedy_argmax", lambda x: calls.append(x.shape) or real(x))
    gen = torch.Generator().manual_seed(1)
    transposed = torch.randn(300, 3, generator=gen).t()
    assert torch.equal(sampler.greedy_ids(transposed), transposed.argmax(dim=-1)) and calls == []
    half = torch.randn(2, 300, generator=gen).bfloat16()
    assert torch.equal(sampler.greedy_ids(half), half.argmax(dim=-1)) and calls == []
    rows = torch.randn(2, 300, generator=gen)
    assert torch.equal(sampler.greedy_ids(rows), rows.argmax(dim=-1)) and len(calls) == 1


def test_greedy_argmax_refuses_bad_input():
    op = torch.ops.chunkserve.greedy_argmax
    for bad in (torch.randn(3, 4).t(), torch.randn(2, 4).double(), torch.randn(4), torch.randn(2, 0)):
        with pytest.raises(RuntimeError, match="logits must be"):
            op(bad)
