"""The mixture-of-experts FFN: a softmax router picks each token's top-k
gated experts, optionally with a sigmoid-gated shared expert (Qwen2-MoE).

Parameter names follow Qwen-MoE (``mlp.gate`` router,
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``); Mixtral checkpoints' ``block_sparse_moe.*.w1/w2/w3``
are renamed to these at load (`engine.model.checkpoint`).

The experts run without a host sync wherever the device allows it, so an
MoE step is one more CUDA-graph step and costs no sync per layer::

    grouped   the (token, expert) pairs sorted by expert, then one grouped
              matmul per projection over the experts' stacked weights
              (`torch.nn.functional.grouped_mm`; offsets stay on the device).
              CUDA: bf16 on Hopper/Blackwell; host: float32 and bf16.
    dense     every expert over every token (batched matmuls), weighted by the
              router's [T, E] weights, zero off the top-k: E / k times the
              routed multiply-adds, no sync. Used elsewhere for batches of at
              most `DENSE_MAX_ROWS` expert rows (decode batches).
    loop      one matmul per expert over its tokens; the per-expert counts are
              read on the host (one sync per layer). Only for large batches
              where neither of the above applies.

`pack()` (called by `LlamaModel.pack`) stacks each expert's gate/up and down
weights into ``[E, 2I, H]`` and ``[E, H, I]`` tensors and makes the
per-expert parameters views of them, so the state dict keeps its names and
no weight is held twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.layers import GatedMLP
from engine.model.model_config import ModelConfig

#: the dense path's limit: tokens x experts of one layer
DENSE_MAX_ROWS = 8192


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm")
    return fn(a, b, offs=offs)


#: (device type, dtype) -> whether this torch build runs a grouped matmul there
_GROUPED: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build has a grouped matmul for `dtype` on `device` (probed once, on a tiny
    problem, before any graph capture: older builds lack the host or float32 kernels)."""
    key = (device.type, dtype)
    if key not in _GROUPED:
        try:
            a = torch.zeros((4, 16), dtype=dtype, device=device)
            b = torch.zeros((2, 16, 16), dtype=dtype, device=device).transpose(1, 2)
            _grouped_mm(a, b, torch.tensor([1, 4], dtype=torch.int32, device=device))
            _GROUPED[key] = True
        except (AttributeError, RuntimeError, NotImplementedError):
            _GROUPED[key] = False
    return _GROUPED[key]


