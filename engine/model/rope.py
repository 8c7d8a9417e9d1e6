"""Rotary position embeddings: the inverse frequencies of each supported
scaling (none, linear, dynamic, llama3, yarn) and the rotation itself, in
Hugging Face's "rotate_half" convention.

Each scaling computes its inverse frequencies the way transformers does
(float32, the same formulas), so a checkpoint's positions mean what they mean
to transformers.

NOTE: dynamic NTK scaling changes the frequencies only once a sequence grows
past ``max_position_embeddings``; below that it is plain RoPE, in transformers
as here. kvlife never rotates past that length (the engine bounds
``max_context`` by it), because past it transformers' keys depend on how the
sequence was computed (one prefill, chunks, cached prefix, recompute after a
retraction) and no paged engine can reproduce that.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from engine.model.model_config import RopeScaling


def default_inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """``1 / theta ** (2i / head_dim)`` for i in [0, head_dim / 2), float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / theta**exponents


def scaled_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device
) -> tuple[Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` under `scaling`, and the factor
    cos and sin are multiplied by (1.0 except for yarn)."""
    inv_freq = default_inverse_frequencies(head_dim, theta, device)
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(inv_freq, head_dim, theta, scaling)


def _llama3(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama-3 scaling: long wavelengths slowed by `factor`, short ones kept,
    the band between interpolated smoothly."""
    assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
    original = scaling.original_max_position_embeddings
    assert original is not None
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, interpolated, scaled)


def _yarn(inv_freq: Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> tuple[Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, extrapolate the high
    ones, ramp linearly between the correction dimensions; scale attention by
    ``attention_factor`` (default ``0.1 * ln(factor) + 1``)."""
    original = scaling.original_max_position_embeddings
    assert original is not None
    factor = scaling.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, to avoid a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp.to(inv_freq.device)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=inv_freq.device).float() / head_dim)
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


#: the most positions `RotaryEmbedding.table` caches (64 MiB at head_dim 128 in float32)
MAX_TABLE_POSITIONS = 1 << 17


class RotaryEmbedding:
    """cos/sin for explicit positions. The inverse frequencies are computed on
    first use on each device and never stored in the state dict, so a model
    built on the meta device needs nothing restored.

    `table` caches, per device and dtype, the cos and sin of every position
    below `max_positions` (as transformers computes them: float32 angles,
    then the dtype), so a step looks its positions up with one `index_select`
    instead of computing them (``max_positions * head_dim`` values, like
    vLLM's ``cos_sin_cache``: 0.5 MiB for the anchor model in float32).
    Past `MAX_TABLE_POSITIONS` positions no table is kept and `lookup`
    computes its rows instead.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int = 0) -> None:
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.max_positions = max_positions
        self._per_device: dict[torch.device, tuple[Tensor, float]] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def inverse_frequencies(self, device: torch.device) -> Tensor:
        return self._frequencies(device)[0]

    def _frequencies(self, device: torch.device) -> tuple[Tensor, float]:
        tables = self._per_device.get(device)
        if tables is None:
            tables = scaled_inverse_frequencies(self.head_dim, self.theta, self.scaling, device)
            self._per_device[device] = tables
        return tables

    def _half_cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 ``[T, head_dim / 2]`` cos and sin, scaled by the attention factor."""
        inv_freq, attention_factor = self._frequencies(positions.device)
        angles = positions.float()[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        return cos, sin

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``[T, head_dim]`` cos and sin for `positions` ``[T]``, computed (the reference)."""
        cos, sin = self._half_cos_sin(positions)
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)

    def table(self, device: torch.device, dtype: torch.dtype) -> Tensor | None:
        """``[max_positions, head_dim]``: row p is cos then sin of position p's
        ``head_dim / 2`` angles, in `dtype`; built once per device and dtype
        (None when `max_positions` is 0 or past `MAX_TABLE_POSITIONS`)."""
        if not 0 < self.max_positions <= MAX_TABLE_POSITIONS:
            return None
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None:
            cos, sin = self._half_cos_sin(torch.arange(self.max_positions, device=device))
            table = self._tables[key] = torch.cat((cos, sin), dim=-1).to(dtype)
        return table

    def lookup(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """``[T, head_dim]``, row t the cos then sin of position ``positions[t]``
        (what `apply_rope_` takes): rows of `table`, or computed without one."""
        table = self.table(positions.device, dtype)
        if table is not None:
            return table.index_select(0, positions)
        return torch.cat(self._half_cos_sin(positions), dim=-1).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` ``[T, heads, head_dim]``: first and second halves of the
    head dimension form the (real, imaginary) pairs ("rotate_half")."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_(x: Tensor, cos_sin: Tensor) -> Tensor:
    """`apply_rope` in place on `x` ``[T, heads, head_dim]`` (any strides with a
    contiguous last dimension), from `RotaryEmbedding.lookup` rows; returns `x`.

    NOTE: op for op the roundings of transformers' ``x * cos + rotate_half(x) * sin``:
    first half ``x1 * cos - x2 * sin``, second half ``x2 * cos + x1 * sin``.
    """
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    x2_sin, x1_sin = x2 * sin, x1 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
    return x
