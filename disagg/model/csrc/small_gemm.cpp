// Linear layer for few rows (CPU): out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]).
//
// A decode step multiplies a handful of token rows by every weight matrix. BLAS GEMMs
// (MKL / oneDNN) are tuned for large M; with M = 2..16 they run well below both the memory
// bound (the weights stream from DRAM once per step, whatever M is) and the FMA bound. Here
// each weight row is read once and dotted with all M input rows while it is in L1:
//
//   for each tile of NB = 3 weight rows (6 when M = 1):
//     for each tile of MB = 4 input rows (then a 1..3-row remainder):
//       acc[NB][MB] (one SIMD vector each, in registers) += w[n][k..k+V] * x[m][k..k+V]
//       over k; then a horizontal sum per (n, m), a scalar tail for K % V, the bias.
//
// 12 accumulators + 3 weight vectors + 1 input vector = the 16 vector registers of AVX2:
// 7 loads per 12 multiply-adds. While a tile's rows are read the first time (from DRAM),
// for short rows the rows about 48 KB ahead are prefetched, which keeps the memory stream
// going during the arithmetic. Vectors are GCC / Clang vector extensions, lowered to whatever
// -march=native offers. Work is split over weight rows as at::parallel_for does with torch's
// OpenMP backend, on torch's thread count (passed in). Float32 only; the summation order
// differs from BLAS, so results agree to rounding.
//
//   x     [M, K] float32, unit stride along K (rows ldx floats apart)
//   w     [N, K] float32, contiguous
//   bias  [N] float32, or null
//   out   [M, N] float32, contiguous
//
// A plain C ABI over raw pointers and sizes (no torch headers, so it compiles in a second or
// two): kernels.py checks dtypes, layouts and devices and calls it through ctypes.
//
// GGUF quantized blocks (Q4_0, Q4_1, Q4_K's sub-blocks, Q8_0) have their own kernel,
// quant_gemm.h, exported at the end (disagg_quant_linear).

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel_for.h"

namespace {

#if defined(__AVX512F__)
constexpr int V = 16;  // floats per vector
#else
constexpr int V = 8;
#endif
typedef float vfloat __attribute__((vector_size(V * sizeof(float))));

constexpr int NB = 3;           // weight rows per tile
constexpr int MB = 4;           // input rows per tile
constexpr int NB1 = 6;          // weight rows per tile when there is a single input row
// Software prefetch of the weights, about 48 KB ahead, for tiles of at most 18 KB (short
// rows). Measured on a Zen 3 core: it makes K = 512..1408 up to 1.5x faster from DRAM, but
// slows long rows (K >= 2048, or 6 rows of 1408), which the hardware prefetcher streams well.
constexpr int kPrefetchFloats = 12288;
constexpr int kPrefetchMaxTileFloats = 4608;
constexpr int kPrefetchLocality = 3;  // __builtin_prefetch's: 3 = into L1

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

inline float hsum(vfloat v) {  // pairwise, halves added as vectors
  float a[V];
  std::memcpy(a, &v, sizeof(v));
  for (int h = V / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) a[i] += a[i + h];
  return a[0];
}

// out[m][n] (row stride ldo) for TN weight rows at w and TM input rows at x (row stride
// ldx). pf: when set, pf[0, pf_len) is prefetched along the way.
template <int TN, int TM>
inline void tile(const float* __restrict w, const float* __restrict x, int64_t K,
                 int64_t ldx, const float* bias, float* __restrict out, int64_t ldo,
                 const float* pf, int64_t pf_len) {
  vfloat acc[TN][TM];
  for (int n = 0; n < TN; ++n)
    for (int m = 0; m < TM; ++m) acc[n][m] = vfloat{};
  const int64_t Kv = K - K % V;
  for (int64_t k = 0; k < Kv; k += V) {
    vfloat wv[TN];
    for (int n = 0; n < TN; ++n) wv[n] = load(w + n * K + k);
    if (pf) {  // the next rows are TN * K contiguous floats: TN * V of them per step
      for (int64_t j = k * TN; j < (k + V) * TN && j < pf_len; j += 16)
        __builtin_prefetch(pf + j, 0, kPrefetchLocality);
    }
    for (int m = 0; m < TM; ++m) {
      vfloat xv = load(x + m * ldx + k);
#if defined(__x86_64__) && defined(__AVX__)
      // Keep x in a register: without this GCC folds its load into each of the TN
      // multiply-adds, and the loop becomes load-bound.
      asm("" : "+x"(xv));
#endif
      for (int n = 0; n < TN; ++n) acc[n][m] += wv[n] * xv;
    }
  }
  for (int n = 0; n < TN; ++n) {
    for (int m = 0; m < TM; ++m) {
      float s = hsum(acc[n][m]);
      for (int64_t k = Kv; k < K; ++k) s += w[n * K + k] * x[m * ldx + k];
      out[m * ldo + n] = bias ? s + bias[n] : s;
    }
  }
}

// TN weight rows at wn against all M rows of x: tiles of MB rows, then the remainder.
template <int TN>
inline void row_tile(const float* wn, const float* x, int64_t M, int64_t K, int64_t ldx,
                     const float* bn, float* on, int64_t N, const float* pf, int64_t pf_len) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB) {
    tile<TN, MB>(wn, x + m * ldx, K, ldx, bn, on + m * N, N, pf, pf_len);
    pf = nullptr;  // prefetch during the first pass only (the one that reads from memory)
  }
  const float* xm = x + m * ldx;
  float* om = on + m * N;
  static_assert(MB == 4, "the remainder below handles 1..3 rows");
  switch (M - m) {
    case 1: tile<TN, 1>(wn, xm, K, ldx, bn, om, N, pf, pf_len); break;
    case 2: tile<TN, 2>(wn, xm, K, ldx, bn, om, N, pf, pf_len); break;
    case 3: tile<TN, 3>(wn, xm, K, ldx, bn, om, N, pf, pf_len); break;
    default: break;
  }
}

