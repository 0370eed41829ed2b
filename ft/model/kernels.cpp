// Quantized matrix products over GGUF blocks as stored, for the CPU.
//
// Activations are quantized per block of 32 to int8 with one float scale (and the block's sum,
// which the formats with a minimum need), as llama.cpp does; each weight block is read once per
// tile of up to four activation rows and multiplied in integers. Built at first use by
// ft/model/kernels.py with -march=native, so the same source runs AVX-512 VNNI, AVX2 or plain C++.
//
// Every extern "C" entry point checks its own arguments (sizes are passed explicitly; each
// weight's type, rows and row bytes are checked against the sizes it is used with) and catches
// every C++ exception: it returns 0, or an FT_E* code with a message for ft_last_error().
// The checks run once per call, never in the loops; nothing allocates inside a parallel region
// (an exception there could not be caught).
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <memory>
#include <new>
#include <stdexcept>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// ---- Errors at the extern "C" boundary ----
enum : int { FT_OK = 0, FT_EINVAL = 1, FT_ENOMEM = 2, FT_EFAULT = 3 };
thread_local char last_error[512];

[[noreturn]] __attribute__((format(printf, 1, 2))) void invalid(const char* fmt, ...) {
  char msg[400];
  va_list args;
  va_start(args, fmt);
  vsnprintf(msg, sizeof msg, fmt, args);
  va_end(args);
  throw std::invalid_argument(msg);
}

#define FT_REQUIRE(cond, ...) \
  do {                        \
    if (!(cond)) invalid(__VA_ARGS__); \
  } while (0)

// Runs `body`, turning any exception into an error code and a message.
template <class F>
int guarded(const char* name, F&& body) {
  try {
    body();
    return FT_OK;
  } catch (const std::invalid_argument& e) {
    snprintf(last_error, sizeof last_error, "%s: %s", name, e.what());
    return FT_EINVAL;
  } catch (const std::bad_alloc&) {
    snprintf(last_error, sizeof last_error, "%s: out of memory", name);
    return FT_ENOMEM;
  } catch (const std::exception& e) {
    snprintf(last_error, sizeof last_error, "%s: %s", name, e.what());
    return FT_EFAULT;
  } catch (...) {
    snprintf(last_error, sizeof last_error, "%s: unknown C++ exception", name);
    return FT_EFAULT;
  }
}

// NOTE: GCC 12 at -O3 -march=native vectorized the signed-by-signed byte dot products below
// with an unsigned-by-signed instruction (vpdpbusd), giving wrong sums; keep them scalar.
#if defined(__GNUC__) && !defined(__clang__)
#define FT_SCALAR __attribute__((optimize("no-tree-vectorize")))
#else
#define FT_SCALAR
#endif

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define FT_VNNI 1
#else
#define FT_VNNI 0
#endif

constexpr int QK = 32;     // elements per activation block (and per Q4_0/Q4_1/Q8_0 block)
constexpr int QK_K = 256;  // elements per K-quant super-block

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; exp--; }
      mant &= 0x3FF;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

inline float rd16(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return fp16_to_float(h);
#endif
}

// One quantized activation row: qs[K], and per block of 32: d, s = d * sum(qs) and sx = sum(qs);
// x16: sum(qs) per 16 (Q6_K's column kernels need it; null where no such weight is multiplied).
struct Act {
  const int8_t* qs;
  const float* d;
  const float* s;
  const int32_t* sx;
  const int32_t* x16;
};

#if defined(__AVX2__)
inline __m256i load32(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// Sum of unsigned-by-signed byte products, four adjacent products per 32-bit lane.
// NOTE: without VNNI the pairs go through 16-bit saturating sums (maddubs): safe for unsigned
// values up to 128 against |x| <= 127, so Q8_0 is multiplied signed there (see FmtQ8_0).
inline __m256i dot_us8(__m256i u, __m256i s) {
#if FT_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Signed-by-signed: move the sign of `a` onto `b`.
inline __m256i dot_ss8(__m256i a, __m256i b) {
  return dot_us8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

inline int hsum_i32(__m256i v) {
  __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1));
  return _mm_cvtsi128_si32(r);
}

// 16 bytes of nibbles -> 32 bytes: low nibbles in bytes 0..15, high nibbles in bytes 16..31.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128((const __m128i*)p);
  const __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}
#endif

// ---- Q4_0 {fp16 d; u8 qs[16]}: w = d * (q - 8); Q4_1 {fp16 d; fp16 m; u8 qs[16]}: w = d * q + m;
//      Q8_0 {fp16 d; i8 qs[32]}: w = d * q ----
// All three are multiplied as unsigned bytes u (so one unsigned-by-signed instruction does the
// products): Q4_0 u = q with w = d * (u - 8), Q8_0 u = q + 128 with w = d * (u - 128); the offset
// comes off the integer sum exactly, as `offset * sum(x)` of the block; Q4_1 adds m * sum(x).
struct FmtQ4_0 {
  static constexpr int bytes = 18, offset = 8;
  static constexpr bool has_min = false;
  static float scale(const uint8_t* w) { return rd16(w); }
  static float min(const uint8_t*) { return 0; }
#if defined(__AVX2__)
  static __m256i weights(const uint8_t* w) { return nibbles32(w + 2); }
  static __m256i mul(__m256i q, __m256i x) { return dot_us8(q, x); }
#endif
  FT_SCALAR static int scalar(const uint8_t* w, const int8_t* x) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += (w[2 + j] & 0xF) * x[j] + (w[2 + j] >> 4) * x[j + 16];
    return s;
  }
};

struct FmtQ4_1 {
  static constexpr int bytes = 20, offset = 0;
  static constexpr bool has_min = true;
  static float scale(const uint8_t* w) { return rd16(w); }
  static float min(const uint8_t* w) { return rd16(w + 2); }
#if defined(__AVX2__)
  static __m256i weights(const uint8_t* w) { return nibbles32(w + 4); }
  static __m256i mul(__m256i q, __m256i x) { return dot_us8(q, x); }
#endif
  FT_SCALAR static int scalar(const uint8_t* w, const int8_t* x) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += (w[4 + j] & 0xF) * x[j] + (w[4 + j] >> 4) * x[j + 16];
    return s;
  }
};

struct FmtQ8_0 {
  // With VNNI: u = q + 128 and offset 128 (one unsigned-by-signed instruction); without it,
  // signed q with the sign trick, whose 16-bit pair sums cannot saturate (|q|, |x| <= 127).
  static constexpr int bytes = 34, offset = FT_VNNI ? 128 : 0;
  static constexpr bool has_min = false;
  static float scale(const uint8_t* w) { return rd16(w); }
  static float min(const uint8_t*) { return 0; }
#if defined(__AVX2__)
  static __m256i weights(const uint8_t* w) {
    return FT_VNNI ? _mm256_xor_si256(load32(w + 2), _mm256_set1_epi8((char)0x80)) : load32(w + 2);
  }
  static __m256i mul(__m256i q, __m256i x) { return FT_VNNI ? dot_us8(q, x) : dot_ss8(q, x); }
#endif
  FT_SCALAR static int scalar(const uint8_t* w, const int8_t* x) {
    int s = 0;
    for (int j = 0; j < 32; j++) s += ((int8_t)w[2 + j] + offset) * x[j];
    return s;
  }
};

#if defined(__AVX2__)
// Eight blocks' 8-lane partial sums -> one lane each, in block order.
inline __m256i hsum8(const __m256i* p) {
  const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i d = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(c, d, 0x20), _mm256_permute2x128_si256(c, d, 0x31));
}
#endif

// MT activation rows against one weight row of 32-element blocks. Blocks go eight at a time:
// their integer sums are reduced into one vector, so the per-block scales cost one 8-wide
// multiply-add per row instead of eight scalar ones.
template <class Fmt, int MT>
void rows_legacy(const uint8_t* w, int nb, const Act* a, float* out) {
  float acc1[MT];
  for (int r = 0; r < MT; r++) acc1[r] = 0;
  int b = 0;
#if defined(__AVX2__)
  __m256 acc[MT];
  for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
  for (; b + 8 <= nb; b += 8) {
    const uint8_t* wb = w + b * Fmt::bytes;
    __m256i q[8];
    float dw_[8], mw_[8];
    for (int i = 0; i < 8; i++) {
      q[i] = Fmt::weights(wb + i * Fmt::bytes);
      dw_[i] = Fmt::scale(wb + i * Fmt::bytes);
      if (Fmt::has_min) mw_[i] = Fmt::min(wb + i * Fmt::bytes);
    }
    const __m256 dw = _mm256_loadu_ps(dw_);
    for (int r = 0; r < MT; r++) {
      const int8_t* x = a[r].qs + b * QK;
      __m256i p[8];
      for (int i = 0; i < 8; i++) p[i] = Fmt::mul(q[i], load32(x + 32 * i));
      __m256i isum = hsum8(p);
      if (Fmt::offset)
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(a[r].sx + b)),
                                                        Fmt::offset == 8 ? 3 : Fmt::offset == 16 ? 4 : 7));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(a[r].d + b)), _mm256_cvtepi32_ps(isum), acc[r]);
      if (Fmt::has_min) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(mw_), _mm256_loadu_ps(a[r].s + b), acc[r]);
    }
  }
  for (int r = 0; r < MT; r++) acc1[r] = hsum(acc[r]);
  for (; b < nb; b++) {  // the last blocks one at a time, still with vector products
    const uint8_t* wb = w + b * Fmt::bytes;
    const __m256i q = Fmt::weights(wb);
    const float d = Fmt::scale(wb), m = Fmt::min(wb);
    for (int r = 0; r < MT; r++) {
      const int isum = hsum_i32(Fmt::mul(q, load32(a[r].qs + b * QK))) - Fmt::offset * a[r].sx[b];
      acc1[r] += d * a[r].d[b] * isum;
      if (Fmt::has_min) acc1[r] += m * a[r].s[b];
    }
  }
#else
  for (; b < nb; b++) {
    const uint8_t* wb = w + b * Fmt::bytes;
    const float d = Fmt::scale(wb), m = Fmt::min(wb);
    for (int r = 0; r < MT; r++) {
      acc1[r] += d * a[r].d[b] * (Fmt::scalar(wb, a[r].qs + b * QK) - Fmt::offset * a[r].sx[b]);
      if (Fmt::has_min) acc1[r] += m * a[r].s[b];
    }
  }
#endif
  for (int r = 0; r < MT; r++) out[r] = acc1[r];
}

// Q4_K's 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ---- Q4_K: {fp16 d; fp16 dmin; u8 scales[12]; u8 qs[128]} per 256; w = d*sc*q - dmin*m ----
// Row kernels (the column kernels below take repacked weights, AVX2 and up): with AVX2, each
// row keeps 8-lane float sums across sub-blocks (one horizontal sum per row), the scales of a
// sub-block folded into one broadcast factor; the min terms of a super-block's 8 sub-blocks are
// one 8-wide multiply-add per row.
template <int MT>
void rows_q4_k(const uint8_t* w, int nbk, const Act* a, float* out) {
  float acc1[MT];
  for (int r = 0; r < MT; r++) acc1[r] = 0;
#if defined(__AVX2__)
  __m256 acc[MT], accm[MT];
  for (int r = 0; r < MT; r++) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int bk = 0; bk < nbk; bk++, w += 144) {
    const float d = rd16(w), dmin = rd16(w + 2);
    int sc[8], m[8];
    for (int j = 0; j < 8; j++) scale_min_k4(j, w + 4, &sc[j], &m[j]);
    const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)m)));
    for (int j = 0; j < 8; j++) {  // sub-block j: qs[32*(j/2)..] low (even j) or high (odd j) nibbles
      const int b = bk * 8 + j;
      const __m256i q = _mm256_and_si256(_mm256_srli_epi16(load32(w + 16 + 32 * (j / 2)), (j & 1) * 4),
                                         _mm256_set1_epi8(0x0F));
      const float dsc = d * sc[j];
      for (int r = 0; r < MT; r++)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us8(q, load32(a[r].qs + b * QK))),
                                 _mm256_set1_ps(dsc * a[r].d[b]), acc[r]);
    }
    for (int r = 0; r < MT; r++) accm[r] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(a[r].s + bk * 8), accm[r]);
  }
  for (int r = 0; r < MT; r++) acc1[r] = hsum(acc[r]) - hsum(accm[r]);
#else
  for (int bk = 0; bk < nbk; bk++, w += 144) {
    const float d = rd16(w), dmin = rd16(w + 2);
    const uint8_t* scales = w + 4;
    const uint8_t* qs = w + 16;
    for (int j = 0; j < 8; j++) {
      int sc, m;
      scale_min_k4(j, scales, &sc, &m);
      const int b = bk * 8 + j;
      const uint8_t* q = qs + 32 * (j / 2);
      const int shift = (j & 1) * 4;
      for (int r = 0; r < MT; r++) {
        const int8_t* x = a[r].qs + b * QK;
        int isum = 0;
        for (int l = 0; l < 32; l++) isum += ((q[l] >> shift) & 0xF) * x[l];
        acc1[r] += d * sc * a[r].d[b] * isum - dmin * m * a[r].s[b];
      }
    }
  }
#endif
  for (int r = 0; r < MT; r++) out[r] = acc1[r];
}

// ---- Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d} per 256; w = d*sc*(q - 32) ----
// With AVX2: q - 32 signed (the sign trick), each 4-lane half of a sub-block's integer sums
// scaled by its own 16-element scale in floats, 8-lane float sums kept across the row.
template <int MT>
void rows_q6_k(const uint8_t* w, int nbk, const Act* a, float* out) {
  float acc1[MT];
  for (int r = 0; r < MT; r++) acc1[r] = 0;
#if defined(__AVX2__)
  __m256 acc[MT];
  for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
#endif
  for (int bk = 0; bk < nbk; bk++, w += 210) {
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const int8_t* sc = (const int8_t*)(w + 192);
    const float d = rd16(w + 208);
    for (int half = 0; half < 2; half++) {
      const uint8_t* l = ql + 64 * half;
      const uint8_t* h = qh + 32 * half;
      const int8_t* s = sc + 8 * half;
      for (int g = 0; g < 4; g++) {  // 32 weights: element i uses scale s[2g + (i >= 16)]
        const int b = bk * 8 + half * 4 + g;
#if defined(__AVX2__)
        const __m256i lo = load32(l + 32 * (g & 1));
        const __m256i q4 = _mm256_and_si256(g < 2 ? lo : _mm256_srli_epi16(lo, 4), _mm256_set1_epi8(0x0F));
        const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(load32(h), 2 * g), _mm256_set1_epi8(3));
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(q4, _mm256_slli_epi16(q2, 4)), _mm256_set1_epi8(32));
        const __m256 scv = _mm256_mul_ps(
            _mm256_set1_ps(d), _mm256_set_m128(_mm_set1_ps(s[2 * g + 1]), _mm_set1_ps(s[2 * g])));
        for (int r = 0; r < MT; r++) {
          const __m256 p = _mm256_cvtepi32_ps(dot_ss8(q, load32(a[r].qs + b * QK)));
          acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(scv, _mm256_set1_ps(a[r].d[b])), acc[r]);
        }
#else
        for (int r = 0; r < MT; r++) {
          const int8_t* x = a[r].qs + b * QK;
          int isum = 0;
          for (int i = 0; i < 32; i++) {
            const int lo4 = g < 2 ? (l[32 * (g & 1) + i] & 0xF) : (l[32 * (g & 1) + i] >> 4);
            const int q = (lo4 | (((h[i] >> (2 * g)) & 3) << 4)) - 32;
            isum += q * x[i] * s[2 * g + (i >= 16)];
          }
          acc1[r] += d * a[r].d[b] * isum;
        }
#endif
      }
    }
  }
