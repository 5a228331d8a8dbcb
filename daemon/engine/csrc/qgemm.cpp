// Products with GGUF block-quantized weights on the CPU (codespec.daemon.quant_gemm).
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) (+ res[M, N]), x fp32, W one of GGUF's block
// types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, kept in its own bytes: no fp32 or fp16 copy
// of the weights ever exists. Weights are widened to fp32 inside the kernel, exactly:
// w = fma(scale, q, off) with q the block's integer quant as a float and scale / off
// the block's fp16 scale and min (or the K-quants' d * sc and -dmin * m, exact products
// of an fp16 and a 6- or 8-bit integer). Every widened weight equals gguf's reference
// dequantizer's value (a zero may differ in sign, which no sum can tell apart).
//
// Layout (made once by cs_q_pack from the GGUF rows): output rows are taken 16 at a time
// ("panels", padded with zero blocks to a multiple of 16). One panel block holds its 16
// rows' blocks side by side:
//   header: the 16 rows' scales (fp16 d[16], then Q4_1's / Q5_1's m[16] / the K-quants'
//           dmin[16],
//           then the K-quants' sub-block scales, re-encoded 16 columns wide),
//   groups: BK / 4 groups of four consecutive k, each holding 16 columns x 4 k values:
//     N4 (4-bit quants, 32 bytes): byte 4i + t holds (column i, k t) in its low nibble and
//        (column 8 + i, k t) in its high nibble;
//     B4 (Q8_0, 64 bytes): byte 4c + t holds (column c, k t);
//     P4 (a bit plane, 8 bytes, Q5_0's, Q5_1's and Q5_K's bit 4, Q6_K's bits 4 and 5):
//        bit 4c + t (after the N4 bytes of the group).
// Panels are stored four at a time (GROUP), interleaved so that the four are one stream:
// block b of a group holds the four headers, then group 0 of each panel, group 1 of each,
// and so on. A panel block has exactly the bytes of its 16 GGUF blocks (16 x 34, 18, 20,
// 22, 24, 144, 176 or 210). Expanding a group gives, per column c, a 32-bit lane whose byte t is
// the quant of k t: the layout AVX-512 wants (one zmm of 16 columns), AVX2 too (two ymm
// of 8), and the one integer dot products (vpdpbusd / vpmaddubsw: 4 bytes per lane) want.
//
// Summation order: each output is summed over k = 0 .. K-1 in order, one FMA per step from
// +0, then + bias, then + res, whatever M, the thread count or the ISA. So a row's result
// equals, bit for bit, the one-row product's; the AVX-512, AVX2 and scalar paths agree bit
// for bit too (the scalar one uses fmaf, the C library's exact fused multiply-add).
//
// Paths, per ISA (chosen at run time by the caller: 0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512
// F/BW/VL/DQ; each ISA's functions carry their own target attributes, the rest of the
// file is baseline x86-64): "direct" for few rows (AVX-512 1 to 8, AVX2 1 to 4) widens
// the weights of a group (64 outputs; 32 from 5 rows on, for registers) in registers as
// they stream in and uses each vector for every row; "scratch" for more rows widens a
// group's panels (K x 16 floats each, in L2) once and runs a register-blocked fp32
// product over them, so the widening is paid once for all rows. Both paths are one source,
// qgemm_exact.inc.cpp, included by each vector ISA's namespace over that ISA's primitives
// for 16 columns (load and expand a group, its quants as floats, scales, fma, store); only
// the primitives and the pass shapes (rows and panels a pass, for the registers) are
// written per ISA. Exact widening costs one FMA per weight vector besides the rows' own:
// a one-row product is bound by the vector pipes that widen the weights, many rows by
// the FMA units (16 fp32 multiply-adds per cycle per core).
//
// A second product, cs_qgemm_i8, is what llama.cpp does instead: each row of x is rounded
// to int8 per 32 k (one fp32 scale per 32), and blocks are multiplied by integer dot
// products (AVX-512 VNNI vpdpbusd, else AVX2 vpmaddubsw). Faster for many rows, not exact:
// its error is that of rounding x to 8 bits. Its rows too are independent of M and threads.
// Where the CPU has AMX-INT8, its products of many rows take tiles for the integer sums
// (qgemm_amx.inc.cpp), with the same integers and float steps, so the same bits.
#include <atomic>
#include <chrono>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#if defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define QG_X86 1
#endif
// QG_NO_AVX512 (codespec builds with it for a CPU without AVX-512F: quant_gemm.FLAGS)
// leaves the AVX-512 and AMX paths out: such a CPU never runs them, and they are about
// half of this file's compile.
#if defined(QG_X86) && !defined(QG_NO_AVX512)
#define QG_AVX512 1
#endif

// The file compiles as five objects at once (a compiler process uses one core, and this
// file alone took 44 s of a first run's ~75 s compile on a 2-core VM), one per part: the
// widening (exact) products of AVX2 (z256: qgemm_avx2.cpp, QG_PART_AVX2) and of AVX-512
// (z512: qgemm_avx512.cpp), the int8 products of AVX2 (v256: qgemm_avx2_i8.cpp) and of
// AVX-512 with the AMX tiles (v512: qgemm_avx512_i8.cpp), and this file itself: the rest
// (the scalar paths, the dispatch and the C functions). An int8 part compiles its ISA's
// widening namespace too, for the primitives it shares, but instantiates none of its
// products. The AVX-512 parts are empty under QG_NO_AVX512. The parts meet through the
// named namespace qgp below: the ISA parts' entry points, taking and giving only plain
// types (a panel function comes back as void*, cast back to its own type, which every
// part defines the same from this one source), and the switches every part reads.
#if defined(QG_X86) && (defined(QG_PART_AVX2) || defined(QG_PART_AVX2_I8))
#define QG_EMIT_Z256 1
#endif
#if defined(QG_X86) && defined(QG_PART_AVX2_I8)
#define QG_EMIT_V256 1
#endif
#if defined(QG_AVX512) && (defined(QG_PART_AVX512) || defined(QG_PART_AVX512_I8))
#define QG_EMIT_Z512 1
#endif
#if defined(QG_AVX512) && defined(QG_PART_AVX512_I8)
#define QG_EMIT_V512 1
#endif
#if !defined(QG_PART_AVX2) && !defined(QG_PART_AVX2_I8) && !defined(QG_PART_AVX512) && \
    !defined(QG_PART_AVX512_I8)
#define QG_BASE 1
#endif

namespace qgp {
extern std::atomic<int64_t> g_prefetch_ahead;
extern std::atomic<int64_t> g_expand_rows;
extern std::atomic<int32_t> g_prefetch_level;
void* z256_panels(int t);  // a PanelFn, or null
void z256_dequant(int t, const void* ref, int64_t K, float* out);  // ref: a const Ref*
void* v256_panels(int t);  // a PanelFnI8, or null
void* v256_quantize();     // a QuantFn
int64_t v256_dot_peak(int64_t iters);
void* z512_panels(int t);
void z512_dequant(int t, const void* ref, int64_t K, float* out);
void* v512_panels(int t);
void* v512_quantize();
int64_t v512_dot_peak(int64_t iters);
int v512_amx(int on);  // cs_q_amx's
}  // namespace qgp

// GGML type -> NS::panels<type> (pick and pick_i8, in the part that has NS)
#define QG_PANELS_OF(NS, t)                          \
  switch (t) {                                       \
    case T_Q8_0: return (void*)NS::panels<T_Q8_0>;   \
    case T_Q4_0: return (void*)NS::panels<T_Q4_0>;   \
    case T_Q4_1: return (void*)NS::panels<T_Q4_1>;   \
    case T_Q5_0: return (void*)NS::panels<T_Q5_0>;   \
    case T_Q5_1: return (void*)NS::panels<T_Q5_1>;   \
    case T_Q4_K: return (void*)NS::panels<T_Q4_K>;   \
    case T_Q5_K: return (void*)NS::panels<T_Q5_K>;   \
    case T_Q6_K: return (void*)NS::panels<T_Q6_K>;   \
    default: return nullptr;                         \
  }

namespace {

constexpr int T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12,
              T_Q5_K = 13, T_Q6_K = 14;

// The types whose groups carry one bit plane (the quants' bit 4: 5-bit quants, 0 .. 31).
template <int T>
constexpr bool five_bit = T == T_Q5_0 || T == T_Q5_1 || T == T_Q5_K;
constexpr bool has_min(int t) { return t == T_Q4_1 || t == T_Q5_1 || t == T_Q4_K || t == T_Q5_K; }
constexpr int planes(int t) {
  return t == T_Q6_K ? 2 : t == T_Q5_0 || t == T_Q5_1 || t == T_Q5_K ? 1 : 0;
}

// Per type: k per block, bytes per GGUF block, k per sub-block (one scale), where the
// groups start in a panel block, bytes per group.
template <int T> struct Tr;
template <int bk, int native, int sub, int goff, int gb>
struct TrOf {
  static constexpr int BK = bk, NATIVE = native, SUB = sub, GOFF = goff, GB = gb;
};
template <> struct Tr<T_Q8_0> : TrOf<32, 34, 32, 32, 64> {};
template <> struct Tr<T_Q4_0> : TrOf<32, 18, 32, 32, 32> {};
template <> struct Tr<T_Q4_1> : TrOf<32, 20, 32, 64, 32> {};
template <> struct Tr<T_Q5_0> : TrOf<32, 22, 32, 32, 40> {};
template <> struct Tr<T_Q5_1> : TrOf<32, 24, 32, 64, 40> {};
template <> struct Tr<T_Q4_K> : TrOf<256, 144, 32, 256, 32> {};
template <> struct Tr<T_Q5_K> : TrOf<256, 176, 32, 256, 40> {};
template <> struct Tr<T_Q6_K> : TrOf<256, 210, 16, 288, 48> {};

struct Desc {
  int bk, native, sub, goff, gb;
};

bool desc_of(int t, Desc& d) {
  switch (t) {
#define QG_DESC(X) \
  case X: d = {Tr<X>::BK, Tr<X>::NATIVE, Tr<X>::SUB, Tr<X>::GOFF, Tr<X>::GB}; return true;
    QG_DESC(T_Q8_0)
    QG_DESC(T_Q4_0)
    QG_DESC(T_Q4_1)
    QG_DESC(T_Q5_0)
    QG_DESC(T_Q5_1)
    QG_DESC(T_Q4_K)
    QG_DESC(T_Q5_K)
    QG_DESC(T_Q6_K)
#undef QG_DESC
    default: return false;
  }
}

// ---------------------------------------------------------------------------------------
// One GGUF block, decoded to integers: quants q (Q8_0: int8 bits; Q6_K: 0..63, the -32
// left to the widening), fp16 bits d and m (Q4_1's min, the K-quants' dmin), sub-block
// scales sc (Q4_K/Q5_K: 8 six-bit; Q6_K: 16 int8 bits) and mins mn (8 six-bit).
struct Blk {
  uint16_t d = 0, m = 0;
  uint8_t sc[16] = {}, mn[8] = {};
  uint8_t q[256] = {};
};

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

inline void wr16(uint8_t* p, uint16_t v) { memcpy(p, &v, 2); }

inline uint64_t rd64(const uint8_t* p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

inline void wr64(uint8_t* p, uint64_t v) { memcpy(p, &v, 8); }

// Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes (low 6 bits of bytes 0-3 /
// 4-7 for sub-blocks 0-3; nibbles of bytes 8-11 plus the top 2 bits of bytes 0-7 for 4-7).
void unpack_k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

void pack_k_scales(const uint8_t* sc, const uint8_t* mn, uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
    s[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
    s[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
  }
}

void decode_native(int t, const uint8_t* b, Blk& o) {
  switch (t) {
    case T_Q8_0:
      o.d = rd16(b);
      memcpy(o.q, b + 2, 32);
      break;
    case T_Q4_0:
    case T_Q4_1: {
      o.d = rd16(b);
      const uint8_t* qs = b + 2;
      if (t == T_Q4_1) {
        o.m = rd16(b + 2);
        qs = b + 4;
      }
      for (int i = 0; i < 16; ++i) {
        o.q[i] = qs[i] & 15;
        o.q[i + 16] = qs[i] >> 4;
      }
      break;
    }
    case T_Q5_0:
    case T_Q5_1: {  // d, (Q5_1: m), 32 high bits (bit i: quant i), 16 bytes of nibbles
      o.d = rd16(b);
      const uint8_t* qh = b + 2;
      if (t == T_Q5_1) {
        o.m = rd16(b + 2);
        qh = b + 4;
      }
      const uint8_t* qs = qh + 4;
      for (int i = 0; i < 16; ++i) {
        o.q[i] = (qs[i] & 15) | (((qh[i / 8] >> (i % 8)) & 1) << 4);
        o.q[i + 16] = (qs[i] >> 4) | (((qh[2 + i / 8] >> (i % 8)) & 1) << 4);
      }
      break;
    }
    case T_Q4_K:
    case T_Q5_K: {
      o.d = rd16(b);
      o.m = rd16(b + 2);
      unpack_k_scales(b + 4, o.sc, o.mn);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = t == T_Q4_K ? b + 16 : b + 48;
      for (int j = 0; j < 8; ++j) {  // sub-block j: nibbles (j & 1) of bytes 32 * (j / 2) ..
        for (int i = 0; i < 32; ++i) {
          uint8_t v = (qs[32 * (j / 2) + i] >> (4 * (j & 1))) & 15;
          if (t == T_Q5_K) v |= ((qh[i] >> j) & 1) << 4;
          o.q[32 * j + i] = v;
        }
      }
      break;
    }
    case T_Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      memcpy(o.sc, b + 192, 16);
      o.d = rd16(b + 208);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = e % 128;
        const uint8_t lo = (ql[64 * h + r % 64] >> (r < 64 ? 0 : 4)) & 15;
        const uint8_t hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        o.q[e] = lo | (hi << 4);
      }
      break;
    }
  }
}

void encode_native(int t, const Blk& o, uint8_t* b) {
  switch (t) {
    case T_Q8_0:
      wr16(b, o.d);
      memcpy(b + 2, o.q, 32);
      break;
    case T_Q4_0:
    case T_Q4_1: {
      wr16(b, o.d);
      uint8_t* qs = b + 2;
      if (t == T_Q4_1) {
        wr16(b + 2, o.m);
        qs = b + 4;
      }
      for (int i = 0; i < 16; ++i) qs[i] = (o.q[i] & 15) | (o.q[i + 16] << 4);
      break;
    }
    case T_Q5_0:
    case T_Q5_1: {
      wr16(b, o.d);
      uint8_t* qh = b + 2;
      if (t == T_Q5_1) {
        wr16(b + 2, o.m);
        qh = b + 4;
      }
      uint8_t* qs = qh + 4;
      memset(qh, 0, 4);
      for (int i = 0; i < 32; ++i) qh[i / 8] |= ((o.q[i] >> 4) & 1) << (i % 8);
      for (int i = 0; i < 16; ++i) qs[i] = (o.q[i] & 15) | ((o.q[i + 16] & 15) << 4);
      break;
    }
    case T_Q4_K:
    case T_Q5_K: {
      wr16(b, o.d);
      wr16(b + 2, o.m);
      pack_k_scales(o.sc, o.mn, b + 4);
      uint8_t* qh = b + 16;
      uint8_t* qs = t == T_Q4_K ? b + 16 : b + 48;
      if (t == T_Q5_K) memset(qh, 0, 32);
      memset(qs, 0, 128);
      for (int j = 0; j < 8; ++j) {
        for (int i = 0; i < 32; ++i) {
          const uint8_t v = o.q[32 * j + i];
          qs[32 * (j / 2) + i] |= (v & 15) << (4 * (j & 1));
          if (t == T_Q5_K) qh[i] |= ((v >> 4) & 1) << j;
        }
      }
      break;
    }
    case T_Q6_K: {
      uint8_t* ql = b;
      uint8_t* qh = b + 128;
      memset(b, 0, 192);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = e % 128;
        ql[64 * h + r % 64] |= (o.q[e] & 15) << (r < 64 ? 0 : 4);
        qh[32 * h + r % 32] |= ((o.q[e] >> 4) & 3) << (2 * (r / 32));
      }
      memcpy(b + 192, o.sc, 16);
      wr16(b + 208, o.d);
      break;
    }
  }
}

