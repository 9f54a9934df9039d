// Decode attention that reads a paged KV cache in place (CPU).
//
// The pure-PyTorch path (attention.py) must first gather every sequence's blocks into one
// contiguous tensor per layer, because SDPA needs each sequence's keys at a single stride: on a
// CPU that copy moves as many bytes as the attention itself reads. This kernel walks the block
// table instead and reads each key and value once.
//
//   q        [S, Hq, D]                    one query token per sequence (decode), contiguous
//   kv_layer [N, 2, Hkv, B, D]             a strided view kv_cache[:, layer]; last dim dense
//   tables   [S, max_blocks] int64         token p of sequence s: block tables[s][p / B],
//                                          offset p % B (row stride s_tab, dense rows)
//   lens     [S] int64                     keys [0, lens[s]) are attended
//   out      [S, Hq, D]                    contiguous
//
// Query head hq reads kv head hq / G (G = Hq / Hkv, Hugging Face's repeat_kv order); one work
// item is a (sequence, kv head) pair with its G query heads, so each key is read once for all
// of them. Softmax in two passes over a per-item score buffer, all arithmetic in float.
//
// A plain C ABI over raw pointers, strides and sizes (no torch headers, so it compiles in a
// second or two): kernels.py checks dtypes, layouts and devices and calls it through ctypes.
// Work items are split over threads as at::parallel_for does with torch's OpenMP backend.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "half.h"
#include "parallel_for.h"

namespace {

using disagg_half::bf16;
using disagg_half::f16;
using disagg_half::from_float;

// q and out of T, the cache of C (T itself, or a 16-bit cache under float32 queries).
template <typename T, typename C>
void decode(const T* qp, const C* kvp, const int64_t* tab, const int64_t* lp, T* op, int64_t S,
            int64_t Hq, int64_t D, int64_t Hkv, int64_t B, int64_t s_blk, int64_t s_kv,
            int64_t s_h, int64_t s_tok, int64_t s_tab, float fscale, int threads) {
  const int64_t G = Hq / Hkv;
  disagg::parallel_for(0, S * Hkv, 1, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, inv(G), row(D);  // row: a 16-bit key
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / Hkv, h = item % Hkv;
      const int64_t L = lp[s];
      scores.resize(static_cast<size_t>(G * L));
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = qp + (s * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qrow[d]) * fscale;
      }
      // Pass 1: scores[g][t] = q_g . k_t
      for (int64_t t0 = 0; t0 < L; t0 += B) {
        const int64_t blk = tab[s * s_tab + t0 / B];
        const C* kb = kvp + blk * s_blk + h * s_h;  // K of this block and head
        const int64_t n = std::min(B, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const float* k = disagg_half::as_floats(kb + j * s_tok, row.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float a = 0.f;
#pragma omp simd reduction(+ : a)
            for (int64_t d = 0; d < D; ++d) a += qg[d] * k[d];
            scores[g * L + t0 + j] = a;
          }
        }
      }
      // Softmax numerators in place; 1 / denominators in inv.
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sc[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        inv[g] = 1.f / sum;
      }
      // Pass 2: acc[g] = sum_t p[g][t] * v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += B) {
        const int64_t blk = tab[s * s_tab + t0 / B];
        const C* vb = kvp + blk * s_blk + s_kv + h * s_h;  // V of this block and head
        const int64_t n = std::min(B, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const float* v = disagg_half::as_floats(vb + j * s_tok, row.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * L + t0 + j];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* orow = op + (s * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = from_float<T>(acc[g * D + d] * inv[g]);
      }
    }
  });
}

}  // namespace

// The kernel's C entry point; dtype (q and out) and kv_dtype (the cache): 0 float32,
// 1 float64, 2 bfloat16, 3 float16, the same for both or a float32 q over a 16-bit cache.
// Returns 0, or before touching anything: 1 a sequence length out of range of its block table,
// 2 a block id out of range [0, N), 3 an unknown dtype or pair.
extern "C" int disagg_paged_decode_attention(
    const void* q, const void* kv, const int64_t* tables, const int64_t* lens, void* out,
    int dtype, int kv_dtype, int64_t S, int64_t Hq, int64_t D, int64_t Hkv, int64_t B, int64_t N,
    int64_t s_blk, int64_t s_kv, int64_t s_h, int64_t s_tok, int64_t s_tab, int64_t max_blocks,
    double scale, int threads) {
  // Checked here, not in the parallel loop: a bad id would read outside the cache.
  for (int64_t s = 0; s < S; ++s) {
    if (!(lens[s] >= 1 && lens[s] <= max_blocks * B)) return 1;
    for (int64_t i = 0; i < (lens[s] + B - 1) / B; ++i) {
      const int64_t blk = tables[s * s_tab + i];
      if (!(blk >= 0 && blk < N)) return 2;
    }
  }
  const float fscale = static_cast<float>(scale);
#define DISAGG_DECODE(T, C)                                                                 \
  decode<T, C>(static_cast<const T*>(q), static_cast<const C*>(kv), tables, lens,           \
               static_cast<T*>(out), S, Hq, D, Hkv, B, s_blk, s_kv, s_h, s_tok, s_tab,      \
               fscale, threads)
  if (kv_dtype == dtype) {
    switch (dtype) {
      case 0: DISAGG_DECODE(float, float); return 0;
      case 1: DISAGG_DECODE(double, double); return 0;
      case 2: DISAGG_DECODE(bf16, bf16); return 0;
      case 3: DISAGG_DECODE(f16, f16); return 0;
      default: return 3;
    }
  }
  if (dtype == 0 && kv_dtype == 2) return DISAGG_DECODE(float, bf16), 0;
  if (dtype == 0 && kv_dtype == 3) return DISAGG_DECODE(float, f16), 0;
  return 3;
#undef DISAGG_DECODE
}
