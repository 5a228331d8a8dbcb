// The many-row int8 products on AMX tiles (Intel Sapphire Rapids and later), included by
// qgemm.cpp inside namespace v512: the same integer sums and float steps as v512::direct,
// so the same bits, with the sums of each sub-block taken by one tile multiply
// (_tile_dpbssd / _tile_dpbsud: 16 rows x 16 columns x 32 k; Q6_K's sub-blocks 16 k)
// instead of by 8 vpdpbusd per row and panel pair. What it owns: x's rows laid out as
// tiles, a panel's quants expanded into a B tile per sub-block, and the float steps over
// the stored sums. It must not change any number: a row's result equals the VNNI path's
// (and so the one-row product's) bit for bit, which the tests check on every type.
//
// Why it pays only for many rows: the GGUF's per-32 scales (on both sides: x's step per
// 32, the weights' per 32 or 16) need each sub-block's integer sums in fp32 before the
// next one, so every tile multiply is followed by a tile store and 16 rows of float steps
// (a load, a multiply, a conversion and a fused multiply-add per 16 sums). Those float
// steps, not the multiplies, bound it; they overlap the next sub-block's tile work (the
// sums are stored into one buffer while the other's are read, a sub-block behind).
//
// The kernel must ask Linux for the tile state once (arch_prctl ARCH_REQ_XCOMP_PERM);
// where the CPU lacks AMX-INT8, the kernel refuses, or CODESPEC_AMX=0, nothing here runs.

#define QG_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

// Products of at least this many rows take the tiles (fewer: v512::direct). A tile holds
// 16 rows; below two tiles the B tile's expansion is paid for too few rows.
constexpr int64_t AMX_MIN_ROWS = 32;

