// The recall tier's tokens attended in one call (rsqr_jax.kernels.recalled_attention): a layer's recalled pages read
// straight from the cold store, each raw key rotated at its rank from the rotation table, and the partial softmax of
// the survivor-segment queries over them, (o, m, l) as survivor_attention_xla's `partial` gives them for a segment.
// XLA:CPU ran this as some ten operations per layer (copy the pages' runs out of the store, gather the table rows,
// rotate, dot, mask, max, exp, sum, dot), most of a recall step's added time; here the pages are read once.
//
// Inputs: cold K and V stacks [L, B, Hkv, N, D] (float32, or bfloat16 held as uint16 bits), the layer, the runs'
// first slots [B, M] (each run `run` slots), the queries already rotated and scaled [B, C, Hkv, G, D] (float32), the
// tokens' rotation positions [B, M * run] and validity, the rotation table [T, D] (cos | sin rows). Outputs, float32:
// o [B, Hkv, G, C, D] = sum_r p_r v_r, m [B, Hkv, G, C, 1] = max_r s_r over valid tokens (MASK when none), l = sum_r p_r,
// with s_r = q . rot(k_r), p_r = exp(s_r - m) for valid tokens and 0 otherwise. A rotation position outside the table
// gives NaN scores (the contract's loud failure). The sums run in another order than XLA's: equal within float32
// rounding, not bit for bit.
#include <algorithm>
#include <atomic>
#include <memory>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMask = -0.7f * std::numeric_limits<float>::max();  // survivor_attention.MASK_VALUE

inline float Bf16(uint16_t bits) {
  const uint32_t w = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

#if defined(__AVX512F__)
// 16 values from p as float32 lanes.
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

#if defined(__AVX512F__)
// exp of 16 floats (Cephes' expf: a degree-5 polynomial after reducing by ln 2, then scaled by 2^n), within 2 ulp of
// std::exp for the scores' x <= 0; below -87.3 it gives ~1e-38 instead of 0, nothing next to a sum >= 1.
inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447505531f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}
#endif

template <typename T>
inline float Load(const T* p, int64_t i);
template <>
inline float Load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float Load<uint16_t>(const uint16_t* p, int64_t i) { return Bf16(p[i]); }

// q . k over D floats. Without -ffast-math the compiler keeps a float sum in order, one lane at a time: here in 16
// lanes (AVX-512), summed at the end.
inline float Dot(const float* q, const float* k, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.0f;
  for (int64_t d = 0; d < D; ++d) acc += q[d] * k[d];
  return acc;
}

// Ask for a run's rows before they are needed: the pages lie anywhere in a store of hundreds of MB.
template <typename T>
inline void Prefetch(const T* p, int64_t n) {
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + i);
}

template <typename T>
struct Job {
  const T *cold_k, *cold_v;
  int64_t B, H, N, D, M, run, C, G, n_table;
  int32_t layer;
  const int32_t* starts;
  const float* q;
  const int32_t* rot_pos;
  const bool* valid;
  const float* table;
  float *o, *m, *l;
  std::atomic<int64_t> next{0}, done{0};
};

