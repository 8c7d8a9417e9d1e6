"""Parity with transformers, family by family: a tiny random checkpoint
written by transformers (`parity_models`) loaded by path through the public
API gives exactly transformers' greedy ids (``generate(do_sample=False)``),
for text and token-id prompts, at batch 1 and in a mixed batch, with prefix
caching on and off, across a retraction, and past the sliding window; and
float32 logits within 1e-4 of transformers'."""

from __future__ import annotations

import attrs
import anyio
import pytest
import torch

transformers = pytest.importorskip("transformers")

import parity_models as pm  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model.checkpoint import load_checkpoint  # noqa: E402
from engine.model.dense_reference import DenseCausalAttention, dense_forward  # noqa: E402

LOGIT_ATOL = 1e-4  # float32: observed differences are ~1e-5
MAX_NEW, ID_PROMPTS, TEXT_PROMPTS = pm.MAX_NEW, pm.ID_PROMPTS, pm.TEXT_PROMPTS

WINDOWED = [name for name, (_, extra, _) in pm.FAMILIES.items() if extra.get("sliding_window")]
MOE = [name for name, (_, extra, _) in pm.FAMILIES.items() if extra.get("num_experts_per_tok")]


@attrs.frozen
class Family:
    name: str
    directory: str
    model: object  # the transformers model
    text_ids: list[list[int]]  # transformers' tokenization of TEXT_PROMPTS
    expected: dict[str, list[int]]  # prompt key -> transformers' greedy ids

    @property
    def prompts(self) -> dict[str, str | list[int]]:
        return {**{f"ids{i}": p for i, p in enumerate(ID_PROMPTS)}, **{f"text{i}": t for i, t in enumerate(TEXT_PROMPTS)}}


@pytest.fixture(scope="module", params=list(pm.FAMILIES))
def family(request, tmp_path_factory) -> Family:
    directory = tmp_path_factory.mktemp(request.param)
    model = pm.write_checkpoint(directory, request.param)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    text_ids = [tokenizer(text)["input_ids"] for text in TEXT_PROMPTS]
    expected = {f"ids{i}": pm.hf_greedy(model, p, MAX_NEW)[0] for i, p in enumerate(ID_PROMPTS)}
    expected.update({f"text{i}": pm.hf_greedy(model, ids, MAX_NEW)[0] for i, ids in enumerate(text_ids)})
    return Family(request.param, str(directory), model, text_ids, expected)


def _config(family: Family, **overrides) -> EngineConfig:
    fields = dict(model=family.directory, page_size=4, num_kv_pages=128, max_running=8, max_context=128,
                  max_prefill_tokens=16, use_entry_points=False)
    return EngineConfig(**{**fields, **overrides})


async def _run_together(engine: Engine, prompts: dict[str, str | list[int]]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}

    async def one(key: str) -> None:
        got[key] = (await engine.complete(prompts[key], SamplingParams(max_new_tokens=MAX_NEW))).token_ids

    async with anyio.create_task_group() as tg:
        for key in prompts:
            tg.start_soon(one, key)
    return got


class TestTokenization:
    @pytest.mark.anyio
    async def test_text_encodes_as_transformers_does(self, family):
        """engine.tokenizer.encode(text) equals AutoTokenizer's ids: BOS/EOS as the post-processor adds them."""
        async with Engine(_config(family)) as engine:
            assert [engine.tokenizer.encode(text) for text in TEXT_PROMPTS] == family.text_ids

    @pytest.mark.anyio
    async def test_special_tokens_are_never_split(self, family):
        """A special token written in the text is one id, including one declared only in tokenizer_config.json."""
        async with Engine(_config(family)) as engine:
            assert pm.EOS_ID in engine.tokenizer.encode(TEXT_PROMPTS[1])
            declared = engine.tokenizer.encode(pm.DECLARED_ONLY, add_special_tokens=False)
        declared_here = pm.FAMILIES[family.name][2] == "qwen"
        assert (len(declared) == 1) == declared_here  # elsewhere it is ordinary text


