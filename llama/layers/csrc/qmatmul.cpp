// int8 and int4 weight products for the CPU, in the way of llama.cpp / ggml's CPU backend:
// the activation rows are quantised to int8 once per product, in blocks of 32 values with
// one float scale each (as Q8_0 does), and each weight row is multiplied by integer dot
// products with the CPU's own instructions -- AVX-512 VNNI's `vpdpbusd` (4 byte products
// summed into each 32-bit lane) or AVX2's `vpmaddubsw` + `vpmaddwd` -- the output rows split
// over torch's threads.  Both instruction paths are compiled into this one file (function
// target attributes: no -march flag, so the library loads on any x86-64 CPU) and chosen at
// run time by the caller (`isa`: 2 = AVX-512 VNNI, 1 = AVX2), which the kernel policy decides
// from the CPU's features (llama/layers/policy.py).  Reference in pure torch, and the layout
// of the int4 matrix: llama/layers/cpu_kernels.py.
//
// int8 weights: the layer's own (N, K) int8 tensor, one float scale per row; nothing repacked.
//   VNNI multiplies unsigned by signed bytes, so the weight bytes are read with their top bit
//   flipped (w + 128, unsigned) against the signed activation codes; the 128 * sum(codes) this
//   adds is taken off once per activation row.  AVX2 uses the sign trick instead
//   (|x| times w with x's sign; no 16-bit overflow: 2 * 127 * 127 < 32767).
// int4 weights: codes 0..15 with a scale and an offset per group of 32 to 256 values
//   (W = (q - 8) * s + z), laid out per row in chunks of 16 blocks of 32 (512 values) so that
//   one 32-bit lane accumulates one block, each chunk's codes followed by its groups' scales and
//   offsets, one per group (not per block: groups of 128 read 4.25 bits a weight, not 5), which
//   the tiles spread over the lanes with a permute: see pack_int4 in cpu_kernels.py.
// Tiles: output features go in blocks of 64 (kOutBlock); a tile gives the sums of a few weight
//   rows against a few activation rows, each vector it loads used for several sums (up to 8
//   activation rows for a decoding batch, or up to 8 weight rows for one activation row); the
//   block's sums are then scaled, corrected and written a vector at a time (Results).  Each
//   weight row is read from its start to its end before the next (one stream from memory at a
//   time): AMD Zen 4's prefetchers lose a pattern that steps from row to row (2.3x slower).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace {

// Storage on 64-byte boundaries for what the tiles load a vector at a time: a 512-bit load
// that crosses a cache line is two loads, and the several-row tiles are bound by their loads
// (the activation's vectors and per-block scales, for every weight vector).  std::vector's own
// storage is only 16-byte aligned: with it the 150m's 8-row int4 products took 11 % longer
// (AMD Zen 4, 1 thread, four alternations: 8.36-8.68 ms a step against 7.55-7.77).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

constexpr int64_t kBlock = 32;
// Activation rows a tile multiplies by each weight vector it loads (a decoding batch of up to
// 8 reads the weight once): the AVX-512 tiles take 8; the AVX2 ones (16 registers) take 4.
constexpr int kMaxRowsPerTile = 8;
constexpr int kMaxRowsNarrow = 4;
// Output features whose sums a tile gathers before they are scaled, converted and written,
// a vector at a time, for each activation row.
constexpr int64_t kOutBlock = 64;

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
// the tiles' helpers, inlined so that their vectors stay in registers
#define INLINE inline __attribute__((always_inline))

// Activation rows quantised: codes (in the order the weight's layout wants), the scale of
// each block, and each block's sum of codes.  Buffers kept per thread between calls.
struct QuantRows {
  AlignedVector<int8_t> codes;  // (M, K_padded)
  AlignedVector<float> scale;   // (M, K_padded / 32)
  AlignedVector<int32_t> sum;   // (M, K_padded / 32)
};

#define TARGET_AVX2_ONLY __attribute__((target("avx2,fma")))

TARGET_AVX2_ONLY INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
TARGET_AVX2_ONLY INLINE __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// One block of 32 values -> 32 codes round(x / d) (ties to even, as torch.round), d = max|x| / 127
// (as ggml's quantize_row_q8_0 for AVX2).  Returns the sum of the codes.
template <typename T>
TARGET_AVX2_ONLY int32_t quantize_block(const T* x, int8_t* codes, float* d_out) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.f;
  *d_out = d;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
  s = _mm_hadd_epi32(s, s);
  s = _mm_hadd_epi32(s, s);
  // int32 -> int16 -> int8 (saturating; |code| <= 127 anyway), then undo the packs' lane order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return _mm_cvtsi128_si32(s);
}

// x (M, K) -> Q8_0-like codes in blocks of 32 (K a multiple of 32), zero past K up to K_padded.
// `permute`: the int4 layout's order within chunks of 16 (or 8) blocks (see pack_int4).
template <typename T>
TARGET_AVX2_ONLY void quantize_rows(QuantRows& q, const T* x, int64_t M, int64_t K, int64_t K_padded, bool permute) {
  const int64_t nb = K_padded / kBlock, nk = K / kBlock;
  q.codes.assign(M * K_padded, 0);
  q.scale.assign(M * nb, 0.f);
  q.sum.assign(M * nb, 0);
  alignas(32) int8_t block[kBlock];
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * K;
    int8_t* out = q.codes.data() + m * K_padded;
    for (int64_t b = 0; b < nk; ++b) {
      const int64_t at = m * nb + b;
      if (!permute) {
        q.sum[at] = quantize_block(row + b * kBlock, out + b * kBlock, &q.scale[at]);
        continue;
      }
      q.sum[at] = quantize_block(row + b * kBlock, block, &q.scale[at]);
      // chunk of B blocks (16; 8 for a last 256 values): value 4v + j of block l goes to byte (v * B + l) * 4 + j
      const int64_t first = b / 16 * 16;
      const int64_t chunk_blocks = first + 16 <= nb ? 16 : 8;
      int8_t* chunk = out + first * kBlock + (b - first) * 4;
      for (int64_t v = 0; v < 8; ++v) std::memcpy(chunk + v * chunk_blocks * 4, block + v * 4, 4);
    }
  }
}

QuantRows& thread_buffers() {
  thread_local QuantRows q;
  return q;
}

// ---------------------------------------------------------------------------- int8 activation blocks
// The int8 kernel reads the weight as it is (row-major), 64 bytes a vector, and lets each 32-bit
// lane sum over up to 8 vectors (512 values) before it scales: so the activation's blocks of
// 32 are the values one lane sees -- block l of a group of 512 is values 64c + 4l + j (c < 8,
// j < 4) -- not 32 neighbours.  A last group of fewer than 8 vectors has blocks of 4 values a
// vector; a last 32 values (widths of 64n + 32) are one block.  (cpu_kernels.q8_block_index.)

