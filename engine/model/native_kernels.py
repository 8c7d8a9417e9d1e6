"""kvlife's native CPU kernels for the decode step, and which engines use them.

torch has no paged attention on CPU: its forms (`engine.model.paged_attend`)
gather a step's K (and V, or value bags) out of the pages before attending, a
dozen ops a layer, and from batch 8 up that attention is as large as every
matmul of the step. Around the matmuls, each RMSNorm is several torch ops
(about 20 us at batch 1, where its arithmetic is 256 multiply-adds), RoPE six
and SwiGLU's activation and product two; the verified greedy head's search
after its bfloat16 matmul about 25. Five kernels (`native/*.cpp`, built by
`engine.model.native_build`):

- `NativeKernels.decode_attention`: every decode row (one new token) over its
  paged K/V, read once in place, page by page, with an online softmax in
  float32 and the next reads prefetched (`native/decode_attention.cpp`); the
  K/V buffers may hold float32 or bfloat16 (``EngineConfig.kv_cache_dtype``):
  bfloat16 is widened to float32 as it is read (a shift: in registers on the
  AVX-512 path, `native/decode_attention_avx512.h`; in the portable loops one
  K or V row at a time into scratch that stays in L1; nothing is gathered), and the step's new
  float32 K/V rows are rounded to bfloat16 (to nearest even, as
  ``.to(torch.bfloat16)``) as they are stored;
- `NativeKernels.rms_norm`: the residual add and the norm in one pass;
- `NativeKernels.rope_`: RoPE in place, rounded as transformers' ops round;
- `NativeKernels.silu_mul_`: SwiGLU's activation and product in place;
- `NativeKernels.verified_argmax`: `engine.model.greedy_head`'s candidate
  search and float32 rescoring (`native/greedy_verify.cpp`).

They take float32 tensors on the CPU (`kernels_for` hands them only to such
models; attention's K/V buffers float32 or bfloat16); `takes_*` say whether a
call's layout qualifies, and the caller uses torch otherwise. Outputs equal
torch's up to float32 rounding (the tests hold them against float64 references
and torch). `kernels_for` resolves
`EngineConfig.native_kernels`; `engine.model.loading.install_native_kernels`
hands them to a model's fused path (the reference path never uses them).
"""

from __future__ import annotations

import ctypes
import torch
from torch import Tensor

from engine.errors import InvalidConfig
from engine.model.native_build import KernelBuild

#: `EngineConfig.native_kernels`' values
NATIVE_KERNELS = ("auto", "on", "off")

#: from this many context tokens in an attention call (rows x longest context) on, the kernel
#: splits the rows over torch's intra-op thread count (a thread start costs tens of microseconds)
PARALLEL_MIN_TOKENS = 4096

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

#: the K/V buffer dtypes `NativeKernels.decode_attention` reads
_KV_DTYPES = (torch.float32, torch.bfloat16)


