// Decode attention that reads a paged KV cache in place (CPU).
//
// The pure-PyTorch path (attention.py) must first gather every sequence's blocks into one
// contiguous tensor per layer, because SDPA needs each sequence's keys at a single stride: on a
// CPU that copy moves as many bytes as the attention itself reads. This kernel walks the block
// table instead and reads each key and value once.
//
//   q        [S, Hq, D]                    one query token per sequence (decode)
//   kv_layer [N, 2, Hkv, B, D]             a strided view kv_cache[:, layer]; last dim dense
//   tables   [S, max_blocks] int64         token p of sequence s: block tables[s][p / B],
//                                          offset p % B
//   lens     [S] int64                     keys [0, lens[s]) are attended
//   out      [S, Hq, D]
//
// Query head hq reads kv head hq / G (G = Hq / Hkv, Hugging Face's repeat_kv order); one work
// item is a (sequence, kv head) pair with its G query heads, so each key is read once for all
// of them. Softmax in two passes over a per-item score buffer, all arithmetic in float.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
            const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = kv.size(2), B = kv.size(3);
  const int64_t G = Hq / Hkv;
  const int64_t s_blk = kv.stride(0), s_kv = kv.stride(1), s_h = kv.stride(2),
                s_tok = kv.stride(3);
  const int64_t s_tab = tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kvp = kv.data_ptr<T>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, S * Hkv, 1, [&](int64_t begin, int64_t end) {
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
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[g * D + d] * inv[g]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_layer,
                                  const at::Tensor& tables, const at::Tensor& lens,
                                  double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_layer.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [S, Hq, D]");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.stride(4) == 1,
              "kv_layer must be [N, 2, Hkv, B, D] with a dense last dim");
  TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type(), "q and kv_layer dtypes differ");
  TORCH_CHECK(q.size(2) == kv_layer.size(4), "head_dim differs");
  TORCH_CHECK(q.size(1) % kv_layer.size(2) == 0, "query heads not a multiple of kv heads");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 &&
                  tables.stride(1) == 1 && tables.size(0) == q.size(0),
              "tables must be [S, max_blocks] int64 with dense rows");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() &&
                  lens.numel() == q.size(0), "lens must be [S] int64");
  // Checked here, not in the parallel loop: a bad id would read outside the cache.
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t B = kv_layer.size(3), N = kv_layer.size(0);
  for (int64_t s = 0; s < q.size(0); ++s) {
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= tables.size(1) * B,
                "sequence length out of range of its block table");
    for (int64_t i = 0; i < (lp[s] + B - 1) / B; ++i) {
      const int64_t blk = tab[s * tables.stride(0) + i];
      TORCH_CHECK(blk >= 0 && blk < N, "block id out of range");
    }
  }
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "paged_decode_attention", [&] {
    decode<scalar_t>(q, kv_layer, tables, lens, scale, out);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache, read in place (CPU)");
}
