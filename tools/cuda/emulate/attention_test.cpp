// attention.cu's kernels, per-row and tiled, in the CPU emulation (cuda_emu.hpp) against a
// double-precision reference of the same attention: the forward's output and probabilities,
// the backward's dS and dqkv, on grouped and plain heads, three bias shapes, and tile heights
// that do and do not divide the length. Outputs start as NaN, so an element a kernel does not
// write fails. Exit status 1 on any difference above 1e-5. Run by tools/cuda/emulate.sh.
#include "cuda_emu.hpp"

#include "attention.cu"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

namespace {

struct Shape {
  size_t b, t, h, kv, d;
  int bias; // 0: causal (1, 1, T, T); 1: padding (B, 1, 1, T); 2: full (B, H, T, T);
            // 3: causal with left padding at rltune's finite MASK_MIN (-1e9; mask.rs), the
            //    first row of each padded sequence masked whole
};

// The forward's output and probabilities, the backward's dS and dqkv.
struct Reference {
  std::vector<double> y, p, ds, dqkv;
};

struct Case {
  Shape s;
  size_t c, w, bb, bh, bt;
  std::vector<float> qkv, bias, g;
  Reference ref; // in double
};

Case make(Shape s, unsigned seed) {
  Case k{s, s.h * s.d, 0, 1, 1, 1, {}, {}, {}, {}};
  k.w = k.c + 2 * s.kv * s.d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  k.qkv.resize(s.b * s.t * k.w);
  for (auto &v : k.qkv) v = n(rng);
  k.g.resize(s.b * s.t * k.c);
  for (auto &v : k.g) v = n(rng);
  if (s.bias == 0 || s.bias == 3) {
    k.bt = s.t;
    if (s.bias == 3) k.bb = s.b;
  } else if (s.bias == 1) {
    k.bb = s.b;
  } else {
    k.bb = s.b, k.bh = s.h, k.bt = s.t;
  }
  k.bias.resize(k.bb * k.bh * k.bt * s.t);
  for (size_t pb = 0; pb < k.bb; ++pb)
    for (size_t ph = 0; ph < k.bh; ++ph)
      for (size_t pi = 0; pi < k.bt; ++pi)
        for (size_t j = 0; j < s.t; ++j) {
          float &v = k.bias[((pb * k.bh + ph) * k.bt + pi) * s.t + j];
          if (s.bias == 0) v = j > pi ? -INFINITY : 0.0f;
          else if (s.bias == 3) v = (j > pi || j < pb) ? -1e9f : 0.0f;
          else if (s.bias == 1) v = (j > 0 && (j + pb) % 3 == 0) ? -INFINITY : 0.0f;
          else v = 0.5f * n(rng);
        }
  // The reference, in double.
  const size_t b = s.b, t = s.t, h = s.h, d = s.d, rep = s.h / s.kv, c = k.c, w = k.w;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Reference &r = k.ref;
  r.y.assign(b * t * c, 0.0);
  r.p.assign(b * h * t * t, 0.0);
  r.ds.assign(b * h * t * t, 0.0);
  r.dqkv.assign(b * t * w, 0.0);
  auto X = [&](size_t bi, size_t i, size_t col) { return static_cast<double>(k.qkv[(bi * t + i) * w + col]); };
  for (size_t bi = 0; bi < b; ++bi)
    for (size_t hi = 0; hi < h; ++hi) {
      const size_t gi = hi / rep, kc = c + gi * d, vc = c + s.kv * d + gi * d;
      for (size_t i = 0; i < t; ++i) {
        const size_t row = (bi * h + hi) * t + i;
        const size_t pb = k.bb == 1 ? 0 : bi, ph = k.bh == 1 ? 0 : hi, pi = k.bt == 1 ? 0 : i;
        const float *br = &k.bias[((pb * k.bh + ph) * k.bt + pi) * t];
        std::vector<double> sc(t);
        double mx = -INFINITY;
        for (size_t j = 0; j < t; ++j) {
          double dot = 0.0;
          for (size_t e = 0; e < d; ++e) dot += X(bi, i, hi * d + e) * X(bi, j, kc + e);
          sc[j] = dot * scale + br[j];
          mx = std::max(mx, sc[j]);
        }
        double sum = 0.0;
        for (size_t j = 0; j < t; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
        for (size_t j = 0; j < t; ++j) r.p[row * t + j] = sc[j] / sum;
        for (size_t e = 0; e < d; ++e) {
          double acc = 0.0;
          for (size_t j = 0; j < t; ++j) acc += r.p[row * t + j] * X(bi, j, vc + e);
          r.y[(bi * t + i) * c + hi * d + e] = acc;
        }
        // The backward of this row.
        const float *gi_row = &k.g[(bi * t + i) * c + hi * d];
        std::vector<double> dp(t);
        double dot = 0.0;
        for (size_t j = 0; j < t; ++j) {
          double acc = 0.0;
          for (size_t e = 0; e < d; ++e) acc += static_cast<double>(gi_row[e]) * X(bi, j, vc + e);
          dp[j] = acc;
          dot += r.p[row * t + j] * acc;
        }
        for (size_t j = 0; j < t; ++j) {
          const double dsv = scale * r.p[row * t + j] * (dp[j] - dot);
          r.ds[row * t + j] = dsv;
          for (size_t e = 0; e < d; ++e) {
            r.dqkv[(bi * t + i) * w + hi * d + e] += dsv * X(bi, j, kc + e);
            r.dqkv[(bi * t + j) * w + kc + e] += dsv * X(bi, i, hi * d + e);
            r.dqkv[(bi * t + j) * w + vc + e] += r.p[row * t + j] * gi_row[e];
          }
        }
      }
    }
  return k;
}

int failures = 0;

void compare(const std::string &what, const std::vector<float> &got, const std::vector<double> &want) {
  double worst = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double diff = std::isnan(got[i]) ? INFINITY : std::fabs(got[i] - want[i]);
    if (!(diff <= worst)) worst = diff, at = i;
  }
  const bool ok = worst <= 1e-5;
  failures += !ok;
  std::printf("%s  %-58s max diff %.2e%s\n", ok ? "PASS" : "FAIL", what.c_str(), worst,
              ok ? "" : (" at " + std::to_string(at)).c_str());
}

constexpr unsigned THREADS = 256;

struct Outputs {
  std::vector<float> y, p, ds, dqkv;
};

// Outputs as a reference (for kernels compared with kernels).
Reference widen(const Outputs &o) {
  auto w = [](const std::vector<float> &v) { return std::vector<double>(v.begin(), v.end()); };
  return {w(o.y), w(o.p), w(o.ds), w(o.dqkv)};
}

void check(const std::string &name, const Outputs &got, const Reference &want) {
  compare(name + ": y", got.y, want.y);
  compare(name + ": P", got.p, want.p);
  compare(name + ": dS", got.ds, want.ds);
  compare(name + ": dqkv", got.dqkv, want.dqkv);
}

// Runs the per-row (tiled = false) or tiled kernels, outputs starting as NaN; with `split`, the
// tiled key side per query head (bwd_kv_part, then kv_sum).
Outputs run(const Case &k, bool tiled, size_t tq, size_t tj, size_t ti, bool split = false) {
  const Shape &s = k.s;
  const size_t b = s.b, t = s.t, h = s.h, kv = s.kv, d = s.d, c = k.c, w = k.w;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> y(b * t * c, NAN), p(b * h * t * t, NAN), ds(b * h * t * t, NAN), dqkv(b * t * w, NAN);
  const float *x = k.qkv.data(), *bias = k.bias.data(), *g = k.g.data();
  const size_t ld = d + 1;
  if (tiled) {
    const size_t tiles = (t + tq - 1) / tq, shared = (tq * ld + RLTUNE_ATT_TK * ld + tq * t) * sizeof(float);
    emu::launch(b * h * tiles, THREADS, shared, [&] {
      rltune_attention_tiled_f32(y.data(), p.data(), x, bias, b, t, c, h, kv, k.bb, k.bh, k.bt, scale, tq);
    });
    emu::launch(b * h * tiles, THREADS, shared, [&] {
      rltune_attention_tiled_bwd_q_f32(dqkv.data(), ds.data(), g, p.data(), x, b, t, c, h, kv, scale, tq);
    });
    const size_t key_tiles = (t + tj - 1) / tj, kv_shared = (2 * ti * ld + 2 * ti * (tj + 1)) * sizeof(float);
    if (split) {
      std::vector<float> part(b * h * t * 2 * d, NAN);
      emu::launch(b * h * key_tiles, THREADS, kv_shared, [&] {
        rltune_attention_tiled_bwd_kv_part_f32(part.data(), ds.data(), g, p.data(), x, b, t, c, h, kv, tj, ti);
      });
      // Fewer threads than values: the grid-stride loop covers the rest.
      emu::launch(3, 64, 0, [&] { rltune_attention_kv_sum_f32(dqkv.data(), part.data(), b, t, c, h, kv); });
    } else {
      emu::launch(b * kv * key_tiles, THREADS, kv_shared, [&] {
        rltune_attention_tiled_bwd_kv_f32(dqkv.data(), ds.data(), g, p.data(), x, b, t, c, h, kv, tj, ti);
      });
    }
  } else {
    const size_t shared = (d + t) * sizeof(float);
    emu::launch(b * h * t, THREADS, shared, [&] {
      rltune_attention_f32(y.data(), p.data(), x, bias, b, t, c, h, kv, k.bb, k.bh, k.bt, scale);
    });
    emu::launch(b * h * t, THREADS, shared, [&] {
      rltune_attention_bwd_q_f32(dqkv.data(), ds.data(), g, p.data(), x, b, t, c, h, kv, scale);
    });
    const unsigned threads = static_cast<unsigned>(std::min<size_t>((d + 31) / 32 * 32, THREADS));
    emu::launch(b * kv * t, threads, 0, [&] {
      rltune_attention_bwd_kv_f32(dqkv.data(), ds.data(), g, p.data(), x, b, t, c, h, kv);
    });
  }
  return {y, p, ds, dqkv};
}

} // namespace