#if defined(__AVX2__)
  for (int r = 0; r < MT; r++) acc1[r] = hsum(acc[r]);
#endif
  for (int r = 0; r < MT; r++) out[r] = acc1[r];
}

enum : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

// ==== More GGUF formats as stored: Q5_0, Q5_1, IQ4_NL (blocks of 32); Q2_K, Q3_K, Q5_K, IQ4_XS
// (super-blocks of 256). Layouts as ggml-common.h declares them; fp16 fields are read with rd16
// (the block bytes need no alignment beyond 2). ====
enum : int { Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q5_K = 13, IQ4_NL = 20, IQ4_XS = 23 };

struct BlockQ5_0 {  // w = d * (q - 16), q = low nibble | bit of qh << 4
  uint16_t d;
  uint8_t qh[4];  // bit j: the fifth bit of element j
  uint8_t qs[16];  // element j in the low nibble, j + 16 in the high
};
struct BlockQ5_1 {  // w = d * q + m
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct BlockIQ4_NL {  // w = d * kvalues_iq4nl[nibble]
  uint16_t d;
  uint8_t qs[16];
};
struct BlockQ5_K {  // sub-block j of 32: w = d * sc_j * q - dmin * m_j (6-bit sc, m as Q4_K's)
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];   // bit j of byte l: the fifth bit of element l of sub-block j
  uint8_t qs[128];  // sub-blocks 2i, 2i + 1: low, high nibbles of qs[32i .. 32i + 32)
};
struct BlockQ3_K {  // 16 sub-blocks of 16: w = d * (sc - 32) * (q - (hmask bit ? 0 : 4))
  uint8_t hmask[32];  // bit k of byte l: element 32k + l
  uint8_t qs[64];     // element 128n + 32j + l: bits 2j..2j+1 of qs[32n + l]
  uint8_t scales[12];  // 16 6-bit scales
  uint16_t d;
};
struct BlockQ2_K {  // 16 sub-blocks of 16: w = d * (sc & 15) * q - dmin * (sc >> 4)
  uint8_t scales[16];
  uint8_t qs[64];  // element 128n + 32j + l: bits 2j..2j+1 of qs[32n + l]
  uint16_t d, dmin;
};
struct BlockIQ4_XS {  // sub-block j of 32: w = d * (ls_j - 32) * kvalues_iq4nl[nibble]
  uint16_t d;
  uint16_t scales_h;   // bits 2j..2j+1: the high two bits of ls_j
  uint8_t scales_l[4];  // nibble j of these bytes: the low four bits of ls_j
  uint8_t qs[128];     // sub-block j: qs[16j .. 16j + 16), low nibbles then high
};
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24 && sizeof(BlockIQ4_NL) == 18, "32-blocks");
static_assert(sizeof(BlockQ5_K) == 176 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ2_K) == 84 &&
                  sizeof(BlockIQ4_XS) == 136,
              "256-blocks");

constexpr int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX2__)
// The 32 bits at p -> 32 bytes: byte j is 0x10 where bit j is set, else 0.
inline __m256i bits32_x16(const uint8_t* p) {
  const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(p)), shuf), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

// Nibbles -> the signed IQ4 values (one table lookup per byte).
inline __m256i iq4_values(__m256i nib) {
  const __m128i t = _mm_loadu_si128((const __m128i*)kvalues_iq4nl);
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib);
}
#endif

struct FmtQ5_0 {
  static constexpr int bytes = 22, offset = 16;
  static constexpr bool has_min = false;
  static float scale(const uint8_t* w) { return rd16(w); }
  static float min(const uint8_t*) { return 0; }
#if defined(__AVX2__)
  static __m256i weights(const uint8_t* w) { return _mm256_or_si256(nibbles32(w + 6), bits32_x16(w + 2)); }
  static __m256i mul(__m256i q, __m256i x) { return dot_us8(q, x); }
#endif
  FT_SCALAR static int scalar(const uint8_t* w, const int8_t* x) {
    const uint32_t qh = rd32(w + 2);
    int s = 0;
    for (int j = 0; j < 16; j++)
      s += ((w[6 + j] & 0xF) | ((qh >> j) & 1) << 4) * x[j] + ((w[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) * x[j + 16];
    return s;
  }
};

struct FmtQ5_1 {
  static constexpr int bytes = 24, offset = 0;
  static constexpr bool has_min = true;
  static float scale(const uint8_t* w) { return rd16(w); }
  static float min(const uint8_t* w) { return rd16(w + 2); }
#if defined(__AVX2__)
  static __m256i weights(const uint8_t* w) { return _mm256_or_si256(nibbles32(w + 8), bits32_x16(w + 4)); }
  static __m256i mul(__m256i q, __m256i x) { return dot_us8(q, x); }
#endif
  FT_SCALAR static int scalar(const uint8_t* w, const int8_t* x) {
    const uint32_t qh = rd32(w + 4);
    int s = 0;
    for (int j = 0; j < 16; j++)
      s += ((w[8 + j] & 0xF) | ((qh >> j) & 1) << 4) * x[j] + ((w[8 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) * x[j + 16];
    return s;
  }
};

struct FmtIQ4_NL {  // signed weights: the sign trick (|w| <= 127, so no 16-bit pair saturates)
  static constexpr int bytes = 18, offset = 0;
  static constexpr bool has_min = false;
  static float scale(const uint8_t* w) { return rd16(w); }
  static float min(const uint8_t*) { return 0; }
#if defined(__AVX2__)
  static __m256i weights(const uint8_t* w) { return iq4_values(nibbles32(w + 2)); }
  static __m256i mul(__m256i q, __m256i x) { return dot_ss8(q, x); }
#endif
  FT_SCALAR static int scalar(const uint8_t* w, const int8_t* x) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += kvalues_iq4nl[w[2 + j] & 0xF] * x[j] + kvalues_iq4nl[w[2 + j] >> 4] * x[j + 16];
    return s;
  }
};

// A super-block of 256 unpacked into integers: weight q (signed), an integer scale per 16
// weights (1 where the format's scale is a float per 32), an integer min per 16 (Q2_K), and per
// block of 32 the float factor dv of its integer sum and mv of its min. Then
//   w[32b + l] = dv[b] * sc[2b + l/16] * q[32b + l] - (MIN32: mv[b]; MIN16: mv[b] * mn[2b + l/16]).
// The portable products and the dequantization both go through it.
enum KMin : int { NO_MIN = 0, MIN32 = 1, MIN16 = 2 };
struct KUnpacked {
  int8_t q[256];
  int16_t sc[16], mn[16];
  float dv[8], mv[8];
};

// The 16 6-bit scales, minus 32: scale i has its low four bits in nibble i / 8 of byte i % 8
// and its high two in bits 2 * (i / 4) of byte 8 + i % 4 (four at a time in 32-bit words).
inline void q3_k_scales(const uint8_t* s, int16_t out[16]) {
  uint32_t aux[3], v[4];
  memcpy(aux, s, 12);
  const uint32_t m4 = 0x0F0F0F0F, m2 = 0x03030303;
  v[0] = (aux[0] & m4) | ((aux[2] & m2) << 4);
  v[1] = (aux[1] & m4) | (((aux[2] >> 2) & m2) << 4);
  v[2] = ((aux[0] >> 4) & m4) | (((aux[2] >> 4) & m2) << 4);
  v[3] = ((aux[1] >> 4) & m4) | (((aux[2] >> 6) & m2) << 4);
  uint8_t b[16];
  memcpy(b, v, 16);
  for (int i = 0; i < 16; i++) out[i] = (int16_t)(b[i] - 32);
}

inline int iq4_xs_scale(const BlockIQ4_XS* b, int j) {
  const int lo = (b->scales_l[j / 2] >> (4 * (j % 2))) & 0xF;
  uint16_t h;
  memcpy(&h, &b->scales_h, 2);
  return (lo | ((h >> (2 * j)) & 3) << 4) - 32;
}

struct KQ5_K {
  static constexpr int bytes = 176, mins = MIN32;
  static constexpr bool is_signed = false, per16 = false;
  static void unpack(const uint8_t* w, KUnpacked& u) {
    const BlockQ5_K* b = (const BlockQ5_K*)w;
    const float d = rd16(w), dmin = rd16(w + 2);
    for (int j = 0; j < 8; j++) {
      int sc, m;
      scale_min_k4(j, b->scales, &sc, &m);
      u.dv[j] = d * sc;
      u.mv[j] = dmin * m;
      for (int l = 0; l < 32; l++)
        u.q[32 * j + l] = (int8_t)(((b->qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF) | ((b->qh[l] >> j) & 1) << 4);
    }
    for (int i = 0; i < 16; i++) u.sc[i] = 1;
  }
#if defined(__AVX2__)
  static void unpack(const uint8_t* w, __m256i q[8], __m256i[8], __m256i[8], float dv[8], float mv[8]) {
    const BlockQ5_K* b = (const BlockQ5_K*)w;
    const float d = rd16(w), dmin = rd16(w + 2);
    for (int j = 0; j < 8; j++) {
      int sc, m;
      scale_min_k4(j, b->scales, &sc, &m);
      dv[j] = d * sc;
      mv[j] = dmin * m;
    }
    const __m256i lo4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i qh = load32(b->qh);
    for (int i = 0; i < 4; i++) {
      const __m256i v = load32(b->qs + 32 * i);
      const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), one), 4);
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i + 1), one), 4);
      q[2 * i] = _mm256_or_si256(_mm256_and_si256(v, lo4), h0);
      q[2 * i + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), h1);
    }
  }
#endif
};

struct KIQ4_XS {
  static constexpr int bytes = 136, mins = NO_MIN;
  static constexpr bool is_signed = true, per16 = false;
  static void unpack(const uint8_t* w, KUnpacked& u) {
    const BlockIQ4_XS* b = (const BlockIQ4_XS*)w;
    const float d = rd16(w);
    for (int j = 0; j < 8; j++) {
      u.dv[j] = d * iq4_xs_scale(b, j);
      u.mv[j] = 0;
      for (int l = 0; l < 16; l++) {
        u.q[32 * j + l] = kvalues_iq4nl[b->qs[16 * j + l] & 0xF];
        u.q[32 * j + 16 + l] = kvalues_iq4nl[b->qs[16 * j + l] >> 4];
      }
    }
    for (int i = 0; i < 16; i++) u.sc[i] = 1;
  }
#if defined(__AVX2__)
  static void unpack(const uint8_t* w, __m256i q[8], __m256i[8], __m256i[8], float dv[8], float mv[8]) {
    const BlockIQ4_XS* b = (const BlockIQ4_XS*)w;
    const float d = rd16(w);
    for (int j = 0; j < 8; j++) {
      dv[j] = d * iq4_xs_scale(b, j);
      mv[j] = 0;
      q[j] = iq4_values(nibbles32(b->qs + 16 * j));
    }
  }
#endif
};

#if defined(__AVX2__)
// Two 16-bit scales: lanes of elements 0..15 get a, lanes of 16..31 get b.
inline __m256i scales16(int a, int b) { return _mm256_set_m128i(_mm_set1_epi16((short)b), _mm_set1_epi16((short)a)); }
#endif

struct KQ3_K {
  static constexpr int bytes = 110, mins = NO_MIN;
  static constexpr bool is_signed = true, per16 = true;
  static void unpack(const uint8_t* w, KUnpacked& u) {
    const BlockQ3_K* b = (const BlockQ3_K*)w;
    const float d = rd16((const uint8_t*)&b->d);
    q3_k_scales(b->scales, u.sc);
    for (int k = 0; k < 8; k++) {  // block k = 4n + j
      u.dv[k] = d;
      u.mv[k] = 0;
      const int n = k / 4, j = k % 4;
      for (int l = 0; l < 32; l++)
        u.q[32 * k + l] = (int8_t)(((b->qs[32 * n + l] >> (2 * j)) & 3) - ((b->hmask[l] >> k) & 1 ? 0 : 4));
    }
  }
#if defined(__AVX2__)
  static void unpack(const uint8_t* w, __m256i q[8], __m256i sc[8], __m256i[8], float dv[8], float mv[8]) {
    const BlockQ3_K* b = (const BlockQ3_K*)w;
    const float d = rd16((const uint8_t*)&b->d);
    int16_t s[16];
    q3_k_scales(b->scales, s);
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), four = _mm256_set1_epi8(4);
    const __m256i hm = load32(b->hmask);
    for (int k = 0; k < 8; k++) {
      dv[k] = d;
      mv[k] = 0;
      sc[k] = scales16(s[2 * k], s[2 * k + 1]);
      const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(load32(b->qs + 32 * (k / 4)), 2 * (k % 4)), three);
      const __m256i h = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, k), one), 2);
      q[k] = _mm256_sub_epi8(_mm256_or_si256(q2, h), four);
    }
  }
#endif
};

struct KQ2_K {
  static constexpr int bytes = 84, mins = MIN16;
  static constexpr bool is_signed = false, per16 = true;
  static void unpack(const uint8_t* w, KUnpacked& u) {
    const BlockQ2_K* b = (const BlockQ2_K*)w;
    const float d = rd16((const uint8_t*)&b->d), dmin = rd16((const uint8_t*)&b->dmin);
    for (int i = 0; i < 16; i++) {
      u.sc[i] = b->scales[i] & 0xF;
      u.mn[i] = b->scales[i] >> 4;
    }
    for (int k = 0; k < 8; k++) {
      u.dv[k] = d;
      u.mv[k] = dmin;
      for (int l = 0; l < 32; l++) u.q[32 * k + l] = (int8_t)((b->qs[32 * (k / 4) + l] >> (2 * (k % 4))) & 3);
    }
  }
#if defined(__AVX2__)
  static void unpack(const uint8_t* w, __m256i q[8], __m256i sc[8], __m256i mn[8], float dv[8], float mv[8]) {
    const BlockQ2_K* b = (const BlockQ2_K*)w;
    const float d = rd16((const uint8_t*)&b->d), dmin = rd16((const uint8_t*)&b->dmin);
    const __m256i three = _mm256_set1_epi8(3);
    for (int k = 0; k < 8; k++) {
      dv[k] = d;
      mv[k] = dmin;
      const int s0 = b->scales[2 * k], s1 = b->scales[2 * k + 1];
      sc[k] = scales16(s0 & 0xF, s1 & 0xF);
      mn[k] = scales16(s0 >> 4, s1 >> 4);
      q[k] = _mm256_and_si256(_mm256_srli_epi16(load32(b->qs + 32 * (k / 4)), 2 * (k % 4)), three);
    }
  }
#endif
};

// The portable product of one unpacked super-block against activation block row x (256 values)
// for its eight blocks: isum[b] = sum q * sc * x, msum[b] = sum mn * x (signed by signed: scalar).
FT_SCALAR inline void k_sums(const KUnpacked& u, const int8_t* x, int isum[8], int msum[8]) {
  for (int b = 0; b < 8; b++) {
    int s = 0, m = 0;
    for (int h = 0; h < 2; h++) {
      const int8_t* q = u.q + 32 * b + 16 * h;
      const int8_t* xx = x + 32 * b + 16 * h;
      int p = 0, px = 0;
      for (int l = 0; l < 16; l++) {
        p += q[l] * xx[l];
        px += xx[l];
      }
      s += p * u.sc[2 * b + h];
      m += px * u.mn[2 * b + h];
    }
    isum[b] = s;
    msum[b] = m;
  }
}

