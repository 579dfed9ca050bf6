// Fused float32 attention for the CPU: the kernel of jaxpe.attention.cpu_flash, called from XLA
// through its FFI (jax.ffi.ffi_call); compiled on first use by cpu_flash.py.
//
// Per (batch row, kv head) and query block of BQ rows, the forward pass computes the block's scores
// against every key it may see (the causal prefix), the exact row softmax (max, exp, sum over the
// whole row: no online rescaling) and P.V; it writes the output and the row log-sum-exp. The
// backward pass recomputes P from the saved log-sum-exp and accumulates dq, dk, dv
// (FlashAttention-2's recurrence, Dao 2023, arXiv 2307.08691). Memory: O(BQ x S) per thread.
// Long sums (over keys: P.V, dS.K, the row sum; over query blocks: dK, dV) are float32 over a chunk
// and float64 across chunks (KB, FLUSH below), so their error does not grow with S or T.
//
// Layouts (row-major): q [B, T, N, Hq], k [B, S, K, Hq], v [B, S, K, H], slopes [N] (or empty),
// positions and segment ids int32 [B, T] / [B, S] (or empty), valid bool [B, S] (or empty);
// out [B, T, N, H], lse [B, T, N]. The query head n = kh * G + g (G = N / K) uses kv head kh. Scores: s = (q_c.k_c + q_p.k_p) * scale - slope_n (pos_t -
// pos_s), clamped at -FLT_MAX, where _c are the first Hq - P dims and _p the last P ("precise")
// dims, summed apart (the RoPE-emulated ALiBi's position-sized dims would round the content to
// their ulp in one sum). A key is visible when (not causal or s <= t) and valid[b, s] and
// qseg[b, t] == kseg[b, s], and within the local window (t - left <= s <= t + right, left / right < 0:
// unbounded) and chunk (t / chunk == s / chunk, chunk 0: none); a row with no visible key gives zeros
// and lse = -inf. With a soft cap (> 0) the scaled scores become cap * tanh(s / cap) before the ALiBi
// bias and the mask (Gemma 2). Key blocks outside every row's window or chunk are not computed: the
// work is O(T x window).
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int VL = 16;  // floats per vector
constexpr int NV = 4;   // vectors per micro-tile row
#else
constexpr int VL = 8;
constexpr int NV = 2;
#endif
constexpr int MR = 4;   // rows per micro-tile
constexpr int PAD = 16; // packed widths are multiples of this (>= VL)
constexpr int BQ = 64;  // query rows per block
// Sums over keys (P.V, dS.K, the row sum) and over query blocks (dK, dV) go in float32 over at most
// KB keys / FLUSH query blocks at a time, and these partial sums into float64: one float32
// accumulator over all S keys would lose the terms once the sum outgrows them (S = 2^25 ones summed
// to 2^24, an output of 0.5 instead of 1).
constexpr int64_t KB = 256;
constexpr int64_t FLUSH = 8;

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int vi __attribute__((vector_size(VL * 4)));

inline vf load(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof(vf));
  return r;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