// The 16 columns' blocks <-> one panel block (layout in the file comment). K-quant
// sub-block j's scales: 24 bytes, byte c = sc[c] | (mn[c] & 3) << 6 for c < 16, then
// nibble c of bytes 16-23 = mn[c] >> 2. Q6_K: 16 bytes per sub-block, byte c = sc[c].
void pack_block(int t, const Blk* col, uint8_t* p) {
  Desc ds;
  desc_of(t, ds);
  memset(p, 0, 16 * ds.native);
  for (int c = 0; c < 16; ++c) wr16(p + 2 * c, col[c].d);
  if (has_min(t))
    for (int c = 0; c < 16; ++c) wr16(p + 32 + 2 * c, col[c].m);
  if (t == T_Q4_K || t == T_Q5_K) {
    for (int j = 0; j < 8; ++j) {
      uint8_t* s = p + 64 + 24 * j;
      for (int c = 0; c < 16; ++c) {
        s[c] = (col[c].sc[j] & 63) | ((col[c].mn[j] & 3) << 6);
        s[16 + c / 2] |= ((col[c].mn[j] >> 2) & 15) << (4 * (c & 1));
      }
    }
  }
  if (t == T_Q6_K)
    for (int j = 0; j < 16; ++j)
      for (int c = 0; c < 16; ++c) p[32 + 16 * j + c] = col[c].sc[j];
  for (int g = 0; g < ds.bk / 4; ++g) {
    uint8_t* gp = p + ds.goff + g * ds.gb;
    for (int c = 0; c < 16; ++c) {
      for (int k = 0; k < 4; ++k) {
        const uint8_t v = col[c].q[4 * g + k];
        if (t == T_Q8_0) {
          gp[4 * c + k] = v;
        } else {
          gp[4 * (c % 8) + k] |= (v & 15) << (c < 8 ? 0 : 4);
        }
      }
    }
    if (planes(t)) {
      for (int plane = 0; plane < planes(t); ++plane) {
        uint64_t bits = 0;
        for (int c = 0; c < 16; ++c)
          for (int k = 0; k < 4; ++k)
            bits |= static_cast<uint64_t>((col[c].q[4 * g + k] >> (4 + plane)) & 1) << (4 * c + k);
        wr64(gp + 32 + 8 * plane, bits);
      }
    }
  }
}

