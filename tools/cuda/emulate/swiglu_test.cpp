// swiglu.cu's kernels in the CPU emulation (cuda_emu.hpp): the f32 forward and backward against
// a double-precision reference, and the bf16 ones against the f32 kernels' values rounded to
// bf16, bit for bit (they compute in f32 and round once). A grid smaller than the tensor
// exercises the grid-stride loop; outputs start as NaN, so an element a kernel does not write
// fails. Exit status 1 on any failure. Run by tools/cuda/emulate.sh.
#include "cuda_emu.hpp"

#include "swiglu.cu"

#include <cstdio>
#include <random>

namespace {

int failures = 0;

void expect(bool ok, const char *what) {
  if (!ok) std::printf("swiglu: %s\n", what);
  failures += !ok;
}

uint16_t bits(float f) { return __float2bfloat16_rn(f).bits; }

__nv_bfloat16 bf(float f) { return __float2bfloat16_rn(f); }

} // namespace

int main() {
  // The rounding itself: ties go to the even neighbour, anything above half rounds up.
  expect(bits(1.0f) == 0x3f80, "1.0 is 0x3f80");
  expect(bits(1.00390625f) == 0x3f80, "the tie 1 + 2^-8 rounds down to the even 0x3f80");
  expect(bits(1.01171875f) == 0x3f82, "the tie 1 + 3·2^-8 rounds up to the even 0x3f82");
  expect(bits(std::nextafter(1.00390625f, 2.0f)) == 0x3f81, "just above the tie rounds up");
  expect(bits(-2.5f) == 0xc020, "-2.5 is exact");
  expect(__bfloat162float(bf(3.0e38f)) > 2.9e38f, "large values stay finite below the top");

  const size_t n = 1000;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> g(n), u(n), dy(n);
  for (size_t i = 0; i < n; ++i) g[i] = normal(rng), u[i] = normal(rng), dy[i] = normal(rng);
  g[0] = 0.0f, g[1] = -30.0f, g[2] = 30.0f, g[3] = -100.0f; // silu's ends: exp overflows at -100
  // The bf16 kernels read bf16 inputs: round them once, and give the f32 kernels the same values.
  std::vector<__nv_bfloat16> gb(n), ub(n), dyb(n);
  for (size_t i = 0; i < n; ++i) {
    gb[i] = bf(g[i]), ub[i] = bf(u[i]), dyb[i] = bf(dy[i]);
    g[i] = __bfloat162float(gb[i]), u[i] = __bfloat162float(ub[i]), dy[i] = __bfloat162float(dyb[i]);
  }

  std::vector<float> y(n, NAN), d(2 * n, NAN);
  emu::launch(3, 64, 0, [&] { rltune_swiglu_f32(y.data(), g.data(), u.data(), n); });
  emu::launch(3, 64, 0, [&] { rltune_swiglu_bwd_f32(d.data(), g.data(), u.data(), dy.data(), n); });
  double worst = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double gi = g[i], s = 1.0 / (1.0 + std::exp(-gi));
    const double want[3] = {gi * s * u[i], dy[i] * u[i] * s * (1.0 + gi * (1.0 - s)), dy[i] * gi * s};
    const double got[3] = {y[i], d[i], d[n + i]};
    for (int k = 0; k < 3; ++k) {
      const double err = std::fabs(got[k] - want[k]) / std::max(1.0, std::fabs(want[k]));
      worst = std::isnan(err) ? INFINITY : std::max(worst, err);
    }
  }
  expect(worst < 1e-5, "an f32 value is off the double reference by more than 1e-5");

  const __nv_bfloat16 poison = {0x7fc0};
  std::vector<__nv_bfloat16> yb(n, poison), db(2 * n, poison);
  emu::launch(3, 64, 0, [&] { rltune_swiglu_bf16(yb.data(), gb.data(), ub.data(), n); });
  emu::launch(3, 64, 0, [&] { rltune_swiglu_bwd_bf16(db.data(), gb.data(), ub.data(), dyb.data(), n); });
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) differ += yb[i].bits != bits(y[i]);
  for (size_t i = 0; i < 2 * n; ++i) differ += db[i].bits != bits(d[i]);
  expect(differ == 0, "a bf16 value is not the f32 kernel's value rounded");

  std::printf("%s (f32 worst relative error %.2e)\n",
              failures ? "swiglu: FAILED" : "swiglu: every kernel matches the reference", worst);
  return failures ? 1 : 0;
}
