"""Decode role with HiSparse: a transfer lands straight in the host pages (never in
device KV pages), so staging copies nothing, and the output equals the single engine's,
whether the context is preloaded from the host rows (short) or swapped in (long)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from engine import Engine, HiSparseConfig, SamplingParams
from helpers import small_config

SPARSE = HiSparseConfig(top_k=8, device_buffer_size=16, recent_window=2, index_dim=16)


@pytest.mark.asyncio
@pytest.mark.parametrize("prompt_len", [10, 30], ids=["preloaded", "swapped-in"])
async def test_transfer_lands_in_host_pages(prompt_len):
    """Every prompt token reaches the host rows through the transfer; staging copies none; same ids."""
    prompt = list(range(3, 3 + prompt_len))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    async with Engine(small_config(hisparse=SPARSE)) as single:
        expected = (await single.complete(prompt, params)).token_ids
    async with Engine(small_config(hisparse=SPARSE, disaggregation="decode")) as engine:
        with capture_logs() as logs:
            final = await engine.complete(prompt, params)
    staged = [e["tokens"] for e in logs if e["event"] == "hisparse.staged"]
    assert staged == [0] and final.token_ids == expected
