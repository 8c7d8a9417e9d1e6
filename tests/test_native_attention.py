"""kvlife's native decode attention kernel (`engine.model.native_attention`):
it builds here and is reused from its cache, equals a float64 softmax on its
own (pages or token locations, grouped heads, windows, rows split over
threads), is what an engine attends its decode rows with by default, gives
the same greedy ids as torch's forms, and `EngineConfig.attention_kernel`
refuses what it cannot do before anything is allocated; a compiler that
fails leaves "auto" on torch's forms."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from engine import Engine, EngineConfig, InvalidConfig, SamplingParams
from engine.model import native_attention
from engine.model.attention import AttentionMetadata
from engine.model.native_attention import DecodeKernel, KernelBuild, decode_kernel_for, load_decode_kernel
from helpers import run_all, small_config
from naive_attention import naive_attention

PAGE, KV_HEADS, HEAD_DIM = 4, 2, 16


def _kernel() -> DecodeKernel:
    kernel = load_decode_kernel()
    assert kernel is not None, native_attention.kernel_problem()
    return kernel


def _decode_rows(lens: list[int], group: int, seed: int):
    """K/V buffers with rows of `lens` context tokens on scattered pages: (k_buf, v_buf, pages,
    locations, kv_lens, q, metadata by token locations for the naive softmax)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // PAGE) for n in lens) + 4
    k_buf = torch.randn(num_pages * PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    v_buf = torch.randn(num_pages * PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    rows = [[order.pop() for _ in range(-(-n // PAGE))] for n in lens]
    width = max(len(r) for r in rows)
    pages = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    locs = [torch.tensor([r[i // PAGE] * PAGE + i % PAGE for i in range(n)]) for r, n in zip(rows, lens)]
    longest = max(lens)
    locations = torch.stack([torch.cat([loc, loc.new_zeros(longest - len(loc))]) for loc in locs])
    q = torch.randn(len(lens), KV_HEADS * group, HEAD_DIM, generator=gen)
    meta = AttentionMetadata.from_locations(locs, [1] * len(lens))
    return k_buf, v_buf, pages, locations, torch.tensor(lens), q, meta


def test_it_builds_here_and_is_reused_from_its_cache(tmp_path):
    """A build into a fresh cache writes one library; a second build of the same source finds it there."""
    first = KernelBuild(tmp_path).load()
    assert first is not None, native_attention.kernel_problem()
    built = list(tmp_path.glob("decode_attention-*.so"))
    assert built == [first.path]
    stamp = first.path.stat().st_mtime_ns
    again = KernelBuild(tmp_path).load()
    assert again is not None and again.path == first.path and first.path.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_it_equals_the_naive_softmax(group, window):
    """Rows of 1 to 37 tokens, by pages and by token locations, grouped query heads, windows."""
    lens = [1, 4, 5, 13, 37, 20]
    k_buf, v_buf, pages, locations, kv_lens, q, meta = _decode_rows(lens, group, seed=group * 10 + (window or 0))
    expected = naive_attention(q, k_buf, v_buf, meta, window)
    kernel = _kernel()
    by_pages = kernel(q, k_buf, v_buf, pages, PAGE, kv_lens, window)
    by_locations = kernel(q, k_buf, v_buf, locations, 1, kv_lens, window)
    torch.testing.assert_close(by_pages.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_locations.double(), expected, atol=1e-5, rtol=1e-5)


def test_rows_split_over_threads_give_the_same_bits(monkeypatch):
    """With every call split over two threads, each row is computed as on one thread: equal bits."""
    k_buf, v_buf, pages, _, kv_lens, q, _ = _decode_rows([9, 30, 2, 17, 25], 2, seed=3)
    kernel = _kernel()
    single = kernel(q, k_buf, v_buf, pages, PAGE, kv_lens, None)
    monkeypatch.setattr(native_attention, "PARALLEL_MIN_TOKENS", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        split = kernel(q, k_buf, v_buf, pages, PAGE, kv_lens, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, split)


def test_it_takes_float32_on_the_cpu_only():
    k_buf, _, _, _, _, q, _ = _decode_rows([3], 1, seed=0)
    assert DecodeKernel.takes(q, k_buf)
    assert not DecodeKernel.takes(q.bfloat16(), k_buf.bfloat16())
    assert not DecodeKernel.takes(q, k_buf[:, :1])  # a buffer that is not contiguous


def test_the_mode_is_checked_before_anything_is_allocated():
    """An unknown mode, "native" off the CPU or on a bfloat16 model fail naming the field; "torch" and
    "auto" where it does not apply choose torch's forms."""
    with pytest.raises(InvalidConfig, match="attention_kernel"):
        EngineConfig(attention_kernel="fast")
    with pytest.raises(InvalidConfig, match="attention_kernel"):
        EngineConfig(attention_kernel="native", device="cuda")
    with pytest.raises(InvalidConfig, match="attention_kernel"):
        decode_kernel_for("native", torch.device("cpu"), torch.bfloat16)
    assert decode_kernel_for("torch", torch.device("cpu"), torch.float32) is None
    assert decode_kernel_for("auto", torch.device("cpu"), torch.bfloat16) is None
    assert decode_kernel_for("auto", torch.device("cpu"), torch.float32) is _kernel()


def test_a_compiler_that_fails(monkeypatch, tmp_path):
    """Fault: the compiler fails (CXX is `false`). "native" refuses to start, naming the field and the
    reason; "auto" logs `kernel.unavailable` once and attends with torch's forms."""
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(native_attention, "BUILD", KernelBuild(tmp_path))
    with capture_logs() as logs:
        with pytest.raises(InvalidConfig, match="attention_kernel.*could not be built"):
            decode_kernel_for("native", torch.device("cpu"), torch.float32)
        assert decode_kernel_for("auto", torch.device("cpu"), torch.float32) is None
    assert [e["event"] for e in logs].count("kernel.unavailable") == 1
    assert native_attention.kernel_problem() is not None and "false" in native_attention.kernel_problem()
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.anyio
async def test_engine_ids_equal_with_the_kernel_and_with_torch(monkeypatch):
    """A batch of decode rows (and a sampled row) with "native" and with "torch": the same ids; the
    kernel attended every decode step of the first and none of the second."""
    calls = []
    real = DecodeKernel.__call__

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DecodeKernel, "__call__", counted)
    prompts = [[5, 6, 7], list(range(20, 47)), [9] * 11, list(range(100, 103))]
    outputs, counts = [], []
    for mode in ("native", "torch"):
        calls.clear()
        async with Engine(small_config(attention_kernel=mode)) as engine:
            greedy = await run_all(engine, prompts, 14)
            sampled = await engine.complete(prompts[1], SamplingParams(max_new_tokens=8, temperature=0.9, seed=3))
            outputs.append((greedy, sampled.token_ids))
        counts.append(len(calls))
    assert outputs[0] == outputs[1]
    layers = 4  # the tiny model's
    assert counts[0] >= layers * (13 + 7) and counts[1] == 0
