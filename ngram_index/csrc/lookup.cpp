// The n-gram index's longest-suffix lookup in one call (ngram_index/native.py loads it).
//
// The same candidates as lookup.py's numpy path, step for step: the key's occurrences in
// the frozen segment (binary search, live documents, a continuation after them) and in
// each loose document (a scan of its keys), each match extended backwards to max_n tokens,
// the longest length per tier, then per tier the occurrences of that length, the most
// recently used document first and the latest position first, at most 64, their
// continuations of up to k ids (cut at a document's end) counted in first-read order, and
// up to b candidates, none offered twice. In a speculative step the numpy path's many
// small calls run with their code and data cold (the forward before them streams the
// weights through every cache), and cost far more than the lookup's arithmetic.
//
// Must not touch: anything but the arrays it is handed (it reads them, writes only Out).

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int32_t SEP = -1;         // segment.SEP: between documents, never an id
constexpr int64_t READ_MOST = 64;  // lookup.OCCURRENCES_READ

struct Occ {
  int64_t end, len, tier, seq, doc;  // doc: segment slot, or -1 - loose index
  const int32_t* arr;
  int64_t alen;
};

int64_t extend(const int32_t* seq, int64_t end, const int64_t* suffix, int64_t slen, int64_t n0,
               int64_t max_n) {
  const int64_t top = max_n < slen ? max_n : slen;
  int64_t m = n0;
  while (m < top && end - m >= 0 && seq[end - m] == suffix[slen - 1 - m]) ++m;
  return m;
}

}  // namespace

extern "C" {

struct SegView {
  const int64_t* skeys;  // (K,) sorted keys
  const int32_t* spos;   // (K,) their positions in cat
  int64_t nkeys;
  const int32_t* cat;  // (T,) ids, SEP after each document
  int64_t ncat;
  const int64_t* doc_start;  // (D,)
  const uint8_t* alive;      // (D,)
  const int64_t* tiers;      // (D,) 1 open, 2 workspace
  const int64_t* seqs;       // (D,) recency
  int64_t ndocs;
};

struct LooseView {
  const int32_t* tokens;
  const int64_t* keys;
  int64_t n;
  int64_t tier, seq;
};

struct Query {
  const SegView* seg;
  const LooseView* loose;
  int64_t nloose;
  int64_t key;
  const int64_t* suffix;
  int64_t slen;
  int64_t g, max_n, k, b, min_n;
  int64_t current;  // the current document's segment slot, -1: none there
};

struct Out {
  int32_t* tokens;  // (b, k)
  int64_t* meta;    // (b, 6): length, count, match, tier, reads, doc
};

// Candidates found (at most q->b).
int64_t cs_ngram_lookup(const Query* q, Out* out) {
  std::vector<Occ> occ;
  const SegView& s = *q->seg;
  if (s.nkeys > 0) {
    const int64_t* lo = std::lower_bound(s.skeys, s.skeys + s.nkeys, q->key);
    const int64_t* hi = std::upper_bound(lo, s.skeys + s.nkeys, q->key);
    for (const int64_t* it = lo; it < hi; ++it) {
      const int64_t end = s.spos[it - s.skeys];
      if (end + 1 >= s.ncat || s.cat[end + 1] == SEP) continue;  // needs a continuation
      const int64_t slot = std::upper_bound(s.doc_start, s.doc_start + s.ndocs, end) - s.doc_start - 1;
      if (slot < 0 || !s.alive[slot]) continue;
      const int64_t len = extend(s.cat, end, q->suffix, q->slen, q->g, q->max_n);
      const int64_t tier = slot == q->current ? 0 : s.tiers[slot];
      occ.push_back({end, len, tier, s.seqs[slot], slot, s.cat, s.ncat});
    }
  }
  for (int64_t j = 0; j < q->nloose; ++j) {
    const LooseView& d = q->loose[j];
    for (int64_t p = 0; p + 1 < d.n; ++p) {
      if (d.keys[p] != q->key) continue;
      const int64_t len = extend(d.tokens, p, q->suffix, q->slen, q->g, q->max_n);
      occ.push_back({p, len, d.tier, d.seq, -1 - j, d.tokens, d.n});
    }
  }
  int64_t best[3] = {0, 0, 0};
  for (const Occ& o : occ)
    if (o.len > best[o.tier]) best[o.tier] = o.len;
  int64_t found = 0;
  std::vector<std::vector<int32_t>> seen;  // every continuation offered so far
  std::vector<const Occ*> reads;
  std::vector<std::vector<int32_t>> conts;  // this tier's, first-read order
  std::vector<int64_t> counts, firsts;
  for (int64_t tier = 0; tier < 3; ++tier) {
    const int64_t n = best[tier];
    if (n < q->min_n || found >= q->b) continue;
    reads.clear();
    for (const Occ& o : occ)
      if (o.tier == tier && o.len == n) reads.push_back(&o);
    std::sort(reads.begin(), reads.end(), [](const Occ* a, const Occ* b) {
      return a->seq != b->seq ? a->seq > b->seq : a->end > b->end;
    });
    if (static_cast<int64_t>(reads.size()) > READ_MOST) reads.resize(READ_MOST);
    conts.clear();
    counts.clear();
    firsts.clear();
    for (int64_t r = 0; r < static_cast<int64_t>(reads.size()); ++r) {
      const Occ& o = *reads[r];
      std::vector<int32_t> w;
      for (int64_t i = o.end + 1; i < o.alen && i <= o.end + q->k && o.arr[i] != SEP; ++i)
        w.push_back(o.arr[i]);
      const auto at = std::find(conts.begin(), conts.end(), w);
      if (at == conts.end()) {
        conts.push_back(std::move(w));
        counts.push_back(1);
        firsts.push_back(r);
      } else {
        ++counts[at - conts.begin()];
      }
    }
    for (size_t c = 0; c < conts.size() && found < q->b; ++c) {
      if (std::find(seen.begin(), seen.end(), conts[c]) != seen.end()) continue;
      seen.push_back(conts[c]);
      std::copy(conts[c].begin(), conts[c].end(), out->tokens + found * q->k);
      int64_t* m = out->meta + found * 6;
      m[0] = static_cast<int64_t>(conts[c].size());
      m[1] = counts[c];
      m[2] = n;
      m[3] = tier;
      m[4] = static_cast<int64_t>(reads.size());
      m[5] = reads[firsts[c]]->doc;
      ++found;
    }
  }
  return found;
}

}  // extern "C"
