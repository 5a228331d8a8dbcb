// The lean runner's whole decoder stack in one call (codespec.daemon.engine.qstack): the
// embedding lookup, every layer (RMSNorm, q/k/v products, RoPE, the fp16 KV cache write,
// grouped-query attention over the cache, o, gate/up, SiLU, down, residuals) and the final
// norm and LM head, for T tokens appended after `past` cached ones. One ctypes call per
// forward: from Python, a dozen or more calls a layer would spend as much time on dispatch
// as the products themselves take.
//
// Products go to the GGUF block kernel (cs_qgemm, qgemm.cpp, built into the same library)
// or, for 16/32-bit panels, to cpu_gemm's cs_gemm* through function pointers the caller
// hands in: both sum each output over k in order, so their rows equal one-row products.
//
// KV cache, per layer: K as (KV, S_max / 16, D, 16) fp16 tiles (16 keys side by side, so a
// score tile is D broadcast FMAs) then V as (KV, S_max, Dp) fp16 rows (Dp: D rounded up
// to 16). Values are clamped to fp16's range before rounding, so the cache holds no inf.
// With bf16 attention (Model::att, ATT_BF16) the same bytes hold bf16 in pairs, what one
// vdpbf16ps lane reads: K as (KV, S_max / 16, D / 2, 16, 2) (a tile's 16 keys, two dims
// each) and V as (KV, S_max / 2, Dp, 2) (two keys' values of each dim); see k_at / v_at.
//
// Attention: each query row attends to its key list, the cached keys then the new keys it
// sees (itself and its ancestors, in order). The list is cut into chunks of CHUNK keys;
// a chunk gives the row (max score, sum of exps, weighted values), and the chunks are
// merged in order. Nothing depends on which other rows share a call, on the threads or
// on the ISA: a tree or chain row equals the decode step at its place bit for bit.
// Chunks are spread over OpenMP threads (torch's pool, as in qgemm.cpp).
#include <stdint.h>
#include <string.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <thread>
#include <vector>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LS_X86 1
#endif
// QG_NO_AVX512 (the quantized kernel's build for a CPU without AVX-512F, qgemm.cpp)
// leaves the AVX-512 stack (z5) out here too: such a CPU never runs it.
#if defined(LS_X86) && !defined(QG_NO_AVX512)
#define LS_AVX512 1
#endif

extern "C" {
int cs_qgemm(int t, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* P,
             int64_t N, float* y, int64_t ldy, const float* bias, const float* res,
             int64_t ldr, int64_t threads, int isa);
void cs_q_rows(int t, const uint8_t* P, int64_t N, int64_t K, const int64_t* ids, int64_t n,
               float* out, int64_t ldo);
int cs_q_isa_ok(int isa);
int cs_qgemm_i8_many(int64_t n, const int* types, const float* x, int64_t M, int64_t K,
                     int64_t ldx, const uint8_t* const* P, const int64_t* N, float* y,
                     int64_t ldy, const float* const* bias, const float* res, int64_t ldr,
                     int64_t threads, int isa);
int cs_qgemm_i8(int t, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* P,
                int64_t N, float* y, int64_t ldy, const float* bias, const float* res,
                int64_t ldr, int64_t threads, int isa);
void* cs_qgemm_i8_buffer(int64_t M, int64_t K);
void cs_qgemm_i8_quantize(void* xq, const float* x, int64_t K, int64_t ldx, int64_t m0,
                          int64_t m1, int isa);
int cs_qgemm_i8_panels(const void* xq, int t, int64_t M, int64_t K, const uint8_t* P, int64_t N,
                       float* y, int64_t ldy, const float* bias, const float* res, int64_t ldr,
                       int64_t p0, int64_t p1, int isa);
}

