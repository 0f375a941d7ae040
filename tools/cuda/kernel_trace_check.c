/* A check of kernel_trace.c without a GPU (tools/cuda/pack.sh runs it): feeds synthetic kernel
 * records to its aggregation and writes the report, which the caller parses as JSON. */
#include "kernel_trace.c"

int main(void) {
  enabled = 1;
  add_kernel("ucopy_f32", 1000000, 3000000);
  add_kernel("ucopy_f32", 5000000, 6000000);
  add_kernel("sm90_xmma_gemm \"bf16\"\\x", 3000000, 4500000);
  add_kernel(NULL, 6000000, 6500000);
  finish();
  return 0;
}
