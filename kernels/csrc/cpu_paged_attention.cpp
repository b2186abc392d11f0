// Native CPU paged attention and KV-cache write for pagedserve (torch custom ops).
//
// Ops (namespace `pagedserve`, see TORCH_LIBRARY at the bottom for the schemas):
//   paged_attention(out!, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
//                   scale, split_keys=0, sliding_window=0, kv_layout=0)
//                                          one varlen kernel: decode, chunked prefill and
//                                          prefix-hit tails in one call
//   reshape_and_cache(key, value, k_cache!, v_cache!, slot_mapping, kv_layout=0)
//   cpu_isa() -> str                       the instruction-set step the kernels run now
//   attention_int8_body() -> str           the integer-product body an int8 pairs cache runs
//
// Layout (kernels/__init__.py draws the index arithmetic):
//   query, out        [num_tokens, num_heads, head_dim]
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], any strides on the
//                     first three dims, head_dim contiguous (so K and V may be halves of one
//                     combined tensor); the query's dtype, or quantized (--kv-cache-dtype, see
//                     KvQuant: int8 rows [.., head_dim + 1] with their scale code, float8)
//                     kv_layout 0 (rows) as above; kv_layout 1 (bf16 pairs, the CPU default
//                     for bf16, kernels/kv_layout.py): the same dense tensor, but each (block,
//                     KV head) holds its bs keys as K^T [head_dim / 2][bs][2] and V
//                     [bs / 2][head_dim][2], the operand layout of the bf16 pair products
//                     (VNNI-2), so attention copies whole rows instead of transposing
//                     an int8 cache in kv_layout 1: the same orders of int8 values, each
//                     followed by the (block, KV head)'s bs scale codes (cpu_attention_i8.h);
//                     a float8 one: the same orders, a byte a value, widened to bf16 pairs in
//                     registers by the kBf16Dp body (bf16 queries on avx512_bf16 / amx only)
//   block_tables      [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32;
//   query_start_loc   [num_seqs + 1] int32
//
// Algorithm. One work item = (sequence, query tile, KV head, KV split); items run in one
// OpenMP loop (dynamic schedule). An item's rows are the G = num_heads / num_kv_heads query
// heads of its KV head for every query token of its tile (about 192 rows; GQA: each K/V row
// is read once for all G heads). It walks its key range THROUGH THE BLOCK TABLE (no gather of
// the context, no padded copy) in chunks of 512 keys at fixed positions (FlashAttention-2,
// Dao 2023): per chunk the rows of its keys are collected block by block, then
//   S = Q K^T         a [rows x keys] product, float32 accumulation
//   online softmax    per row a running max m, sum l and float32 accumulator acc, rescaled
//                     by exp(m_old - m_new); keys a row may not see weigh exactly 0
//   acc += P V        a [rows x head_dim] product over the chunk's keys
// and the next chunk's blocks are prefetched (they lie anywhere in the cache). Keys past a
// row's causal limit (position context_len + j) are never weighed; keys past the tile's last
// row are never read.
// Decode at the memory limit (the float32 body, a rows cache, items of fewer than 16 rows):
// when a step has at least 4 (sequence, split) pairs of decodes per thread, a thread runs all
// the KV heads of one pair in a row (a unit, WorkItem::unit_heads), and while it computes a
// unit it asks for the next unit's K/V token by token, every head at once (a block's heads lie
// side by side: contiguous runs instead of one row in every few), a few lines per pass of
// the products (Scratch::pump); the first chunk of an item nobody queued is asked for in one
// burst. On the AVX2 EPYC this read decode K/V ~1.5-2x faster (docs/benchmarks.md).
// The products, by path (pick_path: the CPU step, the dtype and head_dim decide, nothing else):
//   amx          bf16, head_dim % 32 == 0, on a CPU with AMX tiles:
//                ATen's cpublas::brgemm (oneDNN's ukernel on AMX tiles), K^T and V packed
//                per chunk into bf16 pairs (VNNI-2) with AVX-512 transposes / permutes, P as
//                two bf16 parts (high, and the rest);
//   avx512_bf16  the same P, vdpbf16ps micro-kernels of up to 4 rows (a decode's G rows in one
//                tile), both parts of P in one pass over V; a pair-layout cache (kv_layout 1,
//                block_size % 16 == 0) is read in place, no per-chunk copy of K^T or V;
//   avx512 / avx2 / scalar (and float32 / float16 everywhere): float32 FMA micro-kernels
//                (plain loops compiled per target; on avx2 intrinsics: 6 rows x 16 columns
//                for S and P V, K^T by 8 x 8 transposes, a decode's up to 8 rows across 8
//                lanes): S from K^T (prefill tiles) or, for fewer than 16 rows (decode),
//                from the key rows in place with the rows across the vector lanes (the same
//                FMA chain per element either way); P V with head_dim across the lanes.
//   i8           an int8 cache in the pair layout (kv_layout 1), any query dtype, on every CPU:
//                integer products on the cache as stored (cpu_attention_i8.h; vpdpwssd on
//                AVX512-VNNI, vpmaddwd on AVX2, int32 loops), the float32 softmax between.
// Sliding window W > 0 (Beltagy et al. 2020, "Longformer"; Jiang et al. 2023, "Mistral 7B"):
// the row at position q sees keys max(0, q - W + 1) .. q only. An item's key range then starts
// at the block holding its first row's window start, so blocks wholly before every window of
// the tile are never read (their block-table entries may be -1 or any id) and the work is
// O(W) per row, not O(position).
// KV splits (flash-decoding, Dao et al. 2023) at FIXED key positions: the keys are cut every
// split_keys positions (default 512, whole chunks), an item covers one such range, and a row
// whose keys span several ranges has its (m, l, acc) per range merged in a second pass,
//   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,   M = max_s m_s.
// So a long context keeps both cores busy when few sequences run.
// The block-table cache itself is PagedAttention (Kwon et al., SOSP 2023).
//
// Row invariance. A row's result depends on its query, its position and its keys only, never
// on the rest of the step: its chunks and splits sit at fixed positions, each score is one
// float32 accumulator over the head dims in order, its softmax sums run in a fixed order over
// its own keys (a fixed 16-lane order), and each accumulator of P V adds the chunk's keys in order from the
// chunk's first key (zeros where it sees none). So a prefix-cache hit, another chunk size or
// another batch gives bitwise the same output row (the engine's determinism and
// --batch-invariant rest on it; tests/kernels/test_cpu_paged_attention.py checks every path).
// NOTE: oneDNN's AMX kernel sums a K with a tail, or from another start, differently, so the
// AMX P V always starts at the chunk's first key and runs over whole 32-key tiles.
// NOTE: the paths differ in rounding from each other (vdpbf16ps and AMX pair their products);
// each is tested against the float64 reference.
//
// Instruction sets: the best the CPU has is picked at run time (cpu_isa.h); PAGEDSERVE_CPU_ISA
// forces a lower step (read at every call; asking for more than the CPU has is an error). The
// scalar body is the compiler's baseline (x86-64: SSE2, 4 wide).
// All offsets are int64: a cache may hold more than 2**31 elements.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include "cpu_attention_i8.h"
#include "cpu_isa.h"
#include "cpu_math.h"
#include "cpu_vnni.h"

#include <algorithm>
#include <atomic>
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

// float32 -> bf16 with c10::BFloat16's rounding (nearest even, NaN -> 0x7FC0), vectorizable.
PS_INLINE void store_row(const float* src, c10::BFloat16* dst, int64_t n, float mul) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = src[i] * mul;
    const uint32_t u = __builtin_bit_cast(uint32_t, v);
    const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    d[i] = v != v ? uint16_t{0x7FC0} : rounded;
  }
}

// ---------------------------------------------------------------------------------------------
// Quantized KV cache (--kv-cache-dtype): how a cache row stores its head_dim values.
//   kInt8      head_dim int8 values, then the row's scale code c (1 byte): the row is
//              [num_blocks, block_size, num_kv_heads, head_dim + 1] int8; value = q * scale,
//              scale = code_scale(c), c the smallest code >= amax / 127 (scale_code) per
//              (token, KV head), q = round-half-even(x / scale) clamped to [-127, 127]
//              (symmetric, per token and head; kernels/kv_quant.py has the code's format)
//   kFp8E4m3   float8_e4m3fn, kFp8E5m2 float8_e5m2: [..., head_dim], per-tensor scale 1.0
//              (vLLM's default k_scale / v_scale); writes saturate to the finite range
// An int8 cache in the pair layout (kv_layout 1, the CPU default for int8) is read as stored:
// integer products with each row's scale folded into their epilogues (Path::kI8,
// cpu_attention_i8.h). Other quantized caches (rows, float8) dequantize to the query's dtype,
// then the same products run as for an unquantized cache: the bf16 pair bodies while they
// pack K^T / V (load32_bf16), the float32 body a chunk's rows once into the scratch
// (dequant_row); both round the same bits.
enum class KvQuant : int { kNone = 0, kInt8 = 1, kFp8E4m3 = 2, kFp8E5m2 = 3 };

// An int8 row's scale code -> its float32 scale: an unsigned 8-bit float (5 exponent, 3
// mantissa bits), bits (c << 20) + 0x35000000, 0 for code 0 (kernels/kv_quant.py).
PS_INLINE float code_scale(uint8_t c) {
  const uint32_t bits = (static_cast<uint32_t>(c) << 20) + 0x35000000u;
  return __builtin_bit_cast(float, c == 0 ? 0u : bits);
}

// float32 scale >= 0 -> the smallest code whose scale is >= it, clamped to 1 .. 255; 0 for 0.
PS_INLINE uint8_t scale_code(float scale) {
  if (!(scale > 0.0f)) return 0;
  const int32_t t = static_cast<int32_t>(__builtin_bit_cast(uint32_t, scale) - 0x35000000u);
  const int32_t c = (t >> 20) + ((t & 0xFFFFF) != 0 ? 1 : 0);
  return static_cast<uint8_t>(std::clamp(c, 1, 255));
}

// float8_e4m3fn bits -> float32, exact and branch-free (vectorizes); NaN (0x7F) never stored.
PS_INLINE float e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xFu, m = b & 0x7u;
  const uint32_t normal = ((e + 120u) << 23) | (m << 20);
  const uint32_t sub = __builtin_bit_cast(uint32_t, static_cast<float>(m) * 0x1p-9f);
  return __builtin_bit_cast(float, (e == 0 ? sub : normal) | sign);
}

// float8_e5m2 bits -> float32, exact and branch-free; inf / NaN never stored.
PS_INLINE float e5m2_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 2) & 0x1Fu, m = b & 0x3u;
  const uint32_t normal = ((e + 112u) << 23) | (m << 21);
  const uint32_t sub = __builtin_bit_cast(uint32_t, static_cast<float>(m) * 0x1p-16f);
  return __builtin_bit_cast(float, (e == 0 ? sub : normal) | sign);
}

// float32 -> T with c10's rounding (nearest even), one element (inlined into vector loops).
PS_INLINE void put(float v, float* dst) { *dst = v; }
PS_INLINE void put(float v, c10::BFloat16* dst) {
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
PS_INLINE void put(float v, c10::Half* dst) { *dst = c10::Half(v); }

// One cache row (d values of a quantized cache, see KvQuant) as T.
template <typename T>
PS_INLINE void dequant_row(KvQuant q, const uint8_t* src, int64_t d, T* dst) {
  if (q == KvQuant::kInt8) {
    const float scale = code_scale(src[d]);
    const int8_t* v = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) put(static_cast<float>(v[i]) * scale, dst + i);
  } else if (q == KvQuant::kFp8E4m3) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) put(e4m3_to_float(src[i]), dst + i);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) put(e5m2_to_float(src[i]), dst + i);
  }
}

// ---------------------------------------------------------------------------------------------
// Paged attention: work items, chunks and the tile products

struct AttnParams {
  const void* query;
  int64_t q_stride_tok, q_stride_head;
  void* out;
  int64_t o_stride_tok, o_stride_head;
  const void* k_cache;
  const void* v_cache;
  int64_t k_stride_block, k_stride_tok, k_stride_head;  // in BYTES (the cache may be int8/fp8)
  int64_t v_stride_block, v_stride_tok, v_stride_head;
  KvQuant kv_quant;     // how the caches store K/V (kNone: as the query's dtype)
  bool vnni;            // kv_layout 1: each (block, KV head) holds K^T and V in bf16 pairs
  int64_t kv_row_bytes;  // bytes of one (token, head) row in the cache (the int8 scale included)
  const int32_t* block_tables;
  int64_t bt_stride;
  int64_t block_size, head_dim, group;  // group = num_heads / num_kv_heads
  int64_t chunk;    // keys per online-softmax step (whole blocks; splits are whole chunks)
  int64_t ldk;      // columns of the per-chunk buffers (>= chunk + 32, a multiple of 16)
  float scale;
  int64_t window;   // sliding window in keys, 0 = full causal attention
  float* partials;  // split workspace, (m, l, acc[head_dim]) per row and split
};

// One (sequence, query tile, KV head, KV split). Row r of the item is query token r / group of
// the tile and query head kv_head * group + r % group; it sees key positions
// [max(key_begin, q - W + 1), min(key_end, q + 1)), q = first_pos + r / group (no lower limit
// but key_begin without a sliding window W). Both bounds depend on the row alone: key_begin is
// the split's start or, when later, the tile's first window start rounded down to a block,
// which no row's window starts before.
struct WorkItem {
  int64_t q_row;      // flat query row of the tile's first token
  int64_t first_pos;  // position of that token in its sequence (context_len + j0)
  int64_t key_begin;  // first key position read (a multiple of block_size)
  int64_t key_end;    // one past the last
  int64_t partial;    // workspace offset of this split's (m, l, acc) rows; -1 = write `out`
  int32_t seq, kv_head, q_count;
  // > 1: the item is kv_head of a unit of unit_heads items that one thread runs in a row, the
  // KV heads 0 .. unit_heads - 1 of one (sequence, query tile, split), consecutive in the
  // item list (so the unit starts at this item - kv_head); see paged_attention.
  int32_t unit_heads;
};

// The splits of one (sequence, query tile, KV head) that must be merged.
struct MergeGroup {
  int64_t q_row, partial;
  int32_t kv_head, q_count, num_splits;
};

// Query rows per tile (whole tokens, so group * tokens), about an L2's worth of scores.
constexpr int64_t kTileRows = 192;
constexpr int64_t kMaxTileTokens = 64;
// Keys per online-softmax step (rounded down to whole blocks, at least one).
constexpr int64_t kChunkKeys = 512;
// Default keys per KV split (rounded down to whole chunks, at least one).
constexpr int64_t kDefaultSplitKeys = 512;

// The bodies of a chunk's products. kF32: float32 FMAs (float32 caches on every ISA, 16-bit
// ones below avx512_bf16 or with head_dim % 32 != 0); kBf16Dp: vdpbf16ps; kAmx: AMX tiles
// through cpublas::brgemm; kI8: integer products over an int8 pair-layout cache, any query
// dtype (cpu_attention_i8.h). All share the chunk loop; kF32 and kI8 share softmax_row.
enum class Path : int { kF32 = 0, kBf16Dp = 1, kAmx = 2, kI8 = 3 };

