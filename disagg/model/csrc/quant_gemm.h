// Linear layers on GGUF blocks with the input rows quantized to 8 bits (CPU), as llama.cpp
// multiplies them: out[M, N] = x[M, K] @ W[N, K]^T, W kept as the file's blocks of 32.
//
// Weight blocks, one row after another (row n = K / 32 blocks, `row_bytes` apart):
//
//   Q4_0  { f16 d;          u8 qs[16] }  18 bytes   w_j = d (c_j - 8)
//   Q4_1  { f16 d; f16 m;   u8 qs[16] }  20 bytes   w_j = d c_j + m
//   Q4F   { f32 d; f32 m;   u8 qs[16] }  24 bytes   w_j = d c_j + m  (Q4_K's sub-blocks: d sc,
//                                                                    -dmin mn need float32)
//   Q8_0  { f16 d;          i8 qs[32] }  34 bytes   w_j = d q_j
//
// (the 4-bit codes c_j: element j in the low nibble of qs[j], element j + 16 in the high one;
// Q4_0, Q4_1 and Q8_0 are the file's bytes as they are).
//
// Each input row is first quantized per block of 32 (`XBlock`: dx = max|x| / 127, q_j =
// round(x_j / dx), sx = dx * sum q_j); a block's product is then an integer dot of 32 bytes:
//
//   Q4_0: d dx sum c_j q_j - 8 d sx      Q4_1 / Q4F: d dx sum c_j q_j + m sx
//   Q8_0: d dx sum w_j q_j
//
// On AVX2 the 32 products are one maddubs (u8 x s8 -> pairs of i16) and one madd (-> 8 i32),
// or one dpbusd with AVX-512 VNNI (or AVX-VNNI); Q8_0's signed weights go through the sign
// trick (|w| x sign(q, w)). The block's 8 int32 lanes become floats scaled by d dx into a float
// accumulator; one horizontal sum per output. Without AVX2 a scalar loop computes the same
// integers (the same results up to the float accumulation order).
//
// Tiling: each weight row (all its blocks) is read once and dotted with up to `kTileRows`
// input rows while it is in L1; rows are split over threads as at::parallel_for does. The
// weights of a row a few rows ahead are prefetched (as small_gemm.cpp's kernels do).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "half.h"
#include "parallel_for.h"

namespace disagg_quant {

constexpr int QK = 32;

enum BlockType : int { kQ4_0 = 0, kQ4_1 = 1, kQ4F = 2, kQ8_0 = 3 };

inline int block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ4F: return 24;
    case kQ8_0: return 34;
    default: return 0;
  }
}

// A block's scale (IEEE half) as float: half.h's conversion (F16C where there is one).
inline float f16_to_f32(uint16_t h) { return static_cast<float>(disagg_half::f16{h}); }

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// One input block: its scale, its scale times the sum of its codes, and the codes.
struct XBlock {
  float d;
  float s;
  int8_t q[QK];
};

// Row of K floats -> K / 32 XBlocks (round to nearest, ties away from zero, as roundf).
inline void quantize_row(const float* x, int64_t K, XBlock* out) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * id));
      out[b].q[j] = static_cast<int8_t>(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

#if defined(__AVX2__)
// 8 int32 lanes: sums of 4 products u8 (a) x s8 (b) each.
inline __m256i dot_u8s8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

inline __m256i load_x(const XBlock& xb) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
}

