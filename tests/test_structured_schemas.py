"""50 random JSON schemas, on the tiny model (byte tokenizer) and on a byte-level BPE checkpoint the
test writes itself: greedy, seeded, n > 1, streamed and not, every output parses and validates."""

from __future__ import annotations

import json
import random

import anyio
import jsonschema
import pytest

from engine import Constraint, Engine, FinishReason, SamplingParams
from helpers import small_config
from parity_models import write_checkpoint
from structured_schemas import max_bytes, random_schema

SCHEMAS = [random_schema(random.Random(i), budget=180) for i in range(50)]
#: per schema (by index % 4): how it is sampled and read
MODES = ("greedy", "seeded", "n=2", "streamed")


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    write_checkpoint(directory, "qwen2")
    return str(directory)


def _params(i: int, schema: dict) -> SamplingParams:
    mode = MODES[i % 4]
    sampled = {} if mode in ("greedy", "streamed") else {"temperature": 1.0, "seed": 1000 + i}
    return SamplingParams(max_new_tokens=max_bytes(schema) + 8, n=2 if mode == "n=2" else 1,
                          constraint=Constraint.json_schema(schema), **sampled)


async def _run_all(engine: Engine, prompt: str) -> dict[int, list[tuple[str, FinishReason, str]]]:
    """Per schema: (text, finish reason, streamed text) of each sequence."""
    results: dict[int, list] = {}

    async def one(i: int, schema: dict) -> None:
        params = _params(i, schema)
        finals, streamed = {}, {}
        async with engine.generate(prompt, params, request_id=f"schema-{i}") as stream:
            async for out in stream:
                streamed[out.index] = streamed.get(out.index, "") + out.new_text
                if out.finished:
                    finals[out.index] = out
        results[i] = [(finals[k].text, finals[k].finish_reason, streamed[k]) for k in sorted(finals)]

    async with anyio.create_task_group() as tg:
        for i, schema in enumerate(SCHEMAS):
            tg.start_soon(one, i, schema)
    return results


def _assert_all_valid(results: dict[int, list]) -> None:
    assert sorted(results) == list(range(len(SCHEMAS)))
    for i, sequences in results.items():
        assert len(sequences) == (2 if MODES[i % 4] == "n=2" else 1)
        for text, reason, streamed in sequences:
            assert reason is FinishReason.STOP, (i, reason, text)
            assert streamed == text
            jsonschema.validate(json.loads(text), SCHEMAS[i])
            assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)  # compact


@pytest.mark.asyncio
@pytest.mark.parametrize("model", ["tiny", "bpe"])
async def test_fifty_random_schemas_parse_and_validate(model, bpe_checkpoint):
    """Every output of 50 schemas (greedy, seeded, n=2, streamed) is compact JSON that validates."""
    config = small_config(model=bpe_checkpoint if model == "bpe" else "tiny", max_running=64, num_kv_pages=1024,
                          max_context=256)
    with anyio.fail_after(120):
        async with Engine(config) as engine:
            results = await _run_all(engine, "Answer in JSON:")
            counts = engine.structured_stats
    _assert_all_valid(results)
    n_sequences = sum(2 if MODES[i % 4] == "n=2" else 1 for i in range(len(SCHEMAS)))
    assert counts.grammars.constrained == n_sequences == counts.grammars.completed
    assert counts.compiles.cache_misses == len({json.dumps(s) for s in SCHEMAS})
