// The AVX-512 path of decode_attention.cpp (included there, inside its anonymous namespace,
// after Problem, ReadPlan and the bfloat16 helpers; compiled only when KVLIFE_DECODE_AVX512 is set).
#pragma once

// The same per row over AVX-512, a block of 16 tokens a vector: per query head, the 16 dot
// products accumulate in 16 vectors (one per token, 16 elements of head_dim at a time, the tail
// masked) and one transposing reduction turns them into the block's 16 scores; exp over the 16
// at once; the values are summed into registers (the head's accumulator, up to 4 x 16 elements
// of it at a time) over the block's tokens. The 1/sqrt(d) scale is folded into the query once
// per row. Any head_dim, group and block tail (missing tokens read a row of zeros, then are
// masked out of the softmax).

// a Kv row's 16 elements (those of `mask`; the rest 0) as float32
inline __m512 load16(const float* at, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, at); }
inline __m512 load16(const Bf16* at, __mmask16 mask) {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp.h's exp_float on 16 lanes (the same polynomial; 2^n by scalef): 0 below -87
inline __m512 exp16(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, p, n);
}

// 16 vectors' sums as one vector: lane 4k + j is the sum of a[4j + k] (a 4x4 transpose:
// score_slot below puts token t in the vector that lands in lane t)
inline __m512 sum16(const __m512* a) {
    __m512 r[8], t[4], u[2];
    for (int j = 0; j < 8; ++j) {  // halves: [a 256 + 256 | b 256 + 256] by 128-bit quarters
        const __m512 x = a[2 * j], y = a[2 * j + 1];
        r[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int j = 0; j < 4; ++j)  // quarters: one vector's quarter k is a[4j + k]'s 4 partial sums
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; ++j)  // pairs within quarters
        u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
}

// the token whose dot product accumulates in vector s of sum16's input, so it lands in lane (token)
constexpr int score_slot(int s) { return (s % 4) * 4 + s / 4; }

// The lines of the next block's K and V rows, requested a few at a time (`step`) from inside the
// block's loops: a block's worth at once (up to 32 x 16 lines) would fill the core's queues and stall
// its arithmetic until they came.
struct Ahead {
    const char* rows[2 * TOKEN_BLOCK];
    int64_t count = 0, lines = 0, row = 0, line = 0;  // rows of `lines` lines; the next is (row, line)
    int64_t quota = 0;                                // lines per step

    void refill(int64_t steps) {
        row = line = 0;
        quota = (count * lines + steps - 1) / std::max<int64_t>(steps, 1);
    }
    void step() {
        for (int64_t k = 0; k < quota && row < count; ++k) {
            __builtin_prefetch(rows[row] + 64 * line, 0, 3);
            if (++line == lines) line = 0, ++row;
        }
    }
    void finish() {
        while (row < count) step();
    }
};

// the block's 16 scores of one query head: q (padded to chunks x 16, zeros) against the 16 key
// rows (already at the head's offset; a row of zeros for a missing token), by slot
template <typename Kv>
inline __m512 block_scores(const float* q, const Kv* const* keys, int64_t chunks, __mmask16 tail, Ahead& ahead) {
    __m512 acc[16];
    for (int s = 0; s < 16; ++s) acc[s] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
        const __mmask16 mask = c + 1 == chunks ? tail : static_cast<__mmask16>(0xffff);
        const __m512 qc = _mm512_loadu_ps(q + 16 * c);
        ahead.step();
#pragma GCC unroll 16
        for (int s = 0; s < 16; ++s) acc[s] = _mm512_fmadd_ps(qc, load16(keys[s] + 16 * c, mask), acc[s]);
    }
    return sum16(acc);
}

// a head's accumulator chunks [first, first + N) (16 floats each, padded) += the block's m weighted
// values (rows at the head's offset); two sums per chunk (even and odd tokens), added at the end
template <int N, typename Kv>
inline void add_values(float* acc, const float* w, const Kv* const* values, int64_t m, int64_t first,
                       int64_t chunks, __mmask16 tail, Ahead& ahead) {
    __m512 even[N], odd[N];
    __mmask16 mask[N];
    for (int c = 0; c < N; ++c) {
        even[c] = _mm512_loadu_ps(acc + 16 * (first + c));
        odd[c] = _mm512_setzero_ps();
        mask[c] = first + c + 1 == chunks ? tail : static_cast<__mmask16>(0xffff);
    }
    int64_t i = 0;
    for (; i + 1 < m; i += 2) {
        const __m512 w0 = _mm512_set1_ps(w[i]), w1 = _mm512_set1_ps(w[i + 1]);
        ahead.step();
        for (int c = 0; c < N; ++c) {
            even[c] = _mm512_fmadd_ps(w0, load16(values[i] + 16 * (first + c), mask[c]), even[c]);
            odd[c] = _mm512_fmadd_ps(w1, load16(values[i + 1] + 16 * (first + c), mask[c]), odd[c]);
        }
    }
    if (i < m) {
        const __m512 w0 = _mm512_set1_ps(w[i]);
        for (int c = 0; c < N; ++c)
            even[c] = _mm512_fmadd_ps(w0, load16(values[i] + 16 * (first + c), mask[c]), even[c]);
    }
    for (int c = 0; c < N; ++c) _mm512_storeu_ps(acc + 16 * (first + c), _mm512_add_ps(even[c], odd[c]));
}