namespace {

constexpr int64_t CHUNK = 128;    // keys per softmax chunk
constexpr int64_t MAX_DP = 256;   // the largest head dimension (rounded up to 16)
constexpr int64_t TOKENS = 8;     // tokens per shared attention task
// Cache lines ahead that attention's first pass over a chunk fetches its keys and values
// (0: none; CODESPEC_ATT_AHEAD or cs_lean_att_ahead, for comparisons). 64 lines make
// decode steps and verifications over long caches faster, fewer or more lines less so,
// and prefetcht1 is no faster: the hardware prefetcher alone leaves a long cache's read
// slow.
std::atomic<int64_t> g_att_ahead{[] {
  const char* e = std::getenv("CODESPEC_ATT_AHEAD");
  return e ? static_cast<int64_t>(std::atoi(e)) : int64_t{64};
}()};

// Lines of the chunk of its thread's next task that a team-path attention task of several
// passes fetches at each step of its dot loops (Ahead::then), so that those keys and values
// arrive while this task computes (0: none, that task's own first pass fetches them as
// they are read; CODESPEC_ATT_LEAD or cs_lean_att_lead, for comparisons). One line a step
// makes 8- and 16-token forwards over long caches faster, 2 or 4 lines no more so. A
// decode step (one pass) fetches nothing this way.
std::atomic<int32_t> g_att_lead{[] {
  const char* e = std::getenv("CODESPEC_ATT_LEAD");
  return e ? std::max(0, std::atoi(e)) : 1;
}()};

std::atomic<int64_t> g_att_led{0};  // lines fetched so (cs_lean_att_led)
// Keys a tree token's own attention tasks copied into K tiles (cs_lean_att_gathered): only
// the tiles holding keys it sees. Copying whole 128-key chunks would make a tree's
// forward markedly slower than a chain's of the same length; with this they are close.
std::atomic<int64_t> g_att_gathered{0};

// Whether bf16 attention uses the CPU's own bf16 dot products (AVX512-BF16) where it has
// them; else FMAs give the same numbers (CODESPEC_BF16_DOTS=emulate, or
// cs_lean_bf16_native(0), for comparisons and tests).
bool bf16_cpu() {
#ifdef LS_X86
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}
std::atomic<int32_t> g_bf16_native{[] {
  const char* e = std::getenv("CODESPEC_BF16_DOTS");
  return bf16_cpu() && !(e && strcmp(e, "emulate") == 0) ? 1 : 0;
}()};

// Two threads' shares of a forward's products: thread 0 takes this fraction of each
// matrix's panels, thread 1 the rest. With fixed halves the faster core would wait for
// the slower one at every barrier after a product (in a VM the two cores' speed differs,
// and which one is faster changes from run to run). After each two-thread forward the
// fraction moves halfway to the one that would have balanced the time each thread spent
// in the products (clamped to 0.25-0.75). Which thread computes a panel changes no number.
// CODESPEC_SPLIT_ADAPT=0 or cs_lean_split_adapt(0): halves (for comparisons).
// Forwards shared out by rows (g_row_split) cut their tokens by a fraction of their own,
// g_split_rows, moved only by such forwards: with one fraction for both, each decode
// step's product balance would move the next verification's cut away from its own
// balance.
std::atomic<double> g_split{0.5};
std::atomic<double> g_split_rows{0.5};
std::atomic<int> g_split_adapt{[] {
  const char* e = std::getenv("CODESPEC_SPLIT_ADAPT");
  return e && e[0] == '0' ? 0 : 1;
}()};

// The fraction `split` holds for the next forward from this one's: thread 0 did f of the
// work in t0 ns, thread 1 the rest in t1.
void split_after(std::atomic<double>& split, double f, int64_t t0, int64_t t1) {
  if (!g_split_adapt.load(std::memory_order_relaxed) || t0 <= 0 || t1 <= 0) return;
  const double v0 = f / static_cast<double>(t0), v1 = (1.0 - f) / static_cast<double>(t1);
  double next = f + 0.5 * (v0 / (v0 + v1) - f);
  next = next < 0.25 ? 0.25 : next > 0.75 ? 0.75 : next;
  split.store(next, std::memory_order_relaxed);
}

// From how many tokens a forward's layers are shared out by rows instead of by panels
// (forward_team): each thread runs its own tokens through every product (all panels, so
// each reads the whole weights; the two read a layer's within microseconds of each other,
// the second from L3) and, before each layer's attention, waits for the threads before it
// to have stored that layer's keys (Progress: its tokens see theirs), instead of meeting
// the other ~11 times a layer. With panels, every step's output is written by
// both threads and read by both, so each row's data crosses between the cores at every
// step, and a many-token forward spends a sizeable share of its time at the barriers
// and quantizing x into lines the other core has just read. One token (decode) has no
// rows to share. CODESPEC_ROW_SPLIT=N (0: never) or cs_lean_row_split(N); the engine
// sets it from its own timings when it loads a model (engine/row_split.py, calibrate:
// which way wins depends on the machine). Which thread computes a row changes no number.
std::atomic<int64_t> g_row_split{[] {
  const char* e = std::getenv("CODESPEC_ROW_SPLIT");
  return e ? static_cast<int64_t>(std::atoll(e)) : static_cast<int64_t>(8);
}()};

std::atomic<int64_t> g_row_forwards{0};  // forwards shared out so (cs_lean_row_forwards)

// Whether a forward of T tokens on `threads` threads is shared out by rows (g_row_split).
inline bool by_rows(int64_t T, int64_t threads) {
  const int64_t row_min = g_row_split.load(std::memory_order_relaxed);
  return threads > 1 && row_min > 0 && T >= row_min && T >= threads;
}

// Lines of the cache to prefetch: a range of 64-byte lines, then a second one (a chunk's
// K tiles, then its V rows; each contiguous in the cache).
struct Lines {
  const char* p = nullptr;
  const char* end = nullptr;
  const char* p2 = nullptr;
  const char* end2 = nullptr;
  inline bool empty() const { return p >= end; }
  inline int64_t count() const {  // lines left
    return empty() ? 0 : (end - p + 63) / 64 + (p2 < end2 ? (end2 - p2 + 63) / 64 : 0);
  }
  inline void fetch() {  // the next line (not empty())
    __builtin_prefetch(p, 0, 3);
    p += 64;
    if (p >= end) {
      p = p2;
      end = end2;
      p2 = end2 = nullptr;
    }
  }
};

// Attention's software prefetch, stepped by its dot loops: step(n) fetches the next n lines
// of `own` (the chunk the task reads, `ahead` lines past what the kernel reads, during its
// first pass) and `rate` lines of `then` (the chunk of the thread's next task, along all
// the passes of a task that has several: its keys and values arrive while this task
// computes).
struct Ahead {
  Lines own, then;
  int rate = 0;  // lines of `then` a step
  inline void step(int n) {
    for (int i = 0; i < n && !own.empty(); ++i) own.fetch();
    for (int i = 0; i < rate && !then.empty(); ++i) then.fetch();
  }
};
// A chain's first logit rows under Fwd::stop: the LM head costs about its bytes' read time
// up to ~4 rows on 2 AVX2 cores, and more with every row beyond.
constexpr int64_t STOP_ROWS = 4;
constexpr int64_t THREADED_WEIGHTS = 1 << 16, THREADED_ROWS = 8;  // as cpu_gemm.py

// A weight matrix: kind >= 0 a GGML block type (qgemm panels, n x k), -1 / -2 / -3 fp32 /
// fp16 / bf16 cpu_gemm panels (k x n). As an embedding, -1 / -2 / -3 mean a dense (n, k)
// row-major table of that type.
struct Mat {
  int32_t kind, pad;
  const void* p;
  int64_t n, k;
  const float* bias;
};

struct Layer {
  const float* ln1;
  const float* ln2;
  int64_t nqkv;  // 1 (fused) or 3 matrices, written side by side
  Mat qkv[3];
  Mat o;
  int64_t ngu;  // 1 (fused) or 2
  Mat gu[2];
  Mat down;
};

using GemmFn = void (*)(const float*, int64_t, int64_t, int64_t, const void*, int64_t, float*,
                        int64_t, const float*, const float*, int64_t, int64_t);

struct Model {
  int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, rope_len;
  float eps;
  int32_t int8;  // block products the llama.cpp way (cs_qgemm_i8: x rounded to int8)
  int32_t att;   // ATT_FP32 (fp16 cache) or ATT_BF16 (bf16 cache, bf16 dot products)
  int32_t pad;
  const float* norm;
  const float* cos;  // (rope_len, D)
  const float* sin;  // (rope_len, D), the first half negated
  Mat embed, head;
  const Layer* layer;
  GemmFn gemm[3];  // fp32, fp16, bf16 panel products
};

// One forward: T tokens `ids` at positions `pos`, after `past` cached ones; anc (T x T,
// row t: the new tokens t sees, itself included) or null for a chain. Logits of rows
// first .. T-1 go to logits; hidden (T, ntaps, H) gets the taps (0: embeddings, l: the
// output of layer l). stop (a chain or tree verified greedily, first 0): logits are
// computed STOP_ROWS rows first, then the rest, and not past the chunk holding the row
// where greedy verification's walk ends (walk_ends): it reads no other row. The forward
// then returns the rows it computed.
struct Fwd {
  int64_t T, past, s_max, first, threads, ntaps;
  int32_t isa, stop;
  const int64_t* ids;
  const int64_t* pos;
  const uint8_t* anc;
  uint16_t* kv;
  const int64_t* taps;
  float* hidden;
  float* logits;
  int64_t* best;  // or null: each logit row's argmax (torch's choice), for greedy verification
  // Or null: a flag another thread may set while the forward runs (a request came in
  // behind a warm-up); read between layers, and once set the forward stops there and
  // returns INTERRUPTED with no logits: its keys past `past` are not part of the cache.
  const int32_t* interrupt;
};

constexpr int INTERRUPTED = -4;

inline bool interrupted(const Fwd& f) {
  return f.interrupt && __atomic_load_n(f.interrupt, __ATOMIC_RELAXED) != 0;
}

struct Task {
  int64_t c, t0, t1;  // chunk, tokens [t0, t1)
  int64_t gathered;   // a tree token's own chunk (its keys gathered), else shared
};

struct Attn {
  const uint16_t* kc;
  const uint16_t* vc;
  const float* qs;
  const uint16_t* qh;  // bf16: q's bits (qs: their values)
  float* out;
  float* part;
  int64_t s_max, D, Dp, G, NH, KV, T, past, nchunk;
  const int64_t* len;
  const uint8_t* contig;
  const int64_t* vis;
  const int64_t* vis_off;
  int32_t bf16, native;  // the bf16 cache; with the CPU's own bf16 dot products
};

inline int64_t pad16(int64_t d) { return (d + 15) / 16 * 16; }

inline float clamp_h(float x) { return x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x; }

constexpr int32_t ATT_FP32 = 0, ATT_BF16 = 1;  // Model::att
constexpr float BF16_MAX = 3.38953139e38f;      // the largest finite bf16 (0x7f7f)
inline float clamp_bf(float x) { return x > BF16_MAX ? BF16_MAX : x < -BF16_MAX ? -BF16_MAX : x; }

// fp32 -> bf16, round to nearest even; a denormal becomes a zero of its sign and a NaN a
// quiet NaN (what vcvtneps2bf16 gives).
inline uint16_t f2bf(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf2f(uint16_t h) {  // exact
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float v;
  memcpy(&v, &u, 4);
  return v;
}

// Where key r's dim d lies in a layer's bf16 cache, K part (from the layer's start) and V
// part (from its V start), head h: K tiles of 16 keys with two dims a lane, V pairs of keys.
inline int64_t k_at(int64_t s_max, int64_t D, int64_t h, int64_t r, int64_t d) {
  return h * s_max * D + (r / 16) * D * 16 + (d / 2) * 32 + (r % 16) * 2 + (d & 1);
}
inline int64_t v_at(int64_t s_max, int64_t Dp, int64_t h, int64_t r, int64_t d) {
  return h * s_max * Dp + (r / 2) * Dp * 2 + d * 2 + (r & 1);
}

// The parent row of row j > 0 (its deepest ancestor; j - 1 in a chain).
inline int64_t parent_row(const Fwd& f, int64_t j) {
  if (!f.anc) return j - 1;
  for (int64_t i = j - 1; i >= 0; --i)
    if (f.anc[j * f.T + i]) return i;
  return -1;
}

// torch.argmax's choice in one row of n logits: the first NaN if there is one (nan set),
// else the first largest (+0 and -0 equal). Each lane keeps its largest and the first place
// it was seen; then the largest of the lanes and, among the lanes holding it, the first
// place. One pass over the row, several times faster than torch.argmax over a large
// vocabulary, which a greedy step pays per row of logits.
int64_t argmax_scalar(const float* row, int64_t n, bool& nan) {
  int64_t best = 0;
  nan = false;
  for (int64_t j = 0; j < n; ++j) {
    if (row[j] != row[j]) {
      nan = true;
      return j;
    }
    if (row[j] > row[best]) best = j;
  }
  return best;
}

// The vector passes' end: the lanes' largest values m and first places a (lanes of them,
// the row's first j entries, no NaN among them) and the tail from j give the row's choice;
// a NaN in the tail sends the row to the scalar scan.
int64_t argmax_lanes(const float* m, const int32_t* a, int lanes, const float* row, int64_t j,
                     int64_t n, bool& nan) {
  int64_t best = -1;
  float bv = -INFINITY;
  for (int l = 0; l < lanes; ++l)  // a lane never set (all -inf) holds place l, not yet seen
    if (m[l] > bv || (m[l] == bv && a[l] < best && m[l] > -INFINITY)) bv = m[l], best = a[l];
  for (; j < n; ++j) {
    if (row[j] != row[j]) return argmax_scalar(row, n, nan);
    if (row[j] > bv) bv = row[j], best = j;
  }
  nan = false;
  return best < 0 ? 0 : best;
}

#ifdef LS_X86
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) int64_t argmax512(
    const float* row, int64_t n, bool& nan) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __m512i at = _mm512_setzero_si512();
  __m512i j16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 unord = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(row + j);
    unord |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, mx, _CMP_GT_OQ);
    mx = _mm512_mask_mov_ps(mx, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, j16);
    j16 = _mm512_add_epi32(j16, _mm512_set1_epi32(16));
  }
  if (unord || n > INT32_MAX) return argmax_scalar(row, n, nan);
  alignas(64) float m[16];
  alignas(64) int32_t a[16];
  _mm512_store_ps(m, mx);
  _mm512_store_epi32(a, at);
  return argmax_lanes(m, a, 16, row, j, n, nan);
}