TARGET_AVX2_ONLY inline void store_codes32(const __m256i* q, int8_t* out) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// `chunks` (1..8) vectors of 64 values at x -> their codes at `codes` (same order), the 16 lane
// blocks' scales d[16] and sums of codes sums[16]
template <typename T>
TARGET_AVX2_ONLY void quantize_lanes(const T* x, int chunks, int8_t* codes, float* d, int32_t* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx[8];
  for (int t = 0; t < 8; ++t) mx[t] = _mm256_setzero_ps();
  for (int c = 0; c < chunks; ++c)
    for (int t = 0; t < 8; ++t) mx[t] = _mm256_max_ps(mx[t], _mm256_andnot_ps(sign, load8(x + 64 * c + 8 * t)));
  alignas(32) float tmp[8];
  __m256 inv[8];
  for (int t = 0; t < 8; ++t) {  // ymm t holds lanes 2t (its first 4 values) and 2t + 1
    _mm256_store_ps(tmp, mx[t]);
    const float a0 = std::max(std::max(tmp[0], tmp[1]), std::max(tmp[2], tmp[3]));
    const float a1 = std::max(std::max(tmp[4], tmp[5]), std::max(tmp[6], tmp[7]));
    d[2 * t] = a0 / 127.f;
    d[2 * t + 1] = a1 / 127.f;
    const float i0 = a0 > 0.f ? 1.f / d[2 * t] : 0.f, i1 = a1 > 0.f ? 1.f / d[2 * t + 1] : 0.f;
    inv[t] = _mm256_setr_ps(i0, i0, i0, i0, i1, i1, i1, i1);
  }
  __m256i sum[8];
  for (int t = 0; t < 8; ++t) sum[t] = _mm256_setzero_si256();
  for (int c = 0; c < chunks; ++c) {
    __m256i q[8];
    for (int t = 0; t < 8; ++t) {
      q[t] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(load8(x + 64 * c + 8 * t), inv[t]),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      sum[t] = _mm256_add_epi32(sum[t], q[t]);
    }
    store_codes32(q, codes + 64 * c);
    store_codes32(q + 4, codes + 64 * c + 32);
  }
  alignas(32) int32_t si[8];
  for (int t = 0; t < 8; ++t) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(si), sum[t]);
    sums[2 * t] = si[0] + si[1] + si[2] + si[3];
    sums[2 * t + 1] = si[4] + si[5] + si[6] + si[7];
  }
}

// Blocks of a width K: 16 per group of up to 512 values (of whole vectors of 64), and one for a last 32.
inline int64_t q8_groups(int64_t K) { return (K / 64 + 7) / 8; }
inline int64_t q8_blocks(int64_t K) { return 16 * q8_groups(K) + (K % 64 ? 1 : 0); }

// x (M, K) -> codes in place order, each block's scale and sum (q8_blocks(K) a row)
template <typename T>
TARGET_AVX2_ONLY void quantize_rows_lanes(QuantRows& q, const T* x, int64_t M, int64_t K) {
  const int64_t nb = q8_blocks(K), vectors = K / 64;
  q.codes.resize(M * K);
  q.scale.assign(M * nb, 0.f);
  q.sum.assign(M * nb, 0);
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * K;
    int8_t* out = q.codes.data() + m * K;
    float* d = q.scale.data() + m * nb;
    int32_t* sums = q.sum.data() + m * nb;
    for (int64_t g = 0; g * 8 < vectors; ++g) {
      const int chunks = static_cast<int>(std::min<int64_t>(8, vectors - g * 8));
      quantize_lanes(row + 512 * g, chunks, out + 512 * g, d + 16 * g, sums + 16 * g);
    }
    if (K % 64) sums[nb - 1] = quantize_block(row + K - 32, out + K - 32, d + nb - 1);
  }
}

// The sums of T (<= 8) vectors' 16 lanes each, in order, as one transposing tree: a few
// shuffles an output instead of a horizontal sum each (which short rows -- 512 values -- feel).
template <int T>
TARGET_AVX512 INLINE __m256 sums_of_8x512(const __m512* acc) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i) a[i] = i < T ? acc[i] : _mm512_setzero_ps();
  __m512 t[4];  // per 128-bit lane: [a(2i) 0+2, a(2i+1) 0+2, a(2i) 1+3, a(2i+1) 1+3]
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  // per 128-bit lane: [a0, a1, a2, a3] (u0) and [a4, a5, a6, a7] (u1), each lane's part
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x44), _mm512_shuffle_ps(t[0], t[1], 0xEE));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_ps(t[2], t[3], 0x44), _mm512_shuffle_ps(t[2], t[3], 0xEE));
  // 128-bit lanes [u0 0+1, u0 2+3, u1 0+1, u1 2+3], then [u0 0+1, u1 0+1, u0 2+3, u1 2+3]
  const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 q = _mm512_shuffle_f32x4(p, p, _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_add_ps(_mm512_castps512_ps256(q), _mm512_extractf32x8_ps(q, 1));
}

// The sums of MR (<= 4) vectors' lanes, as one transposing tree (cheaper than one
// horizontal sum each, which a short row -- 512 values -- feels).
template <int MR>
TARGET_AVX512 INLINE void sums_of_512(const __m512* acc, float* out) {
  __m512 a[4];
  for (int r = 0; r < 4; ++r) a[r] = r < MR ? acc[r] : _mm512_setzero_ps();
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // per 128-bit lane: [a0, a1, a2, a3] partial sums
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  alignas(16) float v[4];
  _mm_store_ps(v, q);
  for (int r = 0; r < MR; ++r) out[r] = v[r];
}

template <int MR>
TARGET_AVX2 INLINE void sums_of_256(const __m256* acc, float* out) {
  __m256 a[4];
  for (int r = 0; r < 4; ++r) a[r] = r < MR ? acc[r] : _mm256_setzero_ps();
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  alignas(16) float v[4];
  _mm_store_ps(v, q);
  for (int r = 0; r < MR; ++r) out[r] = v[r];
}

// ---------------------------------------------------------------------------- int8, AVX-512 VNNI

