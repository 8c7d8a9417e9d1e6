"""Every misuse of `kvlife` is one `kvlife: ...` line on stderr with exit code 2, never a traceback;
logging options are taken before or after the command."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from engine.cli.main import build_parser, logging_choice, main

MISUSES = [
    (["run", "--concurrency", "0"], "--concurrency: must be an integer >= 1"),
    (["run", "--concurrency", "-1"], "--concurrency: must be an integer >= 1"),
    (["run", "--requests", "-3"], "--requests: must be an integer >= 1"),
    (["run", "--requests", "many"], "--requests: must be an integer >= 1"),
    (["run", "--max-context", "0"], "EngineConfig.max_context must be None or an integer >= 2"),
    (["run", "--json", "/nonexistent-dir/report.json"], "directory /nonexistent-dir does not exist"),
    (["run", "--json", "/proc/kvlife-report.json", "--requests", "2"],  # permission bits say yes, even to root
     "--json /proc/kvlife-report.json: not writable (No such file or directory)"),
    (["serve", "--disaggregation", "both"], "--disaggregation: invalid choice: 'both'"),
    (["run", "--disaggregation", "prefill"], "--disaggregation: invalid choice: 'prefill'"),
    (["generate", ""], "argument text: must be a non-empty string"),
    (["generate", "hi", "--max-new-tokens", "100000"], "prompt + max_new_tokens must be <= max_context"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1"),
    (["generate", "hi", "--temperature", "-1"], "--temperature: must be a finite number >= 0"),
    (["generate", "hi", "--hisparse-top-k", "0"], "HiSparseConfig.top_k must be an integer >= 1"),
    (["generate", "hi", "--speculative-num-tokens", "0"], "SpeculativeConfig.num_tokens must be an integer >= 1"),
    (["serve", "--port", "70000"], "--port: must be a port in [0, 65535]"),
    (["serve", "--port", "-1"], "--port: must be a port in [0, 65535]"),
    (["serve", "--max-body-bytes", "0"], "--max-body-bytes: must be an integer >= 1"),
    (["serve", "--max-inflight", "0"], "--max-inflight: must be an integer >= 1"),
    (["serve", "--health-timeout", "nan"], "--health-timeout: must be a finite number of seconds > 0"),
    (["serve", "--page-size", "0"], "EngineConfig.page_size must be an integer >= 1, got 0"),
    (["serve", "--leak-check", "sometimes"], "EngineConfig.leak_check must be one of"),
    (["serve", "--api-key", ""], "--api-key (or $KVLIFE_API_KEY) must not be empty"),
    (["--log-level", "loud", "run"], "--log-level: invalid choice: 'loud'"),
    (["run", "--log-level", "loud"], "--log-level: invalid choice: 'loud'"),
    (["run", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    ([], "the following arguments are required"),
]


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own exit
        return exc.code


def _assert_one_line(capsys, expected: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlife: ") and expected in lines[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


class TestMisuse:
    @pytest.mark.parametrize(("argv", "expected"), MISUSES, ids=[" ".join(a) or "(none)" for a, _ in MISUSES])
    def test_one_line_exit_2(self, argv, expected, capsys):
        """The misuse exits 2 with one line naming the option (or field) and its limit."""
        assert _exit_code(argv) == 2
        _assert_one_line(capsys, expected)

    @pytest.mark.parametrize(("command", "roles"), [("serve", "none, decode, prefill"), ("run", "none, decode"),
                                                    ("generate", "none, decode")])
    def test_a_bad_role_lists_the_commands_roles(self, command, roles, capsys):
        """A bad --disaggregation is refused listing every role that command takes (serve: prefill too)."""
        argv = [command, *(["hi"] if command == "generate" else []), "--disaggregation", "both"]
        assert _exit_code(argv) == 2
        line = _assert_one_line(capsys, "--disaggregation: invalid choice: 'both'")
        assert line.replace("'", "").endswith(f"(choose from {roles})")

    def test_checkpoint_error_names_the_cause(self, tmp_path, capsys):
        """A directory that is not a checkpoint: one line with EngineConfig.model and what is missing."""
        assert _exit_code(["generate", "hi", "--model", str(tmp_path)]) == 2
        _assert_one_line(capsys, "config.json: missing")

    def test_port_in_use(self, capsys):
        """A port another socket listens on: one line saying it cannot listen there."""
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            assert _exit_code(["serve", "--port", str(port), "--no-plugins"]) == 2
        _assert_one_line(capsys, f"cannot listen on 127.0.0.1:{port}")

    def test_broken_plugin_is_named(self, monkeypatch, capsys):
        """An entry point that fails to import is named in one line; --no-plugins runs without it."""
        broken = EntryPoint("broken_lease", "kvlife_no_such_module:factory", "kvlife.resources")
        monkeypatch.setattr("resources.plugins.entry_points", lambda group: [broken])
        assert _exit_code(["generate", "hi", "--max-new-tokens", "1"]) == 2
        line = _assert_one_line(capsys, "plugin entry point 'broken_lease' (kvlife_no_such_module:factory)")
        assert line.endswith("--no-plugins runs without plugins")
        assert _exit_code(["generate", "hi", "--max-new-tokens", "1", "--no-plugins"]) == 0

    def test_console_script_prints_no_traceback(self):
        """The installed `kvlife` entry point itself: exit 2 and one line, for an engine and a parse error."""
        for argv in (["run", "--max-context", "1"], ["serve", "--port", "99999"]):
            process = subprocess.Popen([sys.executable, "-m", "engine.cli.main", *argv], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
            try:
                out, err = process.communicate(timeout=60)
            finally:
                if process.poll() is None:
                    os.kill(process.pid, 9)
                    process.wait()
            assert process.returncode == 2 and len(err.splitlines()) == 1 and err.startswith("kvlife: "), err


class TestLoggingOptions:
    @pytest.mark.parametrize(("argv", "expected"), [
        (["run"], ("warning", False)),
        (["--log-level", "debug", "run"], ("debug", False)),
        (["run", "--log-level", "error"], ("error", False)),
        (["serve"], ("info", True)),
        (["--log-level", "debug", "serve"], ("debug", True)),
        (["serve", "--log-level", "warning", "--no-log-json"], ("warning", False)),
        (["--log-json", "generate", "hi"], ("warning", True)),
        (["--log-level", "info", "serve", "--log-level", "error"], ("error", True)),
    ])
    def test_level_before_or_after_the_command(self, argv, expected):
        """--log-level and --log-json are honoured before or after every command (after wins)."""
        assert logging_choice(build_parser().parse_args(argv)) == expected

    def test_version(self, capsys):
        """--version prints the package version and exits 0."""
        assert _exit_code(["--version"]) == 0
        assert capsys.readouterr().out.startswith("kvlife ")
