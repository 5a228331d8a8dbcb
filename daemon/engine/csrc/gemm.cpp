// Small-batch fp32 matrix products for the CPU runner (codespec.daemon.cpu_gemm).
//
// y[M, N] = x[M, K] @ W[K, N] (+ bias[N]) (+ res[M, N]) with W packed in panels of
// 16 output columns, P[N / 16][K][16], so that each panel streams from memory in
// order. Rows are taken four at a time: 4 rows x 2 AVX2 vectors = 8 accumulators,
// the most this register file holds without spilling (5 or 6 rows run slower).
// A product of one or two rows takes four or two panels per pass instead, for the same
// 8 independent sums (one panel alone leaves the FMA units waiting on its 2 or 4).
// Panels hold fp32, fp16 or bf16 weights (the 16-bit ones widened exactly on load).
// Each output element is summed over k = 0 .. K-1 in order with one FMA per step,
// whatever M is, so a row's result does not depend on which other rows share the
// call.
//
// MKL's sgemm spends about M times a one-row product for M = 2 .. 8 on this kind of
// CPU; this kernel reads the weights once for up to four rows. With one-row products
// at the FMA units' rate too, each of these costs about its rows' arithmetic.
#include <immintrin.h>
#include <stdint.h>

#include <cmath>


namespace {

// One panel row of 16 weights as two fp32 vectors: fp32 panels are read as they are,
// fp16 panels (half the bytes to stream) are widened exactly with F16C, bf16 ones by
// a shift.
inline void load16(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(p);
  w1 = _mm256_loadu_ps(p + 8);
}

inline void load16(const uint16_t* p, __m256& w0, __m256& w1) {
  w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// bfloat16 bits: the top half of an fp32, so widening is a 16-bit shift (exact).
struct bf16 {
  uint16_t bits;
};

inline void load16(const bf16* p, __m256& w0, __m256& w1) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16));
}

