"""The small building blocks of a decoder layer: RMSNorm (Llama's, or
Gemma's ``1 + weight`` variant) and the gated MLP (SwiGLU, or Gemma's
tanh-GELU GeGLU).

Both follow transformers' arithmetic order, so a float16/bfloat16 model rounds
where transformers rounds. The norm is torch's own `F.rms_norm` (one fused
kernel on CUDA; on CPU the same float32 arithmetic as transformers', bit for
bit), and `RMSNorm.add_norm` adds the residual in place before normalising;
with kvlife's native kernels installed (`engine.model.native_kernels`), a
float32 norm and its residual add are one native call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from engine.model.native_kernels import NativeKernels

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32.

    Llama: normalise in float32, cast back, then scale by `weight`.
    Gemma (`gemma=True`): scale by ``1 + weight`` in float32, then cast back.
    """

    #: kvlife's native kernels (`engine.model.loading.install_native_kernels`): float32 rows in one call,
    #: the residual add included, when no gradient is recorded
    native: NativeKernels | None = None

    def __init__(self, size: int, eps: float, *, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if gemma else torch.ones(size))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: Tensor) -> Tensor:
        native = self.native
        if native is not None and native.takes_norm(x) and not torch.is_grad_enabled():
            return native.rms_norm(x, self.weight, self.eps)
        shape = (x.shape[-1],)
        if self.gemma:
            return (F.rms_norm(x.float(), shape, None, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # NOTE: transformers rounds the normalised value to the model's dtype before scaling
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)

    def add_norm(self, residual: Tensor, update: Tensor) -> Tensor:
        """``residual += update`` in place, then the norm of the sum (the
        residual stream's step between two sublayers)."""
        native = self.native
        if native is not None and native.takes_norm(residual, update) and not torch.is_grad_enabled():
            return native.rms_norm(residual, self.weight, self.eps, update)
        return self(residual.add_(update))

    def reference(self, x: Tensor) -> Tensor:
        """The norm as transformers writes it, op by op (the tests' reference)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; `act` is "silu" (SwiGLU) or
    "gelu_pytorch_tanh" (GeGLU)."""

    #: SwiGLU's activation and product by kvlife's native kernel (`engine.model.loading.install_native_kernels`)
    native: NativeKernels | None = None

    def __init__(self, hidden_size: int, intermediate_size: int, *, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def act_mul_(self, both: Tensor) -> Tensor:
        """``act(gate) * up`` in place on the packed gate/up output `both` ``[T, 2 * width]``
        (`LlamaModel.pack`); returns the gate half, a view holding the product."""
        native = self.native
        if native is not None and self.act is F.silu and native.takes_silu(both) and not torch.is_grad_enabled():
            return native.silu_mul_(both)
        width = both.shape[-1] // 2
        gate, up = both[:, :width], both[:, width:]  # NOTE: slices, not chunk(): views that may be written in place
        hidden = F.silu(gate, inplace=True) if self.act is F.silu else self.act(gate)
        return hidden.mul_(up)
