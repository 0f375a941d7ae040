// softmax.cu's attention softmax in the CPU emulation (cuda_emu.hpp): the f32 kernels against a
// double-precision reference (forward with a broadcast causal bias and a fully masked row, and
// the scaled backward), and the bf16 ones against the f32 kernels' values from the same bf16
// inputs, rounded to bf16, bit for bit (they compute in f32 the same way and round once).
// Outputs start as NaN, so an element a kernel does not write fails. Exit status 1 on any
// failure. Run by tools/cuda/emulate.sh.
#include "cuda_emu.hpp"

#include "softmax.cu"

#include <cstdio>
#include <random>

namespace {

int failures = 0;

void expect(bool ok, const char *what) {
  if (!ok) std::printf("softmax: %s\n", what);
  failures += !ok;
}

__nv_bfloat16 bf(float f) { return __float2bfloat16_rn(f); }

} // namespace

int main() {
  // Scores (B, H, T, S) = (2, 3, 37, 37); the bias (B, 1, T, S): causal, and batch row 1's
  // first position masked whole at -1e9 (a left-padded row).
  const size_t b = 2, h = 3, t = 37, n = 37, rows = b * h * t;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<__nv_bfloat16> xb(rows * n), gb(rows * n);
  std::vector<float> x(rows * n), g(rows * n), bias(b * t * n);
  for (size_t i = 0; i < rows * n; ++i) {
    xb[i] = bf(normal(rng)), gb[i] = bf(normal(rng));
    x[i] = __bfloat162float(xb[i]), g[i] = __bfloat162float(gb[i]);
  }
  for (size_t bi = 0; bi < b; ++bi)
    for (size_t i = 0; i < t; ++i)
      for (size_t j = 0; j < n; ++j) bias[(bi * t + i) * n + j] = (j > i || (bi == 1 && j == 0)) ? -1e9f : 0.0f;
  const float scale = 0.125f;

  std::vector<float> y(rows * n, NAN), dx(rows * n, NAN);
  emu::launch(rows, 64, 0, [&] {
    rltune_scaled_masked_softmax_f32(y.data(), x.data(), bias.data(), rows, n, h, t, b, 1, t, scale);
  });
  emu::launch(rows, 64, 0, [&] { rltune_softmax_bwd_f32(dx.data(), y.data(), g.data(), rows, n, scale); });
  double worst = 0.0;
  for (size_t r = 0; r < rows; ++r) {
    const size_t bi = r / (t * h), i = r % t;
    // The masked score in f32 as the kernels form it (at -1e9 f32 keeps no fraction of x·scale,
    // so a fully masked row is uniform), the rest in double.
    std::vector<double> p(n), v(n);
    double mx = -INFINITY, sum = 0.0, dot = 0.0;
    for (size_t j = 0; j < n; ++j) mx = std::max(mx, v[j] = x[r * n + j] * scale + bias[(bi * t + i) * n + j]);
    for (size_t j = 0; j < n; ++j) sum += p[j] = std::exp(v[j] - mx);
    for (size_t j = 0; j < n; ++j) p[j] /= sum, dot += g[r * n + j] * p[j];
    for (size_t j = 0; j < n; ++j) {
      const double dp = scale * p[j] * (g[r * n + j] - dot);
      const double e = std::max(std::fabs(y[r * n + j] - p[j]), std::fabs(dx[r * n + j] - dp));
      worst = std::isnan(e) ? INFINITY : std::max(worst, e);
    }
  }
  expect(worst < 1e-5, "an f32 value is off the double reference by more than 1e-5");

  // The bf16 backward reads the bf16 probabilities: the f32 kernel gets the same values.
  const __nv_bfloat16 poison = {0x7fc0};
  std::vector<__nv_bfloat16> yb(rows * n, poison), dxb(rows * n, poison);
  emu::launch(rows, 64, 0, [&] {
    rltune_scaled_masked_softmax_bf16(yb.data(), xb.data(), bias.data(), rows, n, h, t, b, 1, t, scale);
  });
  emu::launch(rows, 64, 0, [&] { rltune_softmax_bwd_bf16(dxb.data(), yb.data(), gb.data(), rows, n, scale); });
  std::vector<float> yr(rows * n), dxr(rows * n, NAN);
  for (size_t i = 0; i < rows * n; ++i) yr[i] = __bfloat162float(yb[i]);
  emu::launch(rows, 64, 0, [&] { rltune_softmax_bwd_f32(dxr.data(), yr.data(), g.data(), rows, n, scale); });
  size_t differ = 0;
  for (size_t i = 0; i < rows * n; ++i) {
    differ += yb[i].bits != bf(y[i]).bits;
    differ += dxb[i].bits != bf(dxr[i]).bits;
  }
  expect(differ == 0, "a bf16 value is not the f32 kernel's value rounded");

  std::printf("%s (f32 worst error %.2e)\n", failures ? "softmax: FAILED" : "softmax: every kernel matches the reference",
              worst);
  return failures ? 1 : 0;
}