// NR weight rows (ws bytes apart) against MR activation rows: each weight vector loaded once
// for the MR rows, the activation's vectors read again (from L1) for each weight row, MR * NR
// sums (<= 8) reduced together at the end.  xt: the MR rows' codes interleaved by vectors of
// 64 (interleave_tile), so that a vector's MR rows are neighbours, read at fixed offsets.  res[r * kOutBlock + j]: the sum of
// activation row r and weight row j, in the activation's units, before the row's scale and the
// flipped weights' correction.  dv: per activation row, 16 lane scales a group, then (widths of
// 64n + 32) 8 copies of the last block's.
template <int MR, int NR>
TARGET_AVX512 INLINE void q8_tile_avx512(const int8_t* w, int64_t ws, int64_t K, const int8_t* xt, const float* dv,
                                         int64_t dv_stride, float* res) {
  constexpr int T = MR * NR;  // sum i: weight row i / MR, activation row i % MR
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[T];
  for (int i = 0; i < T; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t vectors = K / 64;
  // One weight row after another, each read from start to end: a single stream from memory at
  // a time, which the prefetchers follow (AMD Zen 4's lose a pattern that steps across rows:
  // 2.3x slower on the 150m's output matrix at one row, measured); the activation's vectors
  // come again from L1 for each weight row.
  for (int j = 0; j < NR; ++j) {
    const int8_t* wr = w + j * ws;
    const int8_t* x = xt;
    for (int64_t g = 0; g * 8 < vectors; ++g) {
      const int64_t chunks = std::min<int64_t>(8, vectors - g * 8);
      __m512i dot[MR];
      for (int r = 0; r < MR; ++r) dot[r] = _mm512_setzero_si512();
      for (int64_t c = 0; c < chunks; ++c, wr += 64, x += MR * 64) {
        const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(wr), flip);  // w + 128, unsigned
        for (int r = 0; r < MR; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], wu, _mm512_loadu_si512(x + r * 64));
      }
      for (int r = 0; r < MR; ++r)
        acc[j * MR + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_loadu_ps(dv + r * dv_stride + 16 * g),
                                          acc[j * MR + r]);
    }
    if (K % 64) {  // one block of 32 left: the low 8 lanes (the activation's upper 32 bytes and scales zero)
      const int64_t last = 16 * q8_groups(K);
      const __m512i wu =
          _mm512_xor_si512(_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr))), flip);
      for (int r = 0; r < MR; ++r) {
        const __m512 d = _mm512_maskz_loadu_ps(0x00FF, dv + r * dv_stride + last);
        acc[j * MR + r] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, _mm512_loadu_si512(x + r * 64))), d,
            acc[j * MR + r]);
      }
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, sums_of_8x512<T>(acc));
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) res[r * kOutBlock + j] = sums[j * MR + r];
}

// Weight rows per tile for MR activation rows: 8 sums a tile, so that one transposing
// reduction (sums_of_8x512) serves them all.
template <int MR>
constexpr int q8_weight_rows() { return MR >= 5 ? 1 : 8 / MR; }

// `count` weight rows from w (ws bytes apart) against MR activation rows -> res (MR, kOutBlock)
template <int MR>
TARGET_AVX512 void q8_rows_avx512(const int8_t* w, int64_t ws, int64_t count, int64_t K, const int8_t* xt,
                                  const float* dv, int64_t dv_stride, float* res) {
  constexpr int NR = q8_weight_rows<MR>();
  int64_t j = 0;
  for (; j + NR <= count; j += NR) q8_tile_avx512<MR, NR>(w + j * ws, ws, K, xt, dv, dv_stride, res + j);
  for (; j < count; ++j) q8_tile_avx512<MR, 1>(w + j * ws, ws, K, xt, dv, dv_stride, res + j);
}

// Bytes of a tile of `rows` activation rows' codes interleaved: a vector of 64 per row and
// vector of the width (a last 32 values padded with zeros)
inline int64_t interleaved_bytes(int64_t rows, int64_t K) { return rows * (K + 63) / 64 * 64; }

// codes (rows, K) -> xt: vector c of row r at (c * rows + r) * 64
inline void interleave_tile(const int8_t* codes, int64_t rows, int64_t K, int8_t* xt) {
  const int64_t vectors = (K + 63) / 64;
  for (int64_t c = 0; c < vectors; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      int8_t* to = xt + (c * rows + r) * 64;
      const int64_t n = std::min<int64_t>(64, K - 64 * c);
      std::memcpy(to, codes + r * K + 64 * c, n);
      std::memset(to + n, 0, 64 - n);
    }
}

// ---------------------------------------------------------------------------- int8, AVX2

// sum of |x| * (w with x's sign) over 32 bytes, 4 bytes a 32-bit lane (no 16-bit overflow: 2 * 127 * 127)
TARGET_AVX2 inline __m256i dot32_avx2(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x)),
                           _mm256_set1_epi16(1));
}

template <int MR>
TARGET_AVX2 void q8_rows_avx2(const int8_t* w, int64_t K, const int8_t* xq, int64_t x_stride, const float* dv,
                              int64_t dv_stride, float* out) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t vectors = K / 64;
  int64_t k = 0;
  for (int64_t g = 0; g * 8 < vectors; ++g) {
    const int64_t chunks = std::min<int64_t>(8, vectors - g * 8);
    __m256i lo[MR], hi[MR];  // lanes 0..7, 8..15 of the 64-byte vectors
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < chunks; ++c, k += 64) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 32));
      for (int r = 0; r < MR; ++r) {
        const int8_t* x = xq + r * x_stride + k;
        lo[r] = _mm256_add_epi32(lo[r], dot32_avx2(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
        hi[r] = _mm256_add_epi32(hi[r], dot32_avx2(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))));
      }
    }
    for (int r = 0; r < MR; ++r) {
      const float* d = dv + r * dv_stride + 16 * g;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r]), _mm256_loadu_ps(d), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_loadu_ps(d + 8), acc[r]);
    }
  }
  if (k < K) {  // one block of 32 left
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const int64_t last = 16 * q8_groups(K);
    for (int r = 0; r < MR; ++r) {
      const __m256i dot = dot32_avx2(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * x_stride + k)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_loadu_ps(dv + r * dv_stride + last), acc[r]);
    }
  }
  sums_of_256<MR>(acc, out);
}

// ---------------------------------------------------------------------------- int4 layout
// A row: per chunk of B blocks (B = 16; 8 for a last chunk of 256 values), 4 groups of 4B bytes
// of codes (byte i of group t: low nibble value 8t + i%4 of block i/4, high nibble value
// 8t + 4 + i%4 of the same block), then the chunk's G = B / per bfloat16 scales, then its G
// offsets, where `per` (1, 2, 4 or 8) is how many blocks of 32 one scale covers.  The tiles
// want a scale and an offset per lane (a lane a block): lane l takes value l / per, spread by a
// permute whose indices are constants of the layout (Int4Scales).

