// Native CPU paged attention and KV-cache write for pagedserve (torch custom ops).
//
// Ops (namespace `pagedserve`, see TORCH_LIBRARY at the bottom for the schemas):
//   paged_attention(out!, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
//                   scale, split_keys=0, sliding_window=0)
//                                          one varlen kernel: decode, chunked prefill and
//                                          prefix-hit tails in one call
//   reshape_and_cache(key, value, k_cache!, v_cache!, slot_mapping)
//   cpu_isa() -> str                       the instruction-set step the kernels run now
//
// Layout (kernels/__init__.py draws the index arithmetic):
//   query, out        [num_tokens, num_heads, head_dim]
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], any strides on the
//                     first three dims, head_dim contiguous (so K and V may be halves of one
//                     combined tensor)
//   block_tables      [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32;
//   query_start_loc   [num_seqs + 1] int32
//
// Algorithm. One work item = (sequence, query tile, KV heads, KV split); items run in one
// OpenMP loop (dynamic schedule). An item holds the G = num_heads / num_kv_heads query heads of
// each of its KV heads for every query token of its tile as rows, so each K/V row is read (and,
// for 16-bit caches, converted to float32) once for all of them (GQA sharing). It walks its key
// range THROUGH THE BLOCK TABLE (no gather, no padded copy), block by block, with the online
// softmax of FlashAttention-2 (Dao 2023): per row a running max m, sum l and float32
// accumulator acc, rescaled by exp(m_old - m_new). Keys past a row's causal limit (position
// context_len + j) add nothing; keys past the tile's last row are never read. Small tiles
// (decode) take every KV head in one item, so each cache block is read in one sequential pass;
// tiles of >= 16 rows per KV head take one KV head per item.
// Sliding window W > 0 (Beltagy et al. 2020, "Longformer"; Jiang et al. 2023, "Mistral 7B"):
// the row at position q sees keys max(0, q - W + 1) .. q only. An item's key range then starts
// at the block holding its first row's window start, so blocks wholly before every window of
// the tile are never read (their block-table entries may be -1 or any id) and the work is
// O(W) per row, not O(position).
// KV splits (flash-decoding, Dao et al. 2023) at FIXED key positions: the keys are cut every
// split_keys positions (default 512, whole blocks), an item covers one such range, and a row
// whose keys span several ranges has its (m, l, acc) per range merged in a second pass,
//   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,   M = max_s m_s.
// The block-table cache itself is PagedAttention (Kwon et al., SOSP 2023).
//
// Row invariance. A row's result depends on its query, its position and its keys only, never
// on the rest of the step: every row is computed by the same arithmetic (the same dot
// products over the same blocks in the same order, the same split boundaries), whatever tile
// it falls in, however the prompt was chunked and whatever else is batched. So a prefix-cache
// hit, another chunk size or another batch gives bitwise the same output row (the engine's
// determinism and --batch-invariant rest on it; tests/kernels/test_cpu_paged_attention.py).
// NOTE: an earlier version ran tiles of >= 16 rows through ATen GEMMs over 256-key chunks and
// chose the number of splits from the batch; both made a row depend on its neighbours.
//
// Instruction sets: the item kernel is written as plain loops (`#pragma omp simd`) and
// compiled three times, under __attribute__((target("avx512f,..."))), target("avx2,fma") and
// the compiler's baseline ("scalar": no extension beyond x86-64's SSE2, so it is still 4-wide
// SSE). The best the CPU has is picked at run time (cpu_isa.h; the avx512_bf16 and amx steps
// run the avx512 body); PAGEDSERVE_CPU_ISA forces a lower path (read at every call; asking for
// more than the CPU has is an error).
// All offsets are int64: a cache may hold more than 2**31 elements.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/library.h>

#include "cpu_isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#define PS_INLINE inline __attribute__((always_inline))

namespace pagedserve {
namespace {

// ---------------------------------------------------------------------------------------------
// Element helpers (always inlined, so each ISA variant compiles its own copy)

PS_INLINE void load_row(const float* src, float* dst, int64_t n, float mul) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * mul;
}

PS_INLINE void load_row(const c10::BFloat16* src, float* dst, int64_t n, float mul) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(s[i]) << 16) * mul;
  }
}

PS_INLINE void load_row(const c10::Half* src, float* dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * mul;
}