// Whether the kBf16Dp body reads a pair-layout cache in place (no copy of K^T and V per
// chunk): whole 16-key runs of K^T words lie in one block when block_size % 16 == 0.
PS_INLINE bool reads_in_place(const AttnParams& p) { return p.vnni && p.block_size % 16 == 0; }

// Whether the kBf16Dp body widens a float8 pair-layout chunk into its packed buffers first
// (tiles of more than 4 rows: prefill), instead of widening each run in place per row tile.
PS_INLINE bool widens_f8(const AttnParams& p, int64_t rows) {
  return p.vnni && rows > 4 && (p.kv_quant == KvQuant::kFp8E4m3 || p.kv_quant == KvQuant::kFp8E5m2);
}

// 64-byte aligned per-thread buffers of one item (sized for the call's largest item), carved
// out of one thread-local allocation that only ever grows (no allocation per layer call).
struct Scratch {
  float* s;          // [rows][ldk] scores; probabilities in place on the kF32 path
  uint16_t* p16;     // [rows][ldk] bf16 probabilities, their high part (kBf16Dp, kAmx)
  uint16_t* p16lo;   // [rows][ldk] and the bf16 rounding of what that left (p - high)
  float* acc;        // [rows][d]
  float* m;          // [rows]
  float* l;          // [rows]
  float* qf;         // [rows][d] float32 query (kF32)
  uint16_t* q16;     // [rows][d] bf16 query (kBf16Dp, kAmx)
  float* kt;         // [d][ldk] K^T float32 (kF32)
  uint32_t* kp;      // [d / 2][ldk] K^T in bf16 pairs (VNNI-2: dims 2j, 2j+1 of key t at [j][t])
  float* vf;         // [ldk][d] V converted to float32 (kF32 with a 16-bit cache)
  uint16_t* vp;      // [ldk / 2][d][2] V in bf16 pairs (keys 2i, 2i+1 of dim e at [i][e])
  float* zero;       // [d] zeros: the row of a key outside the chunk's range
  int64_t* lo;       // [rows] the chunk's columns [lo, hi) a row sees (lo == hi: none)
  int64_t* hi;       // [rows]
  float* bmax;       // [rows] scratch of the bf16 softmax: a row's largest raw score
  float* alpha;      // [rows] and its rescale factor
  float* qs;         // [rows] kI8: the int16 query row's scale (q16 holds the row)
  float* ws;         // [rows] kI8: the int16 weights' scale of the chunk (p16 holds them)
  float* ks;         // [ldk] kI8: the chunk's keys' K scales (0 past the keys it reads)
  float* vs;         // [ldk] and their V scales
  const void** krow;  // [ldk] K rows of the chunk's keys (nullptr: outside the range)
  const void** vrow;  // [ldk]
  float* kst;         // [ldk][d] (as the query's dtype) K rows dequantized from an int8/fp8 cache
  float* vst;         // [ldk][d] and V's
  const char** kblk;  // [ldk] kv_layout 1: the (block, KV head) K of the chunk's block i at [i]
  const char** vblk;  // [ldk] and its V
  int64_t klo, khi;   // kv_layout 1: the chunk's keys [klo, khi) (chunk columns) it reads
  // The prefetch queue of the in-place bf16 path (reads_in_place): the (block, KV head) pieces
  // of K, then of V, of the next chunk this thread reads (the item's own next chunk, or the
  // first chunk of the item it runs next), asked for a few lines at a time between the
  // chunk's tiles (pump), so the memory reads overlap the products instead of stalling in one
  // burst; a software prefetch holds a miss buffer until its line arrives, so a burst of them
  // stalls the core.
  const char** pf;           // [2 * ldk] the pieces
  int64_t pf_n = 0, pf_i = 0, pf_off = 0, pf_bytes = 0, pf_step = 0;
  const void* next = nullptr;    // the item this thread runs next (nullptr: none)
  const void* next_unit = nullptr;  // the first item of the unit it runs after this one's
  const void* warmed = nullptr;  // the item (the unit's first) whose first chunk the queue held
  PS_INLINE void pump(int64_t lines) {
    for (; lines > 0 && pf_i < pf_n; --lines) {
      __builtin_prefetch(pf[pf_i] + pf_off, 0, 2);
      pf_off += 64;
      if (pf_off >= pf_bytes) {
        pf_off = 0;
        ++pf_i;
      }
    }
  }
  PS_INLINE void pump() { pump(pf_step); }
  Scratch(int64_t rows, int64_t d, int64_t ldk) {
    size_t off = 0;
    std::vector<std::pair<void**, size_t>> parts = {
        {reinterpret_cast<void**>(&s), rows * ldk * 4}, {reinterpret_cast<void**>(&p16), rows * ldk * 2},
        {reinterpret_cast<void**>(&p16lo), rows * ldk * 2},
        {reinterpret_cast<void**>(&acc), rows * d * 4}, {reinterpret_cast<void**>(&m), rows * 4},
        {reinterpret_cast<void**>(&l), rows * 4}, {reinterpret_cast<void**>(&qf), rows * d * 4},
        {reinterpret_cast<void**>(&q16), rows * d * 2}, {reinterpret_cast<void**>(&kt), d * ldk * 4},
        {reinterpret_cast<void**>(&kp), d * ldk * 2}, {reinterpret_cast<void**>(&vf), ldk * d * 4},
        {reinterpret_cast<void**>(&vp), ldk * d * 2}, {reinterpret_cast<void**>(&zero), d * 4},
        {reinterpret_cast<void**>(&lo), rows * 8}, {reinterpret_cast<void**>(&hi), rows * 8},
        {reinterpret_cast<void**>(&bmax), rows * 4}, {reinterpret_cast<void**>(&alpha), rows * 4},
        {reinterpret_cast<void**>(&qs), rows * 4}, {reinterpret_cast<void**>(&ws), rows * 4},
        {reinterpret_cast<void**>(&ks), ldk * 4}, {reinterpret_cast<void**>(&vs), ldk * 4},
        {reinterpret_cast<void**>(&krow), ldk * sizeof(void*)},
        {reinterpret_cast<void**>(&vrow), ldk * sizeof(void*)},
        {reinterpret_cast<void**>(&kst), ldk * d * 4}, {reinterpret_cast<void**>(&vst), ldk * d * 4},
        {reinterpret_cast<void**>(&kblk), ldk * sizeof(void*)},
        {reinterpret_cast<void**>(&vblk), ldk * sizeof(void*)},
        {reinterpret_cast<void**>(&pf), 2 * ldk * sizeof(void*)}};
    std::vector<size_t> offs;
    for (auto& part : parts) {
      offs.push_back(off);
      off += (part.second + 63) / 64 * 64;
    }
    static thread_local std::vector<char> mem;
    if (mem.size() < off + 64) mem.resize(off + 64);
    char* base = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64;
    for (size_t i = 0; i < parts.size(); ++i) *parts[i].first = base + offs[i];
    std::fill(zero, zero + d, 0.0f);
  }
};

// Online-softmax step of row r (float32 path) over the chunk's columns [c0, c1), which it sees
// at [lo, hi) (lo < hi): the raw dots sr[lo .. hi) become probabilities exp(scale s - m_new)
// in place, the columns of [c0, c1) it does not see 0; l and m advance, the row's accumulator
// is rescaled by exp(m_old - m_new). Every step depends on the row's own columns [lo, hi)
// only: l adds its probabilities in a fixed order (16 lanes, lane i taking columns lo + i,
// lo + i + 16, ..., then a fixed tree), never one that depends on the address or on how the
// loop vectorizes.
PS_INLINE void softmax_row(float* sr, int64_t c0, int64_t c1, int64_t lo, int64_t hi,
                           float scale, float* mx, float* l, float* ar, int64_t d) {
  float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
  for (int64_t t = lo; t < hi; ++t) block_max = block_max < sr[t] ? sr[t] : block_max;
  const float m_new = std::max(*mx, block_max * scale);  // (scale > 0: max commutes)
  const float alpha = exp_approx(*mx - m_new);            // 0 on the row's first keys
  float lanes[16] = {0.0f};
  int64_t t = lo;
  for (; t + 16 <= hi; t += 16) {
#pragma omp simd
    for (int i = 0; i < 16; ++i) {
      sr[t + i] = exp_approx(sr[t + i] * scale - m_new);
      lanes[i] += sr[t + i];
    }
  }
  for (int i = 0; t + i < hi; ++i) {
    sr[t + i] = exp_approx(sr[t + i] * scale - m_new);
    lanes[i] += sr[t + i];
  }
  for (int w = 8; w > 0; w /= 2) {
    for (int i = 0; i < w; ++i) lanes[i] += lanes[i + w];
  }
  std::fill(sr + c0, sr + lo, 0.0f);
  std::fill(sr + hi, sr + c1, 0.0f);
  *l = *l * alpha + lanes[0];
  *mx = m_new;
  if (alpha != 1.0f) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) ar[i] *= alpha;
  }
}

// --- kF32 body: K^T and V as float32, FMA tiles (plain loops, vectorized per target) ---------