// Whether this process may use AMX-INT8: the CPU has it and Linux granted the tile state.
inline bool amx_granted() {
  static const bool ok = [] {
#if defined(__linux__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

// The AMX path's switch (cs_q_amx; CODESPEC_AMX=0 starts it off, for comparisons).
std::atomic<int> g_amx_on{[] {
  const char* e = std::getenv("CODESPEC_AMX");
  return e && e[0] == '0' ? 0 : 1;
}()};

// Q8_0 stays on v512::direct: its groups need no expansion, so the tiles save too little
// to pay for the float steps' tile stores (its small k / v products ran ~0.95x as fast on
// tiles, the LM head's 145 MB 0.5-0.9x: streamed a panel at a time, without the
// prefetches of the passes).
template <int T>
inline bool amx_use(int64_t M) {
  return T != T_Q8_0 && M >= AMX_MIN_ROWS && g_amx_on.load(std::memory_order_relaxed) &&
         amx_granted();
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Per-thread buffers: x's rows as A tiles ([tile][sub-block][16 rows][SUB bytes], rows past
// M zero), their steps and step x sums as [tile][32-block][16 rows], a panel's B tiles
// ([sub-block][SUB/4 rows of 64 bytes]) and its scale vectors ([sub-block]: sc, off).
struct AmxBuffers {
  std::vector<int8_t> xt;
  std::vector<float> dx, ms, s;
  std::vector<uint8_t> b;
};

template <int T>
QG_AMX_TARGET void amx_lay_rows(const Args& a, const Xq& xq, int64_t M, AmxBuffers& w) {
  constexpr int SUB = Tr<T>::SUB;
  const int64_t K = a.K, subs = K / SUB, k32 = K / 32, tiles = (M + 15) / 16;
  w.xt.resize(tiles * subs * 16 * SUB);
  w.dx.resize(tiles * k32 * 16);
  w.ms.resize(tiles * k32 * 16);
  if (M % 16)  // the last tile's rows past M: zeros (their sums are never read)
    memset(w.xt.data() + (tiles - 1) * subs * 16 * SUB, 0, subs * 16 * SUB);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t t = m / 16, r = m % 16;
    const int8_t* q = xq.q.data() + m * K;
    for (int64_t i = 0; i < subs; ++i)
      memcpy(w.xt.data() + ((t * subs + i) * 16 + r) * SUB, q + i * SUB, SUB);
    for (int64_t kb = 0; kb < k32; ++kb) {
      w.dx[(t * k32 + kb) * 16 + r] = xq.dx[m * k32 + kb];
      w.ms[(t * k32 + kb) * 16 + r] = xq.ms[m * k32 + kb];
    }
  }
}

// Panel p's quants as B tiles (x's bytes are signed: types with a bias take their quants
// minus it, still exact in a signed byte; the others stay unsigned) and its scales.
template <int T>
QG_AMX_TARGET void amx_lay_panel(const Args& a, int64_t p, AmxBuffers& w) {
  using F = Tr<T>;
  constexpr int SUB = F::SUB, G = SUB / 4, J = F::BK / SUB;
  const int64_t subs = a.K / SUB;
  w.b.resize(subs * G * 64);
  w.s.resize(subs * 32);
  const Ref pr = ref_of(a, p, 16 * F::NATIVE);
  I bias = _mm512_set1_epi8(static_cast<char>(i8_bias(T)));
  if constexpr (high_x16<T>)  // columns 8-15 hold their quants x 16 (group_i8)
    bias = _mm512_inserti64x4(bias, _mm256_set1_epi8(static_cast<char>(16 * i8_bias(T))), 1);
  for (int64_t i = 0; i < subs; ++i) {
    const int64_t b = i / J;
    const int j = static_cast<int>(i % J);
    V sc, off;
    z512::scales<T>(head_at(pr, b, F::GOFF), j, sc, off);
    if constexpr (high_x16<T>)
      sc = _mm512_mul_ps(sc, _mm512_insertf32x8(_mm512_set1_ps(1.0f), _mm256_set1_ps(0.0625f), 1));
    _mm512_storeu_ps(w.s.data() + i * 32, sc);
    _mm512_storeu_ps(w.s.data() + i * 32 + 16, off);
    for (int g = 0; g < G; ++g) {
      I z = group_i8<T>(group_at(pr, b, F::GOFF, F::GB, j * G + g));
      if constexpr (i8_bias(T) != 0) z = _mm512_sub_epi8(z, bias);
      _mm512_storeu_si512(w.b.data() + (i * G + g) * 64, z);
    }
  }
}

// One sub-block's tile multiply: x's tile A and the quants' tile B loaded, the sums into
// C from zero (signed quants: dpbssd; unsigned: dpbsud). Tile numbers are immediates.
#define QG_AMX_DOT(C, A, B)                                        \
  do {                                                             \
    _tile_loadd(A, xt + i * 16 * SUB, SUB);                        \
    _tile_loadd(B, bq + i * G * 64, 64);                           \
    _tile_zero(C);                                                 \
    if constexpr (i8_bias(T) != 0) _tile_dpbssd(C, A, B);          \
    else _tile_dpbsud(C, A, B);                                    \
  } while (0)

// Rows of tile t (`rows` from 16t, at most 16) x panel p, sub-blocks in a pipeline: each
// step stores sub-block i - 1's sums (C tile (i - 1) % 2: its multiply was issued a step
// earlier; storing right after the multiply waited for it), issues i's multiply (A / B
// tiles of their own, so no load waits for the multiply before it) and takes i - 2's float
// steps over sums stored a step ago (read back at once, a tile store stalled the loads).
template <int T>
QG_AMX_TARGET void amx_tile(const ArgsI8& ai, int64_t p, int64_t t, int64_t rows,
                            const AmxBuffers& w, Trickle& tr) {
  using F = Tr<T>;
  constexpr int SUB = F::SUB, G = SUB / 4;
  const Args& a = ai.a;
  const int64_t subs = a.K / SUB, k32 = a.K / 32;
  alignas(64) int32_t sums[3][256];
  V acc[16];
  for (auto& v : acc) v = _mm512_setzero_ps();
  const int8_t* xt = w.xt.data() + t * subs * 16 * SUB;
  const uint8_t* bq = w.b.data();
  const float* sv = w.s.data();
  const float* dx = w.dx.data() + t * k32 * 16;
  const float* ms = w.ms.data() + t * k32 * 16;
  const auto steps = [&](int64_t i) {
    const int32_t* s = sums[i % 3];
    const int64_t kb = i * SUB / 32;
    const V sc = _mm512_loadu_ps(sv + i * 32), off = _mm512_loadu_ps(sv + i * 32 + 16);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      if (r >= rows) break;  // a last tile's rows past M
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(sc, _mm512_set1_ps(dx[kb * 16 + r])),
                               _mm512_cvtepi32_ps(_mm512_load_si512(s + 16 * r)), acc[r]);
      if constexpr (i8_min(T))
        acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(ms[kb * 16 + r]), acc[r]);
    }
  };
  const auto store = [&](int64_t i) {  // sub-block i's sums, from C tile i % 3
    switch (i % 3) {
      case 0: _tile_stored(0, sums[i % 3], 64); break;
      case 1: _tile_stored(1, sums[i % 3], 64); break;
      default: _tile_stored(2, sums[i % 3], 64); break;
    }
  };
  for (int64_t i = 0; i < subs; ++i) {
    for (int64_t l = 0; l < tr.step && tr.p < tr.end; ++l, tr.p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(tr.p), _MM_HINT_T1);
    if (i >= 2) store(i - 2);  // its multiply was issued two steps ago
    switch (i % 3) {
      case 0: if (i & 1) QG_AMX_DOT(0, 3, 5); else QG_AMX_DOT(0, 4, 6); break;
      case 1: if (i & 1) QG_AMX_DOT(1, 3, 5); else QG_AMX_DOT(1, 4, 6); break;
      default: if (i & 1) QG_AMX_DOT(2, 3, 5); else QG_AMX_DOT(2, 4, 6); break;
    }
    if (i >= 3) steps(i - 3);
  }
  for (int64_t i = subs < 2 ? 0 : subs - 2; i < subs; ++i) store(i);
  for (int64_t i = subs < 3 ? 0 : subs - 3; i < subs; ++i) steps(i);
  const __mmask16 mk = z512::cols_mask(a.N - 16 * p);
  for (int r = 0; r < rows; ++r) z512::put(a, 16 * t + r, 16 * p, acc[r], mk);
}
#undef QG_AMX_DOT

