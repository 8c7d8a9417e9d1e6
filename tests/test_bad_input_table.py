"""Bad input, all of it: one table row per invalid value of every public field.

Each row states the exact exception type, the field it must name and a
fragment of the limit it must state. Config rows raise at construction (no
engine exists yet); request rows run against a live engine, which must stay
idle with every pool whole and nothing recorded afterwards ("nothing
allocated"). The misuse rows cover the lifecycle: submitting before start or
after shutdown, aborting unknown or finished ids, a duplicate id in flight.

Adding a row is one line in the table it belongs to.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import anyio
import pytest
import torch

from engine import Engine, EngineClosed, InvalidConfig, InvalidRequest, SamplingParams, StructuredConfig
from helpers import assert_pools_whole, small_config
from hisparse import HiSparseConfig

NAN, INF = math.nan, math.inf
E = "EngineConfig."
H = "HiSparseConfig."
S = "SamplingParams."

# (overrides of small_config, field named, fragment of the limit)
ENGINE_CONFIG = [
    ({"model": ""}, E + "model", "checkpoint"),
    ({"model": 3}, E + "model", "checkpoint"),
    ({"device": ""}, E + "device", "torch device"),
    ({"device": None}, E + "device", "torch device"),
    ({"dtype": "int8"}, E + "dtype", "one of"),
    ({"dtype": None}, E + "dtype", "one of"),
    ({"seed": -1}, E + "seed", ">= 0"),
    ({"seed": 1.5}, E + "seed", "integer"),
    ({"seed": 2**64}, E + "seed", "< 2**63"),
    ({"page_size": 0}, E + "page_size", ">= 1"),
    ({"page_size": -4}, E + "page_size", ">= 1"),
    ({"page_size": "4"}, E + "page_size", "integer"),
    ({"page_size": True}, E + "page_size", "integer"),
    ({"num_kv_pages": 1}, E + "num_kv_pages", ">= 2"),
    ({"num_kv_pages": 2.0}, E + "num_kv_pages", "integer"),
    ({"max_running": 0}, E + "max_running", ">= 1"),
    ({"max_running": None}, E + "max_running", "integer"),
    ({"max_context": 1}, E + "max_context", ">= 2"),
    ({"max_context": NAN}, E + "max_context", "integer"),
    ({"max_context": 10_000}, E + "max_context", "(num_kv_pages - 1) * page_size = 1020"),
    ({"max_prefill_tokens": 0}, E + "max_prefill_tokens", ">= 1"),
    ({"max_queued": -1}, E + "max_queued", ">= 1"),
    ({"mm_cache_bytes": 0}, E + "mm_cache_bytes", ">= 1"),
    ({"prefix_cache": "no"}, E + "prefix_cache", "a bool"),
    ({"prefix_cache": None}, E + "prefix_cache", "a bool"),
    ({"use_entry_points": 1}, E + "use_entry_points", "a bool"),
    ({"cuda_graphs": "yes"}, E + "cuda_graphs", "a bool"),
    ({"hisparse": 5}, E + "hisparse", "HiSparseConfig"),
    ({"hisparse": {"top_k": 4}}, E + "hisparse", "HiSparseConfig"),
    ({"disaggregation": "prefill"}, E + "disaggregation", "one of"),
    ({"disaggregation": None}, E + "disaggregation", "one of"),
    ({"leak_check": "maybe"}, E + "leak_check", "one of"),
    ({"resources": 5}, E + "resources", "resource hooks"),
    ({"resources": [5]}, E + "resources", "resource hooks"),
    ({"fence_timeout": 0}, E + "fence_timeout", "> 0"),
    ({"fence_timeout": -1.0}, E + "fence_timeout", "> 0"),
    ({"fence_timeout": NAN}, E + "fence_timeout", "finite"),
    ({"fence_timeout": INF}, E + "fence_timeout", "finite"),
    ({"fence_timeout": "1"}, E + "fence_timeout", "number"),
    ({"admission_window": -0.001}, E + "admission_window", ">= 0"),
    ({"admission_window": 5.0}, E + "admission_window", "[0, 0.1]"),
    ({"inline_step_tokens": -1}, E + "inline_step_tokens", ">= 0"),
    ({"inline_step_ms": -1.0}, E + "inline_step_ms", ">= 0"),
    ({"inline_step_ms": NAN}, E + "inline_step_ms", "finite"),
    ({"weight_layout": "fast"}, E + "weight_layout", "one of"),
    ({"weight_layout": "onednn", "device": "cuda"}, E + "weight_layout", "other than 'cpu'"),
    ({"starvation_timeout": 0}, E + "starvation_timeout", "> 0"),
    ({"structured": {"compile_timeout": 1}}, E + "structured", "StructuredConfig"),
]

# Valid EngineConfig, rejected when the engine is built (nothing to allocate into yet).
ENGINE_BUILD = [
    ({"device": "nonsense"}, E + "device", "torch device"),
    ({"device": "meta"}, E + "device", "available"),
    ({"model": "/nonexistent/checkpoint"}, E + "model", "checkpoint"),
    ({"dtype": "float16", "weight_layout": "onednn"}, E + "weight_layout", "'auto' or 'packed' for this model"),
]
if not torch.cuda.is_available():
    ENGINE_BUILD.append(({"device": "cuda"}, E + "device", "available"))

# (HiSparseConfig kwargs, field, fragment)
HISPARSE_CONFIG = [
    ({"top_k": 0}, H + "top_k", ">= 1"),
    ({"top_k": "8"}, H + "top_k", "integer"),
    ({"top_k": 8, "device_buffer_size": 4}, H + "device_buffer_size", ">= top_k = 8"),
    ({"device_buffer_size": 0}, H + "device_buffer_size", ">= 1"),
    ({"index_dim": 0}, H + "index_dim", ">= 1"),
    ({"index_dim": True}, H + "index_dim", "integer"),
    ({"recent_window": -1}, H + "recent_window", ">= 0"),
    ({"top_k": 4, "device_buffer_size": 8, "recent_window": 5}, H + "recent_window", "<= top_k = 4"),
    ({"host_pool_tokens": 0}, H + "host_pool_tokens", ">= 1"),
    ({"host_pool_tokens": 2.5}, H + "host_pool_tokens", "integer"),
    ({"host_pool_ratio": 0}, H + "host_pool_ratio", "> 0"),
    ({"host_pool_ratio": NAN}, H + "host_pool_ratio", "finite"),
    ({"host_pool_ratio": "2"}, H + "host_pool_ratio", "number"),
]

# (StructuredConfig kwargs, field, fragment)
STRUCTURED_CONFIG = [
    ({"compile_timeout": 0}, "StructuredConfig.compile_timeout", "> 0"),
    ({"compile_timeout": INF}, "StructuredConfig.compile_timeout", "finite"),
    ({"compile_threads": 0}, "StructuredConfig.compile_threads", ">= 1"),
    ({"cache_size": 0}, "StructuredConfig.cache_size", ">= 1"),
    ({"cache_size": 2.5}, "StructuredConfig.cache_size", "integer"),
    ({"step_max_items": 0}, "StructuredConfig.step_max_items", ">= 1"),
    ({"step_lexer_fuel": -1}, "StructuredConfig.step_lexer_fuel", ">= 1"),
    ({"max_grammar_size": None}, "StructuredConfig.max_grammar_size", "integer"),
]

# (HiSparseConfig kwargs, small_config overrides, field, fragment): valid alone, not with this engine
HISPARSE_VS_ENGINE = [
    ({"top_k": 8, "device_buffer_size": 512}, {"max_context": 256}, H + "device_buffer_size",
     "<= EngineConfig.max_context = 256"),
    ({"top_k": 8, "device_buffer_size": 16, "recent_window": 4, "host_pool_tokens": 64}, {"max_context": 256},
     H + "host_pool_tokens", "one max_context request"),
    ({"top_k": 8, "device_buffer_size": 16, "recent_window": 4, "host_pool_ratio": 0.01}, {"max_context": 256},
     H + "host_pool_ratio", "one max_context request"),
]

# (SamplingParams kwargs, field, fragment)
SAMPLING = [
    ({"max_new_tokens": 0}, S + "max_new_tokens", ">= 1"),
    ({"max_new_tokens": -3}, S + "max_new_tokens", ">= 1"),
    ({"max_new_tokens": 2.0}, S + "max_new_tokens", "integer"),
    ({"max_new_tokens": "8"}, S + "max_new_tokens", "integer"),
    ({"max_new_tokens": None}, S + "max_new_tokens", "integer"),
    ({"temperature": -0.5}, S + "temperature", ">= 0"),
    ({"temperature": NAN}, S + "temperature", "finite"),
    ({"temperature": INF}, S + "temperature", "finite"),
    ({"temperature": "hot"}, S + "temperature", "number"),
    ({"top_p": 0.0}, S + "top_p", "(0, 1]"),
    ({"top_p": 1.5}, S + "top_p", "(0, 1]"),
    ({"top_p": NAN}, S + "top_p", "(0, 1]"),
    ({"top_k": -1}, S + "top_k", ">= 0"),
    ({"top_k": 2.5}, S + "top_k", "integer"),
    ({"stop_token_ids": [-3]}, S + "stop_token_ids", "non-negative"),
    ({"stop_token_ids": [1.5]}, S + "stop_token_ids", "non-negative"),
    ({"stop_token_ids": 7}, S + "stop_token_ids", "list"),
    ({"stop_token_ids": "ab"}, S + "stop_token_ids", "list"),
    ({"ignore_eos": "yes"}, S + "ignore_eos", "a bool"),
    ({"ignore_eos": None}, S + "ignore_eos", "a bool"),
    ({"seed": -1}, S + "seed", ">= 0"),
    ({"seed": 1.5}, S + "seed", "integer"),
    ({"seed": True}, S + "seed", "integer"),
    ({"constraint": "json"}, S + "constraint", "engine.Constraint"),
    ({"constraint": {"kind": "yaml", "value": "a"}}, S + "constraint.kind", "one of"),
    ({"constraint": {"kind": "regex", "value": ""}}, S + "constraint.regex", "non-empty"),
    ({"constraint": {"kind": "choice", "value": []}}, S + "constraint.choice", "non-empty strings"),
    ({"constraint": {"kind": "regex", "value": "a", "starts_after": ""}}, S + "constraint.starts_after", "1 to 64"),
    ({"constraint": {"kind": "regex", "pattern": "a"}}, S + "constraint", "its fields"),
]

IMAGE = torch.zeros(8, 8, 3, dtype=torch.uint8)
# (id, prompt, SamplingParams kwargs or a raw params value, generate kwargs, field, fragment)
REQUESTS = [
    ("empty text", "", {}, {}, "prompt", "non-empty"),
    ("empty ids", [], {}, {}, "prompt", "non-empty"),
    ("wrong prompt type", 42, {}, {}, "prompt", "a string or a list"),
    ("prompt is a dict", {"ids": [1]}, {}, {}, "prompt", "a string or a list"),
    ("id too large", [1, 2, 100_000], {}, {}, "prompt", "[0, 264)"),
    ("id at vocab size", [1, 264], {}, {}, "prompt", "[0, 264)"),
    ("negative id", [1, -1], {}, {}, "prompt", "[0, 264)"),
    ("float id", [1, 2.5], {}, {}, "prompt", "[0, 264)"),
    ("bool id", [True, 2], {}, {}, "prompt", "[0, 264)"),
    ("None id", [1, None, 3], {}, {}, "prompt", "[0, 264)"),
    ("string id", [1, "2"], {}, {}, "prompt", "[0, 264)"),
    ("over max_context", [1] * 250, {"max_new_tokens": 10}, {}, "prompt + max_new_tokens", "max_context = 256"),
    ("max_new_tokens alone too large", [1], {"max_new_tokens": 256}, {}, "prompt + max_new_tokens", "256"),
    ("stop id beyond vocab", [1, 2], {"stop_token_ids": [264]}, {}, S + "stop_token_ids", "[0, 264)"),
    ("params is a dict", [1, 2], {"max_new_tokens": 3, "raw": True}, {}, "params", "SamplingParams"),
    ("request_id int", [1, 2], {}, {"request_id": 5}, "request_id", "non-empty string"),
    ("request_id empty", [1, 2], {}, {"request_id": ""}, "request_id", "non-empty string"),
    ("mm_inputs not a list", [1, 2], {}, {"mm_inputs": "cat.png"}, "mm_inputs", "a list of images"),
    ("image not a tensor", [1, 2], {}, {"mm_inputs": [[0, 0, 0]]}, "mm_inputs[0]", "uint8 [H, W, 3]"),
    ("image float", [1, 2], {}, {"mm_inputs": [IMAGE.float()]}, "mm_inputs[0]", "uint8 [H, W, 3]"),
    ("image 2-D", [1, 2], {}, {"mm_inputs": [IMAGE[..., 0]]}, "mm_inputs[0]", "uint8 [H, W, 3]"),
    ("image 4 channels", [1, 2], {}, {"mm_inputs": [torch.zeros(8, 8, 4, dtype=torch.uint8)]}, "mm_inputs[0]",
     "uint8 [H, W, 3]"),
    ("image off the patch grid", [1, 2], {}, {"mm_inputs": [torch.zeros(7, 8, 3, dtype=torch.uint8)]},
     "mm_inputs[0]", "multiples of 8"),
    ("image empty", [1, 2], {}, {"mm_inputs": [torch.zeros(0, 8, 3, dtype=torch.uint8)]}, "mm_inputs[0]",
     "positive multiples"),
    ("image too large", [1, 2], {}, {"mm_inputs": [torch.zeros(128, 128, 3, dtype=torch.uint8)]},
     "mm_inputs[0]", "up to 64"),
    ("second image bad", [1, 2], {}, {"mm_inputs": [IMAGE, None]}, "mm_inputs[1]", "uint8 [H, W, 3]"),
    ("placeholders mismatch", [259, 259, 1], {}, {"mm_inputs": [IMAGE]}, "prompt", "one image placeholder"),
    ("images over max_context", [1] * 200, {"max_new_tokens": 10},
     {"mm_inputs": [torch.zeros(64, 64, 3, dtype=torch.uint8)]}, "prompt + image tokens + max_new_tokens",
     "max_context = 256"),
]


def _ids(table):
    return [f"{row[-2]}={row[0]!r}"[:60] for row in table]


def _assert_names(exc: InvalidRequest, field: str, fragment: str, *, exactly: type | None = None) -> None:
    """The error names the field and the limit (and is exactly of type `exactly`, not a subclass)."""
    if exactly is not None:
        assert type(exc) is exactly, f"{type(exc).__name__}, not {exactly.__name__}"
    assert exc.field == field, f"names {exc.field!r}, not {field!r}"
    assert fragment in exc.limit, f"limit {exc.limit!r} lacks {fragment!r}"
    assert str(exc).startswith(f"{field} must be {exc.limit}"), str(exc)


def _assert_rejected(build: Callable[[], object], exactly: type, field: str, fragment: str) -> None:
    """build() raises exactly `exactly` (not a subclass), naming the field and the limit."""
    with pytest.raises(exactly) as info:
        build()
    _assert_names(info.value, field, fragment, exactly=exactly)


def _assert_nothing_allocated(engine: Engine) -> None:
    """Nothing was submitted, the ledger tracks no request, and every pool is whole."""
    assert engine.stats.submitted == 0 and engine.parts.ledger.num_tracked_requests == 0
    assert_pools_whole(engine)


class TestEngineConfigTable:
    @pytest.mark.parametrize("overrides,field,fragment", ENGINE_CONFIG, ids=_ids(ENGINE_CONFIG))
    def test_rejected_at_construction(self, overrides, field, fragment):
        """Each invalid EngineConfig value raises InvalidConfig naming the field and the limit."""
        _assert_rejected(lambda: small_config(**overrides), InvalidConfig, field, fragment)

    @pytest.mark.parametrize("overrides,field,fragment", ENGINE_BUILD, ids=_ids(ENGINE_BUILD))
    def test_rejected_when_built(self, overrides, field, fragment):
        """A config the engine cannot serve raises InvalidConfig when the Engine is built."""
        _assert_rejected(lambda: Engine(small_config(**overrides)), InvalidConfig, field, fragment)

    def test_faults_must_be_an_injector(self):
        """Engine(faults=...) takes only an engine.testing.FaultInjector."""
        with pytest.raises(InvalidConfig) as info:
            Engine(small_config(), faults="chaos")
        _assert_names(info.value, "Engine.faults", "FaultInjector")

    def test_config_and_overrides_together(self):
        """Engine(config, **overrides) is ambiguous and raises instead of ignoring the overrides."""
        with pytest.raises(InvalidConfig) as info:
            Engine(small_config(), page_size=8)
        _assert_names(info.value, "Engine(config, **overrides)", "not both")


class TestHiSparseConfigTable:
    @pytest.mark.parametrize("kwargs,field,fragment", HISPARSE_CONFIG, ids=_ids(HISPARSE_CONFIG))
    def test_rejected_at_construction(self, kwargs, field, fragment):
        """Each invalid HiSparseConfig value raises InvalidConfig naming the field and the limit."""
        _assert_rejected(lambda: HiSparseConfig(**kwargs), InvalidConfig, field, fragment)

    @pytest.mark.parametrize("kwargs,overrides,field,fragment", HISPARSE_VS_ENGINE,
                             ids=[r[2] for r in HISPARSE_VS_ENGINE])
    def test_rejected_against_the_engine(self, kwargs, overrides, field, fragment):
        """A HiSparseConfig that cannot serve the engine's config is rejected by EngineConfig."""
        hisparse = HiSparseConfig(**kwargs)
        with pytest.raises(InvalidConfig) as info:
            small_config(hisparse=hisparse, **overrides)
        _assert_names(info.value, field, fragment)


