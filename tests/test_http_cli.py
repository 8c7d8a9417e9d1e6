"""`kvlife serve` arguments: engine options map to EngineConfig fields, validated with its messages."""

from __future__ import annotations

import pytest

from engine.cli.main import build_parser, main
from engine.cli.serve_command import engine_config_from_serve_args, server_settings_from_args


def _parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


class TestServeArguments:
    def test_defaults(self):
        """Without options: 127.0.0.1:30000, JSON logs at info, the default engine with leak_check 'log'."""
        args = _parse()
        config = engine_config_from_serve_args(args)
        assert (args.host, args.port, args.log_json, args.log_level) == ("127.0.0.1", 30000, True, "info")
        assert config.model == "tiny" and config.leak_check == "log" and config.hisparse is None

    def test_engine_options_map_to_config_fields(self):
        """Each engine option sets the EngineConfig field of the same name."""
        args = _parse("--page-size", "4", "--num-kv-pages", "64", "--max-running", "3", "--max-context", "128",
                      "--max-queued", "10", "--leak-check", "raise", "--disaggregation", "decode",
                      "--fence-timeout", "2.5", "--no-prefix-cache")
        config = engine_config_from_serve_args(args)
        assert (config.page_size, config.num_kv_pages, config.max_running, config.max_context) == (4, 64, 3, 128)
        assert (config.max_queued, config.leak_check, config.disaggregation) == (10, "raise", "decode")
        assert config.fence_timeout == 2.5 and config.prefix_cache is False

    def test_hisparse_options(self):
        """--hisparse-top-k and --hisparse-device-buffer-size build a HiSparseConfig."""
        pytest.importorskip("hisparse.config", reason="HiSparse not built yet")
        args = _parse("--hisparse-top-k", "8", "--hisparse-device-buffer-size", "16", "--page-size", "4",
                      "--num-kv-pages", "256", "--max-context", "256")
        config = engine_config_from_serve_args(args)
        assert (config.hisparse.top_k, config.hisparse.device_buffer_size) == (8, 16)

    def test_server_options(self):
        """Server options become ServerSettings."""
        args = _parse("--max-body-bytes", "2048", "--max-prompt-tokens", "100", "--max-inflight", "5",
                      "--health-timeout", "3", "--served-model-name", "mini")
        settings = server_settings_from_args(args)
        assert (settings.max_body_bytes, settings.max_prompt_tokens, settings.max_inflight) == (2048, 100, 5)
        assert settings.health_timeout == 3 and settings.served_model_name == "mini"

    def test_invalid_engine_option_message(self, capsys, monkeypatch):
        """An invalid engine option exits 2 with EngineConfig's own message, before anything binds."""
        monkeypatch.setattr("engine.cli.main.configure_logging", lambda *args, **kwargs: None)  # keep global logging
        assert main(["serve", "--page-size", "0"]) == 2
        assert "EngineConfig.page_size must be an integer >= 1, got 0" in capsys.readouterr().err