inline vf splat(float x) { return vf{} + x; }
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp(x) for a vector (Cephes' single-precision polynomial, ~1 ulp); x below -87.3 gives 0.
inline vf vexp(vf x) {
  const vf lo = splat(-87.33654f), hi = splat(88.0f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  vf fx = xc * 1.44269504088896341f + 0.5f;
  vi ti = __builtin_convertvector(fx, vi);
  vf tf = __builtin_convertvector(ti, vf);
  tf = tf > fx ? tf - 1.0f : tf;
  ti = __builtin_convertvector(tf, vi);
  vf r = xc - tf * 0.693359375f + tf * 2.12194440e-4f;
  vf p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  vf y = p * r * r + r + 1.0f;
  vi bits = (ti + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(vf));
  y = y * scale;
  return x < lo ? splat(0.0f) : y;
}

// C[i][j] (+)= sum_p A(i, p) B[p][j] for i < m, j < n (n a multiple of VL), p < kk, with
// A(i, p) = a[i * ars + p * acs], B rows ldb apart, C rows ldc apart.
template <int R, int V>
inline void micro(int64_t kk, const float* a, int64_t ars, int64_t acs, const float* b, int64_t ldb,
                  float* c, int64_t ldc, bool acc) {
  vf sum[R][V];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) sum[i][v] = acc ? load(c + i * ldc + v * VL) : splat(0.0f);
  for (int64_t p = 0; p < kk; ++p) {
    vf bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load(b + p * ldb + v * VL);
    for (int i = 0; i < R; ++i) {
      vf av = splat(a[i * ars + p * acs]);
      for (int v = 0; v < V; ++v) sum[i][v] += av * bv[v];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) store(c + i * ldc + v * VL, sum[i][v]);
}

template <int R>
inline void micro_rows(int v, int64_t kk, const float* a, int64_t ars, int64_t acs, const float* b,
                       int64_t ldb, float* c, int64_t ldc, bool acc) {
  switch (v) {
    case 1: micro<R, 1>(kk, a, ars, acs, b, ldb, c, ldc, acc); break;
    case 2: micro<R, 2>(kk, a, ars, acs, b, ldb, c, ldc, acc); break;
#if defined(__AVX512F__)
    case 3: micro<R, 3>(kk, a, ars, acs, b, ldb, c, ldc, acc); break;
    case 4: micro<R, 4>(kk, a, ars, acs, b, ldb, c, ldc, acc); break;
#endif
  }
}

void gemm(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, int64_t acs, const float* b,
          int64_t ldb, float* c, int64_t ldc, bool acc) {
  if (kk == 0) {
    if (!acc)
      for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, n * sizeof(float));
    return;
  }
  for (int64_t j = 0; j < n; j += NV * VL) {
    int v = static_cast<int>(std::min<int64_t>(NV, (n - j) / VL));
    int64_t i = 0;
    if (v * VL <= 16)  // a narrow panel (head dim 16): taller tiles, more FMAs per load of B
      for (; i + 2 * MR <= m; i += 2 * MR) {
        if (v == 1) micro<2 * MR, 1>(kk, a + i * ars, ars, acs, b + j, ldb, c + i * ldc + j, ldc, acc);
        else micro<2 * MR, 2>(kk, a + i * ars, ars, acs, b + j, ldb, c + i * ldc + j, ldc, acc);
      }
    for (; i + MR <= m; i += MR) micro_rows<MR>(v, kk, a + i * ars, ars, acs, b + j, ldb, c + i * ldc + j, ldc, acc);
    for (; i < m; ++i) micro_rows<1>(v, kk, a + i * ars, ars, acs, b + j, ldb, c + i * ldc + j, ldc, acc);
  }
}

struct Problem {
  int64_t B, T, S, N, K, G, Hq, H, P;  // P: precise dims
  float scale;
  bool causal;
  int64_t left, right, chunk;  // local window sides (< 0: unbounded), chunk size (0: none)
  float cap;                   // logits soft cap (0: none)
  const float *q, *k, *v, *slopes;
  const int32_t *qpos, *kpos, *qseg, *kseg;
  const bool* valid;
  int64_t Hqp, Hp, Sp;  // padded widths
};

// The keys [begin, end) that query t may see under the causal mask, window and chunk (not clipped to S).
inline int64_t row_begin(const Problem& pr, int64_t t) {
  int64_t lo = 0;
  if (pr.left >= 0) lo = std::max(lo, t - pr.left);
  if (pr.chunk > 0) lo = std::max(lo, t / pr.chunk * pr.chunk);
  return lo;
}
inline int64_t row_end(const Problem& pr, int64_t t) {
  int64_t hi = pr.S;
  if (pr.causal) hi = std::min(hi, t + 1);
  if (pr.right >= 0) hi = std::min(hi, t + pr.right + 1);
  if (pr.chunk > 0) hi = std::min(hi, (t / pr.chunk + 1) * pr.chunk);
  return hi;
}

// Scaled, capped, biased, masked scores of query rows [t0, t0 + rows) of head n (batch row b) against
// keys [s0, s_end) (s0 a multiple of PAD): sc [rows][ld] (ld >= width = round_up(s_end - s0, PAD)),
// column c for key s0 + c; columns a row may not see hold -FLT_MAX. kt: the kv head's keys
// transposed, [Hq][Sp]; tmp: rows x ld scratch when P > 0; capd: rows x ld, d cap(x) / dx
// (1 - tanh^2) when given and the cap is on. qs: the block's queries times the scale, packed
// [rows][Hqp] (pack_scaled_q).
void scores(const Problem& pr, int64_t b, int64_t n, int64_t t0, int64_t rows, int64_t s0, int64_t s_end,
            const float* qs, const float* kt, float* sc, float* tmp, int64_t ld, float* capd = nullptr) {
  const int64_t split = pr.Hq - pr.P, width = round_up(s_end - s0, PAD);
  gemm(rows, width, split, qs, pr.Hqp, 1, kt + s0, pr.Sp, sc, ld, false);
  if (pr.P > 0) {
    gemm(rows, width, pr.P, qs + split, pr.Hqp, 1, kt + split * pr.Sp + s0, pr.Sp, tmp, ld, false);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t s = 0; s < width; ++s) sc[r * ld + s] += tmp[r * ld + s];
  }
  if (pr.cap > 0.0f) {  // Gemma 2: cap * tanh(s / cap), before the bias and the mask
    const float inv = 1.0f / pr.cap;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t s = 0; s < width; ++s) {
        const float th = std::tanh(sc[r * ld + s] * inv);
        sc[r * ld + s] = pr.cap * th;
        if (capd) capd[r * ld + s] = 1.0f - th * th;
      }
  }
  const float slope = pr.slopes ? pr.slopes[n] : 0.0f;
  const int32_t* kpos = pr.kpos ? pr.kpos + b * pr.S + s0 : nullptr;
  const int32_t* kseg = pr.kseg ? pr.kseg + b * pr.S + s0 : nullptr;
  const bool* valid = pr.valid ? pr.valid + b * pr.S + s0 : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r;
    float* row = sc + r * ld;
    // one branch-free (vectorizable) pass per option
    const int64_t vis_end = std::max<int64_t>(std::min(s_end, row_end(pr, t)) - s0, 0);
    const int64_t vis_begin = std::min(std::max<int64_t>(row_begin(pr, t) - s0, 0), vis_end);
    for (int64_t s = 0; s < vis_begin; ++s) row[s] = -FLT_MAX;
    for (int64_t s = vis_end; s < width; ++s) row[s] = -FLT_MAX;
    if (kpos) {
      const int32_t qp = pr.qpos[b * pr.T + t];
      for (int64_t s = vis_begin; s < vis_end; ++s)
        row[s] = std::max(row[s] - slope * static_cast<float>(qp - kpos[s]), -FLT_MAX);
    }
    if (valid)
      for (int64_t s = vis_begin; s < vis_end; ++s) row[s] = valid[s] ? row[s] : -FLT_MAX;
    if (kseg) {
      const int32_t qs = pr.qseg[b * pr.T + t];
      for (int64_t s = vis_begin; s < vis_end; ++s) row[s] = kseg[s] == qs ? row[s] : -FLT_MAX;
    }
  }
}

