"""A KV cache stored in another dtype than the model's (`EngineConfig.kv_cache_dtype`).

A float32 model with a bfloat16 cache: the buffers take half the bytes; greedy
ids and logprobs equal the dense reference whose K/V are rounded through
bfloat16 (and not the unrounded one: the test tells the two apart), with
torch's attention forms and with the native CPU kernel, over whole prompts,
chunked prompts and decode steps; a prompt whose prefix the cache already
holds gives the logprobs of the same prompt computed fresh (a fresh prompt
attends its K/V as stored, not as computed); the decode role with its
in-process prefill gives the single engine's tokens, and so do speculative
verify steps (prompt lookup, a draft model whose own KV stays float32) and
decode runs over the bfloat16 pages. Each of torch's attention forms (SDPA,
the value bags, the blocks) reads float16 and bfloat16 pages under float32
queries as the float64 softmax over the stored values does (the blocks form
raised on them; the bags weighed them in bfloat16). Every pool is whole once
idle. Bad settings are refused before anything is built; the CLI takes the
flag. (A prefill server whose cache dtype differs is refused at connect time:
tests/test_disagg_remote.py.)
"""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, HiSparseConfig, InvalidConfig, SamplingParams
from engine.cli.main import build_parser
from engine.cli.options import engine_config_from_args
from engine.model import paged_attend
from engine.model.attention import AttentionMetadata, PagedAttention
from engine.model.dense_reference import dense_forward
from engine.speculative import SpeculativeConfig
from helpers import assert_pools_whole, collect, run_all, small_config
from naive_attention import naive_attention
from resources.kv_buffers import KVBuffers

#: a whole prompt (one fresh chunk), one longer than max_prefill_tokens (chunked), a short one
PROMPTS = [list(range(30, 70)), [(7 * i) % 250 + 3 for i in range(150)], [9, 8, 7]]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0)


CACHED: list[int] = []  # each prompt's num_cached_tokens in the latest `_greedy`


async def _greedy(config: EngineConfig, prompts=PROMPTS) -> tuple[list[list[int]], list[list[float]], Engine]:
    ids, logprobs = [], []
    CACHED.clear()
    async with Engine(config) as engine:
        for prompt in prompts:
            outputs = await collect(engine.generate(prompt, GREEDY))
            entries = [e for o in outputs for e in o.logprobs or ()]
            ids.append(outputs[-1].token_ids)
            logprobs.append([e.logprob for e in entries])
            CACHED.append(outputs[-1].num_cached_tokens)
        assert_pools_whole(engine)
    return ids, logprobs, engine


def _reference(engine: Engine, prompt: list[int], tokens: list[int], kv_dtype: torch.dtype | None) -> tuple[list, list]:
    """The dense reference's greedy ids over the engine's output and their log probabilities."""
    logits = dense_forward(engine.parts.model, prompt + tokens, kv_dtype=kv_dtype)[len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits.double(), -1)
    return logits.argmax(-1).tolist(), [float(logprobs[i, t]) for i, t in enumerate(tokens)]


@pytest.mark.asyncio
@pytest.mark.parametrize("kernels", ["off", "auto"])
async def test_a_bfloat16_cache_equals_the_reference_rounded_through_it(kernels):
    """Greedy ids equal the reference with bfloat16-rounded K/V, and the logprobs sit near it, ten times
    nearer than to the unrounded reference's (so the comparison sees the rounding). Not within float32
    rounding: a K element one float32 ulp apart before the cast (the engine's fused projections against
    the reference's) may round to the neighbouring bfloat16."""
    ids, logprobs, engine = await _greedy(small_config(kv_cache_dtype="bfloat16", native_kernels=kernels,
                                                       prefix_cache=False))
    assert engine.parts.kv_buffers.k[0].dtype == torch.bfloat16
    rounded, unrounded = [], []
    for prompt, got_ids, got_lp in zip(PROMPTS, ids, logprobs):
        want_ids, want_lp = _reference(engine, prompt, got_ids, torch.bfloat16)
        assert got_ids == want_ids
        rounded += [abs(g - w) for g, w in zip(got_lp, want_lp)]
        unrounded += [abs(g - w) for g, w in zip(got_lp, _reference(engine, prompt, got_ids, None)[1])]
    assert max(rounded) < 5e-4
    assert sum(rounded) * 5 < sum(unrounded), (sum(rounded), sum(unrounded))


@pytest.mark.asyncio
async def test_the_native_kernel_and_torch_give_the_same_tokens():
    """Decode attention through the native kernel (which stores and reads bfloat16 itself) and through
    torch's forms: the same ids, the same logprobs up to a bfloat16 rounding of K/V that the kernels'
    float32 ulps may flip (as against the reference, above)."""
    off_ids, off_lp, _ = await _greedy(small_config(kv_cache_dtype="bfloat16", native_kernels="off"))
    on_ids, on_lp, _ = await _greedy(small_config(kv_cache_dtype="bfloat16", native_kernels="auto"))
    assert on_ids == off_ids
    assert max(abs(a - b) for x, y in zip(on_lp, off_lp) for a, b in zip(x, y)) < 5e-4


