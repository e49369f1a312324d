// A whole decode step's decoder layers in one native call (see models/fused_decode.py, which builds it).
//
// Compiled after cpu_kernels.cpp and cpu_gemv.cpp in the same translation unit (cpu_kernels.py joins the
// sources), so it calls those kernels and DenseLinearMethod's product (dense_linear) directly. Each layer runs exactly the ops the Python path runs, in its order, on
// the same kernels and the same oneDNN products: the same bits, without a Python frame or a dispatch per
// op. The weights are handed over once, when the model is loaded. A quantized projection (set_products) is its
// layer's native products, called through the dispatcher as the Python method calls them, their outputs side by
// side: the kernel class dispatch chose may be another library than this one.
// ATen/ATen.h: cpu_prelude.h
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>

#include <optional>

namespace {

// One native product: op(x, *args, rows[, wide]) (quantization.NativeProduct); the wide product through
// wide_op where it has one (op is then another class's, chosen for few rows).
struct Product {
  c10::OperatorHandle op;
  std::vector<at::Tensor> args;
  int64_t rows;
  bool takes_wide;
  std::optional<c10::OperatorHandle> wide_op;
};

// A quantized projection: its products stacked by rows; wide (the wide bf16 product) from wide_rows bf16 rows.
struct Products {
  std::vector<Product> runs;
  bool wide;
  int64_t wide_rows;
};

// One Llama-form decoder stack: per layer the input norm, stacked qkv, rotary, the KV write, paged decode
// attention, o_proj, the post-attention norm, stacked gate/up, SiLU * up and down_proj.
struct DecodeStep : torch::CustomClassHolder {
  // Per layer: in_norm, qkv, qkv bias, o, o bias, post_norm, gate_up, down (a bias of no elements: none).
  static constexpr int64_t kPerLayer = 8;
  std::vector<at::Tensor> weights;
  std::vector<int64_t> window_of;  // per layer: its index into a step's first_keys
  int64_t heads, kv_heads, dim;
  double eps, scale;
  std::vector<at::Tensor> k_blocks, v_cache;
  std::vector<std::optional<Products>> products;  // per layer, per projection (qkv, o, gate_up, down): quantized

  DecodeStep(std::vector<at::Tensor> weights_, std::vector<int64_t> window_of_, int64_t heads_, int64_t kv_heads_,
             int64_t dim_, double eps_, double scale_)
      : weights(std::move(weights_)), window_of(std::move(window_of_)), heads(heads_), kv_heads(kv_heads_), dim(dim_),
        eps(eps_), scale(scale_) {
    TORCH_CHECK(weights.size() == window_of.size() * kPerLayer, "weights: ", kPerLayer, " per layer");
    products.resize(window_of.size() * kProjections);
  }

  static constexpr int64_t kProjections = 4;

