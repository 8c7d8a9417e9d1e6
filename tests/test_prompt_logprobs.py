"""Prompt logprobs (issue 21): `SamplingParams.prompt_logprobs` equals log_softmax of transformers'
logits on a checkpoint this test writes, within 1e-4, computed in several prefill chunks, with the
prompt in the prefix cache or not (a request that asks computes its whole prompt: a cached page keeps
KV, not logits), and the first entry is None."""

from __future__ import annotations

import anyio
import pytest
import torch

import parity_models as pm
from engine import Engine, EngineConfig, InvalidRequest, SamplingParams
from helpers import DEADLINE

ATOL = 1e-4
PROMPT = pm.ID_PROMPTS[1]  # 21 tokens: three chunks of 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    model = pm.write_checkpoint(directory, "llama")
    expected = torch.log_softmax(pm.hf_logits(model, PROMPT), dim=-1)  # row i predicts token i + 1
    return str(directory), expected


def _config(directory: str, **overrides) -> EngineConfig:
    fields = dict(model=directory, page_size=4, num_kv_pages=128, max_running=4, max_context=128,
                  max_prefill_tokens=8, use_entry_points=False)
    return EngineConfig(**{**fields, **overrides})


def _assert_equal_to_transformers(entries, expected: torch.Tensor, top: int) -> None:
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position in range(1, len(PROMPT)):
        entry, row = entries[position], expected[position - 1]
        assert entry.token_id == PROMPT[position]
        assert abs(entry.logprob - row[PROMPT[position]].item()) < ATOL
        assert entry.rank == int((row > row[PROMPT[position]]).sum()) + 1
        values, ids = torch.topk(row, top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(lp - v) < ATOL for (_, lp), v in zip(entry.top, values.tolist()))


@pytest.mark.anyio
@pytest.mark.parametrize("cached", [False, True], ids=["cold", "prompt-cached"])
async def test_prompt_logprobs_equal_transformers(checkpoint, cached):
    """Every prompt position's logprob, rank and top-3 equal transformers', with or without the prompt cached."""
    directory, expected = checkpoint
    params = SamplingParams(max_new_tokens=2, prompt_logprobs=3)
    with anyio.fail_after(DEADLINE):
        async with Engine(_config(directory)) as engine:
            if cached:
                await engine.complete(PROMPT, SamplingParams(max_new_tokens=4))
                warm = await engine.complete(PROMPT, SamplingParams(max_new_tokens=1))
                assert warm.num_cached_tokens >= 16  # the prompt is in the cache
            outputs = [o async for o in engine.generate(PROMPT, params)]
            again = await engine.complete(PROMPT, params)
    first, final = outputs[0], outputs[-1]
    _assert_equal_to_transformers(first.prompt_logprobs, expected, 3)
    assert final.prompt_logprobs == first.prompt_logprobs and final.num_cached_tokens == 0
    assert all(o.prompt_logprobs is None for o in outputs[1:-1])
    _assert_equal_to_transformers(again.prompt_logprobs, expected, 3)


@pytest.mark.anyio
async def test_prompt_logprobs_alongside_other_requests(checkpoint):
    """In a batch with other prefills and decodes, and with prefix caching off, the entries are the same."""
    directory, expected = checkpoint
    with anyio.fail_after(DEADLINE):
        async with Engine(_config(directory, prefix_cache=False)) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(engine.complete, pm.ID_PROMPTS[i % 2], SamplingParams(max_new_tokens=6))
                final = await engine.complete(PROMPT, SamplingParams(max_new_tokens=3, prompt_logprobs=0))
    _assert_equal_to_transformers(final.prompt_logprobs, expected, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("value", [-1, 21, 1.0, True])
async def test_bad_prompt_logprobs_is_refused(value):
    """prompt_logprobs outside [0, 20] is an InvalidRequest naming the field."""
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(prompt_logprobs=value)
    assert info.value.field == "SamplingParams.prompt_logprobs"