void unpack_block(int t, const uint8_t* p, Blk* col) {
  Desc ds;
  desc_of(t, ds);
  for (int c = 0; c < 16; ++c) {
    col[c] = Blk();
    col[c].d = rd16(p + 2 * c);
    if (has_min(t)) col[c].m = rd16(p + 32 + 2 * c);
  }
  if (t == T_Q4_K || t == T_Q5_K) {
    for (int j = 0; j < 8; ++j) {
      const uint8_t* s = p + 64 + 24 * j;
      for (int c = 0; c < 16; ++c) {
        col[c].sc[j] = s[c] & 63;
        col[c].mn[j] = (s[c] >> 6) | (((s[16 + c / 2] >> (4 * (c & 1))) & 15) << 2);
      }
    }
  }
  if (t == T_Q6_K)
    for (int j = 0; j < 16; ++j)
      for (int c = 0; c < 16; ++c) col[c].sc[j] = p[32 + 16 * j + c];
  for (int g = 0; g < ds.bk / 4; ++g) {
    const uint8_t* gp = p + ds.goff + g * ds.gb;
    const uint64_t h0 = planes(t) >= 1 ? rd64(gp + 32) : 0;
    const uint64_t h1 = planes(t) == 2 ? rd64(gp + 40) : 0;
    for (int c = 0; c < 16; ++c) {
      for (int k = 0; k < 4; ++k) {
        uint8_t v;
        if (t == T_Q8_0) {
          v = gp[4 * c + k];
        } else {
          v = (gp[4 * (c % 8) + k] >> (c < 8 ? 0 : 4)) & 15;
          v |= ((h0 >> (4 * c + k)) & 1) << 4;
          v |= ((h1 >> (4 * c + k)) & 1) << 5;
        }
        col[c].q[4 * g + k] = v;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Scalar path: the reference for the vector paths' arithmetic, and the fallback on a CPU
// without AVX2. Compiled for the baseline ISA; std::fma is the C library's exact fused
// multiply-add (the FMA instruction where the CPU has one), so it rounds as the vector
// paths' FMAs do.

float h2f(uint16_t h) {
  const uint32_t s = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 31, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0) {
    const float f = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return s ? -f : f;
  } else if (e == 31) {
    bits = s | 0x7f800000u | (m << 13);
  } else {
    bits = s | ((e + 112) << 23) | (m << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Scale and offset of sub-block j of a column: w = fma(scale, q, off) for its quants q.
void scale_off(int t, const Blk& b, int j, float& scale, float& off) {
  const float d = h2f(b.d);
  switch (t) {
    case T_Q8_0: scale = d; off = 0.0f; break;
    case T_Q4_0: scale = d; off = d * -8.0f; break;
    case T_Q4_1: scale = d; off = h2f(b.m); break;
    case T_Q5_0: scale = d; off = d * -16.0f; break;
    case T_Q5_1: scale = d; off = h2f(b.m); break;
    case T_Q4_K:
    case T_Q5_K:
      scale = d * static_cast<float>(b.sc[j]);
      off = -(h2f(b.m) * static_cast<float>(b.mn[j]));
      break;
    case T_Q6_K:
      scale = d * static_cast<float>(static_cast<int8_t>(b.sc[j]));
      off = scale * -32.0f;
      break;
  }
}

// Widen one panel block to w[k][16] (BK rows of 16 columns).
void widen_block_scalar(int t, const uint8_t* p, float* w) {
  Desc ds;
  desc_of(t, ds);
  Blk col[16];
  unpack_block(t, p, col);
  for (int c = 0; c < 16; ++c) {
    for (int j = 0; j < ds.bk / ds.sub; ++j) {
      float scale, off;
      scale_off(t, col[c], j, scale, off);
      for (int i = 0; i < ds.sub; ++i) {
        const int k = j * ds.sub + i;
        const uint8_t v = col[c].q[k];
        const float q = t == T_Q8_0 ? static_cast<float>(static_cast<int8_t>(v))
                                    : static_cast<float>(v);
        w[16 * k + c] = std::fma(scale, q, off);
      }
    }
  }
}

struct Args {
  const float* x;
  int64_t M, K, ldx;
  const uint8_t* P;
  int64_t N;
  float* y;
  int64_t ldy;
  const float* bias;
  const float* res;
  int64_t ldr;
  int type;
  int64_t pstride;  // bytes per panel
  int64_t npanel;
};

// Panels are stored in groups of GROUP (the last group may hold fewer), interleaved so
// that the panels a one-row product reads together come in one sequential stream: four
// separate streams make a cold one-row product markedly slower, the Q8_0 LM head's most.
// Block b of a group holds its panels' headers one after the other, then their groups of
// four k interleaved (group 0 of each panel, group 1 of each, ...).
constexpr int64_t GROUP = 4;

// Panel p: its group's first byte, the group's bytes per block and panel count, p's place.
struct Ref {
  const uint8_t* base;
  int64_t bstride, count, q;
};

inline Ref ref_of(const uint8_t* P, int64_t npanel, int64_t pstride, int64_t p, int64_t bytes) {
  const int64_t g = p / GROUP;
  const int64_t count = npanel - g * GROUP < GROUP ? npanel - g * GROUP : GROUP;
  return {P + g * GROUP * pstride, count * bytes, count, p - g * GROUP};
}

inline Ref ref_of(const Args& a, int64_t p, int64_t bytes) {
  return ref_of(a.P, a.npanel, a.pstride, p, bytes);
}

// Panel r.q + dq's header in block b, and its group gi of four k there.
inline const uint8_t* head_at(const Ref& r, int64_t b, int goff, int64_t dq = 0) {
  return r.base + b * r.bstride + (r.q + dq) * goff;
}

inline const uint8_t* group_at(const Ref& r, int64_t b, int goff, int gb, int64_t gi,
                               int64_t dq = 0) {
  return r.base + b * r.bstride + r.count * goff + (gi * r.count + r.q + dq) * gb;
}

// One panel block <-> the contiguous form pack_block / unpack_block read (header, groups).
void gather_block(const Desc& ds, const Ref& r, int64_t b, uint8_t* out) {
  memcpy(out, head_at(r, b, ds.goff), ds.goff);
  for (int gi = 0; gi < ds.bk / 4; ++gi)
    memcpy(out + ds.goff + gi * ds.gb, group_at(r, b, ds.goff, ds.gb, gi), ds.gb);
}

void scatter_block(const Desc& ds, const Ref& r, int64_t b, const uint8_t* in) {
  memcpy(const_cast<uint8_t*>(head_at(r, b, ds.goff)), in, ds.goff);
  for (int gi = 0; gi < ds.bk / 4; ++gi)
    memcpy(const_cast<uint8_t*>(group_at(r, b, ds.goff, ds.gb, gi)), in + ds.goff + gi * ds.gb,
           ds.gb);
}

// The end of the run of panels from p that direct products may take together: p's group,
// cut at p1.
inline int64_t group_end(int64_t p, int64_t p1) {
  const int64_t end = (p / GROUP + 1) * GROUP;
  return end < p1 ? end : p1;
}

// Whether the many-row int8 products (AVX-512 VNNI) fetch the next group of panels while
// their later passes read the current one from cache (CODESPEC_PREFETCH=0: not, for
// comparisons). The fetches make 8- and 16-token forwards a little faster and change
// nothing at 64 tokens.
inline bool prefetch_on() {
  static const bool on = [] {
    const char* e = std::getenv("CODESPEC_PREFETCH");
    return !(e && e[0] == '0');
  }();
  return on;
}

// Rows a pass of the AVX-512 VNNI products of 12 rows or more (v512::panels): 6 (two
// panels: 12 dot-product chains, against 8 with 4 rows; vpdpbusd takes 5 cycles and
// issues 2 a cycle on the Xeon measured), or CODESPEC_PASS_ROWS=4 (for comparisons; the
// same bits). On that Xeon (2 threads): a 128-token prefill chunk of the 0.5B 294 -> 282
// ms, 64 rows of Q4_K 4864 x 896 on one thread 2.31 -> 2.02 ms; 8 rows stay at 4 a pass
// (6 + 2 read the LM head's 145 MB twice: 8.1 -> 9.1 ms).
inline int64_t pass_rows() {
  static const int64_t r = [] {
    const char* e = std::getenv("CODESPEC_PASS_ROWS");
    return e && e[0] == '4' ? int64_t{4} : int64_t{6};
  }();
  return r;
}

// Blocks ahead (of a group of four panels) that the AVX-512 VNNI products of 1 to 4 rows
// and the AVX2 ones' one-row pass fetch while they stream the weights (0: none;
// CODESPEC_PREFETCH_AHEAD or cs_q_prefetch_ahead, for comparisons). Fetching 4 blocks
// ahead (3 and 6 do as well) makes decode steps and 4-token forwards faster at short and
// long contexts: the hardware prefetcher alone leaves the stream well below the bandwidth
// torch's products reach.
using qgp::g_prefetch_ahead;
inline int64_t prefetch_ahead() { return g_prefetch_ahead.load(std::memory_order_relaxed); }

// The few-row passes' fetch ahead: the `bytes` of a slice from f into L1, none past end.
inline void fetch_slice(const uint8_t* f, int64_t bytes, const uint8_t* end) {
#ifdef QG_X86
  for (int64_t o = 0; o < bytes && f + o < end; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(f + o), _MM_HINT_T0);
#else
  (void)f, (void)bytes, (void)end;
#endif
}

// The AVX2 int8 products of 1 + this many rows or more keep each panel's groups as the
// first row's pass expands them, for the passes of the rows after it (v256::panels_kept;
// 0: never; CODESPEC_EXPAND_ROWS or cs_q_expand_rows, for comparisons). The same
// integers, so the same bits. From the second row on: in process on a Zen 3 VM (0.5B
// forwards after 350 cached, every row's logits, 12 alternating rounds, medians), 2 rows
// 43.0 -> 38.4 ms, 3: 49.8 -> 45.0, 4: 54.2 -> 49.1, against keeping them from 9 rows on.
using qgp::g_expand_rows;

// The cache the many-row int8 products fetch the next group of panels into (Trickle): 2,
// L2 (prefetcht1, the default), or 1, L1 (prefetcht0; CODESPEC_PREFETCH_LEVEL or
// cs_q_prefetch_level, for comparisons). The group they read from cache meanwhile (39 KB
// for the LM head) does not fit L1 beside x, and fetching the next one into L1 pushes it
// out: into L2, the LM head's 8- and 16-row products and 8-token forwards are faster,
// 16-token forwards about the same.
using qgp::g_prefetch_level;

// Rows this many at a time in the scratch paths: x's slice stays in L2 (64 x K floats)
// while every panel is widened once for it.
constexpr int64_t ROW_CHUNK = 64;


float* scratch(int64_t floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(floats);
  return buf.data();
}

// One output: its sums in order, + bias, + res.
inline void put1(const Args& a, int64_t m, int64_t n, float acc) {
  if (a.bias) acc = acc + a.bias[n];
  if (a.res) acc = acc + a.res[m * a.ldr + n];
  a.y[m * a.ldy + n] = acc;
}

void panels_scalar(const Args& a, int64_t p0, int64_t p1) {
  Desc ds;
  desc_of(a.type, ds);
  const int64_t nb = a.K / ds.bk;
  float* S = scratch(a.K * 16);
  uint8_t blk[16 * 210];
  for (int64_t m0 = 0; m0 < a.M; m0 += ROW_CHUNK) {
    const int64_t m1 = a.M - m0 < ROW_CHUNK ? a.M : m0 + ROW_CHUNK;
    for (int64_t p = p0; p < p1; ++p) {
      const Ref r = ref_of(a, p, 16 * ds.native);
      for (int64_t b = 0; b < nb; ++b) {
        gather_block(ds, r, b, blk);
        widen_block_scalar(a.type, blk, S + b * ds.bk * 16);
      }
      const int64_t cols = a.N - 16 * p < 16 ? a.N - 16 * p : 16;
      for (int64_t m = m0; m < m1; ++m) {
        const float* xr = a.x + m * a.ldx;
        for (int64_t c = 0; c < cols; ++c) {
          float acc = 0.0f;
          for (int64_t k = 0; k < a.K; ++k) acc = std::fma(xr[k], S[16 * k + c], acc);
          put1(a, m, 16 * p + c, acc);
        }
      }
    }
  }
}

}  // namespace

#ifdef QG_EMIT_Z512
// =======================================================================================
// AVX-512 (F, BW, VL, DQ): one zmm = 16 columns.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace {
namespace z512 {

using V = __m512;
using I = __m512i;

inline V h16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Byte t of each 32-bit lane, zero-extended (pshufb indexes within each 128-bit lane).
template <int t>
inline I byte_u(I z) {
  const I idx = _mm512_set4_epi32(static_cast<int>(0x80808000u | (12 + t)),
                                  static_cast<int>(0x80808000u | (8 + t)),
                                  static_cast<int>(0x80808000u | (4 + t)),
                                  static_cast<int>(0x80808000u | t));
  return _mm512_shuffle_epi8(z, idx);
}

// Byte t of each 32-bit lane, sign-extended.
template <int t>
inline I byte_s(I z) {
  const I idx = _mm512_set4_epi32(static_cast<int>(0x00808080u | ((12u + t) << 24)),
                                  static_cast<int>(0x00808080u | ((8u + t) << 24)),
                                  static_cast<int>(0x00808080u | ((4u + t) << 24)),
                                  static_cast<int>(0x00808080u | (static_cast<unsigned>(t) << 24)));
  return _mm512_srai_epi32(_mm512_shuffle_epi8(z, idx), 24);
}

// Group g of four k: lane c = column c, byte t = its quant at k t (unsigned, Q8_0 signed).
template <int T>
inline I group(const uint8_t* g) {
  if constexpr (T == T_Q8_0) {
    return _mm512_loadu_si512(g);
  } else {
    I z = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
    const I sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    z = _mm512_and_si512(_mm512_srlv_epi16(z, sh), _mm512_set1_epi8(15));
    if constexpr (five_bit<T> || T == T_Q6_K)
      z = _mm512_mask_add_epi8(z, _cvtu64_mask64(rd64(g + 32)), z, _mm512_set1_epi8(16));
    if constexpr (T == T_Q6_K)
      z = _mm512_mask_add_epi8(z, _cvtu64_mask64(rd64(g + 40)), z, _mm512_set1_epi8(32));
    return z;
  }
}

template <int T, int t>
inline V quant(I z) {
  if constexpr (T == T_Q8_0) {
    return _mm512_cvtepi32_ps(byte_s<t>(z));
  } else if constexpr (T != T_Q6_K) {  // 4- and 5-bit quants
    // a table lookup instead of a conversion: vpermps reads the low 4 (vpermt2ps: 5) bits
    // of each lane, so byte t only needs shifting down, and the float comes out directly
    // (conversions share the FMA pipes on Zen 4; permutes do not)
    const V lo = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const I idx = t == 0 ? z : _mm512_srli_epi32(z, 8 * t);
    if constexpr (five_bit<T>) {
      const V hi = _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
      return _mm512_permutex2var_ps(lo, idx, hi);
    } else {
      return _mm512_permutexvar_ps(idx, lo);
    }
  } else {
    return _mm512_cvtepi32_ps(byte_u<t>(z));
  }
}

inline V neg(V v) { return _mm512_xor_ps(v, _mm512_set1_ps(-0.0f)); }

// Scale and offset vectors of sub-block j of panel block p (see scale_off).
template <int T>
inline void scales(const uint8_t* p, int j, V& sc, V& off) {
  const V d = h16(p);
  if constexpr (T == T_Q8_0) {
    sc = d;
    off = _mm512_setzero_ps();
  } else if constexpr (T == T_Q4_0) {
    sc = d;
    off = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
  } else if constexpr (T == T_Q5_0) {
    sc = d;
    off = _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
  } else if constexpr (T == T_Q4_1 || T == T_Q5_1) {
    sc = d;
    off = h16(p + 32);
  } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
    const uint8_t* s = p + 64 + 24 * j;
    const I a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    const I sc6 = _mm512_and_si512(a, _mm512_set1_epi32(63));
    const __m128i hb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i lo = _mm_and_si128(hb, _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(hb, 4), _mm_set1_epi8(15));
    const I mhi = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    const I mn6 = _mm512_or_si512(_mm512_slli_epi32(mhi, 2), _mm512_srli_epi32(a, 6));
    sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc6));
    off = neg(_mm512_mul_ps(h16(p + 32), _mm512_cvtepi32_ps(mn6)));
  } else {  // Q6_K
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * j));
    sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8)));
    off = _mm512_mul_ps(sc, _mm512_set1_ps(-32.0f));
  }
}

inline __mmask16 cols_mask(int64_t cols) {
  return cols >= 16 ? static_cast<__mmask16>(0xffff)
                    : static_cast<__mmask16>((1u << (cols > 0 ? cols : 0)) - 1);
}

inline void put(const Args& a, int64_t m, int64_t n, V v, __mmask16 mk) {
  if (a.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, a.bias + n));
  if (a.res) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, a.res + m * a.ldr + n));
  _mm512_mask_storeu_ps(a.y + m * a.ldy + n, mk, v);
}

// 16 columns for qgemm_exact.inc.cpp: one zmm.
using W = V;
using G = I;
inline W wzero() { return _mm512_setzero_ps(); }
inline W wset1(float f) { return _mm512_set1_ps(f); }
inline W wfma(W a, W b, W c) { return _mm512_fmadd_ps(a, b, c); }
inline W wload(const float* p) { return _mm512_loadu_ps(p); }
inline void wstore(float* p, W w) { _mm512_storeu_ps(p, w); }
template <int T, int t>
inline W wquant(G z) {
  return quant<T, t>(z);
}
inline void put16(const Args& a, int64_t m, int64_t n, W v, int64_t cols) {
  put(a, m, n, v, cols_mask(cols));
}

template <int T, int MR, int NP>
void direct_range(const Args& a, int64_t p0, int64_t p1);

// The direct path's passes for 1 to 8 rows: four panels a pass up to 4 rows, two beyond.
template <int T>
bool direct_panels(const Args& a, int64_t p0, int64_t p1) {
  switch (a.M) {
    case 1: direct_range<T, 1, 4>(a, p0, p1); return true;
    case 2: direct_range<T, 2, 4>(a, p0, p1); return true;
    case 3: direct_range<T, 3, 4>(a, p0, p1); return true;
    case 4: direct_range<T, 4, 4>(a, p0, p1); return true;
    case 5: direct_range<T, 5, 2>(a, p0, p1); return true;
    case 6: direct_range<T, 6, 2>(a, p0, p1); return true;
    case 7: direct_range<T, 7, 2>(a, p0, p1); return true;
    case 8: direct_range<T, 8, 2>(a, p0, p1); return true;
    default: return false;
  }
}

constexpr int SCRATCH_ROWS = 8;  // rows per pass over a widened panel (8 FMA chains)

#include "qgemm_exact.inc.cpp"

}  // namespace z512
}  // namespace
#pragma GCC pop_options
#ifdef QG_PART_AVX512
namespace qgp {
void* z512_panels(int t) { QG_PANELS_OF(z512, t) }
void z512_dequant(int t, const void* ref, int64_t K, float* out) {
  z512::dequant_panel(t, *static_cast<const Ref*>(ref), K, out);
}
}  // namespace qgp
#endif
#endif  // QG_EMIT_Z512

#ifdef QG_EMIT_Z256

// =======================================================================================
// AVX2 + FMA + F16C: two ymm = 16 columns (lo: columns 0-7, hi: 8-15).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace z256 {

using V = __m256;
using I = __m256i;

struct V2 {
  V lo, hi;
};
struct I2 {
  I lo, hi;
};