template <typename T>
PS_INLINE void store_row(const float* src, T* dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

PS_INLINE void store_row(const float* src, float* dst, int64_t n, float mul) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * mul;
}

PS_INLINE float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Four dot products of `a` with rows b, b + stride, b + 2 stride, b + 3 stride: four independent
// vector accumulators (one reduction chain would wait on FMA latency).
PS_INLINE void dot4(const float* a, const float* b, int64_t stride, int64_t n, float* out) {
  const float* b0 = b;
  const float* b1 = b + stride;
  const float* b2 = b + 2 * stride;
  const float* b3 = b + 3 * stride;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    s0 += a[i] * b0[i];
    s1 += a[i] * b1[i];
    s2 += a[i] * b2[i];
    s3 += a[i] * b3[i];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// exp(x) in float32, vectorizable (Cephes expf: range reduction x = n ln2 + r, degree-6
// polynomial, 2^n through the exponent bits; ~1 ulp). Exactly 0 below -87.33 (and for -inf),
// so masked or far-below-max scores weigh nothing.
PS_INLINE float exp_approx(float x) {
  const float lo = -87.3365447504019f, hi = 88.3762626647949f;
  float xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const float fx = xc * 1.44269504088896341f + 0.5f;
  int32_t n = static_cast<int32_t>(fx);
  n -= (static_cast<float>(n) > fx) ? 1 : 0;  // floor
  const float fn = static_cast<float>(n);
  const float r = xc - fn * 0.693359375f + fn * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const float pow2n = __builtin_bit_cast(float, static_cast<uint32_t>(n + 127) << 23);
  return x < lo ? 0.0f : y * pow2n;
}

// ---------------------------------------------------------------------------------------------
// Paged attention: work items and the per-item kernel

struct AttnParams {
  const void* query;
  int64_t q_stride_tok, q_stride_head;
  void* out;
  int64_t o_stride_tok, o_stride_head;
  const void* k_cache;
  const void* v_cache;
  int64_t k_stride_block, k_stride_tok, k_stride_head;
  int64_t v_stride_block, v_stride_tok, v_stride_head;
  const int32_t* block_tables;
  int64_t bt_stride;
  int64_t block_size, head_dim, group;  // group = num_heads / num_kv_heads
  float scale;
  int64_t window;   // sliding window in keys, 0 = full causal attention
  float* partials;  // split workspace, (m, l, acc[head_dim]) per row and split
};

// One (sequence, query tile, KV heads kv_head .. kv_head + num_kv - 1, KV split). With
// hg = num_kv * group query heads per token, row m of the item is query token m / hg of the
// tile and query head kv_head * group + m % hg (KV head kv_head + (m % hg) / group); it sees
// key positions [max(key_begin, q - W + 1), min(key_end, q + 1)), q = first_pos + m / hg (no
// lower limit but key_begin without a sliding window W). Tiles of >= kOneHeadRows rows per KV
// head take one KV head per item; smaller (decode-sized) tiles take every KV head, so an item
// reads each cache block (all heads of a token are adjacent) in one sequential pass.
struct WorkItem {
  int64_t q_row;      // flat query row of the tile's first token
  int64_t first_pos;  // position of that token in its sequence (context_len + j0)
  int64_t key_begin;  // first key position of the split (a multiple of block_size)
  int64_t key_end;    // one past its last key position
  int64_t partial;    // workspace offset of this split's (m, l, acc) rows; -1 = write `out`
  int32_t seq, kv_head, num_kv, q_count;
};

// The splits of one (sequence, query tile, KV head) that must be merged.
struct MergeGroup {
  int64_t q_row, partial;
  int32_t kv_head, num_kv, q_count, num_splits;
};

// Tiles with at least this many rows per KV head get one item per KV head (parallelism, and
// the item's rows stay cache-sized); smaller ones one item for all KV heads.
constexpr int64_t kOneHeadRows = 16;
// Default keys per KV split (rounded down to whole blocks, at least one).
constexpr int64_t kDefaultSplitKeys = 512;

struct Scratch {
  std::vector<float> q, acc, m, l, scores, kbuf, vbuf;
  Scratch(int64_t rows, int64_t block_size, int64_t head_dim)
      : q(rows * head_dim), acc(rows * head_dim), m(rows), l(rows), scores(rows * block_size),
        kbuf(block_size * head_dim), vbuf(block_size * head_dim) {}
};

// Pointer to float32 rows of one cache block's `n` tokens: the cache itself for float32, else
// the block converted once into `buf` (shared by all the item's rows).
template <typename T>
PS_INLINE const float* block_rows(const T* base, int64_t stride_tok, int64_t n, int64_t d,
                                  float* buf, int64_t* row_stride) {
  if constexpr (std::is_same_v<T, float>) {
    *row_stride = stride_tok;
    return base;
  } else {
    for (int64_t t = 0; t < n; ++t) load_row(base + t * stride_tok, buf + t * d, d, 1.0f);
    *row_stride = d;
    return buf;
  }
}

// Online-softmax update of row r with `valid` scores sr[0..valid) of a new key chunk: sr
// becomes the probabilities exp(s - m_new) (0 for t in [valid, n)), l and m advance, and the
// row's accumulator is rescaled by exp(m_old - m_new). valid >= 1.
PS_INLINE void softmax_update(float* sr, int64_t valid, int64_t n, float* mx, float* l,
                              float* ar, int64_t d) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < valid; ++t) block_max = std::max(block_max, sr[t]);
  const float m_new = std::max(*mx, block_max);
  const float alpha = exp_approx(*mx - m_new);  // 0 on the first chunk (mx = -inf)
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < valid; ++t) {
    sr[t] = exp_approx(sr[t] - m_new);
    sum += sr[t];
  }
  for (int64_t t = valid; t < n; ++t) sr[t] = 0.0f;
  *l = *l * alpha + sum;
  *mx = m_new;
  if (alpha != 1.0f) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) ar[i] *= alpha;
  }
}