class TestGreedyParity:
    @pytest.mark.anyio
    async def test_batch_of_one(self, family):
        """Each prompt alone (token ids and text) gives transformers' greedy ids."""
        async with Engine(_config(family, prefix_cache=False)) as engine:
            for key, prompt in family.prompts.items():
                final = await engine.complete(prompt, SamplingParams(max_new_tokens=MAX_NEW))
                assert final.token_ids == family.expected[key], key

    @pytest.mark.anyio
    @pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
    async def test_mixed_batch(self, family, prefix_cache):
        """All prompts at once, twice (the second round hits the prefix cache when on), give transformers' ids."""
        async with Engine(_config(family, prefix_cache=prefix_cache)) as engine:
            first = await _run_together(engine, family.prompts)
            second = await _run_together(engine, family.prompts)
            hits = engine.stats.prefix_hit_tokens
        assert first == family.expected and second == family.expected
        assert (hits > 0) == prefix_cache

    @pytest.mark.anyio
    async def test_packed_layout_too(self, family):
        """weight_layout="packed" (torch.mm, no oneDNN copy) gives transformers' ids as the default layout does."""
        async with Engine(_config(family, weight_layout="packed", prefix_cache=False)) as engine:
            assert engine.parts.model.weight_layout == "packed"
            got = await _run_together(engine, family.prompts)
        assert got == family.expected

    @pytest.mark.anyio
    async def test_across_a_retraction(self, family):
        """A pool too small for every request at once retracts some; outputs still equal transformers'."""
        async with Engine(_config(family, num_kv_pages=24, max_context=92)) as engine:
            got = await _run_together(engine, family.prompts)
            retractions = engine.stats.retractions
        assert got == family.expected
        assert retractions > 0


class TestModel:
    def test_logits_match_transformers(self, family):
        """kvlife's float32 logits over a prompt and its continuation are within 1e-4 of transformers'."""
        model, _, _ = load_checkpoint(family.directory)
        for i, prompt in enumerate(ID_PROMPTS[:2]):
            tokens = prompt + family.expected[f"ids{i}"]
            torch.testing.assert_close(dense_forward(model, tokens), pm.hf_logits(family.model, tokens),
                                       atol=LOGIT_ATOL, rtol=0)

    def test_outputs_are_long_and_varied(self, family):
        """The parity above means something: outputs run past the sliding window and are not one repeated id."""
        longest = len(ID_PROMPTS[1]) + len(family.expected["ids1"])
        assert longest > 3 * pm.WINDOW
        assert all(len(set(tokens)) >= 4 for tokens in family.expected.values())

    @pytest.mark.parametrize("family", WINDOWED, indirect=True)
    def test_window_is_in_force(self, family):
        """For a family with a sliding window, attending fully would change the logits past the window."""
        model, config, _ = load_checkpoint(family.directory)
        tokens = ID_PROMPTS[1] + family.expected["ids1"]
        with torch.inference_mode():
            full = model(torch.tensor(tokens), torch.arange(len(tokens)), DenseCausalAttention())
        assert config.sliding_window == pm.WINDOW
        assert not torch.allclose(full[-1], dense_forward(model, tokens)[-1], atol=1e-3)


class TestExpertRecords:
    @pytest.mark.anyio
    @pytest.mark.parametrize("family", MOE, indirect=True)
    async def test_records_equal_transformers_routing(self, family):
        """An MoE checkpoint's expert records count exactly the experts transformers routes the same tokens to."""
        prompt = ID_PROMPTS[1]
        async with Engine(_config(family, prefix_cache=False)) as engine:
            final = await engine.complete(prompt, SamplingParams(max_new_tokens=MAX_NEW))
            await engine.wait_idle(5)
            counts = engine.expert_distribution()
        forwarded = prompt + final.token_ids[:-1]  # the last token is sampled, never forwarded
        with torch.inference_mode():
            router_logits = family.model(torch.tensor([forwarded]), output_router_logits=True).router_logits
        top_k = family.model.config.num_experts_per_tok
        expected = torch.stack([
            torch.bincount(torch.topk(layer.float().softmax(-1), top_k).indices.flatten(), minlength=counts.shape[1])
            for layer in router_logits
        ])
        assert torch.equal(counts, expected)