inline V h8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int t>
inline I byte_u(I z) {
  const I idx = _mm256_setr_epi32(
      static_cast<int>(0x80808000u | t), static_cast<int>(0x80808000u | (4 + t)),
      static_cast<int>(0x80808000u | (8 + t)), static_cast<int>(0x80808000u | (12 + t)),
      static_cast<int>(0x80808000u | t), static_cast<int>(0x80808000u | (4 + t)),
      static_cast<int>(0x80808000u | (8 + t)), static_cast<int>(0x80808000u | (12 + t)));
  return _mm256_shuffle_epi8(z, idx);
}

template <int t>
inline I byte_s(I z) {
  const I idx = _mm256_setr_epi32(
      static_cast<int>(0x00808080u | (static_cast<unsigned>(t) << 24)),
      static_cast<int>(0x00808080u | ((4u + t) << 24)),
      static_cast<int>(0x00808080u | ((8u + t) << 24)),
      static_cast<int>(0x00808080u | ((12u + t) << 24)),
      static_cast<int>(0x00808080u | (static_cast<unsigned>(t) << 24)),
      static_cast<int>(0x00808080u | ((4u + t) << 24)),
      static_cast<int>(0x00808080u | ((8u + t) << 24)),
      static_cast<int>(0x00808080u | ((12u + t) << 24)));
  return _mm256_srai_epi32(_mm256_shuffle_epi8(z, idx), 24);
}

// 32 bits -> 32 bytes, byte i = 0xff where bit i is set.
inline I bits_to_bytes(uint32_t bits) {
  const I idx = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                   0x0303030303030303LL);
  const I v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), idx);
  const I sel = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

template <int T>
inline I2 group(const uint8_t* g) {
  if constexpr (T == T_Q8_0) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32))};
  } else {
    const I v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g));
    const I m15 = _mm256_set1_epi8(15);
    I2 z = {_mm256_and_si256(v, m15), _mm256_and_si256(_mm256_srli_epi16(v, 4), m15)};
    if constexpr (five_bit<T> || T == T_Q6_K) {
      const uint64_t h = rd64(g + 32);
      const I b16 = _mm256_set1_epi8(16);
      z.lo = _mm256_or_si256(z.lo, _mm256_and_si256(bits_to_bytes(uint32_t(h)), b16));
      z.hi = _mm256_or_si256(z.hi, _mm256_and_si256(bits_to_bytes(uint32_t(h >> 32)), b16));
    }
    if constexpr (T == T_Q6_K) {
      const uint64_t h = rd64(g + 40);
      const I b32 = _mm256_set1_epi8(32);
      z.lo = _mm256_or_si256(z.lo, _mm256_and_si256(bits_to_bytes(uint32_t(h)), b32));
      z.hi = _mm256_or_si256(z.hi, _mm256_and_si256(bits_to_bytes(uint32_t(h >> 32)), b32));
    }
    return z;
  }
}

template <int T, int t>
inline V quant(I z) {
  if constexpr (T == T_Q8_0) return _mm256_cvtepi32_ps(byte_s<t>(z));
  else return _mm256_cvtepi32_ps(byte_u<t>(z));
}

inline V neg(V v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }

template <int T>
inline void scales(const uint8_t* p, int j, V2& sc, V2& off) {
  const V2 d = {h8(p), h8(p + 16)};
  if constexpr (T == T_Q8_0) {
    sc = d;
    off = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  } else if constexpr (T == T_Q4_0) {
    sc = d;
    const V m8 = _mm256_set1_ps(-8.0f);
    off = {_mm256_mul_ps(d.lo, m8), _mm256_mul_ps(d.hi, m8)};
  } else if constexpr (T == T_Q5_0) {
    sc = d;
    const V m16 = _mm256_set1_ps(-16.0f);
    off = {_mm256_mul_ps(d.lo, m16), _mm256_mul_ps(d.hi, m16)};
  } else if constexpr (T == T_Q4_1 || T == T_Q5_1) {
    sc = d;
    off = {h8(p + 32), h8(p + 48)};
  } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
    const uint8_t* s = p + 64 + 24 * j;
    const __m128i a16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const I alo = _mm256_cvtepu8_epi32(a16), ahi = _mm256_cvtepu8_epi32(_mm_srli_si128(a16, 8));
    const __m128i hb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i lo = _mm_and_si128(hb, _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(hb, 4), _mm_set1_epi8(15));
    const __m128i u = _mm_unpacklo_epi8(lo, hi);
    const I m63 = _mm256_set1_epi32(63);
    const I mlo =
        _mm256_or_si256(_mm256_slli_epi32(_mm256_cvtepu8_epi32(u), 2), _mm256_srli_epi32(alo, 6));
    const I mhi = _mm256_or_si256(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(u, 8)), 2),
                                  _mm256_srli_epi32(ahi, 6));
    sc = {_mm256_mul_ps(d.lo, _mm256_cvtepi32_ps(_mm256_and_si256(alo, m63))),
          _mm256_mul_ps(d.hi, _mm256_cvtepi32_ps(_mm256_and_si256(ahi, m63)))};
    const V2 dm = {h8(p + 32), h8(p + 48)};
    off = {neg(_mm256_mul_ps(dm.lo, _mm256_cvtepi32_ps(mlo))),
           neg(_mm256_mul_ps(dm.hi, _mm256_cvtepi32_ps(mhi)))};
  } else {  // Q6_K
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * j));
    sc = {_mm256_mul_ps(d.lo, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))),
          _mm256_mul_ps(d.hi, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))))};
    const V m32 = _mm256_set1_ps(-32.0f);
    off = {_mm256_mul_ps(sc.lo, m32), _mm256_mul_ps(sc.hi, m32)};
  }
}

// 16 outputs of row m from column n (fewer where the matrix ends: cols).
inline void put(const Args& a, int64_t m, int64_t n, V lo, V hi, int64_t cols) {
  if (cols >= 16) {
    if (a.bias) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(a.bias + n));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(a.bias + n + 8));
    }
    if (a.res) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(a.res + m * a.ldr + n));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(a.res + m * a.ldr + n + 8));
    }
    _mm256_storeu_ps(a.y + m * a.ldy + n, lo);
    _mm256_storeu_ps(a.y + m * a.ldy + n + 8, hi);
    return;
  }
  float v[16];
  _mm256_storeu_ps(v, lo);
  _mm256_storeu_ps(v + 8, hi);
  for (int64_t c = 0; c < cols; ++c) put1(a, m, n + c, v[c]);
}

// 16 columns for qgemm_exact.inc.cpp: two ymm (columns 0-7, 8-15).
using W = V2;
using G = I2;
inline W wzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline W wset1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline W wfma(W a, W b, W c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline W wload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void wstore(float* p, W w) {
  _mm256_storeu_ps(p, w.lo);
  _mm256_storeu_ps(p + 8, w.hi);
}
template <int T, int t>
inline W wquant(G z) {
  return {quant<T, t>(z.lo), quant<T, t>(z.hi)};
}
inline void put16(const Args& a, int64_t m, int64_t n, W v, int64_t cols) {
  put(a, m, n, v.lo, v.hi, cols);
}

template <int T, int MR, int NP>
void direct_range(const Args& a, int64_t p0, int64_t p1);

// The direct path's passes for 1 to 4 rows (16 ymm: four panels a pass for 1 or 2 rows).
template <int T>
bool direct_panels(const Args& a, int64_t p0, int64_t p1) {
  switch (a.M) {
    case 1: direct_range<T, 1, 4>(a, p0, p1); return true;
    case 2: direct_range<T, 2, 4>(a, p0, p1); return true;
    case 3: direct_range<T, 3, 2>(a, p0, p1); return true;
    case 4: direct_range<T, 4, 2>(a, p0, p1); return true;
    default: return false;
  }
}

constexpr int SCRATCH_ROWS = 4;  // 8 accumulators of the 16 registers

#include "qgemm_exact.inc.cpp"

}  // namespace z256
}  // namespace
#pragma GCC pop_options
#ifdef QG_PART_AVX2
namespace qgp {
void* z256_panels(int t) { QG_PANELS_OF(z256, t) }
void z256_dequant(int t, const void* ref, int64_t K, float* out) {
  z256::dequant_panel(t, *static_cast<const Ref*>(ref), K, out);
}
}  // namespace qgp
#endif
#endif  // QG_EMIT_Z256

#ifdef QG_BASE
namespace qgp {
std::atomic<int64_t> g_prefetch_ahead{[] {
  const char* e = std::getenv("CODESPEC_PREFETCH_AHEAD");
  return e ? static_cast<int64_t>(std::atoi(e)) : int64_t{4};
}()};
std::atomic<int64_t> g_expand_rows{[] {
  const char* e = std::getenv("CODESPEC_EXPAND_ROWS");
  return e ? static_cast<int64_t>(std::atoi(e)) : int64_t{1};
}()};
std::atomic<int32_t> g_prefetch_level{[] {
  const char* e = std::getenv("CODESPEC_PREFETCH_LEVEL");
  return e && e[0] == '1' ? 1 : 2;
}()};
}  // namespace qgp

namespace {

constexpr int ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_VNNI = 3;

bool isa_ok(int isa) {
  if (isa == ISA_SCALAR) return true;
#ifdef QG_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == ISA_AVX2) return avx2;
#endif
#ifdef QG_AVX512
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (isa == ISA_AVX512) return avx512;
  if (isa == ISA_AVX512_VNNI) return avx512 && __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

using PanelFn = void (*)(const Args&, int64_t, int64_t);

PanelFn pick(int isa, int t) {
#ifdef QG_AVX512
  if (isa >= ISA_AVX512) return reinterpret_cast<PanelFn>(qgp::z512_panels(t));
#endif
#ifdef QG_X86
  if (isa == ISA_AVX2) return reinterpret_cast<PanelFn>(qgp::z256_panels(t));
#endif
  (void)isa;
  (void)t;
  return panels_scalar;
}

void run(PanelFn fn, const Args& a, int64_t npanel, int64_t threads) {
  if (threads <= 1 || npanel < 2) {
    fn(a, 0, npanel);
    return;
  }
  if (threads > npanel) threads = npanel;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < threads; ++t) fn(a, npanel * t / threads, npanel * (t + 1) / threads);
}

}  // namespace