// The 32 codes of a 4-bit block, in element order: low nibbles, then high ones.
inline __m256i unpack_q4(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
  return _mm256_set_m128i(hi, lo);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// The scalar integer dot of a block (the reference of the SIMD paths).
inline int dot_block_scalar(const uint8_t* qs, bool q8, const int8_t* xq) {
  int sum = 0;
  if (q8) {
    const int8_t* w = reinterpret_cast<const int8_t*>(qs);
    for (int j = 0; j < QK; ++j) sum += int(w[j]) * int(xq[j]);
  } else {
    for (int j = 0; j < QK / 2; ++j)
      sum += int(qs[j] & 0x0F) * int(xq[j]) + int(qs[j] >> 4) * int(xq[j + QK / 2]);
  }
  return sum;
}

// out[m * ldo] for TM input rows (xb + m * KB) and weight row w (KB blocks of type T).
template <int T, int TM>
inline void row_dot(const uint8_t* __restrict w, int64_t KB, const XBlock* __restrict xb,
                    float* __restrict out, int64_t ldo) {
  constexpr int bytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ4F ? 24 : 34;
  constexpr int head = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ4F ? 8 : 2;
#if defined(__AVX2__)
  __m256 acc[TM];
  for (int m = 0; m < TM; ++m) acc[m] = _mm256_setzero_ps();
#else
  float acc[TM] = {};
#endif
  float macc[TM] = {};  // the offset term: m sx (Q4_1, Q4F) or -8 d sx (Q4_0)
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = w + b * bytes;
    float d, mw = 0.f;
    if constexpr (T == kQ4F) {
      d = load_f32(blk);
      mw = load_f32(blk + 4);
    } else {
      d = f16_to_f32(load_u16(blk));
      if constexpr (T == kQ4_1) mw = f16_to_f32(load_u16(blk + 2));
      if constexpr (T == kQ4_0) mw = -8.f * d;
    }
    const uint8_t* qs = blk + head;
#if defined(__AVX2__)
    __m256i wv, wabs = _mm256_setzero_si256();
    if constexpr (T == kQ8_0) {
      wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
      wabs = _mm256_sign_epi8(wv, wv);
    } else {
      wv = unpack_q4(qs);
    }
    for (int m = 0; m < TM; ++m) {
      const XBlock& x = xb[m * KB + b];
      __m256i p;
      if constexpr (T == kQ8_0)
        p = dot_u8s8(wabs, _mm256_sign_epi8(load_x(x), wv));
      else
        p = dot_u8s8(wv, load_x(x));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x.d), acc[m]);
      if constexpr (T != kQ8_0) macc[m] += mw * x.s;
    }
#else
    for (int m = 0; m < TM; ++m) {
      const XBlock& x = xb[m * KB + b];
      acc[m] += d * x.d * static_cast<float>(dot_block_scalar(qs, T == kQ8_0, x.q));
      if constexpr (T != kQ8_0) macc[m] += mw * x.s;
    }
#endif
  }
  for (int m = 0; m < TM; ++m) {
#if defined(__AVX2__)
    out[m * ldo] = hsum8(acc[m]) + macc[m];
#else
    out[m * ldo] = acc[m] + macc[m];
#endif
  }
}

constexpr int kTileRows = 4;      // input rows dotted with a weight row while it is in L1
constexpr int64_t kPrefetchBytes = 49152;  // weights prefetched this far ahead (as small_gemm)

// out[M, N] (+ bias) = x-blocks [M, KB] @ W^T for the weight rows [n0, n1).
template <int T>
inline void rows_range(const uint8_t* w, int64_t row_bytes, int64_t KB, const XBlock* xb,
                       int64_t M, const float* bias, float* out, int64_t ldo, int64_t n0,
                       int64_t n1) {
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / row_bytes);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * row_bytes;
    if (n + ahead < n1) {
      const uint8_t* pf = wn + ahead * row_bytes;
      for (int64_t j = 0; j < row_bytes; j += 64) __builtin_prefetch(pf + j, 0, 3);
    }
    int64_t m = 0;
    for (; m + kTileRows <= M; m += kTileRows)
      row_dot<T, kTileRows>(wn, KB, xb + m * KB, out + m * ldo + n, ldo);
    switch (M - m) {
      case 1: row_dot<T, 1>(wn, KB, xb + m * KB, out + m * ldo + n, ldo); break;
      case 2: row_dot<T, 2>(wn, KB, xb + m * KB, out + m * ldo + n, ldo); break;
      case 3: row_dot<T, 3>(wn, KB, xb + m * KB, out + m * ldo + n, ldo); break;
      default: break;
    }
    if (bias)
      for (int64_t mm = 0; mm < M; ++mm) out[mm * ldo + n] += bias[n];
  }
}

