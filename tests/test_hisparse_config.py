"""Tests for hisparse.config: field validation, validation against the engine
config, and the package's public names."""

from __future__ import annotations

import pytest

import hisparse
from engine import EngineConfig, InvalidConfig
from hisparse import HiSparseConfig


class TestFieldValidation:
    @pytest.mark.parametrize(("fields", "field"), [
        ({"top_k": 0}, "HiSparseConfig.top_k"),
        ({"top_k": 2.5}, "HiSparseConfig.top_k"),
        ({"top_k": 64, "device_buffer_size": 32}, "HiSparseConfig.device_buffer_size"),
        ({"index_dim": 0}, "HiSparseConfig.index_dim"),
        ({"recent_window": -1}, "HiSparseConfig.recent_window"),
        ({"top_k": 8, "device_buffer_size": 8, "recent_window": 9}, "HiSparseConfig.recent_window"),
        ({"host_pool_tokens": 0}, "HiSparseConfig.host_pool_tokens"),
        ({"host_pool_ratio": 0}, "HiSparseConfig.host_pool_ratio"),
        ({"host_pool_ratio": float("nan")}, "HiSparseConfig.host_pool_ratio"),
    ])
    def test_bad_field_names_field_and_limit(self, fields, field):
        """Each invalid field raises InvalidConfig naming it."""
        with pytest.raises(InvalidConfig) as info:
            HiSparseConfig(**fields)
        assert info.value.field == field and info.value.limit

    def test_defaults_are_valid(self):
        """The defaults validate: top_k 256 within a 512-slot buffer."""
        config = HiSparseConfig()
        assert config.top_k <= config.device_buffer_size


class TestAgainstEngine:
    def test_buffer_beyond_max_context(self):
        """device_buffer_size above max_context is refused by EngineConfig."""
        with pytest.raises(InvalidConfig, match="max_context") as info:
            EngineConfig(max_context=128, hisparse=HiSparseConfig(top_k=64, device_buffer_size=256))
        assert info.value.field == "HiSparseConfig.device_buffer_size"

    def test_host_pool_too_small_for_one_request(self):
        """A host pool that cannot hold one max_context request is refused."""
        with pytest.raises(InvalidConfig, match="one max_context request") as info:
            EngineConfig(max_context=512, hisparse=HiSparseConfig(top_k=8, device_buffer_size=8,
                                                                  host_pool_tokens=100))
        assert info.value.field == "HiSparseConfig.host_pool_tokens"

    def test_host_pool_by_ratio(self):
        """Without host_pool_tokens the host pool is a ratio of the device KV pool, whole pages."""
        engine_config = EngineConfig(page_size=4, num_kv_pages=11, max_context=40,
                                     hisparse=HiSparseConfig(top_k=8, device_buffer_size=8, host_pool_ratio=1.5))
        assert engine_config.hisparse.host_tokens(engine_config) == 60


class TestPublicNames:
    def test_all(self):
        """The package exports its config and pool names, nothing else."""
        assert sorted(hisparse.__all__) == ["DEVICE_SLOTS", "HOST_PAGES", "HiSparseConfig", "SLOT_MAPS"]