extern "C" {

int cs_q_version() { return 1; }

// Set how many blocks ahead the 1-4 row int8 products prefetch; returns the old value.
int64_t cs_q_prefetch_ahead(int64_t n) { return g_prefetch_ahead.exchange(n); }

// Set from how many rows after the first the AVX2 int8 products expand each panel once
// (0: never); returns the old value.
int64_t cs_q_expand_rows(int64_t n) { return g_expand_rows.exchange(n); }

// Set the cache level (1: L1, 2: L2) the many-row int8 products fetch the next group of
// panels into (g_prefetch_level); another value leaves it. Returns the old value.
int cs_q_prefetch_level(int level) {
  return level == 1 || level == 2 ? g_prefetch_level.exchange(level) : g_prefetch_level.load();
}

// Whether this CPU runs isa (0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512 F/BW/VL/DQ, 3 the same
// with VNNI).
int cs_q_isa_ok(int isa) { return isa_ok(isa) ? 1 : 0; }

// Bytes of one panel block / k per block for GGML type t; 0 for a type this file lacks.
int64_t cs_q_block_bytes(int t) {
  Desc d;
  return desc_of(t, d) ? 16 * d.native : 0;
}

int64_t cs_q_block_k(int t) {
  Desc d;
  return desc_of(t, d) ? d.bk : 0;
}

// GGUF rows (N x K / BK blocks of type t) -> panels (ceil(N / 16) x K / BK panel blocks).
void cs_q_pack(int t, const uint8_t* raw, int64_t N, int64_t K, uint8_t* out) {
  Desc ds;
  if (!desc_of(t, ds)) return;
  const int64_t nb = K / ds.bk, row = nb * ds.native, npanel = (N + 15) / 16;
  std::vector<Blk> col(16);
  std::vector<uint8_t> tmp(16 * ds.native);
  for (int64_t p = 0; p < npanel; ++p) {
    const Ref r = ref_of(out, npanel, nb * 16 * ds.native, p, 16 * ds.native);
    for (int64_t b = 0; b < nb; ++b) {
      for (int c = 0; c < 16; ++c) {
        const int64_t n = 16 * p + c;
        col[c] = Blk();
        if (n < N) decode_native(t, raw + n * row + b * ds.native, col[c]);
      }
      pack_block(t, col.data(), tmp.data());
      scatter_block(ds, r, b, tmp.data());
    }
  }
}

// The inverse: panels -> the N GGUF rows, byte for byte.
void cs_q_unpack(int t, const uint8_t* P, int64_t N, int64_t K, uint8_t* raw) {
  Desc ds;
  if (!desc_of(t, ds)) return;
  const int64_t nb = K / ds.bk, row = nb * ds.native, npanel = (N + 15) / 16;
  std::vector<Blk> col(16);
  std::vector<uint8_t> tmp(16 * ds.native);
  for (int64_t p = 0; p < npanel; ++p) {
    const Ref r = ref_of(P, npanel, nb * 16 * ds.native, p, 16 * ds.native);
    for (int64_t b = 0; b < nb; ++b) {
      gather_block(ds, r, b, tmp.data());
      unpack_block(t, tmp.data(), col.data());
      for (int c = 0; c < 16; ++c) {
        const int64_t n = 16 * p + c;
        if (n < N) encode_native(t, col[c], raw + n * row + b * ds.native);
      }
    }
  }
}

// Rows ids[0 .. n) of W, widened to fp32 into out (n x ldo): an embedding lookup from the
// blocks (the scalar widening, which every path equals). Rows outside 0 .. N-1 are zeros.
void cs_q_rows(int t, const uint8_t* P, int64_t N, int64_t K, const int64_t* ids, int64_t n,
               float* out, int64_t ldo) {
  Desc ds;
  if (!desc_of(t, ds)) return;
  const int64_t nb = K / ds.bk, npanel = (N + 15) / 16;
  std::vector<float> S(256 * 16);
  std::vector<uint8_t> tmp(16 * ds.native);
  for (int64_t i = 0; i < n; ++i) {
    float* o = out + i * ldo;
    const int64_t row = ids[i];
    if (row < 0 || row >= N) {
      memset(o, 0, K * sizeof(float));
      continue;
    }
    const Ref r = ref_of(P, npanel, nb * 16 * ds.native, row / 16, 16 * ds.native);
    for (int64_t b = 0; b < nb; ++b) {
      gather_block(ds, r, b, tmp.data());
      widen_block_scalar(t, tmp.data(), S.data());
      for (int k = 0; k < ds.bk; ++k) o[b * ds.bk + k] = S[16 * k + row % 16];
    }
  }
}

// The widened weights W[N][K] (fp32), by isa's widening code.
void cs_q_dequant(int t, const uint8_t* P, int64_t N, int64_t K, float* out, int isa) {
  Desc ds;
  if (!desc_of(t, ds)) return;
  const int64_t nb = K / ds.bk, npanel = (N + 15) / 16;
  std::vector<float> S(K * 16);
  std::vector<uint8_t> tmp(16 * ds.native);
  for (int64_t p = 0; p < npanel; ++p) {
    const Ref r = ref_of(P, npanel, nb * 16 * ds.native, p, 16 * ds.native);
#ifdef QG_AVX512
    if (isa >= ISA_AVX512) qgp::z512_dequant(t, &r, K, S.data());
    else
#endif
#ifdef QG_X86
    if (isa == ISA_AVX2) qgp::z256_dequant(t, &r, K, S.data());
    else
#endif
      for (int64_t b = 0; b < nb; ++b) {
        gather_block(ds, r, b, tmp.data());
        widen_block_scalar(t, tmp.data(), S.data() + b * ds.bk * 16);
      }
    for (int c = 0; c < 16 && 16 * p + c < N; ++c)
      for (int64_t k = 0; k < K; ++k) out[(16 * p + c) * K + k] = S[16 * k + c];
  }
}

// y[M, N] = x[M, K] @ W^T (+ bias) (+ res) with W the panels P of type t. threads > 1
// splits the panels between that many OpenMP threads (torch's pool: the library is
// loaded after torch and shares its libgomp). Returns 0, or -1 for an unknown type or
// an isa this CPU lacks.
int cs_qgemm(int t, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* P,
             int64_t N, float* y, int64_t ldy, const float* bias, const float* res,
             int64_t ldr, int64_t threads, int isa) {
  Desc ds;
  if (!desc_of(t, ds) || !isa_ok(isa) || K % ds.bk) return -1;
  Args a{x, M, K, ldx, P, N, y, ldy, bias, res, ldr, t, (K / ds.bk) * 16 * ds.native,
         (N + 15) / 16};
  PanelFn fn = pick(isa, t);
  if (!fn) return -1;
  run(fn, a, (N + 15) / 16, threads);
  return 0;
}

}  // extern "C"
#endif  // QG_BASE


// =======================================================================================
// cs_qgemm_i8: x rounded to int8 per 32 k, integer dot products (llama.cpp's way). Not
// exact: x's rounding error (up to half a step of max|x| / 127 per element) goes into
// every output. For a block with scale s (and min term o), one sub-block contributes
//   y += (s * dx) * float(sum_k q_k * xq_k - c * sum_k xq_k)   (c: 8 for Q4_0, 16 for Q5_0,
//                                                  32 for Q6_K, 128 for Q8_0's biased q)
//   y += o * (dx * float(sum_k xq_k))             (Q4_1's and Q5_1's m, K-quants' -dmin*m)
// in that order, sub-block after sub-block, for every M, thread count and ISA: the integer
// sums are exact and the float steps the same, so rows again equal one-row products and
// the paths agree bit for bit.
namespace {

struct Xq {
  std::vector<int8_t> q;     // M x K
  std::vector<float> dx;     // M x K/32: the step of each 32-block
  std::vector<float> ms;     // M x K/32: dx * float(sum of the block's q)
  std::vector<int32_t> s16;  // M x K/16: sums of q per 16
};

void size_xq(int64_t M, int64_t K, Xq& o) {
  o.q.resize(M * K);
  o.dx.resize(M * K / 32);
  o.ms.resize(M * K / 32);
  o.s16.resize(M * K / 16);
}

// Blocks [b0, b1) of x's M x K/32 blocks of 32 inputs (row i / (K/32), block i % (K/32)).
void quantize_blocks_scalar(const float* x, int64_t K, int64_t ldx, Xq& o, int64_t b0,
                            int64_t b1) {
  const int64_t nb = K / 32;
  for (int64_t i = b0; i < b1; ++i) {
    const int64_t m = i / nb, b = i % nb;
    const float* xb = x + m * ldx + 32 * b;
    float amax = 0.0f;
    for (int k = 0; k < 32; ++k) amax = std::fabs(xb[k]) > amax ? std::fabs(xb[k]) : amax;
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s[2] = {0, 0};
    for (int k = 0; k < 32; ++k) {
      float v = std::nearbyint(xb[k] * id);
      v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
      const int8_t q = static_cast<int8_t>(v);
      o.q[m * K + 32 * b + k] = q;
      s[k / 16] += q;
    }
    o.dx[m * nb + b] = d;
    o.ms[m * nb + b] = d * static_cast<float>(s[0] + s[1]);
    o.s16[m * (K / 16) + 2 * b] = s[0];
    o.s16[m * (K / 16) + 2 * b + 1] = s[1];
  }
}

struct ArgsI8 {
  Args a;
  const Xq* xq;
};

// The constant c of the formula above (per type) and whether a min term exists.
constexpr int i8_bias(int t) {
  return t == T_Q8_0 ? 128 : t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : t == T_Q6_K ? 32 : 0;
}
constexpr bool i8_min(int t) { return has_min(t); }

void panels_i8_scalar(const ArgsI8& ai, int64_t p0, int64_t p1) {
  const Args& a = ai.a;
  const Xq& xq = *ai.xq;
  Desc ds;
  desc_of(a.type, ds);
  const int64_t nb = a.K / ds.bk;
  const int c = a.type == T_Q8_0 ? 0 : i8_bias(a.type);  // Q8_0's q are used signed here
  std::vector<Blk> col(16);
  std::vector<uint8_t> tmp(16 * ds.native);
  std::vector<float> acc(a.M * 16);
  for (int64_t p = p0; p < p1; ++p) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      gather_block(ds, ref_of(a, p, 16 * ds.native), b, tmp.data());
      unpack_block(a.type, tmp.data(), col.data());
      for (int j = 0; j < ds.bk / ds.sub; ++j) {
        const int64_t k0 = b * ds.bk + j * ds.sub;
        for (int cc = 0; cc < 16; ++cc) {
          float scale, off;
          scale_off(a.type, col[cc], j, scale, off);
          for (int64_t m = 0; m < a.M; ++m) {
            const int8_t* xr = xq.q.data() + m * a.K + k0;
            int32_t dot = -c * xq.s16[m * (a.K / 16) + k0 / 16];
            if (ds.sub == 32) dot -= c * xq.s16[m * (a.K / 16) + k0 / 16 + 1];
            for (int i = 0; i < ds.sub; ++i) {
              const uint8_t v = col[cc].q[j * ds.sub + i];
              const int32_t q = a.type == T_Q8_0 ? static_cast<int8_t>(v) : v;
              dot += q * xr[i];
            }
            float& y = acc[m * 16 + cc];
            const float dx = xq.dx[m * (a.K / 32) + k0 / 32];
            y = std::fma(scale * dx, static_cast<float>(dot), y);
            if (i8_min(a.type)) y = std::fma(off, xq.ms[m * (a.K / 32) + k0 / 32], y);
          }
        }
      }
    }
    const int64_t cols = a.N - 16 * p < 16 ? a.N - 16 * p : 16;
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t cc = 0; cc < cols; ++cc) put1(a, m, 16 * p + cc, acc[m * 16 + cc]);
  }
}

}  // namespace

#ifdef QG_EMIT_V512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace {
namespace v512 {

using z512::V;
using z512::I;

inline int32_t rd32(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

// acc += the dot products of u's unsigned and s's signed bytes, four per lane: vpdpbusd
// written so that the sum stays in its register. With the intrinsic GCC 12 copies every
// sum to another register and back around each instruction (16 moves a group of four k
// in the 4-row x 2-panel pass below, twice the vpdpbusd).
inline I dpbusd(I acc, I u, I s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
// The same with s the 4 bytes at p in every lane, broadcast by the instruction's own
// memory operand ({1to16}) instead of a vpbroadcastd of its own.
inline I dpbusd_at(I acc, I u, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// The 4-bit types whose group is one vpandd: a group's 32 bytes hold columns 0-7 in their
// low nibbles and 8-15 in their high ones (lanes 8-15 of the broadcast); masking with 0xf0
// instead of shifting down leaves those quants 16 times too large, so their integer sums
// are 16 times too large (exactly: |sum| < 2^24) and their scales are taken 16 times
// smaller (exact: a power of two). (s / 16) * dx rounds to (s * dx) / 16 and the fma sees
// the same real product, so the outputs are those of the shifted quants bit for bit (short
// of a subnormal s * dx). The shift runs on the port the dot products need (SPR: vpsrlvw and
// vpdpbusd zmm on port 0).
template <int T>
constexpr bool high_x16 = T == T_Q4_0 || T == T_Q4_1 || T == T_Q4_K;

template <int T>
inline I group_i8(const uint8_t* g) {
  if constexpr (high_x16<T>) {
    const I z = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
    return _mm512_and_si512(z, _mm512_inserti64x4(_mm512_set1_epi8(15), _mm256_set1_epi8(-16), 1));
  } else if constexpr (T == T_Q8_0) {
    return _mm512_xor_si512(z512::group<T>(g), _mm512_set1_epi8(-128));
  } else {
    return z512::group<T>(g);
  }
}

// Lane j of the result: op over the 16 lanes of v[j] (max or add; exact for both: the
// order of a max does not matter, integer sums are exact). Four rounds of shuffles that
// halve the lanes each vector carries, 15 ops in all, where 16 horizontal reductions
// take ~8 dependent steps each and a move to a general register per sum (such moves take
// a large share of a quantization that reduces block by block). The rounds leave block j
// in lane `spread`[j] (quantize_blocks).
template <class Op>
inline V lanes_reduce(const V* v, Op op) {
  V a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j)
    a[j] = op(_mm512_shuffle_f32x4(v[j], v[j + 8], 0x44), _mm512_shuffle_f32x4(v[j], v[j + 8], 0xEE));
  for (int j = 0; j < 4; ++j)
    b[j] = op(_mm512_shuffle_f32x4(a[j], a[j + 4], 0x88), _mm512_shuffle_f32x4(a[j], a[j + 4], 0xDD));
  for (int j = 0; j < 2; ++j)
    c[j] = op(_mm512_shuffle_ps(b[j], b[j + 2], 0x44), _mm512_shuffle_ps(b[j], b[j + 2], 0xEE));
  return op(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

// quantize_blocks_scalar, 16 blocks a pass: the same fp32 steps, so the same bytes and
// scales. A block's index i is also where its step, ms and sums lie (dx[i], ms[i], s16[2i]),
// so 16 blocks' max |x| go into one vector (lanes_reduce) and their d = max / 127 and
// 1 / d are one division each (IEEE, as the scalar ones), where the AVX2 pass divides
// twice per block and adds its sums in scalar code (a visible part of a many-token
// forward's profile); the blocks' integer sums are reduced 16 at a time too.
void quantize_blocks(const float* x, int64_t K, int64_t ldx, Xq& o, int64_t b0, int64_t b1) {
  const V sign = _mm512_set1_ps(-0.0f), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  // lanes_reduce leaves block j in lane spread[j] (a permutation that is its own inverse)
  const I spread = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  // each block's two half sums side by side, blocks 0-7 then 8-15, from the reduced first
  // halves (indices 0-15) and second halves (16-31)
  const I pick01 = _mm512_setr_epi32(0, 16, 2, 18, 1, 17, 3, 19, 8, 24, 10, 26, 9, 25, 11, 27);
  const I pick23 = _mm512_setr_epi32(4, 20, 6, 22, 5, 21, 7, 23, 12, 28, 14, 30, 13, 29, 15, 31);
  const auto vmax = [](V p, V q) { return _mm512_max_ps(p, q); };
  const auto vadd = [](V p, V q) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_castps_si512(q)));
  };
  const int64_t nb = K / 32;
  for (int64_t i0 = b0; i0 < b1; i0 += 16) {
    const int64_t n = b1 - i0 < 16 ? b1 - i0 : 16;
    const __mmask16 mk = static_cast<__mmask16>((1u << n) - 1);
    const float* xs[16];
    V m[16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) {
        m[j] = _mm512_setzero_ps();
        continue;
      }
      const int64_t i = i0 + j;
      xs[j] = x + (i / nb) * ldx + 32 * (i % nb);
      m[j] = _mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(xs[j])),
                           _mm512_andnot_ps(sign, _mm512_loadu_ps(xs[j] + 16)));
    }
    const V amax = _mm512_permutexvar_ps(spread, lanes_reduce(m, vmax));
    const V d = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
    const V id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_OQ),
                                     _mm512_set1_ps(1.0f), d);
    alignas(64) float ids[16];
    _mm512_store_ps(ids, id);
    V qs[2][16];  // each block's int32 quants, per half (as float bits, for the shuffles)
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) {
        qs[0][j] = qs[1][j] = _mm512_setzero_ps();
        continue;
      }
      const int64_t i = i0 + j;
      const V idv = _mm512_set1_ps(ids[j]);
      for (int c = 0; c < 2; ++c) {
        V r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xs[j] + 16 * c), idv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        const I q = _mm512_cvtps_epi32(r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o.q.data() + (i / nb) * K + 32 * (i % nb) + 16 * c),
                         _mm512_cvtsepi32_epi8(q));
        qs[c][j] = _mm512_castsi512_ps(q);
      }
    }
    const I s_lo = _mm512_castps_si512(lanes_reduce(qs[0], vadd));
    const I s_hi = _mm512_castps_si512(lanes_reduce(qs[1], vadd));
    const I s01 = _mm512_permutex2var_epi32(s_lo, pick01, s_hi);  // blocks 0-7's halves
    const I s23 = _mm512_permutex2var_epi32(s_lo, pick23, s_hi);  // 8-15's
    // block j's two sums are s[2j], s[2j + 1]: add the pairs, in block order
    const I pairs = _mm512_permutex2var_epi32(
        _mm512_add_epi32(s01, _mm512_srli_epi64(s01, 32)),
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
        _mm512_add_epi32(s23, _mm512_srli_epi64(s23, 32)));
    _mm512_mask_storeu_ps(o.dx.data() + i0, mk, d);
    _mm512_mask_storeu_ps(o.ms.data() + i0, mk, _mm512_mul_ps(d, _mm512_cvtepi32_ps(pairs)));
    const __mmask16 lo8 = static_cast<__mmask16>(n >= 8 ? 0xffff : (1u << (2 * n)) - 1);
    const __mmask16 hi8 = static_cast<__mmask16>(n <= 8 ? 0 : (1u << (2 * (n - 8))) - 1);
    _mm512_mask_storeu_epi32(o.s16.data() + 2 * i0, lo8, s01);
    _mm512_mask_storeu_epi32(o.s16.data() + 2 * i0 + 16, hi8, s23);
  }
}