__attribute__((target("avx2,fma"))) int64_t argmax256(const float* row, int64_t n, bool& nan) {
  __m256 mx = _mm256_set1_ps(-INFINITY), unord = _mm256_setzero_ps();
  __m256i at = _mm256_setzero_si256();
  __m256i j8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(row + j);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(v, mx, _CMP_GT_OQ);
    mx = _mm256_blendv_ps(mx, v, gt);
    at = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(j8), gt));
    j8 = _mm256_add_epi32(j8, _mm256_set1_epi32(8));
  }
  if (_mm256_movemask_ps(unord) || n > INT32_MAX) return argmax_scalar(row, n, nan);
  alignas(32) float m[8];
  alignas(32) int32_t a[8];
  _mm256_store_ps(m, mx);
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), at);
  return argmax_lanes(m, a, 8, row, j, n, nan);
}
#endif

int64_t row_argmax(int isa, const float* row, int64_t n, bool& nan) {
#ifdef LS_X86
  if (isa >= 2) return argmax512(row, n, nan);
  if (isa == 1) return argmax256(row, n, nan);
#endif
  (void)isa;
  return argmax_scalar(row, n, nan);
}

// Under Fwd::stop: greedy verification's walk through the logit rows computed so far
// ([0, r1), n columns each). `at` is the row it stands on (0: the root): its first largest
// logit (torch.argmax's choice) names the token, and the walk moves to the first later
// row that is a child of `at` with that id. True when the walk ends at a row < r1 (no such
// child: greedy verification reads no other row); false when it needs rows from r1 on. A
// row with a NaN ends the stopping (at = T): every later row is computed and the caller's
// own argmax decides.
bool walk_ends(const Fwd& f, const float* logits, int64_t n, int64_t r1, int64_t& at,
               const int64_t* bests = nullptr, const uint8_t* nans = nullptr) {
  while (at < r1) {
    bool nan = bests && nans[at];
    const int64_t best = bests ? bests[at] : row_argmax(f.isa, logits + at * n, n, nan);
    if (nan) {
      at = f.T;
      return false;
    }
    int64_t next = -1;
    for (int64_t j = at + 1; j < f.T && next < 0; ++j)
      if (f.ids[j] == best && parent_row(f, j) == at) next = j;
    if (next < 0) return true;
    at = next;
  }
  return false;
}

// Each logit row's argmax in parts: thread t scans the columns [c0, c1) it wrote (in its
// own cache: read from the other core, a row of logits costs many times its scan), then
// merge() takes, per row, the first NaN in column order if a part saw one, else
// the largest value, the first on a tie (threads hold columns in thread order): torch's
// argmax of the whole row.
struct Picks {
  bool on;
  int64_t rows;
  std::vector<float> v;       // [thread][row]: the part's largest value
  std::vector<int64_t> at;    // its column (-1: no columns)
  std::vector<uint8_t> pnan;  // whether it is a NaN
  std::vector<int64_t> best;  // merged, per row
  std::vector<uint8_t> nan;
  Picks(bool o, int64_t threads, int64_t r)
      : on(o), rows(r), v(o ? threads * r : 0), at(o ? threads * r : 0, -1),
        pnan(o ? threads * r : 0), best(o ? r : 0), nan(o ? r : 0) {}
  void part(int64_t t, int64_t r, int isa, const float* row, int64_t c0, int64_t c1) {
    if (c1 <= c0) return;
    bool isnan;
    const int64_t j = c0 + row_argmax(isa, row + c0, c1 - c0, isnan);
    v[t * rows + r] = row[j];
    at[t * rows + r] = j;
    pnan[t * rows + r] = isnan ? 1 : 0;
  }
  void merge(int64_t threads, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t b = -1;
      float bv = 0.0f;
      bool isnan = false;
      for (int64_t t = 0; t < threads && !isnan; ++t)  // torch names the first NaN
        if (at[t * rows + r] >= 0 && pnan[t * rows + r]) {
          b = at[t * rows + r];
          isnan = true;
        }
      for (int64_t t = 0; t < threads && !isnan; ++t) {
        const int64_t i = t * rows + r;
        if (at[i] >= 0 && (b < 0 || v[i] > bv)) {
          b = at[i];
          bv = v[i];
        }
      }
      best[r] = b < 0 ? 0 : b;
      nan[r] = isnan ? 1 : 0;
    }
  }
};

// The row count of the next chunk of logits from row r0 of `rows` (see Fwd::stop).
inline int64_t head_chunk(const Fwd& f, int64_t r0, int64_t rows) {
  if (!f.stop) return rows - r0;
  return r0 == 0 && rows > STOP_ROWS ? STOP_ROWS : rows - r0;
}

inline bool eligible(const Attn& A, int64_t t, const Task& tk) {
  if (tk.gathered) return true;
  const int64_t c0 = tk.c * CHUNK;
  return A.len[t] > c0 && (A.contig[t] || c0 + CHUNK <= A.past);
}

// Per forward: each token's key list (length, the new keys it sees, whether the list is
// the cache's rows as they lie) and the attention tasks, the same for every layer.
struct Plan {
  std::vector<int64_t> len, vis, vis_off;
  std::vector<uint8_t> contig;
  std::vector<Task> tasks;
  int64_t nchunk = 0;

  int32_t native = 0;  // g_bf16_native when the forward began

  Attn attn(const Model& m, const Fwd& f, const uint16_t* kc, const uint16_t* vc,
            const float* qs, const uint16_t* qh, float* out, float* part) const {
    const int64_t D = m.head_dim;
    const int32_t bf16 = m.att == ATT_BF16 ? 1 : 0;
    return Attn{kc, vc, qs, qh, out, part, f.s_max, D, pad16(D), m.heads / m.kv_heads,
                m.heads, m.kv_heads, f.T, f.past, nchunk, len.data(), contig.data(),
                vis.data(), vis_off.data(), bf16, bf16 && native ? 1 : 0};
  }
};