// A table of N lane indices, f(lane) each
template <int N, typename F>
constexpr std::array<int32_t, N> lane_table(F f) {
  std::array<int32_t, N> a{};
  for (int l = 0; l < N; ++l) a[l] = f(l);
  return a;
}

// How the scales of a product's weight rows are stored (a scale and an offset per PER blocks of
// 32), and where a tile's lanes find theirs: a type, so that each layout's tiles are compiled
// with their sizes and permutes as constants (chosen once per product, in q4_matmul).
template <int PER>
struct Int4Scales {
  static constexpr int per = PER;
  static constexpr int n = 16 / PER, nh = 8 / PER;  // scales (and offsets) a chunk, a last chunk
  static constexpr int64_t chunk_bytes = 256 + 4 * n;  // a last chunk: 128 + 4 * nh
  static constexpr int chunk_dwords = n, half_dwords = nh;  // 4-byte words of scales and offsets
  static constexpr bool z_high = PER == 2;  // an AVX2 chunk's offsets are in the second 8 values
  static constexpr int z0 = z_high ? n - 8 : n;
  // lane -> index among the loaded values [scales..., offsets...] (PER > 1 only)
  static constexpr std::array<int32_t, 16> s16 = lane_table<16>([](int l) { return l / PER; });
  static constexpr std::array<int32_t, 16> z16 = lane_table<16>([](int l) { return n + l / PER; });
  static constexpr std::array<int32_t, 8> s_lo = lane_table<8>([](int l) { return l / PER; });
  static constexpr std::array<int32_t, 8> s_hi = lane_table<8>([](int l) { return (8 + l) / PER; });
  static constexpr std::array<int32_t, 8> z_lo = lane_table<8>([](int l) { return z0 + l / PER; });
  static constexpr std::array<int32_t, 8> z_hi = lane_table<8>([](int l) { return z0 + (8 + l) / PER; });
  static constexpr std::array<int32_t, 8> s_half = lane_table<8>([](int l) { return l / PER; });
  static constexpr std::array<int32_t, 8> z_half = lane_table<8>([](int l) { return nh + l / PER; });
};

// Bytes of an int4 row of this padded width with a scale per `per` blocks
inline int64_t int4_row_bytes(int64_t K_padded, int per) {
  return K_padded / 512 * (256 + 64 / per) + (K_padded % 512 ? 128 + 32 / per : 0);
}

// The `dwords` 4-byte words at p (8, 4, 2 or 1; the rest zero), read by one load of exactly that
// size (nothing past them: the last row's may end the tensor), as up to 16 bfloat16
template <int dwords>
TARGET_AVX2_ONLY INLINE __m256i load_words(const uint8_t* p) {
  static_assert(dwords == 8 || dwords == 4 || dwords == 2 || dwords == 1, "a scale area of 8, 4, 2 or 1 words");
  if constexpr (dwords == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m128i v;
  if constexpr (dwords == 4) v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (dwords == 2) v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (dwords == 1) {
    int32_t word;
    std::memcpy(&word, p, 4);
    v = _mm_cvtsi32_si128(word);
  }
  return _mm256_inserti128_si256(_mm256_setzero_si256(), v, 0);
}

// Those words as two vectors of 8 floats (bfloat16 0-7, 8-15)
template <int dwords>
TARGET_AVX2_ONLY INLINE void bf16_words(const uint8_t* p, __m256* lo, __m256* hi) {
  const __m256i v = load_words<dwords>(p);
  *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
  *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
}

TARGET_AVX2_ONLY INLINE __m256i idx8(const std::array<int32_t, 8>& i) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(i.data()));
}

// The scales s and offsets less 8 s (z) of a last chunk's 8 blocks (stored at p), a lane a block
template <typename L>
TARGET_AVX2_ONLY INLINE void q4_half_scales(const uint8_t* p, L g, __m256* s, __m256* z) {
  const auto* sz = reinterpret_cast<const c10::BFloat16*>(p);
  __m256 zs;
  if constexpr (L::per == 1) {
    *s = load8(sz);
    zs = load8(sz + 8);
  } else {
    __m256 lo, hi;
    bf16_words<L::half_dwords>(p, &lo, &hi);
    *s = _mm256_permutevar8x32_ps(lo, idx8(L::s_half));
    zs = _mm256_permutevar8x32_ps(lo, idx8(L::z_half));
  }
  *z = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), *s, zs);
}

// The scales and offsets less 8 s of a chunk's 16 blocks (stored at p) for the AVX2 tiles: blocks
// 0-7 (s_lo, z_lo) and 8-15 (s_hi, z_hi)
template <typename L>
TARGET_AVX2_ONLY INLINE void q4_scales_avx2(const uint8_t* p, L g, __m256* s_lo, __m256* s_hi,
                                            __m256* z_lo, __m256* z_hi) {
  const auto* sz = reinterpret_cast<const c10::BFloat16*>(p);
  __m256 zl, zh;
  if constexpr (L::per == 1) {
    *s_lo = load8(sz), *s_hi = load8(sz + 8), zl = load8(sz + 16), zh = load8(sz + 24);
  } else {
    __m256 lo, hi;
    bf16_words<L::chunk_dwords>(p, &lo, &hi);
    const __m256 zsrc = L::z_high ? hi : lo;
    *s_lo = _mm256_permutevar8x32_ps(lo, idx8(L::s_lo));
    *s_hi = _mm256_permutevar8x32_ps(lo, idx8(L::s_hi));
    zl = _mm256_permutevar8x32_ps(zsrc, idx8(L::z_lo));
    zh = _mm256_permutevar8x32_ps(zsrc, idx8(L::z_hi));
  }
  const __m256 eight = _mm256_set1_ps(8.f);
  *z_lo = _mm256_fnmadd_ps(eight, *s_lo, zl);
  *z_hi = _mm256_fnmadd_ps(eight, *s_hi, zh);
}

// The last half chunk of an int4 row (8 blocks: 128 bytes of codes, then their scales and
// offsets): its codes (u8, 8 vectors, one 32-bit lane a block), scales s and offsets less 8 s (z).
// Inlined into the AVX2 and the AVX-512 paths alike.
template <typename L>
TARGET_AVX2_ONLY INLINE void q4_half_chunk(const uint8_t* w, L g, __m256i* q, __m256* s, __m256* z) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * t));
    q[2 * t] = _mm256_and_si256(b, low);
    q[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
  }
  q4_half_scales(w + 128, g, s, z);
}

// ---------------------------------------------------------------------------- int4, AVX-512 VNNI