class TestStructuredConfigTable:
    @pytest.mark.parametrize("kwargs,field,fragment", STRUCTURED_CONFIG, ids=_ids(STRUCTURED_CONFIG))
    def test_rejected_at_construction(self, kwargs, field, fragment):
        """Each invalid StructuredConfig value raises InvalidConfig naming the field and the limit."""
        _assert_rejected(lambda: StructuredConfig(**kwargs), InvalidConfig, field, fragment)


class TestSamplingParamsTable:
    @pytest.mark.parametrize("kwargs,field,fragment", SAMPLING, ids=_ids(SAMPLING))
    def test_rejected_at_construction(self, kwargs, field, fragment):
        """Each invalid SamplingParams value raises InvalidRequest naming the field and the limit."""
        _assert_rejected(lambda: SamplingParams(**kwargs), InvalidRequest, field, fragment)


class TestRequestTable:
    @pytest.mark.asyncio
    @pytest.mark.parametrize("name,prompt,params,kwargs,field,fragment", REQUESTS, ids=[r[0] for r in REQUESTS])
    async def test_rejected_before_allocation(self, name, prompt, params, kwargs, field, fragment):
        """Each bad request raises InvalidRequest naming field and limit; nothing is allocated."""
        params = dict(params)
        sampling = params if params.pop("raw", False) else SamplingParams(**params)
        with anyio.fail_after(30):
            async with Engine(small_config()) as engine:
                with pytest.raises(InvalidRequest) as info:
                    engine.generate(prompt, sampling, **kwargs)
                _assert_names(info.value, field, fragment, exactly=InvalidRequest)
                _assert_nothing_allocated(engine)


