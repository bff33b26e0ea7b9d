// The torch engine's fused CPU decode, callable from C: a model read from mapped files, its KV caches, its
// steps and its sampler, with nothing of Python's torch (umakit/backends/torch/light.py loads it with ctypes).
//
// Every operation is the one the Python engine runs, in the same order and through the same ATen kernels
// (the embedding lookup of QuantizedEmbedding, RMSNorm's formula, Int4PackLinear's head, make_sampler's
// steps, the cache's growth), so a run here gives the engine's bits: the same tokens for the same seed.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "fused_decode.h"

namespace {

using at::Tensor;

thread_local std::string last_error;

constexpr int64_t GROW_STEP = 256;  // cache.py's
constexpr int64_t DENSE_ROWS = 32;  // quant.py's: the head's rows stay on the int4 kernel below it

at::ScalarType dtype_of(int code) {
  switch (code) {
    case 0: return at::kFloat;
    case 1: return at::kBFloat16;
    case 2: return at::kByte;
    case 3: return at::kHalf;
    case 4: return at::kInt;
    default: throw std::runtime_error("unknown dtype code " + std::to_string(code));
  }
}

struct Mapping {
  void* data = nullptr;
  size_t size = 0;
};

struct Model {
  std::vector<Mapping> maps;
  Tensor inv_freq, final_norm, head_packed, head_sz, embed_w, embed_scales, embed_biases;
  std::vector<Tensor> norms, qk_norms, packed, sz, biases;
  std::vector<int64_t> groups, splits;
  int64_t L, nh, nkv, hd, H, V, max_tokens, embed_bits, embed_group, head_group, head_split, window;
  double eps, scale;