// Input rows already quantized (xb: M rows of K / 32 blocks) -> out[M, N] (row stride ldo).
inline void gemm_quantized_x(int type, const uint8_t* w, int64_t N, int64_t K,
                             const XBlock* xb, int64_t M, const float* bias, float* out,
                             int64_t ldo, int threads) {
  const int64_t KB = K / QK, row_bytes = KB * block_bytes(type);
  // at least ~32 KB of weights per thread's chunk
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_bytes));
  disagg::parallel_for(0, N, grain, threads, [&](int64_t n0, int64_t n1) {
    switch (type) {
      case kQ4_0: rows_range<kQ4_0>(w, row_bytes, KB, xb, M, bias, out, ldo, n0, n1); break;
      case kQ4_1: rows_range<kQ4_1>(w, row_bytes, KB, xb, M, bias, out, ldo, n0, n1); break;
      case kQ4F: rows_range<kQ4F>(w, row_bytes, KB, xb, M, bias, out, ldo, n0, n1); break;
      case kQ8_0: rows_range<kQ8_0>(w, row_bytes, KB, xb, M, bias, out, ldo, n0, n1); break;
      default: break;
    }
  });
}

// Quantize M rows of x (row stride ldx) into xb (M * K / 32 blocks).
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, XBlock* xb,
                          int threads) {
  const int64_t KB = K / QK;
  disagg::parallel_for(0, M, 16, threads, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * ldx, K, xb + m * KB);
  });
}

// out[M, N] (row stride N) = x[M, K] (row stride ldx) @ W^T (+ bias): x's rows quantized into
// xb (grown as needed, reused by the caller) first.
inline void linear(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
                   int type, int64_t N, const float* bias, float* out, std::vector<XBlock>& xb,
                   int threads) {
  xb.resize(static_cast<size_t>(M * (K / QK)));
  quantize_rows(x, M, K, ldx, xb.data(), threads);
  gemm_quantized_x(type, w, N, K, xb.data(), M, bias, out, N, threads);
}

// A block's 32 weights (computed in float32) stored as Out.
inline void store_block(float* o, const float* v) { std::memcpy(o, v, sizeof(float) * QK); }
inline void store_block(uint16_t* o, const float* v) {
  for (int j = 0; j < QK; ++j) o[j] = disagg_half::to_bf16(v[j]).x;  // branch-free: vectorised
}

// The weights of rows [n0, n1) -> out[(n1 - n0), K], float32 or (uint16_t) bfloat16.
template <typename Out>
inline void dequantize_rows(int type, const uint8_t* w, int64_t K, int64_t n0, int64_t n1,
                            Out* out, int threads) {
  const int64_t KB = K / QK, bytes = block_bytes(type), row_bytes = KB * bytes;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K));
  disagg::parallel_for(n0, n1, grain, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n)
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* blk = w + n * row_bytes + b * bytes;
        Out* o = out + (n - n0) * K + b * QK;
        float v[QK];
        if (type == kQ8_0) {
          const float d = f16_to_f32(load_u16(blk));
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          for (int j = 0; j < QK; ++j) v[j] = d * static_cast<float>(q[j]);
          store_block(o, v);
          continue;
        }
        float d, mw;
        const uint8_t* qs;
        if (type == kQ4F) {
          d = load_f32(blk), mw = load_f32(blk + 4), qs = blk + 8;
        } else if (type == kQ4_1) {
          d = f16_to_f32(load_u16(blk)), mw = f16_to_f32(load_u16(blk + 2)), qs = blk + 4;
        } else {
          d = f16_to_f32(load_u16(blk)), mw = -8.f * d, qs = blk + 2;
        }
        for (int j = 0; j < QK / 2; ++j) {
          // Q4_0: d (c - 8) exactly (d c - 8 d may round differently): as the file means it
          v[j] = type == kQ4_0 ? d * static_cast<float>((qs[j] & 0x0F) - 8)
                               : d * static_cast<float>(qs[j] & 0x0F) + mw;
          v[j + QK / 2] = type == kQ4_0 ? d * static_cast<float>((qs[j] >> 4) - 8)
                                        : d * static_cast<float>(qs[j] >> 4) + mw;
        }
        store_block(o, v);
      }
  });
}

}  // namespace disagg_quant
