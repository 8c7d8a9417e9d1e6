// Decode attention over paged K/V, read in place: kvlife's CPU kernel
// (engine/model/native_kernels.py loads and calls it; docs/models.md).
//
// One query token per row b. Its context is kv_lens[b] tokens; token j sits at
// location columns[b, j / unit] * unit + j % unit of the layer's K and V
// buffers [locations, kv_heads, head_dim] (unit: the page size when columns are
// page ids, 1 when they are token locations). With a sliding window W > 0 the
// query (at position kv_lens[b] - 1) sees only the last W tokens. Query head h
// reads KV head h / (heads / kv_heads).
//
// The K/V buffers hold float32 or bfloat16 (Bf16: a float32's top 16 bits), one
// template (attend_rows<Kv>); a bfloat16 K or V row is widened to float32 as it
// is read (a shift per element, vectorized, into one row of scratch that stays
// in L1: once per token, not once per query head of its group), and the step's
// new float32 rows are rounded to bfloat16 as they are stored (to nearest even,
// as torch's .to(bfloat16)). Queries, outputs, new rows and all arithmetic are
// float32 either way; the float32 instantiation reads its buffers directly.
//
// Per row, one pass over the context 16 tokens at a time with an online softmax
// in float32 (attend_rows), the reads prefetched ahead (ReadPlan). Nothing is
// gathered; the scratch is H x 16 floats, the token list and (over bfloat16) one
// widened K/V row. Built with AVX-512 (F, BW, VL; -march=native on such a CPU),
// attend_rows_avx512 runs instead: the same pass with a block's 16 scores of a head
// computed as one vector (16 dot products summed vertically, then one transposing
// reduction), exp over the 16 at once, the values summed in registers and the
// prefetches spread over the block's loops (in a decode step at batch 128 it is
// about 1.5-2x faster over bfloat16 K/V; float32 K/V is near the memory's rate
// either way). No library beyond the C++ standard one (and <immintrin.h> there):
// the file compiles in about a second and is loaded with ctypes, which releases
// the GIL for the call.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include "exp.h"

// AVX-512 (F, BW, VL: -march=native on a CPU that has them) takes the blocked path below
// (attend_rows_avx512); any other build the portable loops (attend_rows)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KVLIFE_DECODE_AVX512 1
#endif

namespace {

using Bf16 = uint16_t;  // bfloat16 storage: the top 16 bits of a float32

// a bfloat16 as float32: its bits shifted into a float32's top half
inline float widen(Bf16 x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// a float32 rounded to bfloat16 as torch's CPU conversion (at::vec's cvtfp32_bf16) rounds:
// to nearest, ties to even (infinities and overflow to infinity included); a NaN becomes 0xFFFF
inline Bf16 narrow(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0xffffu;
    return static_cast<Bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// a K or V row of n elements as float32: the row itself, or the bfloat16 row widened into `wide`
inline const float* as_floats(const float* row, int64_t, float*) { return row; }
inline const float* as_floats(const Bf16* row, int64_t n, float* wide) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) wide[i] = widen(row[i]);
    return wide;
}

// the step's new float32 row stored as Kv: copied, or rounded to bfloat16
inline void store_row(float* to, const float* from, int64_t n) { std::memcpy(to, from, sizeof(float) * n); }
inline void store_row(Bf16* to, const float* from, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) to[i] = narrow(from[i]);
}

template <typename Kv>
struct Problem {
    const float* q;           // [B, H, D], row stride q_row, head stride q_head, element stride 1
    int64_t q_row, q_head;
    Kv* k;                    // [N, KVH, D] contiguous (written only by the store of new rows)
    Kv* v;
    const int64_t* columns;   // [B, >= ceil(len / unit)], row stride col_row, element stride 1
    int64_t col_row, unit;
    const int64_t* kv_lens;   // [B]
    int64_t heads, kv_heads, head_dim, window;
    float scale;
    float* out;               // [B, H, D] contiguous
    // the step's new K and V rows [B, KVH, D] (row strides new_k_row, new_v_row; heads contiguous),
    // stored at out_locs[b] before row b attends; null: already stored
    const float* new_k;
    const float* new_v;
    int64_t new_k_row, new_v_row;
    const int64_t* out_locs;
};

inline void prefetch_row(const void* row, int64_t bytes) {
    const char* at = static_cast<const char*>(row);
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(at + i, 0, 3);
}

// Every token a thread reads, in order: its rows' (windowed) contexts back to back as
// token locations, so a read can be prefetched a fixed distance ahead, across pages and
// rows alike (a decode step's K/V come from memory: the weights evict them between layers).
struct ReadPlan {
    std::vector<int64_t> where;   // token locations
    std::vector<int64_t> row_at;  // row first + r starts at where[row_at[r]]; row_at.back() == where.size()