// s[m][j0 .. j0 + 32) = q[m] . K^T[:, j0 ..] for MR rows: each element one FMA chain over the
// head dims in order.
template <int MR>
PS_INLINE void qk_tile_f32(const float* q, int64_t d, const float* kt, int64_t ldk, int64_t j0,
                           float* s) {
  float a[MR][32];
  for (int m = 0; m < MR; ++m) {
#pragma omp simd
    for (int c = 0; c < 32; ++c) a[m][c] = 0.0f;
  }
  for (int64_t e = 0; e < d; ++e) {
    const float* kv = kt + e * ldk + j0;
    for (int m = 0; m < MR; ++m) {
      const float qv = q[m * d + e];
#pragma omp simd
      for (int c = 0; c < 32; ++c) a[m][c] += qv * kv[c];
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(s + m * ldk + j0, a[m], 32 * sizeof(float));
}

// acc[m][e0 .. e0 + 32) += sum over keys t in [c0, c1), in order, of p[m][t] V[t][e0 ..].
template <int MR>
PS_INLINE void pv_tile_f32(const float* p, int64_t ldk, const void* const* vrow, int64_t c0,
                           int64_t c1, int64_t e0, float* acc, int64_t d) {
  float a[MR][32];
  for (int m = 0; m < MR; ++m) {
#pragma omp simd
    for (int c = 0; c < 32; ++c) a[m][c] = acc[m * d + e0 + c];
  }
  for (int64_t t = c0; t < c1; ++t) {
    const float* vt = static_cast<const float*>(vrow[t]) + e0;
    for (int m = 0; m < MR; ++m) {
      const float pm = p[m * ldk + t];
#pragma omp simd
      for (int c = 0; c < 32; ++c) a[m][c] += pm * vt[c];
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(acc + m * d + e0, a[m], 32 * sizeof(float));
}

// The same, one element column at a time: head dims past the last multiple of 32.
PS_INLINE void pv_tail_f32(const float* p, int64_t ldk, const void* const* vrow, int64_t c0,
                           int64_t c1, int64_t e0, int64_t rows, float* acc, int64_t d) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t e = e0; e < d; ++e) {
      float a = acc[m * d + e];
      for (int64_t t = c0; t < c1; ++t) a += p[m * ldk + t] * static_cast<const float*>(vrow[t])[e];
      acc[m * d + e] = a;
    }
  }
}

#if defined(__x86_64__)
// The AVX2 bodies of the two products (the generic 4 x 32 tiles above need all 16 ymm
// registers for their accumulators and spill): MR rows x 16 columns, 2 ymm accumulators per
// row, the column pair loaded once for all MR rows and the row's factor broadcast (12
// accumulators + 2 loads + 1 broadcast at MR = 6, as the linear kernel's tile_f32_avx2).
// Each element is the same FMA chain as qk_tile_f32's / pv_tile_f32's (and
// qk_keys4_rows16's), for every MR, so the row invariance above holds on this body too.
constexpr int kTileMAvx2 = 6;

// s[m][j0 .. j0 + 16) = q[m] . K^T[:, j0 ..] for MR rows.
template <int MR>
PS_TARGET_AVX2 PS_INLINE void qk_tile16_avx2(const float* q, int64_t d, const float* kt,
                                             int64_t ldk, int64_t j0, float* s) {
  __m256 a0[MR], a1[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
  for (int64_t e = 0; e < d; ++e) {
    const __m256 k0 = _mm256_loadu_ps(kt + e * ldk + j0);
    const __m256 k1 = _mm256_loadu_ps(kt + e * ldk + j0 + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 qv = _mm256_broadcast_ss(q + m * d + e);
      a0[m] = _mm256_fmadd_ps(qv, k0, a0[m]);
      a1[m] = _mm256_fmadd_ps(qv, k1, a1[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(s + m * ldk + j0, a0[m]);
    _mm256_storeu_ps(s + m * ldk + j0 + 8, a1[m]);
  }
}

// acc[m][e0 .. e0 + 16) += sum over keys t in [c0, c1), in order, of p[m][t] V[t][e0 ..].
template <int MR>
PS_TARGET_AVX2 PS_INLINE void pv_tile16_avx2(const float* p, int64_t ldk,
                                             const void* const* vrow, int64_t c0, int64_t c1,
                                             int64_t e0, float* acc, int64_t d, Scratch* pf) {
  __m256 a0[MR], a1[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    a0[m] = _mm256_loadu_ps(acc + m * d + e0);
    a1[m] = _mm256_loadu_ps(acc + m * d + e0 + 8);
  }
  for (int64_t t = c0; t < c1; ++t) {
    if (pf != nullptr && (t - c0) % 8 == 0) pf->pump();
    const float* vt = static_cast<const float*>(vrow[t]) + e0;
    const __m256 v0 = _mm256_loadu_ps(vt);
    const __m256 v1 = _mm256_loadu_ps(vt + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 pm = _mm256_broadcast_ss(p + m * ldk + t);
      a0[m] = _mm256_fmadd_ps(pm, v0, a0[m]);
      a1[m] = _mm256_fmadd_ps(pm, v1, a1[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(acc + m * d + e0, a0[m]);
    _mm256_storeu_ps(acc + m * d + e0 + 8, a1[m]);
  }
}

// In-register transpose of an 8 x 8 float32 matrix (r[i] = row i in, column i out).
PS_TARGET_AVX2 PS_INLINE void transpose8x8_ps(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// 8 values of a float32 or bf16 cache row from dim e on, as float32.
template <typename T>
PS_TARGET_AVX2 PS_INLINE __m256 load8_f32_avx2(const T* row, int64_t e) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(row + e);
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + e));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
}

// Not inlined: K^T [d][ldk] float32, columns [c0, c1p) (c1p - c0 a multiple of 32), from the
// chunk's key rows (nullptr: zeros), 8 keys x 8 dims per in-register transpose (the generic
// body moves one element at a time, which a decode's few rows do not amortize).
template <typename T>
PS_TARGET_AVX2 void kt_rows_avx2(const void* const* krow, int64_t c0, int64_t c1p, int64_t d,
                                 float* kt, int64_t ldk) {
  const int64_t d8 = d / 8 * 8;
  for (int64_t t0 = c0; t0 < c1p; t0 += 8) {
    const T* k[8];
    for (int i = 0; i < 8; ++i) k[i] = static_cast<const T*>(krow[t0 + i]);
    for (int64_t e0 = 0; e0 < d8; e0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        r[i] = k[i] != nullptr ? load8_f32_avx2<T>(k[i], e0) : _mm256_setzero_ps();
      }
      transpose8x8_ps(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(kt + (e0 + j) * ldk + t0, r[j]);
    }
    for (int64_t e = d8; e < d; ++e) {
      for (int i = 0; i < 8; ++i) {
        kt[e * ldk + t0 + i] = k[i] != nullptr ? static_cast<float>(k[i][e]) : 0.0f;
      }
    }
  }
}

// Not inlined (the chunk loop around them has no target of its own): S[rows][c0 .. c1p) =
// Q K^T from the float32 K^T buffer, c1p - c0 a multiple of 32.
PS_TARGET_AVX2 void qk_rows_f32_avx2(const float* qf, int64_t d, const float* kt, int64_t ldk,
                                     int64_t c0, int64_t c1p, int64_t rows, float* s) {
  for (int64_t j0 = c0; j0 < c1p; j0 += 16) {
    int64_t m = 0;
    for (; m + kTileMAvx2 <= rows; m += kTileMAvx2) {
      qk_tile16_avx2<kTileMAvx2>(qf + m * d, d, kt, ldk, j0, s + m * ldk);
    }
    const float* qm = qf + m * d;
    float* sm = s + m * ldk;
    switch (rows - m) {
      case 5: qk_tile16_avx2<5>(qm, d, kt, ldk, j0, sm); break;
      case 4: qk_tile16_avx2<4>(qm, d, kt, ldk, j0, sm); break;
      case 3: qk_tile16_avx2<3>(qm, d, kt, ldk, j0, sm); break;
      case 2: qk_tile16_avx2<2>(qm, d, kt, ldk, j0, sm); break;
      case 1: qk_tile16_avx2<1>(qm, d, kt, ldk, j0, sm); break;
      default: break;
    }
  }
}

// Not inlined: acc[rows][0 .. d16) += P[rows][c0 .. c1) V, d16 = d rounded down to 16.
PS_TARGET_AVX2 void pv_rows_f32_avx2(const float* p, int64_t ldk, const void* const* vrow,
                                     int64_t c0, int64_t c1, int64_t rows, float* acc,
                                     int64_t d, int64_t d16, Scratch* pf) {
  for (int64_t e0 = 0; e0 < d16; e0 += 16) {
    int64_t m = 0;
    for (; m + kTileMAvx2 <= rows; m += kTileMAvx2) {
      pv_tile16_avx2<kTileMAvx2>(p + m * ldk, ldk, vrow, c0, c1, e0, acc + m * d, d, pf);
    }
    const float* pm = p + m * ldk;
    float* am = acc + m * d;
    switch (rows - m) {  // (decode: all of a KV head's rows in one pass over V)
      case 5: pv_tile16_avx2<5>(pm, ldk, vrow, c0, c1, e0, am, d, pf); break;
      case 4: pv_tile16_avx2<4>(pm, ldk, vrow, c0, c1, e0, am, d, pf); break;
      case 3: pv_tile16_avx2<3>(pm, ldk, vrow, c0, c1, e0, am, d, pf); break;
      case 2: pv_tile16_avx2<2>(pm, ldk, vrow, c0, c1, e0, am, d, pf); break;
      case 1: pv_tile16_avx2<1>(pm, ldk, vrow, c0, c1, e0, am, d, pf); break;
      default: break;
    }
  }
}
#endif

#if defined(__x86_64__)
// Key element e of a cache row as float32 in all 8 lanes.
template <typename T>
PS_TARGET_AVX2 PS_INLINE __m256 broadcast_key_avx2(const T* k) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_broadcast_ss(k);
  } else {
    return _mm256_set1_ps(static_cast<float>(*k));
  }
}

// Decode on AVX2, up to 8 rows: s[r][c0 .. c1p) with the rows across the 8 lanes of one ymm
// register (Q^T [d][8], rows zero-padded) and 8 keys per pass, their rows read in place (8
// independent FMA chains: the generic 16-lane body computed 16 lanes for a decode's G = 3
// rows, and zeroed its accumulators through memory for every 4 keys). Each score is the same
// FMA chain over the head dims in order as the prefill tiles', so the row invariance holds.
template <typename T>
PS_TARGET_AVX2 void qk_keys8_rows8_avx2(const float* qt, int64_t d, const void* const* krow,
                                        const void* zero, int64_t rows, float* s, int64_t ldk,
                                        int64_t c0, int64_t c1p, Scratch& sc) {
  for (int64_t t = c0; t < c1p; t += 8) {
    sc.pump();
    const T* k[8];
    for (int kb = 0; kb < 8; ++kb) {
      const void* row = krow[t + kb];
      k[kb] = static_cast<const T*>(row != nullptr ? row : zero);
    }
    __m256 a[8];
    for (int kb = 0; kb < 8; ++kb) a[kb] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      const __m256 qe = _mm256_loadu_ps(qt + e * 8);
#pragma GCC unroll 8
      for (int kb = 0; kb < 8; ++kb) {
        a[kb] = _mm256_fmadd_ps(qe, broadcast_key_avx2<T>(k[kb] + e), a[kb]);
      }
    }
    transpose8x8_ps(a);  // a[r] = row r's scores of keys t .. t + 8
    for (int64_t r = 0; r < rows; ++r) _mm256_storeu_ps(s + r * ldk + t, a[r]);
  }
}
#endif

// Few rows (decode): s[r][t .. t + 4) for up to 16 rows held across the vector lanes, the
// keys' rows read in place (no K^T): each element is the same FMA chain over the head dims in
// order as qk_tile_f32's, so a row's scores do not depend on which of the two ran.
template <typename T>
PS_INLINE void qk_keys4_rows16(const float* qt, int64_t d, const T* const* k, int64_t rows,
                               float* s, int64_t ldk, int64_t t) {
  float a[4][16];
  for (int kb = 0; kb < 4; ++kb) {
#pragma omp simd
    for (int i = 0; i < 16; ++i) a[kb][i] = 0.0f;
  }
  for (int64_t e = 0; e < d; ++e) {
    const float* qe = qt + e * 16;
    for (int kb = 0; kb < 4; ++kb) {
      const float kv = static_cast<float>(k[kb][e]);
#pragma omp simd
      for (int i = 0; i < 16; ++i) a[kb][i] += qe[i] * kv;
    }
  }
  for (int kb = 0; kb < 4; ++kb) {
    for (int64_t r = 0; r < rows; ++r) s[r * ldk + t + kb] = a[kb][r];
  }
}

template <typename T, Isa kIsa>
PS_INLINE void chunk_products_f32_qk(const AttnParams& p, Scratch& s, int64_t rows, int64_t c0,
                                     int64_t c1p) {
  const int64_t d = p.head_dim, ldk = p.ldk;
#if defined(__x86_64__)
  if constexpr (kIsa == Isa::kAvx2) {
    if (rows <= 8) {  // Q^T [d][8] (rows zero-padded) in the K^T buffer, keys read in place
      float* qt = s.kt;
      for (int64_t e = 0; e < d; ++e) {
        for (int64_t r = 0; r < 8; ++r) qt[e * 8 + r] = r < rows ? s.qf[r * d + e] : 0.0f;
      }
      qk_keys8_rows8_avx2<T>(qt, d, s.krow, s.zero, rows, s.s, ldk, c0, c1p, s);
      return;
    }
  }
#endif
  if (rows < 16) {  // Q^T [d][16] (rows zero-padded) in the K^T buffer, keys read in place
    float* qt = s.kt;
    for (int64_t e = 0; e < d; ++e) {
      for (int64_t r = 0; r < 16; ++r) qt[e * 16 + r] = r < rows ? s.qf[r * d + e] : 0.0f;
    }
    const T* zero = reinterpret_cast<const T*>(s.zero);  // (all-zero bits: 0 in every dtype)
    for (int64_t t = c0; t < c1p; t += 4) {
      if ((t - c0) % 8 == 0) s.pump();
      const T* k[4];
      for (int kb = 0; kb < 4; ++kb) {
        const void* row = s.krow[t + kb];
        k[kb] = row != nullptr ? static_cast<const T*>(row) : zero;
      }
      qk_keys4_rows16<T>(qt, d, k, rows, s.s, ldk, t);
    }
    return;
  }
#if defined(__x86_64__)
  if constexpr (kIsa == Isa::kAvx2 && !std::is_same_v<T, c10::Half>) {
    kt_rows_avx2<T>(s.krow, c0, c1p, d, s.kt, ldk);
    qk_rows_f32_avx2(s.qf, d, s.kt, ldk, c0, c1p, rows, s.s);
    return;
  }
#endif
  // K^T, float32, columns [c0, c1p) (zeros outside the range), in 16 x 16 blocks
  for (int64_t t0 = c0; t0 < c1p; t0 += 16) {
    for (int64_t e0 = 0; e0 < d; e0 += 16) {
      const int64_t e1 = std::min(e0 + 16, d);
      for (int64_t i = 0; i < 16; ++i) {
        const T* kr = static_cast<const T*>(s.krow[t0 + i]);
        float* dst = s.kt + t0 + i;
        if (kr == nullptr) {
          for (int64_t e = e0; e < e1; ++e) dst[e * ldk] = 0.0f;
        } else {
          for (int64_t e = e0; e < e1; ++e) dst[e * ldk] = static_cast<float>(kr[e]);
        }
      }
    }
  }
#if defined(__x86_64__)
  if constexpr (kIsa == Isa::kAvx2) {
    qk_rows_f32_avx2(s.qf, d, s.kt, ldk, c0, c1p, rows, s.s);
    return;
  }
#endif
  for (int64_t j0 = c0; j0 < c1p; j0 += 32) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) qk_tile_f32<4>(s.qf + m * d, d, s.kt, ldk, j0, s.s + m * ldk);
    for (; m < rows; ++m) qk_tile_f32<1>(s.qf + m * d, d, s.kt, ldk, j0, s.s + m * ldk);
  }
}

template <typename T, Isa kIsa>
PS_INLINE void chunk_products_f32_pv(const AttnParams& p, Scratch& s, int64_t rows, int64_t c0,
                                     int64_t c1) {
  const int64_t d = p.head_dim, ldk = p.ldk;
  const void** vrow = s.vrow;  // float32 rows: the cache's own, converted ones or zeros
  for (int64_t t = c0; t < c1; ++t) {
    const T* vr = static_cast<const T*>(s.vrow[t]);
    if (vr == nullptr) {
      vrow[t] = s.zero;
    } else if constexpr (!std::is_same_v<T, float>) {
      float* dst = s.vf + t * d;
      load_row(vr, dst, d, 1.0f);
      vrow[t] = dst;
    }
  }
#if defined(__x86_64__)
  if constexpr (kIsa == Isa::kAvx2) {
    const int64_t d16 = d / 16 * 16;
    pv_rows_f32_avx2(s.s, ldk, vrow, c0, c1, rows, s.acc, d, d16, s.pf_n > 0 ? &s : nullptr);
    if (d16 < d) pv_tail_f32(s.s, ldk, vrow, c0, c1, d16, rows, s.acc, d);
    return;
  }
#endif
  const int64_t d32 = d / 32 * 32;
  for (int64_t e0 = 0; e0 < d32; e0 += 32) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) {
      pv_tile_f32<4>(s.s + m * ldk, ldk, vrow, c0, c1, e0, s.acc + m * d, d);
    }
    float* const sm = s.s + m * ldk;
    float* const am = s.acc + m * d;
    switch (rows - m) {  // (decode: all of a KV head's rows in one pass over V)
      case 3: pv_tile_f32<3>(sm, ldk, vrow, c0, c1, e0, am, d); break;
      case 2: pv_tile_f32<2>(sm, ldk, vrow, c0, c1, e0, am, d); break;
      case 1: pv_tile_f32<1>(sm, ldk, vrow, c0, c1, e0, am, d); break;
      default: break;
    }
  }
  if (d32 < d) pv_tail_f32(s.s, ldk, vrow, c0, c1, d32, rows, s.acc, d);
}

// --- kBf16Dp and kAmx bodies: bf16 pairs (VNNI-2), AVX-512 packing ---------------------------

#if defined(__x86_64__)

// In-register transpose of a 16 x 16 matrix of 32-bit words (r[i] = row i in, column i out).
PS_BF16_TARGET PS_INLINE void transpose16x16_u32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// 32 values of a cache row from dim e on, as bf16 in order (one 512-bit register): the row's
// own bf16 values, or a quantized row's (KvQuant) dequantized in float32 and rounded to
// nearest even, the same bits as dequant_row. `row` is the cache row (its scale code at byte
// d).
template <KvQuant Q>
PS_BF16_TARGET PS_INLINE __m512i load32_bf16(const void* row, int64_t e, int64_t d) {
  if constexpr (Q == KvQuant::kNone) {
    return _mm512_loadu_si512(static_cast<const uint16_t*>(row) + e);
  } else {
    const __m256i b = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(row) + e));
    __m512 lo, hi;  // values e .. e + 15 and e + 16 .. e + 31 in float32
    if constexpr (Q == KvQuant::kInt8) {
      const __m512 scale = _mm512_set1_ps(code_scale(static_cast<const uint8_t*>(row)[d]));
      lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))),
                         scale);
      hi = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))), scale);
    } else {
      // float8 -> float16 bits (exact), then float32: e5m2 is float16's high byte; e4m3's
      // exponent and mantissa shift into float16's with the bias 8 short, made up by 2^8
      const __m512i w = _mm512_cvtepu8_epi16(b);
      __m512i h;
      if constexpr (Q == KvQuant::kFp8E5m2) {
        h = _mm512_slli_epi16(w, 8);
      } else {
        h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x7F)), 7),
                            _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
      }
      lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
      hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
      if constexpr (Q == KvQuant::kFp8E4m3) {
        lo = _mm512_mul_ps(lo, _mm512_set1_ps(256.0f));
        hi = _mm512_mul_ps(hi, _mm512_set1_ps(256.0f));
      }
    }
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

// K^T of the chunk's columns [c0, c1p) in bf16 pairs: kp[j][t] = (K[t][2j], K[t][2j + 1]) as
// one 32-bit word; 16 keys x 16 pairs at a time, transposed in registers; keys outside the
// range are zero. head_dim % 32 == 0. Quantized rows are dequantized on the way (load32_bf16).
template <KvQuant Q>
PS_BF16_TARGET void pack_k_pairs(const void* const* krow, int64_t c0, int64_t c1p, int64_t d,
                                 uint32_t* kp, int64_t ldk) {
  const int64_t d2 = d / 2;
  for (int64_t t0 = c0; t0 < c1p; t0 += 16) {
    for (int64_t j0 = 0; j0 < d2; j0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const void* row = krow[t0 + i];
        r[i] = row != nullptr ? load32_bf16<Q>(row, 2 * j0, d) : _mm512_setzero_si512();
      }
      transpose16x16_u32(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(kp + (j0 + j) * ldk + t0, r[j]);
    }
  }
}