// One row against `valid` keys of one block: scores, online-softmax update, acc += P V.
PS_INLINE void attend_row_block(const float* qr, const float* k, int64_t ks, const float* v,
                                int64_t vs, int64_t valid, int64_t d, float* sr, float* mx,
                                float* l, float* ar) {
  int64_t t = 0;
  for (; t + 4 <= valid; t += 4) dot4(qr, k + t * ks, ks, d, sr + t);
  for (; t < valid; ++t) sr[t] = dot(qr, k + t * ks, d);
  softmax_update(sr, valid, valid, mx, l, ar, d);
  // acc += P V, each element summed over t in order; 16 of them held in registers across the
  // keys (the same order as one axpy per key, without storing acc between keys)
  int64_t i0 = 0;
  for (; i0 + 16 <= d; i0 += 16) {
    float a[16];
#pragma omp simd
    for (int64_t i = 0; i < 16; ++i) a[i] = ar[i0 + i];
    for (t = 0; t < valid; ++t) {
      const float pt = sr[t];
      const float* vt = v + t * vs + i0;
#pragma omp simd
      for (int64_t i = 0; i < 16; ++i) a[i] += pt * vt[i];
    }
#pragma omp simd
    for (int64_t i = 0; i < 16; ++i) ar[i0 + i] = a[i];
  }
  for (t = 0; t < valid && i0 < d; ++t) {
    const float pt = sr[t];
    const float* vt = v + t * vs;
    for (int64_t i = i0; i < d; ++i) ar[i] += pt * vt[i];
  }
}

