"""The Llama-family decoder: RMSNorm (`engine.model.layers`), RoPE with its
scalings (`engine.model.rope`), grouped-query attention through an
`AttentionBackend` (optionally with Qwen3's q/k norm), a gated MLP or a top-k
mixture-of-experts FFN (`engine.model.moe`), and an optional tiny vision
projector that turns image patches into embeddings. One class runs every
supported family (Llama, Mistral, Qwen2, Qwen3, Gemma, Mixtral, Qwen2-MoE,
Qwen3-MoE); `ModelConfig` says which parts a family uses.

Module and parameter names mirror Hugging Face's (``model.layers.{i}.
self_attn.q_proj.weight`` ...), so a checkpoint's state dict loads as is;
the MoE FFN follows Qwen-MoE names and the vision projector is
``vision_projector.proj``.

The model is stateless between calls: a forward given a `routing` list
appends to it, per MoE layer in order, the ``[T, top_k]`` expert ids each
token was routed to (nothing for a dense model). NOTE: the list belongs to
the caller, so two threads running forwards of one model (the decode loop
and an in-process prefill worker) never see each other's routing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.attention import AttentionBackend
from engine.model.greedy_head import AUTO_MIN_BYTES, GREEDY_HEADS, VerifiedGreedyHead, verified_head_applies
from engine.model.layers import GatedMLP, RMSNorm
from engine.model.model_config import ModelConfig
from engine.model.moe import MoEFeedForward
from engine.model.projection import Projection, pack_linears, resolve_layout
from engine.model.rope import RotaryEmbedding, apply_rope, apply_rope_
from engine.model.vision import VisionProjector

if TYPE_CHECKING:
    from engine.model.native_kernels import NativeKernels

__all__ = ["LlamaModel", "apply_rope"]


class SelfAttention(nn.Module):
    """q/k/v/o projections (biases as the config says), optional per-head
    q/k RMSNorm before RoPE (Qwen3), attention through the backend."""

    qkv_t: Tensor | None
    qkv_bias: Tensor | None
    o_t: Tensor | None
    #: set by `LlamaModel.pack`: the fused q/k/v projection and o_proj
    qkv: Projection | None = None
    o: Projection | None = None
    #: RoPE by kvlife's native kernel in the fused path (`engine.model.loading.install_native_kernels`)
    native: NativeKernels | None = None

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # set by `LlamaModel.pack`: q/k/v stacked [in, q + k + v], their bias, o_proj [in, out]
        self.register_buffer("qkv_t", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("o_t", None, persistent=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> Tensor:
        """The reference: transformers' ops in its order, on the Hugging Face parameters."""
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.reference(q), self.k_norm.reference(k)
        out = attention.attend(self.layer_id, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def fused(self, x: Tensor, rope: Tensor, attention: AttentionBackend) -> Tensor:
        """`forward` on the packed weights: one matmul for q/k/v, RoPE in place on
        q and k together from the table rows `rope`, one matmul for o."""
        tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv_proj, o_proj = self.qkv, self.o
        assert qkv_proj is not None and o_proj is not None  # `LlamaModel.pack` sets both
        qkv = qkv_proj(x).view(tokens, heads + 2 * kv_heads, self.head_dim)
        native = self.native if not torch.is_grad_enabled() else None  # NOTE: in place, outside autograd
        rotate = native.rope_ if native is not None and native.takes_rope(qkv, rope) else apply_rope_
        if self.q_norm is not None and self.k_norm is not None:
            q = rotate(self.q_norm(qkv[:, :heads]), rope)
            k = rotate(self.k_norm(qkv[:, heads : heads + kv_heads]), rope)
        else:
            rotate(qkv[:, : heads + kv_heads], rope)
            q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
        out = attention.attend(self.layer_id, q, k, qkv[:, heads + kv_heads :])
        return o_proj(out.reshape(tokens, heads * self.head_dim))


class DecoderLayer(nn.Module):
    gate_up_t: Tensor | None
    gate_up_bias: Tensor | None
    down_t: Tensor | None
    #: set by `LlamaModel.pack` (dense MLP only): the fused gate/up projection and down_proj
    gate_up: Projection | None = None
    down: Projection | None = None

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        gemma, eps = config.gemma_norm, config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, gemma=gemma)
        self.self_attn = SelfAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, gemma=gemma)
        self.mlp: GatedMLP | MoEFeedForward = (
            MoEFeedForward(config)
            if config.is_moe
            else GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act, bias=config.mlp_bias)
        )
        # set by `LlamaModel.pack` (dense MLP only): gate/up stacked [in, 2 * intermediate], their bias, down [in, out]
        self.register_buffer("gate_up_t", None, persistent=False)
        self.register_buffer("gate_up_bias", None, persistent=False)
        self.register_buffer("down_t", None, persistent=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend) -> tuple[Tensor, Tensor | None]:
        """The reference: transformers' ops in its order, on the Hugging Face parameters."""
        x = x + self.self_attn(self.input_layernorm.reference(x), cos, sin, attention)
        normed = self.post_attention_layernorm.reference(x)
        if isinstance(self.mlp, MoEFeedForward):
            ffn_out, routing = self.mlp(normed)
            return x + ffn_out, routing
        return x + self.mlp(normed), None

    def fused(self, residual: Tensor, normed: Tensor, next_norm: RMSNorm | None, rope: Tensor,
              attention: AttentionBackend) -> tuple[Tensor | None, Tensor | None]:
        """The layer on the packed weights, with the residual stream updated in
        place: `normed` is this layer's input norm of `residual`; returns
        `next_norm` of the updated residual (the next layer's input norm; None
        for the last layer, whose caller norms only the rows it needs) and the
        MoE routing (None for a dense layer)."""
        normed = self.post_attention_layernorm.add_norm(residual, self.self_attn.fused(normed, rope, attention))
        routing = None
        if isinstance(self.mlp, MoEFeedForward):
            ffn_out, routing = self.mlp(normed)
        else:
            ffn_out = self._fused_mlp(normed)
        if next_norm is None:
            residual.add_(ffn_out)
            return None, routing
        return next_norm.add_norm(residual, ffn_out), routing

    def _fused_mlp(self, x: Tensor) -> Tensor:
        """`GatedMLP.forward` on the packed weights: one matmul for gate and up, the
        activation and the product in place."""
        mlp, gate_up, down = self.mlp, self.gate_up, self.down
        assert isinstance(mlp, GatedMLP) and gate_up is not None and down is not None  # `pack` sets them
        return down(mlp.act_mul_(gate_up(x)))


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (Hugging Face's ``model.``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, gemma=config.gemma_norm)


class LlamaModel(nn.Module):
    """A Llama-family causal LM whose attention is delegated per layer to an
    `AttentionBackend` (paged for the engine, dense for the oracle)."""

    head_t: Tensor | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.vision_projector = None if config.vision is None else VisionProjector(config.vision, config.hidden_size)
        self.register_buffer("head_t", None, persistent=False)  # set by `pack`: the LM head [hidden, vocab]
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)
        #: the layout `pack` chose (`engine.model.projection`); None: not packed, every forward is the reference
        self.weight_layout: str | None = None
        self._head: Projection | None = None
        #: set by `pack` where it applies: greedy tokens through a verified bfloat16 head (`engine.model.greedy_head`)
        self.verified_head: VerifiedGreedyHead | None = None
        self._projections: list[Projection] = []
        self._layers: list[DecoderLayer] = []
        self.register_load_state_dict_post_hook(_refresh_blocked)

    @classmethod
    def from_seed(cls, config: ModelConfig, seed: int = 0, *, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> LlamaModel:
        """Random weights that depend only on `config` and `seed`: drawn on
        the CPU in float32 from a seeded generator, then moved to `device`
        (default CPU) and cast to `dtype` (default `config.dtype`).

        Embeddings have unit variance and every linear layer
        ``1 / sqrt(fan_in)``, so residual updates are as large as the residual
        and greedy decoding depends on context instead of settling into one
        repeated token.
        """
        generator = torch.Generator(device="cpu").manual_seed(seed)
        with torch.device("cpu"):
            model = cls(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith("bias"):
                    param.normal_(0.0, 0.02, generator=generator)
                elif name == "model.embed_tokens.weight":
                    param.normal_(0.0, 1.0, generator=generator)
                else:
                    param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
        return model.to(device=device, dtype=dtype or config.torch_dtype).eval()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def num_image_tokens(self, image: Tensor) -> int:
        """Placeholder tokens `image` takes in a prompt; ValueError if the
        model has no vision projector or the image is unacceptable."""
        if self.vision_projector is None:
            raise ValueError("this model has no vision projector")
        return self.vision_projector.num_image_tokens(image)

    def embed_with_images(self, input_ids: Tensor, images: list[Tensor]) -> Tensor:
        """Token embeddings ``[L, hidden]`` of `input_ids` ``[L]`` with the
        image placeholder positions replaced, in order, by the patches of
        `images`. ValueError if the placeholder count differs from the total
        patch count."""
        num_patches = sum(self.num_image_tokens(image) for image in images)
        image_token_id = self.config.image_token_id  # None only without a vision projector (and so images)
        placeholders = (input_ids[:0] if image_token_id is None
                        else (input_ids == image_token_id).nonzero(as_tuple=True)[0])
        if placeholders.numel() != num_patches:
            raise ValueError(f"{placeholders.numel()} image placeholder tokens for {num_patches} image patches")
        embeds = self.model.embed_tokens(input_ids)
        if num_patches:
            assert self.vision_projector is not None
            patches = torch.cat([self.vision_projector(image) for image in images])
            embeds[placeholders] = patches.to(embeds.dtype)
        return embeds

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attention: AttentionBackend,
        input_embeds: Tensor | None = None,
        *,
        output_rows: Tensor | None = None,
        routing: list[Tensor] | None = None,
        apply_head: bool = True,
    ) -> Tensor:
        """Float32 logits ``[T, vocab]`` for the step's T tokens (only the
        `output_rows` of them, in that order, when given).

        `input_ids` and `positions` are LongTensors ``[T]``; `input_embeds`
        ``[T, hidden]``, when given, replaces the embedding lookup. Also
        appends each MoE layer's routed expert ids to `routing` when given.
        With `apply_head` False: the final-normed hidden states instead of
        the logits (for `verified_head`, or `logits` after it declined).
        """
        hidden = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds.to(self.dtype)
        if self.config.scale_embeddings:
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        if self.weight_layout is not None:
            normed = self._fused_forward(hidden, positions, attention, input_embeds, output_rows, routing)
            return self.logits(normed) if apply_head else normed
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer in self.model.layers:
            hidden, layer_routing = layer(hidden, cos, sin, attention)
            if layer_routing is not None and routing is not None:
                routing.append(layer_routing)
        if output_rows is not None:
            hidden = hidden[output_rows]
        hidden = self.model.norm.reference(hidden)
        if not apply_head:
            return hidden
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, head).float()

    def _fused_forward(self, hidden: Tensor, positions: Tensor, attention: AttentionBackend,
                       input_embeds: Tensor | None, output_rows: Tensor | None,
                       routing: list[Tensor] | None) -> Tensor:
        """`forward` on the packed weights: the residual stream updated in place,
        each norm fused with the residual add before it, RoPE rows looked up once."""
        if input_embeds is not None and hidden is input_embeds:
            hidden = hidden.clone()  # NOTE: the residual stream is written in place; never the caller's tensor
        rope = self.rotary.lookup(positions, hidden.dtype)
        layers = self._layers
        normed: Tensor | None = layers[0].input_layernorm(hidden)
        for i, layer in enumerate(layers):
            assert normed is not None
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            normed, layer_routing = layer.fused(hidden, normed, next_norm, rope, attention)
            if layer_routing is not None and routing is not None:
                routing.append(layer_routing)
        if output_rows is not None:
            hidden = hidden.index_select(0, output_rows)
        return self.model.norm(hidden)

    def logits(self, normed: Tensor) -> Tensor:
        """Float32 logits of final-normed hidden states (`forward` with `apply_head` False)."""
        if self._head is None:  # not packed: the reference head
            head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            return F.linear(normed, head).float()
        logits = self._head(normed)
        return logits if logits.dtype == torch.float32 else logits.float()

    @torch.no_grad()
    def pack(self, layout: str = "auto") -> None:
        """Pack the weights for fast steps, once, in place: the first call
        decides, later calls change nothing. From then on `forward` takes the
        fused path (`DecoderLayer.fused`); before it, the reference path.

        Each layer's q/k/v projections and its dense MLP's gate/up are stacked
        into one matrix, and every projection and the untied LM head are stored
        transposed, ``[in, out]``: at small batch ``torch.mm`` reads that layout
        up to twice as fast as `F.linear` reads ``[out, in]``. The Hugging Face
        parameters become views into the packed tensors, so the state dict
        keeps its names and shapes, loading into it updates the packed tensors,
        and no weight is held twice. `layout` ("auto", "packed", "onednn":
        `engine.model.projection`) may add a oneDNN blocked copy of each.
        Call it with the model on its final device.
        """
        if self.weight_layout is not None:
            return
        layout = resolve_layout(layout, self.device, self.dtype)
        projections: list[Projection] = []

        def projection(weight_t: Tensor, bias: Tensor | None) -> Projection:
            projections.append(Projection(weight_t, bias, layout))
            return projections[-1]

        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            attn = layer.self_attn
            attn.qkv_t, attn.qkv_bias = pack_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            attn.o_t, _ = pack_linears([attn.o_proj])
            attn.qkv, attn.o = projection(attn.qkv_t, attn.qkv_bias), projection(attn.o_t, attn.o_proj.bias)
            if isinstance(layer.mlp, GatedMLP):
                layer.gate_up_t, layer.gate_up_bias = pack_linears([layer.mlp.gate_proj, layer.mlp.up_proj])
                layer.down_t, _ = pack_linears([layer.mlp.down_proj])
                layer.gate_up = projection(layer.gate_up_t, layer.gate_up_bias)
                layer.down = projection(layer.down_t, layer.mlp.down_proj.bias)
            elif isinstance(layer.mlp, MoEFeedForward):
                layer.mlp.pack()  # the experts' weights stacked (engine.model.moe)
        if self.lm_head is not None:
            self.head_t, _ = pack_linears([self.lm_head])
            self._head = projection(self.head_t, None)
        else:  # tied: the embedding's own storage, read transposed
            self._head = projection(self.model.embed_tokens.weight.t(), None)
        self._projections = projections
        self._layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        self.weight_layout = layout

    def use_verified_head(self, mode: str = "auto") -> None:
        """After `pack`: take greedy steps' tokens from a verified bfloat16 copy of the LM
        head (`engine.model.greedy_head`): "auto" where it applies to a head of at least
        `AUTO_MIN_BYTES`, "verified" (ValueError where it does not apply), "full" never."""
        if mode not in GREEDY_HEADS:
            raise ValueError(f"greedy head must be one of {GREEDY_HEADS}, got {mode!r}")
        head = self._head
        applies = head is not None and verified_head_applies(head.weight_t, self.weight_layout or "")
        if mode == "verified" and not applies:
            raise ValueError("the verified greedy head needs a CPU float32 model in the onednn weight layout "
                             "and oneDNN with native bfloat16 matmuls")
        large = head is not None and head.weight_t.numel() * head.weight_t.element_size() >= AUTO_MIN_BYTES
        use = head is not None and applies and (mode == "verified" or (mode == "auto" and large))
        self.verified_head = VerifiedGreedyHead(head.weight_t) if use and head is not None else None


def _refresh_blocked(module: nn.Module, incompatible_keys: object) -> None:
    """After `load_state_dict` into a packed model: rebuild each oneDNN blocked copy."""
    assert isinstance(module, LlamaModel)
    for projection in module._projections:
        if projection.blocked is not None:
            projection.refresh()
    if module.verified_head is not None:
        module.verified_head.refresh()