// One (batch row, KV head): its slots' scores, softmax weights and weighted values.
template <typename T>
void Head(const Job<T>& j, int64_t b, int64_t h) {
  const int64_t B = j.B, H = j.H, N = j.N, D = j.D, M = j.M, run = j.run, C = j.C, G = j.G, n_table = j.n_table;
  const int32_t *starts = j.starts, *rot_pos = j.rot_pos;
  const bool* valid = j.valid;
  const float *q = j.q, *table = j.table;
  float *o = j.o, *m = j.m, *l = j.l;
  const int64_t R = M * run, F = D / 2, Q = C * G;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> k(D), s(Q * R);
  const T* kb = j.cold_k + ((static_cast<int64_t>(j.layer) * B + b) * H + h) * N * D;
  const T* vb = j.cold_v + ((static_cast<int64_t>(j.layer) * B + b) * H + h) * N * D;
  for (int64_t jj = 0; jj < M; ++jj) {
    const int64_t first = starts[b * M + jj];
    Prefetch(kb + first * D, run * D);
    Prefetch(vb + first * D, run * D);
  }
  // scores s[c * G + g][r]
  for (int64_t r = 0; r < R; ++r) {
    if (!valid[b * R + r]) continue;
    const int64_t slot = starts[b * M + r / run] + r % run;
    const int32_t pos = rot_pos[b * R + r];
    const float* row = (pos >= 0 && pos < n_table) ? table + static_cast<int64_t>(pos) * D : nullptr;
    const T* kr = kb + slot * D;
    int64_t d0 = 0;
#if defined(__AVX512F__)
    if (row)
      for (; d0 + 16 <= F; d0 += 16) {  // (k1, k2) -> (k1 cos - k2 sin, k2 cos + k1 sin), 16 lanes at a time
        const __m512 c = _mm512_loadu_ps(row + d0), sn = _mm512_loadu_ps(row + F + d0);
        const __m512 k1 = Load16(kr + d0), k2 = Load16(kr + F + d0);
        _mm512_storeu_ps(k.data() + d0, _mm512_sub_ps(_mm512_mul_ps(k1, c), _mm512_mul_ps(k2, sn)));
        _mm512_storeu_ps(k.data() + F + d0, _mm512_add_ps(_mm512_mul_ps(k2, c), _mm512_mul_ps(k1, sn)));
      }
#endif
    for (int64_t d = d0; d < F; ++d) {  // (k1, k2) -> (k1 cos - k2 sin, k2 cos + k1 sin)
      const float c = row ? row[d] : nan, sn = row ? row[F + d] : nan;
      const float k1 = Load(kr, d), k2 = Load(kr, F + d);
      k[d] = k1 * c + k2 * -sn;
      k[F + d] = k2 * c + k1 * sn;
    }
    for (int64_t c = 0; c < C; ++c)
      for (int64_t g = 0; g < G; ++g) {
        s[(c * G + g) * R + r] = Dot(q + (((b * C + c) * H + h) * G + g) * D, k.data(), D);
      }
  }
  // softmax weights p[i][r] (0 for invalid tokens), their max and sum per query
  for (int64_t c = 0; c < C; ++c)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = c * G + g, at = ((b * H + h) * G + g) * C + c;  // [B, Hkv, G, C]
      float mx = kMask;
      for (int64_t r = 0; r < R; ++r)
        if (valid[b * R + r]) mx = std::isnan(s[i * R + r]) || std::isnan(mx) ? std::numeric_limits<float>::quiet_NaN()
                                                                             : std::max(mx, s[i * R + r]);
      float sum = 0.0f;
      int64_t r0 = 0;
#if defined(__AVX512F__)
      for (; r0 + 16 <= R; r0 += 16) {
        __mmask16 ok = 0;
        for (int t = 0; t < 16; ++t) ok |= static_cast<__mmask16>(valid[b * R + r0 + t]) << t;
        const __m512 e = _mm512_maskz_mov_ps(ok, Exp16(_mm512_sub_ps(_mm512_loadu_ps(&s[i * R + r0]), _mm512_set1_ps(mx))));
        _mm512_storeu_ps(&s[i * R + r0], e);
        sum += _mm512_reduce_add_ps(e);
      }
#endif
      for (int64_t r = r0; r < R; ++r) {
        const float e = valid[b * R + r] ? std::exp(s[i * R + r] - mx) : 0.0f;
        s[i * R + r] = e;
        sum += e;
      }
      m[at] = mx;
      l[at] = sum;
      std::fill(o + at * D, o + (at + 1) * D, 0.0f);
    }
  // o[i] = sum_r p[i][r] v_r: each value row read once for every query
  for (int64_t r = 0; r < R; ++r) {
    if (!valid[b * R + r]) continue;
    const int64_t slot = starts[b * M + r / run] + r % run;
    const T* vr = vb + slot * D;
    for (int64_t c = 0; c < C; ++c)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = c * G + g, at = ((b * H + h) * G + g) * C + c;
        const float p = s[i * R + r];
        float* out = o + at * D;
        int64_t d0 = 0;
#if defined(__AVX512F__)
        const __m512 pv = _mm512_set1_ps(p);
        for (; d0 + 16 <= D; d0 += 16)
          _mm512_storeu_ps(out + d0, _mm512_fmadd_ps(pv, Load16(vr + d0), _mm512_loadu_ps(out + d0)));
#endif
        for (int64_t d = d0; d < D; ++d) out[d] += p * Load(vr, d);
      }
  }
}

