"""The parts of structured output on their own: the constraint (validation, wire form), the
matcher state (sync, rollback, the reasoning marker), the sampler's mask, the compiler's cache."""

from __future__ import annotations

import json

import anyio
import attrs
import numpy as np
import pytest
import torch

from engine import Constraint, InvalidRequest, SamplingParams, StructuredConfig
from engine.disagg.link.wire import params_to_dict
from engine.model.sampling import sample
from engine.model.tokenizer import ByteTokenizer
from engine.structured.compiler import GrammarCompiler
from engine.structured.hook import GrammarHook
from engine.structured.masks import GrammarMasks, unpack
from engine.structured.matcher import GrammarState
from engine.structured.stats import GrammarStats
from resources import ResourceExhausted
from states import FinishReason, Request, RequestState

TOKENIZER = ByteTokenizer()
VOCAB = TOKENIZER.vocab_size
EOS = TOKENIZER.eos_token_id


def _compiler(**config) -> GrammarCompiler:
    """A compiler of its own (not the per-tokenizer shared one)."""
    from engine.structured.vocabulary import build_vocabulary

    return GrammarCompiler(lambda: build_vocabulary(TOKENIZER, VOCAB, [EOS]), StructuredConfig(**config))


def _state(constraint: Constraint, compiler: GrammarCompiler | None = None) -> GrammarState:
    compiler = compiler or _compiler()
    compiled = anyio.run(compiler.compile, constraint)
    stop_words = np.zeros((VOCAB + 31) // 32, dtype=np.int32)
    stop_words[EOS >> 5] = 1 << (EOS & 31)
    return GrammarState(compiled.matcher(), constraint, TOKENIZER.decode, stop_words)


def _allowed(state: GrammarState) -> list[int]:
    bits = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    state.fill(bits, 0)
    return [t for t in range(VOCAB) if (int(bits[0, t >> 5]) >> (t & 31)) & 1]


class TestConstraint:
    def test_the_wire_form_round_trips(self):
        """attrs.asdict -> JSON -> SamplingParams(**) gives the same constraint (how a job travels)."""
        for constraint in (Constraint.json_schema({"type": "object", "properties": {"b": {}, "a": {}}}),
                           Constraint.choice(["x", "y z"]), Constraint.regex("[0-9]+", starts_after="</think>"),
                           Constraint.json_object(flexible_whitespace=True), Constraint.lark('start: "a"')):
            params = SamplingParams(constraint=constraint)
            again = SamplingParams(**json.loads(json.dumps(params_to_dict(params))))
            assert again == params and again.constraint.key == constraint.key

    def test_schema_property_order_is_kept(self):
        """The schema's text keeps its property order (llguidance generates properties in it)."""
        constraint = Constraint.json_schema({"properties": {"zeta": {}, "alpha": {}}})
        assert list(constraint.schema["properties"]) == ["zeta", "alpha"]

    @pytest.mark.parametrize("build,field", [
        (lambda: Constraint.json_schema("[1, 2]"), "SamplingParams.constraint.json_schema"),
        (lambda: Constraint.json_schema("{nope"), "SamplingParams.constraint.json_schema"),
        (lambda: Constraint.choice([]), "SamplingParams.constraint.choice"),
        (lambda: Constraint.choice(["a", ""]), "SamplingParams.constraint.choice"),
        (lambda: Constraint.regex(""), "SamplingParams.constraint.regex"),
        (lambda: Constraint("xml", "<a/>"), "SamplingParams.constraint.kind"),
        (lambda: Constraint.lark("x" * (1 << 19)), "SamplingParams.constraint.lark"),
        (lambda: SamplingParams(constraint="json"), "SamplingParams.constraint"),
        (lambda: SamplingParams(constraint={"kind": "regex", "bogus": 1}), "SamplingParams.constraint"),
    ])
    def test_bad_constraints_name_their_field(self, build, field):
        """Each malformed constraint is an InvalidRequest naming the field."""
        with pytest.raises(InvalidRequest) as refused:
            build()
        assert refused.value.field == field


class TestGrammarState:
    def test_sync_consumes_and_rolls_back_to_the_kept_output(self):
        """sync follows the output both ways: new tokens are consumed, dropped ones rolled back."""
        state = _state(Constraint.regex("ab[0-9]"))
        assert state.sync([ord("a"), ord("b")]) and state.consumed == 2
        assert _allowed(state) == list(range(ord("0"), ord("9") + 1))
        assert state.sync([ord("a")]) and state.consumed == 1  # a refused first token was popped
        assert _allowed(state) == [ord("b")]
        assert not state.sync([ord("a"), ord("x")]) and "not allowed" in state.error and not state.dead_end
        bits = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        assert not state.fill(bits, 0) and bits.eq(0).all()  # the row of a refused token is a dead end

    def test_complete_when_the_grammar_admits_nothing_more(self):
        state = _state(Constraint.choice(["yes", "no"]))
        assert state.sync([ord("n")]) and not state.complete and state.synced_to(1)
        assert state.sync([ord("n"), ord("o")]) and state.complete and state.synced_to(2) and not state.done
        assert _allowed(state) == [EOS] and state.done  # its mask allows only EOS: the loop's check reads that
        assert state.sync([ord("n")]) and not state.done  # rolled back: no longer known complete

    def test_the_marker_starts_the_grammar_after_its_token(self):
        """Before `starts_after` the state is inactive; the grammar starts at the token after the
        one completing the marker, however the marker is split."""
        state = _state(Constraint.regex("[0-9]{2}", starts_after="</think>"))
        output = list(b"hmm </thi")
        for i in range(1, len(output) + 1):
            assert state.sync(output[:i]) and not state.active
        for token in b"nk>":
            output = output + [token]
            assert state.sync(output)
        assert state.active and state.start == len(output)
        assert _allowed(state) == list(range(ord("0"), ord("9") + 1))
        assert state.sync(output[:-1]) and not state.active  # the marker's last token dropped: inactive again
        assert state.sync(output + [ord("4")]) and state.consumed == 1

    def test_an_error_state_is_a_dead_end_with_an_empty_row(self):
        """A matcher in error has no next token: fill leaves the row all zero and says why."""
        state = _state(Constraint.regex("ab"))
        state.matcher.consume_token(ord("x"))  # outside the grammar: the matcher errs
        bits = torch.full((2, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        assert not state.fill(bits, 1) and state.dead_end and state.error
        assert bits[1].eq(0).all() and bits[0].eq(-1).all()


class TestSamplerMask:
    def _bits(self, rows: list[list[int] | None]) -> torch.Tensor:
        bits = torch.full((len(rows), (VOCAB + 31) // 32), -1, dtype=torch.int32)
        for i, allowed in enumerate(rows):
            if allowed is not None:
                bits[i] = 0
                for t in allowed:
                    bits[i, t >> 5] |= 1 << (t & 31) if (t & 31) != 31 else -(1 << 31)
        return bits

    def test_only_allowed_tokens_are_sampled(self):
        """The unpacked mask, through the sampler's seam: greedy and sampled rows take allowed tokens
        only, a free row is untouched, and a row that allows nothing is sampled unmasked (no NaN)
        for the runner to answer -1."""
        torch.manual_seed(0)
        logits = torch.randn(4, VOCAB)
        params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(),
                  SamplingParams(temperature=0.7)]
        allowed = unpack(self._bits([[7, 63, 200], [31, 95, 100], None, []]), [3], torch.device("cpu"), VOCAB)
        assert allowed.dtype is torch.bool and allowed.shape == (4, VOCAB) and allowed[3].all()
        for position in range(20):
            tokens = sample(logits, params, [position] * 4, allowed=allowed)
            assert tokens[0] == max([7, 63, 200], key=lambda t: logits[0, t]) and tokens[1] in (31, 95, 100)
            assert tokens[2] == int(logits[2].argmax()) and 0 <= tokens[3] < VOCAB

    def test_unpacking_matches_the_bits(self):
        """Bit j of word w allows token 32 * w + j, past the first word and at bit 31 too."""
        rows = [[0, 31, 32, 63, VOCAB - 1], None]
        allowed = unpack(self._bits(rows), [], torch.device("cpu"), VOCAB)
        assert allowed[0].nonzero().flatten().tolist() == rows[0] and allowed[1].all()
        narrow = unpack(self._bits([[1]]), [], torch.device("cpu"), VOCAB + 40)  # logits wider than the mask
        assert narrow.shape == (1, VOCAB + 40) and narrow[0].nonzero().flatten().tolist() == [1]


class TestCompilerAndHook:
    def test_the_cache_is_bounded_and_remembers_failures(self):
        """Past cache_size the least recently used grammar goes; a failure is refused without compiling."""
        compiler = _compiler(cache_size=2)
        a, b, c = (Constraint.regex(p) for p in ("a+", "b+", "c+"))
        for constraint in (a, b, a, c):
            anyio.run(compiler.compile, constraint)
        assert compiler.cached(a) and compiler.cached(c) and compiler.cached(b) is None
        assert compiler.stats.compiles == 3
        bad = Constraint.regex("(")
        for _ in range(2):
            with pytest.raises(InvalidRequest, match="valid regex"):
                anyio.run(compiler.compile, bad)
        assert compiler.stats.compile_failures == 1

    def test_the_hook_waits_for_a_cold_grammar_then_holds_one_matcher(self):
        """Admission with the grammar not compiled refuses for now (and compiles it in the background);
        once compiled it holds one matcher, counted in its pool, given back on release."""
        compiler = _compiler()
        hook = GrammarHook(compiler, TOKENIZER.decode, capacity=2, stats=GrammarStats())
        request = Request("r", [1, 2], SamplingParams(constraint=Constraint.regex("[a-z]+")))
        with pytest.raises(ResourceExhausted):
            hook.acquire(request, RequestState.PREFILLING)
        compiler.compile_in_background(request.params.constraint).result(timeout=30)
        handle = hook.acquire(request, RequestState.PREFILLING)
        assert hook.matchers.stats().free == 1
        request.handles["grammar"] = handle
        assert hook.check(request, ord("q")) is None
        verdict = hook.check(request, -1)
        assert verdict[0] is FinishReason.ERROR and "GrammarDeadEnd" in type(verdict[1]).__name__
        handle.mark_released()
        hook.release(request, handle)
        assert hook.matchers.stats().free == 2 and handle.payload.matcher is None

    def test_masks_cover_only_constrained_rows(self):
        compiler = _compiler()
        hook = GrammarHook(compiler, TOKENIZER.decode, capacity=4, stats=GrammarStats())
        masks = GrammarMasks(VOCAB, torch.device("cpu"))
        constrained = Request("c", [1], SamplingParams(constraint=Constraint.regex("z+")))
        free = Request("f", [1], SamplingParams())
        anyio.run(compiler.compile, constrained.params.constraint)
        constrained.handles["grammar"] = hook.acquire(constrained, RequestState.PREFILLING)
        cpu = torch.device("cpu")
        assert masks.begin([free], cpu, VOCAB) is None and masks.bitmask([free]) is None
        bits = masks.bitmask([free, constrained])
        assert bits[0].eq(-1).all() and int(bits[1].ne(0).sum()) == 1
        handle = constrained.handles.pop("grammar")
        handle.mark_released()
        hook.release(constrained, handle)
        assert attrs.asdict(hook.stats)["constrained"] == 1
