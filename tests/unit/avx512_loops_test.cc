// The hand-written AVX-512 loops (kernels/cpu/avx512_loops.h) against the portable casts of
// kernels/cpu/vector_casts.h, element by element, on sampled FP32 bit patterns (every pattern
// whose low 12 bits are one of a few: all rounding boundaries of these formats lie above
// them), every code, and every length and alignment of the vector tails. quantize_test checks
// the portable casts against CUDA's conversions, and runs the whole kernels both ways.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/casts.h"
#include "kernels/cpu/avx512_loops.h"
#include "kernels/cpu/optimizer_loops.h"
#include "kernels/cpu/vector_casts.h"

namespace mainstay::kernels::cpu {
namespace {

// Bit patterns: high 20 bits x a few low 12-bit endings, plus random ones.
std::vector<float> SampledPatterns() {
  const uint32_t lows[] = {0x000, 0x001, 0x7FF, 0x800, 0x801, 0xFFF, 0x5A3};
  std::vector<float> v;
  v.reserve((size_t{1} << 20) * std::size(lows) + 100000);
  for (uint32_t high = 0; high < (1u << 20); ++high) {
    for (uint32_t low : lows) v.push_back(BitsFloat((high << 12) | low));
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 100000; ++i) v.push_back(BitsFloat(rng()));
  return v;
}

float Model(float x, bool fp16) {
  return BitsFloat(fp16 ? ModelValueBits<true>(FloatBits(x)) : ModelValueBits<false>(FloatBits(x)));
}

// Where a dequantization writes: offsets that put the 64-byte boundaries (where the
// non-temporal stores begin) at every distance from the start, streaming or not.
struct OutPlace {
  size_t shift;
  bool stream;
};
constexpr OutPlace kOutPlaces[] = {{0, false}, {0, true}, {1, true}, {5, false}, {8, true}, {15, true}};

// How many floats outside [shift, shift + n) are not the fill value -1.
int64_t OutsideWritten(const std::vector<float>& out, size_t shift, int64_t n) {
  int64_t bad = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (i < shift || i >= shift + static_cast<size_t>(n)) bad += out[i] != -1.0f;
  }
  return bad;
}

// AdamW inputs: gradients of every magnitude (one NaN), masters with a few large ones, moments.
struct AdamWCase {
  std::vector<float> grad, master, m, v;
  AdamWHyper h;
  AdamWConstants c;

  AdamWCase(uint32_t seed, int64_t n, int64_t step, float multiplier)
      : grad(static_cast<size_t>(n)), master(grad.size()), m(grad.size()), v(grad.size()) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < grad.size(); ++i) {
      grad[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
      master[i] = normal(rng) * (i % 101 == 7 ? 1e4f : 0.05f);
      m[i] = normal(rng) * 1e-3f;
      v[i] = std::fabs(normal(rng)) * 1e-6f;
    }
    grad[17] = std::numeric_limits<float>::quiet_NaN();
    h.lr = 1e-3f;
    h.weight_decay = 0.1f;
    h.step = step;
    h.grad_multiplier = multiplier;
    c = MakeAdamWConstants(h);
  }
};

class Avx512LoopsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!avx512::Enabled()) GTEST_SKIP() << "this CPU has no AVX-512 (or MAINSTAY_CPU_KERNELS=portable)";
  }
};

TEST_F(Avx512LoopsTest, Fp8AndSixteenBitCastsMatchThePortableCasts) {
  const std::vector<float> x = SampledPatterns();
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint8_t> q(static_cast<size_t>(n)), h(static_cast<size_t>(2 * n));
  for (bool fp16 : {false, true}) {
    for (bool e5m2 : {false, true}) {
      for (float scale : {1.0f, 0.75f, 3.0e-3f}) {
        avx512::QuantizeFp8(x.data(), q.data(), n, scale, fp16, e5m2);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; ++i) {
          const float y = Model(x[i], fp16) * scale;
          bad += q[i] != (e5m2 ? E5M2Bits(y) : E4M3Bits(y));
        }
        EXPECT_EQ(bad, 0) << "fp16 model " << fp16 << " e5m2 " << e5m2 << " scale " << scale;
      }
    }
    for (bool fp16_out : {false, true}) {
      avx512::Cast16(x.data(), h.data(), n, fp16, fp16_out);
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t u = fp16 == fp16_out ? FloatBits(x[i]) : FloatBits(Model(x[i], fp16));
        const uint16_t want = fp16_out ? Fp16Bits(u) : Bf16Bits(u);
        bad += static_cast<uint16_t>(h[2 * i] | (h[2 * i + 1] << 8)) != want;
      }
      EXPECT_EQ(bad, 0) << "fp16 model " << fp16 << " fp16 out " << fp16_out;
    }
  }
}