// Lines of the next group that a pass reading the current group from cache fetches as it
// goes: `step` cache lines per sub-block, from p up to end.
struct Trickle {
  const uint8_t* p;
  const uint8_t* end;
  int64_t step;
  bool l2;  // into L2 (g_prefetch_level), else L1
};

// MR rows (from m) x NP panels (from p, one group), integer dot products with vpdpbusd.
template <int T, int MR, int NP>
void direct(const ArgsI8& ai, int64_t m, int64_t p, Trickle* tr = nullptr) {
  using F = Tr<T>;
  const Args& a = ai.a;
  const Xq& xq = *ai.xq;
  constexpr int BYTES = 16 * F::NATIVE;
  V acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  const Ref pr = ref_of(a, p, BYTES);
  const int64_t nb = a.K / F::BK, k16 = a.K / 16, k32 = a.K / 32;
  const int64_t ahead = MR <= 4 && NP == 4 ? prefetch_ahead() : 0;
  const uint8_t* pend = a.P + a.npanel * a.pstride;
  // a whole group is one stream, read a sub-block's share of a block (`slice` bytes) at a
  // time: each sub-block fetches the slice `ahead` slices further on (a K-quant block of
  // 256 k is 8 slices: fetched whole, `ahead` blocks on, it ran far ahead in bursts)
  const int64_t slice = pr.bstride * F::SUB / F::BK;
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < F::BK / F::SUB; ++j) {
      const int64_t k0 = b * F::BK + j * F::SUB;
      if (ahead) fetch_slice(pr.base + b * pr.bstride + (j + ahead) * slice, slice, pend);
      if (tr)
        for (int64_t i = 0; i < tr->step && tr->p < tr->end; ++i, tr->p += 64) {
          if (tr->l2)
            _mm_prefetch(reinterpret_cast<const char*>(tr->p), _MM_HINT_T1);
          else
            _mm_prefetch(reinterpret_cast<const char*>(tr->p), _MM_HINT_T0);
        }
      V sc[NP], off[NP];
      for (int q = 0; q < NP; ++q) {
        z512::scales<T>(head_at(pr, b, F::GOFF, q), j, sc[q], off[q]);
        if constexpr (high_x16<T>)
          sc[q] = _mm512_mul_ps(sc[q], _mm512_insertf32x8(_mm512_set1_ps(1.0f),
                                                          _mm256_set1_ps(0.0625f), 1));
      }
      I dot[MR][NP];
      for (int r = 0; r < MR; ++r) {
        const int32_t* s = xq.s16.data() + (m + r) * k16 + k0 / 16;
        const int32_t sum = F::SUB == 32 ? s[0] + s[1] : s[0];
        I init = _mm512_set1_epi32(-i8_bias(T) * sum);
        if constexpr (high_x16<T> && i8_bias(T) != 0)
          init = _mm512_mask_mov_epi32(init, 0xff00, _mm512_set1_epi32(-16 * i8_bias(T) * sum));
        for (int q = 0; q < NP; ++q) dot[r][q] = init;
      }
      for (int g = 0; g < F::SUB / 4; ++g) {
        const int gi = j * (F::SUB / 4) + g;
        I z[NP];
        for (int q = 0; q < NP; ++q) z[q] = group_i8<T>(group_at(pr, b, F::GOFF, F::GB, gi, q));
        for (int r = 0; r < MR; ++r) {
          const int8_t* xp = xq.q.data() + (m + r) * a.K + k0 + 4 * g;
          for (int q = 0; q < NP; ++q) dot[r][q] = dpbusd_at(dot[r][q], z[q], xp);
        }
      }
      for (int r = 0; r < MR; ++r) {
        const V dx = _mm512_set1_ps(xq.dx[(m + r) * k32 + k0 / 32]);
        for (int q = 0; q < NP; ++q) {
          acc[r][q] = _mm512_fmadd_ps(_mm512_mul_ps(sc[q], dx), _mm512_cvtepi32_ps(dot[r][q]),
                                      acc[r][q]);
          if constexpr (i8_min(T))
            acc[r][q] = _mm512_fmadd_ps(off[q], _mm512_set1_ps(xq.ms[(m + r) * k32 + k0 / 32]),
                                        acc[r][q]);
        }
      }
    }
  }
  for (int q = 0; q < NP; ++q) {
    const __mmask16 mk = z512::cols_mask(a.N - 16 * (p + q));
    for (int r = 0; r < MR; ++r) z512::put(a, m + r, 16 * (p + q), acc[r][q], mk);
  }
}

template <int T, int MR, int NP>
void range(const ArgsI8& ai, int64_t m, int64_t p0, int64_t p1, Trickle* tr = nullptr) {
  for (int64_t p = p0; p < p1;) {
    const int64_t end = group_end(p, p1);
    for (; p + NP <= end; p += NP) direct<T, MR, NP>(ai, m, p, tr);
    // what is left of the group (a thread's share cut it) in one pass, not panel by panel:
    // a one-panel pass pays a sub-block's scales and float steps for 16 columns alone (a
    // hot spot in a profile of decode steps)
    if constexpr (NP == 4) {
      if (end - p == 3) direct<T, MR, 3>(ai, m, p, tr);
      else if (end - p == 2) direct<T, MR, 2>(ai, m, p, tr);
      else if (end - p == 1) direct<T, MR, 1>(ai, m, p, tr);
    } else {
      for (; p < end; ++p) direct<T, MR, 1>(ai, m, p, tr);
    }
    p = end;
  }
}

#include "qgemm_amx.inc.cpp"

template <int T>
void panels(const ArgsI8& ai, int64_t p0, int64_t p1) {
  const int64_t M = ai.a.M;
  if (amx_use<T>(M)) return amx_panels<T>(ai, p0, p1);  // the same bits on AMX tiles
  switch (M) {  // one pass: every panel of a group at once, read in storage order
    case 1: return range<T, 1, 4>(ai, 0, p0, p1);
    case 2: return range<T, 2, 4>(ai, 0, p0, p1);
    case 3: return range<T, 3, 4>(ai, 0, p0, p1);
    case 4: return range<T, 4, 4>(ai, 0, p0, p1);
    default: break;
  }
  // More rows: group by group (its bytes come from memory once, then from cache), four
  // rows x two panels a pass: faster than 4 x 4 (spills) and than 8 rows x 1 panel
  // (reads every fourth group of four k from memory, then the rest); from 12 rows six
  // (pass_rows).
  const int64_t R = M < 12 ? 4 : pass_rows();  // rows a pass
  const int64_t passes = (M + R - 1) / R;
  for (int64_t p = p0; p < p1;) {
    const int64_t end = group_end(p, p1);
    // The next group's bytes, fetched a slice before each pass that reads from cache (end
    // < p1: end is a group's first panel, group_end cut nothing).
    const uint8_t* next = end < p1 ? ai.a.P + end * ai.a.pstride : nullptr;
    const int64_t nbytes =
        next ? (ai.a.npanel - end < GROUP ? ai.a.npanel - end : GROUP) * ai.a.pstride : 0;
    for (int64_t m = 0; m < M; m += R) {
      // each later pass takes its slice of the next group a few lines per sub-block: issued
      // all at once before the pass, the fetches would wait on a full set of line-fill
      // buffers and stall the pass at its prefetch instructions
      Trickle tr{nullptr, nullptr, 0, true};
      if (m > 0 && next && prefetch_on()) {
        const int64_t s0 = nbytes * (m / R - 1) / (passes - 1);
        const int64_t s1 = nbytes * (m / R) / (passes - 1);
        const int64_t subs = (end - p + 1) / 2 * (ai.a.K / Tr<T>::SUB);  // this pass's
        const int64_t lines = (s1 - (s0 & ~int64_t{63}) + 63) / 64;
        tr = {next + (s0 & ~int64_t{63}), next + s1, (lines + subs - 1) / subs,
              g_prefetch_level.load(std::memory_order_relaxed) != 1};
      }
      switch (M - m < R ? M - m : R) {
        case 1: range<T, 1, 2>(ai, m, p, end, &tr); break;
        case 2: range<T, 2, 2>(ai, m, p, end, &tr); break;
        case 3: range<T, 3, 2>(ai, m, p, end, &tr); break;
        case 4: range<T, 4, 2>(ai, m, p, end, &tr); break;
        case 5: range<T, 5, 2>(ai, m, p, end, &tr); break;
        default: range<T, 6, 2>(ai, m, p, end, &tr); break;
      }
    }
    p = end;
  }
}

// The integer dot products' own rate, for the benchmarks' compute floor: `iters` rounds of
// 12 independent vpdpbusd (64 multiply-adds each), nothing else; the sum, so that the
// loop is kept. What the products above could reach were they nothing but dot products.
int64_t dot_peak(int64_t iters) {
  I a[12];
  for (auto& v : a) v = _mm512_set1_epi32(1);
  const I u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
  for (int64_t i = 0; i < iters; ++i)
    for (auto& v : a) v = dpbusd(v, u, s);
  I t = a[0];
  for (int j = 1; j < 12; ++j) t = _mm512_add_epi32(t, a[j]);
  return _mm512_reduce_add_epi32(t);
}

}  // namespace v512
}  // namespace
#pragma GCC pop_options