// V of the chunk's key pairs [c0 / 2, c1 / 2) in bf16 pairs: vp[i][e] = (V[2i][e], V[2i+1][e]).
template <KvQuant Q>
PS_BF16_TARGET void pack_v_pairs(const void* const* vrow, int64_t c0, int64_t c1, int64_t d,
                                 uint16_t* vp) {
  const __m512i lo_idx = _mm512_setr_epi32(
      0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005, 0x00260006,
      0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b, 0x002c000c, 0x002d000d,
      0x002e000e, 0x002f000f);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = c0; t < c1; t += 2) {
    const void* a = vrow[t];
    const void* b = vrow[t + 1];
    uint16_t* dst = vp + (t / 2) * d * 2;
    for (int64_t e = 0; e < d; e += 32) {
      const __m512i va = a != nullptr ? load32_bf16<Q>(a, e, d) : zero;
      const __m512i vb = b != nullptr ? load32_bf16<Q>(b, e, d) : zero;
      _mm512_storeu_si512(dst + 2 * e, _mm512_permutex2var_epi16(va, lo_idx, vb));
      _mm512_storeu_si512(dst + 2 * e + 32, _mm512_permutex2var_epi16(va, hi_idx, vb));
    }
  }
}

// kv_layout 1 (the pair layout): each (block, KV head) of bs keys holds, in bf16,
//   K^T  [d / 2][bs][2]   word (j, t) = (K[t][2j], K[t][2j + 1])   (bs * d values)
//   V    [bs / 2][d][2]   (i, e)      = (V[2i][e], V[2i + 1][e])
// i.e. per block exactly the words pack_k_pairs and pack_v_pairs make, written once by
// reshape_and_cache, so a chunk's K^T and V are copies of whole rows, not transposes.

// 64 bytes at a time where it can (a full 16-key row of K^T words, V's pair rows).
PS_BF16_TARGET PS_INLINE void copy_u32(uint32_t* dst, const uint32_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_si512(dst + i, _mm512_loadu_si512(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

// K^T of the chunk's columns [c0, c1p) from a pair-layout cache (kblk[i]: the K^T of the
// chunk's block i): the words pack_k_pairs makes, zero outside the keys [lo, hi) it reads.
PS_BF16_TARGET void copy_k_vnni(const char* const* kblk, int64_t bs, int64_t lo, int64_t hi,
                                int64_t c0, int64_t c1p, int64_t d, uint32_t* kp, int64_t ldk) {
  for (int64_t j = 0; j < d / 2; ++j) {
    std::fill(kp + j * ldk + c0, kp + j * ldk + std::max(c0, lo), 0u);
    std::fill(kp + j * ldk + hi, kp + j * ldk + c1p, 0u);
  }
  for (int64_t b0 = lo / bs * bs; b0 < hi; b0 += bs) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(kblk[b0 / bs]);
    const int64_t a = std::max(lo, b0), n = std::min(hi, b0 + bs) - a;
    for (int64_t j = 0; j < d / 2; ++j) copy_u32(kp + j * ldk + a, src + j * bs + (a - b0), n);
  }
}

// V of the chunk's key pairs [c0 / 2, c1 / 2) from a pair-layout cache (vblk[i]: the V of the
// chunk's block i): the rows pack_v_pairs makes, zero outside the keys [lo, hi) it reads (lo
// even: the keys start at a block or a split).
PS_BF16_TARGET void copy_v_vnni(const char* const* vblk, int64_t bs, int64_t lo, int64_t hi,
                                int64_t c0, int64_t c1, int64_t d, uint16_t* vp) {
  const int64_t row = 2 * d;  // bf16 values per key pair
  const int64_t hp = (hi + 1) / 2;
  std::fill(vp + c0 / 2 * row, vp + std::max(c0, lo) / 2 * row, uint16_t{0});
  std::fill(vp + std::min(hp, c1 / 2) * row, vp + c1 / 2 * row, uint16_t{0});
  for (int64_t b0 = lo / bs * bs; b0 < hi; b0 += bs) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(vblk[b0 / bs]);
    const int64_t a = std::max(lo, b0), pairs = (std::min(hi, b0 + bs) + 1) / 2 - a / 2;
    copy_u32(reinterpret_cast<uint32_t*>(vp + a / 2 * row),
             reinterpret_cast<const uint32_t*>(src + (a - b0) / 2 * row), pairs * d);
  }
  if (hi % 2 == 1) {  // key hi, the odd half of the last pair, is not read
    for (int64_t e = 0; e < d; ++e) vp[hi / 2 * row + 2 * e + 1] = 0;
  }
}

// The packers for the call's cache storage.
PS_BF16_TARGET void pack_k(KvQuant q, const void* const* krow, int64_t c0, int64_t c1p,
                           int64_t d, uint32_t* kp, int64_t ldk) {
  switch (q) {
    case KvQuant::kInt8: return pack_k_pairs<KvQuant::kInt8>(krow, c0, c1p, d, kp, ldk);
    case KvQuant::kFp8E4m3: return pack_k_pairs<KvQuant::kFp8E4m3>(krow, c0, c1p, d, kp, ldk);
    case KvQuant::kFp8E5m2: return pack_k_pairs<KvQuant::kFp8E5m2>(krow, c0, c1p, d, kp, ldk);
    default: return pack_k_pairs<KvQuant::kNone>(krow, c0, c1p, d, kp, ldk);
  }
}

PS_BF16_TARGET void pack_v(KvQuant q, const void* const* vrow, int64_t c0, int64_t c1, int64_t d,
                           uint16_t* vp) {
  switch (q) {
    case KvQuant::kInt8: return pack_v_pairs<KvQuant::kInt8>(vrow, c0, c1, d, vp);
    case KvQuant::kFp8E4m3: return pack_v_pairs<KvQuant::kFp8E4m3>(vrow, c0, c1, d, vp);
    case KvQuant::kFp8E5m2: return pack_v_pairs<KvQuant::kFp8E5m2>(vrow, c0, c1, d, vp);
    default: return pack_v_pairs<KvQuant::kNone>(vrow, c0, c1, d, vp);
  }
}

// s[m][0 .. 32) for MR rows by vdpbf16ps: each element one float32 accumulator over the head
// dims' pairs in order. The 32 keys' K^T words come in two halves of 16: pair j of the first
// half at k0 + j * ld0, of the second at k1 + j * ld1 (the packed K^T: ldk; a pair-layout cache
// block read in place: block_size; a run of zeros: 0), in words of a bf16 pair, or with Q a
// float8 kind, of a float8 pair (2 bytes, widened to bf16 pairs in registers: load32_bf16).
template <int MR, KvQuant Q = KvQuant::kNone>
PS_BF16_TARGET PS_INLINE void qk_tile_dp(const uint16_t* q, int64_t d, const void* k0p,
                                         int64_t ld0, const void* k1p, int64_t ld1,
                                         float* s, int64_t ldk) {
  __m512 a0[MR], a1[MR];
  for (int m = 0; m < MR; ++m) {
    a0[m] = _mm512_setzero_ps();
    a1[m] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < d / 2; ++j) {
    __m512bh k0, k1;
    if constexpr (Q == KvQuant::kNone) {
      k0 = (__m512bh)_mm512_loadu_si512(static_cast<const uint32_t*>(k0p) + j * ld0);
      k1 = (__m512bh)_mm512_loadu_si512(static_cast<const uint32_t*>(k1p) + j * ld1);
    } else {
      k0 = (__m512bh)load32_bf16<Q>(static_cast<const uint8_t*>(k0p) + 2 * j * ld0, 0, 0);
      k1 = (__m512bh)load32_bf16<Q>(static_cast<const uint8_t*>(k1p) + 2 * j * ld1, 0, 0);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, q + m * d + 2 * j, sizeof(pair));
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
      a0[m] = _mm512_dpbf16_ps(a0[m], qb, k0);
      a1[m] = _mm512_dpbf16_ps(a1[m], qb, k1);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(s + m * ldk, a0[m]);
    _mm512_storeu_ps(s + m * ldk + 16, a1[m]);
  }
}

// acc[m][e0 .. e0 + 32) += P V over the key pairs [c0 / 2, c1 / 2), by vdpbf16ps, P in its
// two bf16 parts (softmax_rows_bf16): two float32 accumulators per element, the high part's
// starting from acc and the low part's from 0, each over the pairs in order, added at the end.
// One pass over V for both parts and every row of the tile; vpair[i] is the pair row of keys
// 2i, 2i + 1 ([d][2] bf16: packed, or in place in a pair-layout cache block; with Q a float8
// kind, [d][2] float8 in place, widened in registers). Pumps the prefetch queue every 32 keys.
template <int MR, KvQuant Q = KvQuant::kNone>
PS_BF16_TARGET PS_INLINE void pv_tile_dp(Scratch& s, const uint16_t* p, const uint16_t* plo,
                                         int64_t ldk, const void* const* vpair, int64_t c0,
                                         int64_t c1, int64_t e0, float* acc, int64_t d) {
  __m512 a0[MR], a1[MR], b0[MR], b1[MR];
  for (int m = 0; m < MR; ++m) {
    a0[m] = _mm512_loadu_ps(acc + m * d + e0);
    a1[m] = _mm512_loadu_ps(acc + m * d + e0 + 16);
    b0[m] = _mm512_setzero_ps();
    b1[m] = _mm512_setzero_ps();
  }
  for (int64_t t = c0; t < c1; t += 2) {
    if ((t - c0) % 32 == 0) s.pump();
    __m512bh v0, v1;
    if constexpr (Q == KvQuant::kNone) {
      const uint16_t* v = static_cast<const uint16_t*>(vpair[t / 2]) + 2 * e0;
      v0 = (__m512bh)_mm512_loadu_si512(v);
      v1 = (__m512bh)_mm512_loadu_si512(v + 32);
    } else {
      const uint8_t* v = static_cast<const uint8_t*>(vpair[t / 2]) + 2 * e0;
      v0 = (__m512bh)load32_bf16<Q>(v, 0, 0);
      v1 = (__m512bh)load32_bf16<Q>(v + 32, 0, 0);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t hi, lo;
      std::memcpy(&hi, p + m * ldk + t, sizeof(hi));
      std::memcpy(&lo, plo + m * ldk + t, sizeof(lo));
      const __m512bh ph = (__m512bh)_mm512_set1_epi32(hi);
      const __m512bh pl = (__m512bh)_mm512_set1_epi32(lo);
      a0[m] = _mm512_dpbf16_ps(a0[m], ph, v0);
      a1[m] = _mm512_dpbf16_ps(a1[m], ph, v1);
      b0[m] = _mm512_dpbf16_ps(b0[m], pl, v0);
      b1[m] = _mm512_dpbf16_ps(b1[m], pl, v1);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(acc + m * d + e0, _mm512_add_ps(a0[m], b0[m]));
    _mm512_storeu_ps(acc + m * d + e0 + 16, _mm512_add_ps(a1[m], b1[m]));
  }
}

// Runs fn.template operator()<MR>(m) over rows [0, rows) in tiles of 4, the last tile 1 .. 3
// rows wide (a decode's G rows in one tile, so its products have MR independent chains).
template <typename Fn>
PS_INLINE void for_row_tiles(int64_t rows, Fn&& fn) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) fn.template operator()<4>(m);
  switch (rows - m) {
    case 3: fn.template operator()<3>(m); break;
    case 2: fn.template operator()<2>(m); break;
    case 1: fn.template operator()<1>(m); break;
    default: break;
  }
}

// exp(x) of 16 floats: x = n ln2 + r with n = round(x log2 e) (so |r| <= ln2 / 2), e^r by
// Cephes' degree-6 polynomial (as exp_approx, ~1 ulp), 2^n by vscalefps. x >= -87 (clamped;
// scores are finite, so no -inf reaches it).
PS_BF16_TARGET PS_INLINE __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// softmax_row for the bf16 pair paths, all rows of a chunk in three passes (each row's max,
// then every row's new max and rescale factor, then the probabilities), so that the short
// serial chain of one row (max, exp of the rescale) overlaps the others'. 16 columns per step,
// the tail masked, so every column of a row takes the same instructions. Each probability p
// is stored as two bf16 numbers, hi = bf16(p) in p16 and lo = bf16(p - hi) in p16lo (P V then
// runs over both: ~16 significant bits of p where one bf16 keeps 8), l adding the float32 p in
// softmax_row's fixed 16-lane order.
PS_BF16_TARGET void softmax_rows_bf16(Scratch& s, int64_t rows, int64_t ldk, int64_t c0,
                                      int64_t c1, float scale, int64_t d) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const auto tail = [](int64_t n) -> __mmask16 {
    return n >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float* sr = s.s + r * ldk;
    __m512 vmax = ninf;
    for (int64_t t = s.lo[r]; t < s.hi[r]; t += 16) {
      vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, tail(s.hi[r] - t), sr + t));
    }
    s.bmax[r] = _mm512_reduce_max_ps(vmax);
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (s.hi[r] <= s.lo[r]) continue;
    const float m_new = std::max(s.m[r], s.bmax[r] * scale);  // (scale > 0: max commutes)
    s.alpha[r] = exp_approx(s.m[r] - m_new);                  // 0 on the row's first keys
    s.m[r] = m_new;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* sr = s.s + r * ldk;
    uint16_t* pr = s.p16 + r * ldk;
    uint16_t* plo = s.p16lo + r * ldk;
    const int64_t lo = s.lo[r], hi = s.hi[r];
    if (hi <= lo) {  // the row sees none of this chunk: weight 0 for every column
      std::fill(pr + c0, pr + c1, uint16_t{0});
      std::fill(plo + c0, plo + c1, uint16_t{0});
      continue;
    }
    const __m512 vm = _mm512_set1_ps(s.m[r]);
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t t = lo; t < hi; t += 16) {
      const __mmask16 mask = tail(hi - t);
      const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(mask, sr + t), vscale, vm);
      const __m512 e = exp_ps(x);
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
      const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm256_mask_storeu_epi16(pr + t, mask, h);
      _mm256_mask_storeu_epi16(plo + t, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, hf)));
      lanes = _mm512_mask_add_ps(lanes, mask, lanes, e);
    }
    alignas(64) float lane[16];
    _mm512_store_ps(lane, lanes);
    for (int w = 8; w > 0; w /= 2) {
      for (int i = 0; i < w; ++i) lane[i] += lane[i + w];
    }
    std::fill(pr + c0, pr + lo, uint16_t{0});
    std::fill(pr + hi, pr + c1, uint16_t{0});
    std::fill(plo + c0, plo + lo, uint16_t{0});
    std::fill(plo + hi, plo + c1, uint16_t{0});
    const float alpha = s.alpha[r];
    s.l[r] = s.l[r] * alpha + lane[0];
    if (alpha != 1.0f) {
      float* ar = s.acc + r * d;
      for (int64_t i = 0; i < d; i += 16) {
        _mm512_storeu_ps(ar + i, _mm512_mul_ps(_mm512_loadu_ps(ar + i), _mm512_set1_ps(alpha)));
      }
    }
  }
}