// Packs the queries t0..t0+rows of head n (batch row b) times the scale: qs [rows][Hqp]. (The
// scale multiplies q before the product rather than the scores after it: one pass over rows x Hq
// values instead of rows x S; the two round differently, within float32 rounding of each other.)
void pack_scaled_q(const Problem& pr, int64_t b, int64_t n, int64_t t0, int64_t rows, float* qs) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = pr.q + ((b * pr.T + t0 + r) * pr.N + n) * pr.Hq;
    for (int64_t h = 0; h < pr.Hq; ++h) qs[r * pr.Hqp + h] = src[h] * pr.scale;
  }
}

// The row's max; NaN if any score is NaN (so the row's output and lse are NaN, as the reference's).
inline float row_max(const float* row, int64_t width) {
  vf m = splat(-FLT_MAX);
  for (int64_t s = 0; s < width; s += VL) {
    vf x = load(row + s);
    m = ((x > m) | (x != x)) ? x : m;  // a NaN lane stays NaN: x > NaN is false
  }
  float out = -FLT_MAX;
  for (int i = 0; i < VL; ++i) out = (m[i] > out || m[i] != m[i]) ? m[i] : out;
  return out;
}

// The keys [key_begin, key_end) a query block [t0, t0 + rows) may see; key_begin a multiple of PAD.
int64_t key_end(const Problem& pr, int64_t t0, int64_t rows) {
  return std::max<int64_t>(std::min(pr.S, row_end(pr, t0 + rows - 1)), 0);
}
int64_t key_begin(const Problem& pr, int64_t t0, int64_t rows) {
  return std::min(row_begin(pr, t0), key_end(pr, t0, rows)) / PAD * PAD;
}

