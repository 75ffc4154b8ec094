// vectors.h: the vector types and helpers the kernels share (GCC vector extensions; -march=native picks the
// width: 16 floats with AVX-512, else 8).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#if defined(__FMA__) || defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef uint16_t u16v __attribute__((vector_size(kLanes * 2)));
typedef uint32_t u32v __attribute__((vector_size(kLanes * 4)));

inline vf fma_v(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline vf load_v(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// bfloat16 entries (their bits) widened to float32 at any vector width F (H: as many 16-bit lanes, U: 32-bit):
// a bfloat16 is the top half of a float32, so the widening is exact and costs a shift.
template <typename F, typename H, typename U>
inline F widen_bits(const uint16_t* p) {
  H half;
  __builtin_memcpy(&half, p, sizeof(half));
  const U wide = __builtin_convertvector(half, U) << 16;
  F v;
  __builtin_memcpy(&v, &wide, sizeof(v));
  return v;
}

// bfloat16 weights widened to float32: the weights stream at half the bytes, the arithmetic stays float32.
inline vf load_v(const at::BFloat16* p) {
#if defined(__AVX512F__)  // one widening instruction: the generic conversion took two halves and a shuffle
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
  return widen_bits<vf, u16v, u32v>(reinterpret_cast<const uint16_t*>(p));
#endif
}

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
typedef uint32_t u8 __attribute__((vector_size(32)));

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// exp(x) of the lanes of x <= 0 (scores minus their running maximum), at any vector width V (I: its 32-bit
// integers): Cody-Waite range reduction and a degree-6 polynomial in vector arithmetic (std::exp does not
// vectorize); relative error ~2e-7. Every lane takes the same operations, so a lane's result is the same at
// every width.
template <typename V, typename I>
inline V exp_lanes(V x) {
  const V floor = V{} - 87.f, magic = V{} + 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to nearest
  x = x < floor ? floor : x;
  const V n = (x * 1.44269504088896341f + magic) - magic;
  const V r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  V p = V{} + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
inline v8 exp8(v8 x) { return exp_lanes<v8, i8>(x); }
inline vf exp_v(vf x) { return exp_lanes<vf, vi>(x); }

inline float exp1(float x) { return exp8(splat(x))[0]; }
