// The recall tier's page scores on its int8 scoring copy (rsqr_jax.recall, the "max" rule): for every page, the best
// q . k over its recallable tokens, the chunk's real rows, the query heads and the KV heads, in one pass over the
// copy. XLA:CPU reads a layer's copy into a temporary, converts its words to bytes, runs an integer dot that has no
// fast path and reduces the scores in further passes; this kernel reads each key once.
//
// Layout (rsqr_jax.recall.pack_int8_keys): rows int32 [L, B, Hkv, N, D/4 + 1], per key its D int8 codes four to a
// word, then the float32 scale's bits; the whole stack is passed with the layer to read (a slice would be a copy of
// the layer's copy at every call). Queries as quantize_int8 gives them: codes int8 [B, C, Hkv, G, D], scales float32
// [B, C, Hkv, G].
//
//   score[b, p] = max over the pages' slots n with valid[n], rows c with real[c], heads h, g of
//                 (float(sum_d codes_k[b, h, n, d] codes_q[b, c, h, g, d]) * scale_q[b, c, h, g]) * scale_k[b, h, n]
//
// for pages p < pages_scored, -inf for the others and for a page with no valid slot. The integer dot is exact and the
// two float32 products are XLA's, in its order, so for finite queries the scores equal recall._best_token's (as
// numbers: a zero's sign may differ). Pages are split
// into chunks that the caller and XLA's intra-op threads claim from a shared counter (as block_matvec.cc does).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kThreadedKeys = 1 << 12;  // keys (slots x KV heads x batch rows) below which one thread does it all
constexpr int64_t kMaxQueries = 64;         // query vectors per KV head (C x G): one running-dot vector each

struct Job {
  const int32_t* rows;     // this layer's [B, Hkv, N, W]
  const int8_t* qcodes;    // [B, C, Hkv, G, D]
  const float* qscale;     // [B, C, Hkv, G]
  const bool* valid;       // [N]
  const bool* real;        // [C]
  float* out;              // [B, Np]
  int64_t B, H, N, W, D, C, G, Pg, stride, pages, n_chunks, chunk_pages;  // pages: those scored
  std::atomic<int64_t> next{0}, done{0};
};

// One page's best score over its valid slots [n0, n1) for the queries q (int8 codes, Q x D), their scales and
// whether each is a real row; `best` comes in as the page's best so far.
float PagePlain(const Job& j, const int32_t* rows, int64_t n0, int64_t n1, const int8_t* q, const float* qs,
                const char* qreal, int64_t Q, float best) {
  for (int64_t n = n0; n < n1; ++n) {
    if (!j.valid[n]) continue;
    const int32_t* row = rows + n * j.W;
    float kscale;
    std::memcpy(&kscale, row + j.W - 1, sizeof(float));
    const int8_t* k = reinterpret_cast<const int8_t*>(row);
    for (int64_t i = 0; i < Q; ++i) {
      if (!qreal[i]) continue;
      int32_t dot = 0;
      for (int64_t d = 0; d < j.D; ++d) dot += static_cast<int32_t>(k[d]) * static_cast<int32_t>(q[i * j.D + d]);
      const float s = static_cast<float>(dot) * qs[i] * kscale;
      best = s > best ? s : best;
    }
  }
  return best;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// The 16 x 16 int32 matrix in r (row t: 16 words of slot t) transposed in registers: r[w] becomes word w of the 16
// slots. Four rounds of 16 shuffles (32-bit, 64-bit, then two of 128-bit lanes).
inline void Transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + k]: column 4L + k of rows i..i+3, in each 128-bit lane L
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);        // lanes 0, 2 of rows 0-3 and 4-7
    t[4 + k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);    // lanes 1, 3
    t[8 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);            // columns 0-3
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);   // 4-7
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);        // 8-11
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);  // 12-15
  }
}