// The attention tasks of a plan whose key lists are made (make_plan): per chunk, up to
// TOKENS tokens that share it whole, or one tree token's own; `cuts`: tokens where the
// shared groups break, so that no task spans one (a forward shared out by rows).
void plan_tasks(const Fwd& f, Plan& p, const std::vector<int64_t>& cuts = {}) {
  const int64_t T = f.T;
  p.tasks.clear();
  for (int64_t c = 0; c < p.nchunk; ++c) {
    const int64_t c0 = c * CHUNK;
    int64_t t0 = -1, count = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (t0 >= 0 && std::find(cuts.begin(), cuts.end(), t) != cuts.end()) {
        p.tasks.push_back(Task{c, t0, t, 0});
        t0 = -1;
        count = 0;
      }
      const bool shared = p.len[t] > c0 && (p.contig[t] || c0 + CHUNK <= f.past);
      if (!shared) {
        if (p.len[t] > c0) p.tasks.push_back(Task{c, t, t + 1, 1});
        continue;
      }
      if (t0 < 0) t0 = t;
      if (++count == TOKENS) {
        p.tasks.push_back(Task{c, t0, t + 1, 0});
        t0 = -1;
        count = 0;
      }
    }
    if (t0 >= 0) p.tasks.push_back(Task{c, t0, T, 0});
  }
}

bool make_plan(const Model& m, const Fwd& f, Plan& p) {
  const int64_t T = f.T;
  p.len.assign(T, 0);
  p.contig.assign(T, 1);
  p.vis_off.assign(T + 1, 0);
  p.vis.clear();
  int64_t most = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (f.pos[t] < 0 || f.pos[t] >= m.rope_len) return false;
    for (int64_t j = 0; j < T; ++j) {
      const bool seen = f.anc ? f.anc[t * T + j] != 0 : j <= t;
      if (!seen) continue;
      if (j > t) return false;  // a token sees only itself and earlier ones
      if (j != static_cast<int64_t>(p.vis.size()) - p.vis_off[t]) p.contig[t] = 0;
      p.vis.push_back(j);
    }
    p.vis_off[t + 1] = static_cast<int64_t>(p.vis.size());
    const int64_t n = p.vis_off[t + 1] - p.vis_off[t];
    if (n == 0 || p.vis.back() != t) return false;
    p.len[t] = f.past + n;
    most = p.len[t] > most ? p.len[t] : most;
  }
  p.nchunk = (most + CHUNK - 1) / CHUNK;
  p.native = g_bf16_native.load(std::memory_order_relaxed);
  plan_tasks(f, p);
  return true;
}

struct Bufs {
  std::vector<float> x, a, qkv, qs, o, gu, act, part;
  std::vector<uint16_t> qh;
};

Bufs& bufs(int64_t T, const Model& m) {
  thread_local Bufs b;
  const int64_t H = m.hidden, D = m.head_dim, NH = m.heads, KV = m.kv_heads;
  b.x.resize(T * H);
  b.a.resize(T * H);
  b.qkv.resize(T * (NH + 2 * KV) * D);
  b.qs.resize(T * NH * D);
  b.qh.resize(m.att == ATT_BF16 ? T * NH * D : 0);
  b.o.resize(T * NH * D);
  b.gu.resize(T * 2 * m.inter);
  b.act.resize(T * m.inter);
  return b;
}

float h2f(uint16_t h) {  // exact
  const uint32_t s = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 31, mant = h & 0x3ffu;
  uint32_t bits;
  if (e == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return s ? -v : v;
  }
  bits = e == 31 ? (s | 0x7f800000u | (mant << 13)) : (s | ((e + 112) << 23) | (mant << 13));
  float v;
  memcpy(&v, &bits, 4);
  return v;
}

// fp32 -> fp16, round to nearest even (F. Giesen's float_to_half_fast3_rtne).
uint16_t f2h_soft(float v) {
  uint32_t x;
  memcpy(&x, &v, 4);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint16_t o;
  if (x >= 0x47800000u) {
    o = x > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (x < 0x38800000u) {
    float f;
    memcpy(&f, &x, 4);
    f += 0.5f;
    uint32_t r;
    memcpy(&r, &f, 4);
    o = static_cast<uint16_t>(r - 0x3f000000u);
  } else {
    const uint32_t odd = (x >> 13) & 1;
    x += 0xc8000fffu + odd;
    o = static_cast<uint16_t>(x >> 13);
  }
  return static_cast<uint16_t>((sign >> 16) | o);
}

void embed(const Model& m, const Fwd& f, float* x) {
  const Mat& e = m.embed;
  const int64_t H = m.hidden;
  if (e.kind >= 0) {
    cs_q_rows(e.kind, static_cast<const uint8_t*>(e.p), e.n, e.k, f.ids, f.T, x, H);
    return;
  }
  for (int64_t t = 0; t < f.T; ++t) {
    const int64_t r = f.ids[t];
    float* xr = x + t * H;
    for (int64_t h = 0; h < H; ++h) {
      if (r < 0 || r >= e.n) {
        xr[h] = 0.0f;
      } else if (e.kind == -1) {
        xr[h] = static_cast<const float*>(e.p)[r * H + h];
      } else {
        const uint16_t b = static_cast<const uint16_t*>(e.p)[r * H + h];
        if (e.kind == -2) {
          xr[h] = h2f(b);
        } else {
          const uint32_t bits = static_cast<uint32_t>(b) << 16;
          memcpy(xr + h, &bits, 4);
        }
      }
    }
  }
}

void tap(const Model& m, const Fwd& f, int64_t layer, const float* x, int64_t t0 = 0,
         int64_t t1 = -1) {
  const int64_t H = m.hidden;
  for (int64_t j = 0; j < f.ntaps; ++j) {
    if (f.taps[j] != layer) continue;
    for (int64_t t = t0; t < (t1 < 0 ? f.T : t1); ++t)
      memcpy(f.hidden + (t * f.ntaps + j) * H, x + t * H, H * sizeof(float));
  }
}

// ---------------------------------------------------------------------------------------
// One parallel region per forward (int8 block products): the threads meet at a Barrier
// between the steps of a layer (~11 a layer; once a forward when it is shared out by rows,
// g_row_split, whose layers wait only for earlier tokens' keys: Progress) instead of
// OpenMP opening a region per product (~8 a layer, each a wake-up of sleeping threads,
// together a sizeable part of a decode step). A thread that arrives early spins
// for at most spin_ns (a partner a microsecond behind costs nothing), then sleeps on a
// futex: on a busy machine a partner can be descheduled for milliseconds, and spinning
// through that takes a core from the threads that are behind (OpenMP's own spinning makes
// a decode step several times slower there). Whether to spin at all follows the machine
// (SpinPolicy).

inline void cpu_relax() {
#ifdef LS_X86
  _mm_pause();
#endif
}

// Rounds of every Barrier since the kernel was loaded (for tests: how often a forward's
// threads all met).
std::atomic<int64_t> g_barrier_rounds{0};

struct Barrier {
  alignas(64) std::atomic<int> count{0};
  alignas(64) std::atomic<int> gen{0};
  std::atomic<int> sleepers{0};
  std::atomic<int64_t> slept{0};  // waits that ran out of spin
  std::atomic<int64_t> waits{0};
  int n = 1;
  int64_t spin_ns = 0;

  static void sleep_on(std::atomic<int>* a, int v) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<int*>(a), FUTEX_WAIT_PRIVATE, v, nullptr, nullptr, 0);
#else
    (void)a, (void)v;
    std::this_thread::yield();
#endif
  }
  static void wake_all(std::atomic<int>* a) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<int*>(a), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
            nullptr, 0);
#else
    (void)a;