class MoEFeedForward(nn.Module):
    """Top-k mixture of gated experts.

    A token's output is the sum of its k highest-scoring experts' outputs,
    each weighted by its softmax router probability (renormalised over the k
    when `config.norm_topk_prob`; kept in float32 when
    `config.router_weights_float32`, else cast to the model's dtype first),
    plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` when the model
    has a shared expert.
    """

    gate_up_w: Tensor | None
    down_w: Tensor | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router_weights_float32 = config.router_weights_float32
        hidden, act, bias = config.hidden_size, config.hidden_act, config.mlp_bias
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, config.moe_intermediate_size, act=act, bias=bias) for _ in range(config.num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size, act=act, bias=bias)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        # set by `pack`: the experts' weights stacked, [E, 2I, H] (gate then up) and [E, H, I]
        self.register_buffer("gate_up_w", None, persistent=False)
        self.register_buffer("down_w", None, persistent=False)
        self._bias = bias

    # ------------------------------------------------------------- packing
    @torch.no_grad()
    def pack(self) -> None:
        """Stack the experts' weights (idempotent); each expert's weights become views."""
        if self.gate_up_w is not None or self._bias:
            return
        experts = [e for e in self.experts if isinstance(e, GatedMLP)]
        gate_up = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in experts])
        down = torch.stack([e.down_proj.weight for e in experts])
        inter = gate_up.shape[1] // 2
        for i, e in enumerate(experts):
            e.gate_proj.weight = nn.Parameter(gate_up[i, :inter], requires_grad=False)
            e.up_proj.weight = nn.Parameter(gate_up[i, inter:], requires_grad=False)
            e.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
        self.gate_up_w, self.down_w = gate_up, down

    # --------------------------------------------------------- path choice
    def path(self, rows: int, device: torch.device, dtype: torch.dtype) -> str:
        """"grouped", "dense" or "loop" for a layer input of `rows` tokens (see the module docstring)."""
        if self.gate_up_w is None:
            return "loop"
        if self._grouped_ok(device, dtype):
            return "grouped"
        if rows * len(self.experts) <= DENSE_MAX_ROWS:
            return "dense"
        return "loop"

    def sync_free(self, rows: int = 1) -> bool:
        """Whether a layer input of `rows` tokens (any, up to the largest decode batch) runs without a host sync."""
        w = self.gate_up_w
        return w is not None and self.path(rows, w.device, w.dtype) != "loop"

    def _grouped_ok(self, device: torch.device, dtype: torch.dtype) -> bool:
        assert self.gate_up_w is not None and self.down_w is not None
        size = torch.finfo(dtype).bits // 8
        if any(dim * size % 16 for dim in (self.gate_up_w.shape[1], self.gate_up_w.shape[2], self.down_w.shape[2])):
            return False  # the grouped matmul needs 16-byte aligned rows
        if device.type == "cuda":  # NOTE: elsewhere CUDA's grouped matmul reads its offsets on the host
            fast = dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
            return fast and grouped_mm_works(device, dtype)
        if device.type == "meta":
            return dtype == torch.bfloat16 and grouped_mm_works(device, dtype)
        return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and grouped_mm_works(device, dtype)

    # ------------------------------------------------------------- forward
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Returns the FFN output and the ``[T, top_k]`` routed expert ids."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.router_weights_float32:
            weights = weights.to(x.dtype)
        path = self.path(x.shape[0], x.device, x.dtype)
        if path == "grouped":
            out = self._grouped(x, weights, expert_ids)
        elif path == "dense":
            out = self._dense(x, weights, expert_ids)
        else:
            out = self._loop(x, weights, expert_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out, expert_ids

    def _act(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        first = self.experts[0]  # every expert has the model's activation
        assert isinstance(first, GatedMLP)
        return first.act(gate) * up

    def _grouped(self, x: Tensor, weights: Tensor, expert_ids: Tensor) -> Tensor:
        assert self.gate_up_w is not None and self.down_w is not None
        tokens, k = expert_ids.shape
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)
        # NOTE: counts by scatter_add, not bincount (sizes its output on the host) or one_hot (checks on it)
        counts = torch.zeros(len(self.experts), dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        rows = x.index_select(0, order // k)
        hidden = self._act(_grouped_mm(rows, self.gate_up_w.transpose(1, 2), offs))
        y = _grouped_mm(hidden, self.down_w.transpose(1, 2), offs)
        y = (y * weights.flatten().index_select(0, order)[:, None]).to(x.dtype)
        unsorted = torch.empty_like(y).index_copy_(0, order, y)  # deterministic: no atomic adds
        return unsorted.view(tokens, k, -1).sum(1)

    def _dense(self, x: Tensor, weights: Tensor, expert_ids: Tensor) -> Tensor:
        assert self.gate_up_w is not None and self.down_w is not None
        num_experts = len(self.experts)
        spread = torch.zeros((x.shape[0], num_experts), dtype=weights.dtype, device=x.device)
        spread.scatter_(1, expert_ids, weights)
        xs = x.unsqueeze(0).expand(num_experts, -1, -1)
        hidden = self._act(torch.bmm(xs, self.gate_up_w.transpose(1, 2)))
        y = torch.bmm(hidden, self.down_w.transpose(1, 2))  # [E, T, H]
        return (y * spread.t()[:, :, None]).to(x.dtype).sum(0)

    def _loop(self, x: Tensor, weights: Tensor, expert_ids: Tensor) -> Tensor:
        # Group the (token, slot) assignments by expert; one host sync for the counts.
        flat_experts = expert_ids.flatten()
        order = torch.argsort(flat_experts, stable=True)
        per_expert = torch.bincount(flat_experts, minlength=len(self.experts)).tolist()
        tokens_by_expert = (order // self.top_k).split(per_expert)
        weights_by_expert = weights.flatten()[order].split(per_expert)
        out = torch.zeros_like(x)
        for expert, token_idx, token_weights in zip(self.experts, tokens_by_expert, weights_by_expert, strict=True):
            if token_idx.numel():
                out.index_add_(0, token_idx, (expert(x[token_idx]) * token_weights[:, None]).to(out.dtype))
        return out
