// The lean runner's decoder stack, written once over a 16-lane vector V (csrc/stack.cpp
// includes this file once per ISA, inside that ISA's namespace and target options, after
// defining V and its primitives: vzero vset vld vst vld_n vst_n vldh vadd vsub vmul vdiv
// vfma vmax vmin vrint vexp2i vfirst vhsum vhmax, and f2h for one value).
//
// Every result is a function of its own row only: sums run in a fixed order (per lane, in
// order, then a fixed tree across the 16 lanes), exp is one polynomial, elementwise steps
// are single IEEE operations (the file is built with -ffp-contract=off). So the three ISAs
// agree bit for bit, and a row of a T-token forward equals the one-token forward at its
// position (what lossless speculation needs: verify rows equal decode rows).
// No include guard: included once per ISA namespace.

inline V vexp(V x) {  // exp(x), Cephes' 2^f polynomial (relative error ~2e-7)
  x = vmin(vmax(x, vset(-87.0f)), vset(88.0f));
  const V t = vmul(x, vset(1.44269504088896341f));
  const V n = vrint(t);
  const V f = vsub(t, n);
  V p = vset(1.535336188319500e-4f);
  p = vfma(p, f, vset(1.339887440266574e-3f));
  p = vfma(p, f, vset(9.618437357674640e-3f));
  p = vfma(p, f, vset(5.550332471162809e-2f));
  p = vfma(p, f, vset(2.402264791363012e-1f));
  p = vfma(p, f, vset(6.931472028550421e-1f));
  p = vfma(p, f, vset(1.0f));
  return vmul(p, vexp2i(n));
}

inline float sexp(float x) {  // the same exp for one value (lane 0)
  float out[16];
  vst(out, vexp(vset(x)));
  return out[0];
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
// fp16 (K in tiles of 16 keys, V in rows of Dp), values clamped to fp16's range.
// Tokens [t0, t1) (default: all).
void rope_store(const Model& m, const Fwd& f, const float* qkv, float* qs, uint16_t* kc,
                uint16_t* vc, int64_t t0 = 0, int64_t t1 = -1) {
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
    }
    const int64_t r = f.past + t;
    for (int64_t h = 0; h < KV; ++h) {
      rope(row + (NH + h) * D, c, s, D, tmp);
      uint16_t* kt = kc + h * f.s_max * D + (r / 16) * D * 16 + r % 16;
      for (int64_t d = 0; d < D; ++d) kt[16 * d] = f2h(clamp_h(tmp[d]));
      const float* v = row + (NH + KV + h) * D;
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
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * CHUNK;
    V mx = vset(-INFINITY);
    for (int64_t t = 0; t < ntile; ++t)
      mx = vmax(mx, vfirst(vld(sr + 16 * t), nvalid[r] - 16 * t, vset(-INFINITY)));
    const float m = vhmax(mx);
    V l = vzero();
    for (int64_t t = 0; t < ntile; ++t) {
      const V p = vfirst(vexp(vsub(vld(sr + 16 * t), vset(m))), nvalid[r] - 16 * t, vzero());
      vst(sr + 16 * t, p);
      l = vadd(l, p);
    }
    part[r][0] = m;
    part[r][1] = vhsum(l);
  }
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
  const int64_t t = tk.t0, L = A.len[t];
  const int64_t* vis = A.vis + A.vis_off[t];
  auto row_of = [&](int64_t p) { return p < A.past ? p : A.past + vis[p - A.past]; };
  for (int64_t i = 0; i < CHUNK / 16; ++i) {
    const int64_t p0 = c0 + 16 * i;
    if (p0 + 16 <= A.past) {
      ktile[i] = kh + (p0 / 16) * D * 16;
      continue;
    }
    uint16_t* g = gbuf + i * D * 16;
    for (int64_t lane = 0; lane < 16; ++lane) {
      const int64_t p = p0 + lane;
      const int64_t r = p < L ? row_of(p) : -1;
      for (int64_t d = 0; d < D; ++d)
        g[16 * d + lane] = r < 0 ? 0 : kh[(r / 16) * D * 16 + 16 * d + r % 16];
    }
    ktile[i] = g;
  }
  for (int64_t j = 0; j < CHUNK; ++j) {
    const int64_t p = c0 + j;
    vrow[j] = vh + (p < L ? row_of(p) : 0) * Dp;
  }
}

