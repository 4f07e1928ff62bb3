// Scalar loops written so that the compiler vectorizes them (no libm calls, no branches in the
// element loops but the fp8 normal/subnormal select). Every step matches the torch reference:
// f32 amax, IEEE division, round-half-to-even, saturation.
#include "kernels/cpu/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "common/align.h"
#include "common/error.h"

namespace moecomm::kernels::cpu {
namespace {

using protocol::Encoding;

constexpr float kInt8Max = 127.0f;     // symmetric: -128 is never produced
constexpr float kFp8E4M3Max = 448.0f;  // largest finite e4m3 (fn) value
constexpr float kZeroScale = 1.0f;     // scale of an all-zero group, as in moecomm.ops.quant
// Adding then subtracting 1.5 * 2^23 rounds an f32 of magnitude < 2^22 to an integer, half to
// even, in the default rounding mode: SSE2-vectorizable, unlike nearbyint without SSE4.1.
constexpr float kRoundMagic = 12582912.0f;

// f32 and e4m3 bit layouts.
constexpr uint32_t kF32SignMask = 0x80000000u;
constexpr uint32_t kF32AbsMask = 0x7fffffffu;
constexpr int kF32MantBits = 23;
constexpr int kF32ExpBias = 127;
constexpr int kFp8MantBits = 3;
constexpr int kFp8ExpBias = 7;
constexpr uint32_t kFp8SignBit = 0x80u;
constexpr uint32_t kFp8MantMask = (1u << kFp8MantBits) - 1;
// The f32 mantissa bits that e4m3 drops, and half of their range (the rounding bias).
constexpr int kDroppedBits = kF32MantBits - kFp8MantBits;
constexpr uint32_t kHalfDroppedMinusOne = (1u << (kDroppedBits - 1)) - 1;
// e4m3 normals start at 2^-6; below it the grid steps by 2^-9 (512 steps per unit).
constexpr float kFp8MinNormal = 0.015625f;
constexpr float kFp8SubnormalStepsPerUnit = 512.0f;

// fp16 layout, for the exact widening of fp16 inputs.
constexpr uint32_t kF16ExpMask = 0x1f;
constexpr int kF16MantBits = 10;
constexpr uint32_t kF16MantMask = (1u << kF16MantBits) - 1;
constexpr uint32_t kF16ExpToF32 = kF32ExpBias - 15;          // rebias 15 -> 127
constexpr float kF16SubnormalStep = 5.9604644775390625e-8f;  // 2^-24

MC_FORCE_INLINE float bits_to_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

MC_FORCE_INLINE uint32_t f32_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

struct F32Src {
  static MC_FORCE_INLINE float get(const void* p, uint64_t i) {
    return static_cast<const float*>(p)[i];
  }
};

struct BF16Src {
  // bf16 is the top half of an f32: widening is a shift.
  static MC_FORCE_INLINE float get(const void* p, uint64_t i) {
    return bits_to_f32(uint32_t{static_cast<const uint16_t*>(p)[i]} << 16);
  }
};

struct F16Src {
  static MC_FORCE_INLINE float get(const void* p, uint64_t i) {
    const uint32_t h = static_cast<const uint16_t*>(p)[i];
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t exp = (h >> kF16MantBits) & kF16ExpMask;
    const uint32_t man = h & kF16MantMask;
    if (exp == kF16ExpMask) {  // inf / NaN
      return bits_to_f32(sign | 0x7f800000u | (man << (kF32MantBits - kF16MantBits)));
    }
    if (exp == 0) {  // zero or subnormal: man * 2^-24 is exact in f32
      const float mag = static_cast<float>(man) * kF16SubnormalStep;
      return bits_to_f32(sign | f32_to_bits(mag));
    }
    return bits_to_f32(sign | ((exp + kF16ExpToF32) << kF32MantBits) |
                       (man << (kF32MantBits - kF16MantBits)));
  }
};

// y already clamped to [-448, 448]. Round half to even onto the e4m3 grid and encode.
MC_FORCE_INLINE uint8_t encode_e4m3(float y) {
  const uint32_t bits = f32_to_bits(y);
  const uint32_t sign = (bits & kF32SignMask) ? kFp8SignBit : 0u;
  const float a = std::fabs(y);
  uint32_t code;
  if (a < kFp8MinNormal) {
    // Subnormal (or the smallest normal after rounding up: 8 steps of 2^-9 is code 8 = 2^-6).
    code = static_cast<uint32_t>((a * kFp8SubnormalStepsPerUnit + kRoundMagic) - kRoundMagic);
  } else {
    uint32_t ab = bits & kF32AbsMask;
    ab += kHalfDroppedMinusOne + ((ab >> kDroppedBits) & 1u);  // round half to even
    const uint32_t exp = (ab >> kF32MantBits) - kF32ExpBias + kFp8ExpBias;
    code = (exp << kFp8MantBits) | ((ab >> kDroppedBits) & kFp8MantMask);
  }
  return static_cast<uint8_t>(sign | code);
}

template <typename Src>
float group_amax(const void* row, uint32_t begin, uint32_t end) {
  float amax = 0.0f;
  for (uint32_t c = begin; c < end; ++c) amax = std::max(amax, std::fabs(Src::get(row, c)));
  return amax;
}

template <typename Src, bool kInt8>
void encode_group(const void* row, uint32_t begin, uint32_t end, float scale, uint8_t* q) {
  constexpr float qmax = kInt8 ? kInt8Max : kFp8E4M3Max;
  for (uint32_t c = begin; c < end; ++c) {
    const float y = std::min(std::max(Src::get(row, c) / scale, -qmax), qmax);
    if constexpr (kInt8) {
      q[c] = static_cast<uint8_t>(static_cast<int8_t>((y + kRoundMagic) - kRoundMagic));
    } else {
      q[c] = encode_e4m3(y);
    }
  }
}

template <typename Src, bool kInt8>
void quantize_rows(const QuantizeArgs& a, uint32_t group) {
  constexpr float qmax = kInt8 ? kInt8Max : kFp8E4M3Max;
  const uint32_t groups = static_cast<uint32_t>(ceil_div(a.hidden, group));
  const size_t elem = std::is_same_v<Src, F32Src> ? sizeof(float) : sizeof(uint16_t);
  for (uint32_t t = 0; t < a.tokens; ++t) {
    const void* row = static_cast<const uint8_t*>(a.x) + uint64_t{t} * a.x_row_stride * elem;
    uint8_t* q = static_cast<uint8_t*>(a.q) + uint64_t{t} * a.hidden;
    float* scales = a.scales + uint64_t{t} * groups;
    for (uint32_t g = 0; g < groups; ++g) {
      const uint32_t begin = g * group;
      const uint32_t end = std::min(begin + group, a.hidden);
      const float amax = group_amax<Src>(row, begin, end);
      const float scale = amax == 0.0f ? kZeroScale : amax / qmax;
      scales[g] = scale;
      encode_group<Src, kInt8>(row, begin, end, scale, q);
    }
  }
}

template <typename Src>
void quantize_typed(const QuantizeArgs& a) {
  switch (a.out) {
    case Encoding::kInt8:
      quantize_rows<Src, true>(a, a.hidden);
      break;
    case Encoding::kFP8E4M3:
      quantize_rows<Src, false>(a, a.hidden);
      break;
    default:
      quantize_rows<Src, false>(a, protocol::kScaleBlock);
      break;
  }
}

}  // namespace

void quantize(const QuantizeArgs& a) {
  MC_CHECK(a.in == Encoding::kBF16 || a.in == Encoding::kFP16 || a.in == Encoding::kF32,
           "quantize input must be BF16, FP16 or F32, got encoding ", static_cast<int>(a.in));
  MC_CHECK(protocol::encoding_quantized(a.out),
           "quantize output must be INT8, FP8_E4M3 or FP8_E4M3_B128, got encoding ",
           static_cast<int>(a.out));
  MC_CHECK(a.hidden >= 1, "hidden must be >= 1, got ", a.hidden);
  MC_CHECK(a.tokens <= 1 || a.x_row_stride >= a.hidden, "x_row_stride must be >= hidden (",
           a.hidden, "), got ", a.x_row_stride);
  if (a.tokens == 0) return;
  MC_CHECK(a.x != nullptr && a.q != nullptr && a.scales != nullptr,
           "x, q and scales must be non-null");
  switch (a.in) {
    case Encoding::kBF16:
      quantize_typed<BF16Src>(a);
      break;
    case Encoding::kFP16:
      quantize_typed<F16Src>(a);
      break;
    default:
      quantize_typed<F32Src>(a);
      break;
  }
}

}  // namespace moecomm::kernels::cpu