class NativeKernels:
    """The loaded library's kernels (module docstring)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._attention = library.kvlife_decode_attention_f32  # float32 K/V buffers
        self._attention_bf16 = library.kvlife_decode_attention_bf16kv  # bfloat16 K/V buffers, same arguments
        for fn in (self._attention, self._attention_bf16):
            fn.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _F32,
                           _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR]
        self._norm = library.kvlife_rms_norm_f32
        self._norm.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32, _PTR, _I64]
        self._rope = library.kvlife_rope_f32
        self._rope.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64]
        self._silu_mul = library.kvlife_silu_mul_f32
        self._silu_mul.argtypes = [_PTR, _I64, _I64, _I64]
        self._verify = library.kvlife_verified_argmax
        self._verify.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _F32, _F32, _I64, _I64, _PTR]
        for fn in (self._attention, self._attention_bf16, self._norm, self._rope, self._silu_mul, self._verify):
            fn.restype = ctypes.c_int

    # NOTE: `kernels_for` hands them only to float32 models on a CPU, so the checks below are of
    # layout alone: a few attribute reads per call (each costs about as much as the arithmetic of
    # a norm at batch 1)

    # ----------------------------------------------------------- attention
    @staticmethod
    def takes_attention(q: Tensor, k_buf: Tensor) -> bool:
        """Whether float32 queries `q` over the buffer `k_buf` (float32 or bfloat16, contiguous)
        qualify (the caller checked the rest of the plan: decode rows, page or token columns)."""
        return q.dtype == torch.float32 and k_buf.dtype in _KV_DTYPES and q.stride(-1) == 1 \
            and k_buf.is_contiguous() and q.device.type == "cpu"

    @staticmethod
    def takes_store(k: Tensor, v: Tensor, out_locs: Tensor) -> bool:
        """Whether `decode_attention` can store the step's new float32 `k` and `v` ``[B, KVH, D]``
        at `out_locs` itself (rows of any stride, each row's heads contiguous), whatever the
        buffers' dtype (a bfloat16 buffer gets them rounded, as ``.to(torch.bfloat16)``)."""
        dim = k.shape[-1]
        return (k.stride(-1) == 1 and k.stride(1) == dim and v.stride(-1) == 1 and v.stride(1) == dim
                and out_locs.dtype == torch.int64 and out_locs.is_contiguous())

    def decode_attention(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, columns: Tensor, unit: int,
                         kv_lens: Tensor, window: int | None,
                         store: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """`q` ``[B, H, D]`` (one query per row, at position ``kv_lens[b] - 1``) over the
        contexts in `k_buf` and `v_buf` ``[locations, KVH, D]`` (contiguous, both float32 or both
        bfloat16; bfloat16 is widened to float32 as it is read): row b's token j at
        ``columns[b, j // unit] * unit + j % unit``; the last `window` tokens only when given;
        returns float32 ``[B, H, D]``. `store` ``(k, v, out_locs)``: first write each row's new
        float32 K and V ``[B, KVH, D]`` at its location, rounded to bfloat16 (to nearest even)
        in a bfloat16 buffer (`takes_store` says whether they qualify)."""
        if k_buf.dtype == torch.float32:
            attention = self._attention
        elif k_buf.dtype == torch.bfloat16:
            attention = self._attention_bf16
        else:
            raise ValueError(f"the native decode attention kernel takes float32 or bfloat16 K/V, not {k_buf.dtype}")
        if v_buf.dtype != k_buf.dtype:  # the kernel would read (and store into) it as k_buf's type
            raise ValueError(f"the native decode attention kernel's K and V differ: {k_buf.dtype}, {v_buf.dtype}")
        rows, heads, head_dim = q.shape
        if columns.dtype != torch.int64 or columns.stride(-1) != 1:
            columns = columns.to(torch.int64).contiguous()
        if kv_lens.dtype != torch.int64 or not kv_lens.is_contiguous():
            kv_lens = kv_lens.to(torch.int64).contiguous()
        out = torch.empty((rows, heads, head_dim), dtype=torch.float32)
        width = columns.shape[1] * unit
        threads = torch.get_num_threads() if rows * width >= PARALLEL_MIN_TOKENS else 1
        q_row, q_head, _ = q.stride()
        new_k = new_v = locs = None
        new_k_row = new_v_row = 0
        if store is not None:
            k, v, out_locs = store
            new_k, new_k_row, new_v, new_v_row, locs = k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), \
                out_locs.data_ptr()
        _check(attention(q.data_ptr(), q_row, q_head, k_buf.data_ptr(), v_buf.data_ptr(),
                         columns.data_ptr(), columns.stride(0), unit, kv_lens.data_ptr(), rows, heads,
                         k_buf.shape[1], head_dim, window or 0, head_dim**-0.5, out.data_ptr(), threads,
                         new_k, new_k_row, new_v, new_v_row, locs), "decode attention", q)
        return out

    # ---------------------------------------------------------------- norm
    @staticmethod
    def takes_norm(x: Tensor, update: Tensor | None = None) -> bool:
        """Whether `rms_norm` takes rows `x` (and `update`): 2-d and contiguous."""
        return x.dim() == 2 and x.is_contiguous() and (update is None or update.is_contiguous())

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, update: Tensor | None = None) -> Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension of `x` ``[rows, hidden]``,
        after ``x += update`` in place when `update` is given (also ``[rows, hidden]``)."""
        rows, hidden = x.shape
        out = torch.empty((rows, hidden), dtype=torch.float32)
        _check(self._norm(x.data_ptr(), hidden, None if update is None else update.data_ptr(), hidden,
                          weight.data_ptr(), rows, hidden, eps, out.data_ptr(), hidden), "rms norm", x)
        return out

    # ---------------------------------------------------------------- rope
    @staticmethod
    def takes_rope(x: Tensor, cos_sin: Tensor) -> bool:
        """Whether `rope_` takes `x` ``[T, heads, head_dim]`` (last dimension contiguous) and rows
        `cos_sin` (contiguous)."""
        return x.stride(-1) == 1 and cos_sin.is_contiguous()

    def rope_(self, x: Tensor, cos_sin: Tensor) -> Tensor:
        """`engine.model.rope.apply_rope_` in one call: `x` ``[T, heads, head_dim]`` rotated in
        place from the rows `cos_sin` ``[T, head_dim]``; returns `x`."""
        tokens, heads, dim = x.shape
        x_token, x_head, _ = x.stride()
        _check(self._rope(x.data_ptr(), x_token, x_head, cos_sin.data_ptr(), dim, tokens, heads, dim), "rope", x)
        return x

    # ------------------------------------------------------------ swiglu
    @staticmethod
    def takes_silu(both: Tensor) -> bool:
        """Whether `silu_mul_` takes `both` ``[T, 2 * width]`` (2-d, last dimension contiguous)."""
        return both.dim() == 2 and both.stride(-1) == 1

    def silu_mul_(self, both: Tensor) -> Tensor:
        """SwiGLU's ``silu(gate) * up`` in place on the packed gate/up output `both`
        ``[T, 2 * width]``; returns the gate half ``[T, width]``, which holds it."""
        rows, double = both.shape
        width = double // 2
        _check(self._silu_mul(both.data_ptr(), both.stride(0), rows, width), "silu", both)
        return both[:, :width]

    # ------------------------------------------------------ verified head
    @staticmethod
    def takes_verify(approx: Tensor, x: Tensor) -> bool:
        """Whether `verified_argmax` takes the bfloat16 logits `approx` and the rows `x` (2-d, each
        row contiguous)."""
        return (approx.dtype == torch.bfloat16 and approx.dim() == 2 and approx.stride(-1) == 1
                and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1)

    def verified_argmax(self, approx: Tensor, x: Tensor, columns: Tensor, block: int, norm_coeff: float,
                        value_coeff: float, max_blocks: int, max_tokens: int) -> Tensor | None:
        """`engine.model.greedy_head.VerifiedGreedyHead`'s search after its bfloat16 matmul, in one
        call (`native/greedy_verify.cpp`): `approx` ``[B, vocab]`` the bfloat16 logits of the rows
        `x` ``[B, hidden]``, `columns` the float32 head ``[vocab, hidden]`` (contiguous); int64
        ``[B]``, or None where the torch form declines too."""
        rows, vocab = approx.shape
        out = torch.empty(rows, dtype=torch.int64)
        code = self._verify(approx.data_ptr(), approx.stride(0), x.data_ptr(), x.stride(0), columns.data_ptr(),
                            rows, vocab, x.shape[1], block, norm_coeff, value_coeff, max_blocks, max_tokens,
                            out.data_ptr())
        if code == 2:
            return None
        _check(code, "verified head", approx)
        return out


def _check(code: int, kernel: str, x: Tensor) -> None:
    if code != 0:
        raise ValueError(f"the native {kernel} kernel refused its arguments (code {code}): {tuple(x.shape)}")


#: this process's build of the library
BUILD = KernelBuild()
_loaded: dict[int, NativeKernels] = {}


def load_kernels() -> NativeKernels | None:
    """The kernels of this process's build (built on first call); None where they cannot be."""
    library = BUILD.load()
    if library is None:
        return None
    kernels = _loaded.get(id(library))
    if kernels is None:
        kernels = _loaded[id(library)] = NativeKernels(library)
    return kernels


def kernel_problem() -> str | None:
    """Why `load_kernels` returned None (None if it did not, or was not called)."""
    return BUILD.problem


def kernels_for(mode: str, device: torch.device, dtype: torch.dtype) -> NativeKernels | None:
    """The kernels an engine of `device` and model `dtype` runs under `EngineConfig.native_kernels`
    `mode` (None: torch's ops alone); "on" where they do not apply or cannot be built raises
    `InvalidConfig` naming why (before any pool is allocated)."""
    if mode not in NATIVE_KERNELS:
        raise InvalidConfig("EngineConfig.native_kernels", f"one of {NATIVE_KERNELS}", mode)
    applies = device.type == "cpu" and dtype == torch.float32
    if mode == "off" or (mode == "auto" and not applies):
        return None
    if not applies:
        raise InvalidConfig("EngineConfig.native_kernels",
                            f"'auto' or 'off' for a {dtype} model on {device} (the kernels take float32 on a CPU)",
                            mode)
    kernels = load_kernels()
    if kernels is None and mode == "on":
        raise InvalidConfig("EngineConfig.native_kernels",
                            f"'auto' or 'off' here: the kernels could not be built ({BUILD.problem})", mode)
    return kernels