// MT activation rows against one weight row of super-blocks of format K: each super-block is
// unpacked once for all MT rows; its eight blocks' integer sums are reduced into one vector, so
// the per-block factors are one 8-wide multiply-add per row (one horizontal sum per row at the end).
template <class K, int MT>
void rows_kx(const uint8_t* w, int nbk, const Act* a, float* out) {
#if defined(__AVX2__)
  __m256 acc[MT];
  for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi8(1);
  for (int bk = 0; bk < nbk; bk++, w += K::bytes) {
    __m256i q[8], sc[8], mn[8], aq[8];
    float dv_[8], mv_[8];
    K::unpack(w, q, sc, mn, dv_, mv_);
    if (K::is_signed && K::per16)
      for (int j = 0; j < 8; j++) aq[j] = _mm256_sign_epi8(q[j], q[j]);
    const __m256 dv = _mm256_loadu_ps(dv_), mv = _mm256_loadu_ps(mv_);
    for (int r = 0; r < MT; r++) {
      const int8_t* x = a[r].qs + bk * QK_K;
      const __m256 dx = _mm256_loadu_ps(a[r].d + bk * 8);
      __m256i p[8];
      for (int j = 0; j < 8; j++) {
        const __m256i xv = load32(x + 32 * j);
        if (K::per16)  // the 16-bit pair sums cannot saturate: |q| <= 31 against |x| <= 127
          p[j] = _mm256_madd_epi16(
              K::is_signed ? _mm256_maddubs_epi16(aq[j], _mm256_sign_epi8(xv, q[j])) : _mm256_maddubs_epi16(q[j], xv),
              sc[j]);
        else
          p[j] = K::is_signed ? dot_ss8(q[j], xv) : dot_us8(q[j], xv);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dv, dx), _mm256_cvtepi32_ps(hsum8(p)), acc[r]);
      if (K::mins == MIN32) acc[r] = _mm256_fnmadd_ps(mv, _mm256_loadu_ps(a[r].s + bk * 8), acc[r]);
      if (K::mins == MIN16) {
        for (int j = 0; j < 8; j++) p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, load32(x + 32 * j)), mn[j]);
        acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(mv, dx), _mm256_cvtepi32_ps(hsum8(p)), acc[r]);
      }
    }
  }
  for (int r = 0; r < MT; r++) out[r] = hsum(acc[r]);
#else
  float acc[MT];
  for (int r = 0; r < MT; r++) acc[r] = 0;
  KUnpacked u{};  // (mn stays 0 for the formats without a min per 16)
  for (int bk = 0; bk < nbk; bk++, w += K::bytes) {
    K::unpack(w, u);
    for (int r = 0; r < MT; r++) {
      int isum[8], msum[8];
      k_sums(u, a[r].qs + bk * QK_K, isum, msum);
      for (int b = 0; b < 8; b++) {
        const float dx = a[r].d[bk * 8 + b];
        acc[r] += u.dv[b] * dx * isum[b];
        if (K::mins == MIN32) acc[r] -= u.mv[b] * a[r].s[bk * 8 + b];
        if (K::mins == MIN16) acc[r] -= u.mv[b] * dx * msum[b];
      }
    }
  }
  for (int r = 0; r < MT; r++) out[r] = acc[r];
#endif
}

template <class K>
void dequant_kx(const uint8_t* w, int64_t K_, float* out) {
  KUnpacked u{};
  for (int64_t bk = 0; bk < K_ / QK_K; bk++, w += K::bytes, out += QK_K) {
    K::unpack(w, u);
    for (int i = 0; i < QK_K; i++) {
      const int b = i / 32, h = i / 16;
      const float v = u.dv[b] * u.sc[h] * u.q[i];
      out[i] = K::mins == MIN32 ? v - u.mv[b] : K::mins == MIN16 ? v - u.mv[b] * u.mn[h] : v;
    }
  }
}

// Blocks of 32 of Q5_0, Q5_1, IQ4_NL as floats.
void dequant_formats32(int type, const uint8_t* w, int64_t K, float* out) {
  for (int64_t b = 0; b < K / QK; b++, out += QK) {
    if (type == IQ4_NL) {
      const BlockIQ4_NL* blk = (const BlockIQ4_NL*)(w + b * 18);
      const float d = rd16(w + b * 18);
      for (int j = 0; j < 16; j++) {
        out[j] = d * kvalues_iq4nl[blk->qs[j] & 0xF];
        out[j + 16] = d * kvalues_iq4nl[blk->qs[j] >> 4];
      }
      continue;
    }
    const int bytes = type == Q5_0 ? 22 : 24, at = type == Q5_0 ? 2 : 4;
    const uint8_t* blk = w + b * bytes;
    const float d = rd16(blk), m = type == Q5_1 ? rd16(blk + 2) : 0.0f;
    const uint32_t qh = rd32(blk + at);
    for (int j = 0; j < 16; j++) {
      const int lo = (blk[at + 4 + j] & 0xF) | ((qh >> j) & 1) << 4;
      const int hi = (blk[at + 4 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
      out[j] = type == Q5_0 ? d * (lo - 16) : d * lo + m;
      out[j + 16] = type == Q5_0 ? d * (hi - 16) : d * hi + m;
    }
  }
}

// ==== F16 / BF16 weights as stored: float weights times the activation blocks as floats (d * q,
// the same int8 activations every format multiplies), F16C or shifted BF16 conversion and FMA.
// Counted in "blocks" of 32 elements (64 bytes) so the row checks are the quantized formats'. ====
enum : int { F16 = 1, BF16 = 30 };
constexpr int FLOAT_BLOCK_BYTES = 2 * QK;

inline float bf16_to_float(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

template <int Type>
inline float float_at(const uint8_t* p) {
  return Type == F16 ? rd16(p) : bf16_to_float(p);
}

#if defined(__AVX2__) && defined(__F16C__)
template <int Type>
inline __m256 float8(const uint8_t* p) {  // eight weights
  const __m128i h = _mm_loadu_si128((const __m128i*)p);
  return Type == F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 int8x8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }  // low 8 bytes
#endif

template <int Type, int MT>
void rows_float(const uint8_t* w, int nb, const Act* a, float* out) {
#if defined(__AVX2__) && defined(__F16C__)
  __m256 acc[MT];
  for (int r = 0; r < MT; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const uint8_t* wb = w + b * FLOAT_BLOCK_BYTES;
    const __m256 w0 = float8<Type>(wb), w1 = float8<Type>(wb + 16), w2 = float8<Type>(wb + 32),
                 w3 = float8<Type>(wb + 48);
    for (int r = 0; r < MT; r++) {
      const int8_t* x = a[r].qs + b * QK;
      const __m128i lo = _mm_loadu_si128((const __m128i*)x), hi = _mm_loadu_si128((const __m128i*)(x + 16));
      __m256 s = _mm256_mul_ps(w0, int8x8_ps(lo));
      s = _mm256_fmadd_ps(w1, int8x8_ps(_mm_srli_si128(lo, 8)), s);
      s = _mm256_fmadd_ps(w2, int8x8_ps(hi), s);
      s = _mm256_fmadd_ps(w3, int8x8_ps(_mm_srli_si128(hi, 8)), s);
      acc[r] = _mm256_fmadd_ps(s, _mm256_set1_ps(a[r].d[b]), acc[r]);
    }
  }
  for (int r = 0; r < MT; r++) out[r] = hsum(acc[r]);
#else
  float acc[MT];
  for (int r = 0; r < MT; r++) acc[r] = 0;
  for (int b = 0; b < nb; b++) {
    const uint8_t* wb = w + b * FLOAT_BLOCK_BYTES;
    float wf[QK];
    for (int j = 0; j < QK; j++) wf[j] = float_at<Type>(wb + 2 * j);
    for (int r = 0; r < MT; r++) {
      const int8_t* x = a[r].qs + b * QK;
      float s = 0;
      for (int j = 0; j < QK; j++) s += wf[j] * x[j];
      acc[r] += s * a[r].d[b];
    }
  }
  for (int r = 0; r < MT; r++) out[r] = acc[r];
#endif
}

template <int Type>
void dequant_float(const uint8_t* w, int64_t K, float* out) {
  for (int64_t i = 0; i < K; i++) out[i] = float_at<Type>(w + 2 * i);
}



// Elements and bytes per block of each type the kernels multiply (0: not one of them).
inline int64_t block_elems(int64_t type) {
  switch (type) {
    case Q4_0: case Q4_1: case Q8_0: return QK;
    case Q4_K: case Q6_K: return QK_K;
    case Q5_0: case Q5_1: case IQ4_NL: return QK;
    case Q2_K: case Q3_K: case Q5_K: case IQ4_XS: return QK_K;
    case F16: case BF16: return QK;
  }
  return 0;
}

inline int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q6_K: return 210;
    case Q5_0: return sizeof(BlockQ5_0);
    case Q5_1: return sizeof(BlockQ5_1);
    case IQ4_NL: return sizeof(BlockIQ4_NL);
    case Q2_K: return sizeof(BlockQ2_K);
    case Q3_K: return sizeof(BlockQ3_K);
    case Q5_K: return sizeof(BlockQ5_K);
    case IQ4_XS: return sizeof(BlockIQ4_XS);
    case F16: case BF16: return FLOAT_BLOCK_BYTES;
  }
  return 0;
}

// ---- Repacked Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K (and, in kernels_q5_iq4.inc, Q5_K, IQ4_XS,
// IQ4_NL, Q5_0, Q5_1): RC output columns interleaved per block ----
// For a group of RC weight rows (output columns) and one block of 32, vector j holds 4 bytes of
// each column: bytes qs[4j .. 4j + 4) of column c at [4c, 4c + 4). One vector times the
// broadcast 4 activation bytes then adds into RC column sums at once (no horizontal sums),
// and a block's scales for all RC columns are one vector. RC = 16 (AVX-512 VNNI: 64-byte
// vectors) or 8 (AVX2: 32-byte vectors); a row's result never depends on the other rows of
// its tile. Same bytes as the GGUF blocks, but for Q4_K's unpacked scales.
// Q4_x: 4 vectors (low nibbles: elements 4j.., high: 16 + 4j..), then d[RC] (and m[RC]) fp16.
// Q8_0: 8 vectors of q + 128, then d[RC] fp16.
// Q4_K, per super-block of 256 (148 * RC bytes: the 12 bytes of 6-bit scales and mins unpacked
// to 16 bytes, 2.8% more than the GGUF blocks): 32 vectors qs (pair p of sub-blocks, vector v:
// bytes qs[32p + 4v ..]; low nibbles are sub-block 2p, high 2p + 1), then sc[8][RC] and
// m[8][RC] bytes, d[RC] and dmin[RC] fp16.
// Q6_K, per super-block (210 * RC bytes, as many as the GGUF blocks): 32 vectors ql (half h,
// chunk c, vector v: bytes ql[64h + 32c + 4v ..]), 16 vectors qh (half h, vector v: bytes
// qh[32h + 4v ..]), then the int8 scales sc[16][RC] (one per 16 elements) and d[RC] fp16.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define FT_RC 16
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define FT_RC 8  // AVX2: 8 columns per 256-bit vector
#else
#define FT_RC 0
#endif
constexpr int RC = FT_RC;

inline bool repackable_more(int64_t type);  // (kernels_q5_iq4.inc: Q5_K, IQ4_XS, IQ4_NL, Q5_0, Q5_1)
inline int64_t col_bytes_more(int64_t type);

inline bool repackable(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K || type == Q6_K || repackable_more(type);
}

inline int64_t repacked_bytes(int64_t type) {  // one block (super-block for K-quants) of RC columns
  switch (type) {
    case Q4_0: return RC * 18;
    case Q4_1: return RC * 20;
    case Q8_0: return RC * 34;
    case Q4_K: return RC * 148;
    case Q6_K: return RC * 210;
  }
  return RC * col_bytes_more(type);
}

// NOTE: Zen 5 streamed the Q6_K column kernel from memory at 9 GB/s on one thread (42 GB/s
// from L3), and a 16-row step of the 1B Q4_K_M model's layers took 79 ms: its hardware
// prefetcher does not run far enough ahead of a group's interleaved streams. Asking for the
// bytes PREFETCH_DISTANCE ahead of each block as it is read keeps the misses in flight (the
// same pass: 20.3 -> 13.9 ms at one row, 79 -> 40 ms at 16; docs/performance.md). A prefetch
// past the end of the weights is a hint and never faults.
#ifndef FT_PREFETCH_DISTANCE
#define FT_PREFETCH_DISTANCE 6144
#endif
constexpr int64_t PREFETCH_DISTANCE = FT_PREFETCH_DISTANCE;
inline void prefetch_ahead(const uint8_t* block, int64_t bytes) {
  for (int64_t o = 0; PREFETCH_DISTANCE > 0 && o < bytes; o += 64)
    __builtin_prefetch(block + PREFETCH_DISTANCE + o, 0, 3);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MT activation rows against RC columns: y[r * ldy + c] for c < RC.
template <int Type, int MT>
void group_rows(const uint8_t* wg, int64_t nb, const Act* a, float* y, int64_t ldy) {
  constexpr int64_t gbytes = Type == Q4_0 ? RC * 18 : Type == Q4_1 ? RC * 20 : RC * 34;
  constexpr int nvec = Type == Q8_0 ? 8 : 4;
  constexpr int offset = Type == Q4_0 ? 8 : Type == Q8_0 ? 128 : 0;
  __m512 facc[MT];
  for (int r = 0; r < MT; r++) facc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* gb = wg + b * gbytes;
    prefetch_ahead(gb, gbytes);
    __m512i wv[8];
    if (Type == Q8_0) {
      for (int j = 0; j < 8; j++) wv[j] = _mm512_loadu_si512(gb + 64 * j);
    } else {
      const __m512i lo = _mm512_set1_epi8(0x0F);
      for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(gb + 64 * j);
        wv[j] = _mm512_and_si512(v, lo);
        wv[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
      }
    }
    const __m512 dvec = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(gb + 64 * nvec)));
    __m512 mvec = _mm512_setzero_ps();
    if (Type == Q4_1) mvec = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(gb + 64 * nvec + 2 * RC)));
    for (int r = 0; r < MT; r++) {
      const int8_t* x = a[r].qs + b * QK;
      __m512i acc = _mm512_setzero_si512();
      if (Type == Q8_0) {
        for (int j = 0; j < 8; j++) acc = _mm512_dpbusd_epi32(acc, wv[j], bcast4(x + 4 * j));
      } else {
        for (int j = 0; j < 4; j++) {
          acc = _mm512_dpbusd_epi32(acc, wv[j], bcast4(x + 4 * j));
          acc = _mm512_dpbusd_epi32(acc, wv[4 + j], bcast4(x + 16 + 4 * j));
        }
      }
      if (offset) acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(offset * a[r].sx[b]));
      facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dvec, _mm512_set1_ps(a[r].d[b])), facc[r]);
      if (Type == Q4_1) facc[r] = _mm512_fmadd_ps(mvec, _mm512_set1_ps(a[r].s[b]), facc[r]);
    }
  }
  for (int r = 0; r < MT; r++) _mm512_storeu_ps(y + r * ldy, facc[r]);
}