// PagePlain for 16 slots at a time (head_dim a multiple of 64): the slots' code words are transposed in registers
// (Transpose16), so one vector holds word w of all 16 slots and a dot needs no horizontal sum: each query word,
// broadcast, is multiplied into 16 slots' running dots by one VNNI instruction. VNNI multiplies unsigned by signed
// bytes: the query words come offset by 128 (qu = q + 128, four bytes to a word) and 128 * sum(k) is taken back,
// exactly in int32.
float PageVnni(const Job& j, const int32_t* rows, int64_t n0, int64_t n1, const uint32_t* qu, const float* qs,
               const char* qreal, int64_t Q, float best) {
  const int64_t words = j.D / 4;
  const __m512i lane_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(static_cast<int32_t>(j.W)));
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 best_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i col[16];
  __m512i acc[kMaxQueries];
  for (int64_t s0 = n0; s0 < n1; s0 += 16) {
    __mmask16 m = 0;
    for (int64_t t = 0; t < 16; ++t) m |= static_cast<__mmask16>(j.valid[s0 + t]) << t;
    if (!m) continue;
    const int32_t* base = rows + s0 * j.W;
    __m512i sum_k = _mm512_setzero_si512();
    for (int64_t i = 0; i < Q; ++i) acc[i] = _mm512_setzero_si512();
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
      for (int t = 0; t < 16; ++t) col[t] = _mm512_loadu_si512(base + t * j.W + w0);
      Transpose16(col);
      // Each running sum in a register of its own, in two halves (even and odd words): a chain through memory
      // (acc[i] updated word by word) or of 16 dependent instructions was what limited this loop.
      __m512i even = sum_k, odd = _mm512_setzero_si512();
      for (int w = 0; w < 16; w += 2) {
        even = _mm512_dpbusd_epi32(even, ones, col[w]);
        odd = _mm512_dpbusd_epi32(odd, ones, col[w + 1]);
      }
      sum_k = _mm512_add_epi32(even, odd);
      for (int64_t i = 0; i < Q; ++i) {
        const uint32_t* qw = qu + i * words + w0;
        even = acc[i], odd = _mm512_setzero_si512();
        for (int w = 0; w < 16; w += 2) {
          even = _mm512_dpbusd_epi32(even, _mm512_set1_epi32(static_cast<int32_t>(qw[w])), col[w]);
          odd = _mm512_dpbusd_epi32(odd, _mm512_set1_epi32(static_cast<int32_t>(qw[w + 1])), col[w + 1]);
        }
        acc[i] = _mm512_add_epi32(even, odd);
      }
    }
    const __m512i offset = _mm512_slli_epi32(sum_k, 7);
    const __m512 kscale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, lane_rows, base + words, 4);
    for (int64_t i = 0; i < Q; ++i) {
      if (!qreal[i]) continue;
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], offset));
      const __m512 sc = _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(qs[i])), kscale);
      best_v = _mm512_mask_max_ps(best_v, m, sc, best_v);
    }
  }
  const float b = _mm512_reduce_max_ps(best_v);
  return b > best ? b : best;
}
#endif

// Pages [p0, p1) of every batch row.
void Pages(const Job& j, int64_t p0, int64_t p1) {
  const float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t Q = j.C * j.G;
  std::vector<int8_t> q(Q * j.D);
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  const bool vnni = j.D % 64 == 0 && j.Pg % 16 == 0;
  std::vector<uint32_t> qu(vnni ? Q * j.D / 4 : 0);
#endif
  std::vector<float> qs(Q);
  std::vector<char> qreal(Q);
  for (int64_t b = 0; b < j.B; ++b) {
    float* out = j.out + b * j.stride;
    for (int64_t p = p0; p < p1; ++p) out[p] = kNegInf;
    for (int64_t h = 0; h < j.H; ++h) {
      for (int64_t c = 0; c < j.C; ++c)
        for (int64_t g = 0; g < j.G; ++g) {
          const int64_t i = c * j.G + g, at = ((b * j.C + c) * j.H + h) * j.G + g;
          for (int64_t d = 0; d < j.D; ++d) q[i * j.D + d] = j.qcodes[at * j.D + d];
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
          if (vnni)
            for (int64_t w = 0; w < j.D / 4; ++w) {
              uint32_t word = 0;
              for (int e = 0; e < 4; ++e)
                word |= static_cast<uint32_t>(static_cast<uint8_t>(q[i * j.D + 4 * w + e] + 128)) << (8 * e);
              qu[i * (j.D / 4) + w] = word;
            }
#endif
          qs[i] = j.qscale[at];
          qreal[i] = j.real[c];
        }
      const int32_t* rows = j.rows + (b * j.H + h) * j.N * j.W;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * j.Pg, n1 = n0 + j.Pg;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
        if (vnni) {
          out[p] = PageVnni(j, rows, n0, n1, qu.data(), qs.data(), qreal.data(), Q, out[p]);
          continue;
        }
#endif
        out[p] = PagePlain(j, rows, n0, n1, q.data(), qs.data(), qreal.data(), Q, out[p]);
      }
    }
  }
}

