// A decode step of a dense Llama-family model's decoder layers in one call (CPU): what
// LlamaForCausalLM.forward does layer by layer in Python, for a batch in which every sequence
// has exactly one new token and every linear is a GGUF block matrix (quant_gemm.h). A step
// of one token on a small model is mostly dispatch when it runs op by op (about 10 calls a
// layer: bench/results/decode_profile.md); here the whole stack is one ctypes call.
//
// Per layer l (T tokens, hidden H, Hq / Hkv heads of D, intermediate I):
//
//   h    = residual + x                      (x: the previous layer's feed-forward output)
//   n    = ln1 * rms_norm(h)                 disagg_add_rms_norm (elementwise.cpp)
//   qkv  = n @ Wqkv^T (+ bias)               [T, (Hq + 2 Hkv) D]: q | k | v per row
//          RoPE(q, k) in place, k and v into the paged cache   disagg_rope_store
//   att  = paged decode attention of q      attend (below: split along the keys)
//   h2   = h + att @ Wo^T;  n = ln2 * rms_norm(h2)
//   gu   = n @ Wgu^T                         [T, 2 I]: gate | up
//   x    = (silu(gate) * up) @ Wdown^T       the next layer's x, h2 its residual
//
// and at the end out = final_norm * rms_norm(h2 + x). The cache may hold float32, bfloat16 or
// float16 (half.h; attention reads it as floats, the K/V write rounds to nearest even). Linears with 8-bit input rows
// (quant_gemm.h), the rest the same functions the op-by-op path calls: the output matches
// that path on the same weights up to float rounding order (tests/test_cpu_decoder.py).
//
// A plain C ABI over two structs (DecoderStep, DecoderLayer; ctypes mirrors in
// model/cpu_decoder.py, which checks that a model and a step qualify). Scratch buffers are
// thread-local vectors, grown on demand and reused by every call.

#include "quant_gemm.h"

// elementwise.cpp turns off fp-contract for its RoPE's bits; not for the code below
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#endif
#include "elementwise.cpp"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#elif defined(__clang__)
#pragma clang fp contract(on)
#endif

namespace {

struct DecoderLayer {
  const float* ln1;       // [H] input_layernorm
  const float* ln2;       // [H] post_attention_layernorm
  const uint8_t* qkv;     // [(Hq + 2 Hkv) D, H] blocks
  const float* qkv_bias;  // [(Hq + 2 Hkv) D] or null
  const uint8_t* o;       // [H, Hq D] blocks
  const uint8_t* gate_up; // [2 I, H] blocks
  const uint8_t* down;    // [H, I] blocks
  void* kv;               // this layer's cache [N, 2, Hkv, B, D] (strides in DecoderStep)
  int32_t qkv_type, o_type, gate_up_type, down_type;
};

struct DecoderStep {
  int64_t T, H, Hq, Hkv, D, I;
  double eps, scale;
  const float* x;                // [T, H] the embedded tokens
  float* out;                    // [T, H] the final normed hidden states
  const float* cos;              // [T, D]
  const float* sin;              // [T, D]
  const int64_t* slot_block;     // [T]
  const int64_t* slot_offset;    // [T]
  const int64_t* tables;         // [T, max_blocks] at row stride s_tab
  int64_t s_tab, max_blocks;
  const int64_t* lens;           // [T] context length of each sequence, this token included
  int64_t N, B, s_blk, s_kv, s_h, s_tok;  // the cache's geometry and strides (elements)
  int64_t layers;
  const DecoderLayer* layer;
  const float* final_norm;       // [H]
  int32_t threads;
  int32_t kv_dtype;              // the cache's elements: half.h's codes (float32, bf16, f16)
};

using disagg_quant::XBlock;
using disagg_half::bf16;
using disagg_half::f16;

// 16 floats (GCC / Clang vector extension: one AVX-512 register, two AVX2 ones, or scalar
// code, whatever -march=native offers).
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 16 cache values as floats.
inline vf16 load16(const bf16* p) {  // bfloat16: the high half of a float's bits
  typedef uint16_t vu16 __attribute__((vector_size(32)));
  vu16 u;
  std::memcpy(&u, p, sizeof(u));
  const vi16 w = __builtin_convertvector(u, vi16) << 16;
  vf16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
inline vf16 load16(const f16* p) {
#if defined(__AVX512F__)
  const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  vf16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#else
  float a[16];
  disagg_half::load_row(p, a, 16);
  return load16(a);
#endif
}

inline float hsum16(vf16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));  // a shuffle tree in registers
#else
  float a[16];
  std::memcpy(a, &v, sizeof(v));
  for (int h = 8; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) a[i] += a[i + h];
  return a[0];
#endif
}