// 16 bfloat16 bit patterns -> 16 floats
TARGET_AVX512 INLINE __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TARGET_AVX512 INLINE __m512 bf16x16_to_f32(const c10::BFloat16* p) {
  return bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The scales s and offsets less 8 s (z) of a chunk's 16 blocks (stored at p), a lane a block
template <typename L>
TARGET_AVX512 INLINE void q4_scales_avx512(const uint8_t* p, L g, __m512* s, __m512* z) {
  const auto* sz = reinterpret_cast<const c10::BFloat16*>(p);
  __m512 zs;
  if constexpr (L::per == 1) {
    *s = bf16x16_to_f32(sz);
    zs = bf16x16_to_f32(sz + 16);
  } else {
    const __m512 v = bf16x16_to_f32(load_words<L::chunk_dwords>(p));
    *s = _mm512_permutexvar_ps(_mm512_loadu_si512(L::s16.data()), v);
    zs = _mm512_permutexvar_ps(_mm512_loadu_si512(L::z16.data()), v);
  }
  *z = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), *s, zs);
}

// NR weight rows against MR activation rows (MR * NR <= 8 sums): each chunk of a weight row
// unpacked once for the MR rows, the MR * NR sums reduced together at the end (sums_of_8x512),
// the block of weight rows looped over inside (q4_rows_avx512): a call and a reduction a weight
// row cost as much as a 512-wide row's products (int4's 128256 x 512 matrix at 4 rows: 5.4 ms,
// linear in the rows, with a call a weight row).  xd: per activation row and block, d (the
// activation scale); xs: d * sum(codes).  res[r * kOutBlock + j]: activation row r, weight row j.
template <int MR, int NR, typename L>
TARGET_AVX512 INLINE void q4_tile_avx512(const uint8_t* w, int64_t ws, L g, int64_t K, const int8_t* xq,
                                         int64_t x_stride, const float* xd, const float* xs, int64_t s_stride, float* res) {
  constexpr int T = MR * NR;  // sum i: weight row i / MR, activation row i % MR
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[T];
  for (int i = 0; i < T; ++i) acc[i] = _mm512_setzero_ps();
  float tail[T];
  for (int i = 0; i < T; ++i) tail[i] = 0.f;
  for (int j = 0; j < NR; ++j) {  // each weight row from its start to its end (see q8_tile_avx512)
    const uint8_t* wr = w + j * ws;
    int64_t k = 0;
    for (; k + 512 <= K; k += 512, wr += L::chunk_bytes) {
      __m512i q[8];
      for (int t = 0; t < 4; ++t) {
        const __m512i b = _mm512_loadu_si512(wr + 64 * t);
        q[2 * t] = _mm512_and_si512(b, low);
        q[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
      }
      __m512 s, z;  // z - 8 s
      q4_scales_avx512(wr + 256, g, &s, &z);
      const int64_t b0 = k / kBlock;
      for (int r = 0; r < MR; ++r) {
        const int8_t* x = xq + r * x_stride + k;
        __m512i dot = _mm512_setzero_si512();
        for (int v = 0; v < 8; ++v) dot = _mm512_dpbusd_epi32(dot, q[v], _mm512_loadu_si512(x + 64 * v));
        const __m512 d = _mm512_loadu_ps(xd + r * s_stride + b0);
        __m512& a = acc[j * MR + r];
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, d), a);
        a = _mm512_fmadd_ps(z, _mm512_loadu_ps(xs + r * s_stride + b0), a);
      }
    }
    if (k < K) {  // a chunk of 8 blocks
      __m256i q[8];
      __m256 s, z;
      q4_half_chunk(wr, g, q, &s, &z);
      const int64_t b0 = k / kBlock;
      for (int r = 0; r < MR; ++r) {
        const int8_t* x = xq + r * x_stride + k;
        __m256i dot = _mm256_setzero_si256();
        for (int v = 0; v < 8; ++v)
          dot = _mm256_dpbusd_epi32(dot, q[v], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * v)));
        const __m256 d = _mm256_loadu_ps(xd + r * s_stride + b0);
        __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, d));
        f = _mm256_fmadd_ps(z, _mm256_loadu_ps(xs + r * s_stride + b0), f);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        tail[j * MR + r] = _mm_cvtss_f32(h);
      }
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, sums_of_8x512<T>(acc));
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < MR; ++r) res[r * kOutBlock + j] = sums[j * MR + r] + tail[j * MR + r];
}

// `count` weight rows from w (ws bytes apart) against MR activation rows -> res (MR, kOutBlock)
template <int MR, typename L>
TARGET_AVX512 void q4_rows_avx512(const uint8_t* w, int64_t ws, L g, int64_t count, int64_t K,
                                  const int8_t* xq, int64_t x_stride, const float* xd, const float* xs, int64_t s_stride,
                                  float* res) {
  constexpr int NR = q8_weight_rows<MR>();
  int64_t j = 0;
  for (; j + NR <= count; j += NR)
    q4_tile_avx512<MR, NR>(w + j * ws, ws, g, K, xq, x_stride, xd, xs, s_stride, res + j);
  for (; j < count; ++j) q4_tile_avx512<MR, 1>(w + j * ws, ws, g, K, xq, x_stride, xd, xs, s_stride, res + j);
}

// One weight row's chunk (at wr) against the activation's codes (512: xv, 8 vectors held in
// registers, or loaded from x as the products' operands) and scales d and d * sum(codes) ds, added
// to acc (a lane a block)
template <bool kCodesInRegisters, typename L>
TARGET_AVX512 INLINE __m512 q4_chunk_avx512(const uint8_t* wr, L g, const __m512i* xv, const int8_t* x,
                                            __m512 d, __m512 ds, __m512 acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i dot = _mm512_setzero_si512();
  for (int t = 0; t < 4; ++t) {
    const __m512i b = _mm512_loadu_si512(wr + 64 * t);
    const __m512i x0 = kCodesInRegisters ? xv[2 * t] : _mm512_loadu_si512(x + 128 * t);
    const __m512i x1 = kCodesInRegisters ? xv[2 * t + 1] : _mm512_loadu_si512(x + 128 * t + 64);
    dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(b, low), x0);
    dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(_mm512_srli_epi16(b, 4), low), x1);
  }
  __m512 s, z;  // z - 8 s
  q4_scales_avx512(wr + 256, g, &s, &z);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, d), acc);
  return _mm512_fmadd_ps(z, ds, acc);
}

