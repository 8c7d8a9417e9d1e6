// The decode step's small float32 ops in one call each: RMSNorm (with the
// residual add before it) and RoPE in place. kvlife's CPU kernels
// (engine/model/native_kernels.py); each replaces a handful of torch ops,
// whose dispatch costs more than their arithmetic at decode batch sizes.

#include <cmath>
#include <cstdint>

#include "exp.h"

extern "C" {

// x [rows, hidden] (row stride x_row): with `update` (row stride update_row) first x += update in
// place; then out [rows, hidden] (row stride out_row) = x / sqrt(mean(x^2) + eps) * weight.
int kvlife_rms_norm_f32(float* x, int64_t x_row, const float* update, int64_t update_row, const float* weight,
                        int64_t rows, int64_t hidden, float eps, float* out, int64_t out_row) {
    if (rows < 0 || hidden <= 0) return 1;
    for (int64_t r = 0; r < rows; ++r) {
        float* xr = x + r * x_row;
        if (update != nullptr) {
            const float* ur = update + r * update_row;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) xr[i] += ur[i];
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; ++i) squares += xr[i] * xr[i];
        const float scale = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
        float* o = out + r * out_row;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) o[i] = (xr[i] * scale) * weight[i];
    }
    return 0;
}

// RoPE in place on x [tokens, heads, dim] (strides x_token, x_head; element stride 1) from
// cos_sin [tokens, dim] (row stride cs_row: cos of the dim / 2 angles, then their sin), the
// halves of each head as the (real, imaginary) pairs. Rounded as transformers' ops round:
// each product on its own, then the sum (no fused multiply-add).
__attribute__((optimize("fp-contract=off")))
int kvlife_rope_f32(float* x, int64_t x_token, int64_t x_head, const float* cos_sin, int64_t cs_row,
                    int64_t tokens, int64_t heads, int64_t dim) {
    if (tokens < 0 || heads < 0 || dim <= 0 || dim % 2 != 0) return 1;
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
        const float* cos = cos_sin + t * cs_row;
        const float* sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) {
            float* x1 = x + t * x_token + h * x_head;
            float* x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                const float a_cos = a * cos[i], b_sin = b * sin[i], b_cos = b * cos[i], a_sin = a * sin[i];
                x1[i] = a_cos - b_sin;
                x2[i] = b_cos + a_sin;
            }
        }
    }
    return 0;
}

// SwiGLU's activation in place on the packed gate/up output x [rows, 2 * width] (row stride
// x_row): gate = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
int kvlife_silu_mul_f32(float* x, int64_t x_row, int64_t rows, int64_t width) {
    if (rows < 0 || width <= 0) return 1;
    for (int64_t r = 0; r < rows; ++r) {
        float* gate = x + r * x_row;
        const float* up = gate + width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
            const float g = gate[i];
            gate[i] = (g / (1.0f + kvlife_native::exp_float(-g))) * up[i];
        }
    }
    return 0;
}

}  // extern "C"