// Packs kv head kh of batch row b: kt [Hq][Sp] (transposed keys), vp [S][Hp] (values, zero padded).
void pack_kv(const Problem& pr, int64_t b, int64_t kh, float* kt, float* vp) {
  std::memset(kt, 0, sizeof(float) * pr.Hq * pr.Sp);
  std::memset(vp, 0, sizeof(float) * pr.S * pr.Hp);
  for (int64_t s = 0; s < pr.S; ++s) {
    const float* kr = pr.k + ((b * pr.S + s) * pr.K + kh) * pr.Hq;
    const float* vr = pr.v + ((b * pr.S + s) * pr.K + kh) * pr.H;
    for (int64_t h = 0; h < pr.Hq; ++h) kt[h * pr.Sp + s] = kr[h];
    std::memcpy(vp + s * pr.Hp, vr, sizeof(float) * pr.H);
  }
}

struct Scratch {
  std::vector<float> kt, vp, sc, tmp, o, qs, capd;
  std::vector<double> od;
  explicit Scratch(const Problem& pr)
      : kt(pr.Hq * pr.Sp), vp(pr.S * pr.Hp), sc(BQ * pr.Sp), tmp(pr.P ? BQ * pr.Sp : 0), o(BQ * pr.Hp),
        qs(BQ * pr.Hqp), capd(pr.cap > 0.0f ? BQ * pr.Sp : 0), od(BQ * std::max(pr.Hp, pr.Hqp)) {}
};

// C = A . B over kk (a sum over keys) in chunks of KB: each chunk's float32 product added into the
// float64 acc [m][n] (ldc apart), c a float32 [m][ldc] scratch for one chunk. A(i, p) = a[i * ars +
// p], B rows ldb apart.
void gemm_chunked(int64_t m, int64_t n, int64_t kk, const float* a, int64_t ars, const float* b, int64_t ldb,
                  float* c, int64_t ldc, double* acc) {
  for (int64_t i = 0; i < m * ldc; ++i) acc[i] = 0.0;
  for (int64_t p0 = 0; p0 < kk; p0 += KB) {
    const int64_t len = std::min(KB, kk - p0);
    gemm(m, n, len, a + p0, ars, 1, b + p0 * ldb, ldb, c, ldc, false);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) acc[i * ldc + j] += c[i * ldc + j];
  }
}

// The float32 accumulator acc [rows][width] added into the float64 total and cleared.
void flush(float* acc, double* total, int64_t rows, int64_t width) {
  for (int64_t i = 0; i < rows * width; ++i) {
    total[i] += acc[i];
    acc[i] = 0.0f;
  }
}