int main() {
  const Shape shapes[] = {
      {2, 37, 4, 2, 8, 0},  // grouped heads, causal, a length no tile divides
      {1, 70, 3, 3, 64, 1}, // GPT-2's plain heads at its head width, padding
      {2, 5, 2, 1, 16, 2},  // one key head, a full bias, shorter than a tile
  };
  // Fully masked rows at the finite MASK_MIN: the softmax of scores rounded near -1e9 in f32,
  // which a double reference does not round alike; the tiled kernels against the per-row ones
  // (same summation order), which the H200 ran against the CPU kernel (selftest's mask_biases).
  const Shape padded{3, 33, 4, 2, 32, 3};
  unsigned seed = 1;
  for (const Shape &s : shapes) {
    const Case k = make(s, seed++);
    const std::string name = "B" + std::to_string(s.b) + " T" + std::to_string(s.t) + " H" + std::to_string(s.h) +
                             " KV" + std::to_string(s.kv) + " D" + std::to_string(s.d) + " bias" +
                             std::to_string(s.bias);
    check(name + " per-row", run(k, false, 0, 0, 0), k.ref);
    check(name + " tiled 32/32/32", run(k, true, 32, 32, 32), k.ref);
    check(name + " tiled 7/5/3", run(k, true, 7, 5, 3), k.ref);
    check(name + " tiled 1/1/1", run(k, true, 1, 1, 1), k.ref);
    // The key side split per query head: the reference's values, and the per-group kernel's bits.
    const Outputs grouped = run(k, true, 7, 5, 3), split = run(k, true, 7, 5, 3, true);
    check(name + " tiled 7/5/3 split", split, k.ref);
    const bool same = std::equal(split.dqkv.begin(), split.dqkv.end(), grouped.dqkv.begin(),
                                 [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; });
    failures += !same;
    std::printf("%s  %-58s\n", same ? "PASS" : "FAIL", (name + " split: dqkv bits of the grouped kernel").c_str());
  }
  const Case k = make(padded, seed);
  const Reference rows = widen(run(k, false, 0, 0, 0));
  check("B3 T33 H4 KV2 D32 left padding tiled 32/32/32 vs per-row", run(k, true, 32, 32, 32), rows);
  check("B3 T33 H4 KV2 D32 left padding tiled 7/5/3 vs per-row", run(k, true, 7, 5, 3), rows);
  std::printf("%s\n", failures ? "attention: FAILED" : "attention: every kernel matches the reference");
  return failures ? 1 : 0;
}