#endif
  }

  void wait() {
    if (n <= 1) return;
    const int g = gen.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      g_barrier_rounds.fetch_add(1, std::memory_order_relaxed);
      count.store(0, std::memory_order_relaxed);
      gen.store(g + 1, std::memory_order_seq_cst);
      if (sleepers.load(std::memory_order_seq_cst) > 0) wake_all(&gen);
      return;
    }
    hold(gen, sleepers, [g](int v) { return v != g; });
  }

  // One wait (counted in waits) until ready(word's value): spin for spin_ns (a wait that
  // outlasts it counts in slept), then sleep on word's futex, counted in `sleepers` (whoever
  // changes word wakes it when they are > 0).
  template <class Ready>
  void hold(std::atomic<int>& word, std::atomic<int>& sleepers_of, Ready ready) {
    waits.fetch_add(1, std::memory_order_relaxed);
    if (spin_ns > 0) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
      for (int i = 1;; ++i) {
        if (ready(word.load(std::memory_order_acquire))) return;
        cpu_relax();
        if ((i & 31) == 0 && std::chrono::steady_clock::now() > until) break;
      }
      slept.fetch_add(1, std::memory_order_relaxed);
    }
    sleepers_of.fetch_add(1, std::memory_order_seq_cst);
    for (int v; !ready(v = word.load(std::memory_order_seq_cst));) sleep_on(&word, v);
    sleepers_of.fetch_sub(1, std::memory_order_seq_cst);
  }
};

// How many layers each thread of a forward shared out by tokens has stored its keys and
// values for. A token sees only itself and earlier tokens (make_plan), and each thread's
// tokens follow those of the threads before it, so before a layer's attention a thread
// needs the layer's keys of the threads before it only: it waits for those (thread 0 for
// none), where a barrier held every thread until the slowest had stored, at every layer.
// Its waits are the barrier's (Barrier::hold: spin, then sleep, counted as its waits).
struct Progress {
  struct alignas(64) Slot {
    std::atomic<int> layers{0};
    std::atomic<int> sleepers{0};
  };
  std::vector<Slot> slot;
  explicit Progress(int64_t threads) : slot(static_cast<size_t>(threads)) {}

  void publish(int64_t tid, int layers) {
    Slot& s = slot[static_cast<size_t>(tid)];
    s.layers.store(layers, std::memory_order_seq_cst);
    if (s.sleepers.load(std::memory_order_seq_cst) > 0) Barrier::wake_all(&s.layers);
  }

  // Until every thread before tid has published `layers`.
  void await(int64_t tid, int layers, Barrier& bar) {
    for (int64_t j = 0; j < tid; ++j) {
      Slot& s = slot[static_cast<size_t>(j)];
      if (s.layers.load(std::memory_order_acquire) < layers)
        bar.hold(s.layers, s.sleepers, [layers](int v) { return v >= layers; });
    }
  }
};

// Spin or not, per forward: spin (SPIN_US, env CODESPEC_SPIN_US, 0 never) until a forward's
// waits often outlast the spin (more than one in 8: threads descheduled, the machine is
// busy); then sleep at once for PAUSE forwards (doubling to 1024 while it stays busy)
// before one forward tries spinning again. Kept apart by the forward's kind (1 token; up to
// 16 by panels; up to 16 by rows; up to 64; more): a prefill's waits outlast the spin
// because its steps are long, not because the machine is busy, and sleeping costs it
// little; the decode steps after it must not learn from it (a long prefill would leave the
// next decode steps sleeping at each of their barriers, several times slower on an idle
// machine). So with a verification shared out by rows, whose later threads wait for the
// earlier ones' keys at every layer (Progress) because that is their order: its waits
// would turn spinning off for the small drafts' forwards by panels after it, each of them
// then about twice as long.
//
// A forward that starts long after the last one ended (COLD_US, env CODESPEC_SPIN_COLD_US,
// 0: none is cold) is not learnt from: its partner threads were asleep, their cores idle
// (a VM's idle virtual CPU is descheduled by the host), and they come back slowly, so its
// waits outlast the spin on an idle machine too. Keystrokes ~150 ms apart tripped the
// policy at nearly every completion, and the forwards after each trip slept at every
// barrier (a forward of 2-4 tokens 24-28 -> 33-47 ms on a 2-core Xeon VM). A cold forward
// also spins longer (COLD_SPIN_US, where the policy spins at all): with the usual spin its
// first waits, for a partner coming back, outlasted it, the waiter slept, its own core
// went idle and came back slowly in turn, and so on at every barrier (after 100 ms idle,
// 2-8 tokens 24-38 -> 44-62 ms; with 2 ms of spin 27-41).
struct SpinPolicy {
  struct State {
    std::atomic<int64_t> forwards{0}, skip_until{0}, pause{16}, trips{0};
  };
  static constexpr int SIZES = 5;
  State size[SIZES];
  std::atomic<int64_t> forwards{0};  // one-region forwards run (cs_lean_team_forwards)
  std::atomic<int64_t> last_end_ns{0};  // when the last one-region forward ended
  int64_t spin_ns = -1;
  int64_t cold_ns = -1;
  static constexpr int64_t COLD_SPIN_NS = 2'000'000;  // COLD_SPIN_US

  std::atomic<int64_t> colds{0};  // cold forwards so far (cs_lean_spin_colds)

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // The microseconds the environment variable `name` gives (else `fallback`), in ns;
  // 0 for none or less.
  static int64_t env_us_ns(const char* name, double fallback) {
    const char* e = std::getenv(name);
    const double us = e ? std::atof(e) : fallback;
    return us > 0 ? static_cast<int64_t>(us * 1000.0) : 0;
  }

  // Whether a forward starting now comes after an idle spell (see above).
  bool cold() {
    if (cold_ns < 0) cold_ns = env_us_ns("CODESPEC_SPIN_COLD_US", 5000.0);
    const int64_t last = last_end_ns.load();
    return cold_ns > 0 && last > 0 && now_ns() - last > cold_ns;
  }

  // A forward of T tokens begins: the spin its barriers get (a cold one's longer) and
  // whether it is cold. end() with what it saw: learnt from unless cold.
  int64_t begin(int64_t T, bool rows, bool& was_cold) {
    was_cold = cold();
    const int64_t spin = spin_for_next(T, rows);
    if (was_cold) colds.fetch_add(1);
    return was_cold && spin > 0 ? std::max(spin, COLD_SPIN_NS) : spin;
  }
  void end(int64_t T, bool rows, bool was_cold, int64_t spun_ns, int64_t waits, int64_t slept) {
    forwards.fetch_add(1);
    after(T, rows, was_cold ? 0 : spun_ns, waits, slept);
    last_end_ns.store(now_ns());
  }

  static int size_of(int64_t T, bool rows) {
    return T <= 1 ? 0 : T <= 16 ? (rows ? 2 : 1) : T <= 64 ? 3 : 4;
  }
  int64_t spin_for_next(int64_t T, bool rows) {
    if (spin_ns < 0) spin_ns = env_us_ns("CODESPEC_SPIN_US", 50.0);
    const State& s = size[size_of(T, rows)];
    // A longer forward's steps are longer, and so are the waits its threads' uneven
    // shares leave at a barrier: the spin grows with the tokens (x1 up to 4, x16 from 64).
    // With one spin for every size, 32- and 64-token forwards on an idle machine would at
    // times outlast it, then sleep at every barrier for the next forwards of their size,
    // each futex wake-up adding to their time.
    const int64_t scale = T <= 4 ? 1 : T >= 64 ? 16 : T / 4;
    return s.forwards.load() >= s.skip_until.load() ? spin_ns * scale : 0;
  }
  void after(int64_t T, bool rows, int64_t spun_ns, int64_t waits, int64_t slept) {
    State& s = size[size_of(T, rows)];
    const int64_t n = s.forwards.fetch_add(1) + 1;
    if (spun_ns <= 0 || waits == 0) return;
    if (slept * 8 > waits) {
      s.trips.fetch_add(1);
      const int64_t p = s.pause.load();
      s.skip_until.store(n + p);
      s.pause.store(p < 1024 ? 2 * p : 1024);
    } else {
      s.pause.store(16);
    }
  }
};

SpinPolicy& spin_policy() {
  static SpinPolicy p;
  return p;
}

// Whether a forward can run as one region: int8 products over GGUF blocks for every matrix.
bool team_ok(const Model& m) {
  if (!m.int8 || m.head.kind < 0) return false;
  for (int64_t l = 0; l < m.layers; ++l) {
    const Layer& L = m.layer[l];
    for (int64_t i = 0; i < L.nqkv; ++i)
      if (L.qkv[i].kind < 0) return false;
    for (int64_t i = 0; i < L.ngu; ++i)
      if (L.gu[i].kind < 0) return false;
    if (L.o.kind < 0 || L.down.kind < 0) return false;
  }
  return true;
}