TEST_F(Avx512LoopsTest, TailsWriteExactlyTheirElements) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> x(48);
  for (float& v : x) v = normal(rng);
  for (int64_t n = 1; n <= 33; ++n) {
    std::vector<uint8_t> q(static_cast<size_t>(n) + 1, 0xAB), h(static_cast<size_t>(2 * n) + 2, 0xAB);
    avx512::QuantizeFp8(x.data(), q.data(), n, 10.0f, false, false);
    avx512::Cast16(x.data(), h.data(), n, false, true);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(q[static_cast<size_t>(i)], E4M3Bits(Model(x[static_cast<size_t>(i)], false) * 10.0f)) << n << " " << i;
      EXPECT_EQ(h[static_cast<size_t>(2 * i)] | (h[static_cast<size_t>(2 * i + 1)] << 8),
                Fp16Bits(FloatBits(Model(x[static_cast<size_t>(i)], false))));
    }
    EXPECT_EQ(q.back(), 0xAB) << "wrote past the end, n " << n;
    EXPECT_EQ(h[static_cast<size_t>(2 * n)], 0xAB) << "wrote past the end, n " << n;
  }
}

// A row piece [c0, c1) with a multiplier per block: every alignment of c0 to the blocks and
// every tail length, on sampled patterns.
TEST_F(Avx512LoopsTest, BlockPiecesMatchThePortableCastsAtEveryAlignment) {
  const std::vector<float> all = SampledPatterns();
  std::mt19937 rng(5);
  std::uniform_int_distribution<size_t> start(0, all.size() - 600);
  std::uniform_real_distribution<float> mag(-8.0f, 8.0f);
  int64_t bad = 0, cases = 0;
  for (int block_cols : {16, 32, 128}) {
    for (int64_t c0 = 0; c0 < 2 * block_cols; c0 += block_cols == 128 ? 7 : 1) {
      for (int64_t len : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{33}, int64_t{300}, int64_t{517}}) {
        const int64_t c1 = c0 + len;
        const float* src = all.data() + start(rng);
        std::vector<float> mult(static_cast<size_t>((c1 - 1) / block_cols - c0 / block_cols + 1));
        for (float& m : mult) m = std::ldexp(1.0f, static_cast<int>(mag(rng) * 4)) * (1.0f + mag(rng) / 16);
        auto m_of = [&](int64_t i) { return mult[static_cast<size_t>((c0 + i) / block_cols - c0 / block_cols)]; };
        for (bool fp16 : {false, true}) {
          ++cases;
          if (block_cols == 16) {
            // Packed E2M1: a guard byte after the piece must stay untouched.
            std::vector<uint8_t> packed(static_cast<size_t>((len + 1) / 2 + 1), 0xAB);
            avx512::QuantizeE2M1PiecePacked(src, c0, c1, mult.data(), fp16, packed.data());
            for (int64_t i = 0; i < len; ++i) {
              const uint8_t code = static_cast<uint8_t>((packed[static_cast<size_t>(i / 2)] >> (4 * (i % 2))) & 0xF);
              bad += code != E2M1Bits(Model(src[i], fp16) * m_of(i));
            }
            if (len % 2 != 0) bad += (packed[static_cast<size_t>(len / 2)] >> 4) != 0;
            bad += packed.back() != 0xAB;
            // And back: fl(fl(value * scale) * s_dec).
            for (const OutPlace& at : kOutPlaces) {
              std::vector<float> out(static_cast<size_t>(len) + 32, -1.0f);
              avx512::DequantizeE2M1PiecePacked(packed.data(), c0, c1, mult.data(), 0.375f, out.data() + at.shift,
                                                at.stream);
              for (int64_t i = 0; i < len; ++i) {
                const uint8_t code = static_cast<uint8_t>((packed[static_cast<size_t>(i / 2)] >> (4 * (i % 2))) & 0xF);
                bad += FloatBits(out[static_cast<size_t>(at.shift + i)]) != FloatBits((E2M1Value(code) * m_of(i)) * 0.375f);
              }
              bad += OutsideWritten(out, at.shift, len);
            }
          } else {
            std::vector<uint8_t> q(static_cast<size_t>(len) + 1, 0xAB);
            avx512::QuantizeE4M3Piece(src, c0, c1, block_cols, mult.data(), fp16, q.data());
            for (int64_t i = 0; i < len; ++i) bad += q[static_cast<size_t>(i)] != E4M3Bits(Model(src[i], fp16) * m_of(i));
            bad += q.back() != 0xAB;
            for (const OutPlace& at : kOutPlaces) {
              std::vector<float> out(static_cast<size_t>(len) + 32, -1.0f);
              avx512::DequantizeE4M3Piece(q.data(), c0, c1, block_cols, mult.data(), out.data() + at.shift, at.stream);
              for (int64_t i = 0; i < len; ++i) {
                bad += FloatBits(out[static_cast<size_t>(at.shift + i)]) !=
                       FloatBits(E4M3Value(q[static_cast<size_t>(i)]) * m_of(i));
              }
              bad += OutsideWritten(out, at.shift, len);
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 500);
  EXPECT_EQ(bad, 0);
}

// The optimizer pass's mxfp8 cast of model bits: every 16-bit pattern, in blocks whose amax is
// each of them in turn (NaNs, infinities, subnormals and zeros included).
TEST_F(Avx512LoopsTest, Mxfp8CastOfModelBitsMatchesThePortableCast) {
  std::vector<uint16_t> bits(65536 * 32);
  std::mt19937 rng(9);
  for (size_t i = 0; i < bits.size(); ++i) {
    bits[i] = i % 32 == 0 ? static_cast<uint16_t>(i / 32) : static_cast<uint16_t>(rng() & (rng() % 3 ? 0x3FFF : 0xFFFF));
  }
  const int64_t n = static_cast<int64_t>(bits.size());
  std::vector<uint8_t> q(bits.size()), want_q(bits.size()), e(bits.size() / 32), want_e(bits.size() / 32);
  for (bool fp16 : {false, true}) {
    avx512::CastMxfp8FromBits(bits.data(), n, fp16, q.data(), e.data());
    if (fp16) {
      CastMxfp8Span<Format::kFP16>(bits.data(), n, want_q.data(), want_e.data());
    } else {
      CastMxfp8Span<Format::kBF16>(bits.data(), n, want_q.data(), want_e.data());
    }
    EXPECT_EQ(q, want_q) << "fp16 model " << fp16;
    EXPECT_EQ(e, want_e) << "fp16 model " << fp16;
  }
}

// The dry run for the amax against the portable loops (AdamWSpanOut, then the model bits'
// largest magnitude; AccumulateGradStats), with gradients of every magnitude, NaNs and
// infinities among them, and every tail length.
TEST_F(Avx512LoopsTest, AdamWDryRunAmaxMatchesThePortableDryRun) {
  const int64_t n = 3000;
  AdamWCase data(21, n, 7, 0.5f);
  data.grad[1234] = std::numeric_limits<float>::infinity();
  data.master[2999] = std::numeric_limits<float>::quiet_NaN();
  const auto& [grad, master, m, v, h, c] = data;
  for (bool fp16 : {false, true}) {
    for (int64_t len : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{1024}, n}) {
      // The portable dry run, as ProcessChunk does it.
      std::vector<float> pm(static_cast<size_t>(len)), mm(static_cast<size_t>(len)), vm(static_cast<size_t>(len));
      AdamWSpanOut<ElementType::kFloat32, ElementType::kFloat32>(h, c, grad.data(), master.data(), m.data(), v.data(),
                                                                 len, pm.data(), mm.data(), vm.data());
      std::vector<uint16_t> bits(static_cast<size_t>(len));
      if (fp16) {
        ModelBitsSpan<Format::kFP16>(pm.data(), len, bits.data());
      } else {
        ModelBitsSpan<Format::kBF16>(pm.data(), len, bits.data());
      }
      const Format model = fp16 ? Format::kFP16 : Format::kBF16;
      const float want_amax = ModelBitsToFloat(
          fp16 ? MaxMagnitudeBits<Format::kFP16>(bits.data(), len) : MaxMagnitudeBits<Format::kBF16>(bits.data(), len),
          model);
      double want_lanes[kSumLanes] = {0.5, 0, 0, 0, 0, 0, 0, 0};
      const int64_t want_bad = AccumulateGradStats<ElementType::kFloat32>(grad.data(), len, h.grad_multiplier, want_lanes);

      double lanes[kSumLanes] = {0.5, 0, 0, 0, 0, 0, 0, 0};
      int64_t bad = 0;
      const int32_t amax = avx512::AdamWDryRunAmax(h, c, grad.data(), master.data(), m.data(), v.data(), len, fp16,
                                                   lanes, &bad);
      EXPECT_EQ(static_cast<uint32_t>(amax), FloatBits(want_amax)) << "fp16 " << fp16 << " len " << len;
      EXPECT_EQ(bad, want_bad) << "len " << len;
      for (int l = 0; l < kSumLanes; ++l) {
        EXPECT_EQ(std::bit_cast<uint64_t>(lanes[l]), std::bit_cast<uint64_t>(want_lanes[l])) << "lane " << l << " len " << len;
      }
      // The updated masters the amax is taken over, bit for bit.
      std::vector<float> updated(static_cast<size_t>(len));
      avx512::AdamWDryRunMasters(h, c, grad.data(), master.data(), m.data(), v.data(), len, updated.data());
      int64_t differ = 0;
      for (int64_t i = 0; i < len; ++i) differ += FloatBits(updated[static_cast<size_t>(i)]) != FloatBits(pm[static_cast<size_t>(i)]);
      EXPECT_EQ(differ, 0) << "len " << len;
      // Without statistics: the same amax, nothing else touched.
      int64_t untouched = 5;
      EXPECT_EQ(avx512::AdamWDryRunAmax(h, c, grad.data(), master.data(), m.data(), v.data(), len, fp16, nullptr,
                                        &untouched),
                amax);
      EXPECT_EQ(untouched, 5);
    }
  }
}

// The optimizer pass's AdamW in place + fp8 cast against the portable element functions, state
// and output bit for bit, every tail length.
TEST_F(Avx512LoopsTest, AdamWCastFp8MatchesThePortableLoop) {
  const int64_t n = 2000;
  const AdamWCase data(23, n, 3, 0.25f);
  const auto& [grad, master, m, v, h, c] = data;
  for (bool fp16 : {false, true}) {
    for (bool e5m2 : {false, true}) {
      for (int64_t len : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{33}, n}) {
        std::vector<float> pm = master, mm = m, vm = v;  // the portable loop's state
        std::vector<uint8_t> want(static_cast<size_t>(len));
        for (int64_t i = 0; i < len; ++i) {
          const float p = AdamWInPlace<ElementType::kFloat32, ElementType::kFloat32>(h, c, h.grad_multiplier, grad.data(),
                                                                                    i, pm.data(), mm.data(), vm.data());
          const float y = Model(p, fp16) * 30.0f;
          want[static_cast<size_t>(i)] = e5m2 ? E5M2Bits(y) : E4M3Bits(y);
        }
        std::vector<float> am = master, amm = m, avm = v;
        std::vector<uint8_t> q(static_cast<size_t>(len) + 1, 0xAB);
        avx512::AdamWCastFp8(h, c, grad.data(), am.data(), amm.data(), avm.data(), len, 30.0f, fp16, e5m2, q.data());
        int64_t differ = 0;
        for (int64_t i = 0; i < n; ++i) {
          const size_t k = static_cast<size_t>(i);
          differ += FloatBits(am[k]) != FloatBits(pm[k]) || FloatBits(amm[k]) != FloatBits(mm[k]) ||
                    FloatBits(avm[k]) != FloatBits(vm[k]);
        }
        EXPECT_EQ(differ, 0) << "fp16 " << fp16 << " len " << len;
        EXPECT_TRUE(std::equal(want.begin(), want.end(), q.begin())) << "fp16 " << fp16 << " e5m2 " << e5m2 << " len " << len;
        EXPECT_EQ(q.back(), 0xAB);
      }
    }
  }
}

TEST_F(Avx512LoopsTest, BlockScalesDecodeAsThePortableDecodersForEveryCode) {
  std::vector<uint8_t> codes(256 + 7);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 13);
  for (bool e8m0 : {false, true}) {
    std::vector<float> out(codes.size() + 1, -1.0f);
    avx512::DecodeBlockScales(codes.data(), static_cast<int64_t>(codes.size()), e8m0, out.data());
    for (size_t i = 0; i < codes.size(); ++i) {
      EXPECT_EQ(FloatBits(out[i]), FloatBits(e8m0 ? E8M0Value(codes[i]) : E4M3Value(codes[i]))) << int{codes[i]};
    }
    EXPECT_EQ(out.back(), -1.0f);
  }
}

TEST_F(Avx512LoopsTest, SixteenBitDequantizeMatchesThePortableDecodersForEveryPattern) {
  std::vector<uint8_t> bytes(2 * 65536);
  for (size_t h = 0; h < 65536; ++h) {
    bytes[2 * h] = static_cast<uint8_t>(h);
    bytes[2 * h + 1] = static_cast<uint8_t>(h >> 8);
  }
  for (bool fp16 : {false, true}) {
    for (const OutPlace& at : kOutPlaces) {
      for (size_t n : {size_t{65536}, size_t{7}, size_t{33}}) {
        std::vector<float> out(n + 32, -1.0f);
        avx512::Dequantize16(bytes.data(), out.data() + at.shift, static_cast<int64_t>(n), fp16, at.stream);
        int64_t bad = 0;
        for (size_t h = 0; h < n; ++h) {
          const uint16_t u = static_cast<uint16_t>(h);
          bad += FloatBits(out[at.shift + h]) != FloatBits(fp16 ? Fp16Value(u) : Bf16ToFloat(u));
        }
        EXPECT_EQ(bad, 0) << "fp16 " << fp16 << " n " << n << " shift " << at.shift;
        EXPECT_EQ(OutsideWritten(out, at.shift, static_cast<int64_t>(n)), 0);
      }
    }
  }
}

TEST_F(Avx512LoopsTest, Fp8DequantizeMatchesThePortableDecodersForEveryCode) {
  // Every code, at every position of a vector and in tails of every length.
  std::vector<uint8_t> q;
  for (int rep = 0; rep < 3; ++rep) {
    for (int c = 0; c < 256; ++c) q.push_back(static_cast<uint8_t>((c * 37 + rep) & 0xFF));
  }
  for (bool e5m2 : {false, true}) {
    for (float s : {1.0f, 0.0078125f, 3.3f, 1e-38f}) {
      for (size_t n : {q.size(), size_t{1}, size_t{7}, size_t{16}, size_t{31}}) {
        for (const OutPlace& at : kOutPlaces) {
          std::vector<float> out(n + 32, -1.0f);
          avx512::DequantizeFp8(q.data(), out.data() + at.shift, static_cast<int64_t>(n), s, e5m2, at.stream);
          for (size_t i = 0; i < n; ++i) {
            const float want = (e5m2 ? E5M2Value(q[i]) : E4M3Value(q[i])) * s;
            EXPECT_EQ(FloatBits(out[at.shift + i]), FloatBits(want)) << "code " << int{q[i]} << " e5m2 " << e5m2;
          }
          EXPECT_EQ(OutsideWritten(out, at.shift, static_cast<int64_t>(n)), 0) << "n " << n << " shift " << at.shift;
        }
      }
    }
  }
}

}  // namespace
}  // namespace mainstay::kernels::cpu