// Weight rows [n0, n1) against all M rows of x, in tiles of TN rows.
template <int TN>
void rows(const float* w, const float* x, int64_t M, int64_t K, int64_t ldx,
          const float* bias, float* out, int64_t N, int64_t n0, int64_t n1) {
  const bool prefetch = TN * K <= kPrefetchMaxTileFloats;
  const int64_t ahead = TN * ((kPrefetchFloats + TN * K - 1) / (TN * K));  // whole tiles
  int64_t n = n0;
  for (; n + TN <= n1; n += TN) {
    const int64_t p0 = prefetch ? std::min(N, n + ahead) : N, p1 = std::min(N, p0 + TN);
    row_tile<TN>(w + n * K, x, M, K, ldx, bias ? bias + n : nullptr, out + n, N,
                 p1 > p0 ? w + p0 * K : nullptr, (p1 - p0) * K);
  }
  for (; n < n1; ++n)
    row_tile<1>(w + n * K, x, M, K, ldx, bias ? bias + n : nullptr, out + n, N, nullptr, 0);
}

template <int TN>
void run(const float* w, const float* x, int64_t M, int64_t K, int64_t ldx, const float* bias,
         float* out, int64_t N, int threads) {
  // Parallel over tiles of TN weight rows; a chunk of at least ~64K multiply-adds.
  const int64_t tiles = (N + TN - 1) / TN;
  const int64_t per_tile = std::max<int64_t>(1, M * K * TN);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_tile);
  disagg::parallel_for(0, tiles, grain, threads, [&](int64_t t0, int64_t t1) {
    rows<TN>(w, x, M, K, ldx, bias, out, N, t0 * TN, std::min(N, t1 * TN));
  });
}

}  // namespace

// The kernel's C entry point: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), on `threads` threads.
extern "C" void disagg_small_linear(const float* x, const float* w, const float* bias,
                                    float* out, int64_t M, int64_t K, int64_t N, int64_t ldx,
                                    int threads) {
  if (M == 0 || N == 0) return;
  // One row (1 accumulator per weight row): more weight rows per tile, to have enough
  // independent multiply-adds in flight.
  if (M == 1)
    run<NB1>(w, x, M, K, ldx, bias, out, N, threads);
  else
    run<NB>(w, x, M, K, ldx, bias, out, N, threads);
}

// ---- GGUF blocks -------------------------------------------------------------------------
//
// GGUF blocks with 8-bit input rows (quant_gemm.h): Q4_0, Q4_1, Q4F (Q4_K's sub-blocks with
// float32 scales) and Q8_0 weights, [N, K / 32] blocks of block type `type` (quant_gemm.h's
// BlockType), K % 32 == 0.
#include "quant_gemm.h"

// out[M, N] = x[M, K] @ W^T (+ bias), x's rows quantized to 8 bits per block of 32 first.
extern "C" void disagg_quant_linear(const float* x, int64_t ldx, int64_t M, int64_t K,
                                    const uint8_t* w, int type, int64_t N, const float* bias,
                                    float* out, int threads) {
  if (M == 0 || N == 0) return;
  thread_local std::vector<disagg_quant::XBlock> xb;  // reused: no allocation per call
  disagg_quant::linear(x, ldx, M, K, w, type, N, bias, out, xb, threads);
}

// out[n1 - n0, K] = the float32 weights of rows [n0, n1).
extern "C" void disagg_quant_dequantize(int type, const uint8_t* w, int64_t K, int64_t n0,
                                        int64_t n1, float* out, int threads) {
  disagg_quant::dequantize_rows(type, w, K, n0, n1, out, threads);
}

// The same in bfloat16 (round to nearest even): tiles for a bfloat16 GEMM.
extern "C" void disagg_quant_dequantize_bf16(int type, const uint8_t* w, int64_t K, int64_t n0,
                                             int64_t n1, uint16_t* out, int threads) {
  disagg_quant::dequantize_rows(type, w, K, n0, n1, out, threads);
}
