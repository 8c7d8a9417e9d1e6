"""Grammars that cannot be served are that request's error only: an invalid schema, regex or Lark
grammar and a compile past its deadline are refused before anything is held (`InvalidRequest`
naming the constraint); a dead end mid-output ends the request with `GrammarDeadEnd`, never with
an unconstrained token. The engine serves the next request every time."""

from __future__ import annotations

import anyio
import pytest
import structlog

from engine import Constraint, Engine, FinishReason, InvalidRequest, SamplingParams, StructuredConfig
from helpers import collect, small_config
from test_structured_lifecycle import assert_no_matcher_alive

PROMPT = [5, 6, 7, 8]
OK = SamplingParams(max_new_tokens=6, constraint=Constraint.regex("[0-9]{6}"))
#: an ambiguous grammar that allows only 'a' (20 at least) and whose Earley items grow with each one:
#: its first mask fits step_max_items=500, the second does not, so it has no next token
AMBIGUOUS = Constraint.lark("start: " + " ".join(["s"] * 20) + '\ns: s s | "a"\n')
BIG_SCHEMA = {"type": "object", "additionalProperties": False, "required": [f"p{i}" for i in range(300)],
              "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x[0-9]{{2,{i % 5 + 3}}}$"}
                             for i in range(300)}}


async def _served(engine: Engine) -> None:
    out = await engine.complete(PROMPT, OK)
    assert out.finish_reason is FinishReason.STOP and out.text.isdigit() and len(out.text) == 6


@pytest.mark.asyncio
@pytest.mark.parametrize("constraint,says", [
    (Constraint.json_schema({"type": "foo"}), "valid JSON schema"),
    (Constraint.json_schema({"type": "integer", "minimum": "zero"}), "valid JSON schema"),
    (Constraint.regex("a(b"), "valid regex"),
    (Constraint.lark("start: ( \n"), "valid Lark grammar"),
    (Constraint.lark('start: "a" <[99999]>\n'), "valid Lark grammar"),
], ids=["unknown-type", "bad-minimum", "regex", "lark-syntax", "lark-token"])
async def test_an_invalid_grammar_is_refused_before_anything_is_held(constraint, says):
    """The stream raises InvalidRequest naming SamplingParams.constraint; a second try is refused at
    generate(); a compile failure is logged with the request id; other requests are served."""
    async with Engine(small_config()) as engine:
        observed = []
        engine.parts.machine.transition_observers.append(lambda r, src, dst: observed.append((r.request_id, dst.name)))
        with structlog.testing.capture_logs() as logs:
            stream = engine.generate(PROMPT, SamplingParams(constraint=constraint), request_id="bad")
            with pytest.raises(InvalidRequest, match=says) as refused:
                await stream.ready()
            with pytest.raises(InvalidRequest):
                await collect(stream)
        assert refused.value.field.startswith("SamplingParams.constraint")
        assert ("bad", "PREFILLING") not in observed  # never admitted: nothing was held
        assert any(e["event"] == "grammar.compile_failed" and e["request_id"] == "bad" for e in logs)
        with pytest.raises(InvalidRequest, match=says):
            engine.generate(PROMPT, SamplingParams(constraint=constraint))
        await _served(engine)
        assert engine.structured_stats.compiles.compile_failures == 1
    assert_no_matcher_alive(engine)


@pytest.mark.asyncio
async def test_a_compile_past_its_deadline_is_refused_and_cached_for_later():
    """A grammar not compiled within compile_timeout refuses its request (the engine serves others);
    its compile still finishes in the background, and the same grammar is then served at once."""
    config = small_config(structured=StructuredConfig(compile_timeout=0.0005))
    big = Constraint.json_schema(BIG_SCHEMA)
    async with Engine(config) as engine:
        with pytest.raises(InvalidRequest, match="compile_timeout"):
            await engine.complete(PROMPT, SamplingParams(max_new_tokens=4, constraint=big))
        assert engine.structured_stats.compiles.compile_timeouts == 1
        out = await engine.complete(PROMPT, SamplingParams(max_new_tokens=4))
        assert out.finish_reason is FinishReason.LENGTH
        compiler = engine.parts.structured.compiler
        with anyio.fail_after(30):
            while compiler.cached(big) is None:
                await anyio.sleep(0.01)
        stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, constraint=big))
        await stream.ready()  # cached: in the engine at once
        final = (await collect(stream))[-1]
        assert final.finish_reason is FinishReason.LENGTH and final.text == '{"p0'
    assert_no_matcher_alive(engine)


@pytest.mark.asyncio
async def test_a_dead_end_ends_the_request_never_with_a_free_token():
    """Past llguidance's item limit the grammar allows no token: the request (sampled, so a NaN would
    show) ends ERROR with GrammarDeadEnd (logged with its id), every token it got obeys the grammar,
    and the next is served."""
    config = small_config(structured=StructuredConfig(step_max_items=500))
    async with Engine(config) as engine:
        with structlog.testing.capture_logs() as logs:
            out = await engine.complete(PROMPT, SamplingParams(max_new_tokens=200, temperature=1.0, seed=1,
                                                               constraint=AMBIGUOUS), request_id="dead")
        assert out.finish_reason is FinishReason.ERROR and "GrammarDeadEnd" in out.error
        assert "Too many items" in out.error and set(out.token_ids) <= {ord("a")}  # nothing unconstrained
        assert any(e["event"] == "grammar.dead_end" and e["request_id"] == "dead" for e in logs)
        assert engine.structured_stats.grammars.dead_ends == 1
        await _served(engine)
    assert_no_matcher_alive(engine)


@pytest.mark.asyncio
async def test_constraints_need_a_vocabulary(tmp_path):
    """A checkpoint without tokenizer.json cannot constrain: refused at generate() naming the field."""
    from parity_models import write_checkpoint

    write_checkpoint(tmp_path, "llama", tokenizer=False)
    async with Engine(small_config(model=str(tmp_path))) as engine:
        with pytest.raises(InvalidRequest, match="no vocabulary") as refused:
            engine.generate([1, 5, 6], OK)
        assert refused.value.field == "SamplingParams.constraint"