  // Make projection `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer` a row-stacking of native products:
  // ops[i] (a schema name) takes counts[i] of args, in order, and rows[i]; takes_wide[i] != 0 where it takes the
  // wide flag too, and wide_ops[i] (a schema name, or empty) runs its wide product where the op is not the
  // process's. Its dense weight slot is then unused.
  void set_products(int64_t layer, int64_t which, std::vector<std::string> ops, std::vector<int64_t> counts,
                    std::vector<at::Tensor> args, std::vector<int64_t> rows, std::vector<int64_t> takes_wide,
                    std::vector<std::string> wide_ops, bool wide, int64_t wide_rows) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(window_of.size()) && which >= 0 && which < kProjections,
                "no projection ", which, " of layer ", layer);
    TORCH_CHECK(!ops.empty() && counts.size() == ops.size() && rows.size() == ops.size() && takes_wide.size() == ops.size() &&
                    wide_ops.size() == ops.size(),
                "one count, row count, wide flag and wide op per op");
    Products p{{}, wide, wide_rows};
    size_t next = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      TORCH_CHECK(counts[i] >= 0 && next + counts[i] <= args.size(), "the ops' counts overrun their args");
      std::vector<at::Tensor> mine(args.begin() + next, args.begin() + next + counts[i]);
      next += counts[i];
      std::optional<c10::OperatorHandle> wide_op;
      if (!wide_ops[i].empty()) wide_op = c10::Dispatcher::singleton().findSchemaOrThrow(wide_ops[i].c_str(), "");
      p.runs.push_back({c10::Dispatcher::singleton().findSchemaOrThrow(ops[i].c_str(), ""), std::move(mine), rows[i],
                        takes_wide[i] != 0, std::move(wide_op)});
    }
    TORCH_CHECK(next == args.size(), "args left over after the ops' counts");
    products[layer * kProjections + which] = std::move(p);
  }

  // Projection `which` of layer l over x: its quantized products (as the Python method runs them: x as it is,
  // outputs side by side, then the bias), else the dense product of its weight.
  at::Tensor project(int64_t l, int64_t which, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
    const std::optional<Products>& p = products[l * kProjections + which];
    if (!p) return dense_linear(x, w, b);
    const bool wide = p->wide && x.scalar_type() == at::kBFloat16 && x.size(0) >= p->wide_rows;
    std::vector<at::Tensor> ys;
    ys.reserve(p->runs.size());
    torch::jit::Stack stack;
    for (const Product& r : p->runs) {
      stack.clear();
      stack.emplace_back(x);
      for (const at::Tensor& t : r.args) stack.emplace_back(t);
      stack.emplace_back(r.rows);
      if (r.takes_wide) stack.emplace_back(wide);
      (wide && r.wide_op ? *r.wide_op : r.op).callBoxed(&stack);
      ys.push_back(stack[0].toTensor());
    }
    at::Tensor y = ys.size() == 1 ? ys[0] : at::cat(ys, 1);
    if (b) y.add_(*b);
    return y;
  }

  // The KV cache's per-layer tensors (keys head-dim-major), bound once per cache.
  void bind_cache(std::vector<at::Tensor> k, std::vector<at::Tensor> v) {
    TORCH_CHECK(k.size() == window_of.size() && v.size() == window_of.size(), "one key and one value tensor per layer");
    k_blocks = std::move(k);
    v_cache = std::move(v);
  }

  // h [R, hidden] (the embeddings; the residual stream, updated in place): returns the last layer's output,
  // still to be added to h. One token per row; slots, block_tables, seq_lens and first_keys as the native
  // attention takes them.
  at::Tensor run(at::Tensor h, const at::Tensor& table, const at::Tensor& positions, const at::Tensor& slots,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, std::vector<at::Tensor> first_keys) {
    TORCH_CHECK(k_blocks.size() == window_of.size(), "bind_cache first");
    const int64_t rows = h.size(0), q_size = heads * dim, kv_size = kv_heads * dim;
    const int64_t layers = static_cast<int64_t>(window_of.size());
    at::Tensor attn = at::empty({rows, heads, dim}, h.options());
    std::optional<at::Tensor> delta;
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights.data() + l * kPerLayer;
      const std::optional<at::Tensor> qkv_b = w[2].numel() ? std::optional<at::Tensor>(w[2]) : std::nullopt;
      const std::optional<at::Tensor> o_b = w[4].numel() ? std::optional<at::Tensor>(w[4]) : std::nullopt;
      at::Tensor x = at::empty_like(h);
      rms_norm(h, delta, w[0], eps, x);
      at::Tensor qkv = project(l, 0, x, w[1], qkv_b);
      at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({rows, heads + kv_heads, dim});
      rotary(qk, table, positions);
      write_kv(qk.narrow(1, heads, kv_heads), qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, dim}),
               k_blocks[l], v_cache[l], slots);
      paged_decode(qk.narrow(1, 0, heads), k_blocks[l], v_cache[l], block_tables, seq_lens, first_keys[window_of[l]], scale, attn);
      at::Tensor o = project(l, 1, attn.view({rows, q_size}), w[3], o_b);
      x = at::empty_like(h);
      rms_norm(h, o, w[5], eps, x);
      at::Tensor gate_up = project(l, 2, x, w[6], std::nullopt);
      at::Tensor act = at::empty({rows, gate_up.size(1) / 2}, h.options());
      silu_mul(gate_up, act);
      delta = project(l, 3, act, w[7], std::nullopt);
    }
    return *delta;
  }
};

}  // namespace

METRALE_FRAGMENT(m) {
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, double, double>())
      .def("bind_cache", &DecodeStep::bind_cache)
      .def("set_products", &DecodeStep::set_products)
      .def("run", &DecodeStep::run);
}