void run_task(const Attn& A, int64_t h, const Task& tk) {
  thread_local std::vector<uint16_t> gbuf;
  if (tk.gathered && static_cast<int64_t>(gbuf.size()) < CHUNK * A.D) gbuf.resize(CHUNK * A.D);
  const uint16_t* ktile[CHUNK / 16];
  const uint16_t* vrow[CHUNK];
  chunk_sources(A, h, tk, ktile, vrow, gbuf.data());
  const int64_t c0 = tk.c * CHUNK;
  const float* q[ATT_ROWS];
  float* p[ATT_ROWS];
  int64_t nv[ATT_ROWS];
  int R = 0;
  int64_t nk = 0;
  // The keys of the chunk an eligible token t sees.
  auto keys_of = [&](int64_t t) -> int64_t {
    return A.len[t] - c0 < CHUNK ? A.len[t] - c0 : CHUNK;
  };
  // The first pass over the chunk prefetches it (contiguous K tiles, then V rows), the
  // later ones read it from cache.
  Ahead pf;
  const int64_t ahead = g_att_ahead.load(std::memory_order_relaxed);
  if (ahead > 0 && !tk.gathered) {
    int64_t nkeys = 0;
    for (int64_t t = tk.t0; t < tk.t1; ++t)
      if (eligible(A, t, tk) && keys_of(t) > nkeys) nkeys = keys_of(t);
    const char* k0 = reinterpret_cast<const char*>(ktile[0]);
    const char* v0 = reinterpret_cast<const char*>(vrow[0]);
    pf = {k0, k0 + ((nkeys + 15) / 16) * A.D * 16 * 2, v0, v0 + nkeys * A.Dp * 2};
    pf.step(static_cast<int>(ahead));  // the first `ahead` lines at once, then in step
  }
  for (int64_t t = tk.t0; t < tk.t1; ++t) {
    if (!eligible(A, t, tk)) continue;
    const int64_t n = keys_of(t);
    for (int64_t g = 0; g < A.G; ++g) {
      const int64_t row = (h * A.T + t) * A.G + g;
      q[R] = A.qs + (t * A.NH + h * A.G + g) * A.D;
      p[R] = A.part + (row * A.nchunk + tk.c) * (A.Dp + 2);
      nv[R] = n;
      nk = n > nk ? n : nk;
      if (++R == ATT_ROWS) {
        chunk_any(R, q, nv, nk, A.D, A.Dp, ktile, vrow, p, pf);
        pf = Ahead{};
        R = 0;
        nk = 0;
      }
    }
  }
  if (R) chunk_any(R, q, nv, nk, A.D, A.Dp, ktile, vrow, p, pf);
}

// Attention row `row` = (h, t, g) (KV head, token, query head of the group): its chunks
// merged in order into its place in A.out, out = sum_c o_c e_c / sum_c l_c e_c with
// e_c = exp(m_c - max m).
void merge_row(const Attn& A, int64_t row) {
  const int64_t h = row / (A.T * A.G), t = (row / A.G) % A.T, g = row % A.G, Dp = A.Dp;
  float* out = A.out + t * A.NH * A.D + (h * A.G + g) * A.D;
  const float* part = A.part + row * A.nchunk * (Dp + 2);
  const int64_t nch = (A.len[t] + CHUNK - 1) / CHUNK;
  float M = -INFINITY;
  for (int64_t c = 0; c < nch; ++c) M = part[c * (Dp + 2)] > M ? part[c * (Dp + 2)] : M;
  float o[MAX_DP];
  for (int64_t d = 0; d < Dp; ++d) o[d] = 0.0f;
  float l = 0.0f;
  for (int64_t c = 0; c < nch; ++c) {
    const float* pc = part + c * (Dp + 2);
    const float e = sexp(pc[0] - M);
    l = l + pc[1] * e;
    for (int64_t d = 0; d < Dp; ++d) o[d] = o[d] + pc[2 + d] * e;
  }
  for (int64_t d = 0; d < A.D; ++d) out[d] = o[d] / l;
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
    const Layer& L = m.layer[l];
    uint16_t* kc = f.kv + l * KV * f.s_max * (D + Dp);  // (KV, S_max / 16, D, 16)
    uint16_t* vc = kc + KV * f.s_max * D;  // (KV, S_max, Dp)
    rmsnorm(b.x.data(), T, H, H, L.ln1, m.eps, b.a.data(), H);
    if (!products(m, f, L.qkv, L.nqkv, T, b.a.data(), H, b.qkv.data(), QW, nullptr)) return -1;
    rope_store(m, f, b.qkv.data(), b.qs.data(), kc, vc);
    const Attn A = plan.attn(m, f, kc, vc, b.qs.data(), b.o.data(), b.part.data());
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
  return f.stop ? static_cast<int>(done) : 0;
}

