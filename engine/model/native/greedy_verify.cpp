// The verified greedy head's search in one call: kvlife's CPU kernel for the step after the
// bfloat16 head's matmul (engine/model/greedy_head.py holds the bound, and the torch form this
// equals; engine/model/native_kernels.py calls it).
//
// Per row: the maxima of the bfloat16 logits by blocks of `block` columns, the row's maximum,
// the bound's floor; then every column of a block whose maximum reaches the floor, whose own
// logit does too, rescored in float32 against the float32 head (vocabulary-major rows); the
// row's token is the candidate of the largest score, the first on a tie. About 25 torch ops
// a step in the torch form; here one pass over the logits a row.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

}  // namespace

extern "C" {

// approx [rows, vocab] bfloat16 (row stride approx_row); x [rows, hidden] float32 (row stride x_row);
// columns [vocab, hidden] float32, contiguous. out[rows]: int64 token ids. Returns 0 with every
// row's token; 2 when the step must take the float32 head instead (as the torch form declines: a
// row with a non-finite value or bound, more than max_blocks * rows candidate blocks in all, or
// more than max_tokens * rows candidates, or a non-finite score); 1 for arguments it does not take.
int kvlife_verified_argmax(const uint16_t* approx, int64_t approx_row, const float* x, int64_t x_row,
                           const float* columns, int64_t rows, int64_t vocab, int64_t hidden, int64_t block,
                           float norm_coeff, float value_coeff, int64_t max_blocks, int64_t max_tokens,
                           int64_t* out) {
    if (rows <= 0 || vocab <= 0 || hidden <= 0 || block <= 0) return 1;
    const int64_t num_blocks = (vocab + block - 1) / block;
    int64_t blocks_seen = 0, tokens_seen = 0;
    std::vector<float> maxima(static_cast<size_t>(num_blocks));
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* a = approx + r * approx_row;
        const float* xr = x + r * x_row;
        float top = -INFINITY, poison = 0.0f;  // poison: NaN once any value is NaN or infinite
        for (int64_t b = 0; b < num_blocks; ++b) {  // pass 1: the block maxima, the row's maximum
            const int64_t lo = b * block, hi = lo + block < vocab ? lo + block : vocab;
            float m = -INFINITY, p = 0.0f;
#pragma omp simd reduction(max : m) reduction(+ : p)
            for (int64_t i = lo; i < hi; ++i) {
                const float v = bf16_float(a[i]);
                m = v > m ? v : m;
                p += v * 0.0f;
            }
            maxima[b] = m;
            top = m > top ? m : top;
            poison += p;
        }
        double squares = 0.0;
        for (int64_t i = 0; i < hidden; ++i) squares += static_cast<double>(xr[i]) * xr[i];
        const float shared = norm_coeff * static_cast<float>(std::sqrt(squares));
        const float own = shared + value_coeff * std::fabs(top);
        const float other = (shared + value_coeff * (std::fabs(top) + own)) / (1.0f - value_coeff);
        const float floor = top - own - other;
        if (poison != 0.0f || !std::isfinite(floor)) return 2;
        float best = -INFINITY;
        int64_t winner = -1, candidates = 0;
        for (int64_t b = 0; b < num_blocks; ++b) {  // pass 2: the blocks that reach the floor
            if (!(maxima[b] >= floor)) continue;
            const int64_t lo = b * block, hi = lo + block < vocab ? lo + block : vocab;
            if (++blocks_seen > max_blocks * rows) return 2;
            for (int64_t i = lo; i < hi; ++i) {
                if (!(bf16_float(a[i]) >= floor)) continue;
                if (++tokens_seen > max_tokens * rows) return 2;
                ++candidates;
                const float* w = columns + i * hidden;
                float score = 0.0f;
#pragma omp simd reduction(+ : score)
                for (int64_t d = 0; d < hidden; ++d) score += xr[d] * w[d];
                if (!std::isfinite(score)) return 2;
                if (score > best) best = score, winner = i;  // NOTE: strictly larger: the first on a tie
            }
        }
        if (candidates == 0 || winner < 0) return 2;
        out[r] = winner;
    }
    return 0;
}

}  // extern "C"
