// The lean runner's decoder stack, written once over a 16-lane vector V (csrc/stack.cpp
// includes this file once per ISA, inside that ISA's namespace and target options, after
// defining V and its primitives: vzero vset vld vst vld_n vst_n vldh vadd vsub vmul vdiv
// vfma vmax vmin vrint vldexp vfirst vhsum vhmax, f2h for one value, and for the bf16
// attention vldbf2 (32 bf16 as their even and odd elements), vbfr (round 16 lanes to bf16,
// store them, return their fp32 values), vftz (flush a denormal to zero where the FPU does
// not) and FtzGuard (the FPU flushes denormal results while one lives); a namespace that
// defines LS_BF16_NATIVE also has BfNative, the CPU's own bf16 dot products).
//
// Every result is a function of its own row only: sums run in a fixed order (per lane, in
// order, then a fixed tree across the 16 lanes), exp is one polynomial, elementwise steps
// are single IEEE operations (the file is built with -ffp-contract=off). So the three ISAs
// agree bit for bit, and a row of a T-token forward equals the one-token forward at its
// position (what lossless speculation needs: verify rows equal decode rows).
// No include guard: included once per ISA namespace.

// 2^n p(f) for t = x log2(e) = n + f, n = rint(t): p a polynomial for 2^f on [-1/2, 1/2]
// with coefficients c (highest degree first). x must be >= -87 (n >= -126: vldexp's 2^n is
// a normal float on every ISA).
template <int N>
inline V vexp_poly(V x, const float (&c)[N]) {
  const V t = vmul(x, vset(1.44269504088896341f));
  const V n = vrint(t);
  const V f = vsub(t, n);
  V p = vset(c[0]);
  for (int i = 1; i < N; ++i) p = vfma(p, f, vset(c[i]));
  return vldexp(p, n);
}

inline V vexp(V x) {  // exp(x), Cephes' 2^f polynomial (relative error ~2e-7)
  static constexpr float c[] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                                9.618437357674640e-3f, 5.550332471162809e-2f,
                                2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
  return vexp_poly(vmin(vmax(x, vset(-87.0f)), vset(88.0f)), c);
}

// exp(x) for bf16 attention's softmax weights, x <= 0 (a score less its chunk's max)
// where the result counts (lanes past a row's keys may hold anything: their weights are
// set to 0 after). The weights are rounded to bf16 (a relative step of 2^-8), so a
// degree-4 polynomial for 2^f (fitted here, relative error under 8e-6, against vexp's
// 2e-7) and no upper clamp: two fewer FMAs and a min than vexp, per 16 keys and row, on
// the ports the dot products need.
inline V vexp_w(V x) {
  static constexpr float c[] = {9.266121312975883e-3f, 5.586051195859909e-2f,
                                2.403108775615692e-1f, 6.931300759315491e-1f,
                                9.999977946281433e-1f};
  return vexp_poly(vmax(x, vset(-87.0f)), c);
}

// y = x / sqrt(mean(x^2) + eps) * w, row by row.
void rmsnorm(const float* x, int64_t M, int64_t H, int64_t ldx, const float* w, float eps,
             float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    float* yr = y + m * ldy;
    V acc = vzero();
    for (int64_t h = 0; h < H; h += 16) {
      const V v = h + 16 <= H ? vld(xr + h) : vld_n(xr + h, H - h);
      acc = vfma(v, v, acc);
    }
    const float r = 1.0f / std::sqrt(vhsum(acc) / static_cast<float>(H) + eps);
    for (int64_t h = 0; h < H; ++h) yr[h] = (xr[h] * r) * w[h];
  }
}

// y = silu(g) * u for the rows of gu = [g | u] (T, 2I) -> (T, I).
void silu_mul(const float* gu, int64_t T, int64_t I, float* y) {
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gu + t * 2 * I;
    const float* u = g + I;
    float* yr = y + t * I;
    for (int64_t i = 0; i < I; i += 16) {
      const int64_t n = I - i < 16 ? I - i : 16;
      const V gv = n == 16 ? vld(g + i) : vld_n(g + i, n);
      const V uv = n == 16 ? vld(u + i) : vld_n(u + i, n);
      const V e = vexp(vsub(vzero(), gv));
      const V s = vmul(vdiv(gv, vadd(vset(1.0f), e)), uv);
      if (n == 16) vst(yr + i, s); else vst_n(yr + i, s, n);
    }
  }
}

// RoPE of one head row (rotate-half form, tables cos / signed sin of D values).
inline void rope(const float* x, const float* c, const float* s, int64_t D, float* y) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < D; ++i) y[i] = x[i] * c[i] + x[i < h ? i + h : i - h] * s[i];
}

// q heads: rotated and scaled into qs (T, NH, D); k, v: rotated / copied into the cache as
// fp16 (K in tiles of 16 keys, V in rows of Dp), values clamped to fp16's range. With bf16
// attention (Model::att) q, k and v are rounded to bf16 (qh: q's bits; qs: their values)
// and the cache holds them in k_at / v_at's pairs. Tokens [t0, t1) (default: all).
void rope_store(const Model& m, const Fwd& f, const float* qkv, float* qs, uint16_t* qh,
                uint16_t* kc, uint16_t* vc, int64_t t0 = 0, int64_t t1 = -1) {
  const int64_t D = m.head_dim, NH = m.heads, KV = m.kv_heads, Dp = pad16(D);
  const int64_t QW = (NH + 2 * KV) * D;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  float tmp[MAX_DP];
  for (int64_t t = t0; t < (t1 < 0 ? f.T : t1); ++t) {
    const float* c = m.cos + f.pos[t] * D;
    const float* s = m.sin + f.pos[t] * D;
    const float* row = qkv + t * QW;
    for (int64_t hq = 0; hq < NH; ++hq) {
      float* dst = qs + (t * NH + hq) * D;
      rope(row + hq * D, c, s, D, dst);
      for (int64_t d = 0; d < D; ++d) dst[d] = dst[d] * scale;
      if (m.att == ATT_BF16) {  // q rounded to bf16: its value in qs, its bits in qh
        uint16_t* qb = qh + (t * NH + hq) * D;
        for (int64_t d = 0; d < D; ++d) {
          qb[d] = f2bf(dst[d]);
          dst[d] = bf2f(qb[d]);
        }
      }
    }
    const int64_t r = f.past + t;
    for (int64_t h = 0; h < KV; ++h) {
      rope(row + (NH + h) * D, c, s, D, tmp);
      const float* v = row + (NH + KV + h) * D;
      if (m.att == ATT_BF16) {
        for (int64_t d = 0; d < D; ++d) kc[k_at(f.s_max, D, h, r, d)] = f2bf(clamp_bf(tmp[d]));
        uint16_t* vr = vc + v_at(f.s_max, Dp, h, r, 0);
        for (int64_t d = 0; d < Dp; ++d) vr[2 * d] = d < D ? f2bf(clamp_bf(v[d])) : 0;
        continue;
      }
      uint16_t* kt = kc + h * f.s_max * D + (r / 16) * D * 16 + r % 16;
      for (int64_t d = 0; d < D; ++d) kt[16 * d] = f2h(clamp_h(tmp[d]));
      uint16_t* vr = vc + (h * f.s_max + r) * Dp;
      for (int64_t d = 0; d < Dp; ++d) vr[d] = d < D ? f2h(clamp_h(v[d])) : 0;
    }
  }
}