// A float8 pair-layout chunk widened once into the packed bf16 buffers (a tile of more than 4
// rows would widen each run once per 4 rows in place): K^T words of the chunk's columns
// [c0, c1p) into kp (runs at or past khi zero), V's pair rows [c0 / 2, c1 / 2) into vp (pairs
// past khi zero, the odd half of an odd last key's pair zero).
template <KvQuant Q>
PS_BF16_TARGET void widen_f8_pairs(const Scratch& s, int64_t bs, int64_t d, int64_t c0,
                                   int64_t c1, int64_t c1p, uint32_t* kp, int64_t ldk,
                                   uint16_t* vp) {
  for (int64_t t0 = c0; t0 < c1p; t0 += 16) {
    const uint8_t* run = t0 < s.khi
        ? reinterpret_cast<const uint8_t*>(s.kblk[t0 / bs]) + t0 % bs * 2 : nullptr;
    for (int64_t j = 0; j < d / 2; ++j) {
      const __m512i w = run != nullptr ? load32_bf16<Q>(run + 2 * j * bs, 0, 0)
                                       : _mm512_setzero_si512();
      _mm512_storeu_si512(kp + j * ldk + t0, w);
    }
  }
  for (int64_t i = c0 / 2; i < c1 / 2; ++i) {
    uint16_t* dst = vp + i * 2 * d;
    if (2 * i >= s.khi) {
      std::fill(dst, dst + 2 * d, uint16_t{0});
      continue;
    }
    const uint8_t* src =
        reinterpret_cast<const uint8_t*>(s.vblk[2 * i / bs]) + (2 * i % bs) / 2 * 2 * d;
    for (int64_t e = 0; e < 2 * d; e += 32) _mm512_storeu_si512(dst + e, load32_bf16<Q>(src + e, 0, 0));
    if (2 * i + 1 == s.khi) {
      for (int64_t e = 0; e < d; ++e) dst[2 * e + 1] = 0;
    }
  }
}

// The chunk's two products on the kBf16Dp and kAmx paths (plain calls from the chunk loop).
// In place (reads_in_place): the 16-key runs of K^T come from their blocks, runs at or past
// the chunk's last key read as zeros; V's pair rows from their blocks, the pair of an odd last
// key from a copy whose missing half is zero (a cache slot past the sequence may hold
// anything, NaN included, and 0 x NaN would poison the sum). Keys a row does not see weigh 0
// and are read anyway, exactly as in the packed buffers: the same products in the same order.
PS_BF16_TARGET void chunk_qk_dp(const AttnParams& p, Scratch& s, int64_t rows, int64_t c0,
                                int64_t c1p) {
  const int64_t d = p.head_dim, ldk = p.ldk, bs = p.block_size;
  const bool in_place = reads_in_place(p) && !widens_f8(p, rows);
  if (!in_place) {
    if (widens_f8(p, rows)) {  // (both K^T and V, once per chunk)
      if (p.kv_quant == KvQuant::kFp8E4m3) {
        widen_f8_pairs<KvQuant::kFp8E4m3>(s, bs, d, c0, c1p, c1p, s.kp, ldk, s.vp);
      } else {
        widen_f8_pairs<KvQuant::kFp8E5m2>(s, bs, d, c0, c1p, c1p, s.kp, ldk, s.vp);
      }
    } else if (p.vnni) {
      copy_k_vnni(s.kblk, bs, s.klo, s.khi, c0, c1p, d, s.kp, ldk);
    } else {
      pack_k(p.kv_quant, s.krow, c0, c1p, d, s.kp, ldk);
    }
  }
  // a pair-layout cache read in place as stored: bf16 pairs, or float8 ones (2 bytes a word)
  const KvQuant q = in_place ? p.kv_quant : KvQuant::kNone;
  const int64_t word = q == KvQuant::kNone ? 4 : 2;
  const auto run = [&](int64_t t0, int64_t* ld) -> const void* {
    if (!in_place) {
      *ld = ldk;
      return s.kp + t0;
    }
    if (t0 >= s.khi) {
      *ld = 0;
      return s.zero;
    }
    *ld = bs;
    return s.kblk[t0 / bs] + t0 % bs * word;
  };
  for (int64_t j0 = c0; j0 < c1p; j0 += 32) {
    int64_t ld0, ld1;
    const void* k0 = run(j0, &ld0);
    const void* k1 = run(j0 + 16, &ld1);
    for_row_tiles(rows, [&]<int MR>(int64_t m) PS_BF16_TARGET {
      const uint16_t* qm = s.q16 + m * d;
      float* sm = s.s + m * ldk + j0;
      switch (q) {
        case KvQuant::kFp8E4m3: qk_tile_dp<MR, KvQuant::kFp8E4m3>(qm, d, k0, ld0, k1, ld1, sm, ldk); break;
        case KvQuant::kFp8E5m2: qk_tile_dp<MR, KvQuant::kFp8E5m2>(qm, d, k0, ld0, k1, ld1, sm, ldk); break;
        default: qk_tile_dp<MR>(qm, d, k0, ld0, k1, ld1, sm, ldk); break;
      }
    });
    s.pump();
  }
}

PS_BF16_TARGET void chunk_pv_dp(const AttnParams& p, Scratch& s, int64_t rows, int64_t c0,
                                int64_t c1) {
  const int64_t d = p.head_dim, ldk = p.ldk, bs = p.block_size;
  const void** vpair = s.vrow;
  const bool in_place = reads_in_place(p) && !widens_f8(p, rows);
  const KvQuant q = in_place ? p.kv_quant : KvQuant::kNone;  // as chunk_qk_dp
  if (widens_f8(p, rows)) {  // chunk_qk_dp widened V's pair rows into vp
    for (int64_t i = c0 / 2; i < c1 / 2; ++i) vpair[i] = s.vp + i * 2 * d;
  } else if (in_place) {
    const int64_t es = q == KvQuant::kNone ? 2 : 1;  // bytes a value
    const int64_t hp = s.khi / 2;  // pairs [c0 / 2, hp) whole; an odd last key's pair next
    for (int64_t i = c0 / 2; i < hp; ++i) {
      vpair[i] = s.vblk[2 * i / bs] + (2 * i % bs) / 2 * 2 * d * es;
    }
    if (s.khi % 2 == 1) {
      const char* src = s.vblk[2 * hp / bs] + (2 * hp % bs) / 2 * 2 * d * es;
      char* dst = reinterpret_cast<char*>(s.vp);
      for (int64_t e = 0; e < d; ++e) {
        std::memcpy(dst + 2 * e * es, src + 2 * e * es, es);
        std::memset(dst + (2 * e + 1) * es, 0, es);
      }
      vpair[hp] = s.vp;
    }
  } else {
    if (p.vnni) {
      copy_v_vnni(s.vblk, bs, s.klo, s.khi, c0, c1, d, s.vp);
    } else {
      pack_v(p.kv_quant, s.vrow, c0, c1, d, s.vp);
    }
    for (int64_t i = c0 / 2; i < c1 / 2; ++i) vpair[i] = s.vp + i * 2 * d;
  }
  for (int64_t e0 = 0; e0 < d; e0 += 32) {
    for_row_tiles(rows, [&]<int MR>(int64_t m) PS_BF16_TARGET {
      const uint16_t* hi = s.p16 + m * ldk;
      const uint16_t* lo = s.p16lo + m * ldk;
      float* am = s.acc + m * d;
      switch (q) {
        case KvQuant::kFp8E4m3:
          pv_tile_dp<MR, KvQuant::kFp8E4m3>(s, hi, lo, ldk, vpair, c0, c1, e0, am, d);
          break;
        case KvQuant::kFp8E5m2:
          pv_tile_dp<MR, KvQuant::kFp8E5m2>(s, hi, lo, ldk, vpair, c0, c1, e0, am, d);
          break;
        default: pv_tile_dp<MR>(s, hi, lo, ldk, vpair, c0, c1, e0, am, d); break;
      }
    });
  }
}

// AMX: the same two products as one brgemm each (oneDNN's ukernel on AMX tiles; every element
// one float32 accumulator over its pairs in order, whatever the number of rows).
PS_BF16_TARGET void chunk_qk_amx(const AttnParams& p, Scratch& s, int64_t rows, int64_t c0,
                                 int64_t c1p) {
  // NOTE: N = whole 32-key tiles (zero keys past the chunk's last): ATen keeps every (M, N,
  // K, ...) kernel it JITs, per thread and forever, so N takes 17 values, not one per key count.
  const int64_t d = p.head_dim, ldk = p.ldk;
  if (p.vnni) {
    copy_k_vnni(s.kblk, p.block_size, s.klo, s.khi, c0, c1p, d, s.kp, ldk);
  } else {
    pack_k(p.kv_quant, s.krow, c0, c1p, d, s.kp, ldk);
  }
  at::native::cpublas::brgemm(rows, c1p - c0, d, d, ldk, ldk, /*add_C=*/false,
                              reinterpret_cast<const at::BFloat16*>(s.q16),
                              reinterpret_cast<const at::BFloat16*>(s.kp + c0), s.s + c0,
                              /*is_vnni=*/true);
}

PS_BF16_TARGET void chunk_pv_amx(const AttnParams& p, Scratch& s, int64_t rows, int64_t c0,
                                 int64_t c1) {
  // NOTE: the sum always starts at the chunk's first key and runs over whole 32-key tiles,
  // zeros outside [c0, c1): oneDNN's kernel for a K with a tail (or another start) sums the
  // same products differently, and a row's output then depended on how many keys its step's
  // chunk held (tests/kernels/test_cpu_paged_attention.py caught it).
  const int64_t d = p.head_dim, ldk = p.ldk;
  const int64_t C = (c1 + 31) / 32 * 32;
  for (uint16_t* pp : {s.p16, s.p16lo}) {
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(pp + r * ldk, pp + r * ldk + c0, uint16_t{0});
      std::fill(pp + r * ldk + c1, pp + r * ldk + C, uint16_t{0});
    }
  }
  if (p.vnni) {
    copy_v_vnni(s.vblk, p.block_size, s.klo, s.khi, 0, C, d, s.vp);
  } else {
    pack_v(p.kv_quant, s.vrow, 0, C, d, s.vp);
  }
  for (const uint16_t* pp : {s.p16, s.p16lo}) {  // P's high part, then its low part
    at::native::cpublas::brgemm(rows, d, C, ldk, d, d, /*add_C=*/true,
                                reinterpret_cast<const at::BFloat16*>(pp),
                                reinterpret_cast<const at::BFloat16*>(s.vp), s.acc,
                                /*is_vnni=*/true);
  }
}
#endif

// --- kI8 body: an int8 pair-layout cache read as stored (cpu_attention_i8.h) ----------------
// A (block, KV head) holds bs * d int8 values (K^T pairs, or V pair rows), then the bs keys'
// scale codes; s.kblk / s.vblk point at the chunk's blocks, s.klo / s.khi bound its keys.

// scale[t] for the chunk's columns [c0, c1): key t's scale from its block's codes (blk[i]: the
// chunk's block i), 0 outside the keys [klo, khi) it reads.
PS_INLINE void key_scales(const char* const* blk, int64_t bs, int64_t d, int64_t klo,
                          int64_t khi, int64_t c0, int64_t c1, float* scale) {
  std::fill(scale + c0, scale + std::max(c0, klo), 0.0f);
  std::fill(scale + std::min(c1, std::max(c0, khi)), scale + c1, 0.0f);
  for (int64_t b0 = klo / bs * bs; b0 < std::min(khi, c1); b0 += bs) {
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(blk[b0 / bs]) + bs * d - b0;
    const int64_t hi = std::min({khi, c1, b0 + bs});
#pragma omp simd
    for (int64_t t = std::max(klo, b0); t < hi; ++t) scale[t] = code_scale(codes[t]);
  }
}

// S for the chunk's columns [c0, c1p): runs of 16 keys from their blocks in place (runs at or
// past the chunk's last key read as zeros; slots past it in a block hold finite int8 values,
// and their columns are never weighed).
template <Body B>
PS_INLINE void chunk_qk_i8(const AttnParams& p, Scratch& s, int64_t rows, int64_t c0,
                           int64_t c1p) {
  const int64_t d = p.head_dim, ldk = p.ldk, bs = p.block_size;
  key_scales(s.kblk, bs, d, s.klo, s.khi, c0, c1p, s.ks);
  const int8_t* zeros = reinterpret_cast<const int8_t*>(s.zero);
  const int16_t* q16 = reinterpret_cast<const int16_t*>(s.q16);
  // one tile: NR runs of 16 keys from column j0 (AVX-512: 4 while whole, else 2; AVX2: 1)
  const auto tile = [&]<int NR>(int64_t j0) {
    const int8_t* k[NR];
    int64_t ld[NR];
    for (int r = 0; r < NR; ++r) {
      const int64_t t0 = j0 + 16 * r;
      k[r] = t0 >= s.khi ? zeros : reinterpret_cast<const int8_t*>(s.kblk[t0 / bs]) + t0 % bs * 2;
      ld[r] = t0 >= s.khi ? 0 : 2 * bs;
    }
#if defined(__x86_64__)
    if constexpr (B == Body::kVnni512) {
      qk_rows_i8_vnni512<NR>(q16, d, k, ld, s.qs, s.ks + j0, s.s + j0, ldk, rows);
    } else if constexpr (B == Body::kAvx2) {
      qk_rows_i8_avx2<NR>(q16, d, k, ld, s.qs, s.ks + j0, s.s + j0, ldk, rows);
    } else
#endif
    {
      qk_rows_i8_scalar<NR>(q16, d, k, ld, s.qs, s.ks + j0, s.s + j0, ldk, rows);
    }
    s.pump();
  };
  for (int64_t j0 = c0; j0 < c1p;) {
    if constexpr (B == Body::kAvx2) {
      tile.template operator()<1>(j0);
      j0 += 16;
    } else {
      if (B == Body::kVnni512 && j0 + 64 <= c1p) {
        tile.template operator()<4>(j0);
        j0 += 64;
      } else {
        tile.template operator()<2>(j0);
        j0 += 32;
      }
    }
  }
}

// How many times the kI8 products of a chunk call Scratch::pump: once per S tile, and per P V
// row tile and pass over V every 16 key pairs (the prefetch queue spreads its lines over them).
template <Body B>
PS_INLINE int64_t i8_pump_points(int64_t rows, int64_t d, int64_t c0, int64_t c1, int64_t c1p) {
  const int64_t cols = c1p - c0;
  const int64_t s_tiles = B == Body::kVnni512 ? cols / 64 + (cols % 64 != 0)
                          : B == Body::kAvx2  ? cols / 16
                                              : cols / 32;
  const int64_t passes = B == Body::kVnni512 ? d / 64 + (d % 64) / 32 + (d % 32) / 16 : d / 16;
  return s_tiles + passes * ((rows + 3) / 4) * (((c1 - c0) / 2 + 15) / 16);
}