void Work(Job& j) {
  for (int64_t c; (c = j.next.fetch_add(1)) < j.n_chunks;) {
    Pages(j, c * j.chunk_pages, std::min(j.pages, (c + 1) * j.chunk_pages));
    j.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> layer,
                ffi::Buffer<ffi::S8> qcodes, ffi::Buffer<ffi::F32> qscale, ffi::Buffer<ffi::PRED> valid,
                ffi::Buffer<ffi::PRED> real, ffi::Buffer<ffi::S32> pages_scored, ffi::ResultBuffer<ffi::F32> out) {
  const auto rd = rows.dimensions(), qd = qcodes.dimensions();
  if (rd.size() != 5 || qd.size() != 5)
    return ffi::Error::InvalidArgument("page_scores: rows must be [L, B, Hkv, N, W], query codes [B, C, Hkv, G, D]");
  const int64_t L = rd[0], B = rd[1], H = rd[2], N = rd[3], W = rd[4];
  const int64_t C = qd[1], G = qd[3], D = qd[4];
  const auto od = out->dimensions();
  if (qd[0] != B || qd[2] != H || (W - 1) * 4 != D || valid.element_count() != N || real.element_count() != C ||
      od.size() != 2 || od[0] != B || od[1] == 0 || N % od[1] != 0 || C * G > kMaxQueries)
    return ffi::Error::InvalidArgument("page_scores: rows, queries, validity and scores disagree");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("page_scores: layer out of range");
  auto job = std::make_shared<Job>();
  job->rows = rows.typed_data() + l * B * H * N * W;
  job->qcodes = qcodes.typed_data();
  job->qscale = qscale.typed_data();
  job->valid = valid.typed_data();
  job->real = real.typed_data();
  job->out = out->typed_data();
  job->B = B, job->H = H, job->N = N, job->W = W, job->D = D, job->C = C, job->G = G;
  job->stride = od[1];
  job->Pg = N / od[1];
  const int64_t scored = std::clamp<int64_t>(pages_scored.typed_data()[0], 0, od[1]);
  float* o = job->out;
  for (int64_t b = 0; b < B; ++b)
    std::fill(o + b * od[1] + scored, o + (b + 1) * od[1], -std::numeric_limits<float>::infinity());
  if (scored == 0) return ffi::Error::Success();
  const int64_t keys = B * H * scored * job->Pg;
  const int64_t threads = keys < kThreadedKeys ? 1 : std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), scored));
  job->chunk_pages = (scored + threads - 1) / threads;
  job->n_chunks = (scored + job->chunk_pages - 1) / job->chunk_pages;
  job->pages = scored;
  for (int64_t t = 0; t + 1 < job->n_chunks; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->n_chunks) {
#if defined(__AVX512F__)
    _mm_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PageScoresInt8, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows [L, B, Hkv, N, D/4 + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S8>>()    // query codes [B, C, Hkv, G, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // query scales [B, C, Hkv, G]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid [N]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // real [C]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages scored []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // scores [B, N / page]