  ~Model() {
    for (auto& m : maps)
      if (m.data) munmap(m.data, m.size);
  }
};

struct Cache {
  Tensor k, v;  // (L, 1, nkv, capacity, hd) float32
  int64_t offset = 0;
  Tensor logits;  // (rows, V) float32 of the last forward call that asked for them
};

// The cache's buffers, grown as StaticKVCache grows them (capacity a multiple of GROW_STEP, at most the context).
void allocate(const Model& m, Cache& c, int64_t capacity) {
  Tensor k = at::zeros({m.L, 1, m.nkv, capacity, m.hd}, at::kFloat);
  Tensor v = at::zeros_like(k);
  if (c.k.defined() && c.offset > 0) {
    k.narrow(3, 0, c.offset).copy_(c.k.narrow(3, 0, c.offset));
    v.narrow(3, 0, c.offset).copy_(c.v.narrow(3, 0, c.offset));
  }
  c.k = k;
  c.v = v;
}

void reserve(const Model& m, Cache& c, int64_t n) {
  const int64_t need = c.offset + n;
  if (need <= c.k.size(3)) return;
  if (need > m.max_tokens)
    throw std::runtime_error(std::to_string(need) + " tokens do not fit the model's context of " +
                             std::to_string(m.max_tokens));
  allocate(m, c, std::min((need + GROW_STEP - 1) / GROW_STEP * GROW_STEP, m.max_tokens));
}

// QuantizedEmbedding.forward (quant.dequantize of the looked-up rows), or a float table's rows.
Tensor embed(const Model& m, const Tensor& ids) {
  if (m.embed_bits == 0) return m.embed_w.index_select(0, ids).view({ids.size(0), 1, m.H});
  const Tensor b = m.embed_w.index_select(0, ids);  // (T, bytes): the uint32 words' little-endian bytes
  const Tensor scales = m.embed_scales.index_select(0, ids), biases = m.embed_biases.index_select(0, ids);
  const int64_t rows = scales.size(0), groups = scales.size(1), cols = groups * m.embed_group;
  Tensor q = m.embed_bits == 8 ? b.narrow(1, 0, cols)
                               : at::stack({b.bitwise_and(15), b.bitwise_right_shift(4)}, -1)
                                     .view({rows, -1})
                                     .narrow(1, 0, cols);
  Tensor out = q.reshape({rows, groups, m.embed_group}).to(at::kFloat);
  out.mul_(scales.to(at::kFloat).unsqueeze(-1)).add_(biases.to(at::kFloat).unsqueeze(-1));
  return out.view({rows, -1}).to(at::kFloat).view({rows, 1, m.H});
}

// Transformer._head: RMSNorm (float32 inside), then Int4PackLinear on the int4 kernel; (T, V) float32.
Tensor head(const Model& m, const Tensor& x) {
  const Tensor x32 = x.to(at::kFloat);
  Tensor y = m.final_norm * (x32 * at::rsqrt(x32.square().mean(-1, true) + m.eps)).to(x.scalar_type());
  Tensor rows = y.reshape({-1, m.H}).to(at::kBFloat16);
  if (rows.size(0) >= DENSE_ROWS) throw std::runtime_error("the head runs on fewer than 32 rows here");
  if (m.head_split) rows = at::cat({rows, rows}, -1);
  Tensor out = at::_weight_int4pack_mm_for_cpu(rows, m.head_packed, m.head_group, m.head_sz).to(at::kFloat);
  return out.view({-1, 1, m.V}).select(1, 0);
}

// make_sampler's steps (sampling.py), on logits (1, V).
int64_t sample(Tensor logits, const int64_t* recent, int64_t n_recent, double penalty, int greedy, double temperature,
               int64_t top_k, double top_p, double min_p, at::Generator& gen) {
  if (penalty != 1.0 && n_recent > 0) {
    Tensor ids = at::from_blob(const_cast<int64_t*>(recent), {1, n_recent}, at::kLong).clone();
    Tensor picked = logits.gather(-1, ids);
    picked = at::where(picked > 0, picked / penalty, picked * penalty);
    logits = logits.scatter(-1, ids, picked);
  }
  if (greedy) return logits.argmax(-1).item<int64_t>();
  const double neg_inf = -std::numeric_limits<double>::infinity();
  logits = logits.to(at::kFloat) / temperature;
  if (0 < top_k && top_k < logits.size(-1)) {
    Tensor kth = std::get<0>(logits.topk(top_k, -1)).narrow(-1, top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, neg_inf);
  }
  if (top_p < 1.0) {
    auto sorted = logits.sort(-1, true);
    Tensor sorted_logits = std::get<0>(sorted), order = std::get<1>(sorted);
    Tensor probs = sorted_logits.softmax(-1);
    Tensor before = probs.cumsum(-1) - probs;
    sorted_logits = sorted_logits.masked_fill(before >= top_p, neg_inf);
    logits = logits.scatter(-1, order, sorted_logits);
  }
  if (min_p > 0) {
    Tensor probs = logits.softmax(-1);
    Tensor threshold = min_p * probs.amax(-1, true);
    logits = logits.masked_fill(probs < threshold, neg_inf);
  }
  Tensor race = at::empty_like(logits).exponential_(1.0, gen);
  return (logits.softmax(-1) / race).argmax(-1).item<int64_t>();
}

template <typename F>
int guarded(F&& body) {
  try {
    c10::InferenceMode guard;
    body();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

}  // namespace

extern "C" {

const char* umakit_light_error() { return last_error.c_str(); }

// What torch's dispatcher picked for this CPU ("AVX512", "AVX2", "DEFAULT"): the int4 packing depends on it.
const char* umakit_light_cpu_capability() {
  static std::string capability;
  capability = at::get_cpu_capability();
  return capability.c_str();
}

// A model over `n` tensors, tensor i the bytes at offsets[i] of file file_of[i] (mapped read-only), of dtype
// dtypes[i] and shape shapes[4i .. 4i + ndims[i]). Their order, and that of `ints` and `floats`: light.py's
// `_arguments`. Returns NULL on error (umakit_light_error says why).
void* umakit_light_open(const char** paths, int n_files, int n, const int* file_of, const int64_t* offsets,
                        const int* dtypes, const int* ndims, const int64_t* shapes, const int64_t* ints,
                        const double* floats) {
  auto* m = new Model();
  const int status = guarded([&] {
    for (int f = 0; f < n_files; ++f) {
      const int fd = ::open(paths[f], O_RDONLY);
      if (fd < 0) throw std::runtime_error(std::string("cannot open ") + paths[f] + ": " + std::strerror(errno));
      struct stat st;
      if (fstat(fd, &st) != 0) {
        ::close(fd);
        throw std::runtime_error(std::string("cannot stat ") + paths[f]);
      }
      void* data = mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
      ::close(fd);
      if (data == MAP_FAILED) throw std::runtime_error(std::string("cannot map ") + paths[f]);
      m->maps.push_back({data, static_cast<size_t>(st.st_size)});
    }
    std::vector<Tensor> t;
    for (int i = 0; i < n; ++i) {
      const Mapping& map = m->maps.at(file_of[i]);
      std::vector<int64_t> shape(shapes + 4 * i, shapes + 4 * i + ndims[i]);
      const at::ScalarType dt = dtype_of(dtypes[i]);
      int64_t bytes = c10::elementSize(dt);
      for (int64_t s : shape) bytes *= s;
      if (offsets[i] < 0 || static_cast<size_t>(offsets[i] + bytes) > map.size)
        throw std::runtime_error("tensor " + std::to_string(i) + " lies outside its file");
      t.push_back(at::from_blob(static_cast<char*>(map.data) + offsets[i], shape, at::TensorOptions().dtype(dt)));
    }
    int64_t k = 0;
    m->L = ints[k++], m->nh = ints[k++], m->nkv = ints[k++], m->hd = ints[k++], m->H = ints[k++];
    m->V = ints[k++], m->max_tokens = ints[k++], m->embed_bits = ints[k++], m->embed_group = ints[k++];
    m->head_group = ints[k++], m->head_split = ints[k++];
    const bool qk_norm = ints[k++], bias = ints[k++];
    m->window = ints[k++];
    m->groups.assign(ints + k, ints + k + 4 * m->L);
    m->splits.assign(ints + k + 4 * m->L, ints + k + 8 * m->L);
    m->eps = floats[0], m->scale = floats[1];
    size_t i = 0;
    m->inv_freq = t.at(i++), m->final_norm = t.at(i++), m->head_packed = t.at(i++), m->head_sz = t.at(i++);
    m->embed_w = t.at(i++);
    if (m->embed_bits) m->embed_scales = t.at(i++), m->embed_biases = t.at(i++);
    for (int64_t l = 0; l < m->L; ++l) {
      m->norms.push_back(t.at(i++));
      m->norms.push_back(t.at(i++));
      if (qk_norm) m->qk_norms.push_back(t.at(i++)), m->qk_norms.push_back(t.at(i++));
      for (int j = 0; j < 4; ++j) m->packed.push_back(t.at(i++));
      for (int j = 0; j < 4; ++j) m->sz.push_back(t.at(i++));
      if (bias) m->biases.push_back(t.at(i++));
    }
    if (i != t.size()) throw std::runtime_error("more tensors than the model takes");
  });
  if (status != 0) {
    delete m;
    return nullptr;
  }
  return m;
}

void umakit_light_close(void* model) { delete static_cast<Model*>(model); }

void* umakit_light_cache_new(void* model) {
  auto* c = new Cache();
  const Model& m = *static_cast<Model*>(model);
  if (guarded([&] { allocate(m, *c, std::min(GROW_STEP, m.max_tokens)); }) != 0) {
    delete c;
    return nullptr;
  }
  return c;
}

void umakit_light_cache_free(void* cache) { delete static_cast<Cache*>(cache); }

int64_t umakit_light_cache_offset(void* cache) { return static_cast<Cache*>(cache)->offset; }

void umakit_light_cache_set_offset(void* cache, int64_t offset) { static_cast<Cache*>(cache)->offset = offset; }

int64_t umakit_light_cache_capacity(void* cache) { return static_cast<Cache*>(cache)->k.size(3); }

// The K and V buffers, (L, 1, nkv, capacity, hd) float32, for a copy into the Python engine's cache.
void umakit_light_cache_buffers(void* cache, float** k, float** v) {
  auto* c = static_cast<Cache*>(cache);
  *k = c->k.data_ptr<float>();
  *v = c->v.data_ptr<float>();
}

// `n` tokens appended to the cache, each row as its own decode step computes it (FusedDecoder); with
// `logits`, the logits (n, V) of every row are kept for `umakit_light_logits` and `umakit_light_sample`.
int umakit_light_forward(void* model, void* cache, const int64_t* tokens, int64_t n, int logits) {
  Model& m = *static_cast<Model*>(model);
  Cache& c = *static_cast<Cache*>(cache);
  return guarded([&] {
    reserve(m, c, n);
    Tensor ids = at::from_blob(const_cast<int64_t*>(tokens), {n}, at::kLong).clone();
    std::vector<int64_t> positions(n), rows(n, 0);
    for (int64_t i = 0; i < n; ++i) positions[i] = c.offset + i;
    Tensor x = umakit::decode_layers(embed(m, ids), m.inv_freq, positions, rows, c.k, c.v, m.norms, m.qk_norms,
                                     m.packed, m.sz, m.groups, m.splits, m.biases, m.nh, m.nkv, m.hd, m.eps,
                                     m.scale, m.window);
    c.offset += n;
    c.logits = logits ? head(m, x).contiguous() : Tensor();
  });
}

// Copies the cache's kept logits (rows x V float32) into `out`.
int umakit_light_logits(void* cache, float* out) {
  const Cache& c = *static_cast<Cache*>(cache);
  return guarded([&] {
    if (!c.logits.defined()) throw std::runtime_error("no logits kept");
    std::memcpy(out, c.logits.data_ptr<float>(), c.logits.numel() * sizeof(float));
  });
}

void* umakit_light_generator(uint64_t seed) {
  auto* g = new at::Generator(at::make_generator<at::CPUGeneratorImpl>(seed));
  g->set_current_seed(seed);
  return g;
}

void umakit_light_generator_free(void* gen) { delete static_cast<at::Generator*>(gen); }

// The next token from the last row of the cache's kept logits, as make_sampler draws it; -1 on error.
int64_t umakit_light_sample(void* cache, void* gen, const int64_t* recent, int64_t n_recent, double penalty,
                            int greedy, double temperature, int64_t top_k, double top_p, double min_p) {
  const Cache& c = *static_cast<Cache*>(cache);
  int64_t token = -1;
  const int status = guarded([&] {
    if (!c.logits.defined()) throw std::runtime_error("no logits kept");
    Tensor last = c.logits.narrow(0, c.logits.size(0) - 1, 1);
    token = sample(last, recent, n_recent, penalty, greedy, temperature, top_k, top_p, min_p,
                   *static_cast<at::Generator*>(gen));
  });
  return status == 0 ? token : -1;
}

}  // extern "C"