    template <typename Kv>
    ReadPlan(const Problem<Kv>& p, int64_t first, int64_t last) : row_at(static_cast<size_t>(last - first + 1)) {
        for (int64_t b = first; b < last; ++b) {
            row_at[b - first] = static_cast<int64_t>(where.size());
            const int64_t len = p.kv_lens[b];
            const int64_t start = p.window > 0 ? std::max<int64_t>(0, len - p.window) : 0;
            const int64_t* cols = p.columns + b * p.col_row;
            int64_t column = start / p.unit, offset = start % p.unit;
            for (int64_t j = start; j < len; ++j) {
                where.push_back(cols[column] * p.unit + offset);
                if (++offset == p.unit) offset = 0, ++column;
            }
        }
        row_at[last - first] = static_cast<int64_t>(where.size());
    }
};

// Per row, blocks of TOKEN_BLOCK tokens: the block's scores for every head, one
// online-softmax update per head (flash attention's running maximum and sum), then the
// block's values. Each K and V row is read once; PREFETCH_TOKENS ahead are requested
// meanwhile. No division in the inner loops.
constexpr int64_t TOKEN_BLOCK = 16;
constexpr int64_t PREFETCH_TOKENS = 16;  // measured in a decode step: 2x faster than none, 32 and 64 no better

// a thread's first PREFETCH_TOKENS reads, requested before its first row
template <typename Kv>
void prefetch_start(const Problem<Kv>& p, const ReadPlan& plan, int64_t stride) {
    const int64_t row_bytes = static_cast<int64_t>(sizeof(Kv)) * stride;
    for (int64_t i = 0; i < std::min(plan.row_at.back(), PREFETCH_TOKENS); ++i) {
        prefetch_row(p.k + plan.where[i] * stride, row_bytes);
        prefetch_row(p.v + plan.where[i] * stride, row_bytes);
    }
}

// row b's start, on either path: its new K and V stored first (the last token of its own context);
// false, with zeros written, when its context (n tokens) is empty (never a decode row's)
template <typename Kv>
bool start_row(const Problem<Kv>& p, int64_t b, int64_t n, int64_t stride) {
    if (p.out_locs != nullptr) {
        store_row(p.k + p.out_locs[b] * stride, p.new_k + b * p.new_k_row, stride);
        store_row(p.v + p.out_locs[b] * stride, p.new_v + b * p.new_v_row, stride);
    }
    if (n == 0) {
        float* out = p.out + b * p.heads * p.head_dim;
        std::fill(out, out + p.heads * p.head_dim, 0.0f);
        return false;
    }
    return true;
}

template <typename Kv>
void attend_rows(const Problem<Kv>& p, int64_t first, int64_t last) {
    const int64_t H = p.heads, D = p.head_dim, group = p.heads / p.kv_heads, stride = p.kv_heads * D;
    const int64_t row_bytes = static_cast<int64_t>(sizeof(Kv)) * stride;
    const ReadPlan plan(p, first, last);
    const int64_t planned = plan.row_at.back();
    std::vector<float> scores(static_cast<size_t>(H * TOKEN_BLOCK)), acc(static_cast<size_t>(H * D));
    std::vector<float> totals(static_cast<size_t>(H)), tops(static_cast<size_t>(H));
    std::vector<int64_t> head_offset(static_cast<size_t>(H));
    std::vector<float> wide(std::is_same_v<Kv, float> ? 0 : static_cast<size_t>(stride));  // a widened row
    for (int64_t h = 0; h < H; ++h) head_offset[h] = (h / group) * D;
    prefetch_start(p, plan, stride);
    for (int64_t b = first; b < last; ++b) {
        float* out = p.out + b * H * D;
        const int64_t at = plan.row_at[b - first], n = plan.row_at[b - first + 1] - at;
        if (!start_row(p, b, n, stride)) continue;
        const int64_t* where = plan.where.data() + at;
        const float* qb = p.q + b * p.q_row;
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::fill(totals.begin(), totals.end(), 0.0f);
        std::fill(tops.begin(), tops.end(), -INFINITY);
        for (int64_t lo = 0; lo < n; lo += TOKEN_BLOCK) {
            const int64_t m = std::min(TOKEN_BLOCK, n - lo);
            for (int64_t i = 0; i < m; ++i) {
                const int64_t ahead = at + lo + i + PREFETCH_TOKENS;
                if (ahead < planned) {
                    prefetch_row(p.k + plan.where[ahead] * stride, row_bytes);
                    prefetch_row(p.v + plan.where[ahead] * stride, row_bytes);
                }
                const float* key = as_floats(p.k + where[lo + i] * stride, stride, wide.data());
                for (int64_t h = 0; h < H; ++h) {
                    const float* qh = qb + h * p.q_head;
                    const float* kh = key + head_offset[h];
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
                    scores[h * TOKEN_BLOCK + i] = s * p.scale;
                }
            }
            for (int64_t h = 0; h < H; ++h) {
                float* sc = scores.data() + h * TOKEN_BLOCK;
                float top = tops[h];
                for (int64_t i = 0; i < m; ++i) top = std::max(top, sc[i]);
                if (top > tops[h]) {  // rescale what was summed under the old maximum
                    const float shrink = tops[h] == -INFINITY ? 0.0f : kvlife_native::exp_float(tops[h] - top);
                    float* ah = acc.data() + h * D;
                    for (int64_t d = 0; d < D; ++d) ah[d] *= shrink;
                    totals[h] *= shrink;
                    tops[h] = top;
                }
                float total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int64_t i = 0; i < m; ++i) {
                    sc[i] = kvlife_native::exp_float(sc[i] - top);
                    total += sc[i];
                }
                totals[h] += total;
            }
            for (int64_t i = 0; i < m; ++i) {
                const float* value = as_floats(p.v + where[lo + i] * stride, stride, wide.data());
                for (int64_t h = 0; h < H; ++h) {
                    const float w = scores[h * TOKEN_BLOCK + i];
                    const float* vh = value + head_offset[h];
                    float* ah = acc.data() + h * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) ah[d] += w * vh[d];
                }
            }
        }
        for (int64_t h = 0; h < H; ++h) {
            const float inv = 1.0f / totals[h];
            for (int64_t d = 0; d < D; ++d) out[h * D + d] = acc[h * D + d] * inv;
        }
    }
}

