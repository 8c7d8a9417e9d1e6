"""Bad input raises InvalidRequest naming the field and the limit, before
anything is allocated (the engine stays idle with every pool whole)."""

from __future__ import annotations

import pytest

from engine import Engine, EngineClosed, EngineConfig, InvalidConfig, InvalidRequest, SamplingParams
from helpers import small_config

BAD_REQUESTS = [
    ("empty text", "", None, "prompt"),
    ("lone surrogate in text", "ab\ud800c", None, "prompt"),
    ("empty ids", [], None, "prompt"),
    ("id out of vocab", [1, 2, 100_000], None, "prompt"),
    ("negative id", [1, -1], None, "prompt"),
    ("non-int id", [1, 2.5], None, "prompt"),
    ("bool id", [True, 2], None, "prompt"),
    ("wrong prompt type", 42, None, "prompt"),
    ("over max_context", [1] * 250, SamplingParams(max_new_tokens=10), "prompt + max_new_tokens"),
    ("params not SamplingParams", [1, 2], {"max_new_tokens": 3}, "params"),
]

BAD_PARAMS = [
    ({"max_new_tokens": 0}, "SamplingParams.max_new_tokens", ">= 1"),
    ({"temperature": -0.5}, "SamplingParams.temperature", ">= 0"),
    ({"temperature": float("nan")}, "SamplingParams.temperature", "finite"),
    ({"top_p": 0.0}, "SamplingParams.top_p", "(0, 1]"),
    ({"top_p": 1.5}, "SamplingParams.top_p", "(0, 1]"),
    ({"top_k": -1}, "SamplingParams.top_k", ">= 0"),
    ({"top_k": 2**63}, "SamplingParams.top_k", "< 2**63"),  # overflowed in the step, failing its batch
    ({"stop_token_ids": [-3]}, "SamplingParams.stop_token_ids", "non-negative"),
    ({"seed": -1}, "SamplingParams.seed", ">= 0"),
]

BAD_CONFIGS = [
    ({"page_size": 0}, "EngineConfig.page_size", ">= 1"),
    ({"num_kv_pages": 1}, "EngineConfig.num_kv_pages", ">= 2"),
    ({"max_running": 0}, "EngineConfig.max_running", ">= 1"),
    ({"leak_check": "maybe"}, "EngineConfig.leak_check", "one of"),
    ({"disaggregation": "prefill"}, "EngineConfig.disaggregation", "one of"),
    ({"max_context": 10_000, "num_kv_pages": 16}, "EngineConfig.max_context", "num_kv_pages"),
    ({"fence_timeout": 0}, "EngineConfig.fence_timeout", "> 0"),
    ({"dtype": "int8"}, "EngineConfig.dtype", "one of"),
]


class TestRequestValidation:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("name,prompt,params,field", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
    async def test_bad_request_rejected_before_allocation(self, name, prompt, params, field):
        """Each bad request raises InvalidRequest naming its field; nothing is held afterwards."""
        async with Engine(small_config()) as engine:
            with pytest.raises(InvalidRequest) as info:
                engine.generate(prompt, params)
            assert info.value.field == field
            assert field in str(info.value)
            assert engine.idle
            assert all(s.held == 0 for s in engine.memory_report().pools.values())

    @pytest.mark.asyncio
    async def test_duplicate_request_id_in_flight(self):
        """A request id already in flight is rejected; the first request is unaffected."""
        async with Engine(small_config()) as engine:
            stream = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=20), request_id="dup")
            with pytest.raises(InvalidRequest, match="request_id"):
                engine.generate([4, 5], request_id="dup")
            outputs = [o async for o in stream]
        assert outputs[-1].finish_reason.name == "LENGTH"

    @pytest.mark.asyncio
    async def test_submit_after_shutdown(self):
        """Submitting to an engine that has exited raises EngineClosed."""
        async with Engine(small_config()) as engine:
            pass
        with pytest.raises(EngineClosed):
            engine.generate([1, 2, 3])


class TestParamValidation:
    @pytest.mark.parametrize("kwargs,field,limit", BAD_PARAMS, ids=[b[1] + str(b[0]) for b in BAD_PARAMS])
    def test_bad_sampling_params(self, kwargs, field, limit):
        """Invalid sampling values raise InvalidRequest naming the field and the limit."""
        with pytest.raises(InvalidRequest) as info:
            SamplingParams(**kwargs)
        assert info.value.field == field and limit in info.value.limit


class TestConfigValidation:
    @pytest.mark.parametrize("kwargs,field,limit", BAD_CONFIGS, ids=[b[1] for b in BAD_CONFIGS])
    def test_bad_engine_config(self, kwargs, field, limit):
        """Invalid engine config values raise InvalidConfig naming the field and the limit."""
        with pytest.raises(InvalidConfig) as info:
            EngineConfig(**kwargs)
        assert info.value.field == field and limit in info.value.limit

    def test_missing_checkpoint_directory(self, tmp_path):
        """A model path without a checkpoint raises InvalidConfig naming EngineConfig.model."""
        with pytest.raises(InvalidConfig, match="EngineConfig.model"):
            Engine(small_config(model=str(tmp_path / "nowhere")))
