// AVX2 + FMA gated units for float, bfloat16 and float16 (see gated_units.h).
//
// Eight units per step: their gates and ups are loaded as two float vectors (the interleaved
// layout de-interleaved in registers), the sigmoid's exponential is a polynomial on the
// vector (exp_lanes), and the results are stored in the storage type.  The last width % 8
// units of a row run the portable code.
#include "gated_units.h"

#include <limits>
#include <type_traits>

#include "avx2_lanes.h"

namespace tutel {
namespace core {

#ifdef TUTEL_HAVE_AVX2_KERNELS
namespace {

using avx2::Lanes;

// e^x for every lane: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by the degree-7 polynomial of
// Cephes' expf (relative error about 1e-7, a float ulp or two), times 2^n built in the exponent
// bits.  Inputs are limited to [-87, 88] so that 2^n stays a normal float (e^-87 = 1.6e-38, so
// a sigmoid of such an input is below float's resolution anyway); NaN stays NaN.  Past
// ln(FLT_MAX) the result is +inf, as expf's: a sigmoid of -inf is then exactly 0, and the gated
// unit's g * s at g = -inf NaN, as in the portable and CUDA kernels (not -inf).
TUTEL_AVX2_FMA inline __m256 exp_lanes(__m256 x) {
  const __m256 overflows = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);  // second operand returned for NaN: x
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln 2, with ln 2 split so that n * 0.693359375 is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 scaled = _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
  return _mm256_blendv_ps(scaled, _mm256_set1_ps(std::numeric_limits<float>::infinity()), overflows);
}

// The gates and ups of units i .. i + 7 of one row (interleaved: both from the gate row).
template <class T>
TUTEL_AVX2_FMA inline void load_units(const GatedUnit& unit, const T* gate, const T* up, int64_t i, __m256* g,
                                      __m256* u) {
  if (!unit.interleaved) {
    *g = Lanes<T>::load(gate + i);
    *u = Lanes<T>::load(up + i);
    return;
  }
  const __m256 a = Lanes<T>::load(gate + 2 * i);      // g0 u0 g1 u1 | g2 u2 g3 u3
  const __m256 b = Lanes<T>::load(gate + 2 * i + 8);  // g4 u4 g5 u5 | g6 u6 g7 u7
  // Within 128-bit lanes: g0 g1 g4 g5 | g2 g3 g6 g7, then the 64-bit quarters put in order.
  *g = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
  *u = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
}

// Adds the bias of units i .. i + 7 (a bias row has the layout of a gate/up row) in float, as the
// portable kernels add it in their accumulation type.
template <class T>
TUTEL_AVX2_FMA inline void add_bias(const GatedUnit& unit, const T* gate_bias, const T* up_bias, int64_t i, __m256* g,
                                    __m256* u) {
  __m256 bias_g, bias_u;
  load_units(unit, gate_bias, up_bias, i, &bias_g, &bias_u);
  *g = _mm256_add_ps(*g, bias_g);
  *u = _mm256_add_ps(*u, bias_u);
}

// Stores d g and d u of units i .. i + 7 in the gates' and ups' layout (interleaved: both
// into the gate row).
template <class T>
TUTEL_AVX2_FMA inline void store_units(const GatedUnit& unit, T* gate, T* up, int64_t i, __m256 g, __m256 u) {
  if (!unit.interleaved) {
    Lanes<T>::store(gate + i, g);
    Lanes<T>::store(up + i, u);
    return;
  }
  const __m256 low = _mm256_unpacklo_ps(g, u);   // g0 u0 g1 u1 | g4 u4 g5 u5
  const __m256 high = _mm256_unpackhi_ps(g, u);  // g2 u2 g3 u3 | g6 u6 g7 u7
  Lanes<T>::store(gate + 2 * i, _mm256_permute2f128_ps(low, high, 0x20));
  Lanes<T>::store(gate + 2 * i + 8, _mm256_permute2f128_ps(low, high, 0x31));
}

TUTEL_AVX2_FMA inline __m256 sigmoid_of(__m256 alpha, __m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 minus_alpha_g = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), alpha), g);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp_lanes(minus_alpha_g)));
}

