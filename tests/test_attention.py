"""Tests for engine.model.attention: the metadata contract, PagedAttention against
a naive per-head softmax, and the paged model forward against the dense
full-recompute oracle."""

from __future__ import annotations

import contextlib
import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model import paged_attend
from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.dense_reference import dense_forward
from engine.model.model_config import ModelConfig
from engine.model.llama import LlamaModel
from naive_attention import naive_attention as _naive_attention
from resources.kv_buffers import KVBuffers

PAGE_SIZE = 4


def _make_kv(config: ModelConfig, num_pages: int = 96) -> KVBuffers:
    return KVBuffers(
        num_layers=config.num_layers,
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=torch.float32,
        device="cpu",
    )


class _ScatteredPages:
    """Hands out pages 1.. in a shuffled order, so no sequence is contiguous."""

    def __init__(self, num_pages: int, seed: int) -> None:
        self.free = list(range(1, num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self) -> int:
        return self.free.pop()


class _PagedSequence:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.pages: list[int] = []
        self.cached = 0  # tokens whose K/V is in the buffers

    def locations(self, length: int, pages: _ScatteredPages) -> torch.Tensor:
        while len(self.pages) * PAGE_SIZE < length:
            self.pages.append(pages.take())
        return torch.tensor([self.pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(length)])


def _run_paged_step(
    model: LlamaModel, kv: KVBuffers, pages: _ScatteredPages, step: list[tuple[_PagedSequence, int]]
) -> list[torch.Tensor]:
    """Forward `step` (sequence, new token count) pairs as one batch; returns
    each sequence's logits rows and advances its cached count."""
    ids, positions, context_locs = [], [], []
    for seq, count in step:
        start, end = seq.cached, seq.cached + count
        ids.append(torch.tensor(seq.tokens[start:end]))
        positions.append(torch.arange(start, end))
        context_locs.append(seq.locations(end, pages))
    meta = AttentionMetadata.from_locations(context_locs, [count for _, count in step])
    with torch.inference_mode():
        logits = model(torch.cat(ids), torch.cat(positions), PagedAttention(kv, meta))
    for seq, count in step:
        seq.cached += count
    return list(logits.split([count for _, count in step]))


def _assert_matches_dense(model: LlamaModel, seq: _PagedSequence, count: int, logits: torch.Tensor) -> None:
    expected = dense_forward(model, seq.tokens[: seq.cached])[seq.cached - count :]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


class TestAttentionMetadata:
    def test_from_locations_pads_and_takes_trailing_locations(self):
        """out_locs are each sequence's last q_len locations; kv_locs rows are padded with 0."""
        meta = AttentionMetadata.from_locations([torch.tensor([8, 9, 10]), torch.tensor([20, 21, 22, 23, 4])], [2, 1])
        assert meta.out_locs.tolist() == [9, 10, 4]
        assert meta.q_lens == (2, 1) and meta.kv_lens == (3, 5)
        assert meta.kv_locs.tolist() == [[8, 9, 10, 0, 0], [20, 21, 22, 23, 4]]
        assert meta.num_tokens == 3 and not meta.is_decode_only

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            (dict(q_lens=[2], kv_lens=[1]), "q_len"),
            (dict(q_lens=[0], kv_lens=[1]), "q_len"),
            (dict(q_lens=[1, 1], kv_lens=[1]), "same sequences"),
            (dict(q_lens=[1], kv_lens=[5]), "columns"),
        ],
    )
    def test_inconsistent_metadata_is_rejected(self, kwargs, message):
        """Lengths that contradict each other or the tensors raise ValueError naming the problem."""
        with pytest.raises(ValueError, match=message):
            AttentionMetadata(out_locs=torch.tensor([4]), kv_locs=torch.tensor([[4, 5]]), **kwargs)

    def test_out_locs_count_must_match_q_lens(self):
        """out_locs must hold exactly sum(q_lens) entries."""
        with pytest.raises(ValueError, match="out_locs"):
            AttentionMetadata(out_locs=torch.tensor([4, 5]), q_lens=[1], kv_lens=[2], kv_locs=torch.tensor([[4, 5]]))


