"""The `kvlife` command line: the main job's report, progress only on a terminal, fitting the
workload to the engine, generate, help; the README's embedded example keeps stdout clean."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--page-size", "4", "--num-kv-pages", "200", "--max-context", "512", "--no-plugins"]


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, 9)
    process.wait()


class TestRun:
    def test_run_reports_a_clean_leak_check(self, tmp_path, capsys):
        """`kvlife run` finishes with a clean verdict, exit 0, and writes the same report as JSON."""
        out = tmp_path / "report.json"
        code = main(["run", "--requests", "12", "--concurrency", "6", "--json", str(out), *SMALL])
        captured = capsys.readouterr()
        report = json.loads(out.read_text())
        assert code == 0
        assert "leak check     clean" in captured.out
        assert "\r" not in captured.err  # stderr is not a terminal here: no progress bar
        assert report["leak_check"] == "clean"
        assert sum(n for k, n in report["finishes"].items() if k.startswith("normal/")) == 12
        assert all(p["held"] == 0 for p in report["pools"].values())

    def test_workload_fits_a_small_context(self, capsys):
        """With max_context 64 every request is fitted to it: all finish, none is an InvalidRequest."""
        code = main(["run", "--requests", "16", "--max-context", "64", "--no-plugins"])
        printed = capsys.readouterr().out
        assert code == 0 and "leak check     clean" in printed
        assert re.search(r"\((\d+) fitted to max_context\)", printed).group(1) != "0"
        assert "normal/ERROR" not in printed

    def test_help_shows_run_defaults(self, capsys):
        """`run --help` shows run's own pool defaults, not EngineConfig's; max_context is the engine's own."""
        with pytest.raises(SystemExit):
            main(["run", "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: 160)" in text and "(default: log)" in text and "(default: 10.0)" in text
        assert "prompt + output tokens per request (default: derived from the pool and the model)" in text
        assert "--hisparse-top-k" in text and "--no-plugins" in text and "--log-level" in text

    def test_run_fits_a_model_with_few_positions(self, tmp_path, capsys):
        """`run --model DIR` for a checkpoint of 256 positions runs (max_context fitted to the model: no
        refusal from run's own defaults), its requests fitted to it, clean."""
        import attrs

        from engine.model.checkpoint import save_checkpoint
        from engine.model.llama import LlamaModel
        from engine.model.model_config import ModelConfig

        config = attrs.evolve(ModelConfig.tiny(), max_position_embeddings=256)
        save_checkpoint(LlamaModel.from_seed(config, seed=0), config, tmp_path / "short")
        code = main(["run", "--requests", "8", "--model", str(tmp_path / "short"), "--no-plugins"])
        printed = capsys.readouterr().out
        assert code == 0 and "leak check     clean" in printed, printed
        assert re.search(r"\((\d+) fitted to max_context\)", printed).group(1) != "0"

    def test_a_plugin_leaking_its_pool_dry_ends_the_run_with_leak(self):
        """A plugin that never gives its 4 slots back starves every later request: `kvlife run` still ends
        (within starvation_timeout + about a second), says LEAK, names the pool, the starved request and the
        leaked slots, exit code 1 (a child process, killed if it hangs)."""
        script = ("import sys; sys.path.insert(0, 'tests')\n"
                  "import resources.plugins as plugins\n"
                  "from plugin_example import LoraSlotHook\n"
                  "class Forgetful(LoraSlotHook):\n"
                  "    def release(self, request, handle): pass\n"
                  "class EntryPoint:\n"
                  "    name, value = 'forgetful', 'tests:Forgetful'\n"
                  "    def load(self): return Forgetful\n"
                  "plugins.entry_points = lambda group: [EntryPoint()]\n"
                  "from engine.cli.main import main\n"
                  "sys.exit(main(sys.argv[1:]))\n")
        argv = ["run", "--requests", "24", "--concurrency", "6", "--starvation-timeout", "0.5", "--quiet",
                "--page-size", "4", "--num-kv-pages", "200", "--max-context", "512"]
        process = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            out, err = process.communicate(timeout=120)
        finally:
            _kill(process)
        assert process.returncode == 1, (out, err[-2000:])
        assert "leak check     LEAK" in out and "lora_slots: free 0" in out
        assert re.search(r"stopped early: req-\d+ starved [\d.]+ s waiting for lora_slots", out), out
        assert "slots held by no live request (leaked)" in out

    def test_progress_on_a_terminal(self):
        """On a terminal, stderr shows a progress bar with done/total, elapsed time and a rate; the report
        still goes to stdout."""
        primary, secondary = pty.openpty()
        process = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "run", "--requests", "6", *SMALL],
                                   stdout=subprocess.PIPE, stderr=secondary, text=True, cwd=ROOT)
        os.close(secondary)
        terminal = b""
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                ready, _, _ = select.select([primary], [], [], 0.5)
                if ready:
                    try:
                        chunk = os.read(primary, 65536)
                    except OSError:  # EIO: the child closed its side
                        break
                    if not chunk:
                        break
                    terminal += chunk
                elif process.poll() is not None:
                    break
            out = process.stdout.read()
        finally:
            _kill(process)
            process.stdout.close()
            os.close(primary)
        shown = terminal.decode(errors="replace")
        assert process.returncode == 0 and "leak check     clean" in out
        assert "6/6" in shown and "req/s" in shown and re.search(r"\d:\d\d:\d\d", shown)


class TestGenerate:
    def test_generate_streams_text(self, capsys):
        """`kvlife generate` prints the continuation and exits 0."""
        code = main(["generate", "hello", "--max-new-tokens", "4", "--no-plugins"])
        assert code == 0
        assert capsys.readouterr().out.endswith("\n")

    def test_characters_split_across_tokens_print_whole(self, capsys):
        """Each byte is a token here: the two-byte characters in the output print whole (the engine's
        new_text), so stdout is exactly the engine's final text, not U+FFFD pairs."""
        final = anyio.run(_complete, "hello", SamplingParams(max_new_tokens=48))
        capsys.readouterr()  # the engine's own debug lines (structlog's defaults in tests)
        assert main(["generate", "hello", "--max-new-tokens", "48", "--no-plugins"]) == 0
        printed = capsys.readouterr().out
        assert any(ord(c) > 127 and c != "\ufffd" for c in final.text)  # the case is exercised
        assert printed == final.text + "\n"

    def test_stop_string(self, capsys):
        """--stop ends the output just before the stop string."""
        text = anyio.run(_complete, "hello", SamplingParams(max_new_tokens=24)).text
        stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2]
                    and text[i:i + 2] not in text[:i + 1])
        capsys.readouterr()
        assert main(["generate", "hello", "--max-new-tokens", "24", "--stop", stop, "--no-plugins"]) == 0
        assert capsys.readouterr().out == text[: text.index(stop)] + "\n"


async def _complete(prompt, params):
    async with Engine(EngineConfig(use_entry_points=False)) as engine:
        return await engine.complete(prompt, params)


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["generate", "--help"], ["serve", "--help"]])
def test_help(argv, capsys):
    """Help text names the commands and the engine options."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "kvlife" in capsys.readouterr().out


def test_readme_embedded_example_keeps_stdout_clean(tmp_path):
    """The README's embedded example prints its outputs and the report, and no log line, to stdout."""
    readme = (ROOT / "README.md").read_text()
    example = readme.split("## Use it embedded", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(example)
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=ROOT)
    try:
        out, err = process.communicate(timeout=120)
    finally:
        _kill(process)
    assert process.returncode == 0, err
    assert "request.transition" not in out and "resource.released" not in out
    assert "MemoryReport" in out or "pools" in out