#ifdef KVLIFE_DECODE_AVX512
#include "decode_attention_avx512.h"
#endif  // KVLIFE_DECODE_AVX512

// checks the arguments, then the rows on `threads` threads (row ranges; each row as on one thread)
template <typename Kv>
int decode_attention(const float* q, int64_t q_row, int64_t q_head, Kv* k, Kv* v, const int64_t* columns,
                     int64_t col_row, int64_t unit, const int64_t* kv_lens, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t window, float scale, float* out, int64_t threads,
                     const float* new_k, int64_t new_k_row, const float* new_v, int64_t new_v_row,
                     const int64_t* out_locs) {
    if (rows < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || unit <= 0) return 1;
    const Problem<Kv> p{q, q_row, q_head, k, v, columns, col_row, unit, kv_lens, heads, kv_heads, head_dim, window,
                        scale, out, new_k, new_v, new_k_row, new_v_row, out_locs};
    const int64_t parts = std::max<int64_t>(1, std::min(threads, rows));
#ifdef KVLIFE_DECODE_AVX512
    void (*attend)(const Problem<Kv>&, int64_t, int64_t) = attend_rows_avx512<Kv>;
#else
    void (*attend)(const Problem<Kv>&, int64_t, int64_t) = attend_rows<Kv>;
#endif
    if (parts == 1) {
        attend(p, 0, rows);
        return 0;
    }
    std::vector<std::thread> workers;
    workers.reserve(static_cast<size_t>(parts - 1));
    const int64_t per = (rows + parts - 1) / parts;
    for (int64_t t = 1; t < parts; ++t) {
        const int64_t first = t * per, last = std::min(rows, first + per);
        if (first < last) workers.emplace_back(attend, std::cref(p), first, last);
    }
    attend(p, 0, std::min(rows, per));
    for (auto& w : workers) w.join();
    return 0;
}

}  // namespace

extern "C" {

// Returns 0, or a non-zero code for arguments the kernel does not take (nothing written).
// With out_locs non-null, each row's new K and V (new_k, new_v: [B, KVH, D], row strides given) are
// stored at out_locs[b] of k and v first (the buffers are written: a decode step's K/V store).
int kvlife_decode_attention_f32(const float* q, int64_t q_row, int64_t q_head, float* k, float* v,
                                const int64_t* columns, int64_t col_row, int64_t unit, const int64_t* kv_lens,
                                int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t window,
                                float scale, float* out, int64_t threads, const float* new_k, int64_t new_k_row,
                                const float* new_v, int64_t new_v_row, const int64_t* out_locs) {
    return decode_attention(q, q_row, q_head, k, v, columns, col_row, unit, kv_lens, rows, heads, kv_heads, head_dim,
                            window, scale, out, threads, new_k, new_k_row, new_v, new_v_row, out_locs);
}

// The same over bfloat16 K/V buffers (k, v: the bits, [N, KVH, D]); q, out, new_k and new_v are float32,
// and the new rows are rounded to bfloat16 as they are stored.
int kvlife_decode_attention_bf16kv(const float* q, int64_t q_row, int64_t q_head, uint16_t* k, uint16_t* v,
                                   const int64_t* columns, int64_t col_row, int64_t unit, const int64_t* kv_lens,
                                   int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t window,
                                   float scale, float* out, int64_t threads, const float* new_k, int64_t new_k_row,
                                   const float* new_v, int64_t new_v_row, const int64_t* out_locs) {
    return decode_attention(q, q_row, q_head, k, v, columns, col_row, unit, kv_lens, rows, heads, kv_heads, head_dim,
                            window, scale, out, threads, new_k, new_k_row, new_v, new_v_row, out_locs);
}

}  // extern "C"