// Every item: block by block and, within a block, KV head by KV head (one sequential pass over
// the block), each K/V row read in place (float32) or converted once (16-bit) for all the rows
// of its KV head; dots and axpys vectorized over head_dim. A row's arithmetic depends on its
// position alone (which keys of which block it sees), not on the item's other rows.
template <typename T>
PS_INLINE void attend_blocks_loop(const AttnParams& p, const WorkItem& it, Scratch& s,
                                  int64_t rows) {
  const int64_t d = p.head_dim, g = p.group, bs = p.block_size;
  const int64_t hg = static_cast<int64_t>(it.num_kv) * g;  // query heads per token
  const int32_t* table = p.block_tables + static_cast<int64_t>(it.seq) * p.bt_stride;
  const T* k_base = static_cast<const T*>(p.k_cache) + it.kv_head * p.k_stride_head;
  const T* v_base = static_cast<const T*>(p.v_cache) + it.kv_head * p.v_stride_head;
  const int64_t head_bytes = it.num_kv * d * static_cast<int64_t>(sizeof(T));
  for (int64_t start = it.key_begin; start < it.key_end; start += bs) {
    const int64_t block = table[start / bs];
    const int64_t n = std::min(bs, it.key_end - start);  // tokens of this block in range
    if (start + bs < it.key_end) {
      // NOTE: blocks lie anywhere in the cache, so the hardware prefetcher cannot run ahead
      // across them: fetch the next block's rows of this item's heads while this one computes.
      const int64_t next = table[start / bs + 1];
      const int64_t n_next = std::min(bs, it.key_end - start - bs);
      for (int64_t t = 0; t < n_next; ++t) {
        const char* kr = reinterpret_cast<const char*>(
            k_base + next * p.k_stride_block + t * p.k_stride_tok);
        const char* vr = reinterpret_cast<const char*>(
            v_base + next * p.v_stride_block + t * p.v_stride_tok);
        for (int64_t off = 0; off < head_bytes; off += 64) {
          __builtin_prefetch(kr + off);
          __builtin_prefetch(vr + off);
        }
      }
    }
    for (int64_t h = 0; h < it.num_kv; ++h) {
      int64_t ks, vs;
      const float* k = block_rows(k_base + block * p.k_stride_block + h * p.k_stride_head,
                                  p.k_stride_tok, n, d, s.kbuf.data(), &ks);
      const float* v = block_rows(v_base + block * p.v_stride_block + h * p.v_stride_head,
                                  p.v_stride_tok, n, d, s.vbuf.data(), &vs);
      for (int64_t r = h * g; r < rows; r += (r % g == g - 1) ? hg - g + 1 : 1) {
        // rows of KV head h: h*g .. h*g+g-1 of every token; this row's token is r / hg and it
        // may see block offsets skip .. valid - 1: positions up to q_pos (causal) and, with a
        // sliding window W, from q_pos - W + 1
        const int64_t q_pos = it.first_pos + r / hg;
        const int64_t valid = std::min(n, q_pos - start + 1);
        const int64_t skip =
            p.window > 0 ? std::max<int64_t>(0, q_pos - p.window + 1 - start) : 0;
        if (valid <= skip) continue;
        attend_row_block(s.q.data() + r * d, k + skip * ks, ks, v + skip * vs, vs, valid - skip,
                         d, s.scores.data() + r * bs, s.m.data() + r, s.l.data() + r,
                         s.acc.data() + r * d);
      }
    }
  }
}

template <typename T>
PS_INLINE void attend_item(const AttnParams& p, const WorkItem& it, Scratch& s) {
  const int64_t d = p.head_dim, g = p.group;
  const int64_t hg = static_cast<int64_t>(it.num_kv) * g;  // query heads per token
  const int64_t rows = it.q_count * hg;
  float* acc = s.acc.data();
  const float* mx = s.m.data();
  const float* l = s.l.data();
  const T* query = static_cast<const T*>(p.query);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = query + (it.q_row + r / hg) * p.q_stride_tok +
                   (static_cast<int64_t>(it.kv_head) * g + r % hg) * p.q_stride_head;
    load_row(src, s.q.data() + r * d, d, p.scale);
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.0f;
  }
  std::fill(acc, acc + rows * d, 0.0f);
  attend_blocks_loop<T>(p, it, s, rows);

  if (it.partial < 0) {  // the whole key range: normalize and write out
    T* out = static_cast<T*>(p.out);
    for (int64_t r = 0; r < rows; ++r) {
      T* dst = out + (it.q_row + r / hg) * p.o_stride_tok +
               (static_cast<int64_t>(it.kv_head) * g + r % hg) * p.o_stride_head;
      store_row(acc + r * d, dst, d, 1.0f / l[r]);
    }
  } else {  // one split: leave (m, l, acc) for the merge
    float* part = p.partials + it.partial;
    for (int64_t r = 0; r < rows; ++r) {
      float* pr = part + r * (d + 2);
      pr[0] = mx[r];
      pr[1] = l[r];
      std::memcpy(pr + 2, acc + r * d, d * sizeof(float));
    }
  }
}