void forward_task(const Problem& pr, int64_t b, int64_t kh, Scratch& w, float* out, float* lse) {
  pack_kv(pr, b, kh, w.kt.data(), w.vp.data());
  const int64_t ld = pr.Sp;
  for (int64_t g = 0; g < pr.G; ++g) {
    const int64_t n = kh * pr.G + g;
    for (int64_t t0 = 0; t0 < pr.T; t0 += BQ) {
      const int64_t rows = std::min<int64_t>(BQ, pr.T - t0), s_end = key_end(pr, t0, rows);
      const int64_t s0 = key_begin(pr, t0, rows), width = round_up(s_end - s0, PAD);
      float* sc = w.sc.data();
      pack_scaled_q(pr, b, n, t0, rows, w.qs.data());
      scores(pr, b, n, t0, rows, s0, s_end, w.qs.data(), w.kt.data(), sc, w.tmp.data(), ld);
      float m[BQ];
      double l[BQ];
      for (int64_t r = 0; r < rows; ++r) {
        float* row = sc + r * ld;
        const float mx = row_max(row, width);
        m[r] = mx;
        if (mx == -FLT_MAX) {  // no visible key: P = 0
          std::memset(row, 0, sizeof(float) * width);
          l[r] = 0.0;
          continue;
        }
        double total = 0.0;
        for (int64_t s0 = 0; s0 < width; s0 += KB) {  // float32 per chunk of keys, float64 across
          vf sum = splat(0.0f);
          for (int64_t s = s0; s < std::min(width, s0 + KB); s += VL) {
            vf x = load(row + s);
            vf p = vexp(x - mx);
            p = x == splat(-FLT_MAX) ? splat(0.0f) : p;
            store(row + s, p);
            sum += p;
          }
          for (int i = 0; i < VL; ++i) total += sum[i];
        }
        l[r] = total;
      }
      gemm_chunked(rows, pr.Hp, s_end - s0, sc, ld, w.vp.data() + s0 * pr.Hp, pr.Hp, w.o.data(), pr.Hp,
                   w.od.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r;
        float* dst = out + ((b * pr.T + t) * pr.N + n) * pr.H;
        const bool seen = m[r] != -FLT_MAX;  // NaN scores: seen, NaN output and lse
        const double inv = seen ? 1.0 / l[r] : 0.0;
        for (int64_t h = 0; h < pr.H; ++h) dst[h] = static_cast<float>(w.od[r * pr.Hp + h] * inv);
        lse[(b * pr.T + t) * pr.N + n] = seen ? m[r] + static_cast<float>(std::log(l[r])) : -INFINITY;
      }
    }
  }
}

struct BwdProblem {
  const float *out, *lse, *dout, *dlse;
  float *dq, *dk, *dv;
};

struct BwdScratch : Scratch {
  std::vector<float> kp, vt, dkp, dvp, dsc, dop, qp, dqb;
  std::vector<double> dkd, dvd;  // dk, dv: the float32 sums of FLUSH query blocks added up
  BwdScratch(const Problem& pr)
      : Scratch(pr), kp(pr.S * pr.Hqp), vt(pr.H * pr.Sp), dkp(pr.S * pr.Hqp), dvp(pr.S * pr.Hp),
        dsc(BQ * pr.Sp), dop(BQ * pr.Hp), qp(BQ * pr.Hqp), dqb(BQ * pr.Hqp), dkd(pr.S * pr.Hqp),
        dvd(pr.S * pr.Hp) {}
};