// One activation row (a decoding step) against NR (<= 4) weight rows, widths of whole chunks of
// 512: the NR sums come out of one transposing reduction (sums_of_512) instead of one each -- a
// weight row of a 512-wide matrix is 272 to 320 bytes, little work to hide a row's fixed costs
// behind.  One chunk wide, the NR rows are one stretch of memory and the codes are loaded once for
// them all; wider, each row is read from start to end, one stream from memory at a time, the
// codes loaded again from L1 for each chunk (copied into an array of vectors there, they were
// stored to the stack and loaded back every chunk).  AMD Zen 4's prefetchers lose a pattern that
// steps from row to row: 2.1x slower on the 1B shape's 16384 x 2048 matrix, measured.
template <int NR, typename L>
TARGET_AVX512 void q4_wrows_avx512(const uint8_t* w, int64_t w_stride, L g, int64_t K, const int8_t* x,
                                   const float* xd, const float* xs, float* out) {
  __m512 acc[NR];
  if (K == 512) {  // one chunk a row: the NR rows are one stretch of memory, the codes loaded once
    __m512i xv[8];
    for (int v = 0; v < 8; ++v) xv[v] = _mm512_loadu_si512(x + 64 * v);
    const __m512 d = _mm512_loadu_ps(xd), ds = _mm512_loadu_ps(xs);
    for (int r = 0; r < NR; ++r) acc[r] = q4_chunk_avx512<true>(w + r * w_stride, g, xv, x, d, ds, _mm512_setzero_ps());
  } else {  // each row from start to end: one stream from memory at a time (see q8_tile_avx512)
    for (int r = 0; r < NR; ++r) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t k = 0, at = 0; k < K; k += 512, at += L::chunk_bytes)
        a = q4_chunk_avx512<false>(w + r * w_stride + at, g, nullptr, x + k, _mm512_loadu_ps(xd + k / kBlock),
                                   _mm512_loadu_ps(xs + k / kBlock), a);
      acc[r] = a;
    }
  }
  sums_of_512<NR>(acc, out);
}

// ---------------------------------------------------------------------------- int4, AVX2

// 8 blocks (one 32-bit lane each) of the codes `q` (u8, 8 vectors) against x (8 vectors of 32 bytes
// at `x`, `x_step` apart), scaled and offset; added to acc
TARGET_AVX2 inline __m256 q4_eight_blocks_avx2(const __m256i* q, const int8_t* x, int64_t x_step, __m256 s,
                                               __m256 z, const float* d, const float* ds, __m256 acc) {
  // The 8 vectors' pair sums added in 16 bits, widened once: each is at most 2 * 15 * 127 = 3810
  // in magnitude (codes 0..15, activation codes -127..127), so 8 of them stay below 2^15.
  __m256i pairs = _mm256_setzero_si256();
  for (int v = 0; v < 8; ++v) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + x_step * v));
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(q[v], xv));
  }
  const __m256i dot = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, _mm256_loadu_ps(d)), acc);
  return _mm256_fmadd_ps(z, _mm256_loadu_ps(ds), acc);
}

template <int MR, typename L>
TARGET_AVX2 void q4_rows_avx2(const uint8_t* w, L g, int64_t K, const int8_t* xq, int64_t x_stride,
                              const float* xd, const float* xs, int64_t s_stride, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 512 <= K; k += 512) {
    __m256i lo[8], hi[8];  // blocks 0..7, 8..15
    for (int t = 0; t < 4; ++t) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * t));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * t + 32));
      lo[2 * t] = _mm256_and_si256(b0, low);
      lo[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low);
      hi[2 * t] = _mm256_and_si256(b1, low);
      hi[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low);
    }
    __m256 s_lo, s_hi, z_lo, z_hi;
    q4_scales_avx2(w + 256, g, &s_lo, &s_hi, &z_lo, &z_hi);
    const int64_t b0 = k / kBlock;
    for (int r = 0; r < MR; ++r) {
      const int8_t* x = xq + r * x_stride + k;
      const float* d = xd + r * s_stride + b0;
      const float* ds = xs + r * s_stride + b0;
      acc[r] = q4_eight_blocks_avx2(lo, x, 64, s_lo, z_lo, d, ds, acc[r]);
      acc[r] = q4_eight_blocks_avx2(hi, x + 32, 64, s_hi, z_hi, d + 8, ds + 8, acc[r]);
    }
    w += L::chunk_bytes;
  }
  if (k < K) {  // a chunk of 8 blocks
    __m256i q[8];
    __m256 s, z;
    q4_half_chunk(w, g, q, &s, &z);
    const int64_t b0 = k / kBlock;
    for (int r = 0; r < MR; ++r)
      acc[r] = q4_eight_blocks_avx2(q, xq + r * x_stride + k, 32, s, z, xd + r * s_stride + b0,
                                    xs + r * s_stride + b0, acc[r]);
  }
  sums_of_256<MR>(acc, out);
}

// ---------------------------------------------------------------------------- drivers

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous(),
              "llama_qcpu: x must be a contiguous 2-d float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "llama_qcpu: x has ", x.size(1), " columns, the weight ", K);
}

const QuantRows& quantize_x(const at::Tensor& x, int64_t K_padded, bool permute) {
  QuantRows& q = thread_buffers();
  if (x.scalar_type() == at::kBFloat16)
    quantize_rows(q, x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), K_padded, permute);
  else
    quantize_rows(q, x.data_ptr<float>(), x.size(0), x.size(1), K_padded, permute);
  return q;
}

// ---------------------------------------------------------------------------- writing the results

TARGET_AVX2_ONLY inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// 8 floats -> bfloat16, rounded to nearest even, NaN to a quiet NaN (as c10::BFloat16(float))
TARGET_AVX2_ONLY inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  // 16-bit values 0..7 low
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

// out[j] = scale[j] * (sums[j] - corr) for j < count (scale: nullptr for none), in out's dtype
template <typename O, typename S>
TARGET_AVX2_ONLY void write_sums(const float* sums, int64_t count, const S* scale, float corr, O* out) {
  const __m256 c = _mm256_set1_ps(corr);
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    __m256 v = _mm256_sub_ps(_mm256_loadu_ps(sums + j), c);
    if (scale) v = _mm256_mul_ps(load8(scale + j), v);
    store8(out + j, v);
  }
  for (; j < count; ++j) {
    const float v = sums[j] - corr;
    out[j] = O(scale ? as_float(scale[j]) * v : v);
  }
}

// The (M, N) results, as kernels give them in blocks of sums (res: rows of kOutBlock), written
// into an output of x's dtype, each row scaled by `scale` (N,: float32, bfloat16, or none) and
// less its correction corr[m] (or none).
struct Results {
  at::Tensor out;
  const float* scale_f = nullptr;
  const c10::BFloat16* scale_b = nullptr;
  const float* corr = nullptr;