// Q4_K: MT activation rows against RC columns over nbk super-blocks. Per sub-block of 32, the
// integer dot of each column (eight vpdpbusd in two chains), then w = d*sc*q - dmin*m in floats.
template <int MT>
void group_q4_k(const uint8_t* wg, int64_t nbk, const Act* a, float* y, int64_t ldy) {
  const __m512i lo = _mm512_set1_epi8(0x0F);
  __m512 facc[MT];
  for (int r = 0; r < MT; r++) facc[r] = _mm512_setzero_ps();
  for (int64_t bk = 0; bk < nbk; bk++) {
    const uint8_t* gb = wg + bk * (148 * RC);
    prefetch_ahead(gb, 148 * RC);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(gb + 144 * RC)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(gb + 146 * RC)));
    for (int j = 0; j < 8; j++) {
      const uint8_t* q = gb + (j / 2) * 8 * 4 * RC;
      __m512i wv[8];
      for (int v = 0; v < 8; v++) {
        const __m512i t = _mm512_loadu_si512(q + 4 * RC * v);
        wv[v] = _mm512_and_si512(j & 1 ? _mm512_srli_epi16(t, 4) : t, lo);
      }
      const __m512 dsc = _mm512_mul_ps(
          d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(gb + 128 * RC + RC * j)))));
      const __m512 dm = _mm512_mul_ps(
          dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(gb + 136 * RC + RC * j)))));
      const int64_t b = bk * 8 + j;
      for (int r = 0; r < MT; r++) {
        const int8_t* x = a[r].qs + b * QK;
        __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
        for (int v = 0; v < 8; v += 2) {
          acc0 = _mm512_dpbusd_epi32(acc0, wv[v], bcast4(x + 4 * v));
          acc1 = _mm512_dpbusd_epi32(acc1, wv[v + 1], bcast4(x + 4 * v + 4));
        }
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(acc0, acc1));
        facc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dsc, _mm512_set1_ps(a[r].d[b])), facc[r]);
        facc[r] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(a[r].s[b]), facc[r]);
      }
    }
  }
  for (int r = 0; r < MT; r++) _mm512_storeu_ps(y + r * ldy, facc[r]);
}

// Q6_K: q = ql nibble | qh 2 bits << 4 as unsigned 0..63, w = d*sc*(q - 32): per 16 elements
// the integer dot minus 32 * sum(x) (one accumulator per scale), then the two scales in floats.
template <int MT>
void group_q6_k(const uint8_t* wg, int64_t nbk, const Act* a, float* y, int64_t ldy) {
  const __m512i lo = _mm512_set1_epi8(0x0F), hi = _mm512_set1_epi8(0x30);
  __m512 facc[MT];
  for (int r = 0; r < MT; r++) facc[r] = _mm512_setzero_ps();
  for (int64_t bk = 0; bk < nbk; bk++) {
    const uint8_t* gb = wg + bk * (210 * RC);
    prefetch_ahead(gb, 210 * RC);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(gb + 208 * RC)));
    for (int j = 0; j < 8; j++) {  // sub-block j = 4 * half + g
      const int h = j / 4, g = j % 4;
      const uint8_t* ql = gb + (h * 2 + (g & 1)) * 8 * 4 * RC;
      const uint8_t* qh = gb + 128 * RC + h * 8 * 4 * RC;
      __m512i wv[8];
      for (int v = 0; v < 8; v++) {
        const __m512i l = _mm512_loadu_si512(ql + 4 * RC * v), hb = _mm512_loadu_si512(qh + 4 * RC * v);
        const __m512i l4 = _mm512_and_si512(g < 2 ? l : _mm512_srli_epi16(l, 4), lo);
        const __m512i h2 = g == 0 ? _mm512_slli_epi16(hb, 4) : g == 1 ? _mm512_slli_epi16(hb, 2)
                         : g == 2 ? hb : _mm512_srli_epi16(hb, 2);
        wv[v] = _mm512_or_si512(l4, _mm512_and_si512(h2, hi));
      }
      const __m128i* sc = (const __m128i*)(gb + 192 * RC + 2 * j * RC);
      const __m512 s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sc))));
      const __m512 s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sc + 1))));
      const int64_t b = bk * 8 + j;
      for (int r = 0; r < MT; r++) {
        const int8_t* x = a[r].qs + b * QK;
        const int32_t* x16 = a[r].x16 + bk * 16 + 2 * j;
        __m512i acc0 = _mm512_set1_epi32(-32 * x16[0]), acc1 = _mm512_set1_epi32(-32 * x16[1]);
        for (int v = 0; v < 4; v++) {
          acc0 = _mm512_dpbusd_epi32(acc0, wv[v], bcast4(x + 4 * v));
          acc1 = _mm512_dpbusd_epi32(acc1, wv[4 + v], bcast4(x + 16 + 4 * v));
        }
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc0), s0, _mm512_mul_ps(_mm512_cvtepi32_ps(acc1), s1));
        facc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a[r].d[b]), facc[r]);
      }
    }
  }
  for (int r = 0; r < MT; r++) _mm512_storeu_ps(y + r * ldy, facc[r]);
}

#elif FT_RC == 8
// AVX2 (8 columns per 256-bit vector): the kernels above with half the columns. Without VNNI
// the 4-byte dot goes through 16-bit saturating pair sums, safe for weights up to 128 against
// |x| <= 127: every format here but Q8_0's q + 128, multiplied signed there (|q| by x with the
// sign of q, no offset).
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + the sum of 4 products (u8 weight by s8 activation) in each 32-bit lane.
inline __m256i dp4(__m256i acc, __m256i w, __m256i x) {
#if FT_VNNI
  return _mm256_dpbusd_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

template <int Type, int MT>
void group_rows(const uint8_t* wg, int64_t nb, const Act* a, float* y, int64_t ldy) {
  constexpr int64_t gbytes = Type == Q4_0 ? RC * 18 : Type == Q4_1 ? RC * 20 : RC * 34;
  constexpr int nvec = Type == Q8_0 ? 8 : 4;
  constexpr bool q8_signed = Type == Q8_0 && !FT_VNNI;
  constexpr int offset = Type == Q4_0 ? 8 : Type == Q8_0 && !q8_signed ? 128 : 0;
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  __m256 facc[MT];
  for (int r = 0; r < MT; r++) facc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* gb = wg + b * gbytes;
    prefetch_ahead(gb, gbytes);
    __m256i wv[8];
    if (Type == Q8_0) {  // q + 128, or |q| (its sign goes onto x per row)
      for (int j = 0; j < 8; j++)
        wv[j] = q8_signed ? _mm256_abs_epi8(_mm256_xor_si256(load32(gb + 4 * RC * j), flip)) : load32(gb + 4 * RC * j);
    } else {
      const __m256i lo = _mm256_set1_epi8(0x0F);
      for (int j = 0; j < 4; j++) {
        const __m256i v = load32(gb + 4 * RC * j);
        wv[j] = _mm256_and_si256(v, lo);
        wv[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
      }
    }
    const __m256 dvec = halves8(gb + 4 * RC * nvec);
    const __m256 mvec = Type == Q4_1 ? halves8(gb + 4 * RC * nvec + 2 * RC) : _mm256_setzero_ps();
    for (int r = 0; r < MT; r++) {
      const int8_t* x = a[r].qs + b * QK;
      __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
      if (q8_signed) {
        for (int j = 0; j < 8; j += 2) {
          const __m256i q0 = _mm256_xor_si256(load32(gb + 4 * RC * j), flip);
          const __m256i q1 = _mm256_xor_si256(load32(gb + 4 * RC * (j + 1)), flip);
          acc0 = dp4(acc0, wv[j], _mm256_sign_epi8(bcast4(x + 4 * j), q0));
          acc1 = dp4(acc1, wv[j + 1], _mm256_sign_epi8(bcast4(x + 4 * j + 4), q1));
        }
      } else if (Type == Q8_0) {
        for (int j = 0; j < 8; j += 2) {
          acc0 = dp4(acc0, wv[j], bcast4(x + 4 * j));
          acc1 = dp4(acc1, wv[j + 1], bcast4(x + 4 * j + 4));
        }
      } else {
        for (int j = 0; j < 4; j++) {
          acc0 = dp4(acc0, wv[j], bcast4(x + 4 * j));
          acc1 = dp4(acc1, wv[4 + j], bcast4(x + 16 + 4 * j));
        }
      }
      __m256i acc = _mm256_add_epi32(acc0, acc1);
      if (offset) acc = _mm256_sub_epi32(acc, _mm256_set1_epi32(offset * a[r].sx[b]));
      facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(dvec, _mm256_set1_ps(a[r].d[b])), facc[r]);
      if (Type == Q4_1) facc[r] = _mm256_fmadd_ps(mvec, _mm256_set1_ps(a[r].s[b]), facc[r]);
    }
  }
  for (int r = 0; r < MT; r++) _mm256_storeu_ps(y + r * ldy, facc[r]);
}

template <int MT>
void group_q4_k(const uint8_t* wg, int64_t nbk, const Act* a, float* y, int64_t ldy) {
  const __m256i lo = _mm256_set1_epi8(0x0F);
  __m256 facc[MT];
  for (int r = 0; r < MT; r++) facc[r] = _mm256_setzero_ps();
  for (int64_t bk = 0; bk < nbk; bk++) {
    const uint8_t* gb = wg + bk * (148 * RC);
    prefetch_ahead(gb, 148 * RC);
    const __m256 d = halves8(gb + 144 * RC), dmin = halves8(gb + 146 * RC);
    for (int j = 0; j < 8; j++) {
      const uint8_t* q = gb + (j / 2) * 8 * 4 * RC;
      __m256i wv[8];
      for (int v = 0; v < 8; v++) {
        const __m256i t = load32(q + 4 * RC * v);
        wv[v] = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(t, 4) : t, lo);
      }
      const __m256 dsc = _mm256_mul_ps(d, u8x8(gb + 128 * RC + RC * j));
      const __m256 dm = _mm256_mul_ps(dmin, u8x8(gb + 136 * RC + RC * j));
      const int64_t b = bk * 8 + j;
      for (int r = 0; r < MT; r++) {
        const int8_t* x = a[r].qs + b * QK;
        __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
        for (int v = 0; v < 8; v += 2) {
          acc0 = dp4(acc0, wv[v], bcast4(x + 4 * v));
          acc1 = dp4(acc1, wv[v + 1], bcast4(x + 4 * v + 4));
        }
        const __m256 isum = _mm256_cvtepi32_ps(_mm256_add_epi32(acc0, acc1));
        facc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dsc, _mm256_set1_ps(a[r].d[b])), facc[r]);
        facc[r] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(a[r].s[b]), facc[r]);
      }
    }
  }
  for (int r = 0; r < MT; r++) _mm256_storeu_ps(y + r * ldy, facc[r]);
}

template <int MT>
void group_q6_k(const uint8_t* wg, int64_t nbk, const Act* a, float* y, int64_t ldy) {
  const __m256i lo = _mm256_set1_epi8(0x0F), hi = _mm256_set1_epi8(0x30);
  __m256 facc[MT];
  for (int r = 0; r < MT; r++) facc[r] = _mm256_setzero_ps();
  for (int64_t bk = 0; bk < nbk; bk++) {
    const uint8_t* gb = wg + bk * (210 * RC);
    prefetch_ahead(gb, 210 * RC);
    const __m256 d = halves8(gb + 208 * RC);
    for (int j = 0; j < 8; j++) {
      const int h = j / 4, g = j % 4;
      const uint8_t* ql = gb + (h * 2 + (g & 1)) * 8 * 4 * RC;
      const uint8_t* qh = gb + 128 * RC + h * 8 * 4 * RC;
      __m256i wv[8];
      for (int v = 0; v < 8; v++) {
        const __m256i l = load32(ql + 4 * RC * v), hb = load32(qh + 4 * RC * v);
        const __m256i l4 = _mm256_and_si256(g < 2 ? l : _mm256_srli_epi16(l, 4), lo);
        const __m256i h2 = g == 0 ? _mm256_slli_epi16(hb, 4) : g == 1 ? _mm256_slli_epi16(hb, 2)
                         : g == 2 ? hb : _mm256_srli_epi16(hb, 2);
        wv[v] = _mm256_or_si256(l4, _mm256_and_si256(h2, hi));
      }
      const __m256 s0 = _mm256_mul_ps(d, i8x8(gb + 192 * RC + 2 * j * RC));
      const __m256 s1 = _mm256_mul_ps(d, i8x8(gb + 192 * RC + (2 * j + 1) * RC));
      const int64_t b = bk * 8 + j;
      for (int r = 0; r < MT; r++) {
        const int8_t* x = a[r].qs + b * QK;
        const int32_t* x16 = a[r].x16 + bk * 16 + 2 * j;
        __m256i acc0 = _mm256_set1_epi32(-32 * x16[0]), acc1 = _mm256_set1_epi32(-32 * x16[1]);
        for (int v = 0; v < 4; v++) {
          acc0 = dp4(acc0, wv[v], bcast4(x + 4 * v));
          acc1 = dp4(acc1, wv[4 + v], bcast4(x + 16 + 4 * v));
        }
        const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc0), s0, _mm256_mul_ps(_mm256_cvtepi32_ps(acc1), s1));
        facc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(a[r].d[b]), facc[r]);
      }
    }
  }
  for (int r = 0; r < MT; r++) _mm256_storeu_ps(y + r * ldy, facc[r]);
}

#endif

// ==== Column kernels of Q5_K, IQ4_XS, IQ4_NL, Q5_0, Q5_1: their layouts, repacking and products ====
#include "kernels_q5_iq4.inc"

// `nb`: the weight's blocks per row (super-blocks for the K-quants).
#if FT_RC
template <int MT>
void group_dispatch(int type, const uint8_t* wg, int64_t nb, const Act* a, float* y, int64_t ldy) {
  switch (type) {
    case Q4_0: group_rows<Q4_0, MT>(wg, nb, a, y, ldy); break;
    case Q4_1: group_rows<Q4_1, MT>(wg, nb, a, y, ldy); break;
    case Q8_0: group_rows<Q8_0, MT>(wg, nb, a, y, ldy); break;
    case Q4_K: group_q4_k<MT>(wg, nb, a, y, ldy); break;
    case Q6_K: group_q6_k<MT>(wg, nb, a, y, ldy); break;
    default: group_dispatch_more<MT>(type, wg, nb, a, y, ldy); break;
  }
}
#else
template <int MT>
void group_dispatch(int, const uint8_t*, int64_t, const Act*, float*, int64_t) {}
#endif