void backward_task(const Problem& pr, const BwdProblem& bp, int64_t b, int64_t kh, BwdScratch& w) {
  pack_kv(pr, b, kh, w.kt.data(), w.vp.data());
  std::fill(w.kp.begin(), w.kp.end(), 0.0f);
  std::fill(w.vt.begin(), w.vt.end(), 0.0f);
  std::fill(w.dkp.begin(), w.dkp.end(), 0.0f);
  std::fill(w.dvp.begin(), w.dvp.end(), 0.0f);
  std::fill(w.dkd.begin(), w.dkd.end(), 0.0);
  std::fill(w.dvd.begin(), w.dvd.end(), 0.0);
  // query blocks in dkp / dvp since their last flush, and the keys [pending_begin, pending_end) they touched
  int64_t pending = 0, pending_begin = pr.S, pending_end = 0;
  auto flush_kv = [&]() {
    if (pending_end > pending_begin) {
      const int64_t n = pending_end - pending_begin;
      flush(w.dkp.data() + pending_begin * pr.Hqp, w.dkd.data() + pending_begin * pr.Hqp, n, pr.Hqp);
      flush(w.dvp.data() + pending_begin * pr.Hp, w.dvd.data() + pending_begin * pr.Hp, n, pr.Hp);
    }
    pending = pending_end = 0;
    pending_begin = pr.S;
  };
  for (int64_t s = 0; s < pr.S; ++s) {
    std::memcpy(w.kp.data() + s * pr.Hqp, pr.k + ((b * pr.S + s) * pr.K + kh) * pr.Hq, sizeof(float) * pr.Hq);
    for (int64_t h = 0; h < pr.H; ++h) w.vt[h * pr.Sp + s] = w.vp[s * pr.Hp + h];
  }
  const int64_t ld = pr.Sp;
  for (int64_t g = 0; g < pr.G; ++g) {
    const int64_t n = kh * pr.G + g;
    for (int64_t t0 = 0; t0 < pr.T; t0 += BQ) {
      const int64_t rows = std::min<int64_t>(BQ, pr.T - t0), s_end = key_end(pr, t0, rows);
      const int64_t s0 = key_begin(pr, t0, rows), width = round_up(s_end - s0, PAD), span = s_end - s0;
      float* sc = w.sc.data();
      float* ds = w.dsc.data();
      float* capd = pr.cap > 0.0f ? w.capd.data() : nullptr;
      pack_scaled_q(pr, b, n, t0, rows, w.qs.data());
      scores(pr, b, n, t0, rows, s0, s_end, w.qs.data(), w.kt.data(), sc, w.tmp.data(), ld, capd);
      float delta[BQ];
      std::fill(w.dop.begin(), w.dop.end(), 0.0f);
      std::fill(w.qp.begin(), w.qp.end(), 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row_id = (b * pr.T + t0 + r) * pr.N + n;
        const float* o = bp.out + row_id * pr.H;
        const float* d = bp.dout + row_id * pr.H;
        float dot = 0.0f;
        for (int64_t h = 0; h < pr.H; ++h) dot += o[h] * d[h];
        delta[r] = dot - (bp.dlse ? bp.dlse[row_id] : 0.0f);
        std::memcpy(w.dop.data() + r * pr.Hp, d, sizeof(float) * pr.H);
        std::memcpy(w.qp.data() + r * pr.Hqp, pr.q + row_id * pr.Hq, sizeof(float) * pr.Hq);
        const float l = bp.lse[row_id];
        float* row = sc + r * ld;
        if (l == -INFINITY) {
          std::memset(row, 0, sizeof(float) * width);
          continue;
        }
        for (int64_t s = 0; s < width; s += VL) {
          vf x = load(row + s);
          vf p = vexp(x - l);
          store(row + s, x == splat(-FLT_MAX) ? splat(0.0f) : p);
        }
      }
      // dv[s] += sum_r P[r][s] dO[r]
      gemm(span, pr.Hp, rows, sc, 1, ld, w.dop.data(), pr.Hp, w.dvp.data() + s0 * pr.Hp, pr.Hp, true);
      // dP = dO . V^T
      gemm(rows, width, pr.H, w.dop.data(), pr.Hp, 1, w.vt.data() + s0, pr.Sp, ds, ld, false);
      for (int64_t r = 0; r < rows; ++r) {
        const vf dl = splat(delta[r]);
        for (int64_t s = 0; s < width; s += VL) {
          vf p = load(sc + r * ld + s);
          vf d = p * (load(ds + r * ld + s) - dl) * pr.scale;
          if (capd) d = d * load(capd + r * ld + s);  // through the soft cap to the raw scores
          store(ds + r * ld + s, d);
        }
      }
      // dq = dS . K, dk[s] += sum_r dS[r][s] q[r]
      gemm_chunked(rows, pr.Hqp, span, ds, ld, w.kp.data() + s0 * pr.Hqp, pr.Hqp, w.dqb.data(), pr.Hqp,
                   w.od.data());
      gemm(span, pr.Hqp, rows, ds, 1, ld, w.qp.data(), pr.Hqp, w.dkp.data() + s0 * pr.Hqp, pr.Hqp, true);
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = bp.dq + ((b * pr.T + t0 + r) * pr.N + n) * pr.Hq;
        for (int64_t h = 0; h < pr.Hq; ++h) dst[h] = static_cast<float>(w.od[r * pr.Hqp + h]);
      }
      pending_end = std::max(pending_end, s_end);
      pending_begin = std::min(pending_begin, s0);
      if (++pending == FLUSH) flush_kv();
    }
  }
  flush_kv();
  for (int64_t s = 0; s < pr.S; ++s) {
    float* dk = bp.dk + ((b * pr.S + s) * pr.K + kh) * pr.Hq;
    float* dv = bp.dv + ((b * pr.S + s) * pr.K + kh) * pr.H;
    for (int64_t h = 0; h < pr.Hq; ++h) dk[h] = static_cast<float>(w.dkd[s * pr.Hqp + h]);
    for (int64_t h = 0; h < pr.H; ++h) dv[h] = static_cast<float>(w.dvd[s * pr.Hp + h]);
  }
}