namespace qgp {
void* v512_panels(int t) { QG_PANELS_OF(v512, t) }
void* v512_quantize() { return reinterpret_cast<void*>(v512::quantize_blocks); }
int64_t v512_dot_peak(int64_t iters) { return v512::dot_peak(iters); }
int v512_amx(int on) {
  if (!v512::amx_granted()) return -1;
  return on == 0 || on == 1 ? v512::g_amx_on.exchange(on) : v512::g_amx_on.load();
}
}  // namespace qgp
#endif  // QG_EMIT_V512

#ifdef QG_EMIT_V256
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace v256 {

using z256::I;
using z256::I2;
using z256::V;
using z256::V2;

inline int32_t rd32(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

// quantize_blocks_scalar, 32 inputs a pass: the same fp32 steps (max |x|, d = max / 127, 1 / d,
// round half to even, clamp), so the same bytes and scales. Blocks [b0, b1) of the
// M x K/32 (threads split them).
void quantize_blocks(const float* x, int64_t K, int64_t ldx, Xq& o, int64_t b0, int64_t b1) {
  const V sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  const int64_t nb = K / 32;
  for (int64_t i = b0; i < b1; ++i) {
    const int64_t m = i / nb, b = i % nb;
    const float* xb = x + m * ldx + 32 * b;
    V v[4];
    V amax = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(xb + 8 * c);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
    }
    __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
    a4 = _mm_max_ss(a4, _mm_shuffle_ps(a4, a4, 1));
    const float d = _mm_cvtss_f32(a4) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const V idv = _mm256_set1_ps(id);
    I q32[4];
    for (int c = 0; c < 4; ++c) {
      V r = _mm256_round_ps(_mm256_mul_ps(v[c], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
      q32[c] = _mm256_cvtps_epi32(r);
    }
    int32_t t[16];  // the sums of the first and of the second 16 (exact in 32 bits)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t), _mm256_add_epi32(q32[0], q32[1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + 8), _mm256_add_epi32(q32[2], q32[3]));
    int32_t s0 = 0, s1 = 0;
    for (int k = 0; k < 8; ++k) {
      s0 += t[k];
      s1 += t[8 + k];
    }
    // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it
    const I p8 = _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]),
                                    _mm256_packs_epi32(q32[2], q32[3]));
    const I ord = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.q.data() + m * K + 32 * b), ord);
    o.dx[m * nb + b] = d;
    o.ms[m * nb + b] = d * static_cast<float>(s0 + s1);
    o.s16[m * (K / 16) + 2 * b] = s0;
    o.s16[m * (K / 16) + 2 * b + 1] = s1;
  }
}

// Groups of four k whose vpmaddubsw pair sums are added in 16 bits before widening to
// 32: a pair sum is at most 2 * qmax * 127 (qmax 15 for the 4-bit quants, 31 the 5-bit, 63
// Q6_K, 128 Q8_0's |q|), so 8, 4, 2 and 1 of them stay below 2^15. The sums are exact
// integers either way; only the instruction count changes.
template <int T>
constexpr int acc16() {
  return T == T_Q8_0 ? 1 : T == T_Q6_K ? 2 : five_bit<T> ? 4 : 8;
}

// acc += the 16 pair sums (16 bits) of four products per 32-bit lane, u8 quants z times
// s8 x (vpmaddubsw), in place: written by hand because GCC gives each sum a new register
// and a move back every group (6 of the 31 instructions of a 3-row group, which is bound
// by the front end's 6 a cycle).
inline void mul4_add(I& acc, I z, I xv) {
  I t;
  asm("vpmaddubsw %2, %3, %1\n\tvpaddw %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(xv), "x"(z));
}

// acc += the 32-bit pair-of-pairs sums of signed Q8_0 quants z (|z| in az) times x, in
// place: |z| * (x with z's sign) by vpmaddubsw, widened by vpmaddwd with ones.
inline void mul4_q8_add(I& acc, I az, I z, I xv, I ones) {
  I t;
  asm("vpsignb %3, %2, %1\n\t"
      "vpmaddubsw %1, %4, %1\n\t"
      "vpmaddwd %5, %1, %1\n\t"
      "vpaddd %1, %0, %0"
      : "+x"(acc), "=&x"(t)
      : "x"(xv), "x"(z), "x"(az), "x"(ones));
}

// MR rows x NP panels over all of K: per sub-block, exact integer dots (16-bit partial
// sums, acc16), then the float steps in the file's order. MR x NP is kept small so that
// the 16-bit sums, the quants and x fit AVX2's 16 registers (the float sums live across
// the sub-block loop and may spill: they are touched once a sub-block).
// With PRE (one panel), the panel's groups come expanded from zb instead of from its
// blocks (panels_kept); with KEEP (one row), each panel q's expanded groups are also
// stored at out + q * 16 * K, in PRE's layout, for the passes of the rows after it.
template <int T, int MR, int NP, bool PRE = false, bool KEEP = false>
void tile(const ArgsI8& ai, int64_t m, int64_t p, const uint8_t* zb = nullptr,
          uint8_t* out = nullptr) {
  using F = Tr<T>;
  static_assert(!PRE || (NP == 1 && T != T_Q8_0), "expanded groups: one panel, not Q8_0");
  static_assert(!KEEP || (!PRE && MR == 1 && T != T_Q8_0), "kept groups: one row, not Q8_0");
  const Args& a = ai.a;
  const Xq& xq = *ai.xq;
  constexpr int BYTES = 16 * F::NATIVE;
  constexpr int C = T == T_Q8_0 ? 0 : i8_bias(T);  // Q8_0 is dotted signed here
  constexpr int G = F::SUB / 4;                    // groups of four k per sub-block
  constexpr int A = acc16<T>() < G ? acc16<T>() : G;
  const I ones = _mm256_set1_epi16(1);
  V2 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const Ref pr = ref_of(a, p, BYTES);
  const int64_t nb = a.K / F::BK, k16 = a.K / 16, k32 = a.K / 32;
  const int8_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = xq.q.data() + (m + r) * a.K;
  // the one-row pass that streams a group of four panels fetches ahead as v512::direct
  // does (in process on a Zen 3 VM, 0.5B decode steps after 300 cached, 2 threads, 12
  // alternating pairs: 25.6 -> 24.1 ms median, 4 blocks ahead; 8 ahead was no better)
  const int64_t ahead = MR == 1 && NP == 4 ? prefetch_ahead() : 0;
  const uint8_t* pend = a.P + a.npanel * a.pstride;
  const int64_t slice = pr.bstride * F::SUB / F::BK;
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < F::BK / F::SUB; ++j) {
      const int64_t k0 = b * F::BK + j * F::SUB;
      if (ahead) fetch_slice(pr.base + b * pr.bstride + (j + ahead) * slice, slice, pend);
      I2 dot[MR][NP];
      for (int r = 0; r < MR; ++r) {
        const int32_t* s = xq.s16.data() + (m + r) * k16 + k0 / 16;
        const int32_t sum = F::SUB == 32 ? s[0] + s[1] : s[0];
        const I init = _mm256_set1_epi32(-C * sum);
        for (int q = 0; q < NP; ++q) dot[r][q] = {init, init};
      }
      if constexpr (T == T_Q8_0) {  // 32-bit sums a group, in place (see mul4_q8_add)
#pragma GCC unroll 1
        for (int g = 0; g < G; ++g) {
          const int gi = j * G + g;
          // |z| once a group for one panel; for four, at each row (16 ymm hold no more)
          I2 z[NP], az[NP];
          for (int q = 0; q < NP; ++q) {
            z[q] = z256::group<T>(group_at(pr, b, F::GOFF, F::GB, gi, q));
            if constexpr (NP == 1) az[q] = {_mm256_abs_epi8(z[q].lo), _mm256_abs_epi8(z[q].hi)};
          }
          for (int r = 0; r < MR; ++r) {
            const I xv = _mm256_set1_epi32(rd32(xr[r] + k0 + 4 * g));
            for (int q = 0; q < NP; ++q) {
              const I2 a = NP == 1 ? az[q] : I2{_mm256_abs_epi8(z[q].lo), _mm256_abs_epi8(z[q].hi)};
              mul4_q8_add(dot[r][q].lo, a.lo, z[q].lo, xv, ones);
              mul4_q8_add(dot[r][q].hi, a.hi, z[q].hi, xv, ones);
            }
          }
        }
      }
      for (int g0 = 0; g0 < (T == T_Q8_0 ? 0 : G); g0 += A) {  // the 16-bit sums' types
        I2 s16[MR][NP];
        for (int r = 0; r < MR; ++r)
          for (int q = 0; q < NP; ++q) s16[r][q] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 1  // unrolled, GCC keeps every product on the stack before summing
        for (int g = g0; g < g0 + A; ++g) {
          const int gi = j * G + g;
          I2 z[NP];
          if constexpr (PRE) {
            const I* e = reinterpret_cast<const I*>(zb + 64 * (b * (F::BK / 4) + gi));
            z[0] = {_mm256_loadu_si256(e), _mm256_loadu_si256(e + 1)};
          } else {
            for (int q = 0; q < NP; ++q) {
              z[q] = z256::group<T>(group_at(pr, b, F::GOFF, F::GB, gi, q));
              if constexpr (KEEP) {
                I* o = reinterpret_cast<I*>(out + q * 16 * a.K + 64 * (b * (F::BK / 4) + gi));
                _mm256_storeu_si256(o, z[q].lo);
                _mm256_storeu_si256(o + 1, z[q].hi);
              }
            }
          }
          for (int r = 0; r < MR; ++r) {
            const I xv = _mm256_set1_epi32(rd32(xr[r] + k0 + 4 * g));
            for (int q = 0; q < NP; ++q) {
              mul4_add(s16[r][q].lo, z[q].lo, xv);
              mul4_add(s16[r][q].hi, z[q].hi, xv);
            }
          }
        }
        for (int r = 0; r < MR; ++r)
          for (int q = 0; q < NP; ++q) {
            dot[r][q].lo = _mm256_add_epi32(dot[r][q].lo, _mm256_madd_epi16(s16[r][q].lo, ones));
            dot[r][q].hi = _mm256_add_epi32(dot[r][q].hi, _mm256_madd_epi16(s16[r][q].hi, ones));
          }
      }
      V2 sc[NP], off[NP];
      for (int q = 0; q < NP; ++q) z256::scales<T>(head_at(pr, b, F::GOFF, q), j, sc[q], off[q]);
      for (int r = 0; r < MR; ++r) {
        const V dx = _mm256_set1_ps(xq.dx[(m + r) * k32 + k0 / 32]);
        const V ms = _mm256_set1_ps(xq.ms[(m + r) * k32 + k0 / 32]);
        for (int q = 0; q < NP; ++q) {
          V2& y = acc[r][q];
          const V dlo = _mm256_cvtepi32_ps(dot[r][q].lo), dhi = _mm256_cvtepi32_ps(dot[r][q].hi);
          y.lo = _mm256_fmadd_ps(_mm256_mul_ps(sc[q].lo, dx), dlo, y.lo);
          y.hi = _mm256_fmadd_ps(_mm256_mul_ps(sc[q].hi, dx), dhi, y.hi);
          if constexpr (i8_min(T)) {
            y.lo = _mm256_fmadd_ps(off[q].lo, ms, y.lo);
            y.hi = _mm256_fmadd_ps(off[q].hi, ms, y.hi);
          }
        }
      }
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < MR; ++r)
      z256::put(a, m + r, 16 * (p + q), acc[r][q].lo, acc[r][q].hi, a.N - 16 * (p + q));
}

// Rows m .. m + MR - 1 over panels [p0, p1): NP panels of a group at a time (the weights
// stream once, in storage order).
template <int T, int MR, int NP>
void range(const ArgsI8& ai, int64_t m, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1;) {
    const int64_t end = group_end(p, p1);
    for (; p + NP <= end; p += NP) tile<T, MR, NP>(ai, m, p);
    for (; p < end; ++p) tile<T, MR, 1>(ai, m, p);
  }
}

// Rows 1 .. M - 1 of panel p, four a pass, then three, then pairs (see panels()); with
// PRE from its expanded groups zb.
template <int T, bool PRE>
void rows_after_first(const ArgsI8& ai, int64_t M, int64_t p, const uint8_t* zb) {
  int64_t m = 1;
  for (; M - m >= 4 && M - m != 5; m += 4) tile<T, 4, 1, PRE>(ai, m, p, zb);
  for (; M - m >= 3 && M - m != 4; m += 3) tile<T, 3, 1, PRE>(ai, m, p, zb);
  for (; m + 2 <= M; m += 2) tile<T, 2, 1, PRE>(ai, m, p, zb);
  if (m < M) tile<T, 1, 1, PRE>(ai, m, p, zb);
}