// e^v for v in [-87.3, 0] (softmax numerators; below: 0): 2^n e^f with n = round(v log2 e),
// f = v - n ln 2 (ln 2 in two parts), e^f by its degree-6 Taylor polynomial (|f| <= 0.35:
// relative error ~1e-7), 2^n added to the exponent bits.
inline vf16 exp16(vf16 v) {
  const vf16 lo = vf16{} - 87.3f;
  v = v < lo ? lo : v;
  const vf16 t = v * 1.44269504f;
  const vf16 n = (t + 12582912.f) - 12582912.f;  // round to nearest (|t| < 2^22)
  const vf16 f = (v - n * 0.693359375f) + n * 2.12194440e-4f;
  vf16 p = vf16{} + 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  vi16 bits;
  std::memcpy(&bits, &p, sizeof(p));
  bits += __builtin_convertvector(n, vi16) << 23;
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

// sc[j] <- e^(sc[j] - mx), j < n; returns their sum.
inline float exp_sub(float* sc, int64_t n, float mx) {
  vf16 acc = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const vf16 e = exp16(load16(sc + j) - mx);
    std::memcpy(sc + j, &e, sizeof(e));
    acc += e;
  }
  float sum = hsum16(acc);
  for (; j < n; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
  return sum;
}

// Decode attention of T sequences (one query row each, q [T, Hq, D] dense) over the paged
// cache, split along the keys so that a small batch still keeps every thread busy (one
// sequence has only Hkv kv heads: 3 for SmolLM2, 2 : 1 over two threads). Item (t, h, c)
// covers keys [c * chunk, min(L, (c + 1) * chunk)) of sequence t, kv head h (chunk a whole
// number of cache blocks), for its G query heads; each keeps its max m, sum l of exp(s - m)
// and acc = sum exp(s - m) v, merged after:
//
//   out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c,   M = max_c m_c
//
// (flash-decoding's split-K). Keys are read block by block (block i of the table holds
// positions [i B, (i + 1) B)), each key row once for the G query heads. The block ids and
// lengths are checked by the caller.
template <typename C>
void attend(const float* q, const C* kv, const int64_t* tab, int64_t s_tab,
            const int64_t* lens, float* out, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
            int64_t B, int64_t s_blk, int64_t s_kv, int64_t s_h, int64_t s_tok, float scale,
            int threads) {
  const int64_t G = Hq / Hkv;
  int64_t max_len = 1;
  for (int64_t t = 0; t < T; ++t) max_len = std::max(max_len, lens[t]);
  // items >= 4 per thread where the keys allow chunks of a block or more
  // (and a multiple of the thread count where one is near: 3 heads x 4 splits over 2 threads)
  int64_t want = (4 * threads + T * Hkv - 1) / (T * Hkv);
  for (int64_t s2 = want; s2 < 2 * want; ++s2)
    if ((T * Hkv * s2) % threads == 0) {
      want = s2;
      break;
    }
  const int64_t splits = std::max<int64_t>(1, std::min(want, (max_len + B - 1) / B));
  const int64_t items = T * Hkv * splits;
  const bool vec = D % 16 == 0 && G <= 8;
  thread_local std::vector<float> pm, pl, pacc;
  pm.resize(items * G), pl.resize(items * G), pacc.resize(items * G * D);
  // pointers, not the vectors: inside the parallel region a thread_local names the running
  // thread's own (empty) instance
  float *const pm_p = pm.data(), *const pl_p = pl.data(), *const pacc_p = pacc.data();
  disagg::parallel_for(0, items, 1, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(G * D), row(D);  // row: a 16-bit key (scalar path)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item % splits, h = (item / splits) % Hkv, t = item / (splits * Hkv);
      const int64_t L = lens[t], nblk = (L + B - 1) / B;
      const int64_t per = (nblk + splits - 1) / splits;  // blocks per split
      const int64_t b0 = std::min(nblk, c * per), b1 = std::min(nblk, b0 + per);
      const int64_t k0 = b0 * B, n = std::min(L, b1 * B) - k0;
      float* m = pm_p + item * G;
      float* l = pl_p + item * G;
      float* acc = pacc_p + item * G * D;
      std::fill(acc, acc + G * D, 0.f);
      for (int64_t g = 0; g < G; ++g) m[g] = -INFINITY, l[g] = 0.f;
      if (n <= 0) continue;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = q[(t * Hq + h * G + g) * D + d] * scale;
      scores.resize(static_cast<size_t>(G * n));
      for (int64_t bi = b0; bi < b1; ++bi) {  // scores[g][j] = q_g . k_j
        const C* kb = kv + tab[t * s_tab + bi] * s_blk + h * s_h;
        const int64_t j0 = bi * B - k0, jn = std::min(B, L - bi * B);
        for (int64_t j = 0; j < jn; ++j) {
          if (vec) {
            const C* k = kb + j * s_tok;
            vf16 a[8];
            for (int64_t g = 0; g < G; ++g) a[g] = vf16{};
            for (int64_t d = 0; d < D; d += 16) {
              const vf16 kv16 = load16(k + d);
              for (int64_t g = 0; g < G; ++g) a[g] += load16(qf.data() + g * D + d) * kv16;
            }
            for (int64_t g = 0; g < G; ++g) scores[g * n + j0 + j] = hsum16(a[g]);
          } else {
            const float* k = disagg_half::as_floats(kb + j * s_tok, row.data(), D);
            for (int64_t g = 0; g < G; ++g) {
              const float* qg = qf.data() + g * D;
              float a = 0.f;
              for (int64_t d = 0; d < D; ++d) a += qg[d] * k[d];
              scores[g * n + j0 + j] = a;
            }
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * n;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sc[j]);
        m[g] = mx;
        l[g] = exp_sub(sc, n, mx);
      }
      for (int64_t bi = b0; bi < b1; ++bi) {  // acc[g] += p[g][j] v_j
        const C* vb = kv + tab[t * s_tab + bi] * s_blk + s_kv + h * s_h;
        const int64_t j0 = bi * B - k0, jn = std::min(B, L - bi * B);
        for (int64_t j = 0; j < jn; ++j) {
          if (vec) {
            const C* v = vb + j * s_tok;
            for (int64_t d = 0; d < D; d += 16) {
              const vf16 v16 = load16(v + d);
              for (int64_t g = 0; g < G; ++g) {
                float* ag = acc + g * D + d;
                const vf16 r = load16(ag) + scores[g * n + j0 + j] * v16;
                std::memcpy(ag, &r, sizeof(r));
              }
            }
            continue;
          }
          const float* v = disagg_half::as_floats(vb + j * s_tok, row.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * n + j0 + j];
            float* ag = acc + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
          }
        }
      }
    }
  });
  for (int64_t t = 0; t < T; ++t)  // merge the splits of each (t, h, g)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t first = (t * Hkv + h) * splits;
        float M = -INFINITY;
        for (int64_t c = 0; c < splits; ++c) M = std::max(M, pm[(first + c) * G + g]);
        float denom = 0.f;
        float* o = out + (t * Hq + h * G + g) * D;
        std::fill(o, o + D, 0.f);
        for (int64_t c = 0; c < splits; ++c) {
          const int64_t i = (first + c) * G + g;
          if (pl[i] == 0.f) continue;  // an empty split
          const float w = std::exp(pm[i] - M);
          denom += w * pl[i];
          const float* a = pacc.data() + i * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / denom;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
}