@pytest.mark.asyncio
async def test_a_cached_prefix_gives_the_fresh_prompts_logprobs():
    """The same prompt twice: first attended fresh (its K/V never read back), then over its cached prefix
    (read back from the bfloat16 pages). The same logprobs, as a float32 cache gives."""
    prompt = PROMPTS[0]
    ids, logprobs, _ = await _greedy(small_config(kv_cache_dtype="bfloat16", native_kernels="off"), [prompt, prompt])
    assert CACHED[0] == 0 and CACHED[1] >= 32
    assert ids[0] == ids[1]
    assert max(abs(a - b) for a, b in zip(*logprobs)) < 2e-5


@pytest.mark.asyncio
async def test_half_the_bytes_and_the_decode_role_gives_the_single_engines_tokens():
    """The bfloat16 buffers take half the float32 ones' bytes; the decode role (in-process prefill, the
    KV handed over in bfloat16) gives the single engine's tokens; every pool whole on both."""
    async with Engine(small_config()) as plain:
        full = plain.parts.kv_buffers.nbytes
    single, _, engine = await _greedy(small_config(kv_cache_dtype="bfloat16"))
    assert engine.parts.kv_buffers.nbytes * 2 == full
    decode, _, _ = await _greedy(small_config(kv_cache_dtype="bfloat16", disaggregation="decode"))
    assert decode == single


@pytest.mark.asyncio
@pytest.mark.parametrize("spec", [SpeculativeConfig(num_tokens=3),
                                  SpeculativeConfig(method="draft_model", draft_model="tiny", num_tokens=3)],
                         ids=["ngram", "draft"])
async def test_speculation_and_decode_runs_over_a_bfloat16_cache_give_its_plain_tokens(spec):
    """Verify steps (several queries a row over the bfloat16 pages), a draft model's own float32 KV beside
    it, and decode runs: the plain bfloat16 engine's greedy ids; every pool whole."""
    repetitive = [[5, 6, 7, 8, 9, 10] * 6, PROMPTS[0]]
    outputs, engines = [], []
    for extra in ({}, {"speculative": spec}, {"decode_steps": 4}):  # no logprobs: a row asking them never speculates
        async with Engine(small_config(kv_cache_dtype="bfloat16", **extra)) as engine:
            outputs.append(await run_all(engine, repetitive, 16))
            assert_pools_whole(engine)
        engines.append(engine)
    assert outputs[1] == outputs[2] == outputs[0]
    assert engines[1].stats.spec_draft_tokens > 0 and engines[2].stats.decode_runs > 0


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["sdpa", "bags", "blocks"])
def test_every_attention_form_reads_a_narrower_cache(kv_dtype, form, monkeypatch):
    """Decode rows and prefill chunks of float32 queries over float16 or bfloat16 pages, in each of
    torch's forms (the bags form hands such a cache to SDPA: its weights would take the cache's
    dtype): the new rows stored rounded, and the output the float64 softmax over the stored values."""
    if form == "bags":
        monkeypatch.setattr(paged_attend, "BAG_MIN_TOKENS", 0)
    if form == "blocks":
        monkeypatch.setattr(paged_attend, "GATHER_BUDGET", 2048)  # a block of a few pages at a time
    gen = torch.Generator().manual_seed(3)
    kv = KVBuffers(num_layers=1, num_pages=64, page_size=4, num_kv_heads=2, head_dim=8, dtype=kv_dtype, device="cpu")
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    locations = torch.randperm(kv.num_tokens - 4, generator=gen) + 4
    shapes = [(1, 30), (1, 7), (5, 12), (1, 50)]  # (new tokens, cached tokens): decode rows and a chunk
    starts = [sum(q + old for q, old in shapes[:i]) for i in range(len(shapes))]
    meta = AttentionMetadata.from_locations([locations[s: s + q + old] for s, (q, old) in zip(starts, shapes)],
                                            [q for q, _ in shapes])
    q = torch.randn(meta.num_tokens, 4, 8, generator=gen)
    k, v = (torch.randn(meta.num_tokens, 2, 8, generator=gen) for _ in range(2))
    out = PagedAttention(kv, meta).attend(0, q, k, v)
    assert torch.equal(kv.k[0][meta.out_locs], k.to(kv_dtype)) and torch.equal(kv.v[0][meta.out_locs], v.to(kv_dtype))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_attention(q, kv.k[0], kv.v[0], meta), atol=2e-5, rtol=2e-5)


def test_bad_settings_are_refused_before_anything_is_built():
    with pytest.raises(InvalidConfig, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="float8")
    with pytest.raises(InvalidConfig, match="kv_cache_dtype.*hisparse"):
        EngineConfig(kv_cache_dtype="bfloat16", hisparse=HiSparseConfig(top_k=32))
    assert EngineConfig(kv_cache_dtype="auto", hisparse=HiSparseConfig(top_k=32)).kv_cache_dtype == "auto"


def test_the_cli_takes_the_flag():
    args = build_parser().parse_args(["generate", "--kv-cache-dtype", "bfloat16", "hi"])
    assert engine_config_from_args(args).kv_cache_dtype == "bfloat16"