// cs_qgemm_i8's path for an ISA of cs_qgemm's: AVX-512 with VNNI where the CPU has it
// (code 3), else AVX2; scalar stays scalar. Its rows agree on every path.
int i8_isa(int isa) {
  if (isa >= 2) return cs_q_isa_ok(3) ? 3 : 1;
  return isa;
}

// y[:, col..] = x @ W (+ bias) (+ res) for each matrix, side by side. Block matrices with
// int8 products go to one cs_qgemm_i8_many call (x quantized once, one parallel region).
bool products(const Model& m, const Fwd& f, const Mat* mats, int64_t n, int64_t M,
              const float* x, int64_t ldx, float* y, int64_t ldy, const float* res) {
  constexpr int64_t MOST = 8;
  bool together = m.int8 && n > 1 && n <= MOST;
  for (int64_t i = 0; together && i < n; ++i) together = mats[i].kind >= 0 && mats[i].k == mats[0].k;
  if (together) {
    int types[MOST];
    const uint8_t* P[MOST];
    int64_t N[MOST];
    const float* bias[MOST];
    bool big = M >= THREADED_ROWS;
    for (int64_t i = 0; i < n; ++i) {
      types[i] = mats[i].kind;
      P[i] = static_cast<const uint8_t*>(mats[i].p);
      N[i] = mats[i].n;
      bias[i] = mats[i].bias;
      big = big || mats[i].n * mats[i].k >= THREADED_WEIGHTS;
    }
    return cs_qgemm_i8_many(n, types, x, M, mats[0].k, ldx, P, N, y, ldy, bias, res, ldy,
                            big ? f.threads : 1, i8_isa(f.isa)) == 0;
  }
  int64_t col = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Mat& w = mats[i];
    const bool big = M >= THREADED_ROWS || w.n * w.k >= THREADED_WEIGHTS;
    const int64_t th = big ? f.threads : 1;
    const float* r = res ? res + col : nullptr;
    if (w.kind >= 0) {
      const auto P = static_cast<const uint8_t*>(w.p);
      const int rc = m.int8 ? cs_qgemm_i8(w.kind, x, M, w.k, ldx, P, w.n, y + col, ldy, w.bias,
                                          r, ldy, th, i8_isa(f.isa))
                            : cs_qgemm(w.kind, x, M, w.k, ldx, P, w.n, y + col, ldy, w.bias, r,
                                       ldy, th, f.isa);
      if (rc != 0) return false;
    } else {
      const GemmFn fn = m.gemm[-w.kind - 1];
      if (!fn) return false;
      fn(x, M, w.k, ldx, w.p, w.n, y + col, ldy, w.bias, r, ldy, th);
    }
    col += w.n;
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Scalar: the reference, and the path of a CPU without AVX2.
namespace {
namespace zs {

struct V {
  float v[16];
};

inline V vzero() {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = 0.0f;
  return r;
}
inline V vset(float x) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
inline V vld(const float* p) {
  V r;
  memcpy(r.v, p, 64);
  return r;
}
inline void vst(float* p, V a) { memcpy(p, a.v, 64); }
inline V vld_n(const float* p, int64_t n) {
  V r = vzero();
  for (int64_t i = 0; i < n && i < 16; ++i) r.v[i] = p[i];
  return r;
}
inline void vst_n(float* p, V a, int64_t n) {
  for (int64_t i = 0; i < n && i < 16; ++i) p[i] = a.v[i];
}
inline V vldh(const uint16_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = h2f(p[i]);
  return r;
}
#define LS_ZIP(name, expr)              \
  inline V name(V a, V b) {             \
    V r;                                \
    for (int i = 0; i < 16; ++i) {      \
      const float x = a.v[i], y = b.v[i]; \
      r.v[i] = (expr);                  \
    }                                   \
    return r;                           \
  }
LS_ZIP(vadd, x + y)
LS_ZIP(vsub, x - y)
LS_ZIP(vmul, x * y)
LS_ZIP(vdiv, x / y)
LS_ZIP(vmax, x > y ? x : y)  // maxps / minps: the second operand unless the compare holds
LS_ZIP(vmin, x < y ? x : y)
#undef LS_ZIP
inline V vfma(V a, V b, V c) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline V vrint(V a) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::nearbyint(a.v[i]);
  return r;
}
inline V vexp2i(V n) {
  V r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.v[i]) + 127) << 23;
    memcpy(&r.v[i], &bits, 4);
  }
  return r;
}
inline V vldexp(V p, V n) { return vmul(p, vexp2i(n)); }
inline V vfirst(V a, int64_t n, V b) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = i < n ? a.v[i] : b.v[i];
  return r;
}
// Across lanes: i + (i + 8), then + 4, + 2, + 1 (the vector paths' tree).
inline float vhsum(V a) {
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) s[i] = s[i] + s[i + 4];
  for (int i = 0; i < 2; ++i) s[i] = s[i] + s[i + 2];
  return s[0] + s[1];
}
inline float vhmax(V a) {
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = a.v[i] > a.v[i + 8] ? a.v[i] : a.v[i + 8];
  for (int i = 0; i < 4; ++i) s[i] = s[i] > s[i + 4] ? s[i] : s[i + 4];
  for (int i = 0; i < 2; ++i) s[i] = s[i] > s[i + 2] ? s[i] : s[i + 2];
  return s[0] > s[1] ? s[0] : s[1];
}
inline uint16_t f2h(float x) { return f2h_soft(x); }
inline void vldbf2(const uint16_t* p, V& even, V& odd) {
  for (int i = 0; i < 16; ++i) {
    even.v[i] = bf2f(p[2 * i]);
    odd.v[i] = bf2f(p[2 * i + 1]);
  }
}
inline V vbfr(V a, uint16_t* dst) {
  V r;
  for (int i = 0; i < 16; ++i) {
    dst[i] = f2bf(a.v[i]);
    r.v[i] = bf2f(dst[i]);
  }
  return r;
}
inline V vftz(V a) {  // here by hand: no MXCSR is assumed (FtzGuard does nothing)
  for (int i = 0; i < 16; ++i)
    if (std::fabs(a.v[i]) < 1.17549435e-38f) a.v[i] = std::copysign(0.0f, a.v[i]);
  return a;
}
struct FtzGuard {
  explicit FtzGuard(bool) {}
};
// Attention tiles (lean_ops.inc.cpp): rows per kernel call, key tiles of 16 per score
// pass and value columns / 16 per weighing pass, for R rows.
constexpr int ATT_ROWS = 4;
constexpr int score_tiles_for(int R) { return R <= 2 ? 4 : 2; }
constexpr int value_chunks_for(int) { return 2; }

#include "lean_ops.inc.cpp"

}  // namespace zs
}  // namespace

#ifdef LS_X86
namespace {
// While one lives (on): MXCSR flushes denormal results to zero and reads denormal inputs
// as zero, as vdpbf16ps does whatever MXCSR says (the FMAs standing in for it, BfEmu).
struct MxcsrFtz {
  unsigned int saved = 0;
  bool on;
  explicit MxcsrFtz(bool o) : on(o) {
    if (on) {
      saved = _mm_getcsr();
      _mm_setcsr(saved | 0x8040u);  // FTZ | DAZ
    }
  }
  ~MxcsrFtz() {
    if (on) _mm_setcsr(saved);
  }
  MxcsrFtz(const MxcsrFtz&) = delete;
  MxcsrFtz& operator=(const MxcsrFtz&) = delete;
};
}  // namespace

// ---------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: V is two ymm (lanes 0-7, 8-15).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace z2 {

struct V {
  __m256 lo, hi;
};