// acc += P V for the chunk's key pairs [c0 / 2, c1 / 2), P as softmax_row left it in s.s: V's
// scales folded into it, then quantized per row to int16 (cpu_attention_i8.h).
template <Body B>
PS_INLINE void chunk_pv_i8(const AttnParams& p, Scratch& s, int64_t rows, int64_t c0,
                           int64_t c1) {
  const int64_t d = p.head_dim, ldk = p.ldk, bs = p.block_size;
  key_scales(s.vblk, bs, d, s.klo, s.khi, c0, c1, s.vs);
  // the largest integer weight: 32767, or less where 127 * W * keys could pass int32
  const float w_top = static_cast<float>(
      std::min<int64_t>(32767, std::numeric_limits<int32_t>::max() / (127 * std::max<int64_t>(c1 - c0, 1))));
  int16_t* w16 = reinterpret_cast<int16_t*>(s.p16);
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = s.s + r * ldk;
    float wmax = 0.0f;
#pragma omp simd reduction(max : wmax)
    for (int64_t t = c0; t < c1; ++t) {
      const float w = pr[t] * s.vs[t];
      pr[t] = w;
      wmax = wmax < w ? w : wmax;
    }
    const float f = wmax > 0.0f ? w_top / wmax : 0.0f;
    int16_t* wr = w16 + r * ldk;
#pragma omp simd
    for (int64_t t = c0; t < c1; ++t) {
      const float x = pr[t] * f;
      wr[t] = static_cast<int16_t>(static_cast<int32_t>(std::nearbyint(x < w_top ? x : w_top)));
    }
    s.ws[r] = wmax / w_top;
  }
  // pair row i: keys 2i, 2i + 1 of the chunk (a pair past its last key reads as zeros; the odd
  // half of a pair holding its last key is a slot of the same block, finite and weighed 0)
  const int8_t** vpair = reinterpret_cast<const int8_t**>(s.vrow);
  const int8_t* zeros = reinterpret_cast<const int8_t*>(s.zero);
  for (int64_t b0 = c0 / bs * bs; b0 < c1; b0 += bs) {
    const int8_t* blk = b0 < s.khi ? reinterpret_cast<const int8_t*>(s.vblk[b0 / bs]) : nullptr;
    for (int64_t t = std::max(b0, c0); t < std::min(b0 + bs, c1); t += 2) {
      vpair[t / 2] = t >= s.khi ? zeros : blk + (t - b0) * d;  // pair row (t - b0) / 2
    }
  }
  const int64_t i0 = c0 / 2, i1 = c1 / 2;
  for (int64_t e0 = 0; e0 < d;) {
#if defined(__x86_64__)
    if constexpr (B == Body::kVnni512) {
      if (e0 + 64 <= d) {  // (four registers of 16 dims per row: one pass over V for 64 dims)
        pv_rows_i8_vnni512<4>(w16, ldk, vpair, i0, i1, e0, s.ws, s.acc, d, rows, s);
        e0 += 64;
      } else if (e0 + 32 <= d) {
        pv_rows_i8_vnni512<2>(w16, ldk, vpair, i0, i1, e0, s.ws, s.acc, d, rows, s);
        e0 += 32;
      } else {
        pv_rows_i8_vnni512<1>(w16, ldk, vpair, i0, i1, e0, s.ws, s.acc, d, rows, s);
        e0 += 16;
      }
      continue;
    } else if constexpr (B == Body::kAvx2) {
      pv_rows_i8_avx2<1>(w16, ldk, vpair, i0, i1, e0, s.ws, s.acc, d, rows, s);
      e0 += 16;
      continue;
    }
#endif
    pv_rows_i8_scalar<1>(w16, ldk, vpair, i0, i1, e0, s.ws, s.acc, d, rows, s);
    e0 += 16;
  }
}

// Fills s.pf with the (block, KV head) pieces of item x's keys [key_lo, key_hi) in a
// pair-layout cache, K's then V's; returns their count.
PS_INLINE int64_t queue_pieces(const AttnParams& p, Scratch& s, const WorkItem& x, int64_t key_lo,
                               int64_t key_hi) {
  const int64_t bs = p.block_size;
  const int32_t* table = p.block_tables + static_cast<int64_t>(x.seq) * p.bt_stride;
  const char* k_base = static_cast<const char*>(p.k_cache) + x.kv_head * p.k_stride_head;
  const char* v_base = static_cast<const char*>(p.v_cache) + x.kv_head * p.v_stride_head;
  int64_t n = 0;
  for (int64_t pos = key_lo / bs * bs; pos < key_hi; pos += bs) {
    s.pf[n++] = k_base + table[pos / bs] * p.k_stride_block;
  }
  const int64_t nk = n;
  for (int64_t i = 0; i < nk; ++i) {
    s.pf[n++] = v_base + table[(key_lo / bs * bs) / bs + i] * p.v_stride_block;
  }
  return n;
}

// Fills s.pf with one piece per token of item x's keys [key_lo, key_hi) (at most one chunk)
// in a rows-layout cache, K's then V's, and sets s.pf_bytes; returns their count. A piece is
// the token's row of x's KV head or, for a unit (x.unit_heads > 1), the rows of all its heads:
// a block holds a token's heads side by side, so a unit reads whole blocks, one contiguous run
// per block instead of one row in every few.
PS_INLINE int64_t queue_rows(const AttnParams& p, Scratch& s, const WorkItem& x, int64_t key_lo,
                             int64_t key_hi) {
  const int64_t bs = p.block_size;
  const int32_t* table = p.block_tables + static_cast<int64_t>(x.seq) * p.bt_stride;
  const int64_t head = x.unit_heads > 1 ? 0 : x.kv_head;
  const char* k_base = static_cast<const char*>(p.k_cache) + head * p.k_stride_head;
  const char* v_base = static_cast<const char*>(p.v_cache) + head * p.v_stride_head;
  const int64_t n = key_hi - key_lo;
  for (int64_t pos = key_lo; pos < key_hi; ++pos) {
    const int64_t block = table[pos / bs], off = pos % bs;
    s.pf[pos - key_lo] = k_base + block * p.k_stride_block + off * p.k_stride_tok;
    s.pf[n + pos - key_lo] = v_base + block * p.v_stride_block + off * p.v_stride_tok;
  }
  s.pf_bytes = (x.unit_heads - 1) * std::max(p.k_stride_head, p.v_stride_head) + p.kv_row_bytes;
  return 2 * n;
}

// One item on any path: the query tile in, then chunk by chunk (fixed key positions, every
// `chunk` keys): the rows of the chunk's keys through the block table, S = Q K^T, the
// online-softmax step of each row, acc += P V; finally out = acc / l, or (m, l, acc) for the
// merge of a split.
template <typename T, Path kPath, Isa kIsa = Isa::kScalar, Body kBody = Body::kScalar>
PS_INLINE void attend_item_chunks(const AttnParams& p, const WorkItem& it, Scratch& s) {
  const int64_t d = p.head_dim, g = p.group, bs = p.block_size, C = p.chunk;
  const int64_t rows = it.q_count * g;
  const bool in_place = (kPath == Path::kBf16Dp && reads_in_place(p)) || kPath == Path::kI8;
  // Few rows on the float32 body (decode) over a rows-layout cache: the next chunk's rows
  // (this item's, or the next item's or unit's first) go through the prefetch queue too,
  // pumped every 8 keys of the S passes and of the AVX2 P V tiles; a decode is a few
  // microseconds of products per item, so one burst of its rows at the item's start stalls
  // instead of overlapping them.
  const bool queued = kPath == Path::kF32 && !p.vnni && rows < 16;
  const T* query = static_cast<const T*>(p.query);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = query + (it.q_row + r / g) * p.q_stride_tok +
                   (static_cast<int64_t>(it.kv_head) * g + r % g) * p.q_stride_head;
    if constexpr (kPath == Path::kF32 || kPath == Path::kI8) {
      load_row(src, s.qf + r * d, d, 1.0f);
      if constexpr (kPath == Path::kI8) {
        s.qs[r] = quantize_i16_row(s.qf + r * d, d, reinterpret_cast<int16_t*>(s.q16) + r * d);
      }
    } else {
      std::memcpy(s.q16 + r * d, src, d * sizeof(uint16_t));
    }
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.0f;
  }
  std::fill(s.acc, s.acc + rows * d, 0.0f);
  const int32_t* table = p.block_tables + static_cast<int64_t>(it.seq) * p.bt_stride;
  const char* k_base = static_cast<const char*>(p.k_cache) + it.kv_head * p.k_stride_head;
  const char* v_base = static_cast<const char*>(p.v_cache) + it.kv_head * p.v_stride_head;
  for (int64_t cs = it.key_begin / C * C; cs < it.key_end; cs += C) {
    const int64_t lo_abs = std::max(cs, it.key_begin), hi_abs = std::min(cs + C, it.key_end);
    // the chunk's columns: [c0, c1) in whole key pairs, [c0, c1p) in whole 32-key tiles
    const int64_t c0 = (lo_abs - cs) & ~int64_t{1};
    const int64_t c1 = (hi_abs - cs + 1) & ~int64_t{1};
    const int64_t c1p = c0 + (c1 - c0 + 31) / 32 * 32;
    // the rows of the chunk's keys, block by block (nullptr outside [lo_abs, hi_abs); the AMX
    // path reads whole 32-key tiles from column 0)
    const int64_t t_end = std::max(c1p, (c1 + 31) / 32 * 32);
    const int64_t blk_bytes = bs * p.kv_row_bytes;  // one (block, KV head) in the pair layout
    if (kPath == Path::kF32 || !p.vnni) {
      std::fill(s.krow, s.krow + t_end, nullptr);
      std::fill(s.vrow, s.vrow + t_end, nullptr);
    }
    if (p.vnni) {
      // whole blocks: the chunk starts at one, and so do the keys (a split or a window start)
      s.klo = lo_abs - cs;
      s.khi = hi_abs - cs;
      for (int64_t b0 = s.klo / bs * bs; b0 < s.khi; b0 += bs) {
        const int64_t block = table[(cs + b0) / bs];
        s.kblk[b0 / bs] = k_base + block * p.k_stride_block;
        s.vblk[b0 / bs] = v_base + block * p.v_stride_block;
      }
      s.pf_n = s.pf_i = s.pf_off = 0;
      if (in_place) {  // the next chunk's pieces, for pump() while this one computes
        const WorkItem* nx = static_cast<const WorkItem*>(s.next);
        if (cs + C < it.key_end) {
          s.pf_n = queue_pieces(p, s, it, cs + C, std::min(cs + 2 * C, it.key_end));
        } else if (nx != nullptr) {
          s.pf_n = queue_pieces(p, s, *nx, nx->key_begin,
                                std::min(nx->key_begin / C * C + C, nx->key_end));
        }
        s.pf_bytes = blk_bytes;
        const int64_t lines = s.pf_n * ((blk_bytes + 63) / 64);
        const int64_t points =
            kPath == Path::kI8
                ? i8_pump_points<kBody>(rows, d, c0, c1, c1p)
                : (c1p - c0) / 32 + (d / 32) * ((rows + 3) / 4) * ((c1 - c0 + 31) / 32);
        s.pf_step = (lines + points - 1) / std::max<int64_t>(points, 1);
      }
      if (cs == it.key_begin / C * C && !(in_place && s.warmed == &it)) {
        // as below: the first chunk asks for all its bytes (unless the previous item queued them)
        for (int64_t b0 = s.klo / bs * bs; b0 < s.khi; b0 += bs) {
          for (int64_t off = 0; off < blk_bytes; off += 64) __builtin_prefetch(s.kblk[b0 / bs] + off, 0, 3);
        }
        for (int64_t b0 = s.klo / bs * bs; b0 < s.khi; b0 += bs) {
          for (int64_t off = 0; off < blk_bytes; off += 64) __builtin_prefetch(s.vblk[b0 / bs] + off, 0, 2);
        }
      }
      if constexpr (kPath == Path::kF32) {  // the float32 body reads rows: unpack them once
        for (int64_t t = s.klo; t < s.khi; ++t) {
          auto* kd = reinterpret_cast<uint16_t*>(s.kst) + t * d;
          auto* vd = reinterpret_cast<uint16_t*>(s.vst) + t * d;
          const auto* kb = reinterpret_cast<const uint16_t*>(s.kblk[t / bs]);
          const auto* vb = reinterpret_cast<const uint16_t*>(s.vblk[t / bs]);
          const int64_t o = t % bs;
          for (int64_t j = 0; j < d / 2; ++j) {
            kd[2 * j] = kb[(j * bs + o) * 2];
            kd[2 * j + 1] = kb[(j * bs + o) * 2 + 1];
          }
          for (int64_t e = 0; e < d; ++e) vd[e] = vb[((o / 2) * d + e) * 2 + o % 2];
          s.krow[t] = kd;
          s.vrow[t] = vd;
        }
      }
    } else {
      for (int64_t pos = lo_abs; pos < hi_abs;) {
        const int64_t block = table[pos / bs], off = pos % bs;
        const int64_t n = std::min(bs - off, hi_abs - pos);
        const char* kb = k_base + block * p.k_stride_block + off * p.k_stride_tok;
        const char* vb = v_base + block * p.v_stride_block + off * p.v_stride_tok;
        for (int64_t i = 0; i < n; ++i) {
          s.krow[pos - cs + i] = kb + i * p.k_stride_tok;
          s.vrow[pos - cs + i] = vb + i * p.v_stride_tok;
        }
        pos += n;
      }
      // NOTE: blocks lie anywhere in the cache, so the hardware prefetcher cannot run ahead
      // across them. The item's first chunk (a decode's only one, up to 512 keys): ask for all
      // its rows now, K before V, so their misses overlap instead of stalling the packing row
      // by row (unless the previous item queued them); then fetch the next chunk's rows while
      // this one computes.
      // A unit (WorkItem::unit_heads, single-chunk items): its first item queues the whole
      // tokens of the next unit's first chunk, and its items pump them in turn.
      if (queued && (it.unit_heads == 1 || it.kv_head == 0)) {
        const WorkItem* nx = static_cast<const WorkItem*>(it.unit_heads > 1 ? s.next_unit : s.next);
        s.pf_n = s.pf_i = s.pf_off = 0;
        if (cs + C < it.key_end) {  // (not in a unit: its items are one chunk each)
          s.pf_n = queue_rows(p, s, it, cs + C, std::min(cs + 2 * C, it.key_end));
        } else if (nx != nullptr) {
          s.pf_n = queue_rows(p, s, *nx, nx->key_begin,
                              std::min(nx->key_begin / C * C + C, nx->key_end));
        }
        const int64_t lines = s.pf_n * ((s.pf_bytes + 63) / 64);
        // pump points: the S passes over 8 keys, and every 8 keys of each P V tile (AVX2)
        const int64_t pv_points =
            kIsa == Isa::kAvx2 ? d / 16 * ((rows + 5) / 6) * ((c1 - c0 + 7) / 8) : 0;
        const int64_t points = ((c1p - c0) / 8 + pv_points) * it.unit_heads;
        s.pf_step = (lines + points - 1) / points;
      }
      const WorkItem* unit = &it - (it.unit_heads > 1 ? it.kv_head : 0);
      if (cs == it.key_begin / C * C && !(queued && s.warmed == unit)) {
        for (int64_t t = lo_abs - cs; t < hi_abs - cs; ++t) {
          for (int64_t off = 0; off < p.kv_row_bytes; off += 64) {
            __builtin_prefetch(static_cast<const char*>(s.krow[t]) + off, 0, 3);
          }
        }
        for (int64_t t = lo_abs - cs; t < hi_abs - cs; ++t) {
          for (int64_t off = 0; off < p.kv_row_bytes; off += 64) {
            __builtin_prefetch(static_cast<const char*>(s.vrow[t]) + off, 0, 2);
          }
        }
      }
      // a quantized cache on the float32 body: the chunk's rows dequantized to T once, into the
      // scratch (the bf16 pair bodies dequantize while they pack)
      if (kPath == Path::kF32 && p.kv_quant != KvQuant::kNone) {
        for (int64_t t = lo_abs - cs; t < hi_abs - cs; ++t) {
          T* kd = reinterpret_cast<T*>(s.kst) + t * d;
          T* vd = reinterpret_cast<T*>(s.vst) + t * d;
          dequant_row(p.kv_quant, static_cast<const uint8_t*>(s.krow[t]), d, kd);
          dequant_row(p.kv_quant, static_cast<const uint8_t*>(s.vrow[t]), d, vd);
          s.krow[t] = kd;
          s.vrow[t] = vd;
        }
      }
    }
    for (int64_t pos = cs + C; !in_place && !queued && pos < std::min(cs + 2 * C, it.key_end);
         pos += bs) {
      const int64_t block = table[pos / bs];
      const int64_t n = std::min(bs, it.key_end - pos);
      const char* kb = k_base + block * p.k_stride_block;
      const char* vb = v_base + block * p.v_stride_block;
      if (p.vnni) {
        for (int64_t off = 0; off < blk_bytes; off += 64) {
          __builtin_prefetch(kb + off);
          __builtin_prefetch(vb + off);
        }
        continue;
      }
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t off = 0; off < p.kv_row_bytes; off += 64) {
          __builtin_prefetch(kb + i * p.k_stride_tok + off);
          __builtin_prefetch(vb + i * p.v_stride_tok + off);
        }
      }
    }
    if constexpr (kPath == Path::kF32) {
      chunk_products_f32_qk<T, kIsa>(p, s, rows, c0, c1p);
    }
    if constexpr (kPath == Path::kI8) chunk_qk_i8<kBody>(p, s, rows, c0, c1p);