template <int T>
QG_AMX_TARGET void amx_panels(const ArgsI8& ai, int64_t p0, int64_t p1) {
  constexpr int SUB = Tr<T>::SUB;
  thread_local AmxBuffers w;
  TileConfig cfg{};
  cfg.palette = 1;
  for (int c = 0; c < 3; ++c) cfg.rows[c] = 16, cfg.colsb[c] = 64;  // sums (C)
  for (int c = 3; c < 5; ++c) cfg.rows[c] = 16, cfg.colsb[c] = SUB;  // x (A)
  for (int c = 5; c < 7; ++c) cfg.rows[c] = SUB / 4, cfg.colsb[c] = 64;  // quants (B)
  _tile_loadconfig(&cfg);
  const int64_t M = ai.a.M, tiles = (M + 15) / 16;
  amx_lay_rows<T>(ai.a, *ai.xq, M, w);
  const Args& a = ai.a;
  const int64_t subs = a.K / SUB;
  for (int64_t p = p0; p < p1; ++p) {
    amx_lay_panel<T>(a, p, w);
    // the next group's bytes are fetched into L2 while this group's panels run from cache:
    // each panel's tiles take their share a few lines a sub-block
    const int64_t g = p / GROUP, first = g * GROUP, end = group_end(p, p1);
    const int64_t next = end < p1 ? end : p1;  // the next group's first panel, if ours
    Trickle tr{nullptr, nullptr, 0, true};
    if (next < p1) {
      const int64_t count = a.npanel - next < GROUP ? a.npanel - next : GROUP;
      const uint8_t* base = a.P + next * a.pstride;
      const int64_t nbytes = count * a.pstride, share = end - first;
      const int64_t s0 = nbytes * (p - first) / share, s1 = nbytes * (p - first + 1) / share;
      const int64_t lines = (s1 - (s0 & ~int64_t{63}) + 63) / 64;
      tr = {base + (s0 & ~int64_t{63}), base + s1, (lines + tiles * subs - 1) / (tiles * subs), true};
    }
    for (int64_t t = 0; t < tiles; ++t)
      amx_tile<T>(ai, p, t, M - 16 * t < 16 ? M - 16 * t : 16, w, tr);
  }
  _tile_release();
}
