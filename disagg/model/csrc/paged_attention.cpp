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

#include "parallel_for.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// bfloat16 and IEEE half as torch stores them, converted as c10::BFloat16 / c10::Half do.
struct bf16 {
  uint16_t x;
  operator float() const {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
};
struct f16 {
  uint16_t x;
  operator float() const;
};

inline bf16 to_bf16(float f) {  // round to nearest even; NaN -> 0x7FC0 (c10's)
  if (std::isnan(f)) return bf16{0x7FC0};
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounding_bias = ((u >> 16) & 1) + UINT32_C(0x7FFF);
  return bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

#if defined(__F16C__)
f16::operator float() const { return _cvtsh_ss(x); }
inline f16 to_f16(float f) {
  return f16{static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
}
#else
// c10's portable conversions (from the FP16 library), exact / round to nearest even.
f16::operator float() const {
  const uint32_t w = static_cast<uint32_t>(x) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = UINT32_C(0xE0) << 23;
  const float exp_scale = bits_f32(UINT32_C(0x7800000));
  const float normalized = bits_f32((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = UINT32_C(126) << 23;
  const float magic_bias = 0.5f;
  const float denormalized = bits_f32((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_bits(denormalized) : f32_bits(normalized));
  return bits_f32(result);
}
inline f16 to_f16(float f) {
  const float scale_to_inf = bits_f32(UINT32_C(239) << 23);
  const float scale_to_zero = bits_f32(UINT32_C(17) << 23);
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
  base = bits_f32((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return f16{static_cast<uint16_t>((sign >> 16) |
                                   (shl1_w > UINT32_C(0xFF000000) ? UINT16_C(0x7E00) : nonsign))};
}
#endif

template <typename T> inline T from_float(float f) { return static_cast<T>(f); }
template <> inline bf16 from_float<bf16>(float f) { return to_bf16(f); }
template <> inline f16 from_float<f16>(float f) { return to_f16(f); }

template <typename T>
void decode(const T* qp, const T* kvp, const int64_t* tab, const int64_t* lp, T* op, int64_t S,
            int64_t Hq, int64_t D, int64_t Hkv, int64_t B, int64_t s_blk, int64_t s_kv,
            int64_t s_h, int64_t s_tok, int64_t s_tab, float fscale, int threads) {
  const int64_t G = Hq / Hkv;
  disagg::parallel_for(0, S * Hkv, 1, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, inv(G);
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
        const T* kb = kvp + blk * s_blk + h * s_h;  // K of this block and head
        const int64_t n = std::min(B, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const T* k = kb + j * s_tok;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float a = 0.f;
#pragma omp simd reduction(+ : a)
            for (int64_t d = 0; d < D; ++d) a += qg[d] * static_cast<float>(k[d]);
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
        const T* vb = kvp + blk * s_blk + s_kv + h * s_h;  // V of this block and head
        const int64_t n = std::min(B, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const T* v = vb + j * s_tok;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * L + t0 + j];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(v[d]);
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

// The kernel's C entry point; dtype: 0 float32, 1 float64, 2 bfloat16, 3 float16.
// Returns 0, or before touching anything: 1 a sequence length out of range of its block table,
// 2 a block id out of range [0, N), 3 an unknown dtype.
extern "C" int disagg_paged_decode_attention(
    const void* q, const void* kv, const int64_t* tables, const int64_t* lens, void* out,
    int dtype, int64_t S, int64_t Hq, int64_t D, int64_t Hkv, int64_t B, int64_t N,
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
#define DISAGG_DECODE(T)                                                                    \
  decode<T>(static_cast<const T*>(q), static_cast<const T*>(kv), tables, lens,              \
            static_cast<T*>(out), S, Hq, D, Hkv, B, s_blk, s_kv, s_h, s_tok, s_tab, fscale, \
            threads)
  switch (dtype) {
    case 0: DISAGG_DECODE(float); return 0;
    case 1: DISAGG_DECODE(double); return 0;
    case 2: DISAGG_DECODE(bf16); return 0;
    case 3: DISAGG_DECODE(f16); return 0;
    default: return 3;
  }
#undef DISAGG_DECODE
}
