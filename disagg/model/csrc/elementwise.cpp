// The elementwise work around a decoder layer's linears on the CPU, one call each instead of a
// chain of small PyTorch ops (a dispatch, an allocation and a pass over the data each; for a
// decode step of one token the dispatches are the cost):
//
//   disagg_add_rms_norm  h = residual + x (x alone when there is no residual);
//                        out = weight * (h * (1 / sqrt(mean(h^2) + eps)))
//                        rows [rows, dim]; x and residual at any row stride, dense rows;
//                        out and h contiguous. The sum of squares is accumulated in double
//                        (PyTorch's float reduction orders its sum differently: the result
//                        differs from rms_norm_reference in the last bits, not more).
//
//   disagg_rope_store    RoPE of the q and k heads of each token, in place (rotate_half:
//                        dims [0, D/2) pair with [D/2, D)), then the token's k and v heads
//                        written into the paged KV cache at (slot_block[t], slot_offset[t]):
//                          qk  [T, Hq + Hkv, D] at row stride s_qk, heads dense
//                          v   [T, Hkv, D] at row stride s_v, heads dense
//                          cos, sin [T, D] contiguous
//                          kv  [N, 2, Hkv, B, D] strided (s_blk, s_kv, s_h, s_tok), last dim dense;
//                              float32, bfloat16 or float16 (kv_dtype: half.h's codes)
//                        The arithmetic is apply_rope's, product by product and rounded the
//                        same way (no fused multiply-add: see the pragma below), so q, k and
//                        the cache hold the bits the PyTorch path writes (a 16-bit cache: the
//                        float32 values rounded to nearest even, as write_kv's .to()).
//
// q, k, v float32 (the CPU engine's dtype). A plain C ABI over raw pointers, strides and sizes,
// as the other kernels here; cpu_ops.py checks dtypes, layouts and devices.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "parallel_for.h"

// x * c + y * s must round each product, as PyTorch's separate mul and add kernels do.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

// Rows per thread below which a call stays on one thread (a decode step's 1..32 rows).
constexpr int64_t kGrainRows = 64;
constexpr int64_t kMaxHeadDim = 1024;

void add_rms_norm_rows(const float* x, int64_t s_x, const float* r, int64_t s_r,
                       const float* w, float* out, float* h, int64_t begin, int64_t end,
                       int64_t dim, float eps) {
  for (int64_t row = begin; row < end; ++row) {
    const float* xr = x + row * s_x;
    const float* hr = xr;
    if (r != nullptr) {
      const float* rr = r + row * s_r;
      float* hw = h + row * dim;
      for (int64_t i = 0; i < dim; ++i) hw[i] = rr[i] + xr[i];
      hr = hw;
    }
    // Four partial sums: independent chains (the loop is latency bound otherwise).
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    for (; i + 4 <= dim; i += 4) {
      for (int k = 0; k < 4; ++k) {
        const double v = hr[i + k];
        acc[k] += v * v;
      }
    }
    for (; i < dim; ++i) acc[0] += static_cast<double>(hr[i]) * hr[i];
    const float mean = static_cast<float>(((acc[0] + acc[1]) + (acc[2] + acc[3])) / dim);
    const float inv = 1.0f / std::sqrt(mean + eps);
    float* o = out + row * dim;
    for (int64_t j = 0; j < dim; ++j) o[j] = w[j] * (hr[j] * inv);
  }
}

}  // namespace

extern "C" void disagg_add_rms_norm(const float* x, int64_t s_x, const float* residual,
                                    int64_t s_r, const float* weight, float* out, float* h,
                                    int64_t rows, int64_t dim, double eps, int threads) {
  const float feps = static_cast<float>(eps);
  disagg::parallel_for(0, rows, kGrainRows, threads, [&](int64_t b, int64_t e) {
    add_rms_norm_rows(x, s_x, residual, s_r, weight, out, h, b, e, dim, feps);
  });
}

namespace {

// disagg_rope_store's rows [b, e) into a cache of C (float, or 16-bit: each value rounded to
// nearest even, as write_kv's .to(cache dtype)).
template <typename C>
void rope_store_rows(float* qk, int64_t s_qk, const float* v, int64_t s_v, const float* cos,
                     const float* sin, C* kv, int64_t Hq, int64_t Hkv, int64_t D,
                     int64_t s_blk, int64_t s_kv, int64_t s_h, int64_t s_tok,
                     const int64_t* slot_block, const int64_t* slot_offset, int64_t b,
                     int64_t e) {
  const int64_t half = D / 2;
  float tmp[kMaxHeadDim];
  for (int64_t t = b; t < e; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    C* cache = kv + slot_block[t] * s_blk + slot_offset[t] * s_tok;
    for (int64_t hd = 0; hd < Hq + Hkv; ++hd) {
      float* x = qk + t * s_qk + hd * D;
      for (int64_t j = 0; j < half; ++j) tmp[j] = x[j] * c[j] - x[j + half] * s[j];
      for (int64_t j = half; j < D; ++j) tmp[j] = x[j] * c[j] + x[j - half] * s[j];
      std::memcpy(x, tmp, sizeof(float) * D);
      if (hd >= Hq) disagg_half::store_row(tmp, cache + (hd - Hq) * s_h, D);
    }
    for (int64_t hd = 0; hd < Hkv; ++hd)
      disagg_half::store_row(v + t * s_v + hd * D, cache + s_kv + hd * s_h, D);
  }
}

}  // namespace

// Returns 0, or before writing anything: 1 a block id out of range [0, N), 2 an offset out
// of range [0, B), 3 an odd or too large head dim, 5 an unknown cache type.
extern "C" int disagg_rope_store(float* qk, int64_t s_qk, const float* v, int64_t s_v,
                                 const float* cos, const float* sin, void* kv, int kv_dtype,
                                 int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t N,
                                 int64_t B, int64_t s_blk, int64_t s_kv, int64_t s_h,
                                 int64_t s_tok, const int64_t* slot_block,
                                 const int64_t* slot_offset, int threads) {
  if (D % 2 != 0 || D > kMaxHeadDim) return 3;
  if (kv_dtype != disagg_half::kF32 && kv_dtype != disagg_half::kBF16 &&
      kv_dtype != disagg_half::kF16)
    return 5;
  for (int64_t t = 0; t < T; ++t) {
    if (!(slot_block[t] >= 0 && slot_block[t] < N)) return 1;
    if (!(slot_offset[t] >= 0 && slot_offset[t] < B)) return 2;
  }
  disagg::parallel_for(0, T, kGrainRows, threads, [&](int64_t b, int64_t e) {
#define DISAGG_ROPE_STORE(C)                                                                \
  rope_store_rows(qk, s_qk, v, s_v, cos, sin, static_cast<C*>(kv), Hq, Hkv, D, s_blk, s_kv, \
                  s_h, s_tok, slot_block, slot_offset, b, e)
    if (kv_dtype == disagg_half::kF32)
      DISAGG_ROPE_STORE(float);
    else if (kv_dtype == disagg_half::kBF16)
      DISAGG_ROPE_STORE(disagg_half::bf16);
    else
      DISAGG_ROPE_STORE(disagg_half::f16);
#undef DISAGG_ROPE_STORE
  });
  return 0;
}