  void write(const float* res, int64_t m, int rows, int64_t n, int64_t count) const {
    const int64_t N = out.size(1);
    for (int i = 0; i < rows; ++i) {
      const float* sums = res + i * kOutBlock;
      const float c = corr ? corr[m + i] : 0.f;
      if (out.scalar_type() == at::kFloat)
        write_one(sums, count, n, c, out.data_ptr<float>() + (m + i) * N + n);
      else
        write_one(sums, count, n, c, out.data_ptr<c10::BFloat16>() + (m + i) * N + n);
    }
  }

 private:
  template <typename O>
  void write_one(const float* sums, int64_t count, int64_t n, float c, O* o) const {
    if (scale_b)
      write_sums(sums, count, scale_b + n, c, o);
    else
      write_sums(sums, count, scale_f ? scale_f + n : nullptr, c, o);
  }
};

// Products that read fewer weight bytes (times activation rows) than this run on the calling
// thread alone: handing a small product to other threads (a fork and a join, about 5 us on AMD
// Zen 4) costs more than it saves.  The 150m shape's 768 x 512 int4 product, one row, took 12.6
// us on 1 thread and 14.7 on 2, its 3072 x 512 37.6 and 30.0 (in cache); whole 150m decoding
// steps at 2 threads, this bound at 0 and at 512 KiB in one process, alternated 20 times: int4
// (groups of 64) 0.95x, int8 0.96x the time (AMD Zen 4, BENCHMARKS.md).  Decoding steps of
// wider models (the 1B shape's smallest product reads 2.2 MB) and batches of rows split as before.
std::atomic<int64_t> parallel_min_bytes{512 * 1024};

// (llama_qcpu::set_parallel_min_bytes) set that bound; returns the one it replaces
int64_t set_parallel_min_bytes(int64_t bytes) { return parallel_min_bytes.exchange(bytes); }

// Output features [0, N) in blocks of at most kOutBlock, block(n, count), split over torch's
// threads: chunks of blocks that the threads take in turn from a shared counter (as ggml does),
// so that a thread slowed by another process on its core takes fewer chunks instead of holding
// the product up with its fixed share; a product under parallel_min_bytes on the calling thread.
template <typename Block>
void over_rows(int64_t N, int64_t grain, int64_t work_bytes, const Block& block) {
  const int64_t threads = work_bytes < parallel_min_bytes.load(std::memory_order_relaxed) ? 1 : at::get_num_threads();
  const int64_t chunk = threads == 1 ? N : std::max<int64_t>(grain, N / (threads * 8));
  const int64_t chunks = (N + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < chunks; c = next++) {
      const int64_t end = std::min(N, (c + 1) * chunk);
      for (int64_t n = c * chunk; n < end; n += kOutBlock) block(n, std::min<int64_t>(kOutBlock, end - n));
    }
  });
}

// F<rows>::run(args...), rows (1..MR) as a compile-time count
template <template <int> class F, int MR, typename... Args>
inline void by_rows(int rows, Args... args) {
  if constexpr (MR > 1) {
    if (rows < MR) return by_rows<F, MR - 1>(rows, args...);
  }
  F<MR>::run(args...);
}

template <int MR> struct Q8Avx512 { template <typename... A> static void run(A... a) { q8_rows_avx512<MR>(a...); } };

// The AVX2 tiles: one weight row against up to 4 activation rows, a call a row
template <int MR, typename Row>
inline void each_row(int64_t count, float* res, const Row& row) {
  float r[MR];
  for (int64_t j = 0; j < count; ++j) {
    row(j, r);
    for (int i = 0; i < MR; ++i) res[i * kOutBlock + j] = r[i];
  }
}
template <int MR> struct Q8Avx2 {
  static void run(const int8_t* w, int64_t ws, int64_t count, int64_t K, const int8_t* xq, int64_t x_stride,
                  const float* dv, int64_t dv_stride, float* res) {
    each_row<MR>(count, res, [&](int64_t j, float* r) { q8_rows_avx2<MR>(w + j * ws, K, xq, x_stride, dv, dv_stride, r); });
  }
};
template <int MR> struct Q4Avx512 { template <typename... A> static void run(A... a) { q4_rows_avx512<MR>(a...); } };
template <int MR> struct Q4Avx2 {
  template <typename L>
  static void run(const uint8_t* w, int64_t ws, L g, int64_t count, int64_t Kp, const int8_t* xq,
                  int64_t x_stride, const float* xd, const float* xs, int64_t s_stride, float* res) {
    each_row<MR>(count, res, [&](int64_t j, float* r) {
      q4_rows_avx2<MR>(w + j * ws, g, Kp, xq, x_stride, xd, xs, s_stride, r);
    });
  }
};
// int4's decoding step on AVX-512 VNNI: one activation row against up to 4 weight rows a call
template <int NR> struct Q4WRowsAvx512 {
  template <typename... A> static void run(A... a) { q4_wrows_avx512<NR>(a...); }
};

