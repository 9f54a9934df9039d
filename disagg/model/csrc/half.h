// 16-bit floats as torch stores them (bfloat16 and IEEE half), for the kernels that read and
// write a KV cache of those types while computing in float: conversions bit for bit those of
// c10::BFloat16 / c10::Half (round to nearest even; a NaN stays a NaN), one value at a time
// and a row at a time (vectorised where the CPU has F16C / AVX-512).
//
// Cache element codes shared with the Python wrappers: 0 float32, 2 bfloat16, 3 float16
// (1, float64, is the paged decode kernel's q dtype only).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace disagg_half {

enum CacheType : int { kF32 = 0, kBF16 = 2, kF16 = 3 };

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

struct bf16 {
  uint16_t x;
  operator float() const { return bits_f32(static_cast<uint32_t>(x) << 16); }
};
struct f16 {
  uint16_t x;
  operator float() const;
};

// Round to nearest even; NaN -> 0x7FC0 (c10's). A select, not a branch: loops over it vectorise.
inline bf16 to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1)) >> 16;
  return bf16{static_cast<uint16_t>((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000)
                                        ? UINT32_C(0x7FC0) : rounded)};
}

#if defined(__F16C__)
inline f16::operator float() const { return _cvtsh_ss(x); }
inline f16 to_f16(float f) {
  return f16{static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
}
#else
// c10's portable conversions (from the FP16 library), exact / round to nearest even.
inline f16::operator float() const {
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

// dst[i] = float(src[i]), i < n.
template <typename C> inline void load_row(const C* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <> inline void load_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, sizeof(float) * n);
}
#if defined(__F16C__)
template <> inline void load_row<f16>(const f16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

// Row p of n values as floats: p itself for a float row, else converted into buf (n floats).
template <typename C> inline const float* as_floats(const C* p, float* buf, int64_t n) {
  load_row(p, buf, n);
  return buf;
}
template <> inline const float* as_floats<float>(const float* p, float*, int64_t) { return p; }

// dst[i] = C(src[i]) rounded to nearest even, i < n.
template <typename C> inline void store_row(const float* src, C* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<C>(src[i]);
}
template <> inline void store_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, sizeof(float) * n);
}
#if defined(__F16C__)
template <> inline void store_row<f16>(const float* src, f16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = to_f16(src[i]);
}
#endif

}  // namespace disagg_half