// Runs task(index) for index in [0, count) on the caller and on pool workers that start before the
// caller has run out of work (a worker queued behind busy threads finds the loop closed and returns:
// the caller never waits for a task that has not started, so a busy or one-thread pool cannot
// deadlock).
struct Loop {
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int active = 0;
  bool closed = false;
};

template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t count, const F& task) {
  auto loop = std::make_shared<Loop>();
  auto run = [loop, count, &task]() {
    for (int64_t i = loop->next.fetch_add(1); i < count; i = loop->next.fetch_add(1)) task(i);
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), count));
  for (int64_t w = 1; w < workers; ++w) {
    pool.Schedule([loop, run]() {
      {
        std::lock_guard<std::mutex> lock(loop->mu);
        if (loop->closed) return;
        ++loop->active;
      }
      run();
      std::lock_guard<std::mutex> lock(loop->mu);
      --loop->active;
      loop->cv.notify_all();
    });
  }
  run();
  std::unique_lock<std::mutex> lock(loop->mu);
  loop->closed = true;
  loop->cv.wait(lock, [&] { return loop->active == 0; });
}

Problem make_problem(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::S32> kpos, ffi::Buffer<ffi::S32> qseg,
                     ffi::Buffer<ffi::S32> kseg, ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::F32> slopes,
                     float scale, bool causal, int64_t precise, int64_t left, int64_t right, int64_t chunk,
                     float cap) {
  Problem pr{};
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  pr.B = qd[0];
  pr.T = qd[1];
  pr.N = qd[2];
  pr.Hq = qd[3];
  pr.S = kd[1];
  pr.K = kd[2];
  pr.G = pr.N / pr.K;
  pr.H = vd[3];
  pr.P = precise;
  pr.scale = scale;
  pr.causal = causal;
  pr.left = left;
  pr.right = right;
  pr.chunk = chunk;
  pr.cap = cap;
  pr.q = q.typed_data();
  pr.k = k.typed_data();
  pr.v = v.typed_data();
  pr.slopes = slopes.element_count() ? slopes.typed_data() : nullptr;
  pr.qpos = qpos.element_count() ? qpos.typed_data() : nullptr;
  pr.kpos = kpos.element_count() ? kpos.typed_data() : nullptr;
  pr.qseg = qseg.element_count() ? qseg.typed_data() : nullptr;
  pr.kseg = kseg.element_count() ? kseg.typed_data() : nullptr;
  pr.valid = valid.element_count() ? valid.typed_data() : nullptr;
  pr.Hqp = round_up(pr.Hq, PAD);
  pr.Hp = round_up(pr.H, PAD);
  pr.Sp = round_up(pr.S, PAD);
  return pr;
}