template <typename T>
void Work(Job<T>& j) {
  for (int64_t i; (i = j.next.fetch_add(1)) < j.B * j.H;) {
    Head(j, i / j.H, i % j.H);
    j.done.fetch_add(1, std::memory_order_release);
  }
}

// The (batch row, KV head) pairs shared between the caller and XLA's intra-op threads: each pair reads its own
// pages' rows, so two threads read twice as many at once.
template <typename T>
ffi::Error Run(ffi::ThreadPool pool, const T* cold_k, const T* cold_v, int64_t L, int64_t B, int64_t H, int64_t N,
               int64_t D, int32_t layer, const int32_t* starts, int64_t M, int64_t run, const float* q, int64_t C,
               int64_t G, const int32_t* rot_pos, const bool* valid, const float* table, int64_t n_table, float* o,
               float* m, float* l) {
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("recalled_attention: layer out of range");
  for (int64_t i = 0; i < B * M; ++i)
    if (starts[i] < 0 || starts[i] + run > N) return ffi::Error::InvalidArgument("recalled_attention: a run leaves the store");
  auto job = std::make_shared<Job<T>>();
  job->cold_k = cold_k, job->cold_v = cold_v, job->B = B, job->H = H, job->N = N, job->D = D, job->M = M;
  job->run = run, job->C = C, job->G = G, job->n_table = n_table, job->layer = layer, job->starts = starts;
  job->q = q, job->rot_pos = rot_pos, job->valid = valid, job->table = table, job->o = o, job->m = m, job->l = l;
  const int64_t items = B * H;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < items) {
#if defined(__AVX512F__)
    _mm_pause();
#endif
  }
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer cold_k, ffi::AnyBuffer cold_v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> starts,
                ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> rot_pos, ffi::Buffer<ffi::PRED> valid,
                ffi::Buffer<ffi::F32> table, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                ffi::ResultBuffer<ffi::F32> l) {
  const auto kd = cold_k.dimensions(), qd = q.dimensions(), sd = starts.dimensions(), td = table.dimensions();
  const auto vd = cold_v.dimensions();
  if (kd.size() != 5 || qd.size() != 5 || sd.size() != 2 || td.size() != 2 || vd.size() != 5 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("recalled_attention: bad ranks");
  const int64_t L = kd[0], B = kd[1], H = kd[2], N = kd[3], D = kd[4];
  const int64_t C = qd[1], G = qd[3], M = sd[1];
  const int64_t R = rot_pos.dimensions().back();
  if (qd[0] != B || qd[2] != H || qd[4] != D || sd[0] != B || M == 0 || R % M != 0 || valid.element_count() != B * R ||
      td[1] != D || D % 2 != 0 || o->element_count() != B * H * G * C * D || m->element_count() != B * H * G * C)
    return ffi::Error::InvalidArgument("recalled_attention: shapes disagree");
  const int32_t lay = layer.typed_data()[0];
  const auto common = [&](auto kptr, auto vptr) {
    return Run(pool, kptr, vptr, L, B, H, N, D, lay, starts.typed_data(), M, R / M, q.typed_data(), C, G,
               rot_pos.typed_data(), valid.typed_data(), table.typed_data(), td[0], o->typed_data(), m->typed_data(),
               l->typed_data());
  };
  if (cold_k.element_type() == ffi::DataType::F32 && cold_v.element_type() == ffi::DataType::F32)
    return common(reinterpret_cast<const float*>(cold_k.untyped_data()),
                  reinterpret_cast<const float*>(cold_v.untyped_data()));
  if (cold_k.element_type() == ffi::DataType::U16 && cold_v.element_type() == ffi::DataType::U16)
    return common(reinterpret_cast<const uint16_t*>(cold_k.untyped_data()),
                  reinterpret_cast<const uint16_t*>(cold_v.untyped_data()));
  return ffi::Error::InvalidArgument("recalled_attention: K/V must be float32 or bfloat16 bits (uint16)");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RecalledAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // cold K [L, B, Hkv, N, D]
                                  .Arg<ffi::AnyBuffer>()          // cold V
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // runs' first slots [B, M]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // queries, rotated and scaled [B, C, Hkv, G, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rotation positions [B, R]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid [B, R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // rotation table [T, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o [B, Hkv, G, C, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // m [B, Hkv, G, C, 1]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // l [B, Hkv, G, C, 1]
