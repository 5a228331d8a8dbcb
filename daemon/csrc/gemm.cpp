// Small-batch fp32 matrix products for the CPU runner (codespec.daemon.cpu_gemm).
//
// y[M, N] = x[M, K] @ W[K, N] (+ bias[N]) (+ res[M, N]) with W packed in panels of
// 16 output columns, P[N / 16][K][16], so that each panel streams from memory in
// order. Rows are taken four at a time: 4 rows x 2 AVX2 vectors = 8 accumulators,
// the most this register file holds without spilling (5 or 6 rows measured slower).
// Each output element is summed over k = 0 .. K-1 in order with one FMA per step,
// whatever M is, so a row's result does not depend on which other rows share the
// call: a verify forward computes bit for bit what a decode step would.
//
// MKL's sgemm spends about M times a one-row product for M = 2 .. 8 on this kind of
// CPU; this kernel reads the weights once for up to four rows, which is what makes
// a draft of a few tokens cost little more than one decode step.
#include <immintrin.h>
#include <stdint.h>

#include <thread>
#include <vector>

namespace {

// pf: the panel to fetch into L2 while this one is computed (the next one, on the
// first row group), or nullptr.
template <int MR>
inline void block(const float* x, int64_t ldx, int64_t K, const float* p, float* y,
                  int64_t ldy, const float* bias, const float* res, int64_t ldr,
                  const float* pf) {
  __m256 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) {
    a0[r] = _mm256_setzero_ps();
    a1[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(p + k * 16);
    const __m256 w1 = _mm256_loadu_ps(p + k * 16 + 8);
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

void panels(const float* x, int64_t M, int64_t K, int64_t ldx, const float* P, int64_t j0,
            int64_t j1, float* y, int64_t ldy, const float* bias, const float* res, int64_t ldr) {
  for (int64_t j = j0; j < j1; j += 16) {
    const float* p = P + j * K;
    const float* next = j + 16 < j1 ? p + 16 * K : nullptr;
    for (int64_t m = 0; m < M; m += 4) {
      const float* pf = m == 0 && M > 1 ? next : nullptr;
      const int64_t mr = M - m < 4 ? M - m : 4;
      const float* xm = x + m * ldx;
      float* ym = y + m * ldy + j;
      const float* b = bias ? bias + j : nullptr;
      const float* rm = res ? res + m * ldr + j : nullptr;
      switch (mr) {
        case 1: block<1>(xm, ldx, K, p, ym, ldy, b, rm, ldr, pf); break;
        case 2: block<2>(xm, ldx, K, p, ym, ldy, b, rm, ldr, pf); break;
        case 3: block<3>(xm, ldx, K, p, ym, ldy, b, rm, ldr, pf); break;
        default: block<4>(xm, ldx, K, p, ym, ldy, b, rm, ldr, pf); break;
      }
    }
  }
}

}  // namespace

extern "C" {

int cs_gemm_version() { return 1; }

// threads > 1 splits the panels between that many threads (started per call, so
// only worth it for large M: the caller decides).
void cs_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const float* P, int64_t N,
             float* y, int64_t ldy, const float* bias, const float* res, int64_t ldr,
             int64_t threads) {
  const int64_t npanel = N / 16;
  if (threads <= 1 || npanel < 2) {
    panels(x, M, K, ldx, P, 0, N, y, ldy, bias, res, ldr);
    return;
  }
  if (threads > npanel) threads = npanel;
  std::vector<std::thread> pool;
  int64_t start = 0;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t stop = (npanel * (t + 1) / threads) * 16;
    if (t + 1 == threads) {
      panels(x, M, K, ldx, P, start, stop, y, ldy, bias, res, ldr);
    } else {
      pool.emplace_back(panels, x, M, K, ldx, P, start, stop, y, ldy, bias, res, ldr);
    }
    start = stop;
  }
  for (auto& th : pool) th.join();
}

}  // extern "C"