// forward() with int8 block products (team_ok) in one parallel region: each step's work is
// shared out by rows (norms, x's quantization, RoPE, SiLU), panels (products), attention
// tasks (taken in turn) or merged rows, with bar.wait() between steps. The same numbers
// as forward(): no result depends on which thread computes it.
int forward_team(const Model& m, const Fwd& f, Barrier& bar) {
  const int64_t T = f.T, H = m.hidden, D = m.head_dim, NH = m.heads, KV = m.kv_heads;
  const int64_t I = m.inter, QW = (NH + 2 * KV) * D, Dp = pad16(D), G = NH / KV;
  Bufs& b = bufs(T, m);
  embed(m, f, b.x.data());
  tap(m, f, 0, b.x.data());
  Plan plan;
  if (!make_plan(m, f, plan)) return -2;
  b.part.resize(KV * T * G * plan.nchunk * (Dp + 2));
  const int64_t kmax = H > I ? (H > NH * D ? H : NH * D) : (I > NH * D ? I : NH * D);
  void* xq = cs_qgemm_i8_buffer(T, kmax);
  const int isa = i8_isa(f.isa);
  const int64_t ntask = static_cast<int64_t>(plan.tasks.size()) * KV;
  const int64_t mrows = KV * T * G;
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int> rc{0};
  std::atomic<bool> broke{false};
  const int64_t threads = f.threads > 1 ? f.threads : 1;
  const double split = g_split.load(std::memory_order_relaxed);  // thread 0's, of two
  int64_t busy[2] = {0, 0};  // ns each of two threads spent in the products
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
    auto mats = [&](const Mat* ms, int64_t count, int64_t M, float* y, int64_t ldy,
                    const float* res) {
      const auto t0 = std::chrono::steady_clock::now();
      int64_t col = 0;
      for (int64_t i = 0; i < count; ++i) {
        const Mat& w = ms[i];
        const int64_t np = (w.n + 15) / 16;
        int64_t p0, p1;
        if (n == 2) {  // g_split's shares
          const int64_t cut = static_cast<int64_t>(static_cast<double>(np) * split + 0.5);
          p0 = tid == 0 ? 0 : cut;
          p1 = tid == 0 ? cut : np;
        } else {
          share(np, p0, p1);
        }
        if (cs_qgemm_i8_panels(xq, w.kind, M, w.k, static_cast<const uint8_t*>(w.p), w.n,
                               y + col, ldy, w.bias, res ? res + col : nullptr, ldy, p0, p1,
                               isa))
          rc.store(-1);
        col += w.n;
      }
      ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - t0)
                .count();
    };
    int64_t r0, r1;
    share(T, r0, r1);
    for (int64_t l = 0; l < m.layers; ++l) {
      const Layer& L = m.layer[l];
      uint16_t* kc = f.kv + l * KV * f.s_max * (D + Dp);
      uint16_t* vc = kc + KV * f.s_max * D;
      rmsnorm(b.x.data() + r0 * H, r1 - r0, H, H, L.ln1, m.eps, b.a.data() + r0 * H, H);
      cs_qgemm_i8_quantize(xq, b.a.data(), H, H, r0, r1, isa);
      if (tid == 0) next.store(0);
      bar.wait();
      mats(L.qkv, L.nqkv, T, b.qkv.data(), QW, nullptr);
      bar.wait();
      rope_store(m, f, b.qkv.data(), b.qs.data(), kc, vc, r0, r1);
      bar.wait();
      const Attn A = plan.attn(m, f, kc, vc, b.qs.data(), b.o.data(), b.part.data());
      for (int64_t i = next.fetch_add(1); i < ntask; i = next.fetch_add(1)) {
        const int64_t nt = ntask / KV;
        run_task(A, i / nt, plan.tasks[i % nt]);
      }
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
      bar.wait();
      if (tid == 0) tap(m, f, l + 1, b.x.data());  // read-only on x, as the next norm
    }
    const int64_t rows = T - f.first;
    if (rows > 0 && f.logits) {
      int64_t h0, h1, at = 0;  // at: greedy verification's walk (tid 0's, Fwd::stop)
      share(rows, h0, h1);
      rmsnorm(b.x.data() + (f.first + h0) * H, h1 - h0, H, H, m.norm, m.eps,
              b.a.data() + h0 * H, H);
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
        r0 += c;
        if (tid == 0) done.store(r0, std::memory_order_relaxed);
        if (r0 == rows) break;
        bar.wait();  // the chunk's logits written
        if (tid == 0) broke.store(walk_ends(f, f.logits, m.vocab, r0, at));
      }
    }
    if (n == 2) busy[tid] = ns;
  }
  if (threads == 2) split_after(split, busy[0], busy[1]);
  const int r = rc.load();
  return r == 0 && f.stop ? static_cast<int>(done.load()) : r;
}