// Group by group, the first row's pass (four panels, or one, as range()) keeping each
// panel's expanded groups (z256::group: 64 bytes, the quants of 16 columns x 4 k) one
// after the other over all K in a buffer of this thread's; the rows after it read them
// from there: a pass of up to four rows would expand them again (Q5_0's bit plane costs
// ~14 instructions a group, against ~20 for four rows' products of it).
template <int T>
void panels_kept(const ArgsI8& ai, int64_t p0, int64_t p1) {
  const int64_t M = ai.a.M, K = ai.a.K;
  thread_local std::vector<uint8_t> buf;
  buf.resize(4 * 16 * K);  // four panels' K / 4 groups of 64 bytes
  for (int64_t p = p0; p < p1;) {
    const int64_t end = group_end(p, p1), first = p;
    for (; p + 4 <= end; p += 4) tile<T, 1, 4, false, true>(ai, 0, p, nullptr, buf.data());
    for (; p < end; ++p)
      tile<T, 1, 1, false, true>(ai, 0, p, nullptr, buf.data() + (p - first) * 16 * K);
    for (int64_t q = first; q < end; ++q)
      rows_after_first<T, true>(ai, M, q, buf.data() + (q - first) * 16 * K);
  }
}

template <int T>
void panels(const ArgsI8& ai, int64_t p0, int64_t p1) {
  const int64_t M = ai.a.M;
  if (M == 1) return range<T, 1, 4>(ai, 0, p0, p1);
  if (T == T_Q8_0 && M <= 8) {
    // Q8_0 gains nothing from 16-bit sums (acc16 1): up to 8 rows, group by group, two
    // rows x four panels a pass, the four panels read as one stream; beyond, as the other
    // types (for the LM head at 16 rows the other types' way is faster; at 2-8 rows it is
    // as fast or slower).
    for (int64_t p = p0; p < p1;) {
      const int64_t end = group_end(p, p1);
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) range<T, 2, 4>(ai, m, p, end);
      if (m < M) range<T, 1, 4>(ai, m, p, end);
      p = end;
    }
    return;
  }
  // Group by group: the first row with the group's four panels at once (its weights
  // stream from memory in storage order, as a one-row product's do), then the other rows
  // panel by panel, three a pass, from L1/L2. Were every pass to start panel by panel, it
  // would read a quarter of each cache line and wait on memory, slower at every row
  // count. Rows after the first go four at a
  // time (8 sums, 2 quant vectors, x, a product and the nibble mask: 13 of the 16 ymm),
  // then three, then pairs, never a lone row where a pair can be made (a pass's unpacking
  // is shared by its rows: a lone row pays it alone). Four rather than three a pass is
  // faster from cache at 8 to 17 rows; unrolling the group loop twice is slower. By
  // default (g_expand_rows) those passes read the groups the first row's expanded.
  const int64_t from = g_expand_rows.load(std::memory_order_relaxed);
  const bool pre = T != T_Q8_0 && from > 0 && M - 1 >= from;
  if constexpr (T != T_Q8_0)
    if (pre) return panels_kept<T>(ai, p0, p1);
  for (int64_t p = p0; p < p1;) {
    const int64_t end = group_end(p, p1);
    range<T, 1, 4>(ai, 0, p, end);
    for (; p < end; ++p) rows_after_first<T, false>(ai, M, p, nullptr);
  }
}

// dot_peak's AVX2 twin: 12 independent vpmaddubsw + vpaddw pairs (32 multiply-adds
// each), the products' own step (mul4_add).
int64_t dot_peak(int64_t iters) {
  I a[12];
  for (auto& v : a) v = _mm256_setzero_si256();
  const I u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(5);
  for (int64_t i = 0; i < iters; ++i)
    for (auto& v : a) mul4_add(v, u, s);
  I t = a[0];
  for (int j = 1; j < 12; ++j) t = _mm256_add_epi16(t, a[j]);
  alignas(32) int16_t out[16];
  _mm256_store_si256(reinterpret_cast<I*>(out), t);
  int64_t sum = 0;
  for (int16_t v : out) sum += v;
  return sum;
}

}  // namespace v256
}  // namespace
#pragma GCC pop_options

namespace qgp {
void* v256_panels(int t) { QG_PANELS_OF(v256, t) }
void* v256_quantize() { return reinterpret_cast<void*>(v256::quantize_blocks); }
int64_t v256_dot_peak(int64_t iters) { return v256::dot_peak(iters); }
}  // namespace qgp
#endif  // QG_EMIT_V256

#ifdef QG_BASE
namespace {

using PanelFnI8 = void (*)(const ArgsI8&, int64_t, int64_t);
using QuantFn = void (*)(const float*, int64_t, int64_t, Xq&, int64_t, int64_t);

QuantFn pick_quant(int isa) {
#ifdef QG_X86
#ifdef QG_AVX512
  if (isa == ISA_AVX512_VNNI) return reinterpret_cast<QuantFn>(qgp::v512_quantize());
#endif
  if (isa == ISA_AVX2) return reinterpret_cast<QuantFn>(qgp::v256_quantize());
#endif
  (void)isa;
  return quantize_blocks_scalar;
}

PanelFnI8 pick_i8(int isa, int t) {
#ifdef QG_AVX512
  if (isa == ISA_AVX512_VNNI) return reinterpret_cast<PanelFnI8>(qgp::v512_panels(t));
#endif
#ifdef QG_X86
  if (isa == ISA_AVX2) return reinterpret_cast<PanelFnI8>(qgp::v256_panels(t));
#endif
  (void)isa;
  (void)t;
  return panels_i8_scalar;
}

// A matrix's arguments and panel function for the int8 product; false for an unknown
// type, K not a whole number of its blocks (and of 32) or no path for isa.
bool i8_matrix(int t, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* P,
               int64_t N, float* y, int64_t ldy, const float* bias, const float* res,
               int64_t ldr, const Xq* xq, int isa, ArgsI8& ai, PanelFnI8& fn) {
  Desc ds;
  if (!desc_of(t, ds) || K % ds.bk || K % 32) return false;
  fn = pick_i8(isa, t);
  ai = ArgsI8{{x, M, K, ldx, P, N, y, ldy, bias, res, ldr, t, (K / ds.bk) * 16 * ds.native,
               (N + 15) / 16},
              xq};
  return fn != nullptr;
}

// The calling thread's reused quantization buffer (a forward makes ~150 products). Take
// it before a parallel region and share the reference: inside the region the name would
// be each worker thread's own (empty) buffer.
Xq& thread_buffer() {
  thread_local Xq buffer;
  return buffer;
}

}  // namespace

extern "C" {

// The many-row int8 products' AMX path (qgemm_amx.inc.cpp; the same bits as without it):
// on (1) or off (0), or -1 to ask. Returns the old setting, or -1 where this CPU or the
// kernel offers no AMX-INT8 (then nothing changes).
int cs_q_amx(int on) {
#ifdef QG_AVX512
  return qgp::v512_amx(on);
#else
  (void)on;
  return -1;
#endif
}

// The int8 product in steps, for a caller that shares the work out itself inside its own
// parallel region (the lean stack's one region per forward): cs_qgemm_i8_buffer gives the
// calling thread's reused buffer sized for M rows of up to K inputs (call it before the
// region and share the pointer); cs_qgemm_i8_quantize puts rows [m0, m1) of x into it;
// cs_qgemm_i8_panels computes panels [p0, p1) of one matrix's product from it (then
// nothing may quantize into the buffer until every thread's panels are done). The same
// numbers as cs_qgemm_i8.
void* cs_qgemm_i8_buffer(int64_t M, int64_t K) {
  Xq& buffer = thread_buffer();
  size_xq(M, K, buffer);
  return &buffer;
}

void cs_qgemm_i8_quantize(void* xq, const float* x, int64_t K, int64_t ldx, int64_t m0,
                          int64_t m1, int isa) {
  if (m1 > m0) pick_quant(isa)(x, K, ldx, *static_cast<Xq*>(xq), m0 * (K / 32), m1 * (K / 32));
}

int cs_qgemm_i8_panels(const void* xq, int t, int64_t M, int64_t K, const uint8_t* P, int64_t N,
                       float* y, int64_t ldy, const float* bias, const float* res, int64_t ldr,
                       int64_t p0, int64_t p1, int isa) {
  ArgsI8 ai;
  PanelFnI8 fn;
  if (!i8_matrix(t, nullptr, M, K, 0, P, N, y, ldy, bias, res, ldr, static_cast<const Xq*>(xq),
                 isa, ai, fn))
    return -1;
  if (p1 > p0) fn(ai, p0, p1);
  return 0;
}

// The int8-activation product (see above): isa 0 scalar, 1 AVX2, 3 AVX-512 VNNI (2, plain
// AVX-512, is refused: it has no integer dot product worth using). Returns 0, or -1.
int cs_qgemm_i8_many(int64_t n, const int* types, const float* x, int64_t M, int64_t K,
                     int64_t ldx, const uint8_t* const* P, const int64_t* N, float* y,
                     int64_t ldy, const float* const* bias, const float* res, int64_t ldr,
                     int64_t threads, int isa);

int cs_qgemm_i8(int t, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* P,
                int64_t N, float* y, int64_t ldy, const float* bias, const float* res,
                int64_t ldr, int64_t threads, int isa) {
  return cs_qgemm_i8_many(1, &t, x, M, K, ldx, &P, &N, y, ldy, &bias, res, ldr, threads, isa);
}

// n products of the same rows x side by side: y[:, c_i .. c_i + N_i] = x @ W_i^T (+ bias_i)
// (+ res[:, c_i ..]), c_i the sum of the N before it (q, k and v; gate and up). x is
// quantized once and every matrix's panels are shared out in one parallel region: a
// region costs a wake-up of the sleeping threads, and a forward would open ~240 of them.
// Each output equals cs_qgemm_i8's for its matrix alone. Returns 0, or -1.
int cs_qgemm_i8_many(int64_t n, const int* types, const float* x, int64_t M, int64_t K,
                     int64_t ldx, const uint8_t* const* P, const int64_t* N, float* y,
                     int64_t ldy, const float* const* bias, const float* res, int64_t ldr,
                     int64_t threads, int isa) {
  constexpr int64_t MOST = 8;
  if (n < 1 || n > MOST || !isa_ok(isa) || isa == ISA_AVX512 || K % 32) return -1;
  Xq* const xp = &thread_buffer();
  ArgsI8 ai[MOST];
  PanelFnI8 fn[MOST];
  int64_t most = 0, col = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!i8_matrix(types[i], x, M, K, ldx, P[i], N[i], y + col, ldy, bias[i],
                   res ? res + col : nullptr, ldr, xp, isa, ai[i], fn[i]))
      return -1;
    most = ai[i].a.npanel > most ? ai[i].a.npanel : most;
    col += N[i];
  }
  size_xq(M, K, *xp);
  QuantFn quant = pick_quant(isa);
  const int64_t nblk = M * (K / 32);
  if (threads > most) threads = most;
  if (threads <= 1) {
    quant(x, K, ldx, *xp, 0, nblk);
    for (int64_t i = 0; i < n; ++i) fn[i](ai[i], 0, ai[i].a.npanel);
    return 0;
  }
  // one parallel region: the rows' blocks quantized, then (after the loop's barrier) each
  // matrix's panels shared out, one matrix after the other with no barrier between
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < threads; ++i)
      quant(x, K, ldx, *xp, nblk * i / threads, nblk * (i + 1) / threads);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < threads; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const int64_t np = ai[j].a.npanel;
        fn[j](ai[j], np * i / threads, np * (i + 1) / threads);
      }
  }
  return 0;
}

// Multiply-adds per second (in billions) of the int8 products' dot product instruction on
// `threads` threads at once, isa 1 (AVX2 vpmaddubsw) or 3 (AVX-512 VNNI vpdpbusd), the best
// of `rounds` runs of `iters` rounds each: the compute floor `codespec bench runner` sets a
// verification against. 0 where the isa is not available here.
double cs_qgemm_i8_peak(int isa, int64_t threads, int64_t iters, int64_t rounds) {
#ifdef QG_X86
  const auto dot_peak = [](int i, int64_t n) {
#ifdef QG_AVX512
    if (i == ISA_AVX512_VNNI) return qgp::v512_dot_peak(n);
#endif
    (void)i;
    return qgp::v256_dot_peak(n);
  };
  if (!isa_ok(isa) || (isa != ISA_AVX2 && isa != ISA_AVX512_VNNI) || threads < 1 || iters < 1)
    return 0.0;
  const double per_iter = isa == ISA_AVX512_VNNI ? 12.0 * 64 : 12.0 * 32;
  double best = 0.0;
  std::atomic<int64_t> sink{0};
  for (int64_t r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(static_cast<int>(threads))
    sink += dot_peak(isa, iters);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double rate = per_iter * static_cast<double>(iters) * static_cast<double>(threads) / s;
    if (s > 0 && rate > best) best = rate;
  }
  return best / 1e9;  // (sink, an atomic, keeps the loops)
#else
  (void)isa, (void)threads, (void)iters, (void)rounds;
  return 0.0;
#endif
}

}  // extern "C"
#endif  // QG_BASE
