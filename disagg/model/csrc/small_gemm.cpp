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
// The same tiling serves GGUF Q8_0 weights (disagg_q8_0_linear): int8 [N, K] with one float32
// scale per block of 32 along K; see the Q8_0 section at the end.

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

// ---- Q8_0 weights ------------------------------------------------------------------------
//
// GGUF Q8_0: w[n][k] = d[n][k / 32] * q[n][k], q int8, d an fp16 scale per block of 32
// (held here as float32: fp16 widens exactly). The weights are read as they are stored, 1 byte
// each plus 4 per block, and widened to float32 in registers: d * q needs at most 11 + 8
// significant bits, so it is exact in float32, and the products with x are the float32
// kernel's products on the dequantized weights (the results agree with F.linear on those to
// the rounding of the sum, as the float32 kernel's do). Same tiles as above: TN weight rows x
// TM input rows of accumulators in registers, each weight block widened once per tile and
// dotted with all TM rows of x.
//
//   q     [N, K] int8, contiguous, K a multiple of 32
//   d     [N, K / 32] float32, contiguous
//   x, bias, out as above
//
// disagg_q8_0_dequantize writes the float32 weights of rows [n0, n1) (for many-row inputs,
// which go to torch's GEMM on a dequantized tile).

namespace {

constexpr int QK = 32;  // weights per Q8_0 block
static_assert(QK % V == 0, "a vector never straddles two blocks");
inline vfloat load_q8(const int8_t* p) {  // V int8 widened to float32
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vfloat)_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  // GCC 12 lowers __builtin_convertvector from int8 to scalar code; so does this loop, which
  // at least needs no intrinsics (any target).
  float f[V];
  for (int i = 0; i < V; ++i) f[i] = p[i];
  return load(f);
#endif
}

// As tile() above; pf: when set, pf[0, pf_len) (bytes: the weights of a tile ahead) is
// prefetched along the way.
template <int TN, int TM>
inline void q8_tile(const int8_t* __restrict w, const float* __restrict d,
                    const float* __restrict x, int64_t K, int64_t ldx, const float* bias,
                    float* __restrict out, int64_t ldo, const int8_t* pf, int64_t pf_len) {
  const int64_t KB = K / QK;
  vfloat acc[TN][TM];
  for (int n = 0; n < TN; ++n)
    for (int m = 0; m < TM; ++m) acc[n][m] = vfloat{};
  for (int64_t b = 0; b < KB; ++b) {
    float s[TN];
    for (int n = 0; n < TN; ++n) s[n] = d[n * KB + b];
    if (pf) {  // TN * 32 bytes of the tile ahead per block, one cache line at a time
      for (int64_t j = b * QK * TN; j < (b + 1) * QK * TN && j < pf_len; j += 64)
        __builtin_prefetch(pf + j, 0, kPrefetchLocality);
    }
    for (int j = 0; j < QK; j += V) {
      const int64_t k = b * QK + j;
      vfloat wv[TN];
      for (int n = 0; n < TN; ++n) wv[n] = load_q8(w + n * K + k) * s[n];
      for (int m = 0; m < TM; ++m) {
        vfloat xv = load(x + m * ldx + k);
#if defined(__x86_64__) && defined(__AVX__)
        asm("" : "+x"(xv));  // as in tile(): keep x in a register
#endif
        for (int n = 0; n < TN; ++n) acc[n][m] += wv[n] * xv;
      }
    }
  }
  for (int n = 0; n < TN; ++n)
    for (int m = 0; m < TM; ++m) {
      const float s = hsum(acc[n][m]);
      out[m * ldo + n] = bias ? s + bias[n] : s;
    }
}

template <int TN>
inline void q8_row_tile(const int8_t* wn, const float* dn, const float* x, int64_t M,
                        int64_t K, int64_t ldx, const float* bn, float* on, int64_t N,
                        const int8_t* pf, int64_t pf_len) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB) {
    q8_tile<TN, MB>(wn, dn, x + m * ldx, K, ldx, bn, on + m * N, N, pf, pf_len);
    pf = nullptr;  // the first pass only (the one that reads from memory)
  }
  const float* xm = x + m * ldx;
  float* om = on + m * N;
  switch (M - m) {
    case 1: q8_tile<TN, 1>(wn, dn, xm, K, ldx, bn, om, N, pf, pf_len); break;
    case 2: q8_tile<TN, 2>(wn, dn, xm, K, ldx, bn, om, N, pf, pf_len); break;
    case 3: q8_tile<TN, 3>(wn, dn, xm, K, ldx, bn, om, N, pf, pf_len); break;
    default: break;
  }
}