// y[T, N] = x[T, K] (dense rows) @ W^T (+ bias), through xb.
inline void linear(const float* x, int64_t T, int64_t K, const uint8_t* w, int type, int64_t N,
                   const float* bias, float* y, std::vector<XBlock>& xb, int threads) {
  disagg_quant::linear(x, K, T, K, w, type, N, bias, y, xb, threads);
}

}  // namespace

// Returns 0, or (checked before the cache is touched) 1 a sequence length out of range of its
// block table, 2 a block id out of range, 3 an unsupported shape (K not a multiple of 32, head
// dim odd or over 1024), 4 a slot out of range, 5 an unknown cache type.
extern "C" int disagg_decode_layers(const DecoderStep* a) {
  const int64_t T = a->T, H = a->H, Hq = a->Hq, Hkv = a->Hkv, D = a->D, I = a->I;
  const int threads = a->threads;
  if (H % disagg_quant::QK || (Hq * D) % disagg_quant::QK || I % disagg_quant::QK ||
      D % 2 || D > kMaxHeadDim)
    return 3;
  if (a->kv_dtype != disagg_half::kF32 && a->kv_dtype != disagg_half::kBF16 &&
      a->kv_dtype != disagg_half::kF16)
    return 5;
  for (int64_t t = 0; t < T; ++t) {
    if (!(a->lens[t] >= 1 && a->lens[t] <= a->max_blocks * a->B)) return 1;
    for (int64_t i = 0; i < (a->lens[t] + a->B - 1) / a->B; ++i) {
      const int64_t blk = a->tables[t * a->s_tab + i];
      if (!(blk >= 0 && blk < a->N)) return 2;
    }
    if (!(a->slot_block[t] >= 0 && a->slot_block[t] < a->N && a->slot_offset[t] >= 0 &&
          a->slot_offset[t] < a->B))
      return 4;
  }
  const int64_t W = (Hq + 2 * Hkv) * D;  // a qkv row
  thread_local std::vector<XBlock> xb;
  thread_local std::vector<float> n, h, h2, qkv, q, att, o, gu, act, ffn;
  n.resize(T * H), h.resize(T * H), h2.resize(T * H), qkv.resize(T * W), q.resize(T * Hq * D);
  att.resize(T * Hq * D), o.resize(T * H), gu.resize(T * 2 * I), act.resize(T * I);
  ffn.resize(T * H);
  const float feps = static_cast<float>(a->eps);
  const float* x = a->x;      // the feed-forward output added next (the embedding at first)
  const float* res = nullptr;  // the stream it is added to (none at first)
  for (int64_t l = 0; l < a->layers; ++l) {
    const DecoderLayer& L = a->layer[l];
    // h = res + x; n = ln1 * norm(h)
    disagg_add_rms_norm(x, H, res, H, L.ln1, n.data(), h.data(), T, H, feps, threads);
    const float* hs = res ? h.data() : x;
    linear(n.data(), T, H, L.qkv, L.qkv_type, W, L.qkv_bias, qkv.data(), xb, threads);
    // RoPE of the q | k heads of each row in place; k, v into the cache (slots checked above)
    disagg_rope_store(qkv.data(), W, qkv.data() + (Hq + Hkv) * D, W, a->cos, a->sin, L.kv,
                      a->kv_dtype, T, Hq, Hkv, D, a->N, a->B, a->s_blk, a->s_kv, a->s_h,
                      a->s_tok, a->slot_block, a->slot_offset, 1);
    for (int64_t t = 0; t < T; ++t)  // q rows dense for the attention kernel: [T, Hq, D]
      std::memcpy(q.data() + t * Hq * D, qkv.data() + t * W, sizeof(float) * Hq * D);
#define DISAGG_ATTEND(C)                                                                     \
  attend(q.data(), static_cast<const C*>(L.kv), a->tables, a->s_tab, a->lens, att.data(), T, \
         Hq, Hkv, D, a->B, a->s_blk, a->s_kv, a->s_h, a->s_tok,                             \
         static_cast<float>(a->scale), threads)
    if (a->kv_dtype == disagg_half::kF32)
      DISAGG_ATTEND(float);
    else if (a->kv_dtype == disagg_half::kBF16)
      DISAGG_ATTEND(bf16);
    else
      DISAGG_ATTEND(f16);
#undef DISAGG_ATTEND
    linear(att.data(), T, Hq * D, L.o, L.o_type, H, nullptr, o.data(), xb, threads);
    // h2 = h + o; n = ln2 * norm(h2)
    disagg_add_rms_norm(o.data(), H, hs, H, L.ln2, n.data(), h2.data(), T, H, feps, threads);
    linear(n.data(), T, H, L.gate_up, L.gate_up_type, 2 * I, nullptr, gu.data(), xb, threads);
    for (int64_t t = 0; t < T; ++t) {
      const float* g = gu.data() + t * 2 * I;
      const float* u = g + I;
      float* y = act.data() + t * I;
      for (int64_t j = 0; j < I; ++j) y[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
    linear(act.data(), T, I, L.down, L.down_type, H, nullptr, ffn.data(), xb, threads);
    // the stream: h2 (its buffer becomes h's next round; ffn is x)
    std::swap(h, h2);
    x = ffn.data();
    res = h.data();
  }
  // out = final_norm * norm(res + x) (h2 as scratch for the sum)
  disagg_add_rms_norm(x, H, res, H, a->final_norm, a->out, h2.data(), T, H, feps, threads);
  return 0;
}
