// Stand-in for what MLX puts above a custom Metal kernel (<metal_stdlib> and mlx/backend/metal/kernels/utils.h),
// so that clang can parse kvq's generated Metal sources as C++17 on a machine without Metal
// (tests/test_metal_syntax.py). Declarations only: nothing here runs. It declares what the kvq dialect's Metal
// prelude and kernels use; a kernel that needs more fails the test with clang's message, and the name goes here.
#pragma once

// address spaces: plain C++ has one
#define device
#define constant
#define threadgroup
#define thread

typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef __SIZE_TYPE__ size_t;

struct half {
  half() = default;
  half(float);
  operator float() const;
};
struct bfloat {
  bfloat() = default;
  bfloat(float);
  operator float() const;
};
typedef half float16_t;
typedef bfloat bfloat16_t;
struct complex64_t {
  float real, imag;
};

struct uint3 {
  uint x, y, z;
};

#define INFINITY __builtin_inff()

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags);

template <typename T> T simd_shuffle(T value, ushort lane);
template <typename T> T simd_shuffle_xor(T value, ushort mask);
template <typename T, typename U> T as_type(U value);

namespace metal {
float exp(float);
float log(float);
float sqrt(float);
template <typename T> T max(T a, T b);
template <typename T> T min(T a, T b);
}  // namespace metal
using namespace metal;