template <typename T>
void merge_group(const AttnParams& p, const MergeGroup& mg) {
  const int64_t d = p.head_dim, g = p.group;
  const int64_t hg = static_cast<int64_t>(mg.num_kv) * g;
  const int64_t rows = mg.q_count * hg;
  const int64_t split_stride = rows * (d + 2);
  std::vector<float> acc(d);
  T* out = static_cast<T*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    const float* first = p.partials + mg.partial + r * (d + 2);
    float m = -std::numeric_limits<float>::infinity();
    for (int32_t sp = 0; sp < mg.num_splits; ++sp) m = std::max(m, first[sp * split_stride]);
    float l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int32_t sp = 0; sp < mg.num_splits; ++sp) {
      const float* pr = first + sp * split_stride;
      if (pr[1] == 0.0f) continue;  // a split this row sees no key of (causal, window)
      const float w = std::exp(pr[0] - m);
      l += w * pr[1];
      for (int64_t i = 0; i < d; ++i) acc[i] += w * pr[2 + i];
    }
    T* dst = out + (mg.q_row + r / hg) * p.o_stride_tok +
             (static_cast<int64_t>(mg.kv_head) * g + r % hg) * p.o_stride_head;
    store_row(acc.data(), dst, d, 1.0f / l);
  }
}

// One function per (ISA, dtype); the always-inline body is vectorized under each target.
using ItemFn = void (*)(const AttnParams&, const WorkItem&, Scratch&);

#if defined(__x86_64__)
#define PS_DEFINE_ITEM(NAME, TARGET)                                                      \
  TARGET void NAME##_f32(const AttnParams& p, const WorkItem& it, Scratch& s) {           \
    attend_item<float>(p, it, s);                                                         \
  }                                                                                       \
  TARGET void NAME##_bf16(const AttnParams& p, const WorkItem& it, Scratch& s) {          \
    attend_item<c10::BFloat16>(p, it, s);                                                 \
  }                                                                                       \
  TARGET void NAME##_f16(const AttnParams& p, const WorkItem& it, Scratch& s) {           \
    attend_item<c10::Half>(p, it, s);                                                     \
  }
PS_DEFINE_ITEM(item_avx512, PS_TARGET_AVX512)
PS_DEFINE_ITEM(item_avx2, PS_TARGET_AVX2)
#endif
PS_DEFINE_ITEM(item_scalar, )

ItemFn pick_item_fn(Isa isa, at::ScalarType dtype) {
  PS_ISA_DTYPE_TABLE(ItemFn, table, item_scalar, item_avx2, item_avx512);
  return table[static_cast<int>(isa)][dtype_index(dtype)];
}

