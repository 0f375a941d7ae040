/* A check of kernel_trace.c without a GPU (tools/cuda/pack.sh runs it): feeds synthetic kernel
 * records to its aggregation and writes the report, which the caller parses as JSON. */
#include "kernel_trace.c"

int main(void) {
  enabled = 1;
  add_kernel("ucopy_f32", 1000000, 3000000, 40, 1024);
  add_kernel("ucopy_f32", 5000000, 6000000, 8, 1024);
  add_kernel("sm90_xmma_gemm \"bf16\"\\x", 3000000, 4500000, 132, 384);
  add_kernel(NULL, 6000000, 6500000, 1, 32);
  /* Ten launch sizes of one kernel, 1 to 10 µs: the eight longest are listed, two summed. */
  for (uint64_t g = 1; g <= 10; g++) add_kernel("cast_f32_bf16", 7000000, 7000000 + 1000 * g, g, 1024);
  finish();
  return 0;
}
