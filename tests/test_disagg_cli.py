"""`kvlife serve --disaggregation prefill|decode`: the options, and a prefill server
started by the real command serving a decode built from the decode command's options."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import httpx
import pytest

from disagg_helpers import SERVE_FAST as FAST
from disagg_helpers import SERVE_SMALL as SMALL
from disagg_helpers import started_event
from engine import Engine, SamplingParams
from engine.cli.main import build_parser
from engine.cli.serve_command import engine_config_from_serve_args, prefill_settings_from_args
from engine.disagg.link.settings import SECRET_ENV
from engine.errors import InvalidConfig
from helpers import small_config



def _args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


class TestOptions:
    def test_decode_with_prefill_peers(self, monkeypatch):
        """--prefill (repeatable) and --transfer-* make the decode's RemotePrefill."""
        monkeypatch.delenv(SECRET_ENV, raising=False)
        config = engine_config_from_serve_args(_args("--disaggregation", "decode", "--prefill", "127.0.0.1:31001",
                                                     "--prefill", "127.0.0.1:31002", *FAST))
        remote = config.remote_prefill
        assert remote.peers == ("127.0.0.1:31001", "127.0.0.1:31002") and remote.keepalive == 0.5
        assert remote.secret is None and config.disaggregation == "decode"
        plain = engine_config_from_serve_args(_args("--disaggregation", "decode"))
        assert plain.remote_prefill is None  # the in-process worker

    def test_prefill_role(self):
        """--disaggregation prefill runs a plain engine config under a PrefillServerConfig."""
        args = _args("--disaggregation", "prefill", "--disaggregation-bootstrap-port", "0",
                     "--disaggregation-secret", "a-long-secret")
        settings = prefill_settings_from_args(args)
        assert settings.bootstrap_port == 0 and settings.secret == "a-long-secret" and settings.host == "127.0.0.1"
        assert engine_config_from_serve_args(args).disaggregation == "none"
        assert settings.transport == "auto"

    def test_transport(self, monkeypatch):
        """--disaggregation-transport picks what carries the link on either role; a wrong value names the field."""
        monkeypatch.delenv(SECRET_ENV, raising=False)
        prefill = prefill_settings_from_args(_args("--disaggregation", "prefill", "--disaggregation-transport", "gloo"))
        decode = engine_config_from_serve_args(_args("--disaggregation", "decode", "--prefill", "127.0.0.1:31001",
                                                     "--disaggregation-transport", "gloo")).remote_prefill
        assert prefill.transport == decode.transport == "gloo"
        with pytest.raises(InvalidConfig) as info:
            prefill_settings_from_args(_args("--disaggregation", "prefill", "--disaggregation-transport", "rdma"))
        assert info.value.field == "PrefillServerConfig.transport"

    @pytest.mark.parametrize("argv, field", [
        (["--disaggregation", "decode", "--disaggregation-bootstrap-port", "1"], "--disaggregation-bootstrap-port"),
        (["--disaggregation", "decode", "--prefill", "10.1.2.3:31001"], "RemotePrefill.peers"),
        (["--prefill", "127.0.0.1:31001"], "EngineConfig.remote_prefill"),
    ], ids=["bootstrap-port-on-decode", "remote-peer-without-secret", "prefill-without-decode-role"])
    def test_bad_combinations_name_the_option(self, argv, field, monkeypatch):
        """Options that do not go together raise InvalidConfig naming what is wrong."""
        monkeypatch.delenv(SECRET_ENV, raising=False)
        with pytest.raises(InvalidConfig) as info:
            engine_config_from_serve_args(_args(*argv))
        assert info.value.field == field


class TestCommand:
    @pytest.mark.asyncio
    async def test_prefill_command_serves_a_decode_command_config(self):
        """The prefill command starts, a decode configured by the decode command's options gets the single
        engine's output through it, and SIGTERM ends the prefill with a clean leak-check verdict."""
        with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
            proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--disaggregation", "prefill",
                                     "--disaggregation-bootstrap-port", "0", "--port", "0", *SMALL, *FAST],
                                    stderr=log, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
            try:
                started = started_event(log.name, proc)
                peer = f"127.0.0.1:{started['bootstrap_port']}"
                config = engine_config_from_serve_args(_args("--disaggregation", "decode", "--prefill", peer,
                                                             "--leak-check", "raise", *SMALL, *FAST))
                params = SamplingParams(max_new_tokens=5, ignore_eos=True)
                async with Engine(config) as engine:
                    remote = await engine.complete([5, 6, 7, 8, 9], params)
                async with Engine(small_config()) as single:
                    assert remote.token_ids == (await single.complete([5, 6, 7, 8, 9], params)).token_ids
                assert httpx.get(f"http://127.0.0.1:{started['port']}/health").json()["role"] == "prefill"
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            with open(log.name) as f:
                lines = [json.loads(line) for line in f if line.startswith("{")]
        assert any(e["event"] == "server.leak_check" and e["verdict"] == "clean" for e in lines)
        assert any(e["event"] == "transfer.no_secret" for e in lines)  # said at startup