// Element k of column c (of a group) in repacked block `gb`, as float (the GGUF block's value).
inline float repacked_at(int type, const uint8_t* gb, int c, int k) {
  if (repackable_more(type)) return repacked_at_more(type, gb, c, k);
  if (type == Q4_K) {
    const int j = k / 32, e = k % 32;
    const uint8_t byte = gb[((j / 2) * 8 + e / 4) * 4 * RC + 4 * c + e % 4];
    const int q = j & 1 ? byte >> 4 : byte & 0xF;
    const int sc = gb[128 * RC + j * RC + c], m = gb[136 * RC + j * RC + c];
    return rd16(gb + 144 * RC + 2 * c) * sc * q - rd16(gb + 146 * RC + 2 * c) * m;
  }
  if (type == Q6_K) {
    const int h = k / 128, g = (k % 128) / 32, i = k % 32;
    const uint8_t l = gb[((h * 2 + (g & 1)) * 8 + i / 4) * 4 * RC + 4 * c + i % 4];
    const uint8_t hb = gb[128 * RC + (h * 8 + i / 4) * 4 * RC + 4 * c + i % 4];
    const int q = ((g < 2 ? l & 0xF : l >> 4) | (((hb >> (2 * g)) & 3) << 4)) - 32;
    return rd16(gb + 208 * RC + 2 * c) * (int8_t)gb[192 * RC + (k / 16) * RC + c] * q;
  }
  if (type == Q8_0) {
    const int v = (int)gb[(k / 4) * 4 * RC + 4 * c + k % 4] - 128;
    uint16_t h;
    memcpy(&h, gb + 32 * RC + 2 * c, 2);
    return rd16((const uint8_t*)&h) * v;
  }
  const int j = (k % 16) / 4, i = k % 4;
  const uint8_t byte = gb[j * 4 * RC + 4 * c + i];
  const int q = k < 16 ? (byte & 0xF) : (byte >> 4);
  const float d = rd16(gb + 16 * RC + 2 * c);
  return type == Q4_0 ? d * (q - 8) : d * q + rd16(gb + 18 * RC + 2 * c);
}


constexpr int64_t MAX_K = (int64_t)1 << 30;  // dot_rows counts a row's blocks in an int

// A weight of `rows` rows of `row_bytes` bytes of `type` blocks (or groups of `columns`
// repacked rows) to be multiplied against activations of K elements.
void check_weight(const char* what, int64_t type, int64_t rows, int64_t row_bytes, int64_t columns, int64_t K) {
  const int64_t be = block_elems(type);
  FT_REQUIRE(be, "%s: unsupported weight type %lld", what, (long long)type);
  FT_REQUIRE(K > 0 && K <= MAX_K && K % be == 0 && K % QK == 0,
             "%s: %lld columns are not whole blocks of %lld", what, (long long)K, (long long)be);
  FT_REQUIRE(rows >= 0, "%s: %lld rows", what, (long long)rows);
  FT_REQUIRE(columns == 0 || (columns == RC && repackable(type) && rows % columns == 0),
             "%s: repacked in groups of %lld (of %lld rows), this build multiplies groups of %d", what,
             (long long)columns, (long long)rows, RC);
  // a repacked row's share of its groups' bytes (Q4_K's unpacked scales make it larger)
  const int64_t expected = K / be * (columns ? repacked_bytes(type) / RC : block_bytes(type));
  FT_REQUIRE(row_bytes == expected, "%s: rows of %lld bytes, expected %lld for %lld columns", what,
             (long long)row_bytes, (long long)expected, (long long)K);
}

template <int MT>
void dot_rows(int type, const uint8_t* w, int64_t K, const Act* a, float* out) {
  switch (type) {
    case Q4_0: rows_legacy<FmtQ4_0, MT>(w, (int)(K / QK), a, out); break;
    case Q4_1: rows_legacy<FmtQ4_1, MT>(w, (int)(K / QK), a, out); break;
    case Q8_0: rows_legacy<FmtQ8_0, MT>(w, (int)(K / QK), a, out); break;
    case Q4_K: rows_q4_k<MT>(w, (int)(K / QK_K), a, out); break;
    case Q6_K: rows_q6_k<MT>(w, (int)(K / QK_K), a, out); break;
    case Q5_0: rows_legacy<FmtQ5_0, MT>(w, (int)(K / QK), a, out); break;
    case Q5_1: rows_legacy<FmtQ5_1, MT>(w, (int)(K / QK), a, out); break;
    case IQ4_NL: rows_legacy<FmtIQ4_NL, MT>(w, (int)(K / QK), a, out); break;
    case Q2_K: rows_kx<KQ2_K, MT>(w, (int)(K / QK_K), a, out); break;
    case Q3_K: rows_kx<KQ3_K, MT>(w, (int)(K / QK_K), a, out); break;
    case Q5_K: rows_kx<KQ5_K, MT>(w, (int)(K / QK_K), a, out); break;
    case IQ4_XS: rows_kx<KIQ4_XS, MT>(w, (int)(K / QK_K), a, out); break;
    case F16: rows_float<F16, MT>(w, (int)(K / QK), a, out); break;
    case BF16: rows_float<BF16, MT>(w, (int)(K / QK), a, out); break;
  }
}

}  // namespace

// One block x[32] -> int8 qs[32] with scale d, scaled sum s and integer sum sx.
inline void quantize_block(const float* xb, int8_t* qs, float* d, float* s, int32_t* sx) {
  // NOTE: the largest |x| as fmaxf gives it, a NaN skipped; lanes then their maximum (max is
  // exact, so the order does not change it).
#if defined(__AVX512F__)
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 m = _mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(xb + 16)),
                                 _mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(xb)), _mm512_setzero_ps()));
  const float amax = _mm512_reduce_max_ps(m);
#else
  float amax = 0;
  for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
#endif
  const float scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int j = 0; j < QK; j++) {
    // NOTE: a NaN (or an infinity, where inv is 0) stores 0: no float cast out of range; a
    // block with an infinity keeps d = inf, so its products stay non-finite.
    const float r = xb[j] * inv;
    const int v = r == r ? (int)nearbyintf(r) : 0;
    qs[j] = (int8_t)v;
    sum += v;
  }
  *d = scale;
  *s = scale * (float)sum;
  *sx = sum;
}

// One row x[K] -> int8 blocks of 32 with scale d, scaled sum s and integer sum sx per block.
void quantize_row(const float* x, int64_t K, int8_t* qs, float* d, float* s, int32_t* sx) {
  for (int64_t b = 0; b < K / QK; b++) quantize_block(x + b * QK, qs + b * QK, d + b, s + b, sx + b);
}

// The sums of each 16 of a row's K elements (K % 16 == 0).
void sums16_row(const int8_t* qs, int64_t K, int32_t* x16) {
  for (int64_t i = 0; i < K / 16; i++) {
    int sum = 0;
    for (int j = 0; j < 16; j++) sum += qs[16 * i + j];
    x16[i] = sum;
  }
}

// M quantized activation rows of K elements.
struct ActRows {
  const int8_t* qs;
  const float* d;
  const float* s;
  const int32_t* sx;
  int64_t K;
  const int32_t* x16 = nullptr;  // [M, K / 16], or null
  Act row(int64_t m) const {
    const int64_t nb = K / QK;
    return {qs + m * K, d + m * nb, s + m * nb, sx + m * nb, x16 ? x16 + m * (K / 16) : nullptr};
  }
};

// y[m * ldy] = dot(W row, activation row m) for every m, four rows per pass over the weights.
void gemm_row(int type, const uint8_t* wrow, const ActRows& a, int64_t M, float* y, int64_t ldy) {
  Act rows[4];
  float out[4] = {0, 0, 0, 0};
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    for (int r = 0; r < 4; r++) rows[r] = a.row(m + r);
    dot_rows<4>(type, wrow, a.K, rows, out);
    for (int r = 0; r < 4; r++) y[(m + r) * ldy] = out[r];
  }
  for (; m < M; m++) {
    rows[0] = a.row(m);
    dot_rows<1>(type, wrow, a.K, rows, out);
    y[m * ldy] = out[0];
  }
}

// y[m * ldy + c] for c < RC: one repacked group of RC columns against M rows, four at a time.
void gemm_group(int type, const uint8_t* wg, const ActRows& a, int64_t M, float* y, int64_t ldy) {
  Act rows[8];
  const int64_t nb = a.K / block_elems(type);
  int64_t m = 0;
  // tiles of 8 rows with 32 vector registers (AVX-512); with 16 (AVX2), 4 keep them in registers
  for (; RC == 16 && m + 8 <= M; m += 8) {
    for (int r = 0; r < 8; r++) rows[r] = a.row(m + r);
    group_dispatch<8>(type, wg, nb, rows, y + m * ldy, ldy);
  }
  for (; m + 4 <= M; m += 4) {
    for (int r = 0; r < 4; r++) rows[r] = a.row(m + r);
    group_dispatch<4>(type, wg, nb, rows, y + m * ldy, ldy);
  }
  for (; m < M; m++) {
    rows[0] = a.row(m);
    group_dispatch<1>(type, wg, nb, rows, y + m * ldy, ldy);
  }
}

extern "C" {

// The message of the last failed call on this thread.
const char* ft_last_error() { return last_error; }

// x [M, K] float32 (row stride ldx) -> qs [M, K] int8; d, s, sx [M, K/32]. K % 32 == 0.
int ft_quantize_q8(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* qs, float* d, float* s,
                   int32_t* sx, int threads) {
  return guarded("ft_quantize_q8", [&] {
    FT_REQUIRE(M >= 0 && K >= 0 && K % QK == 0 && K <= MAX_K, "%lld rows of %lld are not whole blocks of %d",
               (long long)M, (long long)K, QK);
    FT_REQUIRE(M <= 1 || ldx >= K, "row stride %lld under the row length %lld", (long long)ldx, (long long)K);
    FT_REQUIRE(threads >= 1, "%d threads", threads);
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * ldx, K, qs + m * K, d + m * nb, s + m * nb, sx + m * nb);
  });
}

// y[m, n] = sum_k x[m, k] * W[n, k] for n < N, W's rows stored as `row_bytes` bytes of blocks of
// `type`; y has row stride ldy (so a caller can fill a column slice of a wider output).
int ft_gemm(int type, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes, int64_t columns,
            const int8_t* qs, const float* d, const float* s, const int32_t* sx, int64_t M, float* y, int64_t ldy,
            int threads) {
  return guarded("ft_gemm", [&] {
    check_weight("weight", type, N, row_bytes, columns, K);
    FT_REQUIRE(M >= 0 && (M <= 1 || ldy >= N), "%lld rows of stride %lld for %lld outputs", (long long)M,
               (long long)ldy, (long long)N);
    FT_REQUIRE(threads >= 1, "%d threads", threads);
    std::vector<int32_t> x16(columns && type == Q6_K ? M * (K / 16) : 0);
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < (int64_t)x16.size() / (K / 16); m++) sums16_row(qs + m * K, K, &x16[m * (K / 16)]);
    const ActRows a{qs, d, s, sx, K, x16.empty() ? nullptr : x16.data()};
    if (columns) {
      const int64_t group_bytes = K / block_elems(type) * repacked_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t g = 0; g < N / columns; g++) gemm_group(type, w + g * group_bytes, a, M, y + g * columns, ldy);
      return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) gemm_row(type, w + n * row_bytes, a, M, y + n, ldy);
  });
}

// Columns per repacked group on this build (0: no repacked kernels here).
int ft_repack_columns() { return RC; }

// Bytes per row of a `type` weight of K columns once repacked on this build (0: it is not).
int64_t ft_repacked_row_bytes(int type, int64_t K) {
  const int64_t be = block_elems(type);
  if (!RC || !repackable(type) || K <= 0 || K % be) return 0;
  return K / be * repacked_bytes(type) / RC;
}

// src: N rows of GGUF blocks of a repackable type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, Q5_K, IQ4_XS,
// IQ4_NL, Q5_0, Q5_1), N % RC == 0 -> dst in the
// repacked layout (N * ft_repacked_row_bytes(type, K) bytes).
int ft_repack(int type, const uint8_t* src, int64_t N, int64_t K, int64_t row_bytes, uint8_t* dst) {
  return guarded("ft_repack", [&] {
    FT_REQUIRE(RC && repackable(type), "type %d cannot be repacked on this build", type);
    check_weight("weight", type, N, row_bytes, 0, K);
    constexpr int64_t group = RC ? RC : 1;  // (no division by a zero RC where it compiles away)
    FT_REQUIRE(N % group == 0, "%lld rows are not whole groups of %d", (long long)N, RC);
    const int64_t nb = K / block_elems(type), gbytes = repacked_bytes(type), bytes = block_bytes(type);
    for (int64_t g = 0; g < N / group; g++)
      for (int64_t b = 0; b < nb; b++) {
        uint8_t* out = dst + (g * nb + b) * gbytes;
        for (int c = 0; c < RC; c++) {
          const uint8_t* blk = src + (g * RC + c) * row_bytes + b * bytes;
          // 4 bytes of column c in each vector j: out[j * 4 * RC + 4c ..] = from[4j ..]
          auto interleave = [&](uint8_t* to, const uint8_t* from, int nvec, uint8_t flip) {
            for (int j = 0; j < nvec; j++)
              for (int i = 0; i < 4; i++) to[j * 4 * RC + 4 * c + i] = from[4 * j + i] ^ flip;
          };
          if (type == Q4_K) {
            interleave(out, blk + 16, 32, 0);
            for (int j = 0; j < 8; j++) {
              int sc, m;
              scale_min_k4(j, blk + 4, &sc, &m);
              out[128 * RC + j * RC + c] = (uint8_t)sc;
              out[136 * RC + j * RC + c] = (uint8_t)m;
            }
            memcpy(out + 144 * RC + 2 * c, blk, 2);      // d
            memcpy(out + 146 * RC + 2 * c, blk + 2, 2);  // dmin
          } else if (type == Q6_K) {
            interleave(out, blk, 32, 0);                     // ql
            interleave(out + 128 * RC, blk + 128, 16, 0);    // qh
            for (int k = 0; k < 16; k++) out[192 * RC + k * RC + c] = blk[192 + k];
            memcpy(out + 208 * RC + 2 * c, blk + 208, 2);  // d
          } else if (repackable_more(type)) {
            repack_block_more(type, blk, out, c);
          } else {
            const int nvec = type == Q8_0 ? 8 : 4;
            interleave(out, blk + (type == Q4_1 ? 4 : 2), nvec, type == Q8_0 ? 0x80 : 0);
            memcpy(out + nvec * 4 * RC + 2 * c, blk, 2);                                 // d
            if (type == Q4_1) memcpy(out + nvec * 4 * RC + 2 * RC + 2 * c, blk + 2, 2);  // m
          }
        }
      }
  });
}

}  // extern "C"