// MR rows of one panel: 2 * MR accumulators, enough to keep the FMA units busy from
// three rows on. pf: the panel to fetch into L2 while this one is computed (the next
// one, on the first row group), or nullptr. W: float, uint16_t (fp16 bits) or bf16.
template <int MR, typename W>
inline void block1(const float* x, int64_t ldx, int64_t K, const W* p, float* y,
                  int64_t ldy, const float* bias, const float* res, int64_t ldr,
                  const W* pf) {
  __m256 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) {
    a0[r] = _mm256_setzero_ps();
    a1[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    load16(p + k * 16, w0, w1);
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + k * 16), _MM_HINT_T1);
    for (int r = 0; r < MR; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
      a0[r] = _mm256_fmadd_ps(b, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(b, w1, a1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (bias) {
      a0[r] = _mm256_add_ps(a0[r], _mm256_loadu_ps(bias));
      a1[r] = _mm256_add_ps(a1[r], _mm256_loadu_ps(bias + 8));
    }
    if (res) {
      a0[r] = _mm256_add_ps(a0[r], _mm256_loadu_ps(res + r * ldr));
      a1[r] = _mm256_add_ps(a1[r], _mm256_loadu_ps(res + r * ldr + 8));
    }
    _mm256_storeu_ps(y + r * ldy, a0[r]);
    _mm256_storeu_ps(y + r * ldy + 8, a1[r]);
  }
}

// MR rows times NP adjacent panels (16 * NP output columns): 2 * MR * NP accumulators.
// One or two rows of one panel would leave the FMA units waiting on a chain of 2 or 4
// dependent sums (an FMA's latency is ~4 cycles), so they take 4 or 2 panels at once;
// each output is still summed over k in order, one FMA per step, as in block1.
// W: float, uint16_t (fp16 bits) or bf16; ps: the panel stride.
template <int MR, int NP, typename W>
inline void blockn(const float* x, int64_t ldx, int64_t K, const W* p, int64_t ps, float* y,
                   int64_t ldy, const float* bias, const float* res, int64_t ldr) {
  __m256 a0[MR][NP], a1[MR][NP];
  for (int r = 0; r < MR; ++r) {
    for (int q = 0; q < NP; ++q) {
      a0[r][q] = _mm256_setzero_ps();
      a1[r][q] = _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0[NP], w1[NP];
    for (int q = 0; q < NP; ++q) load16(p + q * ps + k * 16, w0[q], w1[q]);
    for (int r = 0; r < MR; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
      for (int q = 0; q < NP; ++q) {
        a0[r][q] = _mm256_fmadd_ps(b, w0[q], a0[r][q]);
        a1[r][q] = _mm256_fmadd_ps(b, w1[q], a1[r][q]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int q = 0; q < NP; ++q) {
      const int64_t c = 16 * q;
      if (bias) {
        a0[r][q] = _mm256_add_ps(a0[r][q], _mm256_loadu_ps(bias + c));
        a1[r][q] = _mm256_add_ps(a1[r][q], _mm256_loadu_ps(bias + c + 8));
      }
      if (res) {
        a0[r][q] = _mm256_add_ps(a0[r][q], _mm256_loadu_ps(res + r * ldr + c));
        a1[r][q] = _mm256_add_ps(a1[r][q], _mm256_loadu_ps(res + r * ldr + c + 8));
      }
      _mm256_storeu_ps(y + r * ldy + c, a0[r][q]);
      _mm256_storeu_ps(y + r * ldy + c + 8, a1[r][q]);
    }
  }
}

// One or two rows: NP panels per pass (see blockn), then single panels for the rest.
template <int MR, int NP, typename W>
void narrow(const float* x, int64_t K, int64_t ldx, const W* P, int64_t j0, int64_t j1,
            float* y, int64_t ldy, const float* bias, const float* res, int64_t ldr) {
  int64_t j = j0;
  for (; j + 16 * NP <= j1; j += 16 * NP) {
    blockn<MR, NP, W>(x, ldx, K, P + j * K, 16 * K, y + j, ldy, bias ? bias + j : nullptr,
                      res ? res + j : nullptr, ldr);
  }
  for (; j < j1; j += 16) {
    block1<MR, W>(x, ldx, K, P + j * K, y + j, ldy, bias ? bias + j : nullptr,
                  res ? res + j : nullptr, ldr, nullptr);
  }
}

template <typename W>
void panels(const float* x, int64_t M, int64_t K, int64_t ldx, const W* P, int64_t j0,
            int64_t j1, float* y, int64_t ldy, const float* bias, const float* res, int64_t ldr) {
  if (M == 1) return narrow<1, 4, W>(x, K, ldx, P, j0, j1, y, ldy, bias, res, ldr);
  if (M == 2) return narrow<2, 2, W>(x, K, ldx, P, j0, j1, y, ldy, bias, res, ldr);
  for (int64_t j = j0; j < j1; j += 16) {
    const W* p = P + j * K;
    const W* next = j + 16 < j1 ? p + 16 * K : nullptr;
    for (int64_t m = 0; m < M; m += 4) {
      const W* pf = m == 0 ? next : nullptr;
      const int64_t mr = M - m < 4 ? M - m : 4;
      const float* xm = x + m * ldx;
      float* ym = y + m * ldy + j;
      const float* b = bias ? bias + j : nullptr;
      const float* rm = res ? res + m * ldr + j : nullptr;
      switch (mr) {
        case 1: block1<1, W>(xm, ldx, K, p, ym, ldy, b, rm, ldr, pf); break;
        case 2: block1<2, W>(xm, ldx, K, p, ym, ldy, b, rm, ldr, pf); break;
        case 3: block1<3, W>(xm, ldx, K, p, ym, ldy, b, rm, ldr, pf); break;
        default: block1<4, W>(xm, ldx, K, p, ym, ldy, b, rm, ldr, pf); break;
      }
    }
  }
}

// exp(x) for a vector, x <= 0 (softmax after the max is subtracted): 2^n * 2^f with
// Cephes' exp2f polynomial for 2^f on [-0.5, 0.5] (relative error ~2e-7).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// scores[r][s] = q_r . k_s * scale for RG rows, four keys at a time: 4 x RG
// accumulators, each key chunk loaded once for every row.
template <int RG>
inline void score_rows(const float* const* qr, const float* kh, int64_t D, int64_t total,
                       float scale, float* const* sr) {
  int64_t s = 0;
  for (; s + 4 <= total; s += 4) {
    __m256 acc[RG][4];
    for (int r = 0; r < RG; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      __m256 qv[RG];
      for (int r = 0; r < RG; ++r) qv[r] = _mm256_loadu_ps(qr[r] + c);
      for (int j = 0; j < 4; ++j) {
        const __m256 kv = _mm256_loadu_ps(kh + (s + j) * D + c);
        for (int r = 0; r < RG; ++r) acc[r][j] = _mm256_fmadd_ps(qv[r], kv, acc[r][j]);
      }
    }
    const __m128 sc = _mm_set1_ps(scale);
    for (int r = 0; r < RG; ++r) {
      const __m256 t0 = _mm256_hadd_ps(acc[r][0], acc[r][1]);
      const __m256 t1 = _mm256_hadd_ps(acc[r][2], acc[r][3]);
      const __m256 t2 = _mm256_hadd_ps(t0, t1);
      const __m128 four =
          _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1));
      _mm_storeu_ps(sr[r] + s, _mm_mul_ps(four, sc));
    }
  }
  for (; s < total; ++s) {
    for (int r = 0; r < RG; ++r) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr[r] + c), _mm256_loadu_ps(kh + s * D + c), acc);
      sr[r][s] = hsum(acc) * scale;
    }
  }
}