#if defined(__x86_64__)
    if constexpr (kPath == Path::kBf16Dp) chunk_qk_dp(p, s, rows, c0, c1p);
    if constexpr (kPath == Path::kAmx) chunk_qk_amx(p, s, rows, c0, c1p);
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t q_pos = it.first_pos + r / g;
      int64_t row_lo = it.key_begin;
      if (p.window > 0) row_lo = std::max(row_lo, q_pos - p.window + 1);
      const int64_t row_hi = std::min(it.key_end, q_pos + 1);
      s.lo[r] = std::max(row_lo, cs) - cs;
      s.hi[r] = std::max(s.lo[r], std::min(row_hi, cs + C) - cs);
    }
    if constexpr (kPath == Path::kF32 || kPath == Path::kI8) {
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s.s + r * p.ldk;
        if (s.hi[r] <= s.lo[r]) {  // the row sees none of this chunk: weight 0 everywhere
          std::fill(sr + c0, sr + c1, 0.0f);
          continue;
        }
        softmax_row(sr, c0, c1, s.lo[r], s.hi[r], p.scale, s.m + r, s.l + r, s.acc + r * d, d);
      }
    }
#if defined(__x86_64__)
    if constexpr (kPath == Path::kBf16Dp || kPath == Path::kAmx) {
      softmax_rows_bf16(s, rows, p.ldk, c0, c1, p.scale, d);
    }
#endif
    if constexpr (kPath == Path::kF32) {
      chunk_products_f32_pv<T, kIsa>(p, s, rows, c0, c1);
    }
    if constexpr (kPath == Path::kI8) chunk_pv_i8<kBody>(p, s, rows, c0, c1);
#if defined(__x86_64__)
    if constexpr (kPath == Path::kBf16Dp) chunk_pv_dp(p, s, rows, c0, c1);
    if constexpr (kPath == Path::kAmx) chunk_pv_amx(p, s, rows, c0, c1);
#endif
    if (in_place || (queued && it.kv_head + 1 >= it.unit_heads)) {
      s.pump(std::numeric_limits<int64_t>::max());  // whatever the tiles left unasked
      s.pf_n = 0;
      if (cs + C >= it.key_end) s.warmed = it.unit_heads > 1 ? s.next_unit : s.next;
    }
  }

  if (it.partial < 0) {  // the whole key range: normalize and write out
    T* out = static_cast<T*>(p.out);
    for (int64_t r = 0; r < rows; ++r) {
      T* dst = out + (it.q_row + r / g) * p.o_stride_tok +
               (static_cast<int64_t>(it.kv_head) * g + r % g) * p.o_stride_head;
      store_row(s.acc + r * d, dst, d, 1.0f / s.l[r]);
    }
  } else {  // one split: leave (m, l, acc) for the merge
    float* part = p.partials + it.partial;
    for (int64_t r = 0; r < rows; ++r) {
      float* pr = part + r * (d + 2);
      pr[0] = s.m[r];
      pr[1] = s.l[r];
      std::memcpy(pr + 2, s.acc + r * d, d * sizeof(float));
    }
  }
}

template <typename T, Isa kIsa>
PS_INLINE void attend_item_f32(const AttnParams& p, const WorkItem& it, Scratch& s) {
  attend_item_chunks<T, Path::kF32, kIsa>(p, it, s);
}

template <typename T>
void merge_group(const AttnParams& p, const MergeGroup& mg) {
  const int64_t d = p.head_dim, g = p.group;
  const int64_t rows = mg.q_count * g;
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
    T* dst = out + (mg.q_row + r / g) * p.o_stride_tok +
             (static_cast<int64_t>(mg.kv_head) * g + r % g) * p.o_stride_head;
    store_row(acc.data(), dst, d, 1.0f / l);
  }
}

// One function per (ISA, dtype) of the float32 body; the always-inline body is vectorized
// under each target.
using ItemFn = void (*)(const AttnParams&, const WorkItem&, Scratch&);

#if defined(__x86_64__)
#define PS_DEFINE_ITEM(NAME, TARGET, ISA)                                                 \
  TARGET void NAME##_f32(const AttnParams& p, const WorkItem& it, Scratch& s) {           \
    attend_item_f32<float, ISA>(p, it, s);                                                \
  }                                                                                       \
  TARGET void NAME##_bf16(const AttnParams& p, const WorkItem& it, Scratch& s) {          \
    attend_item_f32<c10::BFloat16, ISA>(p, it, s);                                        \
  }                                                                                       \
  TARGET void NAME##_f16(const AttnParams& p, const WorkItem& it, Scratch& s) {           \
    attend_item_f32<c10::Half, ISA>(p, it, s);                                            \
  }
PS_DEFINE_ITEM(item_avx512, PS_TARGET_AVX512, Isa::kAvx512)
PS_DEFINE_ITEM(item_avx2, PS_TARGET_AVX2, Isa::kAvx2)
#endif
PS_DEFINE_ITEM(item_scalar, , Isa::kScalar)

#if defined(__x86_64__)
PS_BF16_TARGET void item_bf16_dp(const AttnParams& p, const WorkItem& it, Scratch& s) {
  attend_item_chunks<c10::BFloat16, Path::kBf16Dp>(p, it, s);
}

PS_BF16_TARGET void item_bf16_amx(const AttnParams& p, const WorkItem& it, Scratch& s) {
  attend_item_chunks<c10::BFloat16, Path::kAmx>(p, it, s);
}
#endif

ItemFn pick_item_fn(Isa isa, at::ScalarType dtype) {
  PS_ISA_DTYPE_TABLE(ItemFn, table, item_scalar, item_avx2, item_avx512);
  return table[static_cast<int>(isa)][dtype_index(dtype)];
}

// The kI8 body per integer-product body (cpu_vnni.h's pick_body; AVX-VNNI runs the AVX2 one)
// and query dtype.
#define PS_DEFINE_I8_ITEM(NAME, TARGET, BODY)                                          \
  TARGET void NAME##_f32(const AttnParams& p, const WorkItem& it, Scratch& s) {        \
    attend_item_chunks<float, Path::kI8, Isa::kScalar, BODY>(p, it, s);                \
  }                                                                                    \
  TARGET void NAME##_bf16(const AttnParams& p, const WorkItem& it, Scratch& s) {       \
    attend_item_chunks<c10::BFloat16, Path::kI8, Isa::kScalar, BODY>(p, it, s);        \
  }                                                                                    \
  TARGET void NAME##_f16(const AttnParams& p, const WorkItem& it, Scratch& s) {        \
    attend_item_chunks<c10::Half, Path::kI8, Isa::kScalar, BODY>(p, it, s);            \
  }
#if defined(__x86_64__)
PS_DEFINE_I8_ITEM(item_i8_vnni512, PS_TARGET_VNNI512, Body::kVnni512)
PS_DEFINE_I8_ITEM(item_i8_avx2, PS_TARGET_AVX2, Body::kAvx2)
#endif
PS_DEFINE_I8_ITEM(item_i8_scalar, , Body::kScalar)

ItemFn pick_i8_item_fn(Body body, at::ScalarType dtype) {
#if defined(__x86_64__)
  static const ItemFn table[3][3] = {
      {item_i8_scalar_f32, item_i8_scalar_bf16, item_i8_scalar_f16},
      {item_i8_avx2_f32, item_i8_avx2_bf16, item_i8_avx2_f16},
      {item_i8_vnni512_f32, item_i8_vnni512_bf16, item_i8_vnni512_f16}};
  const int row = body == Body::kVnni512 ? 2 : body == Body::kScalar ? 0 : 1;
  return table[row][dtype_index(dtype)];
#else
  static const ItemFn table[3] = {item_i8_scalar_f32, item_i8_scalar_bf16, item_i8_scalar_f16};
  return table[dtype_index(dtype)];
#endif
}

// The integer-product body an int8 pair-layout cache runs now (attention_int8_body()).
Body attention_i8_body() {
  const Body b = pick_body();
  return b == Body::kAvxVnni ? Body::kAvx2 : b;
}

// The body a call runs: the bf16 pair paths for bf16 with head_dim a multiple of 32 (up to
// 256) on a CPU step that has them (AMX tiles, else vdpbf16ps), the float32 body otherwise. A
// function of the CPU step, the dtype and head_dim only, so every row of a model takes the same
// path in every step (PAGEDSERVE_CPU_ISA=avx512_bf16 picks the vdpbf16ps body on an AMX CPU).
Path pick_path(Isa isa, at::ScalarType dtype, int64_t head_dim) {
  if (dtype != at::kBFloat16 || head_dim % 32 != 0 || head_dim > 256) return Path::kF32;
  if (isa == Isa::kAmx) return Path::kAmx;
  return isa == Isa::kAvx512Bf16 ? Path::kBf16Dp : Path::kF32;
}

// How a cache of this dtype stores K/V; kNone for a float dtype (checked against the query's).
KvQuant kv_quant_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kChar: return KvQuant::kInt8;
    case at::kFloat8_e4m3fn: return KvQuant::kFp8E4m3;
    case at::kFloat8_e5m2: return KvQuant::kFp8E5m2;
    default: return KvQuant::kNone;
  }
}

// The head_dim of a cache's rows (an int8 cache's rows end in their scale code).
int64_t cache_head_dim(const at::Tensor& c) {
  return c.scalar_type() == at::kChar ? c.size(3) - 1 : c.size(3);
}

void check_cache(const at::Tensor& c, const char* name) {
  TORCH_CHECK_VALUE(c.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, "
                    "head_dim], got ", c.sizes());
  TORCH_CHECK_VALUE(c.stride(3) == 1, name, ": head_dim must be contiguous");
  TORCH_CHECK_VALUE(c.device().is_cpu(), name, " must be on the CPU");
}

