// Per-row log-prob / entropy statistics of a block of logits and their gradient, on CPU (ATen + OpenMP).
//
// A block is a [N, C] slice of (vocab-parallel) logits: one TP rank's shard, or one vocabulary chunk of an
// LM-head matmul. With z = logits / temperature over the block's first `valid` columns (the rest is vocab
// padding, i.e. -inf), the forward returns per row, in double (z too is computed in double):
//     m = max_j z_j,   S = sum_j exp(z_j - m),   zy = z_target (0 when the target is not in the block),
//     T = sum_j exp(z_j - m) (z_j - m)
// Blocks are combined in Python (hybridrl/ops/logprob.py): log Z = M + log S,
// log p(y) = zy - log Z, H = log S - T / S. The backward takes the combined log Z and H and writes
//     d/dz_j [g_lp log p(y) + g_ent H] / temperature = (g_lp (1[j=y] - p_j) - g_ent p_j (log p_j + H)) / temperature
// with p_j = exp(z_j - log Z), into `out` (which may be the logits tensor itself). No [N, C]-sized temporary
// is allocated: each row is read in one or two passes, with the math in double.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace {

void check_block(const at::Tensor& logits, const at::Tensor& target, int64_t valid) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be a 2-D tensor with contiguous rows");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0) && target.scalar_type() == at::kLong,
              "target must be int64 [N] (a column of the block, or -1)");
  TORCH_CHECK(valid >= 0 && valid <= logits.size(1), "valid columns out of range");
  TORCH_CHECK(logits.device().is_cpu() && target.device().is_cpu(), "CPU tensors expected");
}

at::Tensor row_stats(const at::Tensor& logits, const at::Tensor& target_in, int64_t valid, double temperature) {
  check_block(logits, target_in, valid);
  const at::Tensor target = target_in.contiguous();
  const int64_t N = logits.size(0), ld = logits.stride(0);
  at::Tensor out = at::empty({N, 4}, logits.options().dtype(at::kDouble));
  const double temp = temperature, ninf = -std::numeric_limits<double>::infinity();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "row_stats", [&] {
    const scalar_t* x = logits.const_data_ptr<scalar_t>();
    const int64_t* y = target.const_data_ptr<int64_t>();
    double* o = out.data_ptr<double>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* row = x + i * ld;
        double m = ninf;
        for (int64_t j = 0; j < valid; ++j) m = std::max(m, static_cast<double>(row[j]) / temp);
        double S = 0.0, T = 0.0;
        if (m != ninf) {
          for (int64_t j = 0; j < valid; ++j) {
            const double d = static_cast<double>(row[j]) / temp - m;
            const double e = std::exp(d);
            S += e;
            T += e * d;
          }
        }
        const int64_t t = y[i];
        o[4 * i] = m;
        o[4 * i + 1] = S;
        o[4 * i + 2] = t < 0 ? 0.0 : (t < valid ? static_cast<double>(row[t]) / temp : ninf);
        o[4 * i + 3] = T;
      }
    });
  });
  return out;
}

// Writes the gradient into `out` ([N, C], logits' dtype; may alias `logits`) and returns it.
at::Tensor row_grad(const at::Tensor& logits, const at::Tensor& target_in, int64_t valid, double temperature,
                    const at::Tensor& log_z, const at::Tensor& entropy, const at::Tensor& g_lp,
                    const at::Tensor& g_ent, at::Tensor out) {
  check_block(logits, target_in, valid);
  TORCH_CHECK(out.sizes() == logits.sizes() && out.scalar_type() == logits.scalar_type() && out.stride(1) == 1,
              "out must have the logits' shape and dtype, rows contiguous");
  const at::Tensor target = target_in.contiguous();
  const at::Tensor lz = log_z.to(at::kDouble).contiguous(), h = entropy.to(at::kDouble).contiguous();
  const at::Tensor gl = g_lp.to(at::kDouble).contiguous(), ge = g_ent.to(at::kDouble).contiguous();
  const int64_t N = logits.size(0), C = logits.size(1), ld = logits.stride(0), ldo = out.stride(0);
  const double temp = temperature;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "row_grad", [&] {
    const scalar_t* x = logits.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t* y = target.const_data_ptr<int64_t>();
    const double *lzp = lz.const_data_ptr<double>(), *hp = h.const_data_ptr<double>();
    const double *glp = gl.const_data_ptr<double>(), *gep = ge.const_data_ptr<double>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* row = x + i * ld;
        scalar_t* orow = o + i * ldo;
        const double L = lzp[i], H = hp[i], a = glp[i], b = gep[i];
        const int64_t t = y[i];
        for (int64_t j = 0; j < valid; ++j) {
          const double lp = static_cast<double>(row[j]) / temp - L;
          const double p = std::exp(lp);
          double g = -p * (a + b * (lp + H));
          if (j == t) g += a;
          orow[j] = static_cast<scalar_t>(g / temp);
        }
        for (int64_t j = valid; j < C; ++j) orow[j] = static_cast<scalar_t>(0.f);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(hybridrl_ops, m) {
  m.def("row_stats(Tensor logits, Tensor target, int valid, float temperature) -> Tensor");
  m.def("row_grad(Tensor logits, Tensor target, int valid, float temperature, Tensor log_z, Tensor entropy, "
        "Tensor g_lp, Tensor g_ent, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(hybridrl_ops, CPU, m) {
  m.impl("row_stats", &row_stats);
  m.impl("row_grad", &row_grad);
}
