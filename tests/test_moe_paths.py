"""MoE experts without a host sync: the grouped and dense paths compute what the
per-expert loop computes, on the meta device none of them reads the host, and
`sync_free` says which model a CUDA graph can capture."""

from __future__ import annotations

import pytest
import torch

from engine.model.model_config import ModelConfig
from engine.model.moe import DENSE_MAX_ROWS, MoEFeedForward


def _moe(**overrides) -> MoEFeedForward:
    torch.manual_seed(0)
    moe = MoEFeedForward(ModelConfig.tiny_moe(**overrides)).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    moe.pack()
    return moe


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": True}, {"shared_expert_intermediate_size": 128}],
                         ids=["plain", "renormalised", "shared-expert"])
def test_grouped_and_dense_equal_the_loop(overrides, monkeypatch):
    """For 1, 7 and 40 tokens the three paths give the same output (1e-5) and the same routing."""
    moe = _moe(**overrides)
    for tokens in (1, 7, 40):
        x = torch.randn(tokens, moe.gate.in_features, generator=torch.Generator().manual_seed(tokens))
        outs = {}
        for path in ("loop", "grouped", "dense"):
            monkeypatch.setattr(MoEFeedForward, "path", lambda self, rows, device, dtype, p=path: p)
            with torch.inference_mode():
                outs[path] = moe(x)
        for path in ("grouped", "dense"):
            torch.testing.assert_close(outs[path][0], outs["loop"][0], atol=1e-5, rtol=1e-5)
            assert torch.equal(outs[path][1], outs["loop"][1])


def test_pack_keeps_names_and_views():
    """Packing stacks the experts' weights; the per-expert parameters are views with their old values."""
    torch.manual_seed(0)
    plain = MoEFeedForward(ModelConfig.tiny_moe())
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    plain.pack()
    after = plain.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    assert plain.experts[3].up_proj.weight.untyped_storage().data_ptr() == plain.gate_up_w.untyped_storage().data_ptr()


def test_path_choice():
    """Host float32: grouped; a dtype without the grouped kernel's alignment: dense for small batches, the
    loop (which syncs) beyond DENSE_MAX_ROWS; unpacked: the loop."""
    moe = _moe()
    cpu = torch.device("cpu")
    assert moe.path(8, cpu, torch.float32) == "grouped" and moe.sync_free(64)
    odd = _moe(moe_intermediate_size=250)  # 250 * 4 bytes is no multiple of 16
    assert odd.path(8, cpu, torch.float32) == "dense"
    assert odd.path(DENSE_MAX_ROWS, cpu, torch.float32) == "loop" and not odd.sync_free(DENSE_MAX_ROWS)
    assert MoEFeedForward(ModelConfig.tiny_moe()).path(1, cpu, torch.float32) == "loop"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-grouped", "fp32-dense"])
def test_sync_free_paths_read_nothing_on_meta(dtype):
    """On meta (which refuses host reads, as a sync would need) both sync-free paths run."""
    moe = _moe().to(device="meta", dtype=dtype)
    moe.gate_up_w, moe.down_w = moe.gate_up_w.to("meta", dtype), moe.down_w.to("meta", dtype)
    out, routing = moe(torch.zeros(5, moe.gate.in_features, device="meta", dtype=dtype))
    assert out.shape == (5, moe.gate.in_features) and routing.shape == (5, moe.top_k)