template <class T>
TUTEL_AVX2_FMA void avx2_forward(const GatedUnit& unit, const GatedRows<T>& p, int64_t row_begin, int64_t row_end) {
  const __m256 alpha = _mm256_set1_ps(float(unit.alpha)), offset = _mm256_set1_ps(float(unit.up_offset));
  const __m256 limit = _mm256_set1_ps(float(unit.limit)), neg_limit = _mm256_set1_ps(-float(unit.limit));
  const int64_t vector_end = p.width / 8 * 8;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* gate = p.gate + r * p.gate_stride;
    const T* up = p.up + r * p.up_stride;
    T* out = p.out + r * p.out_stride;
    const T *gate_bias = nullptr, *up_bias = nullptr;
    const bool biased = bias_of_row(p, r, &gate_bias, &up_bias);
    for (int64_t i = 0; i < vector_end; i += 8) {
      __m256 g, u;
      load_units(unit, gate, up, i, &g, &u);
      if (biased) add_bias(unit, gate_bias, up_bias, i, &g, &u);
      if (unit.clamped) {  // operand order keeps NaN, as torch.clamp does
        g = _mm256_min_ps(limit, g);
        u = _mm256_max_ps(neg_limit, _mm256_min_ps(limit, u));
      }
      const __m256 gs = _mm256_mul_ps(g, sigmoid_of(alpha, g));
      Lanes<T>::store(out + i, _mm256_mul_ps(_mm256_add_ps(u, offset), gs));
    }
    if (vector_end < p.width) portable_forward_units(unit, p, r, vector_end);
  }
}

template <class T>
TUTEL_AVX2_FMA void avx2_backward(const GatedUnit& unit, const GatedRows<T>& p, int64_t row_begin, int64_t row_end) {
  const __m256 alpha = _mm256_set1_ps(float(unit.alpha)), offset = _mm256_set1_ps(float(unit.up_offset));
  const __m256 limit = _mm256_set1_ps(float(unit.limit)), neg_limit = _mm256_set1_ps(-float(unit.limit));
  const __m256 one = _mm256_set1_ps(1.0f);
  const int64_t vector_end = p.width / 8 * 8;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* gate = p.gate + r * p.gate_stride;
    const T* up = p.up + r * p.up_stride;
    const T* grad = p.grad + r * p.grad_stride;
    T* out_gate = p.out + r * p.out_stride;
    T* out_up = p.out_up + r * p.out_up_stride;
    const T *gate_bias = nullptr, *up_bias = nullptr;
    const bool biased = bias_of_row(p, r, &gate_bias, &up_bias);
    for (int64_t i = 0; i < vector_end; i += 8) {
      __m256 g, u;
      load_units(unit, gate, up, i, &g, &u);
      if (biased) add_bias(unit, gate_bias, up_bias, i, &g, &u);
      __m256 gate_passes = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), up_passes = gate_passes;
      if (unit.clamped) {  // ordered comparisons: NaN passes no gradient, as in torch.clamp's backward
        gate_passes = _mm256_cmp_ps(g, limit, _CMP_LE_OQ);
        up_passes = _mm256_and_ps(_mm256_cmp_ps(u, neg_limit, _CMP_GE_OQ), _mm256_cmp_ps(u, limit, _CMP_LE_OQ));
        g = _mm256_min_ps(limit, g);
        u = _mm256_max_ps(neg_limit, _mm256_min_ps(limit, u));
      }
      const __m256 dh = Lanes<T>::load(grad + i);
      const __m256 s = sigmoid_of(alpha, g);
      // s * (1 + alpha * g * (1 - s))
      const __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(_mm256_mul_ps(alpha, g), _mm256_sub_ps(one, s), one));
      const __m256 dg = _mm256_mul_ps(_mm256_mul_ps(dh, _mm256_add_ps(u, offset)), slope);
      const __m256 du = _mm256_mul_ps(dh, _mm256_mul_ps(g, s));
      store_units(unit, out_gate, out_up, i, _mm256_and_ps(dg, gate_passes), _mm256_and_ps(du, up_passes));
    }
    if (vector_end < p.width) portable_backward_units(unit, p, r, vector_end);
  }
}

}  // namespace
#endif

template <class T>
const GatedKernels<T>* avx2_gated_kernels() {
#ifdef TUTEL_HAVE_AVX2_KERNELS
  if constexpr (!std::is_same<T, double>::value) {
    static const GatedKernels<T> kernels{&avx2_forward<T>, &avx2_backward<T>};
    if (avx2::cpu_has_avx2_fma()) return &kernels;
  }
#endif
  return nullptr;
}

template const GatedKernels<float>* avx2_gated_kernels<float>();
template const GatedKernels<double>* avx2_gated_kernels<double>();
template const GatedKernels<bfloat16>* avx2_gated_kernels<bfloat16>();
template const GatedKernels<float16>* avx2_gated_kernels<float16>();

}  // namespace core
}  // namespace tutel