// ---- Dequantized rows (embedding lookups) ----
namespace {
void dequant_row(int type, const uint8_t* w, int64_t K, float* out) {
  switch (type) {
    case Q4_0:
      for (int64_t b = 0; b < K / QK; b++, w += 18) {
        const float d = rd16(w);
        for (int j = 0; j < 16; j++) {
          out[b * QK + j] = d * ((w[2 + j] & 0xF) - 8);
          out[b * QK + j + 16] = d * ((w[2 + j] >> 4) - 8);
        }
      }
      break;
    case Q4_1:
      for (int64_t b = 0; b < K / QK; b++, w += 20) {
        const float d = rd16(w), m = rd16(w + 2);
        for (int j = 0; j < 16; j++) {
          out[b * QK + j] = d * (w[4 + j] & 0xF) + m;
          out[b * QK + j + 16] = d * (w[4 + j] >> 4) + m;
        }
      }
      break;
    case Q8_0:
      for (int64_t b = 0; b < K / QK; b++, w += 34) {
        const float d = rd16(w);
        for (int j = 0; j < 32; j++) out[b * QK + j] = d * (int8_t)w[2 + j];
      }
      break;
    case Q4_K:
      for (int64_t bk = 0; bk < K / QK_K; bk++, w += 144) {
        const float d = rd16(w), dmin = rd16(w + 2);
        for (int j = 0; j < 8; j++) {
          int sc, m;
          scale_min_k4(j, w + 4, &sc, &m);
          const uint8_t* q = w + 16 + 32 * (j / 2);
          for (int l = 0; l < 32; l++)
            out[bk * QK_K + j * 32 + l] = d * sc * ((q[l] >> ((j & 1) * 4)) & 0xF) - dmin * m;
        }
      }
      break;
    case Q6_K:
      for (int64_t bk = 0; bk < K / QK_K; bk++, w += 210) {
        const float d = rd16(w + 208);
        for (int half = 0; half < 2; half++) {
          const uint8_t* l = w + 64 * half;
          const uint8_t* h = w + 128 + 32 * half;
          const int8_t* s = (const int8_t*)(w + 192) + 8 * half;
          for (int g = 0; g < 4; g++)
            for (int i = 0; i < 32; i++) {
              const int lo4 = g < 2 ? (l[32 * (g & 1) + i] & 0xF) : (l[32 * (g & 1) + i] >> 4);
              const int q = (lo4 | (((h[i] >> (2 * g)) & 3) << 4)) - 32;
              out[bk * QK_K + half * 128 + g * 32 + i] = d * s[2 * g + (i >= 16)] * q;
            }
        }
      }
      break;
    case Q5_0: case Q5_1: case IQ4_NL: dequant_formats32(type, w, K, out); break;
    case Q2_K: dequant_kx<KQ2_K>(w, K, out); break;
    case Q3_K: dequant_kx<KQ3_K>(w, K, out); break;
    case Q5_K: dequant_kx<KQ5_K>(w, K, out); break;
    case IQ4_XS: dequant_kx<KIQ4_XS>(w, K, out); break;
    case F16: dequant_float<F16>(w, K, out); break;
    case BF16: dequant_float<BF16>(w, K, out); break;
  }
}

struct Weight {  // one projection: rows of GGUF blocks, or groups of `columns` repacked rows
  int64_t type;
  const uint8_t* data;
  int64_t rows;
  int64_t row_bytes;
  int64_t columns;
};

// Quantized activations of M rows, reused by every projection that reads the same input.
struct QAct {
  std::vector<int8_t> qs;
  std::vector<float> d, s;
  std::vector<int32_t> sx, x16;
  int64_t M = 0, K = 0;
  // Room for m rows of up to k_max elements (before the parallel region: set() never allocates).
  QAct(int64_t m, int64_t k_max)
      : qs(m * k_max), d(m * k_max / QK), s(m * k_max / QK), sx(m * k_max / QK), x16(m * k_max / 16) {}
  // Called by every thread of the team: the blocks are split across it. NOTE: the team must
  // be past its last read of these rows (a barrier), and the loop's barrier publishes them.
  void set_team(const float* x, int64_t m, int64_t k, int64_t ldx) {
#pragma omp master
    {
      M = m;
      K = k;
    }
    const int64_t nb = k / QK;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m * nb; i++) {
      const int64_t r = i / nb, b = i % nb;
      quantize_block(x + r * ldx + b * QK, &qs[r * k + b * QK], &d[i], &s[i], &sx[i]);
      sums16_row(&qs[r * k + b * QK], QK, &x16[2 * i]);
    }
  }
  ActRows rows() const { return {qs.data(), d.data(), s.data(), sx.data(), K, x16.data()}; }
};

// y[:, 0:N] = act @ W.T, rows of W split across the team (call from inside a parallel region).
// `wait` false: no barrier after it, for a product the next one does not read (q, k and v; gate
// and up): a thread that finishes its share starts on the next.
void gemm_team(const Weight& w, const QAct& a, float* y, int64_t ldy, bool wait = true) {
  const ActRows rows = a.rows();
  const int64_t group_bytes = w.columns ? a.K / block_elems(w.type) * repacked_bytes(w.type) : 0;
  const int64_t n = w.columns ? w.rows / w.columns : w.rows;
  auto one = [&](int64_t i) {
    if (w.columns)
      gemm_group((int)w.type, w.data + i * group_bytes, rows, a.M, y + i * w.columns, ldy);
    else
      gemm_row((int)w.type, w.data + i * w.row_bytes, rows, a.M, y + i, ldy);
  };
  if (wait) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) one(i);
  } else {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; i++) one(i);
  }
}

// KV cache element types: float32, IEEE half, bfloat16, and q8_0 blocks of 32.
enum : int { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };
struct half_t {
  uint16_t bits;
};
struct bfloat_t {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(half_t x) { return rd16((const uint8_t*)&x.bits); }
inline float to_float(bfloat_t x) {
  const uint32_t b = (uint32_t)x.bits << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, half_t* out) {
#if defined(__F16C__)
  out->bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
  // round to nearest even via float arithmetic on the exponent range of half (normals only)
  uint32_t b;
  memcpy(&b, &x, 4);
  const uint32_t sign = (b >> 16) & 0x8000;
  const int exp = (int)((b >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) {
    out->bits = (uint16_t)sign;
  } else if (exp >= 31) {
    out->bits = (uint16_t)(sign | 0x7C00);
  } else {
    uint32_t mant = b & 0x7FFFFF, h = sign | (exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    out->bits = (uint16_t)h;
  }
#endif
}
inline void from_float(float x, bfloat_t* out) {  // round to nearest even, as torch does
  uint32_t b;
  memcpy(&b, &x, 4);
  out->bits = (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// A q8_0 KV block, as GGUF's Q8_0: 32 int8 values and their scale d (IEEE half); element i is
// qs[i] * d. A head of hd (a multiple of 32) elements is hd / 32 consecutive blocks.
struct kv_q8_t {
  uint16_t d;
  int8_t qs[QK];
};
static_assert(sizeof(kv_q8_t) == 34, "a q8_0 KV block is 34 bytes");

// Elements per unit of a KV cache of T: one, or a block's 32.
template <class T>
constexpr int64_t kv_per = 1;
template <>
constexpr int64_t kv_per<kv_q8_t> = QK;

// Element i of a head (or slot) starting at p, as float.
template <class T>
inline float kv_at(const T* p, int64_t i) {
  return to_float(p[i]);
}
inline float kv_at(const kv_q8_t* p, int64_t i) {
  const kv_q8_t& b = p[i / QK];
  return (float)b.qs[i % QK] * rd16((const uint8_t*)&b.d);
}

// The IEEE half nearest a scale d >= 0, saturated at the largest half (subnormals kept: the
// portable from_float flushes them, which would zero a block of small values).
inline uint16_t kv_scale_bits(float d) {
  d = d < 65504.0f ? d : 65504.0f;
#if defined(__F16C__)
  return _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
#else
  if (d < 6.103515625e-05f) return (uint16_t)lrintf(d * 16777216.0f);  // 2^-24 steps
  half_t h;
  from_float(d, &h);
  return h.bits;
#endif
}

// n elements of x written from `out` on (the KV write of one slot).
template <class T>
inline void kv_store(const float* x, int64_t n, T* out) {
  for (int64_t i = 0; i < n; i++) from_float(x[i], out + i);
}
// q8_0: per block of 32, d = max|x| / 127 rounded to half, qs = round(x / d) (n % 32 == 0).
inline void kv_store(const float* x, int64_t n, kv_q8_t* out) {
  for (int64_t b = 0; b < n / QK; b++) {
    const float* xb = x + b * QK;
    float amax = 0;
    for (int i = 0; i < QK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
    out[b].d = kv_scale_bits(amax / 127.0f);
    const float d = rd16((const uint8_t*)&out[b].d), id = d > 0 ? 1.0f / d : 0.0f;
    for (int i = 0; i < QK; i++) {
      const float v = xb[i] * id;  // NOTE: NaN stores 0; the clamps keep the cast defined
      out[b].qs[i] = (int8_t)(v == v ? roundf(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v) : 0.0f);
    }
  }
}

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const half_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load8(const bfloat_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// Elements i..i+7 of a head starting at p (i % 8 == 0), as float: exactly kv_at's values.
template <class T>
inline __m256 kv_load8(const T* p, int64_t i) {
  return load8(p + i);
}
inline __m256 kv_load8(const kv_q8_t* p, int64_t i) {
  const kv_q8_t& b = p[i / QK];
  const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b.qs + i % QK))));
  return _mm256_mul_ps(q, _mm256_set1_ps(rd16((const uint8_t*)&b.d)));
}
#endif

// dot(q, k) over hd elements.
template <class T>
inline float dot_kv(const float* q, const T* k, int64_t hd) {
  int64_t i = 0;
  float sum = 0;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv_load8(k, i), acc);
  sum = hsum(acc);
#endif
  for (; i < hd; i++) sum += q[i] * kv_at(k, i);
  return sum;
}

// o += c * v over hd elements.
template <class T>
inline void axpy_kv(float c, const T* v, float* o, int64_t hd) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 cv = _mm256_set1_ps(c);
  for (; i + 8 <= hd; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(cv, kv_load8(v, i), _mm256_loadu_ps(o + i)));
#endif
  for (; i < hd; i++) o[i] += c * kv_at(v, i);
}

#if defined(__AVX2__)
// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), |rel. error| < 2e-7.
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // NOTE: this operand order keeps a NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Eight dot products' 8-lane partial sums -> one lane each, in order.
inline __m256 hsum8_ps(const __m256* a) {
  const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 d = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
}
#endif

// Softmax of sc[0, len) in place; sc has room for len rounded up to 8.
inline void softmax(float* sc, int64_t len) {
  float mx = -INFINITY, sum = 0;
  for (int64_t p = 0; p < len; p++) mx = sc[p] > mx ? sc[p] : mx;
#if defined(__AVX2__)
  const int64_t padded = (len + 7) / 8 * 8;
  for (int64_t p = len; p < padded; p++) sc[p] = -INFINITY;
  __m256 total = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(mx);
  for (int64_t p = 0; p < padded; p += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sc + p), m));
    _mm256_storeu_ps(sc + p, e);
    total = _mm256_add_ps(total, e);
  }
  sum = hsum(total);
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (int64_t p = 0; p < padded; p += 8) _mm256_storeu_ps(sc + p, _mm256_mul_ps(_mm256_loadu_ps(sc + p), inv));
#else
  for (int64_t p = 0; p < len; p++) {
    sc[p] = expf(sc[p] - mx);
    sum += sc[p];
  }
  const float inv = 1.0f / sum;
  for (int64_t p = 0; p < len; p++) sc[p] *= inv;
#endif
}

// Paged attention of T rows (call from inside a parallel region). Row t is position pos[t] of
// sequence seq[t] and attends positions 0..pos[t]; it reads queries at q + t * ldq and writes
// out + t * ldo. Consecutive rows of one sequence (a prompt chunk) go in tiles of up to eight
// that share each block of eight keys and values, converted to float once; every (row, position)
// is computed the same way in a tile or alone, so a row never depends on its neighbours.
// What attend_team needs besides its inputs, made before the parallel region (nothing may
// allocate inside one): the first row of each tile, and a score buffer per thread.
struct AttendScratch {
  std::vector<int64_t> tiles;
  // [thread][row < tile rows][head][position]; left uninitialized (every score is written
  // before it is read), so only the pages a thread touches are ever committed or cleared.
  std::unique_ptr<float[]> scores;
  int64_t per_thread = 0;
  AttendScratch(int64_t T_, const int64_t* seq, const int64_t* pos, int64_t group, int threads) {
    int64_t len_max = 0, rows_max = 0;
    for (int64_t t = 0; t < T_; t++) {
      if (t == 0 || seq[t] != seq[t - 1] || pos[t] != pos[t - 1] + 1 || t - tiles.back() == 8) tiles.push_back(t);
      rows_max = t + 1 - tiles.back() > rows_max ? t + 1 - tiles.back() : rows_max;
      len_max = pos[t] + 1 > len_max ? pos[t] + 1 : len_max;
    }
    // NOTE: sized by the longest tile (one row for decodes), not always eight rows.
    per_thread = rows_max * group * ((len_max + 7) / 8 * 8);
    scores.reset(new float[per_thread * threads]);
  }
};

