// ggml's CPU mul_mat at one shape, for tools/bench_kernels.py: W [m, k] of a GGUF type (random
// normal weights quantized by ggml; in the CPU backend's repack buffer when it has one that takes
// this product, as llama.cpp loads a model), X [k, n] f32 (ggml quantizes it inside the product).
//
//     ggml_mul_mat TYPE M K N [THREADS [REPS]]  ->  one JSON line: microseconds per product
//
// Built by bench_kernels.py against the static ggml libraries of build-llama-server.sh.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include <algorithm>
int main(int argc, char** argv) {
  const char* tname = argv[1];
  const int64_t m = atoll(argv[2]), k = atoll(argv[3]), n = atoll(argv[4]);
  const int threads = argc > 5 ? atoi(argv[5]) : 2, reps = argc > 6 ? atoi(argv[6]) : 50;
  ggml_type type = GGML_TYPE_COUNT;
  for (int t = 0; t < GGML_TYPE_COUNT; t++) if (ggml_type_name((ggml_type)t) && !strcmp(ggml_type_name((ggml_type)t), tname)) type = (ggml_type)t;
  if (type == GGML_TYPE_COUNT) { fprintf(stderr, "type?\n"); return 1; }
  ggml_backend_reg_t reg = ggml_backend_cpu_reg();
  ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
  auto get_extra = (ggml_backend_buffer_type_t* (*)(ggml_backend_dev_t))ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
  ggml_backend_t be = ggml_backend_cpu_init();
  ggml_backend_cpu_set_n_threads(be, threads);
  ggml_init_params ip = {ggml_tensor_overhead() * 8, nullptr, true};
  ggml_context* cw = ggml_init(ip);
  ggml_tensor* W = ggml_new_tensor_2d(cw, type, k, m);
  // the first extra buffer type that takes this mul_mat (the repack one), else the plain CPU one
  ggml_context* cx = ggml_init(ip);
  ggml_tensor* X = ggml_new_tensor_2d(cx, GGML_TYPE_F32, k, n);
  ggml_context* cg = ggml_init({ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true});
  ggml_tensor* Y = ggml_mul_mat(cg, W, X);
  const char* used = "CPU";
  ggml_backend_buffer_type_t buft = ggml_backend_cpu_buffer_type();
  if (get_extra && !getenv("NOREPACK"))
    for (ggml_backend_buffer_type_t* b = get_extra(dev); b && *b; b++) {
      ggml_backend_buffer_t probe = ggml_backend_buft_alloc_buffer(*b, ggml_nbytes(W) + 4096);
      W->buffer = probe;  // (supports_op asks the weight's buffer type)
      if (ggml_backend_dev_supports_op(dev, Y)) { buft = *b; used = ggml_backend_buft_name(*b); }
      W->buffer = nullptr;
      ggml_backend_buffer_free(probe);
      if (buft != ggml_backend_cpu_buffer_type()) break;
    }
  ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, buft);
  ggml_backend_buffer_t bx = ggml_backend_alloc_ctx_tensors_from_buft(cx, ggml_backend_cpu_buffer_type());
  std::mt19937 rng(1); std::normal_distribution<float> nd;
  std::vector<float> wf(m * k); for (auto& v : wf) v = nd(rng);
  std::vector<uint8_t> wq(ggml_row_size(type, k) * m);
  ggml_quantize_chunk(type, wf.data(), wq.data(), 0, m, k, nullptr);
  ggml_backend_tensor_set(W, wq.data(), 0, wq.size());
  std::vector<float> xf(k * n); for (auto& v : xf) v = nd(rng);
  ggml_backend_tensor_set(X, xf.data(), 0, xf.size() * 4);
  ggml_cgraph* gf = ggml_new_graph(cg);
  ggml_build_forward_expand(gf, Y);
  ggml_gallocr_t ga = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
  ggml_gallocr_alloc_graph(ga, gf);
  for (int i = 0; i < 3; i++) ggml_backend_graph_compute(be, gf);
  std::vector<double> ts;
  for (int i = 0; i < reps; i++) {
    auto t0 = std::chrono::steady_clock::now();
    ggml_backend_graph_compute(be, gf);
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  printf("{\"type\": \"%s\", \"m\": %lld, \"k\": %lld, \"n\": %lld, \"buffer\": \"%s\", \"us_min\": %.1f, \"us_median\": %.1f}\n", tname, (long long)m, (long long)k, (long long)n, used, ts[0] * 1e6, ts[ts.size() / 2] * 1e6);
  return 0;
}