void check_cache(const at::Tensor& c, const char* name) {
  TORCH_CHECK_VALUE(c.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, "
                    "head_dim], got ", c.sizes());
  TORCH_CHECK_VALUE(c.stride(3) == 1, name, ": head_dim must be contiguous");
  TORCH_CHECK_VALUE(c.device().is_cpu(), name, " must be on the CPU");
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     int64_t split_keys, int64_t sliding_window) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "k_cache ", k_cache.sizes(),
                    " and v_cache ", v_cache.sizes(), " differ");
  TORCH_CHECK_VALUE(query.dim() == 3 && query.stride(2) == 1,
                    "query must be [num_tokens, num_heads, head_dim] with head_dim contiguous");
  TORCH_CHECK_VALUE(out.sizes() == query.sizes() && out.stride(2) == 1,
                    "out must have query's shape with head_dim contiguous");
  const auto dtype = query.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "paged_attention supports float32, bfloat16 and float16, got ", dtype);
  TORCH_CHECK_VALUE(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype &&
                        out.scalar_type() == dtype,
                    "query, out, k_cache and v_cache must share one dtype");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), d = query.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == d, "head_dim of query (", d, ") and cache (",
                    k_cache.size(3), ") differ");
  TORCH_CHECK_VALUE(hkv > 0 && num_heads % hkv == 0, "num_heads ", num_heads,
                    " is not a multiple of num_kv_heads ", hkv);
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->device().is_cpu(),
                      "block_tables, seq_lens and query_start_loc must be int32 CPU tensors");
  }
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.stride(1) == 1,
                    "block_tables must be [num_seqs, max_blocks] with contiguous rows");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(seq_lens.is_contiguous() && query_start_loc.is_contiguous() &&
                        query_start_loc.size(0) == num_seqs + 1 &&
                        block_tables.size(0) >= num_seqs,
                    "seq_lens [num_seqs], query_start_loc [num_seqs + 1] and block_tables "
                    "[num_seqs, max_blocks] disagree");
  TORCH_CHECK_VALUE(split_keys >= 0, "split_keys must be >= 0 (0 = the default ",
                    kDefaultSplitKeys, "), got ", split_keys);
  TORCH_CHECK_VALUE(sliding_window >= 0, "sliding_window must be >= 0 (0 = full), got ",
                    sliding_window);
  const int64_t window = sliding_window;
  // First key position the tile starting at position first_pos reads (its first row's window
  // start, 0 without a window); the keys of every later row start at or after it.
  const auto window_start = [window](int64_t first_pos) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  };
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0), max_blocks = block_tables.size(1);
  const int64_t g = num_heads / hkv;

  // Query tile: about 256 rows x 64 dims of q + acc per item (L2-sized), whole query tokens.
  const int64_t tile = std::clamp<int64_t>((256 * 64 / std::max<int64_t>(d, 1)) / g, 1, 64);

  // Validate, count the items without splits.
  TORCH_CHECK_VALUE(qsl[0] == 0 && qsl[num_seqs] <= num_tokens,
                    "query_start_loc must start at 0 and end within num_tokens");
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t ql = qsl[i + 1] - qsl[i], sl = lens[i];
    TORCH_CHECK_VALUE(ql >= 0 && sl >= ql, "sequence ", i, ": query_len ", ql, ", seq_len ",
                      sl, " (need seq_len >= query_len >= 0)");
    if (ql == 0) continue;
    const int64_t nb = (sl + bs - 1) / bs;
    TORCH_CHECK_INDEX(nb <= max_blocks, "sequence ", i, ": seq_len ", sl, " needs ", nb,
                      " blocks, block_tables has ", max_blocks);
    // blocks wholly before every window of the sequence are never read: any entry is fine
    for (int64_t b = window_start(sl - ql) / bs; b < nb; ++b) {
      const int32_t id = tables[i * bt_stride + b];
      TORCH_CHECK_INDEX(id >= 0 && id < num_blocks, "sequence ", i, ": block_tables[", i, ", ",
                        b, "] = ", id, " is not a block id in [0, ", num_blocks, ")");
    }
  }

  // Keys per split: whole blocks, fixed positions (a row's splits depend on its position only).
  const int64_t split = std::max<int64_t>(
      1, (split_keys > 0 ? split_keys : kDefaultSplitKeys) / bs) * bs;
  const int nthreads = std::max(1, at::get_num_threads());
  std::vector<WorkItem> items;
  std::vector<MergeGroup> merges;
  int64_t partial_floats = 0;
  int64_t max_rows = 1;  // rows of the largest item
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t ql = qsl[i + 1] - qsl[i], sl = lens[i];
    for (int64_t j0 = 0; j0 < ql; j0 += tile) {
      const int32_t count = static_cast<int32_t>(std::min(tile, ql - j0));
      const int64_t first_pos = sl - ql + j0;
      const int64_t key_end = first_pos + count;  // the tile's last row sees up to here
      const int64_t key_lo = window_start(first_pos) / bs * bs;  // the tile's first block read
      const int64_t split0 = key_lo / split;                     // its splits: split0 ..
      const int64_t splits = (key_end - 1) / split - split0 + 1;
      // KV heads per item: one for tiles of many rows, all of them for decode-sized tiles
      const int64_t num_kv = count * g >= kOneHeadRows ? 1 : hkv;
      const int64_t rows_floats = count * num_kv * g * (d + 2);
      max_rows = std::max(max_rows, count * num_kv * g);
      for (int64_t h = 0; h < hkv; h += num_kv) {
        const int64_t group_partial = splits > 1 ? partial_floats : -1;
        for (int64_t sp = 0; sp < splits; ++sp) {
          WorkItem it;
          it.q_row = qsl[i] + j0;
          it.first_pos = first_pos;
          it.key_begin = std::max(key_lo, (split0 + sp) * split);
          it.key_end = std::min(key_end, (split0 + sp + 1) * split);
          it.partial = splits > 1 ? group_partial + sp * rows_floats : -1;
          it.seq = static_cast<int32_t>(i);
          it.kv_head = static_cast<int32_t>(h);
          it.num_kv = static_cast<int32_t>(num_kv);
          it.q_count = count;
          items.push_back(it);
        }
        if (splits > 1) {
          merges.push_back({qsl[i] + j0, group_partial, static_cast<int32_t>(h),
                            static_cast<int32_t>(num_kv), count, static_cast<int32_t>(splits)});
          partial_floats += splits * rows_floats;
        }
      }
    }
  }

  AttnParams p;
  p.query = query.data_ptr();
  p.q_stride_tok = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.out = out.data_ptr();
  p.o_stride_tok = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_stride_block = k_cache.stride(0);
  p.k_stride_tok = k_cache.stride(1);
  p.k_stride_head = k_cache.stride(2);
  p.v_stride_block = v_cache.stride(0);
  p.v_stride_tok = v_cache.stride(1);
  p.v_stride_head = v_cache.stride(2);
  p.block_tables = tables;
  p.bt_stride = bt_stride;
  p.block_size = bs;
  p.head_dim = d;
  p.group = g;
  p.scale = static_cast<float>(scale);
  p.window = window;
  at::Tensor workspace;
  if (partial_floats > 0) {
    workspace = at::empty({partial_floats}, query.options().dtype(at::kFloat));
    p.partials = workspace.data_ptr<float>();
  } else {
    p.partials = nullptr;
  }

  const ItemFn fn = pick_item_fn(at_most(active_isa(), Isa::kAvx512), dtype);
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(nthreads) if (num_items > 1)
  {
    Scratch scratch(max_rows, bs, d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < num_items; ++w) fn(p, items[w], scratch);
  }
  if (!merges.empty()) {
    const int64_t num_merges = static_cast<int64_t>(merges.size());
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (num_merges > 1)
    for (int64_t w = 0; w < num_merges; ++w) {
      if (dtype == at::kFloat) {
        merge_group<float>(p, merges[w]);
      } else if (dtype == at::kBFloat16) {
        merge_group<c10::BFloat16>(p, merges[w]);
      } else {
        merge_group<c10::Half>(p, merges[w]);
      }
    }
  }
  // Rows of padding tokens (past query_start_loc[-1]) are zero, like the other backends.
  if (qsl[num_seqs] < num_tokens) out.narrow(0, qsl[num_seqs], num_tokens - qsl[num_seqs]).zero_();
  // Sequences with query_len 0 own no rows; nothing else is left unwritten.
}