class TestLifecycleMisuse:
    @pytest.mark.asyncio
    async def test_submit_before_start_and_after_shutdown(self):
        """generate() and health_check() on an engine not running raise EngineClosed; re-entry is refused."""
        engine = Engine(small_config())
        with pytest.raises(EngineClosed):
            engine.generate([1, 2, 3])
        with anyio.fail_after(30):
            async with engine:
                pass
            with pytest.raises(EngineClosed):
                engine.generate([1, 2, 3])
            with pytest.raises(EngineClosed):
                await engine.health_check(timeout=5)
            with pytest.raises(EngineClosed):
                async with engine:
                    pass
        assert engine.stats.submitted == 0

    @pytest.mark.asyncio
    async def test_abort_unknown_finished_or_odd_ids(self):
        """abort() of an unknown, finished, non-string or empty id returns False and raises nothing."""
        with anyio.fail_after(30):
            async with Engine(small_config()) as engine:
                await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="done")
                await engine.wait_idle(10)
                for request_id in ("done", "never-seen", "", None, 42):
                    assert await engine.abort(request_id) is False
                assert_pools_whole(engine)

    @pytest.mark.asyncio
    async def test_duplicate_id_in_flight_then_reused(self):
        """A request id in flight is refused without touching the first; once released it may be reused."""
        with anyio.fail_after(30):
            async with Engine(small_config()) as engine:
                stream = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=20), request_id="dup")
                with pytest.raises(InvalidRequest) as info:
                    engine.generate([4, 5], request_id="dup")
                _assert_names(info.value, "request_id", "unique among requests in flight")
                first = [o async for o in stream]
                await engine.wait_idle(10)
                again = await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=20), request_id="dup")
        assert first[-1].finish_reason.name == "LENGTH" and len(first[-1].token_ids) == 20
        assert again.token_ids == first[-1].token_ids
