// scripts/attention_isa_probe.cpp — what the attention of a verification could gain from
// the CPU's 16-bit dot products (a many-token verify over a long cache is bound by
// attention's fp32 FMAs). Not part of the product: a probe run by hand. Build and run
// (x86-64 Linux, GCC 12+):
//
//   g++ -O3 -mavx512f -mavx512bw -mavx512vl -mfma -mf16c -o /tmp/attention_isa_probe
//       scripts/attention_isa_probe.cpp && /tmp/attention_isa_probe
//
// For one chunk of 128 keys (head dim 64) and R query rows it times (1) the lean stack's way,
// fp16 cache widened to fp32 and fp32 FMAs; (2) AVX512-BF16 vdpbf16ps over a bf16 cache laid
// out in pairs; (3) AMX-BF16 tiles (scores, a bf16 P, P x V), each from cache (8 chunks
// cycled) and from memory (2,048 chunks, 32 MB). The softmax is a stand-in (max and
// subtract, no exp) in (2) and (3) and absent in (1): the three compare the products. Then
// it checks which sequence of fp32 operations reproduces vdpbf16ps and tdpbf16ps bit for
// bit on random bf16 inputs (a path any other ISA must match to agree with them).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int D = 64, C = 128;
using V = __m512;

// (1) R = 6 rows; K tiles [8][64][16] fp16, V rows [128][64] fp16.
__attribute__((noinline)) void fp32_chunk(const float* q, const uint16_t* K, const uint16_t* Vv,
                                          float* s, float* o) {
  constexpr int R = 6;
  for (int t = 0; t < C / 16; t += 2) {
    V acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const V k0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(K + (t * D + d) * 16)));
      const V k1 =
          _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(K + ((t + 1) * D + d) * 16)));
      for (int r = 0; r < R; ++r) {
        const V qv = _mm512_set1_ps(q[r * D + d]);
        acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * C + 16 * t, acc[r][0]);
      _mm512_storeu_ps(s + r * C + 16 * t + 16, acc[r][1]);
    }
  }
  V acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int j = 0; j < C; ++j) {
    V v[4];
    for (int c = 0; c < 4; ++c)
      v[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(Vv + j * D + 16 * c)));
    for (int r = 0; r < R; ++r) {
      const V p = _mm512_set1_ps(s[r * C + j]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

// (2) R = 6 rows; K tiles [8][32 dim pairs][16][2] bf16, V [64 key pairs][64][2] bf16.
__attribute__((target("avx512bf16,avx512bw"), noinline)) void vdp_chunk(
    const uint32_t* q2, const uint16_t* K, const uint16_t* Vv, float* s, uint32_t* p2, float* o) {
  constexpr int R = 6;
  for (int t = 0; t < C / 16; t += 2) {
    V acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int d = 0; d < D / 2; ++d) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(K + (t * D / 2 + d) * 32);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(K + ((t + 1) * D / 2 + d) * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(q2[r * D / 2 + d]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * C + 16 * t, acc[r][0]);
      _mm512_storeu_ps(s + r * C + 16 * t + 16, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; j += 32) {
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + r * C + j + 16),
                                             _mm512_loadu_ps(s + r * C + j));
      _mm512_storeu_si512(p2 + (r * C + j) / 2, (__m512i)b);
    }
  V acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int j = 0; j < C / 2; ++j) {
    __m512bh v[4];
    for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(Vv + (j * D + 16 * c) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(p2[r * C / 2 + j]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

struct TileCfg {
  uint8_t palette, start;
  uint8_t pad[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (M rows), 4-5: A (M rows), 6-7: B (16 rows). Static and behind a compiler
// barrier: GCC 12 does not see ldtilecfg read all 64 bytes and drops the zeroing of an
// automatic config's unused entries (the load then faults).
__attribute__((target("amx-tile"))) void tile_config(int M) {
  alignas(64) static TileCfg c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = t < 6 ? M : 16;
  }
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
}

// (3) M <= 16 rows: q [M][64] bf16; K tiles [8][32][16][2]; V [64][64][2]; P [M][128] bf16.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"), noinline)) void amx_chunk(
    int M, const uint16_t* q, const uint16_t* K, const uint16_t* Vv, float* s, uint16_t* p,
    float* o) {
  _tile_loadd(4, q, D * 2);
  _tile_loadd(5, q + 32, D * 2);
  for (int t = 0; t < C / 16; ++t) {
    _tile_zero(0);
    _tile_loadd(6, K + t * 1024, 64);
    _tile_loadd(7, K + t * 1024 + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(0, 5, 7);
    _tile_stored(0, s + 16 * t, C * 4);
  }
  for (int r = 0; r < M; ++r) {
    float* sr = s + r * C;
    V mx = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < C; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
    const V m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int j = 0; j < C; j += 32) {
      const V a = _mm512_sub_ps(_mm512_loadu_ps(sr + j), m);
      const V b = _mm512_sub_ps(_mm512_loadu_ps(sr + j + 16), m);
      _mm512_storeu_si512(p + r * C + j, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int kg = 0; kg < C / 32; ++kg) {
    _tile_loadd(4, p + kg * 32, C * 2);
    const uint16_t* vk = Vv + kg * 16 * 128;
    _tile_loadd(6, vk, 256);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, vk + 32, 256);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, vk + 64, 256);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, vk + 96, 256);
    _tile_dpbf16ps(3, 4, 7);
  }
  _tile_stored(0, o, D * 4);
  _tile_stored(1, o + 16, D * 4);
  _tile_stored(2, o + 32, D * 4);
  _tile_stored(3, o + 48, D * 4);
}

// tdpbf16ps of one 16 x 16 x (16 pairs) tile product (C starts at 0).
__attribute__((target("amx-tile,amx-bf16"), noinline)) void amx_tile(const uint16_t* a,
                                                                     const uint16_t* b,
                                                                     float* c) {
  tile_config(16);
  _tile_zero(0);
  _tile_loadd(4, a, 64);
  _tile_loadd(6, b, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_stored(0, c, 64);
}

// vdpbf16ps over the same 16 pairs, lane n of row m.
__attribute__((target("avx512bf16,avx512f"), noinline)) void vdp_tile(const uint16_t* a,
                                                                      const uint16_t* b,
                                                                      float* c) {
  for (int m = 0; m < 16; ++m) {
    V acc = _mm512_setzero_ps();
    for (int k = 0; k < 16; ++k) {
      uint32_t ap;
      memcpy(&ap, a + m * 32 + 2 * k, 4);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(ap),
                             (__m512bh)_mm512_loadu_si512(b + k * 32));
    }
    _mm512_storeu_ps(c + m * 16, acc);
  }
}

float widen(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

template <class F>
double per_call_us(int n, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f(i);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
         n;
}

}  // namespace

int main() {
  const bool bf16 = __builtin_cpu_supports("avx512bf16");
  const bool amx = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  printf("avx512bf16 %s, AMX tile data %s\n", bf16 ? "yes" : "no", amx ? "granted" : "refused");
  for (const int nch : {8, 2048}) {
    std::vector<uint16_t> K(nch * C * D, 0x3c00), Vv(nch * C * D, 0x3c00), q(16 * D, 0x3c00),
        p(16 * C);
    std::vector<float> qf(16 * D, 0.01f), s(16 * C), o(16 * D);
    std::vector<uint32_t> q2(16 * D / 2, 0x3c003c00), p2(16 * C / 2);
    const int n = nch > 64 ? 20000 : 100000;
    printf("%s (%d chunks cycled), us per chunk of 128 keys:\n", nch > 64 ? "memory" : "cache",
           nch);
    for (int rep = 0; rep < 2; ++rep) {
      const double a = per_call_us(n, [&](int i) {
        const int c = i % nch;
        fp32_chunk(qf.data(), K.data() + c * C * D, Vv.data() + c * C * D, s.data(), o.data());
      });
      printf("  fp32 FMA, 6 rows %.2f", a);
      if (bf16) {
        const double b = per_call_us(n, [&](int i) {
          const int c = i % nch;
          vdp_chunk(q2.data(), K.data() + c * C * D, Vv.data() + c * C * D, s.data(), p2.data(),
                    o.data());
        });
        printf("   vdpbf16ps, 6 rows %.2f", b);
      }
      if (amx)
        for (const int M : {3, 16}) {
          tile_config(M);
          const double t = per_call_us(n, [&](int i) {
            const int c = i % nch;
            amx_chunk(M, q.data(), K.data() + c * C * D, Vv.data() + c * C * D, s.data(),
                      p.data(), o.data());
          });
          printf("   AMX, %d rows %.2f", M, t);
        }
      printf("\n");
    }
  }
  // Which fp32 sequence each instruction's results are (random bf16, magnitudes e^N(0,1)).
  std::mt19937 g(1);
  std::normal_distribution<float> nd(0, 1);
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float ca[256], cv[256];
  long total = 0, amx_seq = 0, amx_rev = 0, amx_once = 0, vdp_seq = 0, vdp_rev = 0;
  for (int trial = 0; trial < 500; ++trial) {
    for (int i = 0; i < 512; ++i) {
      const float x = nd(g) * std::exp(nd(g)), y = nd(g) * std::exp(nd(g));
      uint32_t ux, uy;
      memcpy(&ux, &x, 4);
      memcpy(&uy, &y, 4);
      a[i] = uint16_t(ux >> 16);
      b[i] = uint16_t(uy >> 16);
    }
    if (amx) amx_tile(a, b, ca);
    if (bf16) vdp_tile(a, b, cv);
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float seq = 0, rev = 0;  // even then odd / odd then even, one rounding each
        double exact = 0;
        for (int k = 0; k < 16; ++k) {
          const float a0 = widen(a[m * 32 + 2 * k]), a1 = widen(a[m * 32 + 2 * k + 1]);
          const float b0 = widen(b[k * 32 + 2 * n]), b1 = widen(b[k * 32 + 2 * n + 1]);
          seq = std::fma(a1, b1, std::fma(a0, b0, seq));
          rev = std::fma(a0, b0, std::fma(a1, b1, rev));
          exact += double(a0) * b0 + double(a1) * b1;
        }
        const float once = float(exact);
        ++total;
        amx_seq += memcmp(&ca[m * 16 + n], &seq, 4) != 0;
        amx_rev += memcmp(&ca[m * 16 + n], &rev, 4) != 0;
        amx_once += memcmp(&ca[m * 16 + n], &once, 4) != 0;
        vdp_seq += memcmp(&cv[m * 16 + n], &seq, 4) != 0;
        vdp_rev += memcmp(&cv[m * 16 + n], &rev, 4) != 0;
      }
  }
  printf("of %ld dot products of 16 bf16 pairs, differing from an fp32 sequence:\n", total);
  if (bf16)
    printf("  vdpbf16ps: even-then-odd FMAs %ld, odd-then-even %ld\n", vdp_seq, vdp_rev);
  if (amx)
    printf("  tdpbf16ps: even-then-odd FMAs %ld, odd-then-even %ld, one rounding %ld\n", amx_seq,
           amx_rev, amx_once);
  return 0;
}
