// The exact products' kernels (qgemm.cpp's "direct" and "scratch" paths), written once and
// included by each vector ISA's namespace of qgemm.cpp (z512, z256) inside that ISA's
// `#pragma GCC target` region, so that every instantiation is compiled for its ISA (a
// template defined outside the region could not inline the ISA's intrinsics). Included
// only there: it names what the including namespace defines for 16 columns of outputs:
//   W                   16 floats (one zmm, or two ymm),
//   wzero(), wset1(f)   all zeros / f in every column,
//   wfma(a, b, c)       a * b + c, one rounding per column,
//   wload(p), wstore(p, w)
//   G, group<T>(p)      a group of four k, as group<T> expands it,
//   wquant<T, t>(z)     the 16 columns' quants of k t of a group, as floats,
//   scales<T>(p, j, sc, off), put16(a, m, n, w, cols),
//   direct_panels<T>(a, p0, p1): the direct path's pass shapes for a.M rows (false: the
//                       scratch path), SCRATCH_ROWS.
// Every column is computed by the same operations in the same order on every ISA, so the
// ISAs agree bit for bit (the file comment of qgemm.cpp).

// MR rows (from m) x NP panels (from p): widen in registers, every weight vector used for
// all MR rows; MR * NP independent FMA chains.
template <int T, int MR, int NP>
void direct(const Args& a, int64_t m, int64_t p) {
  using F = Tr<T>;
  constexpr int BYTES = 16 * F::NATIVE;
  W acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = wzero();
  const float* x = a.x + m * a.ldx;
  const Ref pr = ref_of(a, p, BYTES);
  const int64_t nb = a.K / F::BK;
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < F::BK / F::SUB; ++j) {
      W sc[NP], off[NP];
      for (int q = 0; q < NP; ++q) scales<T>(head_at(pr, b, F::GOFF, q), j, sc[q], off[q]);
      for (int g = 0; g < F::SUB / 4; ++g) {
        const int gi = j * (F::SUB / 4) + g;
        const int64_t k = b * F::BK + 4 * gi;
        G z[NP];
        for (int q = 0; q < NP; ++q) z[q] = group<T>(group_at(pr, b, F::GOFF, F::GB, gi, q));
        auto step = [&](auto tc) {
          constexpr int t = decltype(tc)::value;
          W xb[MR];
          for (int r = 0; r < MR; ++r) xb[r] = wset1(x[r * a.ldx + k + t]);
          for (int q = 0; q < NP; ++q) {
            const W w = wfma(sc[q], wquant<T, t>(z[q]), off[q]);
            for (int r = 0; r < MR; ++r) acc[r][q] = wfma(xb[r], w, acc[r][q]);
          }
        };
        step(std::integral_constant<int, 0>());
        step(std::integral_constant<int, 1>());
        step(std::integral_constant<int, 2>());
        step(std::integral_constant<int, 3>());
      }
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < MR; ++r) put16(a, m + r, 16 * (p + q), acc[r][q], a.N - 16 * (p + q));
}

// Panels r.q .. r.q + n - 1 (of one group) widened, read in the order they are stored:
// S + i * K * 16 holds panel r.q + i as S[k][16], k < K.
template <int T>
void widen_run(const Ref& r, int64_t n, int64_t K, float* S) {
  using F = Tr<T>;
  const int64_t nb = K / F::BK;
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < F::BK / F::SUB; ++j) {
      W sc[GROUP], off[GROUP];
      for (int64_t i = 0; i < n; ++i) scales<T>(head_at(r, b, F::GOFF, i), j, sc[i], off[i]);
      for (int g = 0; g < F::SUB / 4; ++g) {
        const int gi = j * (F::SUB / 4) + g;
        for (int64_t i = 0; i < n; ++i) {
          const G z = group<T>(group_at(r, b, F::GOFF, F::GB, gi, i));
          float* s = S + i * K * 16 + 16 * (b * F::BK + 4 * gi);
          wstore(s, wfma(sc[i], wquant<T, 0>(z), off[i]));
          wstore(s + 16, wfma(sc[i], wquant<T, 1>(z), off[i]));
          wstore(s + 32, wfma(sc[i], wquant<T, 2>(z), off[i]));
          wstore(s + 48, wfma(sc[i], wquant<T, 3>(z), off[i]));
        }
      }
    }
  }
}

// MR rows (from m) of one widened panel p.
template <int MR>
void rows(const Args& a, int64_t m, int64_t p, const float* S) {
  W acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = wzero();
  const float* x = a.x + m * a.ldx;
  for (int64_t k = 0; k < a.K; ++k) {
    const W w = wload(S + 16 * k);
    for (int r = 0; r < MR; ++r) acc[r] = wfma(wset1(x[r * a.ldx + k]), w, acc[r]);
  }
  for (int r = 0; r < MR; ++r) put16(a, m + r, 16 * p, acc[r], a.N - 16 * p);
}

// The n < R rows left after the passes of SCRATCH_ROWS (R: SCRATCH_ROWS - 1 at first).
template <int R>
void rows_tail(const Args& a, int64_t n, int64_t m, int64_t p, const float* S) {
  if (n == R) return rows<R>(a, m, p, S);
  if constexpr (R > 1) rows_tail<R - 1>(a, n, m, p, S);
}

template <int T, int MR, int NP>
void direct_range(const Args& a, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1;) {
    const int64_t end = group_end(p, p1);
    for (; p + NP <= end; p += NP) direct<T, MR, NP>(a, 0, p);
    for (; p < end; ++p) direct<T, MR, 1>(a, 0, p);
  }
}

template <int T>
void panels(const Args& a, int64_t p0, int64_t p1) {
  if (direct_panels<T>(a, p0, p1)) return;
  float* S0 = scratch(GROUP * a.K * 16);
  for (int64_t m0 = 0; m0 < a.M; m0 += ROW_CHUNK) {
    const int64_t m1 = a.M - m0 < ROW_CHUNK ? a.M : m0 + ROW_CHUNK;
    for (int64_t p = p0; p < p1;) {  // a group's panels (or those of this range) at once
      const int64_t end = group_end(p, p1);
      widen_run<T>(ref_of(a, p, 16 * Tr<T>::NATIVE), end - p, a.K, S0);
      for (int64_t q = p; q < end; ++q) {
        const float* S = S0 + (q - p) * a.K * 16;
        int64_t m = m0;
        for (; m + SCRATCH_ROWS <= m1; m += SCRATCH_ROWS) rows<SCRATCH_ROWS>(a, m, q, S);
        rows_tail<SCRATCH_ROWS - 1>(a, m1 - m, m, q, S);
      }
      p = end;
    }
  }
}

void dequant_panel(int t, const Ref& r, int64_t K, float* S) {
  switch (t) {
    case T_Q8_0: widen_run<T_Q8_0>(r, 1, K, S); break;
    case T_Q4_0: widen_run<T_Q4_0>(r, 1, K, S); break;
    case T_Q4_1: widen_run<T_Q4_1>(r, 1, K, S); break;
    case T_Q5_0: widen_run<T_Q5_0>(r, 1, K, S); break;
    case T_Q5_1: widen_run<T_Q5_1>(r, 1, K, S); break;
    case T_Q4_K: widen_run<T_Q4_K>(r, 1, K, S); break;
    case T_Q5_K: widen_run<T_Q5_K>(r, 1, K, S); break;
    case T_Q6_K: widen_run<T_Q6_K>(r, 1, K, S); break;
  }
}