// In place: scores -> softmax weights (-inf scores get weight 0).
inline void softmax_row(float* sr, int64_t total) {
  float mx = -INFINITY;
  for (int64_t s = 0; s < total; ++s) mx = sr[s] > mx ? sr[s] : mx;
  const __m256 mv = _mm256_set1_ps(mx);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 sum = _mm256_setzero_ps();
  int64_t s = 0;
  for (; s + 8 <= total; s += 8) {
    const __m256 x = _mm256_loadu_ps(sr + s);
    const __m256 keep = _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ);
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(x, mv)), keep);
    _mm256_storeu_ps(sr + s, e);
    sum = _mm256_add_ps(sum, e);
  }
  float tail = 0.0f;
  for (; s < total; ++s) {
    const float e = sr[s] == -INFINITY ? 0.0f : __builtin_expf(sr[s] - mx);
    sr[s] = e;
    tail += e;
  }
  const float inv = 1.0f / (hsum(sum) + tail);
  for (int64_t i = 0; i < total; ++i) sr[i] *= inv;
}

// out[r] = sum_s p[r][s] * v_s for RG rows, 32 columns at a time: RG x 4 accumulators,
// each value chunk loaded once for every row.
template <int RG>
inline void weigh_rows(const float* const* pr, const float* vh, int64_t D, int64_t total,
                       float* const* orow) {
  for (int64_t c0 = 0; c0 < D; c0 += 32) {
    const int nc = D - c0 >= 32 ? 4 : static_cast<int>((D - c0) / 8);
    __m256 acc[RG][4];
    for (int r = 0; r < RG; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t s = 0; s < total; ++s) {
      __m256 p[RG];
      for (int r = 0; r < RG; ++r) p[r] = _mm256_broadcast_ss(pr[r] + s);
      const float* vs = vh + s * D + c0;
      if (nc == 4) {
        for (int c = 0; c < 4; ++c) {
          const __m256 vv = _mm256_loadu_ps(vs + 8 * c);
          for (int r = 0; r < RG; ++r) acc[r][c] = _mm256_fmadd_ps(p[r], vv, acc[r][c]);
        }
      } else {
        for (int c = 0; c < nc; ++c) {
          const __m256 vv = _mm256_loadu_ps(vs + 8 * c);
          for (int r = 0; r < RG; ++r) acc[r][c] = _mm256_fmadd_ps(p[r], vv, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < RG; ++r)
      for (int c = 0; c < nc; ++c) _mm256_storeu_ps(orow[r] + c0 + 8 * c, acc[r][c]);
  }
}

template <typename W>
void gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const W* P, int64_t N, float* y,
          int64_t ldy, const float* bias, const float* res, int64_t ldr, int64_t threads) {
  const int64_t npanel = N / 16;
  if (threads <= 1 || npanel < 2) {
    panels(x, M, K, ldx, P, 0, N, y, ldy, bias, res, ldr);
    return;
  }
  if (threads > npanel) threads = npanel;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t start = (npanel * t / threads) * 16;
    const int64_t stop = (npanel * (t + 1) / threads) * 16;
    panels(x, M, K, ldx, P, start, stop, y, ldy, bias, res, ldr);
  }
}

}  // namespace