template <class T>
void attend_team(const float* qbase, int64_t ldq, const T* k_cache, const T* v_cache, int64_t T_,
                 const int64_t* seq, const int64_t* pos, const int32_t* block_tables, int64_t max_pages,
                 int64_t page_size, int64_t nh, int64_t nkvh, int64_t hd, float* obase, int64_t ldo,
                 AttendScratch& scratch, float scale_in = 0, float softcap = 0, int64_t window = 0) {
  // scale_in: the scores' scale (0: 1 / sqrt(hd)); softcap: scores as tanh(s / cap) * cap (0:
  // none); window: row t attends positions pos[t] - window + 1 .. pos[t] only (0: all). A row's
  // first block of eight keys is its window's, whatever its tile, so it never depends on them.
  const int64_t kvsz = nkvh * hd, group = nh / nkvh;
  const float scale = scale_in > 0 ? scale_in : 1.0f / sqrtf((float)hd);
  auto first = [&](int64_t p) { return window && p - window + 1 > 0 ? p - window + 1 : (int64_t)0; };
  const std::vector<int64_t>& tiles = scratch.tiles;  // first row of each tile
  const int page_shift = (page_size & (page_size - 1)) == 0 ? __builtin_ctzll((unsigned long long)page_size) : -1;
  const int64_t ntiles = (int64_t)tiles.size();
#pragma omp for schedule(dynamic, 1) collapse(2)
  for (int64_t ti = 0; ti < ntiles; ti++) {
    for (int64_t kh = 0; kh < nkvh; kh++) {
      const int64_t t0 = tiles[ti], rows = (ti + 1 < ntiles ? tiles[ti + 1] : T_) - t0;
      const int64_t len_max = pos[t0 + rows - 1] + 1, stride = (len_max + 7) / 8 * 8;
      const int32_t* table = block_tables + seq[t0] * max_pages;
      // Positions past the tile's last are clamped to it: computed, then never used.
      auto at = [&](const T* cache, int64_t p) {
        p = p < len_max ? p : len_max - 1;
        // (a shift and a mask for the usual power-of-two pages: a division per key was a tenth
        // of the attention's time)
        const int64_t page = page_shift >= 0 ? p >> page_shift : p / page_size;
        const int64_t slot = page_shift >= 0 ? p & (page_size - 1) : p % page_size;
        return cache + (((int64_t)table[page] * page_size + slot) * kvsz + kh * hd) / kv_per<T>;
      };
      float* sc = scratch.scores.get() + omp_get_thread_num() * scratch.per_thread;  // [row][head][position]
#if defined(__AVX2__)
      if (hd % 8 == 0 && hd <= 256) {
        alignas(32) float buf[8 * 256];
        const int64_t p_first = first(pos[t0]) / 8 * 8;  // the tile's earliest window (its first row's)
        // NOTE: a head's keys of consecutive positions are a slot apart and pages are scattered:
        // no hardware prefetcher follows them, so the keys (values) of the block after next are
        // asked for while this one is computed (16 streams at 550 positions: 99 -> ~55 ms a step).
        const int64_t head_bytes = hd * (int64_t)sizeof(T) / kv_per<T>;
        auto prefetch_block = [&](const T* cache, int64_t p0) {
          for (int j = 0; j < 8 && p0 + j < len_max; j++)
            for (int64_t o = 0; o < head_bytes; o += 64) __builtin_prefetch((const char*)at(cache, p0 + j) + o);
        };
        prefetch_block(k_cache, p_first);
        prefetch_block(k_cache, p_first + 8);
        for (int64_t p0 = p_first; p0 < len_max; p0 += 8) {
          prefetch_block(k_cache, p0 + 16);
          for (int j = 0; j < 8; j++) {
            const T* k = at(k_cache, p0 + j);
            for (int64_t i = 0; i < hd; i += 8) _mm256_store_ps(buf + j * hd + i, kv_load8(k, i));
          }
          for (int64_t r = 0; r < rows; r++) {
            if (p0 > pos[t0 + r] || p0 + 8 <= first(pos[t0 + r])) continue;
            for (int64_t g = 0; g < group; g++) {
              const float* q = qbase + (t0 + r) * ldq + (kh * group + g) * hd;
              __m256 acc[8];
              for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
              for (int64_t i = 0; i < hd; i += 8) {
                const __m256 qv = _mm256_loadu_ps(q + i);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_load_ps(buf + j * hd + i), acc[j]);
              }
              float* s8 = &sc[(r * group + g) * stride + p0];
              _mm256_storeu_ps(s8, _mm256_mul_ps(hsum8_ps(acc), _mm256_set1_ps(scale)));
              if (softcap)
                for (int j = 0; j < 8; j++) s8[j] = tanhf(s8[j] / softcap) * softcap;
              for (int64_t j = 0; p0 + j < first(pos[t0 + r]); j++) s8[j] = -INFINITY;  // before its window
            }
          }
        }
        for (int64_t r = 0; r < rows; r++) {
          const int64_t from = first(pos[t0 + r]) / 8 * 8;
          for (int64_t g = 0; g < group; g++) softmax(&sc[(r * group + g) * stride + from], pos[t0 + r] + 1 - from);
        }
        for (int64_t r = 0; r < rows; r++)
          for (int64_t i = 0; i < group * hd; i++) obase[(t0 + r) * ldo + kh * group * hd + i] = 0;
        prefetch_block(v_cache, p_first);
        prefetch_block(v_cache, p_first + 8);
        for (int64_t p0 = p_first; p0 < len_max; p0 += 8) {
          prefetch_block(v_cache, p0 + 16);
          for (int j = 0; j < 8; j++) {
            const T* v = at(v_cache, p0 + j);
            for (int64_t i = 0; i < hd; i += 8) _mm256_store_ps(buf + j * hd + i, kv_load8(v, i));
          }
          for (int64_t r = 0; r < rows; r++) {
            const int64_t n = pos[t0 + r] + 1 - p0 < 8 ? pos[t0 + r] + 1 - p0 : 8;
            const int64_t j0 = first(pos[t0 + r]) - p0 > 0 ? first(pos[t0 + r]) - p0 : 0;
            for (int64_t g = 0; g < group && n > j0; g++) {
              const float* c = &sc[(r * group + g) * stride + p0];
              float* o = obase + (t0 + r) * ldo + (kh * group + g) * hd;
              // NOTE: 64 outputs at a time in eight accumulators, a position's weight broadcast
              // once: one accumulator per 8 outputs made each a chain of dependent FMAs (the
              // values' products were 3/4 of the attention's time). Each output still sums its
              // positions in order, so the result is the same.
              int64_t i = 0;
              for (; i + 64 <= hd; i += 64) {
                __m256 acc[8];
                for (int u = 0; u < 8; u++) acc[u] = _mm256_loadu_ps(o + i + 8 * u);
                for (int64_t j = j0; j < n; j++) {
                  const __m256 cj = _mm256_set1_ps(c[j]);
                  for (int u = 0; u < 8; u++)
                    acc[u] = _mm256_fmadd_ps(cj, _mm256_load_ps(buf + j * hd + i + 8 * u), acc[u]);
                }
                for (int u = 0; u < 8; u++) _mm256_storeu_ps(o + i + 8 * u, acc[u]);
              }
              for (; i < hd; i += 8) {
                __m256 acc = _mm256_loadu_ps(o + i);
                for (int64_t j = j0; j < n; j++)
                  acc = _mm256_fmadd_ps(_mm256_set1_ps(c[j]), _mm256_load_ps(buf + j * hd + i), acc);
                _mm256_storeu_ps(o + i, acc);
              }
            }
          }
        }
        continue;
      }
#endif
      for (int64_t r = 0; r < rows; r++) {
        const int64_t len = pos[t0 + r] + 1, from = first(pos[t0 + r]);
        for (int64_t g = 0; g < group; g++) {
          const float* q = qbase + (t0 + r) * ldq + (kh * group + g) * hd;
          float* s_ = &sc[(r * group + g) * stride];
          for (int64_t p = from; p < len; p++) {
            s_[p] = dot_kv(q, at(k_cache, p), hd) * scale;
            if (softcap) s_[p] = tanhf(s_[p] / softcap) * softcap;
          }
          softmax(s_ + from, len - from);
          float* o = obase + (t0 + r) * ldo + (kh * group + g) * hd;
          for (int64_t i = 0; i < hd; i++) o[i] = 0;
          for (int64_t p = from; p < len; p++) axpy_kv(s_[p], at(v_cache, p), o, hd);
        }
      }
    }
  }
}

void rms_norm_row(const float* x, const float* weight, float eps, int64_t H, float* out) {
  float ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; i++) ss += x[i] * x[i];
  const float r = 1.0f / sqrtf(ss / H + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; i++) out[i] = weight[i] * (x[i] * r);
}

// Half-split (Hugging Face) rotary embedding of the leading `rot` dims of `heads` heads of `hd`
// in place (rot < hd: partial rotary, the other dims pass); cos, sin [rot / 2].
void rope(float* v, int64_t heads, int64_t hd, int64_t rot, const float* cos, const float* sin) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; h++) {
    float* x = v + h * hd;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + half] = b * cos[i] + a * sin[i];
    }
  }
}
}  // namespace

extern "C" {

// out[t, :] = row ids[t] of W (`rows` rows of GGUF blocks, or repacked groups of `columns`) as
// float32; every id must be a row.
int ft_dequantize_rows(int type, const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t columns, int64_t K,
                       const int64_t* ids, int64_t T, float* out) {
  return guarded("ft_dequantize_rows", [&] {
    check_weight("weight", type, rows, row_bytes, columns, K);
    FT_REQUIRE(T >= 0, "%lld ids", (long long)T);
    for (int64_t t = 0; t < T; t++)
      FT_REQUIRE(ids[t] >= 0 && ids[t] < rows, "id %lld is not one of the %lld rows", (long long)ids[t],
                 (long long)rows);
    for (int64_t t = 0; t < T; t++) {
      if (!columns) {
        dequant_row(type, w + ids[t] * row_bytes, K, out + t * K);
        continue;
      }
      const int64_t be = block_elems(type), nb = K / be, g = ids[t] / columns;
      const int c = (int)(ids[t] % columns);
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* gb = w + (g * nb + b) * repacked_bytes(type);
        for (int k = 0; k < be; k++) out[t * K + b * be + k] = repacked_at(type, gb, c, k);
      }
    }
  });
}

// out[t, :] = rms_norm(x[t, :]) * weight, weight of `weight_len` == H elements.
int ft_rms_norm(const float* x, int64_t T, int64_t H, int64_t ldx, const float* weight, int64_t weight_len,
                float eps, float* out) {
  return guarded("ft_rms_norm", [&] {
    FT_REQUIRE(H > 0 && weight_len == H, "a norm of %lld elements for rows of %lld", (long long)weight_len,
               (long long)H);
    FT_REQUIRE(T >= 0 && (T <= 1 || ldx >= H), "%lld rows of stride %lld", (long long)T, (long long)ldx);
    for (int64_t t = 0; t < T; t++) rms_norm_row(x + t * ldx, weight, eps, H, out + t * H);
  });
}

}  // extern "C"

// One decoder layer's constant parts, built once per layer at load (`kernels.LayerArgs` mirrors
// it field by field; `quantized_llama._Layer` fills it). ft_decoder_layer checks every size
// against the others before it reads a pointer. A field added for a family goes at the end, its
// zero / null value meaning "as Llama", and into FT_LAYER_FIELDS (ft_struct_layout: the test
// that checks the mirror's every offset).
struct LayerArgs {
  int64_t hidden, heads, kv_heads, head_dim, inter;  // H, nh, nkvh, hd, ffn width
  float eps;                                          // every RMSNorm's epsilon
  const float* norm1;                                 // [norm1_len == H] before attention
  int64_t norm1_len;
  const float* norm2;  // [norm2_len == H] before the MLP
  int64_t norm2_len;
  Weight w[7];         // q, k, v, o, gate, up, down
  const float* bias;   // [bias_len == q + 2 kv] q|k|v, or null
  int64_t bias_len;
  const float* q_norm;  // [qk_norm_len == hd] RMSNorm over every q head before the rotary (Qwen3),
  const float* k_norm;  // and k's; both null or both set
  int64_t qk_norm_len;
  // Gemma 2/3 and sliding windows (zero / null: as Llama)
  const float* attn_out_norm;  // [post_norm_len == H] RMSNorm of the attention's output (Gemma),
  const float* mlp_out_norm;   // and of the MLP's, before their residuals; both null or both set
  int64_t post_norm_len;
  int64_t gelu;         // 1: GeGLU (gelu, tanh approximation) instead of SwiGLU
  float query_scale;    // the scores' scale; 0: 1 / sqrt(head_dim)
  float attn_softcap;   // scores as tanh(s / cap) * cap before the softmax (Gemma 2); 0: none
  int64_t window;       // a row attends its last `window` positions only (sliding window); 0: all
  // mixture of experts: nonzero stops the layer after the attention residual (x += o_proj(attn));
  // the caller runs norm2 and the routed experts. w[4..6] and inter are then unused (0).
  int64_t attention_only;
  // OLMoE: nonzero makes q_norm one RMSNorm over the whole q projection (qk_norm_len == nh * hd)
  // and k_norm one over the whole k (k_norm_len == nkvh * hd), not one per head.
  int64_t qk_norm_whole;
  int64_t k_norm_len;
  // Phi-3 / SmolLM3 / Granite
  int64_t rotary_dim;    // the leading dims of each head the rotary turns (0: head_dim), even
  int64_t no_rope;       // 1: this layer skips the rotary (SmolLM3's NoPE layers)
  float residual_scale;  // each branch times this before its residual add (0: 1)
  float attn_scale;      // the softmax scale (0: 1 / sqrt(head_dim))
};

// One step's rows and where they go, the same for every layer of the step (`kernels.StepArgs`).
// Row t is position pos[t] of sequence seq[t]; its keys and values are written at slot_of[t],
// then it attends every position 0..pos[t] of its sequence, found through
// block_tables[seq[t] * max_pages + p / page_size] * page_size + p % page_size. So decode rows
// and causal prefill chunks are the same loop. The caches passed with it hold num_slots slots
// of kv_slot_bytes (kv_heads * head_dim elements of kv_type) each.
struct StepArgs {
  int64_t rows;  // T
  const int64_t* slot_of;
  const int64_t* seq;
  int64_t num_seqs;
  const int64_t* pos;
  const int32_t* block_tables;  // [num_seqs, max_pages]
  int64_t max_pages, page_size;
  int64_t num_slots, kv_slot_bytes;
  int64_t kv_type;  // KV_F32, KV_F16, KV_BF16, KV_Q8_0
  int64_t threads;
};

namespace {
// One pre-norm Llama decoder layer over the step's T new tokens, x [T, H] updated in place.
// cos, sin: [T, rotary_dim / 2]. Caches: this layer's, of the step's KV type.
template <class KT>
void decoder_layer(const LayerArgs& L, const StepArgs& S, float* x, const float* cos, const float* sin, KT* k_cache,
                   KT* v_cache) {
  const int64_t T = S.rows, H = L.hidden, nh = L.heads, nkvh = L.kv_heads, hd = L.head_dim, inter = L.inter;
  const float eps = L.eps;
  const float *norm1 = L.norm1, *norm2 = L.norm2, *bias = L.bias, *q_norm = L.q_norm, *k_norm = L.k_norm;
  const Weight* w = L.w;
  const int64_t *slot_of = S.slot_of, *seq = S.seq, *pos = S.pos;
  const int32_t* block_tables = S.block_tables;
  const int64_t max_pages = S.max_pages, page_size = S.page_size;
  const int threads = S.threads;
  const int64_t qsz = nh * hd, kvsz = nkvh * hd, qkv_w = qsz + 2 * kvsz;
  const int64_t rot = L.rotary_dim ? L.rotary_dim : hd;
  const float q_scale = L.attn_scale ? L.attn_scale * sqrtf((float)hd) : 1.0f;
  const float res = L.residual_scale ? L.residual_scale : 1.0f;
  std::vector<float> h(T * H), qkv(T * qkv_w), attn(T * qsz), gu(T * 2 * inter);
  const int64_t k_max = H > qsz ? (H > inter ? H : inter) : (qsz > inter ? qsz : inter);
  QAct act(T, k_max);
  AttendScratch scratch(T, seq, pos, nh / nkvh, threads);
#pragma omp parallel num_threads(threads)
  {
    // attention block
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) rms_norm_row(x + t * H, norm1, eps, H, h.data() + t * H);
    act.set_team(h.data(), T, H, H);
    gemm_team(w[0], act, qkv.data(), qkv_w, false);
    gemm_team(w[1], act, qkv.data() + qsz, qkv_w, false);
    gemm_team(w[2], act, qkv.data() + qsz + kvsz, qkv_w);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      float* row = qkv.data() + t * qkv_w;
      if (bias)
        for (int64_t i = 0; i < qkv_w; i++) row[i] += bias[i];
      if (q_norm && L.qk_norm_whole) {
        rms_norm_row(row, q_norm, eps, qsz, row);
        rms_norm_row(row + qsz, k_norm, eps, kvsz, row + qsz);
      } else if (q_norm) {
        for (int64_t j = 0; j < nh; j++) rms_norm_row(row + j * hd, q_norm, eps, hd, row + j * hd);
        for (int64_t j = 0; j < nkvh; j++) rms_norm_row(row + qsz + j * hd, k_norm, eps, hd, row + qsz + j * hd);
      }
      if (!L.no_rope) {
        rope(row, nh, hd, rot, cos + t * (rot / 2), sin + t * (rot / 2));
        rope(row + qsz, nkvh, hd, rot, cos + t * (rot / 2), sin + t * (rot / 2));
      }
      if (q_scale != 1.0f)  // Granite's softmax scale, as a scale of q (attention divides by sqrt(hd))
        for (int64_t i = 0; i < qsz; i++) row[i] *= q_scale;
      kv_store(row + qsz, kvsz, k_cache + slot_of[t] * kvsz / kv_per<KT>);
      kv_store(row + qsz + kvsz, kvsz, v_cache + slot_of[t] * kvsz / kv_per<KT>);
    }
    attend_team(qkv.data(), qkv_w, k_cache, v_cache, T, seq, pos, block_tables, max_pages, page_size, nh, nkvh,
                hd, attn.data(), qsz, scratch, L.query_scale, L.attn_softcap, L.window);
    act.set_team(attn.data(), T, qsz, qsz);
    gemm_team(w[3], act, h.data(), H);  // h = o_proj(attn)
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      if (L.attn_out_norm) rms_norm_row(h.data() + t * H, L.attn_out_norm, eps, H, h.data() + t * H);
      for (int64_t i = 0; i < H; i++) x[t * H + i] += res * h[t * H + i];
      if (!L.attention_only) rms_norm_row(x + t * H, norm2, eps, H, h.data() + t * H);
    }
    if (!L.attention_only) {  // (every thread takes the same branch)
    act.set_team(h.data(), T, H, H);
    gemm_team(w[4], act, gu.data(), 2 * inter, false);
    gemm_team(w[5], act, gu.data() + inter, 2 * inter);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      float* g = gu.data() + t * 2 * inter;
      if (L.gelu) {  // GeGLU: gelu(g) with the tanh approximation, as torch's approximate="tanh"
        for (int64_t i = 0; i < inter; i++)
          g[i] = 0.5f * g[i] * (1.0f + tanhf(0.7978845608028654f * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) *
                 g[i + inter];
        continue;
      }
#pragma omp simd
      for (int64_t i = 0; i < inter; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * g[i + inter];
    }
    act.set_team(gu.data(), T, inter, 2 * inter);
    gemm_team(w[6], act, h.data(), H);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      if (L.mlp_out_norm) rms_norm_row(h.data() + t * H, L.mlp_out_norm, eps, H, h.data() + t * H);
      for (int64_t i = 0; i < H; i++) x[t * H + i] += res * h[t * H + i];
    }
    }  // (not attention_only)
  }
}