// The shapes the kernel reads (the Python side checks the user's arguments; this guards the call).
ffi::Error check(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                 ffi::Buffer<ffi::S32>& qpos, ffi::Buffer<ffi::S32>& kpos, ffi::Buffer<ffi::S32>& qseg,
                 ffi::Buffer<ffi::S32>& kseg, ffi::Buffer<ffi::PRED>& valid, ffi::Buffer<ffi::F32>& slopes,
                 int64_t precise) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("cpu_flash: q, k, v must have rank 4");
  const int64_t B = qd[0], T = qd[1], N = qd[2], Hq = qd[3], S = kd[1], K = kd[2];
  if (K == 0 || N % K != 0 || kd[0] != B || kd[3] != Hq || vd[0] != B || vd[1] != S || vd[2] != K)
    return ffi::Error::InvalidArgument("cpu_flash: q [B,T,N,Hq], k [B,S,K,Hq], v [B,S,K,H] do not fit");
  const int64_t G = N / K;
  if (precise < 0 || precise > Hq) return ffi::Error::InvalidArgument("cpu_flash: precise_dims outside 0..Hq");
  auto side = [](int64_t count, int64_t a, int64_t b) { return count == 0 || count == a * b; };
  if (!side(qpos.element_count(), B, T) || !side(kpos.element_count(), B, S) || !side(qseg.element_count(), B, T) ||
      !side(kseg.element_count(), B, S) || !side(valid.element_count(), B, S) ||
      !side(slopes.element_count(), K, G) || (qpos.element_count() == 0) != (kpos.element_count() == 0) ||
      (qpos.element_count() == 0) != (slopes.element_count() == 0) ||
      (qseg.element_count() == 0) != (kseg.element_count() == 0))
    return ffi::Error::InvalidArgument("cpu_flash: side arrays do not fit q and k");
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::S32> kpos,
                   ffi::Buffer<ffi::S32> qseg, ffi::Buffer<ffi::S32> kseg, ffi::Buffer<ffi::PRED> valid,
                   ffi::Buffer<ffi::F32> slopes, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> lse, float scale, bool causal, int64_t precise, int64_t left,
                   int64_t right, int64_t chunk, float cap) {
  if (auto err = check(q, k, v, qpos, kpos, qseg, kseg, valid, slopes, precise); !err.success()) return err;
  Problem pr = make_problem(q, k, v, qpos, kpos, qseg, kseg, valid, slopes, scale, causal, precise, left, right,
                            chunk, cap);
  if (pr.B * pr.T * pr.N == 0) return ffi::Error::Success();
  if (pr.S == 0) {
    std::memset(out->typed_data(), 0, out->size_bytes());
    std::fill(lse->typed_data(), lse->typed_data() + lse->element_count(), -INFINITY);
    return ffi::Error::Success();
  }
  float* o = out->typed_data();
  float* l = lse->typed_data();
  parallel_for(pool, pr.B * pr.K, [&](int64_t i) {
    Scratch w(pr);
    forward_task(pr, i / pr.K, i % pr.K, w, o, l);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::S32> kpos,
                    ffi::Buffer<ffi::S32> qseg, ffi::Buffer<ffi::S32> kseg, ffi::Buffer<ffi::PRED> valid,
                    ffi::Buffer<ffi::F32> slopes, ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::F32> dlse, ffi::ResultBuffer<ffi::F32> dq,
                    ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, float scale, bool causal,
                    int64_t precise, int64_t left, int64_t right, int64_t chunk, float cap) {
  if (auto err = check(q, k, v, qpos, kpos, qseg, kseg, valid, slopes, precise); !err.success()) return err;
  Problem pr = make_problem(q, k, v, qpos, kpos, qseg, kseg, valid, slopes, scale, causal, precise, left, right,
                            chunk, cap);
  BwdProblem bp{out.typed_data(), lse.typed_data(), dout.typed_data(),
                dlse.element_count() ? dlse.typed_data() : nullptr, dq->typed_data(), dk->typed_data(),
                dv->typed_data()};
  if (pr.T == 0 || pr.S == 0) {
    std::memset(dq->typed_data(), 0, dq->size_bytes());
    std::memset(dk->typed_data(), 0, dk->size_bytes());
    std::memset(dv->typed_data(), 0, dv->size_bytes());
    return ffi::Error::Success();
  }
  parallel_for(pool, pr.B * pr.K, [&](int64_t i) {
    BwdScratch w(pr);
    backward_task(pr, bp, i / pr.K, i % pr.K, w);
  });
  return ffi::Error::Success();
}

}  // namespace

#define JAXPE_ARGS                                                                              \
  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()     \
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>() \
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::PRED>>().Arg<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpeCpuFlashForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>() JAXPE_ARGS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("precise_dims")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<int64_t>("chunk_size")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpeCpuFlashBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>() JAXPE_ARGS
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("precise_dims")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<int64_t>("chunk_size")
                                  .Attr<float>("soft_cap"));