extern "C" {

// Attention of a few query rows over a KV cache, grouped-query style, for decode
// steps and small drafts (torch's SDPA costs several times its bytes' read time there).
// q (KV, R, D) with rows r = t * G + g; k, v (KV, S_max, D) caches (head stride
// S_max * D) holding past + T keys; query t sees every key s < past and new key
// past + j when allowed[t * T + j] (allowed == nullptr: a chain, j <= t).
// scores: scratch of R * (past + T) floats. out (KV, R, D). D % 8 == 0, D <= 256.
// Rows are taken three at a time (the G query heads of a kv head, for Llama-style
// GQA), so each key and value row is read once for all three.
void cs_attention(const float* q, int64_t KV, int64_t R, int64_t G, int64_t D, const float* k,
                  const float* v, int64_t head_stride, int64_t past, int64_t T,
                  const uint8_t* allowed, float scale, float* scores, float* out) {
  const int64_t total = past + T;
  for (int64_t h = 0; h < KV; ++h) {
    const float* qh = q + h * R * D;
    const float* kh = k + h * head_stride;
    const float* vh = v + h * head_stride;
    float* oh = out + h * R * D;
    for (int64_t r0 = 0; r0 < R; r0 += 3) {
      const int rg = R - r0 < 3 ? static_cast<int>(R - r0) : 3;
      const float* qr[3];
      float* sr[3];
      float* orow[3];
      for (int i = 0; i < rg; ++i) {
        qr[i] = qh + (r0 + i) * D;
        sr[i] = scores + (r0 + i) * total;
        orow[i] = oh + (r0 + i) * D;
      }
      switch (rg) {
        case 1: score_rows<1>(qr, kh, D, total, scale, sr); break;
        case 2: score_rows<2>(qr, kh, D, total, scale, sr); break;
        default: score_rows<3>(qr, kh, D, total, scale, sr); break;
      }
      for (int i = 0; i < rg; ++i) {  // the new keys a row may not see
        const int64_t t = (r0 + i) / G;
        for (int64_t j = 0; j < T; ++j) {
          const bool seen = allowed ? allowed[t * T + j] != 0 : j <= t;
          if (!seen) sr[i][past + j] = -INFINITY;
        }
        softmax_row(sr[i], total);
      }
      switch (rg) {
        case 1: weigh_rows<1>(sr, vh, D, total, orow); break;
        case 2: weigh_rows<2>(sr, vh, D, total, orow); break;
        default: weigh_rows<3>(sr, vh, D, total, orow); break;
      }
    }
  }
}

int cs_gemm_version() { return 7; }

// y = x / sqrt(mean(x^2) + eps) * w per row (RMSNorm as Llama computes it, in fp32).
// torch's rms_norm spends many times longer on dispatch for one row than this takes.
void cs_rmsnorm(const float* x, int64_t M, int64_t H, int64_t ldx, const float* w, float eps,
                float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    float* yr = y + m * ldy;
    __m256 acc = _mm256_setzero_ps();
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
      const __m256 v = _mm256_loadu_ps(xr + h);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float ss = 0.0f;
    for (int i = 0; i < 8; ++i) ss += lanes[i];
    for (; h < H; ++h) ss += xr[h] * xr[h];
    const float r = 1.0f / __builtin_sqrtf(ss / static_cast<float>(H) + eps);
    const __m256 rv = _mm256_set1_ps(r);
    h = 0;
    for (; h + 8 <= H; h += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + h), rv);
      _mm256_storeu_ps(yr + h, _mm256_mul_ps(v, _mm256_loadu_ps(w + h)));
    }
    for (; h < H; ++h) yr[h] = (xr[h] * r) * w[h];
  }
}

// threads > 1 splits the panels between that many OpenMP threads. The library is
// built with -fopenmp and loaded after torch, so it shares torch's libgomp and its
// thread pool: threads of its own would fight torch's spinning workers for the cores
// (a long prefill on 2 cores is markedly slower that way).
void cs_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const float* P, int64_t N,
             float* y, int64_t ldy, const float* bias, const float* res, int64_t ldr,
             int64_t threads) {
  gemm(x, M, K, ldx, P, N, y, ldy, bias, res, ldr, threads);
}

// The same product with fp16 panels (the bits of IEEE half floats). Widening fp16 to
// fp32 is exact and the sums run in the same order, so the result equals, bit for bit,
// cs_gemm's over the same weights held in fp32, for half the bytes read.
void cs_gemm_h(const float* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* P, int64_t N,
               float* y, int64_t ldy, const float* bias, const float* res, int64_t ldr,
               int64_t threads) {
  gemm(x, M, K, ldx, P, N, y, ldy, bias, res, ldr, threads);
}

// The same with bf16 panels (a bf16 checkpoint's weights, exact in bf16).
void cs_gemm_b(const float* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* P, int64_t N,
               float* y, int64_t ldy, const float* bias, const float* res, int64_t ldr,
               int64_t threads) {
  gemm(x, M, K, ldx, reinterpret_cast<const bf16*>(P), N, y, ldy, bias, res, ldr, threads);
}

}  // extern "C"
