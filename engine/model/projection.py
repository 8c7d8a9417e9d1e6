"""The model's projections as packed at load: one matmul per fused projection
(q/k/v, gate/up, o, down, the LM head), in one of two weight layouts.

- ``"packed"``: the weight stored transposed, ``[in, out]``, for `torch.mm`
  (which reads that layout up to twice as fast as `F.linear` reads
  ``[out, in]`` at small batch). The Hugging Face parameters are views into
  it, so no weight is held twice.
- ``"onednn"`` (CPU, float32 and bfloat16): also a copy of the weight in
  oneDNN's blocked layout, multiplied by ``torch.ops.mkldnn._linear_pointwise``
  (the kernel Inductor uses for packed linears on CPU). On the development
  machine (AMD EPYC, AVX-512) it runs the anchor model's 32,000 x 256 LM head
  2.6x faster than `torch.mm` at batch 8 to 128 and 1.6x faster at batch 1, and
  bfloat16 projections 3-8x faster; it costs a second copy of each weight.
  A single token through a small float32 matrix (under `SMALL_BYTES`) still
  takes `torch.mm`: oneDNN's fixed cost per call is about 10 us there.
  oneDNN builds and caches a primitive per input shape, each holding memory
  of its own (about 0.3x the weight's size on the development machine, up to
  1,024 shapes), so the rows are padded to their size class
  (`resources.paging.size_class`: at most a quarter of padding): a server
  whose batches take every size from 1 to 4,096 rows builds about 45
  primitives per projection, not 4,096 (a soak grew 300 MiB without this).

``"auto"`` (the default) is ``"onednn"`` where it applies (CPU, float32 or
bfloat16, PyTorch built with oneDNN) and ``"packed"`` elsewhere.

NOTE: the blocked copy is not a parameter: `LlamaModel` refreshes it after
``load_state_dict`` (a load-state-dict post hook), so loading new weights
into a packed model changes what it computes, as with the packed layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from resources.paging import size_class

#: accepted values of `EngineConfig.weight_layout` and `LlamaModel.pack(layout=...)`
WEIGHT_LAYOUTS = ("auto", "packed", "onednn")

#: float32 weights below this many bytes take `torch.mm` for steps of at most two tokens
SMALL_BYTES = 2 << 20

_BLOCKED_DTYPES = (torch.float32, torch.bfloat16)


def onednn_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the oneDNN blocked layout can be used for weights of `dtype` on `device`."""
    return (device.type == "cpu" and dtype in _BLOCKED_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def resolve_layout(layout: str, device: torch.device, dtype: torch.dtype) -> str:
    """The layout `layout` means for weights of `dtype` on `device`; ValueError
    for an unknown name or ``"onednn"`` where it does not apply."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}")
    applies = onednn_applies(device, dtype)
    if layout == "onednn" and not applies:
        raise ValueError(f"the onednn weight layout needs a CPU float32 or bfloat16 model and PyTorch with oneDNN, "
                         f"got {dtype} on {device}")
    if layout == "auto":
        return "onednn" if applies else "packed"
    return layout


class Projection:
    """``x @ weight_t (+ bias)`` for ``x`` ``[T, in]``: `weight_t` is the packed
    ``[in, out]`` tensor, `blocked` its oneDNN copy (None: `torch.mm` always)."""

    __slots__ = ("weight_t", "bias", "blocked", "mm_tokens")

    def __init__(self, weight_t: Tensor, bias: Tensor | None, layout: str) -> None:
        self.weight_t, self.bias = weight_t, bias
        self.blocked: Tensor | None = None
        #: steps of at most this many tokens take torch.mm even with a blocked copy
        small = weight_t.dtype == torch.float32 and weight_t.numel() * weight_t.element_size() < SMALL_BYTES
        self.mm_tokens = 2 if small else 0
        if layout == "onednn":
            self.refresh()

    @classmethod
    def blocked_only(cls, weight_t: Tensor) -> Projection:
        """A oneDNN projection that keeps only the blocked copy of `weight_t` (not float32: it
        never takes `torch.mm`), so the ``[in, out]`` tensor can be a temporary."""
        if weight_t.dtype == torch.float32:
            raise ValueError("a float32 projection keeps its [in, out] weight for small steps")
        projection = cls(weight_t, None, "onednn")
        projection.weight_t = weight_t.new_empty((weight_t.shape[0], 0))
        return projection

    def refresh(self) -> None:
        """Rebuild the blocked copy from `weight_t` (after its values changed)."""
        # NOTE: the batch-size hint only tunes the blocking; 8 measured as fast as 128 at every batch
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(self.weight_t.t().contiguous(), 8)

    def __call__(self, x: Tensor) -> Tensor:
        blocked, bias = self.blocked, self.bias
        rows = x.shape[0]
        if blocked is not None and rows > self.mm_tokens:
            padded = size_class(rows)
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            out = torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")
            return out if padded == rows else out[:rows]
        return torch.mm(x, self.weight_t) if bias is None else torch.addmm(bias, x, self.weight_t)


def pack_linears(linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """The linears' weights stacked and transposed, ``[in, sum of out]``, and
    their biases stacked (None without); each weight and bias becomes a view."""
    packed = torch.cat([m.weight for m in linears]).t().contiguous()
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = nn.Parameter(packed[:, start:end].t(), requires_grad=m.weight.requires_grad)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=m.bias.requires_grad)
        start = end
    return packed, bias
