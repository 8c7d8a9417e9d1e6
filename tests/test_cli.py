"""The `kvlife` command line: the main job's report and exit status, generate."""

from __future__ import annotations

import json

import pytest

from engine.cli.main import main


class TestRun:
    def test_run_reports_a_clean_leak_check(self, tmp_path, capsys):
        """`kvlife run` finishes with a clean verdict, exit 0, and writes the same report as JSON."""
        out = tmp_path / "report.json"
        code = main(["run", "--requests", "12", "--concurrency", "6", "--quiet", "--json", str(out),
                     "--page-size", "4", "--num-kv-pages", "200", "--max-context", "512"])
        printed = capsys.readouterr().out
        report = json.loads(out.read_text())
        assert code == 0
        assert "leak check     clean" in printed
        assert report["leak_check"] == "clean"
        assert sum(n for k, n in report["finishes"].items() if k.startswith("normal/")) == 12
        assert all(p["held"] == 0 for p in report["pools"].values())

    def test_invalid_engine_option_is_a_clear_error(self, capsys):
        """A bad engine option exits 2 with the field and the limit."""
        code = main(["run", "--requests", "1", "--quiet", "--page-size", "0"])
        assert code == 2
        assert "EngineConfig.page_size must be an integer >= 1" in capsys.readouterr().err


class TestGenerate:
    def test_generate_streams_text(self, capsys):
        """`kvlife generate` prints the continuation and exits 0."""
        code = main(["generate", "hello", "--max-new-tokens", "4"])
        assert code == 0
        assert capsys.readouterr().out.endswith("\n")


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]])
def test_help(argv, capsys):
    """Help text names the commands and the engine options."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "kvlife" in capsys.readouterr().out
