"""The verified greedy head (`engine.model.greedy_head`): a bfloat16 copy of the
LM head whose candidates are rescored in float32 gives the float32 head's
argmax, near-ties below bfloat16's resolution included; it declines what its
bound cannot settle, and the engine then takes the float32 head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineConfig, InvalidConfig, SamplingParams
from engine.model import greedy_head
from engine.model.greedy_head import VerifiedGreedyHead, verified_head_applies
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.native_kernels import kernel_problem, load_kernels
from engine.model.projection import Projection
from engine.model.sampling import argmax_rows
from helpers import small_config


def _head(hidden: int, vocab: int, seed: int) -> torch.Tensor:
    """A packed LM head ``[hidden, vocab]`` as random checkpoints have it (std 0.02)."""
    return torch.randn(hidden, vocab, generator=torch.Generator().manual_seed(seed)) * 0.02


def _rows(n: int, hidden: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Final-normed hidden states (RMSNorm with a weight of `scale`)."""
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))
    return F.rms_norm(x, (hidden,)) * scale


def _float32_argmax(head_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The float32 head's greedy ids, as the engine computes them (oneDNN blocked, blocked argmax)."""
    return argmax_rows(Projection(head_t, None, "onednn")(x))


def _verified(head_t: torch.Tensor, form: str) -> VerifiedGreedyHead:
    """The verified head with its search in torch's ops, or in kvlife's native kernel."""
    head = VerifiedGreedyHead(head_t)
    if form == "native":
        head.native = load_kernels()
        assert head.native is not None, kernel_problem()
    return head


FORMS = ["torch", "native"]


def test_it_applies_on_this_machine():
    """The CPU this suite runs on multiplies bfloat16 natively, so "auto" takes the verified head."""
    assert verified_head_applies(_head(16, 64, 0), "onednn")
    assert not verified_head_applies(_head(16, 64, 0), "packed")
    assert not verified_head_applies(_head(16, 64, 0).double(), "onednn")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("hidden, vocab, scale", [(256, 32000, 1.0), (64, 1000 + 37, 1.0), (256, 32000, 40.0),
                                                  (128, 5000, 0.05), (96, 129, 1.0), (32, 100, 1.0)])
def test_ids_equal_the_float32_head(hidden, vocab, scale, form):
    """Every row's id equals the float32 head's, at every batch size, vocabularies off the block size (and
    under one block) included, whether the search runs in torch's ops or the native kernel."""
    head_t = _head(hidden, vocab, 1)
    verified = _verified(head_t, form)
    for rows in (1, 3, 8, 33, 128):
        x = _rows(rows, hidden, rows, scale)
        ids = verified.argmax(x)
        assert ids is not None, f"declined {rows} rows"
        assert torch.equal(ids, _float32_argmax(head_t, x))
    assert verified.served == 5 and verified.declined == 0


@pytest.mark.parametrize("form", FORMS)
def test_near_ties_below_bfloat16_resolution_are_settled_in_float32(form):
    """Each row's winning column has a copy scaled by (1 - 1e-3) placed before it: bfloat16 cannot tell
    the two apart (its argmax picks the copy, which is wrong), the verified head picks the original."""
    hidden, vocab, rows = 128, 4096, 16
    head_t = _head(hidden, vocab, 2)
    x = _rows(rows, hidden, 3)
    winners = _float32_argmax(head_t, x)
    for row in range(rows):  # the copy goes to a free column below the winner, in the same block or not
        original = int(winners[row])
        spot = max(0, original - 1 - 7 * row)
        if spot in winners.tolist() or spot == original:
            continue
        head_t[:, spot] = head_t[:, original] * (1 - 1e-3)
    truth = _float32_argmax(head_t, x)
    bfloat16_only = (x.bfloat16() @ head_t.bfloat16()).float().argmax(dim=-1)
    assert int((bfloat16_only != truth).sum()) >= rows // 4, "the test lost its near-ties"
    ids = _verified(head_t, form).argmax(x)
    assert ids is not None and torch.equal(ids, truth)


@pytest.mark.parametrize("form", FORMS)
def test_it_declines_what_its_bound_cannot_settle(form):
    """A row with NaN, a row with infinity, and a head whose columns all tie, are left to the float32
    head (None)."""
    head_t = _head(64, 2048, 4)
    verified = _verified(head_t, form)
    x = _rows(4, 64, 5)
    x[2, 7] = float("nan")
    assert verified.argmax(x) is None
    x = _rows(4, 64, 5)
    x[1, 3] = float("inf")
    assert verified.argmax(x) is None
    flat = _verified(head_t[:, :1].expand(64, 2048).contiguous(), form)
    assert flat.argmax(_rows(4, 64, 6)) is None
    assert verified.declined == 2 and flat.declined == 1 and verified.served == 0


def test_a_state_dict_load_refreshes_it():
    """load_state_dict into a packed model: the verified head answers for the new weights."""
    model = LlamaModel.from_seed(ModelConfig.tiny(), seed=1)
    model.pack("onednn")
    model.use_verified_head("verified")
    other = LlamaModel.from_seed(ModelConfig.tiny(), seed=9)
    model.load_state_dict(other.state_dict())
    x = _rows(8, ModelConfig.tiny().hidden_size, 7)
    assert model.verified_head is not None
    with torch.inference_mode():
        ids = model.verified_head.argmax(x)
        assert ids is not None and torch.equal(ids, argmax_rows(model.logits(x)))


def test_the_mode_is_checked():
    """An unknown mode, and "verified" where it cannot apply, fail naming the field; "full" turns it off."""
    with pytest.raises(InvalidConfig, match="greedy_head"):
        EngineConfig(greedy_head="fast")
    model = LlamaModel.from_seed(ModelConfig.tiny(), seed=1)
    model.pack("packed")
    with pytest.raises(ValueError, match="onednn"):
        model.use_verified_head("verified")
    model.use_verified_head("auto")
    assert model.verified_head is None


def test_auto_leaves_a_small_head_to_float32():
    """"auto" takes the verified head for a head of at least AUTO_MIN_BYTES only (below it the float32
    head stays in cache and is faster); "verified" takes it for any head it applies to."""
    small = LlamaModel.from_seed(ModelConfig.tiny(), seed=1)  # a 264 x 256 head
    small.pack("onednn")
    small.use_verified_head("auto")
    assert small.verified_head is None
    small.use_verified_head("verified")
    assert small.verified_head is not None
    large = LlamaModel.from_seed(ModelConfig.tiny(vocab_size=greedy_head.AUTO_MIN_BYTES // (4 * 256)), seed=1)
    large.pack("onednn")
    large.use_verified_head("auto")
    assert large.verified_head is not None


@pytest.mark.anyio
async def test_engine_ids_equal_with_and_without_it():
    """Greedy rows, a row that asks for logprobs and a sampled row, with the verified head and with "full":
    the same ids; the verified head served the all-greedy steps."""
    prompts = [[7, 8, 9, 10], list(range(30, 55)), [3]]
    outputs, heads = [], []
    for mode, native in (("full", "auto"), ("verified", "auto"), ("verified", "off")):
        async with Engine(small_config(greedy_head=mode, native_kernels=native)) as engine:
            greedy = [await engine.complete(p, SamplingParams(max_new_tokens=12)) for p in prompts]
            mixed = [engine.complete(prompts[0], SamplingParams(max_new_tokens=6, logprobs=2)),
                     engine.complete(prompts[1], SamplingParams(max_new_tokens=6, temperature=0.8, seed=5))]
            outputs.append([f.token_ids for f in greedy] + [(await m).token_ids for m in mixed])
            heads.append(engine.parts.model.verified_head)
    assert outputs[0] == outputs[1] == outputs[2]
    assert heads[0] is None and all(h is not None and h.served >= 12 and h.declined == 0 for h in heads[1:])
    assert heads[1].native is not None and heads[2].native is None  # the kernel's search, then torch's


@pytest.mark.anyio
async def test_engine_takes_the_float32_head_when_it_declines(monkeypatch):
    """Fault: the bound admits no step (no candidate blocks allowed): every step falls back, ids unchanged."""
    prompt = list(range(40, 60))
    async with Engine(small_config(greedy_head="full")) as engine:
        expected = (await engine.complete(prompt, SamplingParams(max_new_tokens=10))).token_ids
    monkeypatch.setattr(greedy_head, "MAX_BLOCKS_PER_ROW", 0)
    async with Engine(small_config(greedy_head="verified")) as engine:
        assert (await engine.complete(prompt, SamplingParams(max_new_tokens=10))).token_ids == expected
        head = engine.parts.model.verified_head
        assert head.served == 0 and head.declined >= 9


def test_a_blocked_only_projection_keeps_no_plain_copy():
    """`Projection.blocked_only` multiplies like the plain bfloat16 matmul and keeps no [in, out] tensor;
    float32 is refused (its small steps take torch.mm on that tensor)."""
    weight_t = _head(64, 300, 8).bfloat16()
    projection = Projection.blocked_only(weight_t)
    x = _rows(5, 64, 9).bfloat16()
    assert projection.weight_t.numel() == 0
    assert torch.allclose(projection(x).float(), (x @ weight_t).float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="float32"):
        Projection.blocked_only(weight_t.float())
