"""`kvlife serve` arguments: engine options map to EngineConfig fields, server options to ServerSettings."""

from __future__ import annotations

import pytest

from engine.cli.main import build_parser, main
from engine.cli.options import engine_config_from_args
from engine.cli.serve_command import server_settings_from_args


def _parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


class TestServeArguments:
    def test_defaults(self):
        """Without options: 127.0.0.1:30000, JSON logs at info, the default engine with leak_check 'log'."""
        args = _parse()
        config = engine_config_from_args(args)
        assert (args.host, args.port, args.default_log_json, args.default_log_level) == ("127.0.0.1", 30000, True,
                                                                                           "info")
        assert args.log_level is None and args.log_json is None
        assert config.model == "tiny" and config.leak_check == "log" and config.hisparse is None

    def test_engine_options_map_to_config_fields(self):
        """Each engine option sets the EngineConfig field of the same name."""
        args = _parse("--page-size", "4", "--num-kv-pages", "64", "--max-running", "3", "--max-context", "128",
                      "--max-queued", "10", "--leak-check", "raise", "--disaggregation", "decode",
                      "--fence-timeout", "2.5", "--no-prefix-cache", "--no-plugins")
        config = engine_config_from_args(args)
        assert (config.page_size, config.num_kv_pages, config.max_running, config.max_context) == (4, 64, 3, 128)
        assert (config.max_queued, config.leak_check, config.disaggregation) == (10, "raise", "decode")
        assert config.fence_timeout == 2.5 and config.prefix_cache is False and config.use_entry_points is False

    @pytest.mark.parametrize("command", [["serve"], ["run"], ["generate", "hi"]])
    def test_hisparse_options_on_every_command(self, command):
        """--hisparse-top-k, --hisparse-device-buffer-size and --hisparse-recent-window build a HiSparseConfig."""
        args = build_parser().parse_args([*command, "--hisparse-top-k", "8", "--hisparse-device-buffer-size", "16",
                                          "--hisparse-recent-window", "2", "--page-size", "4",
                                          "--num-kv-pages", "256", "--max-context", "256"])
        config = engine_config_from_args(args)
        assert (config.hisparse.top_k, config.hisparse.device_buffer_size, config.hisparse.recent_window) == (8, 16, 2)

    def test_server_options(self, monkeypatch):
        """Server options become ServerSettings; the API key comes from --api-key or KVLIFE_API_KEY."""
        monkeypatch.delenv("KVLIFE_API_KEY", raising=False)
        args = _parse("--max-body-bytes", "2048", "--max-prompt-tokens", "100", "--max-inflight", "5",
                      "--health-timeout", "3", "--served-model-name", "mini")
        settings = server_settings_from_args(args)
        assert (settings.max_body_bytes, settings.max_prompt_tokens, settings.max_inflight) == (2048, 100, 5)
        assert settings.health_timeout == 3 and settings.served_model_name == "mini" and settings.api_key is None
        monkeypatch.setenv("KVLIFE_API_KEY", "from-env")
        assert server_settings_from_args(_parse()).api_key == "from-env"
        assert server_settings_from_args(_parse("--api-key", "given")).api_key == "given"

    def test_api_key_never_in_repr_or_help(self, monkeypatch, capsys):
        """The key is in neither the settings' repr nor --help, even when set in the environment."""
        monkeypatch.setenv("KVLIFE_API_KEY", "sekrit-env")
        settings = server_settings_from_args(_parse("--api-key", "sekrit-arg"))
        with pytest.raises(SystemExit):
            main(["serve", "--help"])
        assert "sekrit" not in repr(settings) and "sekrit" not in capsys.readouterr().out

    def test_invalid_engine_option_message(self, capsys):
        """An invalid engine option exits 2 with EngineConfig's own message, before anything binds."""
        assert main(["serve", "--page-size", "0"]) == 2
        assert capsys.readouterr().err == "kvlife: EngineConfig.page_size must be an integer >= 1, got 0\n"


class TestToolAndReasoningOptions:
    def test_parsers_become_settings(self):
        """--tool-call-parser and --reasoning-parser set ServerSettings; none by default; vLLM's
        --enable-auto-tool-choice is accepted."""
        assert (server_settings_from_args(_parse()).tool_call_parser, server_settings_from_args(_parse())
                .reasoning_parser) == (None, None)
        settings = server_settings_from_args(_parse("--tool-call-parser", "llama3_json", "--reasoning-parser",
                                                    "deepseek_r1", "--enable-auto-tool-choice"))
        assert (settings.tool_call_parser, settings.reasoning_parser) == ("llama3_json", "deepseek_r1")

    @pytest.mark.parametrize("option", ["--tool-call-parser", "--reasoning-parser"])
    def test_an_unknown_parser_is_a_usage_error(self, option, capsys):
        with pytest.raises(SystemExit) as exited:
            main(["serve", option, "nope"])
        assert exited.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err

    def test_settings_name_the_field(self):
        from engine.errors import InvalidConfig
        from engine.serve.settings import ServerSettings

        with pytest.raises(InvalidConfig, match="ServerSettings.tool_call_parser"):
            ServerSettings(tool_call_parser="xml")

    def test_the_cli_offers_every_parser(self):
        """The CLI's choices (kept free of web imports) are exactly the parsers the server has."""
        from engine.cli import serve_command
        from engine.serve.reasoning import REASONING_PARSERS
        from engine.serve.tool_parsers import TOOL_PARSERS

        assert set(serve_command.TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
        assert set(serve_command.REASONING_PARSERS) == set(REASONING_PARSERS)
