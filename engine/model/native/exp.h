// exp(x) in float32 for kvlife's native kernels (decode_attention.cpp, step_ops.cpp),
// branch-free so a loop that calls it vectorises: x = n ln2 + r (|r| <= ln2 / 2), exp(r) by
// a degree-7 polynomial (a few ulp), times 2^n built in the exponent bits; 0 below -87, and
// finite up to 88.7 (x is clamped there).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvlife_native {

inline float exp_float(float x) {
    const float zero = x < -87.0f ? 0.0f : 1.0f;
    x = std::min(std::max(x, -87.0f), 88.7f);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    // NOTE: 2^n as two halves, so n = 128 (x near 88.7) stays finite
    const int32_t low = static_cast<int32_t>(n) / 2, high = static_cast<int32_t>(n) - low;
    const int32_t low_bits = (low + 127) << 23, high_bits = (high + 127) << 23;
    float a, b;
    std::memcpy(&a, &low_bits, sizeof a);
    std::memcpy(&b, &high_bits, sizeof b);
    return p * a * b * zero;
}

}  // namespace kvlife_native