// The indices of a step: T rows of S sequences, each row's position within its table of
// max_pages pages of page_size slots, every page (and written slot) within num_slots.
void check_step(int64_t T, const int64_t* slot_of, const int64_t* seq, const int64_t* pos, int64_t num_seqs,
                const int32_t* block_tables, int64_t max_pages, int64_t page_size, int64_t num_slots) {
  FT_REQUIRE(T >= 0 && num_seqs >= 0, "%lld rows of %lld sequences", (long long)T, (long long)num_seqs);
  FT_REQUIRE(page_size >= 1 && max_pages >= 1 && num_slots >= 0, "pages of %lld slots, %lld per sequence",
             (long long)page_size, (long long)max_pages);
  std::vector<int64_t> len(num_seqs, 0);  // positions each sequence attends
  for (int64_t t = 0; t < T; t++) {
    FT_REQUIRE(seq[t] >= 0 && seq[t] < num_seqs, "row %lld: sequence %lld of %lld", (long long)t,
               (long long)seq[t], (long long)num_seqs);
    FT_REQUIRE(pos[t] >= 0 && pos[t] < max_pages * page_size, "row %lld: position %lld past %lld pages of %lld",
               (long long)t, (long long)pos[t], (long long)max_pages, (long long)page_size);
    FT_REQUIRE(!slot_of || (slot_of[t] >= 0 && slot_of[t] < num_slots), "row %lld: slot %lld of %lld", (long long)t,
               (long long)slot_of[t], (long long)num_slots);
    len[seq[t]] = pos[t] + 1 > len[seq[t]] ? pos[t] + 1 : len[seq[t]];
  }
  for (int64_t q = 0; q < num_seqs; q++)
    for (int64_t p = 0; p < (len[q] + page_size - 1) / page_size; p++) {
      const int64_t page = block_tables[q * max_pages + p];
      FT_REQUIRE(page >= 0 && (page + 1) * page_size <= num_slots, "sequence %lld: page %lld of %lld slots",
                 (long long)q, (long long)page, (long long)num_slots);
    }
}

// The KV type, and the bytes of one slot of the caches (kvsz elements of it) against those of
// the buffers passed: q8_0 needs heads of a multiple of 32 (blocks never straddle two heads).
void check_kv(int kv_type, int64_t kvsz, int64_t hd, int64_t slot_bytes) {
  FT_REQUIRE(kv_type >= KV_F32 && kv_type <= KV_Q8_0, "KV type %d", kv_type);
  FT_REQUIRE(kv_type != KV_Q8_0 || hd % QK == 0, "q8_0 KV needs heads of a multiple of %d, not %lld", QK,
             (long long)hd);
  const int64_t expected = kv_type == KV_Q8_0 ? kvsz / QK * (int64_t)sizeof(kv_q8_t)
                           : kv_type == KV_F32 ? kvsz * 4
                                               : kvsz * 2;
  FT_REQUIRE(slot_bytes == expected, "KV slots of %lld bytes for %lld elements of type %d (%lld bytes)",
             (long long)slot_bytes, (long long)kvsz, kv_type, (long long)expected);
}

// The heads: nh query heads in groups over nkvh kv heads of hd (even: rotary pairs).
void check_heads(int64_t nh, int64_t nkvh, int64_t hd) {
  FT_REQUIRE(nh >= 1 && nkvh >= 1 && nh % nkvh == 0, "%lld heads over %lld kv heads", (long long)nh,
             (long long)nkvh);
  FT_REQUIRE(hd >= 2 && hd % 2 == 0 && nh * hd <= MAX_K, "heads of %lld", (long long)hd);
}

}  // namespace

extern "C" {

// Paged attention alone (the tests check it against torch): q [T, nh * hd] -> out [T, nh * hd]
// over caches of `kv_type` of num_slots slots of slot_bytes (nkvh * hd elements) each;
// indices as for ft_decoder_layer.
int ft_attention(const float* q, int64_t T, const void* k_cache, const void* v_cache, int64_t num_slots,
                 int64_t slot_bytes,
                 const int64_t* seq, int64_t num_seqs, const int64_t* pos, const int32_t* block_tables,
                 int64_t max_pages, int64_t page_size, int64_t nh, int64_t nkvh, int64_t hd, float* out,
                 int kv_type) {
  return guarded("ft_attention", [&] {
    check_heads(nh, nkvh, hd);
    check_kv(kv_type, nkvh * hd, hd, slot_bytes);
    check_step(T, nullptr, seq, pos, num_seqs, block_tables, max_pages, page_size, num_slots);
    AttendScratch scratch(T, seq, pos, nh / nkvh, 1);
    auto run = [&](auto* kc, auto* vc) {
#pragma omp parallel num_threads(1)
      {
        attend_team(q, nh * hd, kc, vc, T, seq, pos, block_tables, max_pages, page_size, nh, nkvh, hd, out, nh * hd,
                    scratch);
      }
    };
    switch (kv_type) {
      case KV_F32: run((const float*)k_cache, (const float*)v_cache); break;
      case KV_F16: run((const half_t*)k_cache, (const half_t*)v_cache); break;
      case KV_BF16: run((const bfloat_t*)k_cache, (const bfloat_t*)v_cache); break;
      case KV_Q8_0: run((const kv_q8_t*)k_cache, (const kv_q8_t*)v_cache); break;
    }
  });
}

// decoder_layer of the layer `L` over the step `S`: x [S.rows, x_width == L.hidden], cos, sin
// [S.rows, rope_width == (rotary_dim or head_dim) / 2], and this layer's caches. Every size is an argument and
// checked against the others: the norms hold H floats, the bias (or null) q + 2 kv, the q and k
// head norms (both null, or both qk_norm_len == hd floats) one head, and w[] (q, k, v, o, gate,
// up, down) have the rows and row bytes of [nh * hd, H], [nkvh * hd, H] twice, [H, nh * hd],
// [inter, H] twice and [H, inter].
int ft_decoder_layer(const LayerArgs* layer, const StepArgs* step, float* x, int64_t x_width, const float* cos,
                     const float* sin, int64_t rope_width, void* k_cache, void* v_cache) {
  return guarded("ft_decoder_layer", [&] {
    FT_REQUIRE(layer && step, "no layer or step arguments");
    const LayerArgs& L = *layer;
    const StepArgs& S = *step;
    const int64_t H = L.hidden, nh = L.heads, nkvh = L.kv_heads, hd = L.head_dim, inter = L.inter;
    check_heads(nh, nkvh, hd);
    FT_REQUIRE(H >= 1 && H <= MAX_K && (L.attention_only ? inter == 0 : inter >= 1 && inter <= MAX_K),
               "hidden %lld, ffn %lld (attention only: %lld)", (long long)H, (long long)inter,
               (long long)L.attention_only);
    FT_REQUIRE(x_width == H, "rows of %lld for hidden %lld", (long long)x_width, (long long)H);
    FT_REQUIRE(L.norm1 && L.norm2 && L.norm1_len == H && L.norm2_len == H,
               "norms of %lld and %lld elements for hidden %lld", (long long)L.norm1_len, (long long)L.norm2_len,
               (long long)H);
    const int64_t qsz = nh * hd, kvsz = nkvh * hd;
    FT_REQUIRE(!L.bias || L.bias_len == qsz + 2 * kvsz, "a q|k|v bias of %lld, expected %lld",
               (long long)L.bias_len, (long long)(qsz + 2 * kvsz));
    FT_REQUIRE(!L.q_norm == !L.k_norm && (!L.q_norm || L.qk_norm_whole || L.qk_norm_len == hd),
               "q/k head norms of %lld for heads of %lld", (long long)L.qk_norm_len, (long long)hd);
    FT_REQUIRE(!L.attn_out_norm == !L.mlp_out_norm && (!L.attn_out_norm || L.post_norm_len == H),
               "output norms of %lld for hidden %lld (both or neither)", (long long)L.post_norm_len, (long long)H);
    FT_REQUIRE(L.gelu == 0 || L.gelu == 1, "activation %lld (0 SwiGLU, 1 GeGLU)", (long long)L.gelu);
    FT_REQUIRE(std::isfinite(L.query_scale) && L.query_scale >= 0 && std::isfinite(L.attn_softcap) &&
                   L.attn_softcap >= 0 && L.window >= 0,
               "query scale %g, soft-cap %g, window %lld", (double)L.query_scale, (double)L.attn_softcap,
               (long long)L.window);
    FT_REQUIRE(!L.qk_norm_whole || (L.q_norm && L.qk_norm_len == qsz && L.k_norm_len == kvsz),
               "whole q/k norms of %lld and %lld for projections of %lld and %lld", (long long)L.qk_norm_len,
               (long long)L.k_norm_len, (long long)qsz, (long long)kvsz);
    static const char* names[7] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    const int64_t rows[7] = {qsz, kvsz, kvsz, H, inter, inter, H};
    const int64_t cols[7] = {H, H, H, qsz, H, H, inter};
    for (int i = 0; i < (L.attention_only ? 4 : 7); i++) {
      FT_REQUIRE(L.w[i].rows == rows[i], "%s: %lld rows, expected %lld", names[i], (long long)L.w[i].rows,
                 (long long)rows[i]);
      check_weight(names[i], L.w[i].type, L.w[i].rows, L.w[i].row_bytes, L.w[i].columns, cols[i]);
    }
    FT_REQUIRE(L.rotary_dim >= 0 && L.rotary_dim <= hd && L.rotary_dim % 2 == 0,
               "a rotary over %lld dims of heads of %lld", (long long)L.rotary_dim, (long long)hd);
    const int64_t rot = L.rotary_dim ? L.rotary_dim : hd;
    FT_REQUIRE(rope_width == rot / 2, "rotary tables of %lld for a rotary over %lld of heads of %lld",
               (long long)rope_width, (long long)rot, (long long)hd);
    FT_REQUIRE(L.no_rope == 0 || L.no_rope == 1, "no_rope %lld", (long long)L.no_rope);
    FT_REQUIRE(isfinite(L.residual_scale) && L.residual_scale >= 0 && isfinite(L.attn_scale) &&
                   L.attn_scale >= 0,
               "residual scale %g, attention scale %g", (double)L.residual_scale, (double)L.attn_scale);
    FT_REQUIRE(!(L.attn_scale && L.query_scale), "attention scale %g and query scale %g: at most one is set",
               (double)L.attn_scale, (double)L.query_scale);
    FT_REQUIRE(S.kv_type >= KV_F32 && S.kv_type <= KV_Q8_0, "KV type %lld", (long long)S.kv_type);
    check_kv((int)S.kv_type, kvsz, hd, S.kv_slot_bytes);
    FT_REQUIRE(S.threads >= 1 && S.threads <= 4096, "%lld threads", (long long)S.threads);
    check_step(S.rows, S.slot_of, S.seq, S.pos, S.num_seqs, S.block_tables, S.max_pages, S.page_size, S.num_slots);
    switch (S.kv_type) {
      case KV_F32: decoder_layer(L, S, x, cos, sin, (float*)k_cache, (float*)v_cache); break;
      case KV_F16: decoder_layer(L, S, x, cos, sin, (half_t*)k_cache, (half_t*)v_cache); break;
      case KV_BF16: decoder_layer(L, S, x, cos, sin, (bfloat_t*)k_cache, (bfloat_t*)v_cache); break;
      case KV_Q8_0: decoder_layer(L, S, x, cos, sin, (kv_q8_t*)k_cache, (kv_q8_t*)v_cache); break;
    }
  });
}

// The fields of the structs ctypes mirrors, in their order (a field added to a struct goes here too).
#define FT_WEIGHT_FIELDS(F) F(type) F(data) F(rows) F(row_bytes) F(columns)
#define FT_LAYER_FIELDS(F)                                                                                      \
  F(hidden) F(heads) F(kv_heads) F(head_dim) F(inter) F(eps) F(norm1) F(norm1_len) F(norm2) F(norm2_len) F(w)   \
  F(bias) F(bias_len) F(q_norm) F(k_norm) F(qk_norm_len) F(attn_out_norm) F(mlp_out_norm) F(post_norm_len)     \
  F(gelu) F(query_scale) F(attn_softcap) F(window) F(attention_only) F(qk_norm_whole) F(k_norm_len)            \
  F(rotary_dim) F(no_rope) F(residual_scale) F(attn_scale)
#define FT_STEP_FIELDS(F)                                                                                  \
  F(rows) F(slot_of) F(seq) F(num_seqs) F(pos) F(block_tables) F(max_pages) F(page_size) F(num_slots) \
  F(kv_slot_bytes) F(kv_type) F(threads)

// The layout of struct `which` (0 Weight, 1 LayerArgs, 2 StepArgs), for the test that checks
// kernels.py's mirrors against it: out[0] = sizeof, out[1 + i] = offsetof field i (at most cap
// entries written); returns the fields' names, comma-separated, or null for another `which`.
const char* ft_struct_layout(int which, int64_t* out, int64_t cap) {
  int64_t n = 0;
  auto put = [&](size_t v) {
    if (n < cap) out[n] = (int64_t)v;
    n++;
  };
#define FT_NAME(f) #f ","
#define FT_OFFSET(f) put(offsetof(S, f));
  switch (which) {
    case 0: {
      using S = Weight;
      put(sizeof(S));
      FT_WEIGHT_FIELDS(FT_OFFSET)
      return FT_WEIGHT_FIELDS(FT_NAME);
    }
    case 1: {
      using S = LayerArgs;
      put(sizeof(S));
      FT_LAYER_FIELDS(FT_OFFSET)
      return FT_LAYER_FIELDS(FT_NAME);
    }
    case 2: {
      using S = StepArgs;
      put(sizeof(S));
      FT_STEP_FIELDS(FT_OFFSET)
      return FT_STEP_FIELDS(FT_NAME);
    }
    default: return nullptr;
  }
#undef FT_NAME
#undef FT_OFFSET
}

}  // extern "C"
