"""A user's own checkpoint directory through the public API and the CLI:
`EngineConfig(model=DIR)` and `kvlife generate --model DIR` run it; a
directory without tokenizer.json takes token ids only; every refusal is one
line naming the field, exit code 2."""

from __future__ import annotations

import json

import pytest
from structlog.testing import capture_logs

import transformers  # noqa: E402 - in the test extra: a missing one fails, never skips

import parity_models as pm  # noqa: E402
from engine import Engine, EngineConfig, InvalidRequest, SamplingParams  # noqa: E402
from engine.cli.main import main  # noqa: E402
from engine.model.checkpoint import CheckpointError  # noqa: E402


def _config(directory, **overrides) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(directory), page_size=4, num_kv_pages=64, max_context=128,
                                  use_entry_points=False), **overrides})


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    return directory, pm.write_checkpoint(directory, "qwen3")


class TestModelOnlyDirectory:
    @pytest.mark.anyio
    async def test_loads_with_a_warning_and_takes_token_ids(self, tmp_path):
        """save_pretrained of a model alone (no tokenizer.json): a warning, token-id prompts give transformers' ids."""
        model = pm.write_checkpoint(tmp_path, "mistral", tokenizer=False)
        with capture_logs() as logs:
            engine = Engine(_config(tmp_path))
        assert any(e["event"] == "checkpoint.no_tokenizer" and e["log_level"] == "warning" for e in logs)
        async with engine:
            final = await engine.complete(pm.ID_PROMPTS[1], SamplingParams(max_new_tokens=pm.MAX_NEW))
            with pytest.raises(InvalidRequest, match="this checkpoint has no tokenizer.json") as caught:
                await engine.complete("hello", SamplingParams(max_new_tokens=2))
        assert caught.value.field == "prompt"
        assert final.token_ids == pm.hf_greedy(model, pm.ID_PROMPTS[1], pm.MAX_NEW)[0]


class TestLimits:
    @pytest.mark.anyio
    async def test_model_limits_are_exposed(self, qwen3):
        """The engine's model config carries the checkpoint's max_position_embeddings and stop ids."""
        directory, _ = qwen3
        async with Engine(_config(directory)) as engine:
            assert engine.model_config.max_position_embeddings == 256
            assert engine.model_config.stop_token_ids == (pm.EOS_ID,)


class TestCli:
    def test_generate_streams_the_checkpoints_continuation(self, qwen3, capsys):
        """`kvlife generate --model DIR TEXT` prints transformers' greedy continuation of TEXT, decoded."""
        directory, model = qwen3
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        expected, _ = pm.hf_greedy(model, tokenizer(pm.TEXT_PROMPTS[0])["input_ids"], 8)
        code = main(["generate", pm.TEXT_PROMPTS[0], "--model", str(directory), "--max-new-tokens", "8",
                     "--num-kv-pages", "64", "--max-context", "128"])
        assert code == 0
        decoded = tokenizer.decode(expected, skip_special_tokens=True)  # printed whole (new_text), not per token
        assert capsys.readouterr().out == decoded + "\n"

    @pytest.mark.parametrize(
        ("edit", "field"),
        [
            (lambda hf: hf.update(model_type="gemma2"), "config.json model_type"),
            (lambda hf: hf.update(rope_parameters={"rope_type": "longrope", "factor": 2.0}),
             "config.json rope_parameters.rope_type"),
            (lambda hf: hf.update(intermediate_size=32), "model.layers.0.mlp."),
        ],
        ids=["family", "option", "tensor-shape"],
    )
    def test_refusals_are_one_line_with_exit_code_2(self, tmp_path, capsys, edit, field):
        """An unsupported family or option, or a misshapen tensor: `kvlife: <field>: ...`, one line, exit 2."""
        pm.write_checkpoint(tmp_path, "llama")
        hf = json.loads((tmp_path / "config.json").read_text())
        edit(hf)
        (tmp_path / "config.json").write_text(json.dumps(hf))
        capsys.readouterr()
        code = main(["generate", "hi", "--model", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"kvlife: {field}") and err.count("\n") == 1
        assert "Traceback" not in err

    def test_checkpoint_error_carries_the_field(self, tmp_path):
        """Engine() raises CheckpointError itself (an InvalidConfig), its field naming the unsupported option."""
        pm.write_checkpoint(tmp_path, "llama", tokenizer=False)
        hf = json.loads((tmp_path / "config.json").read_text())
        hf["rope_parameters"]["partial_rotary_factor"] = 0.5
        (tmp_path / "config.json").write_text(json.dumps(hf))
        with pytest.raises(CheckpointError) as caught:
            Engine(_config(tmp_path))
        assert caught.value.field == "config.json partial_rotary_factor"