inline __m256 mask8(int64_t n) {  // lanes i < n
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t k = n < 0 ? 0 : n > 8 ? 8 : static_cast<int32_t>(n);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k), iota));
}
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vld(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vst(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V vld_n(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, _mm256_castps_si256(mask8(n))),
          _mm256_maskload_ps(p + 8, _mm256_castps_si256(mask8(n - 8)))};
}
inline void vst_n(float* p, V a, int64_t n) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(mask8(n)), a.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(mask8(n - 8)), a.hi);
}
inline V vldh(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V vmin(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V vfma(V a, V b, V c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V vrint(V a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline __m256 exp2i8(__m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline V vexp2i(V n) { return {exp2i8(n.lo), exp2i8(n.hi)}; }
inline V vldexp(V p, V n) { return vmul(p, vexp2i(n)); }
inline V vfirst(V a, int64_t n, V b) {
  return {_mm256_blendv_ps(b.lo, a.lo, mask8(n)), _mm256_blendv_ps(b.hi, a.hi, mask8(n - 8))};
}
inline float vhsum(V a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}
inline float vhmax(V a) {
  const __m256 s = _mm256_max_ps(a.lo, a.hi);
  const __m128 u = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 w = _mm_max_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_max_ss(w, _mm_shuffle_ps(w, w, 1)));
}
inline uint16_t f2h(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
inline void vldbf2(const uint16_t* p, V& even, V& odd) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(a, hi)),
         _mm256_castsi256_ps(_mm256_and_si256(b, hi))};
}
inline __m256i bf_bits8(__m256 x) {  // f2bf of 8 lanes, in each lane's low 16 bits
  const __m256i u = _mm256_castps_si256(x), top = _mm256_srli_epi32(u, 16);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i den =
      _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
  const __m256i odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
  return _mm256_blendv_epi8(r, _mm256_and_si256(top, _mm256_set1_epi32(0x8000)), den);
}
inline V vbfr(V a, uint16_t* dst) {
  const __m256i lo = bf_bits8(a.lo), hi = bf_bits8(a.hi);
  // packus: per 128-bit half lo0-3 hi0-3 | lo4-7 hi4-7; the permute puts them in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
inline V vftz(V a) { return a; }  // MXCSR does it (FtzGuard)
using FtzGuard = MxcsrFtz;
// Attention tiles: R rows x n tiles (or value chunks) take R * n accumulators and n loaded
// operands, two ymm each, beside one broadcast: n = 7 / (R + 1) keeps them in the 16 ymm
// (R 4 x 2 tiles spill to the stack, a large share of the kernel's time). Up to 6 rows a call
// (a shared task has 8 tokens x 3 query heads of a group on the default model).
constexpr int ATT_ROWS = 6;
constexpr int fit_ymm(int R, int most) { return 7 / (R + 1) < 1 ? 1 : 7 / (R + 1) > most ? most : 7 / (R + 1); }
constexpr int score_tiles_for(int R) { return fit_ymm(R, 4); }
constexpr int value_chunks_for(int R) { return fit_ymm(R, 4); }

#include "lean_ops.inc.cpp"

}  // namespace z2
}  // namespace
#pragma GCC pop_options

#ifdef LS_AVX512
// ---------------------------------------------------------------------------------------
// AVX-512 (F, BW, VL, DQ): V is one zmm.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace {
namespace z5 {

using V = __m512;

inline __mmask16 mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff)
                 : static_cast<__mmask16>((1u << (n > 0 ? n : 0)) - 1);
}
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float x) { return _mm512_set1_ps(x); }
inline V vld(const float* p) { return _mm512_loadu_ps(p); }
inline void vst(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V vld_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(mask16(n), p); }
inline void vst_n(float* p, V a, int64_t n) { _mm512_mask_storeu_ps(p, mask16(n), a); }
inline V vldh(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vrint(V a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p 2^n, one instruction: as p times 2^n built from n's bits (vexp's n is an integer in
// [-126, 127]: 2^n is a normal float, and both round a product that falls below the
// normal range the same way).
inline V vldexp(V p, V n) { return _mm512_scalef_ps(p, n); }
inline V vfirst(V a, int64_t n, V b) { return _mm512_mask_blend_ps(mask16(n), b, a); }
inline float vhsum(V a) {
  const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}
inline float vhmax(V a) {
  const __m256 s = _mm256_max_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 u = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 w = _mm_max_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_max_ss(w, _mm_shuffle_ps(w, w, 1)));
}
inline uint16_t f2h(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
inline void vldbf2(const uint16_t* p, V& even, V& odd) {
  const __m512i a = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(a, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline V vbfr(V a, uint16_t* dst) {
  const __m512i u = _mm512_castps_si512(a), top = _mm512_srli_epi32(u, 16);
  const __mmask16 nan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                              _mm512_set1_epi32(0x7f800000));
  const __mmask16 den = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(top, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
  r = _mm512_mask_mov_epi32(r, den, _mm512_and_si512(top, _mm512_set1_epi32(0x8000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
  return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
}
inline V vftz(V a) { return a; }  // MXCSR does it (FtzGuard)
using FtzGuard = MxcsrFtz;
// The CPU's own bf16 dot products (AVX512-BF16; chosen at run time: g_bf16_native).
#define LS_BF16_NATIVE 1
struct BfNative {
  static constexpr bool native = true;
  using KP = __m512bh;
  static inline KP ld(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  // acc + the 16 lanes' pairs times the pair at b (bits of two bf16)
  static inline V dot(V acc, KP k, const uint16_t* b) {  // (b's pair broadcast by the
    asm("vdpbf16ps %2%{1to16%}, %1, %0"              // instruction's memory operand)
        : "+v"(acc)
        : "v"(k), "m"(*reinterpret_cast<const uint32_t*>(b)));
    return acc;
  }
  static inline V round(V a, uint16_t* dst) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};
// Attention tiles in 32 zmm: up to 6 rows x 4 accumulators (6 x 4 score tiles or value
// chunks: 24 accumulators, 4 operands, a broadcast). Each fp16 -> fp32 widening (two
// uops on the FMA ports) serves 6 rows instead of 4, which makes 16-token verifications
// over long caches faster than 4 or 5 rows a call (a decode step has 3 rows: unchanged).
constexpr int ATT_ROWS = 6;
constexpr int score_tiles_for(int R) { return R <= 2 ? 4 : R <= 4 ? 2 : 4; }
constexpr int value_chunks_for(int) { return 4; }

#include "lean_ops.inc.cpp"
#undef LS_BF16_NATIVE

}  // namespace z5
}  // namespace
#pragma GCC pop_options
#endif  // LS_AVX512
#endif  // LS_X86

extern "C" {

int cs_lean_version() { return 1; }

// Set how many cache lines ahead attention prefetches a chunk's keys and values; returns
// the old value (0: none).
int64_t cs_lean_att_ahead(int64_t n) { return g_att_ahead.exchange(n); }

// Set how many lines a step attention tasks fetch of their thread's next task's chunk
// (g_att_lead; 0: none, -1 leaves it). Returns the old value.
int cs_lean_att_lead(int on) {
  return on < 0 ? g_att_lead.load() : g_att_lead.exchange(on);
}

// Lines attention tasks have fetched of their thread's next task's chunk, since the kernel
// was loaded (team path; for tests).
int64_t cs_lean_att_led() { return g_att_led.load(); }

// Keys tree tokens' attention tasks have gathered into K tiles, since the kernel was
// loaded (for tests).
int64_t cs_lean_att_gathered() { return g_att_gathered.load(); }

// Rounds of the stack's barriers since the kernel was loaded (for tests).
int64_t cs_lean_barrier_rounds() { return g_barrier_rounds.load(); }

// Set thread 0's fraction of the products' panels and of the tokens shared out by rows
// (two threads), and whether they adapt (see g_split); each returns the old value (the
// panels' fraction).
double cs_lean_split(double f) {
  const double v = f < 0.0 ? 0.0 : f > 1.0 ? 1.0 : f;
  g_split_rows.store(v);
  return g_split.exchange(v);
}
int cs_lean_split_adapt(int on) { return g_split_adapt.exchange(on ? 1 : 0); }
// Thread 0's fraction of the tokens of a forward shared out by rows (g_split_rows): set
// to f (f < 0 leaves it); returns the old value.
double cs_lean_row_share(double f) {
  return f < 0.0 ? g_split_rows.load() : g_split_rows.exchange(f > 1.0 ? 1.0 : f);
}

// Set from how many tokens a forward's layers are shared out by rows (g_row_split; 0:
// never, -1 leaves it); returns the old value.
int64_t cs_lean_row_split(int64_t n) { return n < 0 ? g_row_split.load() : g_row_split.exchange(n); }

// Forwards shared out by rows since the kernel was loaded (for tests).
int64_t cs_lean_row_forwards() { return g_row_forwards.load(); }

// Whether bf16 attention uses the CPU's own bf16 dot products (g_bf16_native): on 1 (where
// the CPU has them) or 0; -1 leaves it. Returns the old value.
int32_t cs_lean_bf16_native(int32_t on) {
  if (on < 0) return g_bf16_native.load();
  return g_bf16_native.exchange(on && bf16_cpu() ? 1 : 0);
}

// Each of `rows` rows of n logits (ld apart): torch.argmax's choice (row_argmax) into out,
// rows shared between `threads` OpenMP threads. Returns how many rows hold a NaN.
int64_t cs_lean_argmax(const float* x, int64_t rows, int64_t n, int64_t ld, int64_t* out,
                       int64_t threads, int isa) {
  if (!cs_q_isa_ok(isa)) isa = 0;
  int64_t nans = 0;
#pragma omp parallel for num_threads(threads > 1 ? threads : 1) schedule(static) \
    reduction(+ : nans) if (threads > 1 && rows >= 8)
  for (int64_t r = 0; r < rows; ++r) {
    bool nan;
    out[r] = row_argmax(isa, x + r * ld, n, nan);
    nans += nan ? 1 : 0;
  }
  return nans;
}

// For tests: the bf16 attention's rounding of n values (a multiple of 16) and one tile's
// 16 scores (lean_ops.inc.cpp's bf16_probe) on the path of `isa`, with the CPU's own bf16
// dot products (native) or FMAs. -3: an ISA this CPU lacks (native: AVX512-BF16).
int cs_lean_bf16_probe(int isa, int native, const float* x, int64_t n, uint16_t* xb,
                       const uint16_t* kt, const uint16_t* qb, int64_t pairs, float* s) {
  if (!cs_q_isa_ok(isa)) return -3;
  if (native && (!bf16_cpu() || isa < 2)) return -3;
#ifdef LS_AVX512
  if (isa >= 2) {
    z5::bf16_probe(native != 0, x, n, xb, kt, qb, pairs, s);
    return 0;
  }
#endif
#ifdef LS_X86
  if (isa == 1) {
    z2::bf16_probe(false, x, n, xb, kt, qb, pairs, s);
    return 0;
  }
#endif
  zs::bf16_probe(false, x, n, xb, kt, qb, pairs, s);
  return 0;
}

// Forwards run as one parallel region so far (team_ok), for tests and diagnostics.
int64_t cs_lean_team_forwards() { return spin_policy().forwards.load(); }

// The spin (ns, 0: sleep at once) the next one-region forward of T tokens gets at its
// barriers; and the spin policy told what a forward of T tokens saw (what cs_lean_forward
// does after each one): for tests and diagnostics, T's kind as on two threads (by_rows).
int64_t cs_lean_spin_ns(int64_t T) { return spin_policy().spin_for_next(T, by_rows(T, 2)); }
void cs_lean_spin_observe(int64_t T, int64_t spun_ns, int64_t waits, int64_t slept) {
  spin_policy().after(T, by_rows(T, 2), spun_ns, waits, slept);
}
// Forwards of T tokens' kind so far, and how many of them turned spinning off.
int64_t cs_lean_spin_forwards(int64_t T) {
  return spin_policy().size[SpinPolicy::size_of(T, by_rows(T, 2))].forwards.load();
}
int64_t cs_lean_spin_trips(int64_t T) {
  return spin_policy().size[SpinPolicy::size_of(T, by_rows(T, 2))].trips.load();
}
// A forward of T tokens as cs_lean_forward runs one, for tests: begin (the spin it gets;
// *cold: whether it came after an idle spell), then end with the waits it saw.
int64_t cs_lean_spin_begin(int64_t T, int32_t* cold) {
  bool c = false;
  const int64_t spin = spin_policy().begin(T, by_rows(T, 2), c);
  *cold = c ? 1 : 0;
  return spin;
}
void cs_lean_spin_end(int64_t T, int32_t cold, int64_t spun_ns, int64_t waits, int64_t slept) {
  spin_policy().end(T, by_rows(T, 2), cold != 0, spun_ns, waits, slept);
}
// Cold forwards so far; and the idle spell that makes one (us; 0: none is; < 0: the
// environment's, CODESPEC_SPIN_COLD_US, else the default): for tests.
int64_t cs_lean_spin_colds() { return spin_policy().colds.load(); }
void cs_lean_spin_cold_us(double us) {
  spin_policy().cold_ns = us < 0 ? -1 : static_cast<int64_t>(us * 1000.0);
}
// Forget what the spin policy learnt (every size spins again), for tests.
void cs_lean_spin_reset() {
  for (auto& s : spin_policy().size) {
    s.skip_until.store(0);
    s.pause.store(16);
  }
}

// The forward (see Fwd). Returns 0 (with Fwd::stop: the logit rows computed, >= 1); -1 a
// product refused (an unknown type, a missing
// panel product), -2 a bad layout (a position outside the RoPE tables, a token seeing a
// later one or not itself), -3 an ISA this CPU lacks or an unsupported head dimension,
// INTERRUPTED (-4) Fwd::interrupt was set before the last layer.
int cs_lean_forward(const Model* m, const Fwd* f) {
  if (pad16(m->head_dim) > MAX_DP || !cs_q_isa_ok(f->isa)) return -3;
  if (m->att == ATT_BF16 && m->head_dim % 2) return -3;  // its cache holds pairs of dims
  // CODESPEC_LEAN_REGIONS=per-product: a region per product as for the other weights (for
  // comparisons; the numbers are the same)
  const char* regions = std::getenv("CODESPEC_LEAN_REGIONS");
  const bool per_product = regions && strcmp(regions, "per-product") == 0;
  if (!per_product && team_ok(*m)) {
    thread_local Barrier bar;
    SpinPolicy& sp = spin_policy();
    const bool rows = by_rows(f->T, f->threads);
    bool cold = false;
    bar.spin_ns = sp.begin(f->T, rows, cold);
    bar.waits = 0;
    bar.slept = 0;
    int rc;
#ifdef LS_AVX512
    if (f->isa >= 2) rc = z5::forward_team(*m, *f, bar);
    else
#endif
#ifdef LS_X86
    if (f->isa == 1) rc = z2::forward_team(*m, *f, bar);
    else
#endif
      rc = zs::forward_team(*m, *f, bar);
    sp.end(f->T, rows, cold, bar.spin_ns, bar.waits.load(), bar.slept.load());
    return rc;
  }
#ifdef LS_AVX512
  if (f->isa >= 2) return z5::forward(*m, *f);
#endif
#ifdef LS_X86
  if (f->isa == 1) return z2::forward(*m, *f);
#endif
  return zs::forward(*m, *f);
}

// After a forward that appended rows base.., keep rows base + idx[j] (increasing) as rows
// base + j, in every layer's K tiles and V rows (att: the cache's layout, Model::att).
void cs_lean_keep(uint16_t* kv, int64_t layers, int64_t KV, int64_t s_max, int64_t D,
                  int64_t base, const int64_t* idx, int64_t n, int32_t att) {
  const int64_t Dp = pad16(D);
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t h = 0; h < KV; ++h) {
      uint16_t* kc = kv + l * KV * s_max * (D + Dp) + h * s_max * D;
      uint16_t* vc = kv + l * KV * s_max * (D + Dp) + KV * s_max * D + h * s_max * Dp;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t src = base + idx[j], dst = base + j;
        if (src == dst) continue;
        if (att == ATT_BF16) {
          for (int64_t d = 0; d < D; ++d) kc[k_at(s_max, D, 0, dst, d)] = kc[k_at(s_max, D, 0, src, d)];
          for (int64_t d = 0; d < Dp; ++d)
            vc[v_at(s_max, Dp, 0, dst, d)] = vc[v_at(s_max, Dp, 0, src, d)];
          continue;
        }
        for (int64_t d = 0; d < D; ++d)
          kc[(dst / 16) * D * 16 + 16 * d + dst % 16] = kc[(src / 16) * D * 16 + 16 * d + src % 16];
        memcpy(vc + dst * Dp, vc + src * Dp, Dp * sizeof(uint16_t));
      }
    }
  }
}

}  // extern "C"
