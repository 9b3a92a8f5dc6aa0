// y = x @ W for a few rows x and a weight W held as a GGUF holds it: int8 codes in blocks of 32 along the input
// axis, a float32 scale (and for Q4_1 an offset) per block and output column. XLA:CPU dequantizes such a matrix
// into float32 before its dot; this kernel reads the codes once and never writes the float32 matrix.
//
// Layout (rsqr_jax.models.blocks.BlockWeights, tiled): codes int8 [L, K/32, N/8, 32, 8] - per block of 32 inputs
// and per group of 8 output columns, the 32 x 8 codes contiguous, so a matrix is read in one forward stream;
// scale, offset float32 [L, K/32, 1, N]; layer: int32 scalar, the matrix of the stack to use (the stack is passed
// whole: a slice would be a copy of the codes at every call).
//
//   y[m, n] = sum_b scale[b, n] * (sum_i codes[b, i, n] x[m, 32 b + i]) + offset[b, n] * (sum_i x[m, 32 b + i])
//
// the dequantized weights' products, regrouped per block (float32 throughout; the sum's order is not XLA's, so
// the result is the float32 dot's within rounding, not bit for bit). Work is split over column chunks that the
// caller and XLA's intra-op threads claim from a shared counter: the caller never waits on a task that has not
// started (two projections may run at once on a two-thread pool). With AVX-512 a tile's codes are converted once
// for up to 8 rows; the AVX2 path and the plain loop (other machines) take one row at a time.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;      // inputs per block
constexpr int64_t kGroup = 8;       // output columns per tile
constexpr int64_t kThreadedWork = 1 << 18;  // rows x weights below which one thread does it all

struct Job {
  const float* x;
  const int8_t* codes;
  const float* scale;
  const float* offset;  // nullptr: no offset (Q4_0, Q8_0)
  float* y;
  int64_t M, K, N, n_chunks, chunk_groups;
  std::atomic<int64_t> next{0}, done{0};
};

// Output columns [8 g0, 8 g1) of every row.
void Columns(const Job& j, int64_t g0, int64_t g1) {
  const int64_t nb = j.K / kBlock, G = j.N / kGroup;
  for (int64_t m = 0; m < j.M; ++m) std::fill(j.y + m * j.N + g0 * kGroup, j.y + m * j.N + g1 * kGroup, 0.0f);
#if defined(__AVX512F__)
  // Rows in groups of up to kRows: each tile's codes are converted once and used for every row of the group.
  constexpr int64_t kRows = 8;
  for (int64_t m0 = 0; m0 < j.M; m0 += kRows) {
    const int64_t rows = std::min(kRows, j.M - m0);
    for (int64_t b = 0; b < nb; ++b) {
      __m512 xv[kRows][kBlock / 2];  // per row: inputs 2i and 2i + 1 of the block, 8 lanes each
      float xsum[kRows];
      for (int64_t r = 0; r < rows; ++r) {
        const float* xb = j.x + (m0 + r) * j.K + b * kBlock;
        xsum[r] = 0.0f;
        for (int i = 0; i < kBlock; ++i) xsum[r] += xb[i];
        for (int i = 0; i < kBlock / 2; ++i)
          xv[r][i] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(xb[2 * i])), _mm256_set1_ps(xb[2 * i + 1]), 1);
      }
      const float* sb = j.scale + b * j.N;
      const float* ob = j.offset ? j.offset + b * j.N : nullptr;
      for (int64_t g = g0; g < g1; ++g) {
        const int8_t* c = j.codes + (b * G + g) * kBlock * kGroup;
        __m512 w[kBlock / 2];
        for (int i = 0; i < kBlock / 2; ++i)
          w[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + 16 * i))));
        const __m256 s = _mm256_loadu_ps(sb + g * kGroup);
        for (int64_t r = 0; r < rows; ++r) {
          __m512 a0 = _mm512_mul_ps(xv[r][0], w[0]), a1 = _mm512_mul_ps(xv[r][1], w[1]);
          __m512 a2 = _mm512_mul_ps(xv[r][2], w[2]), a3 = _mm512_mul_ps(xv[r][3], w[3]);
          for (int i = 4; i < kBlock / 2; i += 4) {
            a0 = _mm512_fmadd_ps(xv[r][i], w[i], a0);
            a1 = _mm512_fmadd_ps(xv[r][i + 1], w[i + 1], a1);
            a2 = _mm512_fmadd_ps(xv[r][i + 2], w[i + 2], a2);
            a3 = _mm512_fmadd_ps(xv[r][i + 3], w[i + 3], a3);
          }
          const __m512 a = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
          const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
          float* yo = j.y + (m0 + r) * j.N + g * kGroup;
          __m256 o = _mm256_fmadd_ps(s, h, _mm256_loadu_ps(yo));
          if (ob) o = _mm256_fmadd_ps(_mm256_loadu_ps(ob + g * kGroup), _mm256_set1_ps(xsum[r]), o);
          _mm256_storeu_ps(yo, o);
        }
      }
    }
  }
