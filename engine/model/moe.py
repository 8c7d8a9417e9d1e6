"""The mixture-of-experts FFN: a softmax router picks each token's top-k
gated experts, optionally with a sigmoid-gated shared expert (Qwen2-MoE).

Parameter names follow Qwen-MoE (``mlp.gate`` router,
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate``); Mixtral checkpoints' ``block_sparse_moe.*.w1/w2/w3``
are renamed to these at load (`engine.model.checkpoint`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model.layers import GatedMLP
from engine.model.model_config import ModelConfig


class MoEFeedForward(nn.Module):
    """Top-k mixture of gated experts.

    A token's output is the sum of its k highest-scoring experts' outputs,
    each weighted by its softmax router probability (renormalised over the k
    when `config.norm_topk_prob`; kept in float32 when
    `config.router_weights_float32`, else cast to the model's dtype first),
    plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` when the model
    has a shared expert.
    """

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

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Returns the FFN output and the ``[T, top_k]`` routed expert ids."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.router_weights_float32:
            weights = weights.to(x.dtype)
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
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out, expert_ids
