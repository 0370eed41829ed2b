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
//
// One translation unit (so the hot templates inline across parts); the parts by concern, in the
// order they build on each other:
#include "csrc/common.inc"          // headers, errors, block sizes, fp16, Act, AVX2 helpers
#include "csrc/formats.inc"         // GGUF type codes and block layouts
#include "csrc/rows.inc"            // row products: blocks of 32, F16 / BF16
#include "csrc/rows_k.inc"          // row products: K-quants and IQ4_XS
#include "csrc/dequantize.inc"      // weights as floats, per format
#include "csrc/columns.inc"         // repacked layouts: RC, interleaving, vector helpers
#include "csrc/columns_q4_q8.inc"   // column kernels: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K
#include "csrc/columns_q5_iq4.inc"  // column kernels: Q5_K, IQ4_XS, IQ4_NL, Q5_0, Q5_1
#include "csrc/columns_q2_q3.inc"   // column kernels: Q3_K, Q2_K
#include "csrc/columns_float.inc"   // column kernels: F16, BF16
#include "csrc/traits.inc"          // one row per type: block sizes and kernels (no switch on a type)
#include "csrc/gemm.inc"            // weight checks, quantized activations, the product loops
#include "csrc/attention.inc"       // paged attention, KV types (q8_0 included)
#include "csrc/layer.inc"           // LayerArgs, StepArgs, the fused decoder layer

// ==== The exported entry points ====
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
    const TypeTraits& ty = type_traits(type);
    std::vector<int32_t> x16(columns && ty.cols.sums16 ? M * (K / 16) : 0);
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < (int64_t)x16.size() / (K / 16); m++) sums16_row(qs + m * K, K, &x16[m * (K / 16)]);
    const ActRows a{qs, d, s, sx, K, x16.empty() ? nullptr : x16.data()};
    if (columns) {
      const int64_t group_bytes = K / ty.block_elems * ty.group_bytes();
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
  const TypeTraits& ty = type_traits(type);
  if (!RC || !ty.repackable() || K <= 0 || K % ty.block_elems) return 0;
  return K / ty.block_elems * ty.cols.col_bytes;
}

// src: N rows of GGUF blocks of a repackable type (one whose row in traits.inc has a repacked
// layout), N % RC == 0 -> dst in that layout (N * ft_repacked_row_bytes(type, K) bytes).
int ft_repack(int type, const uint8_t* src, int64_t N, int64_t K, int64_t row_bytes, uint8_t* dst) {
  return guarded("ft_repack", [&] {
    const TypeTraits& ty = type_traits(type);
    FT_REQUIRE(RC && ty.repackable(), "type %d cannot be repacked on this build", type);
    check_weight("weight", type, N, row_bytes, 0, K);
    constexpr int64_t group = RC ? RC : 1;  // (no division by a zero RC where it compiles away)
    FT_REQUIRE(N % group == 0, "%lld rows are not whole groups of %d", (long long)N, RC);
    const int64_t nb = K / ty.block_elems, gbytes = ty.group_bytes(), bytes = ty.block_bytes;
    for (int64_t g = 0; g < N / group; g++)
      for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < RC; c++)
          ty.cols.repack(src + (g * RC + c) * row_bytes + b * bytes, dst + (g * nb + b) * gbytes, c);
  });
}

// out[t, :] = row ids[t] of W (`rows` rows of GGUF blocks, or repacked groups of `columns`) as
// float32; every id must be a row.
int ft_dequantize_rows(int type, const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t columns, int64_t K,
                       const int64_t* ids, int64_t T, float* out) {
  return guarded("ft_dequantize_rows", [&] {
    check_weight("weight", type, rows, row_bytes, columns, K);
    const TypeTraits& ty = type_traits(type);
    FT_REQUIRE(T >= 0, "%lld ids", (long long)T);
    for (int64_t t = 0; t < T; t++)
      FT_REQUIRE(ids[t] >= 0 && ids[t] < rows, "id %lld is not one of the %lld rows", (long long)ids[t],
                 (long long)rows);
    for (int64_t t = 0; t < T; t++) {
      if (!columns) {
        ty.dequantize(w + ids[t] * row_bytes, K, out + t * K);
        continue;
      }
      const int64_t be = ty.block_elems, nb = K / be, g = ids[t] / columns;
      const int c = (int)(ids[t] % columns);
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* gb = w + (g * nb + b) * ty.group_bytes();
        for (int k = 0; k < be; k++) out[t * K + b * be + k] = ty.cols.at(gb, c, k);
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