// Software prefetch of the int8 weights kQ8PrefetchBytes ahead (the float32 kernel's distance
// in bytes). Measured on a Zen 4 core from DRAM: SmolLM2's 49152 x 576 LM head at M = 1 went
// from 4.3 to 1.9 ms (the in-cache speed), a whole decode step's Q8_0 linears on 2 threads from
// 12.8 to 7.1 ms; with several input rows it helped every shape tried (K = 576..14336, 4 rows:
// 5-40%), but a single row of long rows (tiles over kQ8PrefetchMaxTileBytes: K = 4096, 14336)
// ran 3-30% slower with it, as the float32 kernel's long rows do: those go without.
constexpr int64_t kQ8PrefetchBytes = 4 * kPrefetchFloats;
constexpr int64_t kQ8PrefetchMaxTileBytes = 4 * kPrefetchMaxTileFloats;

template <int TN>
void q8_run(const int8_t* q, const float* d, const float* x, int64_t M, int64_t K, int64_t ldx,
            const float* bias, float* out, int64_t N, int threads) {
  const int64_t KB = K / QK;
  const int64_t tiles = (N + TN - 1) / TN;
  const int64_t per_tile = std::max<int64_t>(1, M * K * TN);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_tile);
  const bool prefetch = M > 1 || TN * K <= kQ8PrefetchMaxTileBytes;
  const int64_t ahead = TN * ((kQ8PrefetchBytes + TN * K - 1) / (TN * K));  // whole tiles
  disagg::parallel_for(0, tiles, grain, threads, [&](int64_t t0, int64_t t1) {
    const int64_t n1 = std::min(N, t1 * TN);
    int64_t n = t0 * TN;
    for (; n + TN <= n1; n += TN) {
      const int64_t p0 = prefetch ? std::min(N, n + ahead) : N, p1 = std::min(N, p0 + TN);
      q8_row_tile<TN>(q + n * K, d + n * KB, x, M, K, ldx, bias ? bias + n : nullptr, out + n,
                      N, p1 > p0 ? q + p0 * K : nullptr, (p1 - p0) * K);
    }
    for (; n < n1; ++n)
      q8_row_tile<1>(q + n * K, d + n * KB, x, M, K, ldx, bias ? bias + n : nullptr, out + n,
                     N, nullptr, 0);
  });
}

}  // namespace

// out[M, N] = x[M, K] @ (d * q)[N, K]^T (+ bias), on `threads` threads. K % 32 == 0.
extern "C" void disagg_q8_0_linear(const float* x, const int8_t* q, const float* d,
                                   const float* bias, float* out, int64_t M, int64_t K,
                                   int64_t N, int64_t ldx, int threads) {
  if (M == 0 || N == 0) return;
  if (M == 1)
    q8_run<NB1>(q, d, x, M, K, ldx, bias, out, N, threads);
  else
    q8_run<NB>(q, d, x, M, K, ldx, bias, out, N, threads);
}

// out[n1 - n0, K] = the float32 weights of rows [n0, n1). K % 32 == 0.
extern "C" void disagg_q8_0_dequantize(const int8_t* q, const float* d, float* out,
                                       int64_t n0, int64_t n1, int64_t K, int threads) {
  const int64_t KB = K / QK;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, K));
  disagg::parallel_for(n0, n1, grain, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n)
      for (int64_t b = 0; b < KB; ++b) {
        const float s = d[n * KB + b];
        float* o = out + (n - n0) * K + b * QK;
        const int8_t* src = q + n * K + b * QK;
        for (int j = 0; j < QK; j += V) {
          const vfloat v = load_q8(src + j) * s;
          std::memcpy(o + j, &v, sizeof(v));
        }
      }
  });
}