#else
  for (int64_t m = 0; m < j.M; ++m) {
    const float* xm = j.x + m * j.K;
    float* ym = j.y + m * j.N;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xm + b * kBlock;
      float xsum = 0.0f;
      for (int i = 0; i < kBlock; ++i) xsum += xb[i];
      const float* sb = j.scale + b * j.N;
      const float* ob = j.offset ? j.offset + b * j.N : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
      __m256 xv[kBlock];
      for (int i = 0; i < kBlock; ++i) xv[i] = _mm256_set1_ps(xb[i]);
      const __m256 xs = _mm256_set1_ps(xsum);
      for (int64_t g = g0; g < g1; ++g) {
        const int8_t* c = j.codes + (b * G + g) * kBlock * kGroup;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < kBlock; i += 4) {
          a0 = _mm256_fmadd_ps(xv[i], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 8 * i)))), a0);
          a1 = _mm256_fmadd_ps(xv[i + 1], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 8 * i + 8)))), a1);
          a2 = _mm256_fmadd_ps(xv[i + 2], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 8 * i + 16)))), a2);
          a3 = _mm256_fmadd_ps(xv[i + 3], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 8 * i + 24)))), a3);
        }
        const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        float* yo = ym + g * kGroup;
        __m256 o = _mm256_fmadd_ps(_mm256_loadu_ps(sb + g * kGroup), s, _mm256_loadu_ps(yo));
        if (ob) o = _mm256_fmadd_ps(_mm256_loadu_ps(ob + g * kGroup), xs, o);
        _mm256_storeu_ps(yo, o);
      }
#else
      for (int64_t g = g0; g < g1; ++g) {
        const int8_t* c = j.codes + (b * G + g) * kBlock * kGroup;
        float s[kGroup] = {0};
        for (int i = 0; i < kBlock; ++i)
          for (int e = 0; e < kGroup; ++e) s[e] += xb[i] * static_cast<float>(c[i * kGroup + e]);
        for (int e = 0; e < kGroup; ++e) {
          const int64_t n = g * kGroup + e;
          ym[n] += sb[n] * s[e] + (ob ? ob[n] * xsum : 0.0f);
        }
      }
#endif
    }
  }
#endif
}

void Work(Job& j) {
  const int64_t G = j.N / kGroup;
  for (int64_t c; (c = j.next.fetch_add(1)) < j.n_chunks;) {
    Columns(j, c * j.chunk_groups, std::min(G, (c + 1) * j.chunk_groups));
    j.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scale,
                ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                bool has_offset) {
  const auto cd = codes.dimensions();
  if (cd.size() != 5 || cd[3] != kBlock || cd[4] != kGroup)
    return ffi::Error::InvalidArgument("block_matvec: codes must be [L, K/32, N/8, 32, 8]");
  const int64_t L = cd[0], K = cd[1] * kBlock, N = cd[2] * kGroup;
  if (x.dimensions().back() != K || y->element_count() != x.element_count() / K * N)
    return ffi::Error::InvalidArgument("block_matvec: x, codes and y disagree");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("block_matvec: layer out of range");
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->codes = codes.typed_data() + l * K * N;
  job->scale = scale.typed_data() + l * (K / kBlock) * N;
  job->offset = has_offset ? offset.typed_data() + l * (K / kBlock) * N : nullptr;
  job->y = y->typed_data();
  job->M = x.element_count() / K;
  job->K = K;
  job->N = N;
  // One contiguous run of columns per thread: per block, each reads one stretch of codes (a run per block of
  // 64 columns each, claimed in turn, measured slower: short strided reads).
  // A small matrix on the calling thread alone: waking a helper costs more than it saves.
  const int64_t threads = job->M * K * N < kThreadedWork ? 1 : std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), N / kGroup));
  job->chunk_groups = (N / kGroup + threads - 1) / threads;
  job->n_chunks = (N / kGroup + job->chunk_groups - 1) / job->chunk_groups;
  const int64_t helpers = job->n_chunks - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->n_chunks) {
#if defined(__AVX2__)
    _mm_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatvec, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // codes [L, K/32, N/8, 32, 8]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [L, K/32, 1, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // offset like scale (ignored without has_offset)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., N]
                                  .Attr<bool>("has_offset"));