// kv_layout 0 = rows (any strides on the first three dims), 1 = the pair layout (see
// copy_k_vnni and cpu_attention_i8.h), each block dense: bf16 with an even block_size and
// head_dim, or int8 with block_size and head_dim multiples of 16.
bool check_layout(int64_t kv_layout, const at::Tensor& c, const char* name) {
  TORCH_CHECK_VALUE(kv_layout == 0 || kv_layout == 1, "kv_layout must be 0 (rows) or 1 "
                    "(pairs), got ", kv_layout);
  if (kv_layout == 0) return false;
  if (c.scalar_type() == at::kChar) {
    TORCH_CHECK_VALUE(c.size(1) % 16 == 0 && (c.size(3) - 1) % 16 == 0 && c.size(3) - 1 <= 512,
                      name, ": kv_layout 1 on an int8 cache needs block_size and head_dim "
                      "multiples of 16 (head_dim <= 512), got ", c.sizes());
  } else if (kv_quant_of(c.scalar_type()) != KvQuant::kNone) {
    TORCH_CHECK_VALUE(c.size(1) % 16 == 0 && c.size(3) % 32 == 0 && c.size(3) <= 256, name,
                      ": kv_layout 1 on a float8 cache needs a block_size multiple of 16 and "
                      "a head_dim multiple of 32 (<= 256), got ", c.sizes());
  } else {
    TORCH_CHECK_VALUE(c.scalar_type() == at::kBFloat16, name, ": kv_layout 1 (pairs) needs a "
                      "bfloat16, int8 or float8 cache, got ", c.scalar_type());
    TORCH_CHECK_VALUE(c.size(1) % 2 == 0 && c.size(3) % 2 == 0, name, ": kv_layout 1 needs an "
                      "even block_size and head_dim, got ", c.sizes());
  }
  TORCH_CHECK_VALUE(c.stride(2) == c.size(3) && c.stride(1) == c.size(2) * c.size(3), name,
                    ": kv_layout 1 needs dense blocks, got strides ", c.strides());
  return true;
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     int64_t split_keys, int64_t sliding_window, int64_t kv_layout) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  const bool vnni = check_layout(kv_layout, k_cache, "k_cache");
  check_layout(kv_layout, v_cache, "v_cache");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "k_cache ", k_cache.sizes(),
                    " and v_cache ", v_cache.sizes(), " differ");
  TORCH_CHECK_VALUE(query.dim() == 3 && query.stride(2) == 1,
                    "query must be [num_tokens, num_heads, head_dim] with head_dim contiguous");
  TORCH_CHECK_VALUE(out.sizes() == query.sizes() && out.stride(2) == 1,
                    "out must have query's shape with head_dim contiguous");
  const auto dtype = query.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "paged_attention supports float32, bfloat16 and float16, got ", dtype);
  const KvQuant quant = kv_quant_of(k_cache.scalar_type());
  TORCH_CHECK_VALUE(out.scalar_type() == dtype && v_cache.scalar_type() == k_cache.scalar_type() &&
                        (quant != KvQuant::kNone || k_cache.scalar_type() == dtype),
                    "query and out must share one dtype, and k_cache and v_cache either that "
                    "one or int8 / float8_e4m3fn / float8_e5m2 (a quantized cache), got query ",
                    dtype, ", out ", out.scalar_type(), ", caches ", k_cache.scalar_type(), " / ",
                    v_cache.scalar_type());
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), d = query.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(cache_head_dim(k_cache) == d, "head_dim of query (", d, ") and cache (",
                    cache_head_dim(k_cache), quant == KvQuant::kInt8 ? " + 1 scale byte" : "",
                    ") differ");
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

  // Query tile: about kTileRows rows (whole tokens, g rows each).
  const int64_t tile = std::clamp<int64_t>(kTileRows / g, 1, kMaxTileTokens);

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

  // Keys per online-softmax chunk and per split: whole blocks, fixed positions (a row's chunks
  // and splits depend on its position only); a split is whole chunks.
  int64_t chunk_blocks = std::max<int64_t>(1, kChunkKeys / bs);
  int64_t split_blocks =
      std::max<int64_t>(1, (split_keys > 0 ? split_keys : kDefaultSplitKeys) / bs);
  if (split_blocks < chunk_blocks) {
    chunk_blocks = split_blocks;
  } else {
    split_blocks -= split_blocks % chunk_blocks;
  }
  const int64_t chunk = chunk_blocks * bs, split = split_blocks * bs;
  const int nthreads = std::max(1, at::get_num_threads());
  Path path = quant == KvQuant::kInt8 && vnni ? Path::kI8 : pick_path(active_isa(), dtype, d);
  if (vnni && (quant == KvQuant::kFp8E4m3 || quant == KvQuant::kFp8E5m2)) {
    // read as stored by the vdpbf16ps body only (the float8 pairs widened in registers)
    TORCH_CHECK_VALUE(dtype == at::kBFloat16 && active_isa() >= Isa::kAvx512Bf16,
                      "kv_layout 1 on a float8 cache needs bfloat16 queries on an avx512_bf16 "
                      "or amx CPU step, got ", dtype, " on ", isa_name(active_isa()));
    path = Path::kBf16Dp;
  }
  // Decode items (fewer than 16 rows, the float32 body, a rows-layout cache, one chunk each)
  // run in units of all the KV heads of one (sequence, split), so a thread reads whole blocks
  // (attend_item_chunks: queue_rows), when there are units enough for every thread.
  int64_t decode_units = 0;
  if (path == Path::kF32 && !vnni && split == chunk && hkv > 1) {
    for (int64_t i = 0; i < num_seqs; ++i) {
      const int64_t ql = qsl[i + 1] - qsl[i];
      if (ql == 0 || ql * g >= 16) continue;
      const int64_t key_lo = window_start(lens[i] - ql) / bs * bs;  // as the items' below
      decode_units += (lens[i] - 1) / split - key_lo / split + 1;
    }
  }
  const bool units = decode_units >= 4 * nthreads;
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
      const int64_t rows_floats = count * g * (d + 2);
      max_rows = std::max(max_rows, count * g);
      const bool unit = units && count * g < 16;
      // split-major, so a unit's KV heads are consecutive items; head h's splits keep their
      // (m, l, acc) at partial_floats + (h * splits + sp) * rows_floats
      for (int64_t sp = 0; sp < splits; ++sp) {
        for (int64_t h = 0; h < hkv; ++h) {
          WorkItem it;
          it.q_row = qsl[i] + j0;
          it.first_pos = first_pos;
          it.key_begin = std::max(key_lo, (split0 + sp) * split);
          it.key_end = std::min(key_end, (split0 + sp + 1) * split);
          it.partial = splits > 1 ? partial_floats + (h * splits + sp) * rows_floats : -1;
          it.seq = static_cast<int32_t>(i);
          it.kv_head = static_cast<int32_t>(h);
          it.q_count = count;
          it.unit_heads = unit ? static_cast<int32_t>(hkv) : 1;
          items.push_back(it);
        }
      }
      if (splits > 1) {
        for (int64_t h = 0; h < hkv; ++h) {
          merges.push_back({qsl[i] + j0, partial_floats + h * splits * rows_floats,
                            static_cast<int32_t>(h), count, static_cast<int32_t>(splits)});
        }
        partial_floats += hkv * splits * rows_floats;
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
  const int64_t kv_elem = k_cache.element_size();
  p.k_stride_block = k_cache.stride(0) * kv_elem;
  p.k_stride_tok = k_cache.stride(1) * kv_elem;
  p.k_stride_head = k_cache.stride(2) * kv_elem;
  p.v_stride_block = v_cache.stride(0) * kv_elem;
  p.v_stride_tok = v_cache.stride(1) * kv_elem;
  p.v_stride_head = v_cache.stride(2) * kv_elem;
  p.kv_quant = quant;
  p.vnni = vnni;
  p.kv_row_bytes = k_cache.size(3) * kv_elem;
  if (vnni) {  // a (block, KV head) is bs rows' bytes, contiguous
    p.k_stride_head = bs * p.kv_row_bytes;
    p.v_stride_head = bs * p.kv_row_bytes;
  }
  p.block_tables = tables;
  p.bt_stride = bt_stride;
  p.block_size = bs;
  p.head_dim = d;
  p.group = g;
  p.chunk = chunk;
  p.ldk = (chunk + 32 + 15) / 16 * 16;
  p.scale = static_cast<float>(scale);
  p.window = window;
  at::Tensor workspace;
  if (partial_floats > 0) {
    workspace = at::empty({partial_floats}, query.options().dtype(at::kFloat));
    p.partials = workspace.data_ptr<float>();
  } else {
    p.partials = nullptr;
  }

  const ItemFn fn = path == Path::kI8   ? pick_i8_item_fn(attention_i8_body(), dtype)
                    : path == Path::kF32 ? pick_item_fn(at_most(active_isa(), Isa::kAvx512), dtype)
#if defined(__x86_64__)
                    : path == Path::kBf16Dp ? item_bf16_dp : item_bf16_amx;
#else
                    : nullptr;
#endif
  // Units (an item, or the items of a WorkItem::unit_heads unit) are claimed one at a time
  // from a shared counter (a dynamic schedule), each thread claiming its next unit before it
  // runs the current one, so the current one can prefetch the next one's first chunk while it
  // computes (Scratch::pump).
  std::vector<int64_t> unit_start;  // the units' first items, then the item count
  for (int64_t w = 0; w < static_cast<int64_t>(items.size()); w += items[w].unit_heads) {
    unit_start.push_back(w);
  }
  const int64_t num_units = static_cast<int64_t>(unit_start.size());
  unit_start.push_back(static_cast<int64_t>(items.size()));
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(nthreads) if (num_units > 1)
  {
    Scratch scratch(max_rows, d, p.ldk);
    int64_t u = claimed.fetch_add(1, std::memory_order_relaxed);
    while (u < num_units) {
      const int64_t next = claimed.fetch_add(1, std::memory_order_relaxed);
      scratch.next_unit = next < num_units ? &items[unit_start[next]] : nullptr;
      for (int64_t w = unit_start[u]; w < unit_start[u + 1]; ++w) {
        scratch.next = w + 1 < unit_start[u + 1] ? &items[w + 1] : scratch.next_unit;
        fn(p, items[w], scratch);
      }
      u = next;
    }
    if (path == Path::kAmx) at::native::cpublas::brgemm_release(/*is_vnni=*/true);
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

// One (token, head) row of d values into a quantized cache row (KvQuant), from T.
template <typename T>
void quantize_row(KvQuant q, const T* src, int64_t d, uint8_t* dst) {
  if (q == KvQuant::kInt8) {  // (vectorizable loops: a decode step writes a row per KV head)
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < d; ++i) {
      const float a = std::fabs(static_cast<float>(src[i]));
      amax = amax < a ? a : amax;
    }
    const uint8_t code = scale_code(amax / 127.0f);
    const float scale = code_scale(code);
    int8_t* v = reinterpret_cast<int8_t*>(dst);
    if (!(scale > 0.0f)) {
      std::fill(v, v + d, int8_t{0});
    } else {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float r = std::nearbyint(static_cast<float>(src[i]) / scale);
        v[i] = static_cast<int8_t>(static_cast<int32_t>(r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r));
      }
    }
    dst[d] = code;
  } else if (q == KvQuant::kFp8E4m3) {
    for (int64_t i = 0; i < d; ++i) {
      const float x = std::clamp(static_cast<float>(src[i]), -448.0f, 448.0f);
      dst[i] = c10::Float8_e4m3fn(x).x;
    }
  } else {
    for (int64_t i = 0; i < d; ++i) {
      const float x = std::clamp(static_cast<float>(src[i]), -57344.0f, 57344.0f);
      dst[i] = c10::Float8_e5m2(x).x;
    }
  }
}

template <typename T>
void quantize_rows(KvQuant q, const T* src, int64_t stride_head, int64_t hkv, int64_t d,
                   uint8_t* dst, int64_t dst_stride_head) {
  for (int64_t h = 0; h < hkv; ++h) quantize_row(q, src + h * stride_head, d, dst + h * dst_stride_head);
}

// Token `off` of a block of a quantized pair-layout cache (int8: cpu_attention_i8.h; float8:
// the bf16 pair orders, a byte a value): each head's row quantized as quantize_row does, its
// values into K^T word (j, off) / V pair row off / 2, an int8 row's scale code after the
// bs * d values. kb, vb: the block's first byte.
template <typename T>
void quantize_rows_pairs(KvQuant q, const T* k, int64_t k_stride_head, const T* v,
                         int64_t v_stride_head, int64_t hkv, int64_t d, int64_t bs, int64_t off,
                         uint8_t* kb, uint8_t* vb) {
  uint8_t row[513];  // d <= 512 (check_layout) values + an int8 row's scale code
  const int64_t region = bs * (d + (q == KvQuant::kInt8 ? 1 : 0));  // one (block, KV head)
  for (int64_t h = 0; h < hkv; ++h) {
    uint8_t* kh = kb + h * region;
    uint8_t* vh = vb + h * region;
    quantize_row(q, k + h * k_stride_head, d, row);
    for (int64_t j = 0; j < d / 2; ++j) {
      kh[(j * bs + off) * 2] = row[2 * j];
      kh[(j * bs + off) * 2 + 1] = row[2 * j + 1];
    }
    if (q == KvQuant::kInt8) kh[bs * d + off] = row[d];
    quantize_row(q, v + h * v_stride_head, d, row);
    for (int64_t e = 0; e < d; ++e) vh[((off / 2) * d + e) * 2 + off % 2] = row[e];
    if (q == KvQuant::kInt8) vh[bs * d + off] = row[d];
  }
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t kv_layout) {
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  const bool vnni = check_layout(kv_layout, k_cache, "k_cache");
  check_layout(kv_layout, v_cache, "v_cache");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() &&
                        k_cache.scalar_type() == v_cache.scalar_type(),
                    "k_cache and v_cache shapes or dtypes differ");
  const KvQuant quant = kv_quant_of(k_cache.scalar_type());
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2),
                d = cache_head_dim(k_cache);
  const int64_t num_tokens = slot_mapping.size(0);
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                        slot_mapping.is_contiguous(),
                    "slot_mapping must be a contiguous [num_tokens] int64 tensor");
  const auto dtype = key.scalar_type();
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == hkv &&
                          t->size(2) == d && t->stride(2) == 1,
                      "key and value must be [num_tokens, num_kv_heads, head_dim] with "
                      "head_dim contiguous, got ", t->sizes());
    TORCH_CHECK_VALUE(t->scalar_type() == dtype &&
                          (quant == KvQuant::kNone ? dtype == k_cache.scalar_type()
                                                   : (dtype == at::kFloat ||
                                                      dtype == at::kBFloat16 ||
                                                      dtype == at::kHalf)),
                      "key and value must share the caches' dtype (or be float32 / bfloat16 / "
                      "float16 for an int8 / float8 cache), got ", t->scalar_type(), " for a ",
                      k_cache.scalar_type(), " cache");
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_INDEX(slots[t] < num_blocks * bs, "slot_mapping[", t, "] = ", slots[t],
                      " is past the cache's ", num_blocks * bs, " slots");
  }
  const int64_t elem = key.element_size(), row_bytes = d * elem;
  const int64_t celem = k_cache.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0),
                vs1 = value.stride(1);
  const int64_t kc0 = k_cache.stride(0), kc1 = k_cache.stride(1), kc2 = k_cache.stride(2);
  const int64_t vc0 = v_cache.stride(0), vc1 = v_cache.stride(1), vc2 = v_cache.stride(2);
  // (a quantized row costs more than a copy: smaller pieces, so a decode step's rows spread)
  at::parallel_for(0, num_tokens, quant != KvQuant::kNone ? 16 : 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token: no slot
      const int64_t block = slot / bs, off = slot % bs;
      char* kdst = kc + (block * kc0 + off * kc1) * celem;
      char* vdst = vc + (block * vc0 + off * vc1) * celem;
      if (quant != KvQuant::kNone && vnni) {
        auto* kb = reinterpret_cast<uint8_t*>(kc) + block * kc0;
        auto* vb = reinterpret_cast<uint8_t*>(vc) + block * vc0;
        if (dtype == at::kFloat) {
          quantize_rows_pairs(quant, key.data_ptr<float>() + t * ks0, ks1,
                              value.data_ptr<float>() + t * vs0, vs1, hkv, d, bs, off, kb, vb);
        } else if (dtype == at::kBFloat16) {
          quantize_rows_pairs(quant, key.data_ptr<c10::BFloat16>() + t * ks0, ks1,
                              value.data_ptr<c10::BFloat16>() + t * vs0, vs1, hkv, d, bs, off,
                              kb, vb);
        } else {
          quantize_rows_pairs(quant, key.data_ptr<c10::Half>() + t * ks0, ks1,
                              value.data_ptr<c10::Half>() + t * vs0, vs1, hkv, d, bs, off, kb,
                              vb);
        }
        continue;
      }
      if (quant != KvQuant::kNone) {
        auto* kd = reinterpret_cast<uint8_t*>(kdst);
        auto* vd = reinterpret_cast<uint8_t*>(vdst);
        if (dtype == at::kFloat) {
          quantize_rows(quant, key.data_ptr<float>() + t * ks0, ks1, hkv, d, kd, kc2);
          quantize_rows(quant, value.data_ptr<float>() + t * vs0, vs1, hkv, d, vd, vc2);
        } else if (dtype == at::kBFloat16) {
          quantize_rows(quant, key.data_ptr<c10::BFloat16>() + t * ks0, ks1, hkv, d, kd, kc2);
          quantize_rows(quant, value.data_ptr<c10::BFloat16>() + t * vs0, vs1, hkv, d, vd, vc2);
        } else {
          quantize_rows(quant, key.data_ptr<c10::Half>() + t * ks0, ks1, hkv, d, kd, kc2);
          quantize_rows(quant, value.data_ptr<c10::Half>() + t * vs0, vs1, hkv, d, vd, vc2);
        }
        continue;
      }
      if (vnni) {  // K^T word (j, off) and V pair row off / 2 of each head's block (copy_k_vnni)
        const auto* ksrc = reinterpret_cast<const uint16_t*>(kp);
        const auto* vsrc = reinterpret_cast<const uint16_t*>(vp);
        auto* kb = reinterpret_cast<uint16_t*>(kc) + block * kc0;
        auto* vb = reinterpret_cast<uint16_t*>(vc) + block * vc0;
        for (int64_t h = 0; h < hkv; ++h) {
          const uint16_t* kr = ksrc + t * ks0 + h * ks1;
          const uint16_t* vr = vsrc + t * vs0 + h * vs1;
          uint16_t* kh = kb + h * bs * d;
          uint16_t* vh = vb + h * bs * d + (off / 2) * 2 * d + off % 2;
          for (int64_t j = 0; j < d / 2; ++j) {
            kh[(j * bs + off) * 2] = kr[2 * j];
            kh[(j * bs + off) * 2 + 1] = kr[2 * j + 1];
          }
          for (int64_t e = 0; e < d; ++e) vh[2 * e] = vr[e];
        }
        continue;
      }
      for (int64_t h = 0; h < hkv; ++h) {
        std::memcpy(kdst + h * kc2 * celem, kp + (t * ks0 + h * ks1) * elem, row_bytes);
        std::memcpy(vdst + h * vc2 * celem, vp + (t * vs0 + h * vs1) * elem, row_bytes);
      }
    }
  });
}

std::string cpu_isa() { return isa_name(active_isa()); }

std::string attention_int8_body() { return body_name(attention_i8_body()); }

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY(pagedserve, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "int split_keys=0, int sliding_window=0, int kv_layout=0) -> ()");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, int kv_layout=0) -> ()");
  m.def("cpu_isa() -> str", &pagedserve::cpu_isa);
  m.def("attention_int8_body() -> str", &pagedserve::attention_int8_body);
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
            int64_t, int64_t) {});
  m.impl("reshape_and_cache", [](const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                 const at::Tensor&, int64_t) {});
}