// Scores of R rows against TT tiles of 16 keys: R * TT independent FMA chains per step
// (an FMA's latency is ~4 cycles: fewer chains leave the units idle).
template <int R, int TT>
inline void score_tiles(const float* const* q, int64_t D, const uint16_t* const* kt, float* s,
                        int64_t ld, Ahead& pf) {
  V acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < TT; ++i) acc[r][i] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    if (d & 1) pf.step(TT);  // TT tiles' two rows of 16 fp16: TT lines
    V kv[TT];
    for (int i = 0; i < TT; ++i) kv[i] = vldh(kt[i] + 16 * d);
    for (int r = 0; r < R; ++r) {
      const V qv = vset(q[r][d]);
      for (int i = 0; i < TT; ++i) acc[r][i] = vfma(qv, kv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < TT; ++i) vst(s + r * ld + 16 * i, acc[r][i]);
}

// o[r][dc .. dc + 16 NC] = sum_j p[r][j] v_j over keys j < nk, in order: R * NC chains.
template <int R, int NC>
inline void weigh_keys(const float* p, int64_t ld, int64_t nk, const uint16_t* const* vrow,
                       int64_t dc, float* const* part, Ahead& pf) {
  V o[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) o[r][c] = vzero();
  for (int64_t j = 0; j < nk; ++j) {
    if (j & 1) pf.step(NC);  // two keys' NC x 16 fp16: NC lines
    V v[NC];
    for (int c = 0; c < NC; ++c) v[c] = vldh(vrow[j] + dc + 16 * c);
    for (int r = 0; r < R; ++r) {
      const V pv = vset(p[r * ld + j]);
      for (int c = 0; c < NC; ++c) o[r][c] = vfma(pv, v[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) vst(part[r] + 2 + dc + 16 * c, o[r][c]);
}

// A chunk's softmax for R rows of scores s (rows CHUNK apart, ntile tiles of 16): each row's
// weights p = exp(s - m) over its first nvalid keys (0 past them) replace its scores (Keep),
// and m goes to part[r][0]. weights(e, r, t) gives tile t of row r's weights as they weigh
// the values (fp32: e itself; bf16: e rounded, its bits stored by weights). fp32 (!Bf):
// exp is vexp and the sum l of the weights goes to part[r][1]; bf16: exp is vexp_w, and
// the caller sums the stored bits (sum_pairs).
template <int R, bool Keep, bool Bf, class Weights>
inline void chunk_softmax(float* s, const int64_t* nvalid, int64_t ntile, float* const* part,
                          Weights weights) {
  // The tiles every row sees whole go row by row inside each tile (independent chains for
  // the CPU to overlap); each row's own tail after. Per row the same steps in tile order.
  int64_t full[R], both = ntile;
  for (int r = 0; r < R; ++r) {
    full[r] = nvalid[r] / 16 < ntile ? nvalid[r] / 16 : ntile;
    both = full[r] < both ? full[r] : both;
  }
  V mx[R], vm[R], l[R];
  for (int r = 0; r < R; ++r) mx[r] = vset(-INFINITY);
  for (int64_t t = 0; t < both; ++t)
    for (int r = 0; r < R; ++r) mx[r] = vmax(mx[r], vld(s + r * CHUNK + 16 * t));
  for (int r = 0; r < R; ++r) {
    const float* sr = s + r * CHUNK;
    for (int64_t t = both; t < ntile; ++t)
      mx[r] = vmax(mx[r], vfirst(vld(sr + 16 * t), nvalid[r] - 16 * t, vset(-INFINITY)));
    part[r][0] = vhmax(mx[r]);
    vm[r] = vset(part[r][0]);
    l[r] = vzero();
  }
  const auto ex = [](V x) { return Bf ? vexp_w(x) : vexp(x); };
  for (int64_t t = 0; t < both; ++t)
    for (int r = 0; r < R; ++r) {
      float* st = s + r * CHUNK + 16 * t;
      const V p = weights(ex(vsub(vld(st), vm[r])), r, t);
      if constexpr (Keep) vst(st, p);
      if constexpr (!Bf) l[r] = vadd(l[r], p);
    }
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * CHUNK;
    for (int64_t t = both; t < ntile; ++t) {  // (a tile past the row's keys: weights 0)
      const V e = vfirst(ex(vsub(vld(sr + 16 * t), vm[r])), nvalid[r] - 16 * t, vzero());
      const V p = weights(e, r, t);
      if constexpr (Keep) vst(sr + 16 * t, p);
      if constexpr (!Bf) l[r] = vadd(l[r], p);
    }
    if constexpr (!Bf) part[r][1] = vhsum(l[r]);
  }
}

// One chunk of keys for R query rows: scores, the chunk's softmax (max m, sum l) and its
// weighted values o. nvalid[r]: keys of the chunk row r sees (its first ones); nk: the
// most of them. Keys past a row's nvalid get weight 0 (their values are finite: adding
// 0 * v to a sum changes nothing), so each row's numbers depend on its keys only.
template <int R>
void chunk_rows(const float* const* q, const int64_t* nvalid, int64_t nk, int64_t D, int64_t Dp,
                const uint16_t* const* ktile, const uint16_t* const* vrow, float* const* part,
                Ahead& pf) {
  alignas(64) float s[R * CHUNK];
  const int64_t ntile = (nk + 15) / 16;
  constexpr int TT = score_tiles_for(R);
  int64_t i = 0;
  for (; i + TT <= ntile; i += TT) score_tiles<R, TT>(q, D, ktile + i, s + 16 * i, CHUNK, pf);
  for (; i < ntile; ++i) score_tiles<R, 1>(q, D, ktile + i, s + 16 * i, CHUNK, pf);
  chunk_softmax<R, true, false>(s, nvalid, ntile, part, [](V e, int, int64_t) { return e; });
  constexpr int NC = value_chunks_for(R);
  for (int64_t dc = 0; dc < Dp;) {
    const int64_t left = (Dp - dc) / 16;
    if (left >= NC) {
      weigh_keys<R, NC>(s, CHUNK, nk, vrow, dc, part, pf);
      dc += 16 * NC;
    } else {
      weigh_keys<R, 1>(s, CHUNK, nk, vrow, dc, part, pf);
      dc += 16;
    }
  }
}

void chunk_any(int R, const float* const* q, const int64_t* nvalid, int64_t nk, int64_t D,
               int64_t Dp, const uint16_t* const* kt, const uint16_t* const* vr, float* const* p,
               Ahead& pf) {
  static_assert(ATT_ROWS >= 1 && ATT_ROWS <= 6, "chunk_any covers 1 to 6 rows");
  switch (R) {
    case 1: chunk_rows<1>(q, nvalid, nk, D, Dp, kt, vr, p, pf); break;
    case 2: chunk_rows<ATT_ROWS < 2 ? ATT_ROWS : 2>(q, nvalid, nk, D, Dp, kt, vr, p, pf); break;
    case 3: chunk_rows<ATT_ROWS < 3 ? ATT_ROWS : 3>(q, nvalid, nk, D, Dp, kt, vr, p, pf); break;
    case 4: chunk_rows<ATT_ROWS < 4 ? ATT_ROWS : 4>(q, nvalid, nk, D, Dp, kt, vr, p, pf); break;
    case 5: chunk_rows<ATT_ROWS < 5 ? ATT_ROWS : 5>(q, nvalid, nk, D, Dp, kt, vr, p, pf); break;
    default: chunk_rows<ATT_ROWS>(q, nvalid, nk, D, Dp, kt, vr, p, pf); break;
  }
}

// ---------------------------------------------------------------------------------------
// bf16 attention (Model::att == ATT_BF16): q, k, v and each chunk's softmax weights p are
// bf16, so every product of two of them is exact in fp32, and each sum adds them in
// vdpbf16ps's order: per pair of elements (d, d + 1) the odd one's product first, then the
// even one's, each addition rounded to fp32 (to nearest even, a denormal result flushed
// to zero). On a CPU with AVX512-BF16 one vdpbf16ps does a pair for 16 lanes (BfNative);
// elsewhere two FMAs do (BfEmu): the same numbers bit for bit, at more than the fp32 path's
// cost over a long cache, which is why lean.attention_for picks bf16 only where
// the CPU has vdpbf16ps. With it, half the instructions of the fp32 FMAs: a verification's
// attention over a long cache is arithmetic-bound. BfEmu / BfNative: round (vbfr's
// contract), and BfNative's ld / dot.
struct BfEmu {
  static constexpr bool native = false;
  static inline V round(V a, uint16_t* dst) { return vbfr(a, dst); }
};

// Scores of R rows (q: bf16 values; qb: their bits) against TT tiles of 16 keys.
template <class B, int R, int TT>
inline void score_tiles_bf(const float* const* q, const uint16_t* const* qb, int64_t D,
                           const uint16_t* const* kt, float* s, int64_t ld, Ahead& pf) {
  V acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < TT; ++i) acc[r][i] = vzero();
  for (int64_t d = 0; d < D; d += 2) {
    pf.step(TT);  // TT tiles' pair of dims for 16 keys: TT lines
    if constexpr (B::native) {
      typename B::KP k[TT];
      for (int i = 0; i < TT; ++i) k[i] = B::ld(kt[i] + 16 * d);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < TT; ++i) acc[r][i] = B::dot(acc[r][i], k[i], qb[r] + d);
    } else {
      for (int i = 0; i < TT; ++i) {
        V even, odd;
        vldbf2(kt[i] + 16 * d, even, odd);
        for (int r = 0; r < R; ++r) acc[r][i] = vftz(vfma(odd, vset(q[r][d + 1]), acc[r][i]));
        for (int r = 0; r < R; ++r) acc[r][i] = vftz(vfma(even, vset(q[r][d]), acc[r][i]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < TT; ++i) vst(s + r * ld + 16 * i, acc[r][i]);
}

// o[r][dc .. dc + 16 NC] = sum_j p[r][j] v_j over the pairs of keys j < nk (p: bf16 values,
// pb: their bits; a key past a row's own has p = 0), in order.
template <class B, int R, int NC>
inline void weigh_keys_bf(const float* p, const uint16_t* pb, int64_t ld, int64_t nk,
                          const uint16_t* const* vpair, int64_t dc, float* const* part,
                          Ahead& pf) {
  V o[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) o[r][c] = vzero();
  for (int64_t j = 0; j < nk; j += 2) {
    pf.step(NC);  // a pair of keys' NC x 16 values: NC lines
    const uint16_t* vp = vpair[j / 2] + 2 * dc;
    if constexpr (B::native) {
      typename B::KP v[NC];
      for (int c = 0; c < NC; ++c) v[c] = B::ld(vp + 32 * c);
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) o[r][c] = B::dot(o[r][c], v[c], pb + r * ld + j);
    } else {
      for (int c = 0; c < NC; ++c) {
        V even, odd;
        vldbf2(vp + 32 * c, even, odd);
        for (int r = 0; r < R; ++r) o[r][c] = vftz(vfma(odd, vset(p[r * ld + j + 1]), o[r][c]));
        for (int r = 0; r < R; ++r) o[r][c] = vftz(vfma(even, vset(p[r * ld + j]), o[r][c]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) vst(part[r] + 2 + dc + 16 * c, o[r][c]);
}

// The sum l of each row's rounded weights (bits in sb, rows CHUNK apart, ntile tiles) to
// part[r][1], as the dot products add: 32 weights a step, lane i adding the pair (2i, 2i
// + 1) (the odd one first) with a vdpbf16ps by ones where the CPU has it (one instruction
// per two tiles, where widening the rounded weights back and adding them takes three per
// tile). A tile past the last is zeros.
template <class B, int R>
inline void sum_pairs(uint16_t* sb, int64_t ntile, float* const* part) {
  static const uint16_t one[2] = {0x3f80, 0x3f80};  // (bf16 1.0, twice)
  for (int r = 0; r < R; ++r) {
    uint16_t* row = sb + r * CHUNK;
    if (ntile & 1) memset(row + 16 * ntile, 0, 16 * sizeof(uint16_t));
    V l = vzero();
    for (int64_t t = 0; t < ntile; t += 2) {
      if constexpr (B::native) {
        l = B::dot(l, B::ld(row + 16 * t), one);
      } else {
        V even, odd;
        vldbf2(row + 16 * t, even, odd);
        l = vftz(vadd(l, odd));
        l = vftz(vadd(l, even));
      }
    }
    part[r][1] = vhsum(l);
  }
}

// chunk_rows over the bf16 cache: the chunk's weights p are rounded to bf16 before they
// weigh the values, and its sum l adds the rounded ones.
template <class B, int R>
void chunk_rows_bf(const float* const* q, const uint16_t* const* qb, const int64_t* nvalid,
                   int64_t nk, int64_t D, int64_t Dp, const uint16_t* const* ktile,
                   const uint16_t* const* vpair, float* const* part, Ahead& pf) {
  alignas(64) float s[R * CHUNK];
  alignas(64) uint16_t sb[R * CHUNK];
  const int64_t ntile = (nk + 15) / 16;
  constexpr int TT = score_tiles_for(R);
  int64_t i = 0;
  for (; i + TT <= ntile; i += TT)
    score_tiles_bf<B, R, TT>(q, qb, D, ktile + i, s + 16 * i, CHUNK, pf);
  for (; i < ntile; ++i) score_tiles_bf<B, R, 1>(q, qb, D, ktile + i, s + 16 * i, CHUNK, pf);
  // (BfNative weighs the values with the weights' bits, sb; BfEmu with their values, s)
  chunk_softmax<R, !B::native, true>(s, nvalid, ntile, part, [&sb](V e, int r, int64_t t) {
    return B::round(e, sb + r * CHUNK + 16 * t);
  });
  sum_pairs<B, R>(sb, ntile, part);
  constexpr int NC = value_chunks_for(R);
  for (int64_t dc = 0; dc < Dp;) {
    if ((Dp - dc) / 16 >= NC) {
      weigh_keys_bf<B, R, NC>(s, sb, CHUNK, nk, vpair, dc, part, pf);
      dc += 16 * NC;
    } else {
      weigh_keys_bf<B, R, 1>(s, sb, CHUNK, nk, vpair, dc, part, pf);
      dc += 16;
    }
  }
}

template <class B>
void chunk_any_bf(int R, const float* const* q, const uint16_t* const* qb, const int64_t* nvalid,
                  int64_t nk, int64_t D, int64_t Dp, const uint16_t* const* kt,
                  const uint16_t* const* vp, float* const* p, Ahead& pf) {
  switch (R) {
    case 1: chunk_rows_bf<B, 1>(q, qb, nvalid, nk, D, Dp, kt, vp, p, pf); break;
    case 2: chunk_rows_bf<B, ATT_ROWS < 2 ? ATT_ROWS : 2>(q, qb, nvalid, nk, D, Dp, kt, vp, p, pf); break;
    case 3: chunk_rows_bf<B, ATT_ROWS < 3 ? ATT_ROWS : 3>(q, qb, nvalid, nk, D, Dp, kt, vp, p, pf); break;
    case 4: chunk_rows_bf<B, ATT_ROWS < 4 ? ATT_ROWS : 4>(q, qb, nvalid, nk, D, Dp, kt, vp, p, pf); break;
    case 5: chunk_rows_bf<B, ATT_ROWS < 5 ? ATT_ROWS : 5>(q, qb, nvalid, nk, D, Dp, kt, vp, p, pf); break;
    default: chunk_rows_bf<B, ATT_ROWS>(q, qb, nvalid, nk, D, Dp, kt, vp, p, pf); break;
  }
}

// The keys of tk's chunk that token t (eligible) sees.
inline int64_t keys_in(const Attn& A, int64_t t, const Task& tk) {
  const int64_t c0 = tk.c * CHUNK;
  return A.len[t] - c0 < CHUNK ? A.len[t] - c0 : CHUNK;
}

// The key sources of chunk c for head h: tiles of K and rows of V in list order. Shared
// tasks read the cache as it lies; a tree token's chunk past the cache gathers its
// ancestors' keys (tiles holding positions >= past) into gbuf.
void chunk_sources(const Attn& A, int64_t h, const Task& tk, const uint16_t** ktile,
                   const uint16_t** vrow, uint16_t* gbuf) {
  const int64_t D = A.D, Dp = A.Dp, c0 = tk.c * CHUNK;
  const uint16_t* kh = A.kc + h * A.s_max * D;
  const uint16_t* vh = A.vc + h * A.s_max * Dp;
  if (!tk.gathered) {
    for (int64_t i = 0; i < CHUNK / 16; ++i) ktile[i] = kh + (c0 / 16 + i) * D * 16;
    for (int64_t j = 0; j < CHUNK; ++j) vrow[j] = vh + (c0 + j) * Dp;
    return;
  }
  const int64_t t = tk.t0, L = A.len[t], nk = keys_in(A, t, tk);
  const int64_t* vis = A.vis + A.vis_off[t];
  auto row_of = [&](int64_t p) { return p < A.past ? p : A.past + vis[p - A.past]; };
  // only the tiles holding keys the token sees: the rest of the chunk is never read
  int64_t copied = 0;
  for (int64_t i = 0; i < (nk + 15) / 16; ++i) {
    const int64_t p0 = c0 + 16 * i;
    if (p0 + 16 <= A.past) {
      ktile[i] = kh + (p0 / 16) * D * 16;
      continue;
    }
    copied += 16;
    uint16_t* g = gbuf + i * D * 16;
    for (int64_t lane = 0; lane < 16; ++lane) {
      const int64_t p = p0 + lane;
      const int64_t r = p < L ? row_of(p) : -1;
      for (int64_t d = 0; d < D; ++d)
        g[16 * d + lane] = r < 0 ? 0 : kh[(r / 16) * D * 16 + 16 * d + r % 16];
    }
    ktile[i] = g;
  }
  g_att_gathered.fetch_add(copied, std::memory_order_relaxed);
  for (int64_t j = 0; j < CHUNK; ++j) {
    const int64_t p = c0 + j;
    vrow[j] = vh + (p < L ? row_of(p) : 0) * Dp;
  }
}

// One chunk for R rows on the cache's path: fp32 over fp16, or bf16 (the CPU's own dot
// products where it has them and A.native asks for them).
inline void chunk_call(const Attn& A, int R, const float* const* q, const uint16_t* const* qb,
                       const int64_t* nv, int64_t nk, const uint16_t* const* kt,
                       const uint16_t* const* vr, float* const* p, Ahead& pf) {
  if (!A.bf16) {
    chunk_any(R, q, nv, nk, A.D, A.Dp, kt, vr, p, pf);
    return;
  }
#ifdef LS_BF16_NATIVE
  if (A.native) {
    chunk_any_bf<BfNative>(R, q, qb, nv, nk, A.D, A.Dp, kt, vr, p, pf);
    return;
  }
#endif
  chunk_any_bf<BfEmu>(R, q, qb, nv, nk, A.D, A.Dp, kt, vr, p, pf);
}

// chunk_sources for the bf16 cache: K tiles, and V as pairs of keys (vpair[j]: keys 2j and
// 2j + 1 of the chunk's list, Dp x 2 values). A tree token's chunk past the cache gathers
// its ancestors' keys into gk (tiles) and gv (pairs holding a position >= past).
void chunk_sources_bf(const Attn& A, int64_t h, const Task& tk, const uint16_t** ktile,
                      const uint16_t** vpair, uint16_t* gk, uint16_t* gv) {
  const int64_t D = A.D, Dp = A.Dp, c0 = tk.c * CHUNK;
  const uint16_t* kh = A.kc + k_at(A.s_max, D, h, 0, 0);
  const uint16_t* vh = A.vc + v_at(A.s_max, Dp, h, 0, 0);
  for (int64_t i = 0; i < CHUNK / 16; ++i) ktile[i] = kh + k_at(A.s_max, D, 0, c0 + 16 * i, 0);
  for (int64_t j = 0; j < CHUNK / 2; ++j) vpair[j] = vh + v_at(A.s_max, Dp, 0, c0 + 2 * j, 0);
  if (!tk.gathered) return;
  const int64_t t = tk.t0, L = A.len[t], nk = keys_in(A, t, tk);
  const int64_t* vis = A.vis + A.vis_off[t];
  auto row_of = [&](int64_t p) { return p >= L ? -1 : p < A.past ? p : A.past + vis[p - A.past]; };
  // Only the tiles and pairs holding keys the token sees (the rest of the chunk is never
  // read); a key's dims go two at a time (a lane's pair of bf16 is 4 bytes in both
  // layouts), a pair of V rows that lie side by side in the cache at once.
  int64_t copied = 0;
  for (int64_t i = 0; i < (nk + 15) / 16; ++i) {
    const int64_t p0 = c0 + 16 * i;
    if (p0 + 16 <= A.past) continue;
    copied += 16;
    uint16_t* g = gk + i * D * 16;
    for (int64_t lane = 0; lane < 16; ++lane) {
      const int64_t r = row_of(p0 + lane);
      uint16_t* dst = g + k_at(0, D, 0, lane, 0);
      const uint16_t* src = r < 0 ? nullptr : kh + k_at(A.s_max, D, 0, r, 0);
      for (int64_t d = 0; d + 1 < D; d += 2) {  // dims d, d + 1: 4 bytes, 32 apart a pair
        if (src)
          memcpy(dst + 16 * d, src + 16 * d, 4);
        else
          memset(dst + 16 * d, 0, 4);
      }
      if (D & 1) dst[16 * (D - 1)] = src ? src[16 * (D - 1)] : 0;  // (k_at: the last dim)
    }
    ktile[i] = g;
  }
  g_att_gathered.fetch_add(copied, std::memory_order_relaxed);
  for (int64_t j = 0; j < (nk + 1) / 2; ++j) {
    const int64_t p0 = c0 + 2 * j;
    if (p0 + 2 <= A.past) continue;
    uint16_t* g = gv + j * Dp * 2;
    const int64_t r0 = row_of(p0), r1 = row_of(p0 + 1);
    if (r0 >= 0 && r1 == r0 + 1 && (r0 & 1) == 0) {  // a pair of the cache as it lies
      memcpy(g, vh + v_at(A.s_max, Dp, 0, r0, 0), 2 * Dp * sizeof(uint16_t));
    } else {
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t r = e ? r1 : r0;
        for (int64_t d = 0; d < Dp; ++d) g[2 * d + e] = r < 0 ? 0 : vh[v_at(A.s_max, Dp, 0, r, d)];
      }
    }
    vpair[j] = g;
  }
}

// The cache lines shared task tk of head h reads: its chunk's K tiles, then its V rows
// (bf16: whole pairs), as far as the most keys one of its tokens sees. Both layouts put
// row r of head h at (h S_max + r) D for K and (h S_max + r) Dp for V, a chunk's rows in
// one run.
Lines chunk_lines(const Attn& A, int64_t h, const Task& tk) {
  int64_t nkeys = 0;
  for (int64_t t = tk.t0; t < tk.t1; ++t)
    if (eligible(A, t, tk) && keys_in(A, t, tk) > nkeys) nkeys = keys_in(A, t, tk);
  const int64_t c0 = tk.c * CHUNK;
  const char* k0 = reinterpret_cast<const char*>(A.kc + (h * A.s_max + c0) * A.D);
  const char* v0 = reinterpret_cast<const char*>(A.vc + (h * A.s_max + c0) * A.Dp);
  const int64_t vkeys = A.bf16 ? (nkeys + 1) / 2 * 2 : nkeys;
  return {k0, k0 + ((nkeys + 15) / 16) * A.D * 16 * 2, v0, v0 + vkeys * A.Dp * 2};
}

// What a thread's tasks pass on (team path): the lines of its next task's chunk that
// the task before it has not fetched yet (set: that task fetched the others).
struct Carry {
  Lines rest;
  bool set = false;
  int64_t led = 0;  // lines fetched so for the next tasks, over this thread's tasks
};

// Task tk of head h. With carry, after names the thread's next task (head after_h): a task
// of several passes fetches its chunk along them (Ahead::then), and leaves in carry what
// it did not reach; carry comes in holding what is left of tk's own chunk.
void run_task(const Attn& A, int64_t h, const Task& tk, Carry* carry = nullptr,
              const Task* after = nullptr, int64_t after_h = 0) {
  thread_local std::vector<uint16_t> gbuf;
  const int64_t gsize = CHUNK * (A.D + (A.bf16 ? A.Dp : 0));
  if (tk.gathered && static_cast<int64_t>(gbuf.size()) < gsize) gbuf.resize(gsize);
  const uint16_t* ktile[CHUNK / 16];
  const uint16_t* vrow[CHUNK];  // bf16: the first CHUNK / 2 are pairs of rows
  if (A.bf16)
    chunk_sources_bf(A, h, tk, ktile, vrow, gbuf.data(), gbuf.data() + CHUNK * A.D);
  else
    chunk_sources(A, h, tk, ktile, vrow, gbuf.data());
  FtzGuard ftz(A.bf16 && !A.native);  // the FMAs that stand in for vdpbf16ps flush as it does
  const float* q[ATT_ROWS];
  const uint16_t* qb[ATT_ROWS];
  float* p[ATT_ROWS];
  int64_t nv[ATT_ROWS];
  int R = 0;
  int64_t nk = 0, rows = 0;
  for (int64_t t = tk.t0; t < tk.t1; ++t) rows += eligible(A, t, tk) ? A.G : 0;
  // The first pass over the chunk prefetches it (contiguous K tiles, then V rows), the
  // later ones read it from cache; with several passes, they fetch the next task's chunk.
  Ahead pf;
  const int64_t ahead = g_att_ahead.load(std::memory_order_relaxed);
  if (ahead > 0 && !tk.gathered) {
    pf.own = carry && carry->set ? carry->rest : chunk_lines(A, h, tk);
    for (int64_t i = 0; i < ahead && !pf.own.empty(); ++i) pf.own.fetch();  // then in step
  }
  const int rate = g_att_lead.load(std::memory_order_relaxed);
  const bool lead = ahead > 0 && rate > 0 && carry && after && !after->gathered && rows > ATT_ROWS;
  int64_t then_lines = 0;
  if (lead) {
    pf.then = chunk_lines(A, after_h, *after);
    pf.rate = rate;
    then_lines = pf.then.count();
  }
  for (int64_t t = tk.t0; t < tk.t1; ++t) {
    if (!eligible(A, t, tk)) continue;
    const int64_t n = keys_in(A, t, tk);
    for (int64_t g = 0; g < A.G; ++g) {
      const int64_t row = (h * A.T + t) * A.G + g;
      q[R] = A.qs + (t * A.NH + h * A.G + g) * A.D;
      qb[R] = A.qh + (t * A.NH + h * A.G + g) * A.D;
      p[R] = A.part + (row * A.nchunk + tk.c) * (A.Dp + 2);
      nv[R] = n;
      nk = n > nk ? n : nk;
      if (++R == ATT_ROWS) {
        chunk_call(A, R, q, qb, nv, nk, ktile, vrow, p, pf);
        pf.own = Lines{};
        R = 0;
        nk = 0;
      }
    }
  }
  if (R) chunk_call(A, R, q, qb, nv, nk, ktile, vrow, p, pf);
  if (carry) {
    carry->led += then_lines - pf.then.count();
    carry->rest = pf.then;
    carry->set = lead;
  }
}

// The bf16 path as tests see it (cs_lean_bf16_probe): x (n values, a multiple of 16)
// rounded as the weights p are (bits to xb), and the 16 scores of one tile of keys kt
// (pairs x 16 lanes x 2 bf16) against q (2 x pairs bf16 bits) to s.
template <class B>
void bf16_probe_with(const float* x, int64_t n, uint16_t* xb, const uint16_t* kt,
                     const uint16_t* qb, int64_t pairs, float* s) {
  for (int64_t i = 0; i + 16 <= n; i += 16) B::round(vld(x + i), xb + i);
  std::vector<float> qf(2 * pairs);
  for (int64_t i = 0; i < 2 * pairs; ++i) qf[i] = bf2f(qb[i]);
  const float* q[1] = {qf.data()};
  const uint16_t* qp[1] = {qb};
  const uint16_t* k[1] = {kt};
  Ahead pf;
  score_tiles_bf<B, 1, 1>(q, qp, 2 * pairs, k, s, 16, pf);
}

void bf16_probe(bool native, const float* x, int64_t n, uint16_t* xb, const uint16_t* kt,
                const uint16_t* qb, int64_t pairs, float* s) {
#ifdef LS_BF16_NATIVE
  if (native) {
    bf16_probe_with<BfNative>(x, n, xb, kt, qb, pairs, s);
    return;
  }
#endif
  (void)native;
  FtzGuard ftz(true);
  bf16_probe_with<BfEmu>(x, n, xb, kt, qb, pairs, s);
}

// Attention row `row` = (h, t, g) (KV head, token, query head of the group): its chunks
// merged in order into its place in A.out, out = sum_c o_c e_c / sum_c l_c e_c with
// e_c = exp(m_c - max m). 16 chunks' e_c come from one vexp, and each o_c e_c is added
// 16 dims at a time (the same product and sum per dim as one at a time).
void merge_row(const Attn& A, int64_t row) {
  const int64_t h = row / (A.T * A.G), t = (row / A.G) % A.T, g = row % A.G, Dp = A.Dp;
  float* out = A.out + t * A.NH * A.D + (h * A.G + g) * A.D;
  const float* part = A.part + row * A.nchunk * (Dp + 2);
  const int64_t nch = (A.len[t] + CHUNK - 1) / CHUNK;
  float M = -INFINITY;
  for (int64_t c = 0; c < nch; ++c) M = part[c * (Dp + 2)] > M ? part[c * (Dp + 2)] : M;
  V o[MAX_DP / 16];
  for (int64_t k = 0; k < Dp / 16; ++k) o[k] = vzero();
  float l = 0.0f;
  alignas(64) float e[16];
  for (int64_t c0 = 0; c0 < nch; c0 += 16) {
    const int64_t n = nch - c0 < 16 ? nch - c0 : 16;
    for (int64_t i = 0; i < 16; ++i) e[i] = i < n ? part[(c0 + i) * (Dp + 2)] - M : 0.0f;
    vst(e, vexp(vld(e)));
    for (int64_t i = 0; i < n; ++i) {
      const float* pc = part + (c0 + i) * (Dp + 2);
      l = l + pc[1] * e[i];
      const V ev = vset(e[i]);
      for (int64_t k = 0; k < Dp / 16; ++k) o[k] = vadd(o[k], vmul(vld(pc + 2 + 16 * k), ev));
    }
  }
  const V lv = vset(l);
  for (int64_t k = 0; 16 * k < A.D; ++k) {
    const V y = vdiv(o[k], lv);
    if (A.D - 16 * k >= 16) vst(out + 16 * k, y); else vst_n(out + 16 * k, y, A.D - 16 * k);
  }
}

void attention(const Attn& A, const std::vector<Task>& tasks, int64_t threads) {
  const int64_t nt = static_cast<int64_t>(tasks.size()), total = A.KV * nt;
  const int64_t th = threads < total ? threads : total;
#pragma omp parallel for num_threads(th) schedule(dynamic, 1) if (th > 1)
  for (int64_t i = 0; i < total; ++i) run_task(A, i / nt, tasks[i % nt]);
  const int64_t rows = A.KV * A.T * A.G;
  const int64_t tm = threads < rows ? threads : rows;
#pragma omp parallel for num_threads(tm) schedule(static) if (tm > 1 && rows >= 64)
  for (int64_t i = 0; i < rows; ++i) merge_row(A, i);
}

// The decoder stack over T tokens (see cs_lean_forward).
int forward(const Model& m, const Fwd& f) {
  const int64_t T = f.T, H = m.hidden, D = m.head_dim, NH = m.heads, KV = m.kv_heads;
  const int64_t I = m.inter, QW = (NH + 2 * KV) * D, Dp = pad16(D);
  Bufs& b = bufs(T, m);
  embed(m, f, b.x.data());
  tap(m, f, 0, b.x.data());
  Plan plan;
  if (!make_plan(m, f, plan)) return -2;
  b.part.resize(KV * T * (NH / KV) * plan.nchunk * (Dp + 2));
  for (int64_t l = 0; l < m.layers; ++l) {
    if (l > 0 && interrupted(f)) return INTERRUPTED;
    const Layer& L = m.layer[l];
    uint16_t* kc = f.kv + l * KV * f.s_max * (D + Dp);  // (KV, S_max / 16, D, 16)
    uint16_t* vc = kc + KV * f.s_max * D;  // (KV, S_max, Dp)
    rmsnorm(b.x.data(), T, H, H, L.ln1, m.eps, b.a.data(), H);
    if (!products(m, f, L.qkv, L.nqkv, T, b.a.data(), H, b.qkv.data(), QW, nullptr)) return -1;
    rope_store(m, f, b.qkv.data(), b.qs.data(), b.qh.data(), kc, vc);
    const Attn A = plan.attn(m, f, kc, vc, b.qs.data(), b.qh.data(), b.o.data(), b.part.data());
    attention(A, plan.tasks, f.threads);
    if (!products(m, f, &L.o, 1, T, b.o.data(), NH * D, b.x.data(), H, b.x.data())) return -1;
    rmsnorm(b.x.data(), T, H, H, L.ln2, m.eps, b.a.data(), H);
    if (!products(m, f, L.gu, L.ngu, T, b.a.data(), H, b.gu.data(), 2 * I, nullptr)) return -1;
    silu_mul(b.gu.data(), T, I, b.act.data());
    if (!products(m, f, &L.down, 1, T, b.act.data(), I, b.x.data(), H, b.x.data())) return -1;
    tap(m, f, l + 1, b.x.data());
  }
  const int64_t rows = T - f.first;
  int64_t done = 0, at = 0;  // at: greedy verification's walk (Fwd::stop)
  if (rows > 0 && f.logits) {
    rmsnorm(b.x.data() + f.first * H, rows, H, H, m.norm, m.eps, b.a.data(), H);
    while (done < rows) {
      const int64_t c = head_chunk(f, done, rows);
      if (!products(m, f, &m.head, 1, c, b.a.data() + done * H, H, f.logits + done * m.vocab,
                    m.vocab, nullptr))
        return -1;
      done += c;
      if (f.stop && walk_ends(f, f.logits, m.vocab, done, at)) break;
    }
  }
  if (f.best)
    for (int64_t r = 0; r < done; ++r) {
      bool nan;
      f.best[r] = row_argmax(f.isa, f.logits + r * m.vocab, m.vocab, nan);
    }
  return f.stop ? static_cast<int>(done) : 0;
}

// Where each of `threads` threads' tokens start when a forward is shared out by rows
// (g_row_split), and T at the end: cut so that each thread's share of the work is its
// share of the threads (thread 0's `split` of two), a token's work being its products'
// multiply-adds (int8, at about twice the rate of attention's bf16 ones) plus attention's
// for the keys it sees (the plan's key lists). Every thread gets at least one token.
// share0: the work thread 0 gets, of the whole (its tokens' work, whole tokens).
std::vector<int64_t> row_starts(const Model& m, const Plan& plan, int64_t threads, double split,
                                double& share0) {
  const int64_t T = static_cast<int64_t>(plan.len.size());
  const int64_t H = m.hidden, D = m.head_dim, NH = m.heads, KV = m.kv_heads;
  const double per_row =
      0.5 * static_cast<double>(H * (NH + 2 * KV) * D + NH * D * H + 3 * H * m.inter);
  const double per_key = 2.0 * static_cast<double>(NH * D);
  std::vector<double> upto(T + 1, 0.0);  // work of tokens [0, t)
  for (int64_t t = 0; t < T; ++t)
    upto[t + 1] = upto[t] + per_row + per_key * static_cast<double>(plan.len[t]);
  std::vector<int64_t> starts(threads + 1, 0);
  starts[threads] = T;
  for (int64_t i = 1; i < threads; ++i) {
    const double share = threads == 2 ? split : static_cast<double>(i) / threads;
    const double want = share * upto[T];
    int64_t t = starts[i - 1] + 1;
    while (t < T - (threads - i) && upto[t + 1] <= want) ++t;
    if (t < T - (threads - i) && want - upto[t] > upto[t + 1] - want) ++t;
    starts[i] = t;
  }
  share0 = upto[starts[1]] / upto[T];
  return starts;
}

// forward() with int8 block products (team_ok) in one parallel region: each step's work is
// shared out by rows (norms, x's quantization, RoPE, SiLU), panels (products), attention
// tasks (taken in turn) or merged rows, with bar.wait() between steps; from g_row_split
// tokens on, each layer's whole work by tokens (layers_by_rows, cut by row_starts). The
// same numbers as forward(): no result depends on which thread computes it.
int forward_team(const Model& m, const Fwd& f, Barrier& bar) {
  const int64_t T = f.T, H = m.hidden, D = m.head_dim, NH = m.heads, KV = m.kv_heads;
  const int64_t I = m.inter, QW = (NH + 2 * KV) * D, Dp = pad16(D), G = NH / KV;
  Bufs& b = bufs(T, m);
  embed(m, f, b.x.data());
  tap(m, f, 0, b.x.data());
  const int64_t threads = f.threads > 1 ? f.threads : 1;
  // Shared out by rows (g_row_split): thread i's tokens are [starts[i], starts[i + 1]).
  const bool rows_planned = by_rows(T, threads);
  std::atomic<double>& split_of = rows_planned ? g_split_rows : g_split;
  const double split = split_of.load(std::memory_order_relaxed);  // thread 0's, of two
  Plan plan;
  if (!make_plan(m, f, plan)) return -2;
  std::vector<int64_t> starts;
  double share0 = split;  // the share of the work thread 0 gets (of two)
  if (rows_planned) {
    starts = row_starts(m, plan, threads, split, share0);
    plan_tasks(f, plan, starts);  // no task spans two threads' tokens
  }
  b.part.resize(KV * T * G * plan.nchunk * (Dp + 2));
  const int64_t kmax = H > I ? (H > NH * D ? H : NH * D) : (I > NH * D ? I : NH * D);
  void* xq = cs_qgemm_i8_buffer(T, kmax);
  const int isa = i8_isa(f.isa);
  const int64_t ntask = static_cast<int64_t>(plan.tasks.size()) * KV;
  const int64_t mrows = KV * T * G;
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int> rc{0};
  std::atomic<bool> broke{false};
  // Fwd::interrupt seen: by panels thread 0 reads it before a layer's last barrier and
  // every thread after it (all stop at the same layer); by rows each thread at its layers'
  // starts (one that stops publishes every layer, so no later thread waits for its keys)
  std::atomic<bool> quit{false};
  int64_t busy[2] = {0, 0};  // ns each of two threads spent in the products (by rows: working)
  Progress progress(threads);  // by rows: the layers each thread has stored keys for
  // Fwd::best / Fwd::stop: each row's argmax, from each thread's own columns of the head
  Picks pick(f.best || f.stop, threads, T - f.first > 0 ? T - f.first : 0);
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    bar.n = omp_get_num_threads();  // (its implicit barrier: every thread sees n)
    const int64_t tid = omp_get_thread_num(), n = bar.n;
    auto share = [&](int64_t total, int64_t& lo, int64_t& hi) {
      lo = total * tid / n;
      hi = total * (tid + 1) / n;
    };
    int64_t ns = 0;
    auto panels_of = [&](int64_t np, int64_t& p0, int64_t& p1) {  // this thread's, in order
      if (n == 2) {  // split's shares (by rows: the LM head's)
        const int64_t cut = static_cast<int64_t>(static_cast<double>(np) * split + 0.5);
        p0 = tid == 0 ? 0 : cut;
        p1 = tid == 0 ? cut : np;
      } else {
        share(np, p0, p1);
      }
    };
    // The products of M rows of x quantized in xs by ms side by side (their columns one
    // after another in y): this thread's panels of each, or with whole every panel.
    auto mats_of = [&](const void* xs, bool whole, const Mat* ms, int64_t count, int64_t M,
                       float* y, int64_t ldy, const float* res) {
      const auto t0 = std::chrono::steady_clock::now();
      int64_t col = 0;
      for (int64_t i = 0; i < count; ++i) {
        const Mat& w = ms[i];
        const int64_t np = (w.n + 15) / 16;
        int64_t p0 = 0, p1 = np;
        if (!whole) panels_of(np, p0, p1);
        if (cs_qgemm_i8_panels(xs, w.kind, M, w.k, static_cast<const uint8_t*>(w.p), w.n,
                               y + col, ldy, w.bias, res ? res + col : nullptr, ldy, p0, p1,
                               isa))
          rc.store(-1);
        col += w.n;
      }
      ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - t0)
                .count();
    };
    auto mats = [&](const Mat* ms, int64_t count, int64_t M, float* y, int64_t ldy,
                    const float* res) { mats_of(xq, false, ms, count, M, y, ldy, res); };
    int64_t r0, r1;
    share(T, r0, r1);
    // By rows only with the team the rows were cut for (the plan's tasks break at its cuts)
    const bool by_rows = !starts.empty() && n == threads;
    // By rows: this thread's tokens through every panel of each product, x quantized into
    // its own buffer (its rows from 0), the earlier threads' keys awaited a layer (Progress).
    auto layers_by_rows = [&] {
      const auto t_in = std::chrono::steady_clock::now();
      int64_t waited = 0;
      const int64_t q0 = starts[tid], q1 = starts[tid + 1], nq = q1 - q0;
      void* mq = cs_qgemm_i8_buffer(T, kmax);  // this thread's own (tid 0's is xq)
      auto own = [&](const Mat* ms, int64_t count, float* y, int64_t ldy, const float* res) {
        mats_of(mq, true, ms, count, nq, y, ldy, res);
      };
      const int64_t nt = ntask / KV;
      std::vector<int64_t> mine;  // this thread's attention tasks (head i / nt, task i % nt)
      for (int64_t i = 0; i < ntask; ++i)
        if (plan.tasks[i % nt].t0 >= q0 && plan.tasks[i % nt].t0 < q1) mine.push_back(i);
      for (int64_t l = 0; l < m.layers; ++l) {
        if (l > 0 && interrupted(f)) {
          quit.store(true, std::memory_order_relaxed);
          progress.publish(tid, static_cast<int>(m.layers));
          break;
        }
        const Layer& L = m.layer[l];
        uint16_t* kc = f.kv + l * KV * f.s_max * (D + Dp);
        uint16_t* vc = kc + KV * f.s_max * D;
        rmsnorm(b.x.data() + q0 * H, nq, H, H, L.ln1, m.eps, b.a.data() + q0 * H, H);
        cs_qgemm_i8_quantize(mq, b.a.data() + q0 * H, H, H, 0, nq, isa);
        own(L.qkv, L.nqkv, b.qkv.data() + q0 * QW, QW, nullptr);
        rope_store(m, f, b.qkv.data(), b.qs.data(), b.qh.data(), kc, vc, q0, q1);
        const auto w0 = std::chrono::steady_clock::now();
        progress.publish(tid, static_cast<int>(l + 1));
        progress.await(tid, static_cast<int>(l + 1), bar);  // earlier tokens' keys stored
        waited += std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - w0)
                      .count();
        const Attn A = plan.attn(m, f, kc, vc, b.qs.data(), b.qh.data(), b.o.data(), b.part.data());
        Carry carry;
        for (size_t k = 0; k < mine.size(); ++k) {
          const int64_t i = mine[k], j = k + 1 < mine.size() ? mine[k + 1] : -1;
          run_task(A, i / nt, plan.tasks[i % nt], &carry, j < 0 ? nullptr : &plan.tasks[j % nt],
                   j < 0 ? 0 : j / nt);
        }
        if (carry.led) g_att_led.fetch_add(carry.led, std::memory_order_relaxed);
        for (int64_t h = 0; h < KV; ++h)
          for (int64_t t = q0; t < q1; ++t)
            for (int64_t g = 0; g < G; ++g) merge_row(A, (h * T + t) * G + g);
        cs_qgemm_i8_quantize(mq, b.o.data() + q0 * NH * D, NH * D, NH * D, 0, nq, isa);
        own(&L.o, 1, b.x.data() + q0 * H, H, b.x.data() + q0 * H);
        rmsnorm(b.x.data() + q0 * H, nq, H, H, L.ln2, m.eps, b.a.data() + q0 * H, H);
        cs_qgemm_i8_quantize(mq, b.a.data() + q0 * H, H, H, 0, nq, isa);
        own(L.gu, L.ngu, b.gu.data() + q0 * 2 * I, 2 * I, nullptr);
        silu_mul(b.gu.data() + q0 * 2 * I, nq, I, b.act.data() + q0 * I);
        cs_qgemm_i8_quantize(mq, b.act.data() + q0 * I, I, I, 0, nq, isa);
        own(&L.down, 1, b.x.data() + q0 * H, H, b.x.data() + q0 * H);
        tap(m, f, l + 1, b.x.data(), q0, q1);
      }
      ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now() - t_in)
               .count() -
           waited;
      bar.wait();  // every row's last layer done (the head reads rows of both)
    };
    if (by_rows) {
      if (tid == 0) g_row_forwards.fetch_add(1, std::memory_order_relaxed);
      layers_by_rows();
    }
    for (int64_t l = 0; l < (by_rows ? 0 : m.layers); ++l) {
      const Layer& L = m.layer[l];
      uint16_t* kc = f.kv + l * KV * f.s_max * (D + Dp);
      uint16_t* vc = kc + KV * f.s_max * D;
      rmsnorm(b.x.data() + r0 * H, r1 - r0, H, H, L.ln1, m.eps, b.a.data() + r0 * H, H);
      cs_qgemm_i8_quantize(xq, b.a.data(), H, H, r0, r1, isa);
      if (tid == 0) next.store(0);
      bar.wait();
      mats(L.qkv, L.nqkv, T, b.qkv.data(), QW, nullptr);
      bar.wait();
      rope_store(m, f, b.qkv.data(), b.qs.data(), b.qh.data(), kc, vc, r0, r1);
      bar.wait();
      const Attn A = plan.attn(m, f, kc, vc, b.qs.data(), b.qh.data(), b.o.data(), b.part.data());
      // Tasks in turn, each thread taking its next one as it starts one (so that a task
      // of several passes fetches the next one's keys and values along them).
      const int64_t nt = ntask / KV;
      Carry carry;
      for (int64_t i = next.fetch_add(1); i < ntask;) {
        const int64_t j = next.fetch_add(1);
        const Task* after = j < ntask ? &plan.tasks[j % nt] : nullptr;
        run_task(A, i / nt, plan.tasks[i % nt], &carry, after, j / nt);
        i = j;
      }
      if (carry.led) g_att_led.fetch_add(carry.led, std::memory_order_relaxed);
      bar.wait();
      int64_t a0, a1;
      share(mrows, a0, a1);
      for (int64_t i = a0; i < a1; ++i) merge_row(A, i);
      bar.wait();
      cs_qgemm_i8_quantize(xq, b.o.data(), NH * D, NH * D, r0, r1, isa);
      bar.wait();
      mats(&L.o, 1, T, b.x.data(), H, b.x.data());
      bar.wait();
      rmsnorm(b.x.data() + r0 * H, r1 - r0, H, H, L.ln2, m.eps, b.a.data() + r0 * H, H);
      cs_qgemm_i8_quantize(xq, b.a.data(), H, H, r0, r1, isa);
      bar.wait();
      mats(L.gu, L.ngu, T, b.gu.data(), 2 * I, nullptr);
      bar.wait();
      silu_mul(b.gu.data() + r0 * 2 * I, r1 - r0, I, b.act.data() + r0 * I);
      cs_qgemm_i8_quantize(xq, b.act.data(), I, I, r0, r1, isa);
      bar.wait();
      mats(&L.down, 1, T, b.x.data(), H, b.x.data());
      if (tid == 0 && l + 1 < m.layers && interrupted(f)) quit.store(true);
      bar.wait();
      if (quit.load(std::memory_order_relaxed)) break;
      if (tid == 0) tap(m, f, l + 1, b.x.data());  // read-only on x, as the next norm
    }
    const int64_t rows = T - f.first;
    // (by rows: every thread's quit stored before layers_by_rows's last barrier)
    if (rows > 0 && f.logits && !quit.load(std::memory_order_relaxed)) {
      int64_t h0, h1, at = 0;  // at: greedy verification's walk (tid 0's, Fwd::stop)
      share(rows, h0, h1);
      rmsnorm(b.x.data() + (f.first + h0) * H, h1 - h0, H, H, m.norm, m.eps,
              b.a.data() + h0 * H, H);
      int64_t c0 = 0, c1 = 0;  // this thread's columns of the head (its panels)
      if (pick.on) {
        panels_of((m.vocab + 15) / 16, c0, c1);
        c0 = 16 * c0 < m.vocab ? 16 * c0 : m.vocab;
        c1 = 16 * c1 < m.vocab ? 16 * c1 : m.vocab;
      }
      for (int64_t r0 = 0; r0 < rows;) {  // chunks of rows (one without Fwd::stop)
        const int64_t c = head_chunk(f, r0, rows);
        share(c, h0, h1);
        if (f.stop) {  // chunks share rows unlike the norms; the last chunk's break decided
          bar.wait();
          if (r0 > 0 && broke.load(std::memory_order_relaxed)) break;
        }
        cs_qgemm_i8_quantize(xq, b.a.data() + r0 * H, H, H, h0, h1, isa);
        bar.wait();
        mats(&m.head, 1, c, f.logits + r0 * m.vocab, m.vocab, nullptr);
        if (pick.on)  // each row's argmax over the columns this thread just wrote (in its cache)
          for (int64_t r = r0; r < r0 + c; ++r) pick.part(tid, r, f.isa, f.logits + r * m.vocab, c0, c1);
        r0 += c;
        if (tid == 0) done.store(r0, std::memory_order_relaxed);
        if (r0 == rows) break;
        bar.wait();  // the chunk's logits (and argmax parts) written
        if (tid == 0) {
          pick.merge(n, r0 - c, r0);
          broke.store(walk_ends(f, f.logits, m.vocab, r0, at, pick.best.data(), pick.nan.data()));
        }
      }
    }
    if (n == 2) busy[tid] = ns;
  }
  if (quit.load()) return INTERRUPTED;  // its busy times are not a whole forward's
  const bool rows_used = !starts.empty() && bar.n == threads;  // as by_rows in the region
  if (threads == 2 && rows_used == rows_planned)
    split_after(split_of, rows_used ? share0 : split, busy[0], busy[1]);
  const int r = rc.load();
  if (r == 0 && f.best) {
    pick.merge(bar.n, 0, done.load());
    for (int64_t i = 0; i < done.load(); ++i) f.best[i] = pick.best[i];
  }
  return r == 0 && f.stop ? static_cast<int>(done.load()) : r;
}