// x (M, K) float32 or bfloat16, w (N, K) int8, scale (N,) float32 or bfloat16 -> (M, N) in x's dtype
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t isa) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.stride(1) == 1,
              "llama_qcpu::q8_matmul: w must be a 2-d int8 tensor with contiguous rows");
  TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16) && scale.dim() == 1 &&
                  scale.numel() == w.size(0),
              "llama_qcpu::q8_matmul: scale must be float32 or bfloat16, one per weight row");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K);
  TORCH_CHECK(K % kBlock == 0, "llama_qcpu::q8_matmul: the width (", K, ") must be a multiple of 32");
  TORCH_CHECK(isa == 1 || isa == 2, "llama_qcpu: isa must be 1 (AVX2) or 2 (AVX-512 VNNI)");
  QuantRows& q = thread_buffers();
  if (x.scalar_type() == at::kBFloat16)
    quantize_rows_lanes(q, x.data_ptr<c10::BFloat16>(), M, K);
  else
    quantize_rows_lanes(q, x.data_ptr<float>(), M, K);
  const int64_t nb = q8_blocks(K), groups = q8_groups(K);
  const int64_t dvs = 16 * groups + (K % 64 ? 8 : 0);  // a row's lane scales
  thread_local AlignedVector<float> dv, corr;
  dv.resize(M * dvs);
  corr.assign(M, 0.f);  // 128 * sum of the codes, in the activation's units (the flipped weights' extra)
  for (int64_t m = 0; m < M; ++m) {
    std::copy_n(q.scale.data() + m * nb, 16 * groups, dv.data() + m * dvs);
    if (K % 64) std::fill_n(dv.data() + m * dvs + 16 * groups, 8, q.scale[m * nb + nb - 1]);
    for (int64_t b = 0; b < nb; ++b) corr[m] += 128.f * q.scale[m * nb + b] * static_cast<float>(q.sum[m * nb + b]);
  }
  Results results{at::empty({M, N}, x.options())};
  const at::Tensor row_scale = scale.contiguous();
  if (row_scale.scalar_type() == at::kBFloat16)
    results.scale_b = row_scale.data_ptr<c10::BFloat16>();
  else
    results.scale_f = row_scale.data_ptr<float>();
  if (isa == 2) results.corr = corr.data();  // a pointer: the workers must not name the thread_local itself
  const int8_t* wp = w.data_ptr<int8_t>();
  const int64_t ws = w.stride(0);
  const int8_t* xq = q.codes.data();
  const float* dvp = dv.data();
  const int tile = isa == 2 ? kMaxRowsPerTile : kMaxRowsNarrow;
  thread_local AlignedVector<int8_t> interleaved;  // the AVX-512 tiles' codes, a tile after another
  if (isa == 2) {
    interleaved.resize(interleaved_bytes(M, K));
    for (int64_t m = 0; m < M; m += tile)
      interleave_tile(xq + m * K, std::min<int64_t>(tile, M - m), K, interleaved.data() + interleaved_bytes(m, K));
  }
  const int8_t* xt = interleaved.data();
  over_rows(N, 16, N * K * M, [&](int64_t n, int64_t count) {
    alignas(64) float res[kMaxRowsPerTile * kOutBlock];
    for (int64_t m = 0; m < M; m += tile) {
      const int rows = static_cast<int>(std::min<int64_t>(tile, M - m));
      if (isa == 2)
        by_rows<Q8Avx512, kMaxRowsPerTile>(rows, wp + n * ws, ws, count, K, xt + interleaved_bytes(m, K),
                                           dvp + m * dvs, dvs, res);
      else
        by_rows<Q8Avx2, kMaxRowsNarrow>(rows, wp + n * ws, ws, count, K, xq + m * K, K, dvp + m * dvs, dvs, res);
      results.write(res, m, rows, n, count);
    }
  });
  return results.out;
}

// q4_matmul for the layout L (the rows' scales one per L::per blocks), its checks passed
template <typename L>
at::Tensor q4_matmul_as(L g, const at::Tensor& x, const at::Tensor& w, int64_t K, int64_t Kp, int64_t isa) {
  const int64_t N = w.size(0), M = x.size(0);
  const QuantRows& q = quantize_x(x, Kp, true);
  const int64_t nb = Kp / kBlock;
  thread_local AlignedVector<float> ds;
  ds.resize(M * nb);
  for (int64_t i = 0; i < M * nb; ++i) ds[i] = q.scale[i] * static_cast<float>(q.sum[i]);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t ws = w.size(1);
  const int8_t* xq = q.codes.data();
  const float* xd = q.scale.data();
  const float* xs = ds.data();
  Results results{at::empty({M, N}, x.options())};
  if (isa == 2 && M == 1 && Kp % 512 == 0) {  // a decoding step: weight rows 4 at a time
    constexpr int kWRows = 4;
    over_rows(N, 16, N * ws, [&](int64_t n, int64_t count) {
      alignas(64) float res[kMaxRowsPerTile * kOutBlock];
      for (int64_t j = 0; j < count; j += kWRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kWRows, count - j));
        by_rows<Q4WRowsAvx512, kWRows>(rows, wp + (n + j) * ws, ws, g, Kp, xq, xd, xs, res + j);
      }
      results.write(res, 0, 1, n, count);
    });
    return results.out;
  }
  const int tile = isa == 2 ? kMaxRowsPerTile : kMaxRowsNarrow;
  over_rows(N, 16, N * ws * M, [&](int64_t n, int64_t count) {
    alignas(64) float res[kMaxRowsPerTile * kOutBlock];
    for (int64_t m = 0; m < M; m += tile) {
      const int rows = static_cast<int>(std::min<int64_t>(tile, M - m));
      if (isa == 2)
        by_rows<Q4Avx512, kMaxRowsPerTile>(rows, wp + n * ws, ws, g, count, Kp, xq + m * Kp, Kp, xd + m * nb, xs + m * nb,
                                           nb, res);
      else
        by_rows<Q4Avx2, kMaxRowsNarrow>(rows, wp + n * ws, ws, g, count, Kp, xq + m * Kp, Kp, xd + m * nb, xs + m * nb,
                                        nb, res);
      results.write(res, m, rows, n, count);
    }
  });
  return results.out;
}

// x (M, K) float32 or bfloat16, w (N, row_bytes) uint8 in the int4 layout -> (M, N) in x's dtype;
// the layout's scales per 1, 2, 4 or 8 blocks told by the rows' length
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& w, int64_t K, int64_t isa) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "llama_qcpu::q4_matmul: w must be a contiguous 2-d uint8 tensor (cpu_kernels.pack_int4)");
  check_x(x, K);
  TORCH_CHECK(K % kBlock == 0, "llama_qcpu::q4_matmul: the width (", K, ") must be a multiple of 32");
  TORCH_CHECK(isa == 1 || isa == 2, "llama_qcpu: isa must be 1 (AVX2) or 2 (AVX-512 VNNI)");
  const int64_t Kp = (K + 255) / 256 * 256, bytes = w.size(1);
  if (bytes == int4_row_bytes(Kp, 1)) return q4_matmul_as(Int4Scales<1>{}, x, w, K, Kp, isa);
  if (bytes == int4_row_bytes(Kp, 2)) return q4_matmul_as(Int4Scales<2>{}, x, w, K, Kp, isa);
  if (bytes == int4_row_bytes(Kp, 4)) return q4_matmul_as(Int4Scales<4>{}, x, w, K, Kp, isa);
  TORCH_CHECK(bytes == int4_row_bytes(Kp, 8), "llama_qcpu::q4_matmul: the packed rows (", bytes,
              " bytes) do not match the width ", K, " with a scale per 32, 64, 128 or 256 values");
  return q4_matmul_as(Int4Scales<8>{}, x, w, K, Kp, isa);
}

}  // namespace

TORCH_LIBRARY(llama_qcpu, m) {
  m.def("q8_matmul(Tensor x, Tensor w, Tensor scale, int isa) -> Tensor");
  m.def("q4_matmul(Tensor x, Tensor w, int k, int isa) -> Tensor");
  m.def("set_parallel_min_bytes(int bytes) -> int", &set_parallel_min_bytes);
}

TORCH_LIBRARY_IMPL(llama_qcpu, CPU, m) {
  m.impl("q8_matmul", &q8_matmul);
  m.impl("q4_matmul", &q4_matmul);
}
