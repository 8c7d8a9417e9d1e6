"""Batched paged attention (`engine.model.paged_attend` through `PagedAttention`):
every form (SDPA, the CPU's embedding bags, bounded blocks, kvlife's native
decode kernel) equals a per-row
float64 softmax, for dense and paged contexts, sliding windows, grouped heads
and mixed prefill + decode steps; one call per layer for the decode rows and
one for the prefill chunks; no mask where the shape says it all; no call
gathers more than its budget."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model import paged_attend
from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.native_kernels import kernel_problem, load_kernels
from naive_attention import naive_attention as _naive
from resources.kv_buffers import KVBuffers

PAGE = 4
KV_HEADS, HEAD_DIM = 2, 8


@contextlib.contextmanager
def _form(form: str):
    """Force every call through one form: "sdpa", "bags" (decode rows; "bags-rows": one row's keys at a time),
    "blocks" (one page per block) or "native" (decode rows through kvlife's kernel, given as `_kernel(form)`)."""
    saved = paged_attend.BAG_MIN_TOKENS, paged_attend.GATHER_BUDGET, paged_attend.BAG_CHUNK_BYTES
    if form.startswith("bags"):
        paged_attend.BAG_MIN_TOKENS = 0
        paged_attend.BAG_CHUNK_BYTES = 1 if form == "bags-rows" else saved[2]
    elif form == "sdpa":
        paged_attend.BAG_MIN_TOKENS = 1 << 40
    elif form == "native":  # decode rows through the kernel, prefill chunks as torch would take them
        pass
    else:
        paged_attend.GATHER_BUDGET = 1
    try:
        yield
    finally:
        paged_attend.BAG_MIN_TOKENS, paged_attend.GATHER_BUDGET, paged_attend.BAG_CHUNK_BYTES = saved


def _kernel(form: str):
    """kvlife's native decode kernel for the "native" form (it must build here: CI has a compiler), else None."""
    if form != "native":
        return None
    kernel = load_kernels()
    assert kernel is not None, kernel_problem()
    return kernel


def _step(shapes, group: int, seed: int, dtype=torch.float32, scattered: bool = True):
    """KV buffers, (by-locations, by-pages) metadata and q/k/v for sequences of (new, cached) tokens."""
    gen = torch.Generator().manual_seed(seed)
    kv = KVBuffers(num_layers=1, num_pages=96, page_size=PAGE, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
                   device="cpu")
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    order = ((torch.randperm(95, generator=gen) + 1) if scattered else torch.arange(1, 96)).tolist()
    rows, locs = [], []
    for q_len, cached in shapes:
        n = q_len + cached
        pages = [order.pop(0) for _ in range(-(-n // PAGE))]
        rows.append(pages)
        locs.append(torch.tensor([pages[i // PAGE] * PAGE + i % PAGE for i in range(n)]))
    by_locs = AttentionMetadata.from_locations(locs, [q_len for q_len, _ in shapes])
    width = max(len(r) for r in rows)
    pages = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    by_pages = AttentionMetadata(out_locs=by_locs.out_locs, q_lens=by_locs.q_lens, kv_lens=by_locs.kv_lens,
                                 kv_pages=pages, page_size=PAGE)
    tokens = by_locs.num_tokens
    q = torch.randn(tokens, KV_HEADS * group, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return kv, by_locs, by_pages, q, k, v


class TestForms:
    @settings(max_examples=20, deadline=None)
    @given(
        shapes=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 13)), min_size=1, max_size=5),
        group=st.sampled_from([1, 2, 4]),
        window=st.sampled_from([None, 1, 3, 6]),
        by_pages=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    @pytest.mark.parametrize("form", ["sdpa", "bags", "bags-rows", "blocks", "native"])
    def test_every_form_equals_the_naive_softmax(self, form, shapes, group, window, by_pages, seed):
        """Any mix of decode rows and prefill chunks, by pages or by token locations, with or without a
        window: each form's output equals a per-row float64 softmax, and the new K/V are stored."""
        kv, by_locs, paged, q, k, v = _step(shapes, group, seed)
        with _form(form):
            out = PagedAttention(kv, paged if by_pages else by_locs, layer_windows=[window],
                                 kernel=_kernel(form)).attend(0, q, k, v)
        assert torch.equal(kv.k[0][by_locs.out_locs], k) and torch.equal(kv.v[0][by_locs.out_locs], v)
        expected = _naive(q, kv.k[0], kv.v[0], by_locs, window)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("form", ["sdpa", "bags", "bags-rows", "blocks", "native"])
    def test_bfloat16_softmax_runs_in_float32(self, form):
        """In bfloat16 every form stays within bfloat16's rounding of the float64 softmax (the native
        kernel takes float32 only: bfloat16 rows fall back to torch's forms)."""
        shapes = [(1, 30), (1, 7), (5, 9), (1, 22)]
        kv, by_locs, paged, q, k, v = _step(shapes, 2, seed=4, dtype=torch.bfloat16)
        with _form(form):
            out = PagedAttention(kv, paged, layer_windows=[None], kernel=_kernel(form)).attend(0, q, k, v)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), _naive(q, kv.k[0], kv.v[0], by_locs, None), atol=2e-2, rtol=2e-2)


class _CountCalls:
    """Records each `paged_attend.attend` call's query shape and each SDPA call's mask arguments."""

    def __init__(self, monkeypatch) -> None:
        self.attends: list[tuple[int, ...]] = []
        self.sdpa: list[dict] = []
        real_attend, real_sdpa = paged_attend.attend, F.scaled_dot_product_attention

        def attend(q, *args):
            self.attends.append(tuple(q.shape))
            return real_attend(q, *args)

        def sdpa(*args, **kwargs):
            self.sdpa.append({k: kwargs.get(k) for k in ("attn_mask", "is_causal")})
            return real_sdpa(*args, **kwargs)

        class Functional:  # torch.nn.functional with SDPA recorded (the module itself stays untouched)
            scaled_dot_product_attention = staticmethod(sdpa)

            def __getattr__(self, name):
                return getattr(F, name)

        monkeypatch.setattr("engine.model.attention.attend", attend)
        monkeypatch.setattr(paged_attend, "F", Functional())


class TestCalls:
    def test_one_call_for_the_decode_rows_and_one_for_the_prefill_chunks(self, monkeypatch):
        """A step of three decode rows and two prefill chunks (3 and 5 tokens) makes two calls per layer:
        [3, 1, H, D] and [2, 5, H, D] (the shorter chunk padded)."""
        kv, by_locs, paged, q, k, v = _step([(1, 6), (3, 4), (1, 9), (5, 0), (1, 2)], 2, seed=1)
        calls = _CountCalls(monkeypatch)
        out = PagedAttention(kv, paged).attend(0, q, k, v)
        assert sorted(calls.attends) == [(2, 5, 4, HEAD_DIM), (3, 1, 4, HEAD_DIM)]
        torch.testing.assert_close(out.double(), _naive(q, kv.k[0], kv.v[0], by_locs, None), atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize(("shapes", "expected"), [
        ([(1, 11), (1, 11), (1, 11)], {"attn_mask": None, "is_causal": None}),  # decode rows of one length
        ([(9, 0)], {"attn_mask": None, "is_causal": True}),  # a whole prompt in one chunk
    ], ids=["equal-decode", "whole-prompt"])
    def test_no_mask_where_the_shape_says_it_all(self, monkeypatch, shapes, expected):
        """Equal-length decode rows, and a chunk that is its whole context, reach SDPA with no mask
        (so CUDA may choose its flash kernel); the result still equals the naive softmax."""
        kv, by_locs, paged, q, k, v = _step(shapes, 2, seed=2)
        calls = _CountCalls(monkeypatch)
        with _form("sdpa"):
            out = PagedAttention(kv, paged).attend(0, q, k, v)
        assert calls.sdpa == [expected]
        torch.testing.assert_close(out.double(), _naive(q, kv.k[0], kv.v[0], by_locs, None), atol=1e-5, rtol=1e-5)

    @pytest.mark.filterwarnings("ignore:.*(flash|[Ee]fficient|[Mm]emory).*:UserWarning")
    def test_a_chunk_after_a_prefix_takes_the_lower_right_causal_bias(self, monkeypatch):
        """A chunk that extends a cached prefix gets torch's lower-right causal bias, not a mask tensor (on CUDA;
        here made to take it on CPU too, where torch materialises it and warns that no fused kernel applies)."""
        kv, by_locs, paged, q, k, v = _step([(6, 10)], 1, seed=3)
        calls = _CountCalls(monkeypatch)
        monkeypatch.setattr(paged_attend, "LOWER_RIGHT_DEVICES", frozenset({"cpu", "cuda"}))
        out = PagedAttention(kv, paged).attend(0, q, k, v)
        (call,) = calls.sdpa
        assert type(call["attn_mask"]).__name__ == "CausalBias"
        torch.testing.assert_close(out.double(), _naive(q, kv.k[0], kv.v[0], by_locs, None), atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("window", [None, 3])
    def test_whole_prompts_of_one_length_read_nothing_back(self, monkeypatch, window):
        """Three prompts of 6 tokens, each whole in one chunk: attended on their own k/v (no gather from the KV
        buffers), causal with no mask unless a window is shorter; equal to the naive softmax."""
        kv, by_locs, paged, q, k, v = _step([(6, 0), (6, 0), (6, 0)], 2, seed=8)
        monkeypatch.setattr(paged_attend.ContextBatch, "fetch", lambda *args, **kwargs: pytest.fail("gathered"))
        calls = _CountCalls(monkeypatch)
        out = PagedAttention(kv, paged, layer_windows=[window]).attend(0, q, k, v)
        (call,) = calls.sdpa
        assert (call["attn_mask"] is None) == (window is None) and calls.attends == []
        torch.testing.assert_close(out.double(), _naive(q, kv.k[0], kv.v[0], by_locs, window), atol=1e-5, rtol=1e-5)

    def test_windows_and_unequal_lengths_keep_their_mask(self, monkeypatch):
        """Unequal decode lengths get a mask (one built per step, not per layer)."""
        kv, by_locs, paged, q, k, v = _step([(1, 3), (1, 12)], 2, seed=5)
        calls = _CountCalls(monkeypatch)
        attention = PagedAttention(kv, paged)
        with _form("sdpa"):
            attention.attend(0, q, k, v)
            attention.attend(0, q, k, v)
        first, second = calls.sdpa
        assert first["attn_mask"] is not None and second["attn_mask"] is first["attn_mask"]


class TestBudget:
    def test_no_call_gathers_more_than_the_budget(self, monkeypatch):
        """With a budget of 3 pages of K and V per call, every fetch is at most 3 pages, and the output still
        equals the naive softmax (decode rows and a prefill chunk, contexts of up to 10 pages)."""
        kv, by_locs, paged, q, k, v = _step([(1, 37), (4, 30), (1, 5)], 2, seed=6)
        per_page = PAGE * KV_HEADS * HEAD_DIM * 4 * 2  # K and V bytes of one page of one row
        fetched: list[int] = []
        real_fetch = paged_attend.ContextBatch.fetch

        def fetch(self, buf, start=0, stop=None):
            gathered = real_fetch(self, buf, start, stop)
            fetched.append(gathered.shape[0] * gathered.shape[1] // PAGE)  # rows x page columns
            return gathered

        monkeypatch.setattr(paged_attend.ContextBatch, "fetch", fetch)
        monkeypatch.setattr(paged_attend, "GATHER_BUDGET", 3 * per_page)
        out = PagedAttention(kv, paged).attend(0, q, k, v)
        assert fetched and max(fetched) <= 3
        torch.testing.assert_close(out.double(), _naive(q, kv.k[0], kv.v[0], by_locs, None), atol=1e-5, rtol=1e-5)

    def test_blocks_write_nothing_for_padding_queries(self):
        """A short chunk padded to a longer one's length in the blocks form gives finite outputs everywhere."""
        kv, by_locs, paged, q, k, v = _step([(2, 0), (7, 3)], 4, seed=7)
        with _form("blocks"):
            out = PagedAttention(kv, paged, layer_windows=[2]).attend(0, q, k, v)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), _naive(q, kv.k[0], kv.v[0], by_locs, 2), atol=1e-5, rtol=1e-5)
