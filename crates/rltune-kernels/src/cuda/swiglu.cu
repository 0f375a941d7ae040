// SwiGLU, silu(gate) * up, forward and backward: the CUDA twin of src/swiglu.rs.
// silu(g) = g / (1 + e^-g), as the CPU kernel (and candle's CPU silu) computes it;
// with s = 1 / (1 + e^-g): d gate = dy * up * s * (1 + g (1 - s)), d up = dy * g * s.
//
// The bf16 kernels (bf16 activations between autocast's products, issue #53) read bf16, compute
// in f32 exactly as the f32 kernels do, and round each result to bf16 once (to nearest, ties to
// even): the f32 kernel's value, rounded. torch's autocast rounds twice, after silu and after
// the product.
#include <cuda_bf16.h>
#include <stddef.h>

__device__ __forceinline__ float swiglu_value(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// d gate and d up for one element.
__device__ __forceinline__ void swiglu_grads(float g, float u, float dy, float *dg, float *du) {
  const float s = 1.0f / (1.0f + expf(-g));
  *dg = dy * u * s * (1.0f + g * (1.0f - s));
  *du = dy * g * s;
}

extern "C" __global__ void rltune_swiglu_f32(float *__restrict__ out, const float *__restrict__ g,
                                             const float *__restrict__ u, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    out[i] = swiglu_value(g[i], u[i]);
  }
}

// out holds [d gate; d up]: 2n values, d gate first.
extern "C" __global__ void rltune_swiglu_bwd_f32(float *__restrict__ out, const float *__restrict__ g,
                                                 const float *__restrict__ u, const float *__restrict__ dy,
                                                 size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    swiglu_grads(g[i], u[i], dy[i], &out[i], &out[n + i]);
  }
}

extern "C" __global__ void rltune_swiglu_bf16(__nv_bfloat16 *__restrict__ out, const __nv_bfloat16 *__restrict__ g,
                                              const __nv_bfloat16 *__restrict__ u, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    out[i] = __float2bfloat16_rn(swiglu_value(__bfloat162float(g[i]), __bfloat162float(u[i])));
  }
}

// out holds [d gate; d up] in bf16: 2n values, d gate first.
extern "C" __global__ void rltune_swiglu_bwd_bf16(__nv_bfloat16 *__restrict__ out,
                                                  const __nv_bfloat16 *__restrict__ g,
                                                  const __nv_bfloat16 *__restrict__ u,
                                                  const __nv_bfloat16 *__restrict__ dy, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float dg, du;
    swiglu_grads(__bfloat162float(g[i]), __bfloat162float(u[i]), __bfloat162float(dy[i]), &dg, &du);
    out[i] = __float2bfloat16_rn(dg);
    out[n + i] = __float2bfloat16_rn(du);
  }
}