template <typename Kv>
void attend_rows_avx512(const Problem<Kv>& p, int64_t first, int64_t last) {
    const int64_t H = p.heads, D = p.head_dim, group = p.heads / p.kv_heads, stride = p.kv_heads * D;
    const int64_t chunks = (D + 15) / 16, padded = 16 * chunks;
    const __mmask16 tail = static_cast<__mmask16>(0xffffu >> (padded - D));
    const int64_t row_bytes = static_cast<int64_t>(sizeof(Kv)) * stride;
    const ReadPlan plan(p, first, last);
    const int64_t planned = plan.row_at.back();
    std::vector<float> q(static_cast<size_t>(H * padded), 0.0f), acc(static_cast<size_t>(H * padded));
    std::vector<float> weights(static_cast<size_t>(H * TOKEN_BLOCK)), totals(static_cast<size_t>(H));
    std::vector<float> tops(static_cast<size_t>(H));
    const std::vector<Kv> zeros(static_cast<size_t>(stride), Kv{});  // a missing token's key
    const Kv* keys[16];
    const Kv* values[16];
    const Kv* head_keys[16];
    const Kv* head_values[16];
    Ahead ahead;
    ahead.lines = (row_bytes + 63) / 64;
    prefetch_start(p, plan, stride);
    for (int64_t b = first; b < last; ++b) {
        float* out = p.out + b * H * D;
        const int64_t at = plan.row_at[b - first], n = plan.row_at[b - first + 1] - at;
        if (!start_row(p, b, n, stride)) continue;
        const int64_t* where = plan.where.data() + at;
        const float* qb = p.q + b * p.q_row;
        for (int64_t h = 0; h < H; ++h)
            for (int64_t d = 0; d < D; ++d) q[h * padded + d] = qb[h * p.q_head + d] * p.scale;
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::fill(totals.begin(), totals.end(), 0.0f);
        std::fill(tops.begin(), tops.end(), -INFINITY);
        for (int64_t lo = 0; lo < n; lo += TOKEN_BLOCK) {
            const int64_t m = std::min(TOKEN_BLOCK, n - lo);
            // the tokens PREFETCH_TOKENS on (across rows), requested along this block's loops
            ahead.count = 0;
            for (int64_t i = at + lo + PREFETCH_TOKENS; i < std::min(at + lo + PREFETCH_TOKENS + m, planned); ++i) {
                ahead.rows[ahead.count++] = reinterpret_cast<const char*>(p.k + plan.where[i] * stride);
                ahead.rows[ahead.count++] = reinterpret_cast<const char*>(p.v + plan.where[i] * stride);
            }
            ahead.refill(H * (chunks + m / 2));
            for (int s = 0; s < 16; ++s) {
                const int64_t t = score_slot(s);
                keys[s] = t < m ? p.k + where[lo + t] * stride : zeros.data();
            }
            for (int64_t i = 0; i < m; ++i) values[i] = p.v + where[lo + i] * stride;
            const __mmask16 live = static_cast<__mmask16>(0xffffu >> (TOKEN_BLOCK - m));
            for (int64_t h = 0; h < H; ++h) {
                const int64_t offset = (h / group) * D;
                for (int s = 0; s < 16; ++s) head_keys[s] = keys[s] + offset;
                const __m512 sc = _mm512_mask_mov_ps(  // missing tokens: -inf
                    _mm512_set1_ps(-INFINITY), live, block_scores(q.data() + h * padded, head_keys, chunks, tail, ahead));
                const float top = std::max(tops[h], _mm512_reduce_max_ps(sc));
                if (top > tops[h]) {  // rescale what was summed under the old maximum
                    const float shrink = tops[h] == -INFINITY ? 0.0f : kvlife_native::exp_float(tops[h] - top);
                    const __m512 by = _mm512_set1_ps(shrink);
                    float* ah = acc.data() + h * padded;
                    for (int64_t c = 0; c < chunks; ++c)
                        _mm512_storeu_ps(ah + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(ah + 16 * c), by));
                    totals[h] *= shrink;
                    tops[h] = top;
                }
                const __m512 x = _mm512_sub_ps(sc, _mm512_set1_ps(top));
                // 0 where not live; a NaN score (a NaN in q or the key, inf - inf) stays NaN, as exp_float's
                const __m512 w = _mm512_mask_mov_ps(exp16(x), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
                totals[h] += _mm512_reduce_add_ps(w);
                _mm512_storeu_ps(weights.data() + h * TOKEN_BLOCK, w);
            }
            for (int64_t h = 0; h < H; ++h) {
                const int64_t offset = (h / group) * D;
                for (int64_t i = 0; i < m; ++i) head_values[i] = values[i] + offset;
                float* ah = acc.data() + h * padded;
                const float* wh = weights.data() + h * TOKEN_BLOCK;
                int64_t c = 0;
                for (; c + 4 <= chunks; c += 4) add_values<4>(ah, wh, head_values, m, c, chunks, tail, ahead);
                switch (chunks - c) {
                    case 3: add_values<3>(ah, wh, head_values, m, c, chunks, tail, ahead); break;
                    case 2: add_values<2>(ah, wh, head_values, m, c, chunks, tail, ahead); break;
                    case 1: add_values<1>(ah, wh, head_values, m, c, chunks, tail, ahead); break;
                    default: break;
                }
            }
            ahead.finish();
        }
        for (int64_t h = 0; h < H; ++h) {
            const float inv = 1.0f / totals[h];
            for (int64_t d = 0; d < D; ++d) out[h * D + d] = acc[h * padded + d] * inv;
        }
    }
}
