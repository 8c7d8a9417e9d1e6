"""kvlife's native CPU kernels (`engine.model.native_kernels`): the library
builds here and is reused from its cache; decode attention equals a float64
softmax (pages or token locations, grouped heads, windows, rows split over
threads), over float32 K/V buffers and over bfloat16 ones (new rows stored
rounded as torch rounds them, bit for bit); RMSNorm with the residual add and RoPE equal torch's ops (RoPE bit
for bit); an engine uses them by default and gives the same greedy ids as
with torch's ops alone; `EngineConfig.native_kernels` refuses what it cannot
do before anything is allocated; a compiler that fails leaves "auto" on
torch's ops."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from engine import Engine, EngineConfig, FinishReason, InvalidConfig, SamplingParams
from engine.model import native_kernels
from engine.model.attention import AttentionMetadata
from engine.model.layers import GatedMLP, RMSNorm
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.native_build import KernelBuild
from engine.model.loading import install_native_kernels as install
from engine.model.native_kernels import NativeKernels, kernels_for, load_kernels
from engine.model.rope import apply_rope_
from helpers import assert_pools_whole, run_all, small_config
from naive_attention import naive_attention

PAGE, KV_HEADS, HEAD_DIM = 4, 2, 16


def _kernels() -> NativeKernels:
    kernels = load_kernels()
    assert kernels is not None, native_kernels.kernel_problem()
    return kernels


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
    """A build into a fresh cache writes one library; a second build of the same sources finds it there."""
    first = KernelBuild(tmp_path)
    assert first.load() is not None, first.problem
    assert list(tmp_path.glob("*.so")) == [first.path] and first.path is not None
    stamp = first.path.stat().st_mtime_ns
    again = KernelBuild(tmp_path)
    assert again.load() is not None and again.path == first.path and first.path.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_it_equals_the_naive_softmax(group, window):
    """Rows of 1 to 37 tokens, by pages and by token locations, grouped query heads, windows."""
    lens = [1, 4, 5, 13, 37, 20]
    k_buf, v_buf, pages, locations, kv_lens, q, meta = _decode_rows(lens, group, seed=group * 10 + (window or 0))
    expected = naive_attention(q, k_buf, v_buf, meta, window)
    kernels = _kernels()
    by_pages = kernels.decode_attention(q, k_buf, v_buf, pages, PAGE, kv_lens, window)
    by_locations = kernels.decode_attention(q, k_buf, v_buf, locations, 1, kv_lens, window)
    torch.testing.assert_close(by_pages.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_locations.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_it_equals_the_naive_softmax_over_bfloat16_buffers(group, window):
    """bfloat16 K/V buffers (float32 queries): the float64 softmax over the same bfloat16 values,
    upcast, to float32 rounding; the tolerance tells them from the float32 values they were rounded from."""
    lens = [1, 4, 5, 13, 37, 20]
    k32, v32, pages, locations, kv_lens, q, meta = _decode_rows(lens, group, seed=group * 10 + (window or 0) + 1)
    k_buf, v_buf = k32.bfloat16(), v32.bfloat16()
    expected = naive_attention(q, k_buf, v_buf, meta, window)
    kernels = _kernels()
    assert kernels.takes_attention(q, k_buf)
    by_pages = kernels.decode_attention(q, k_buf, v_buf, pages, PAGE, kv_lens, window)
    by_locations = kernels.decode_attention(q, k_buf, v_buf, locations, 1, kv_lens, window)
    assert by_pages.dtype == by_locations.dtype == torch.float32
    torch.testing.assert_close(by_pages.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_locations.double(), expected, atol=1e-5, rtol=1e-5)
    unrounded = naive_attention(q, k32, v32, meta, window)
    assert not torch.allclose(by_pages.double(), unrounded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [1, 20, 64, 72])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_it_equals_the_naive_softmax_for_any_head_dim(head_dim, kv_dtype):
    """Head dims other than 16 (the kernel's vector width: a part of one, several, several and a part),
    grouped heads, a window, over both buffer dtypes."""
    gen = torch.Generator().manual_seed(head_dim)
    lens, kv_heads, group = [1, 16, 17, 40], 2, 2
    k_buf = torch.randn(sum(lens) + 3, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_buf = torch.randn(sum(lens) + 3, kv_heads, head_dim, generator=gen).to(kv_dtype)
    order = (torch.randperm(sum(lens), generator=gen) + 3).tolist()
    locs = [torch.tensor([order.pop() for _ in range(n)]) for n in lens]
    locations = torch.stack([torch.cat([loc, loc.new_zeros(max(lens) - len(loc))]) for loc in locs])
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    meta = AttentionMetadata.from_locations(locs, [1] * len(lens))
    for window in (None, 19):
        got = _kernels().decode_attention(q, k_buf, v_buf, locations, 1, torch.tensor(lens), window)
        torch.testing.assert_close(got.double(), naive_attention(q, k_buf, v_buf, meta, window), atol=1e-5, rtol=1e-5)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def _assert_same_bits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits for every number; a NaN where (and only where) `expected` has one."""
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(_bits(got)[~nan], _bits(expected)[~nan])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rows_split_over_threads_give_the_same_bits(monkeypatch, kv_dtype):
    """With every call split over two threads, each row is computed (and its new K/V stored) as on
    one thread: equal bits, over float32 and bfloat16 buffers."""
    lens = [9, 30, 2, 17, 25]
    k_buf, v_buf, pages, _, kv_lens, q, _ = _decode_rows(lens, 2, seed=3)
    k_buf, v_buf = k_buf.to(kv_dtype), v_buf.to(kv_dtype)
    new = torch.randn(2, len(lens), KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    out_locs = torch.stack([pages[b, (n - 1) // PAGE] * PAGE + (n - 1) % PAGE for b, n in enumerate(lens)])
    kernels = _kernels()

    def attend() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        k, v = k_buf.clone(), v_buf.clone()
        plain = kernels.decode_attention(q, k_buf, v_buf, pages, PAGE, kv_lens, None)
        return plain, kernels.decode_attention(q, k, v, pages, PAGE, kv_lens, None, (new[0], new[1], out_locs)), k, v

    single = attend()
    monkeypatch.setattr(native_kernels, "PARALLEL_MIN_TOKENS", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        split = attend()
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(single[2], k_buf)  # the store wrote
    for one, two in zip(single, split):
        assert torch.equal(_bits(one), _bits(two))


def test_attention_stores_the_new_rows_first():
    """With `store`, each row's new K/V (strided rows, as q/k/v views of one projection are) are written
    at its location before it attends: the buffers and the output equal index_copy_ then attention."""
    lens = [6, 1, 19, 12]
    k_buf, v_buf, pages, _, kv_lens, q, _ = _decode_rows(lens, 2, seed=11)
    qkv = torch.randn(len(lens), 3, KV_HEADS, HEAD_DIM)
    new_k, new_v = qkv[:, 1], qkv[:, 2]
    out_locs = torch.stack([pages[b, (n - 1) // PAGE] * PAGE + (n - 1) % PAGE for b, n in enumerate(lens)])
    kernels = _kernels()
    assert kernels.takes_store(new_k, new_v, out_locs)
    k_ref, v_ref = k_buf.clone().index_copy_(0, out_locs, new_k), v_buf.clone().index_copy_(0, out_locs, new_v)
    expected = kernels.decode_attention(q, k_ref, v_ref, pages, PAGE, kv_lens, None)
    got = kernels.decode_attention(q, k_buf, v_buf, pages, PAGE, kv_lens, None, (new_k, new_v, out_locs))
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref) and torch.equal(got, expected)
    assert not kernels.takes_store(new_k.transpose(1, 2), new_v, out_locs)  # heads not contiguous


def test_bfloat16_buffers_store_the_new_rows_rounded_as_torch_rounds():
    """Into bfloat16 buffers, each row's new float32 K/V are stored as ``.to(torch.bfloat16)`` stores them,
    bit for bit: to nearest, ties to even, overflow to infinity, subnormals, infinities (a NaN stays
    a NaN); each row then attends what was stored, as over buffers written by index_copy_."""
    lens = [6, 1, 19, 12]
    k32, v32, pages, _, kv_lens, q, meta = _decode_rows(lens, 2, seed=12)
    k_buf, v_buf = k32.bfloat16(), v32.bfloat16()
    qkv = torch.randn(len(lens), 3, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(13)) * 3
    ties = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130 + 2**-134, 2**-130 + 3 * 2**-134]  # to even
    rounded = [1 + 2**-8 + 2**-20, 1 - 2**-10, 3.4028234663852886e38, 1e-40, -0.0, 0.1, 1e30]
    nans = torch.tensor([0x7FC00000, 0x7F800001], dtype=torch.int32).view(torch.float32)  # the 2nd: 0x7F80 + 1
    specials = torch.cat([torch.tensor(ties + rounded + [float("inf"), float("-inf")]), nans])
    qkv[0, 1].view(-1)[: len(specials)] = specials  # row 0's K head 0: its heads 0 and 1 give NaN
    qkv[2, 2].view(-1)[: len(specials) - 2] = specials[:-2]  # row 2's V: no NaN, but infinities
    new_k, new_v = qkv[:, 1], qkv[:, 2]
    assert torch.equal(new_k[0].view(-1)[:5].bfloat16().float(),
                       torch.tensor([1.0, 1 + 2**-6, -1.0, 2**-130, 2**-130 + 2**-132]))
    out_locs = torch.stack([pages[b, (n - 1) // PAGE] * PAGE + (n - 1) % PAGE for b, n in enumerate(lens)])
    kernels = _kernels()
    assert kernels.takes_attention(q, k_buf) and kernels.takes_store(new_k, new_v, out_locs)
    k_ref = k_buf.clone().index_copy_(0, out_locs, new_k.to(torch.bfloat16))
    v_ref = v_buf.clone().index_copy_(0, out_locs, new_v.to(torch.bfloat16))
    expected = kernels.decode_attention(q, k_ref, v_ref, pages, PAGE, kv_lens, None)
    got = kernels.decode_attention(q, k_buf, v_buf, pages, PAGE, kv_lens, None, (new_k, new_v, out_locs))
    assert k_buf.dtype == v_buf.dtype == torch.bfloat16
    _assert_same_bits(k_buf, k_ref)
    _assert_same_bits(v_buf, v_ref)
    assert k_buf[out_locs[0]].isnan().sum() == 2 and v_buf[out_locs[2]].isinf().sum() == 3  # inf, -inf, max
    _assert_same_bits(got, expected)
    assert got[0, :2].isnan().all() and not got[0, 2:].isnan().any()  # heads 0 and 1 read KV head 0's NaN
    assert not got[1:].isnan().any()
    finite = [1, 3]  # rows 0 and 2 attend a NaN and infinities
    torch.testing.assert_close(got[finite].double(), naive_attention(q, k_ref, v_ref, meta)[finite],
                               atol=1e-5, rtol=1e-5)


def test_they_take_float32_on_the_cpu_only():
    """Attention checks its dtypes (float32 queries; float32 or bfloat16 K/V, never float16, and a call
    with K and V of different dtypes raises); the norm and RoPE check layouts (`install` refuses a model
    that is not float32 on a CPU, so their inputs are float32 rows)."""
    k_buf, v_buf, pages, _, kv_lens, q, _ = _decode_rows([3], 1, seed=0)
    assert NativeKernels.takes_attention(q, k_buf)
    assert NativeKernels.takes_attention(q, k_buf.bfloat16())  # a bfloat16 cache under a float32 model
    assert not NativeKernels.takes_attention(q.bfloat16(), k_buf.bfloat16())
    assert not NativeKernels.takes_attention(q.bfloat16(), k_buf)
    assert not NativeKernels.takes_attention(q, k_buf.half())
    assert not NativeKernels.takes_attention(q, k_buf.double())
    assert not NativeKernels.takes_attention(q, k_buf[:, :1])  # a buffer that is not contiguous
    assert not NativeKernels.takes_attention(q, k_buf.bfloat16()[:, :1])
    with pytest.raises(ValueError, match="float16"):
        _kernels().decode_attention(q, k_buf.half(), v_buf.half(), pages, PAGE, kv_lens, None)
    with pytest.raises(ValueError, match="differ"):
        _kernels().decode_attention(q, k_buf.bfloat16(), v_buf, pages, PAGE, kv_lens, None)
    x = torch.randn(3, 8)
    assert NativeKernels.takes_norm(x) and NativeKernels.takes_norm(x, x)
    assert not NativeKernels.takes_norm(x[:, ::2]) and not NativeKernels.takes_norm(x, x.t().contiguous().t())
    assert not NativeKernels.takes_norm(x.view(3, 2, 4))  # per-head norms (Qwen3's q/k norm) keep torch's
    assert NativeKernels.takes_rope(q, torch.randn(1, HEAD_DIM)) and not NativeKernels.takes_rope(q[..., ::2], x)
    model = LlamaModel.from_seed(ModelConfig.tiny(), seed=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        install(model, _kernels())


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_norm_with_the_residual_add_equals_torch(rows):
    """`rms_norm` equals torch's `F.rms_norm`, with and without the residual add (which it does in
    place, as `RMSNorm.add_norm` does), to float32 rounding."""
    gen = torch.Generator().manual_seed(rows)
    x, update = torch.randn(rows, 96, generator=gen) * 3, torch.randn(rows, 96, generator=gen)
    weight = torch.randn(96, generator=gen)
    expected = torch.nn.functional.rms_norm(x + update, (96,), weight, 1e-5)
    kernels = _kernels()
    torch.testing.assert_close(kernels.rms_norm(x.clone(), weight, 1e-5, None), torch.nn.functional.rms_norm(
        x, (96,), weight, 1e-5), atol=2e-6, rtol=2e-6)
    residual = x.clone()
    torch.testing.assert_close(kernels.rms_norm(residual, weight, 1e-5, update), expected, atol=2e-6, rtol=2e-6)
    assert torch.equal(residual, x + update)


def test_rope_is_torch_s_bit_for_bit():
    """`rope_` rotates in place exactly as `apply_rope_` (each product rounded on its own, no fused
    multiply-add), on a strided view of q and k inside a fused q/k/v tensor."""
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(5, 8, 64, generator=gen) * 10
    angles = torch.rand(5, 32, generator=gen) * 6
    cos_sin = torch.cat([torch.cos(angles), torch.sin(angles)], -1)
    expected = qkv.clone()
    apply_rope_(expected[:, :6], cos_sin)
    got = qkv.clone()
    assert _kernels().rope_(got[:, :6], cos_sin) is not None
    assert torch.equal(got, expected)  # the v heads (6 and 7) untouched too


def test_silu_mul_equals_torch():
    """SwiGLU's ``silu(gate) * up`` in place on a packed gate/up output equals torch's ops to float32
    rounding, over values from -100 to 100 (exp's range ends included); the up half is untouched."""
    gen = torch.Generator().manual_seed(2)
    both = torch.cat([torch.linspace(-100, 100, 2 * 96).view(2, 96), torch.randn(6, 96, generator=gen) * 4])
    both = torch.cat([both, torch.randn(8, 96, generator=gen)], dim=1)  # [8, 2 * 96]: gate | up
    expected = torch.nn.functional.silu(both[:, :96]) * both[:, 96:]
    got = both.clone()
    product = _kernels().silu_mul_(got)
    assert product.data_ptr() == got.data_ptr() and product.shape == (8, 96)
    torch.testing.assert_close(product, expected, atol=1e-6, rtol=2e-6)
    assert torch.equal(got[:, 96:], both[:, 96:])


def test_model_forward_equals_torch_ops_with_them_installed():
    """The packed tiny model's logits with the kernels installed and taken back: equal to float32
    rounding, and its norms and attention layers hold the kernels only while installed."""
    model = LlamaModel.from_seed(ModelConfig.tiny(), seed=3)
    model.pack("auto")
    ids, positions = torch.tensor([5, 77, 200, 9]), torch.arange(4)
    from engine.model.attention import PagedAttention
    from resources.kv_buffers import KVBuffers

    def logits() -> torch.Tensor:
        cfg = model.config
        kv = KVBuffers(num_layers=cfg.num_layers, num_pages=4, page_size=4, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, dtype=torch.float32, device="cpu")
        meta = AttentionMetadata.from_locations([torch.arange(4, 8)], [4])
        with torch.inference_mode():
            return model(ids, positions, PagedAttention(kv, meta))

    plain = logits()
    install(model, _kernels())
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, GatedMLP))]
    assert len(norms) == 2 * 4 + 1 + 4 and all(m.native is not None for m in norms)
    native = logits()
    install(model, None)
    assert all(m.native is None for m in norms)
    torch.testing.assert_close(native, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(native.argmax(-1), plain.argmax(-1))


def test_the_mode_is_checked_before_anything_is_allocated():
    """An unknown mode, "on" off the CPU or on a bfloat16 model fail naming the field; "off" and
    "auto" where they do not apply choose torch's ops."""
    with pytest.raises(InvalidConfig, match="native_kernels"):
        EngineConfig(native_kernels="fast")
    with pytest.raises(InvalidConfig, match="native_kernels"):
        EngineConfig(native_kernels="on", device="cuda")
    with pytest.raises(InvalidConfig, match="native_kernels"):
        kernels_for("on", torch.device("cpu"), torch.bfloat16)
    assert kernels_for("off", torch.device("cpu"), torch.float32) is None
    assert kernels_for("auto", torch.device("cpu"), torch.bfloat16) is None
    assert kernels_for("auto", torch.device("cpu"), torch.float32) is _kernels()


def test_a_compiler_that_fails(monkeypatch, tmp_path):
    """Fault: the compiler fails (CXX is `false`). "on" refuses to start, naming the field and the
    reason; "auto" logs `kernel.unavailable` once and runs torch's ops; an engine still serves."""
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(native_kernels, "BUILD", KernelBuild(tmp_path))
    with capture_logs() as logs:
        with pytest.raises(InvalidConfig, match="native_kernels.*could not be built"):
            kernels_for("on", torch.device("cpu"), torch.float32)
        assert kernels_for("auto", torch.device("cpu"), torch.float32) is None
    assert [e["event"] for e in logs].count("kernel.unavailable") == 1
    problem = native_kernels.kernel_problem()
    assert problem is not None and "false" in problem
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.anyio
async def test_engine_ids_equal_with_the_kernels_and_without(monkeypatch):
    """A batch of decode rows (and a sampled row) with "on" and with "off": the same ids; the
    kernel attended every decode step of the first and none of the second."""
    calls = []
    real = NativeKernels.decode_attention

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(NativeKernels, "decode_attention", counted)
    prompts = [[5, 6, 7], list(range(20, 47)), [9] * 11, list(range(100, 103))]
    outputs, counts = [], []
    for mode in ("on", "off"):
        calls.clear()
        async with Engine(small_config(native_kernels=mode)) as engine:
            greedy = await run_all(engine, prompts, 14)
            sampled = await engine.complete(prompts[1], SamplingParams(max_new_tokens=8, temperature=0.9, seed=3))
            outputs.append((greedy, sampled.token_ids))
        counts.append(len(calls))
    assert outputs[0] == outputs[1]
    layers = 4  # the tiny model's
    assert counts[0] >= layers * (13 + 7) and counts[1] == 0


@pytest.mark.anyio
async def test_a_kernel_that_raises_fails_its_batch_and_the_engine_serves_on(monkeypatch):
    """Fault: the attention kernel raises on one decode step. That request ends with ERROR (not an empty
    success), the next request is served, and every pool is whole once idle."""
    real = NativeKernels.decode_attention
    calls = {"n": 0}

    def fails_once(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4 * 3:  # the third decode step's last layer
            raise RuntimeError("injected kernel fault")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(NativeKernels, "decode_attention", fails_once)
    async with Engine(small_config(native_kernels="on")) as engine:
        bad = await engine.complete([5, 6, 7], SamplingParams(max_new_tokens=10, ignore_eos=True))
        good = await engine.complete([8, 9], SamplingParams(max_new_tokens=6, ignore_eos=True))
        await engine.wait_idle(5)
        assert_pools_whole(engine)
    assert bad.finish_reason is FinishReason.ERROR and "injected kernel fault" in bad.error
    assert good.finish_reason is FinishReason.LENGTH and len(good.token_ids) == 6