// ---------------------------------------------------------------------------------------------
// KV-cache write

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2),
                d = k_cache.size(3);
  const int64_t num_tokens = slot_mapping.size(0);
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                        slot_mapping.is_contiguous(),
                    "slot_mapping must be a contiguous [num_tokens] int64 tensor");
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == hkv &&
                          t->size(2) == d && t->stride(2) == 1,
                      "key and value must be [num_tokens, num_kv_heads, head_dim] with "
                      "head_dim contiguous, got ", t->sizes());
    TORCH_CHECK_VALUE(t->scalar_type() == k_cache.scalar_type() &&
                          v_cache.scalar_type() == k_cache.scalar_type(),
                      "key, value and the caches must share one dtype");
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_INDEX(slots[t] < num_blocks * bs, "slot_mapping[", t, "] = ", slots[t],
                      " is past the cache's ", num_blocks * bs, " slots");
  }
  const int64_t elem = key.element_size(), row_bytes = d * elem;
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0),
                vs1 = value.stride(1);
  const int64_t kc0 = k_cache.stride(0), kc1 = k_cache.stride(1), kc2 = k_cache.stride(2);
  const int64_t vc0 = v_cache.stride(0), vc1 = v_cache.stride(1), vc2 = v_cache.stride(2);
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token: no slot
      const int64_t block = slot / bs, off = slot % bs;
      for (int64_t h = 0; h < hkv; ++h) {
        std::memcpy(kc + (block * kc0 + off * kc1 + h * kc2) * elem,
                    kp + (t * ks0 + h * ks1) * elem, row_bytes);
        std::memcpy(vc + (block * vc0 + off * vc1 + h * vc2) * elem,
                    vp + (t * vs0 + h * vs1) * elem, row_bytes);
      }
    }
  });
}

std::string cpu_isa() { return isa_name(active_isa()); }

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY(pagedserve, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "int split_keys=0, int sliding_window=0) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("cpu_isa() -> str", &pagedserve::cpu_isa);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_attention", &pagedserve::paged_attention);
  m.impl("reshape_and_cache", &pagedserve::reshape_and_cache);
}

// Shape-only kernels for meta / fake tensors (torch.compile traces through these): both ops
// only mutate their annotated arguments and return nothing.
TORCH_LIBRARY_IMPL(pagedserve, Meta, m) {
  m.impl("paged_attention",
         [](at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
            int64_t) {});
  m.impl("reshape_and_cache", [](const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                 const at::Tensor&) {});
}