def _paged_context(shapes, num_pages: int, gen: torch.Generator):
    """Page-aligned contexts on shuffled pages 1..: (kv_pages [B, P], locations per sequence)."""
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    rows, locs = [], []
    for q_len, old in shapes:
        n = old + q_len
        pages = [order.pop() for _ in range(-(-n // PAGE_SIZE))]
        rows.append(pages)
        locs.append(torch.tensor([pages[i // PAGE_SIZE] * PAGE_SIZE + i % PAGE_SIZE for i in range(n)]))
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows]), locs


@contextlib.contextmanager
def _bag_path():
    """Every decode batch through the embedding-bag path (normally only large ones)."""
    saved = paged_attend.BAG_MIN_TOKENS
    paged_attend.BAG_MIN_TOKENS = 0
    try:
        yield
    finally:
        paged_attend.BAG_MIN_TOKENS = saved


class TestPagedMetadata:
    def test_context_must_be_given_exactly_once(self):
        """Neither or both of kv_locs and kv_pages raise ValueError."""
        with pytest.raises(ValueError, match="exactly one"):
            AttentionMetadata(out_locs=torch.tensor([4]), q_lens=[1], kv_lens=[1])
        with pytest.raises(ValueError, match="exactly one"):
            AttentionMetadata(out_locs=torch.tensor([4]), q_lens=[1], kv_lens=[1], kv_locs=torch.tensor([[4]]),
                              kv_pages=torch.tensor([[1]]), page_size=4)

    def test_pages_must_cover_the_longest_context(self):
        """kv_pages columns * page_size below the longest context raise ValueError."""
        with pytest.raises(ValueError, match="columns"):
            AttentionMetadata(out_locs=torch.tensor([4]), q_lens=[1], kv_lens=[5], kv_pages=torch.tensor([[1]]),
                              page_size=4)

    def test_select_keeps_the_chosen_sequences(self):
        """select(seqs) keeps those sequences' new-token locations, lengths and context rows, in that order."""
        meta = AttentionMetadata.from_locations([torch.tensor([8, 9, 10]), torch.tensor([20, 21]),
                                                 torch.tensor([4, 5, 6, 7])], [2, 1, 3])
        part = meta.select([2, 0])
        assert part.out_locs.tolist() == [5, 6, 7, 9, 10]
        assert part.q_lens == (3, 2) and part.kv_lens == (4, 3)
        assert part.kv_locs.tolist() == [[4, 5, 6, 7], [8, 9, 10, 0]]

    @settings(max_examples=25, deadline=None)
    @given(
        shapes=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 13)), min_size=1, max_size=5),
        group=st.sampled_from([1, 2, 4]),
        seed=st.integers(0, 2**16),
    )
    def test_pages_give_the_same_output_as_locations(self, shapes, group, seed):
        """The same contexts as page tables or as token locations: equal outputs and writes."""
        gen = torch.Generator().manual_seed(seed)
        kv_by_pages = KVBuffers(num_layers=1, num_pages=64, page_size=PAGE_SIZE, num_kv_heads=2, head_dim=8,
                                dtype=torch.float32, device="cpu")
        kv_by_pages.k[0].normal_(generator=gen)
        kv_by_pages.v[0].normal_(generator=gen)
        kv_by_locs = copy.deepcopy(kv_by_pages)
        pages, locs = _paged_context(shapes, 64, gen)
        by_locs = AttentionMetadata.from_locations(locs, [q_len for q_len, _ in shapes])
        by_pages = AttentionMetadata(out_locs=by_locs.out_locs, q_lens=by_locs.q_lens, kv_lens=by_locs.kv_lens,
                                     kv_pages=pages, page_size=PAGE_SIZE)
        tokens = by_locs.num_tokens
        q = torch.randn(tokens, 2 * group, 8, generator=gen)
        k = torch.randn(tokens, 2, 8, generator=gen)
        v = torch.randn(tokens, 2, 8, generator=gen)
        with _bag_path():  # decode rows through the bmm + embedding_bag path, whatever their size
            out_pages = PagedAttention(kv_by_pages, by_pages).attend(0, q, k, v)
        out_locs = PagedAttention(kv_by_locs, by_locs).attend(0, q, k, v)
        torch.testing.assert_close(out_pages, out_locs, atol=1e-5, rtol=1e-5)
        assert torch.equal(kv_by_pages.k[0], kv_by_locs.k[0]) and torch.equal(kv_by_pages.v[0], kv_by_locs.v[0])
        torch.testing.assert_close(out_pages.double(), _naive_attention(q, kv_by_locs.k[0], kv_by_locs.v[0], by_locs),
                                   atol=1e-5, rtol=1e-5)

    def test_decode_from_device_tensors_equals_metadata(self):
        """PagedAttention.decode (device lengths, the CUDA-graph form) equals the metadata form."""
        gen = torch.Generator().manual_seed(3)
        kv = KVBuffers(num_layers=1, num_pages=64, page_size=PAGE_SIZE, num_kv_heads=2, head_dim=8,
                       dtype=torch.float32, device="cpu")
        kv.k[0].normal_(generator=gen)
        kv.v[0].normal_(generator=gen)
        shapes = [(1, 0), (1, 6), (1, 13)]
        pages, locs = _paged_context(shapes, 64, gen)
        meta = AttentionMetadata.from_locations(locs, [1, 1, 1])
        q = torch.randn(3, 4, 8, generator=gen)
        k = torch.randn(3, 2, 8, generator=gen)
        v = torch.randn(3, 2, 8, generator=gen)
        expected = PagedAttention(kv, meta).attend(0, q, k, v)
        got = PagedAttention.decode(kv, meta.out_locs, pages, torch.tensor(meta.kv_lens)).attend(0, q, k, v)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        with _bag_path():
            windowed = PagedAttention(kv, meta, layer_windows=[5]).attend(0, q, k, v)
        for b, n in enumerate(meta.kv_lens):  # a window of 5: each query sees its last 5 keys only
            window_meta = AttentionMetadata.from_locations([locs[b][max(0, n - 5):]], [1])
            alone = PagedAttention(kv, window_meta).attend(0, q[b : b + 1], k[b : b + 1], v[b : b + 1])
            torch.testing.assert_close(windowed[b : b + 1], alone, atol=1e-5, rtol=1e-5)


class TestPagedAttention:
    @settings(max_examples=25, deadline=None)
    @given(
        shapes=st.lists(
            st.tuples(st.integers(1, 6), st.integers(0, 9)), min_size=1, max_size=5
        ),  # (q_len, old context length) per sequence
        group=st.sampled_from([1, 2, 4]),
        seed=st.integers(0, 2**16),
    )
    def test_matches_naive_softmax(self, shapes, group, seed):
        """Any mix of decode rows and prefill chunks equals a per-head float64 softmax over the context."""
        gen = torch.Generator().manual_seed(seed)
        num_kv_heads, head_dim, num_pages = 2, 8, 64
        kv = KVBuffers(
            num_layers=1,
            num_pages=num_pages,
            page_size=PAGE_SIZE,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=torch.float32,
            device="cpu",
        )
        kv.k[0].normal_(generator=gen)
        kv.v[0].normal_(generator=gen)
        locations = torch.randperm(kv.num_tokens - PAGE_SIZE, generator=gen) + PAGE_SIZE
        context_locs, start = [], 0
        for q_len, old in shapes:
            context_locs.append(locations[start : start + old + q_len])
            start += old + q_len
        meta = AttentionMetadata.from_locations(context_locs, [q_len for q_len, _ in shapes])
        tokens = meta.num_tokens
        q = torch.randn(tokens, num_kv_heads * group, head_dim, generator=gen)
        k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
        out = PagedAttention(kv, meta).attend(0, q, k, v)
        assert torch.equal(kv.k[0][meta.out_locs], k) and torch.equal(kv.v[0][meta.out_locs], v)
        torch.testing.assert_close(out.double(), _naive_attention(q, kv.k[0], kv.v[0], meta), atol=1e-5, rtol=1e-5)

    def test_padding_page_contents_never_leak_into_output(self):
        """Huge values at the padding page's locations do not change any output."""
        config = ModelConfig.tiny()
        kv = _make_kv(config, num_pages=8)
        gen = torch.Generator().manual_seed(1)
        meta = AttentionMetadata.from_locations(
            [torch.arange(8, 11), torch.arange(12, 20), torch.arange(20, 23)], [1, 1, 3]
        )
        q = torch.randn(5, config.num_heads, config.head_dim, generator=gen)
        k = torch.randn(5, config.num_kv_heads, config.head_dim, generator=gen)
        v = torch.randn(5, config.num_kv_heads, config.head_dim, generator=gen)
        clean = PagedAttention(kv, meta).attend(0, q, k, v)
        kv.k[0][:PAGE_SIZE] = 1e4
        kv.v[0][:PAGE_SIZE] = 1e4
        torch.testing.assert_close(PagedAttention(kv, meta).attend(0, q, k, v), clean)


# (sequence index, new tokens) per step; sequences start with 0 tokens cached.
_COMPOSITIONS = [
    [(0, 7), (1, 5)],  # two prefills, one of them a first chunk
    [(1, 8), (0, 1), (2, 1)],  # chunk, decode, one-token prompt in between
    [(0, 1), (1, 1), (2, 1), (3, 9)],  # decode rows batched with a prefill chunk
    [(3, 11)],  # last chunk alone
    [(0, 1), (1, 1), (2, 1), (3, 1)],  # pure decode, four lengths
    [(3, 1), (1, 1), (0, 1)],  # pure decode, different subset and order
    [(2, 3), (0, 1), (3, 1)],  # a sequence extended by a multi-token chunk after decoding
    [(0, 1), (1, 1), (2, 1), (3, 1)],
]


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig.tiny(),
        ModelConfig.tiny_moe(),
        ModelConfig.tiny(num_kv_heads=4, attention_bias=True, tie_word_embeddings=True),
    ],
    ids=["tiny-gqa", "tiny-moe", "mha-bias-tied"],
)
def test_paged_forward_matches_dense_forward(config):
    """Chunked prefill and batched decode over scattered pages give the dense oracle's logits (atol 1e-4)."""
    model = LlamaModel.from_seed(config, seed=3)
    rng = random.Random(5)
    sequences = [_PagedSequence([rng.randrange(256) for _ in range(40)]) for _ in range(4)]
    kv = _make_kv(config)
    pages = _ScatteredPages(96, seed=7)
    for composition in _COMPOSITIONS:
        step = [(sequences[index], count) for index, count in composition]
        for (seq, count), logits in zip(step, _run_paged_step(model, kv, pages, step), strict=True):
            _assert_matches_dense(model, seq, count, logits)
