/* Where a CUDA process's GPU time goes, kernel by kernel: a library that CUPTI's activity API
 * loads into any process through LD_PRELOAD, with no change to the program (rltune is Rust and
 * candle launches its own kernels, so PyTorch's profiler cannot see them).
 *
 *   LD_PRELOAD=kernel_trace.so RLTUNE_KERNEL_TRACE=trace.json rltune bench ppo --device cuda ...
 *
 * At exit it writes RLTUNE_KERNEL_TRACE (default kernel-trace.json):
 *   {"span_ms": first kernel start to last kernel end,
 *    "kernel_ms": the kernels' summed time, "kernel_launches": how many ran,
 *    "busy": kernel_ms / span_ms (well below 1: the GPU waits on the host: launch overhead,
 *            synchronizations, host work between kernels),
 *    "kernels": [{"name", "count", "total_ms", "mean_us", "share",
 *                 "grids": [{"blocks", "threads", "count", "total_ms"}, ...]}, ...] (the 60
 *               largest; "grids" their launch sizes, the 8 largest by time, blocks in the grid
 *               and threads in a block, and "other_grids" the rest summed: candle's elementwise
 *               kernels launch one thread per value, so blocks × threads tells a weight's
 *               kernels from an activation's),
 *    "memcpy": {"HtoD" | "DtoH" | "DtoD" | ...: {"count", "mb", "ms"}}, "dropped": records lost}
 *
 * Built by tools/cuda/pack.sh against CUPTI 13.0's headers (PyPI's nvidia-cuda-cupti), whose
 * kernel record (CUpti_ActivityKernel10) has the same leading fields as later versions' (start,
 * end and name are all it reads); libcupti.so.13 comes from the GPU machine's PyTorch packages.
 */
#include <cupti.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SLOTS 16384 /* distinct kernel names (open addressing) */
#define TOP 60
#define BUF_SIZE (8u << 20)
#define GRIDS 512 /* distinct launch sizes counted per kernel name; later ones go to "other" */
#define TOP_GRIDS 8

typedef struct {
  uint64_t blocks, threads, count, ns;
} Grid;

typedef struct {
  char *name;
  uint64_t count, ns;
  Grid *grids; /* GRIDS of them, allocated at the name's first launch */
  uint64_t other_count, other_ns;
} Slot;

static Slot slots[SLOTS];
static uint64_t first_start = UINT64_MAX, last_end, kernel_ns, launches, dropped;
static uint64_t copy_count[16], copy_bytes[16], copy_ns[16];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int enabled;

static uint64_t fnv(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

/* Counts one launch of `blocks` blocks of `threads` threads that took `ns` under `s`. */
static void add_grid(Slot *s, uint64_t blocks, uint64_t threads, uint64_t ns) {
  if (!s->grids) s->grids = calloc(GRIDS, sizeof(Grid));
  for (size_t g = 0; s->grids && g < GRIDS; g++) {
    Grid *x = &s->grids[g];
    if (!x->count) x->blocks = blocks, x->threads = threads;
    if (x->blocks == blocks && x->threads == threads) {
      x->count++;
      x->ns += ns;
      return;
    }
  }
  s->other_count++;
  s->other_ns += ns;
}

static void add_kernel(const char *name, uint64_t start, uint64_t end, uint64_t blocks, uint64_t threads) {
  if (!name) name = "?";
  uint64_t i = fnv(name) % SLOTS;
  for (uint64_t probe = 0; probe < SLOTS; probe++, i = (i + 1) % SLOTS) {
    if (!slots[i].name) slots[i].name = strdup(name);
    if (strcmp(slots[i].name, name) == 0) {
      slots[i].count++;
      slots[i].ns += end - start;
      add_grid(&slots[i], blocks, threads, end - start);
      break;
    }
  }
  kernel_ns += end - start;
  launches++;
  if (start < first_start) first_start = start;
  if (end > last_end) last_end = end;
}

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(8, BUF_SIZE);
  *size = *buffer ? BUF_SIZE : 0;
  *max_records = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
  (void)ctx, (void)stream, (void)size;
  CUpti_Activity *r = NULL;
  pthread_mutex_lock(&lock);
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
      uint64_t blocks = (uint64_t)k->gridX * k->gridY * k->gridZ, threads = (uint64_t)k->blockX * k->blockY * k->blockZ;
      add_kernel(k->name, k->start, k->end, blocks, threads);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
      unsigned kind = m->copyKind < 16 ? m->copyKind : 0;
      copy_count[kind]++;
      copy_bytes[kind] += m->bytes;
      copy_ns[kind] += m->end - m->start;
    }
  }
  size_t d = 0;
  if (cuptiActivityGetNumDroppedRecords(ctx, stream, &d) == CUPTI_SUCCESS) dropped += d;
  pthread_mutex_unlock(&lock);
  free(buffer);
}

__attribute__((constructor)) static void start(void) {
  if (cuptiActivityRegisterCallbacks(requested, completed) != CUPTI_SUCCESS) {
    fprintf(stderr, "kernel_trace: CUPTI did not accept the callbacks; no trace\n");
    return;
  }
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityFlushPeriod(500);
  enabled = 1;
}

static int by_time(const void *a, const void *b) {
  uint64_t x = ((const Slot *)a)->ns, y = ((const Slot *)b)->ns;
  return x < y ? 1 : x > y ? -1 : 0;
}

static int grid_by_time(const void *a, const void *b) {
  uint64_t x = ((const Grid *)a)->ns, y = ((const Grid *)b)->ns;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* ", "grids": [...], "other_grids": {...}" for `s` (its grids sorted by time in place). */
static void json_grids(FILE *f, Slot *s) {
  size_t n = 0;
  while (s->grids && n < GRIDS && s->grids[n].count) n++;
  if (n) qsort(s->grids, n, sizeof(Grid), grid_by_time);
  uint64_t rest_count = s->other_count, rest_ns = s->other_ns;
  fprintf(f, ", \"grids\": [");
  for (size_t g = 0; g < n; g++) {
    const Grid *x = &s->grids[g];
    if (g >= TOP_GRIDS) {
      rest_count += x->count, rest_ns += x->ns;
      continue;
    }
    fprintf(f, "%s{\"blocks\": %llu, \"threads\": %llu, \"count\": %llu, \"total_ms\": %.3f}", g ? ", " : "",
            (unsigned long long)x->blocks, (unsigned long long)x->threads, (unsigned long long)x->count, x->ns / 1e6);
  }
  fprintf(f, "], \"other_grids\": {\"count\": %llu, \"total_ms\": %.3f}", (unsigned long long)rest_count,
          rest_ns / 1e6);
}

static void json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') fputc('\\', f);
    if ((unsigned char)*s >= 0x20) fputc(*s, f);
  }
  fputc('"', f);
}

static const char *copy_name(unsigned k) {
  switch (k) {
  case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
  case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
  case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
  case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
  case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "PtoP";
  default: return "other";
  }
}

__attribute__((destructor)) static void finish(void) {
  if (!enabled) return;
  enabled = 0; /* once, whether called or run at exit */
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  pthread_mutex_lock(&lock);
  const char *path = getenv("RLTUNE_KERNEL_TRACE");
  if (!path || !*path) path = "kernel-trace.json";
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) {
    fprintf(stderr, "kernel_trace: cannot write %s\n", tmp);
    pthread_mutex_unlock(&lock);
    return;
  }
  static Slot used[SLOTS];
  size_t n = 0;
  for (size_t i = 0; i < SLOTS; i++)
    if (slots[i].name) used[n++] = slots[i];
  qsort(used, n, sizeof(Slot), by_time);
  double span = launches ? (last_end - first_start) / 1e6 : 0.0, total = kernel_ns / 1e6;
  fprintf(f, "{\"span_ms\": %.3f, \"kernel_ms\": %.3f, \"kernel_launches\": %llu, \"busy\": %.4f, "
             "\"distinct_kernels\": %zu, \"dropped\": %llu,\n \"kernels\": [",
          span, total, (unsigned long long)launches, span > 0 ? total / span : 0.0, n,
          (unsigned long long)dropped);
  for (size_t i = 0; i < n && i < TOP; i++) {
    fprintf(f, "%s\n  {\"name\": ", i ? "," : "");
    json_string(f, used[i].name);
    fprintf(f, ", \"count\": %llu, \"total_ms\": %.3f, \"mean_us\": %.2f, \"share\": %.4f",
            (unsigned long long)used[i].count, used[i].ns / 1e6, used[i].ns / 1e3 / used[i].count,
            kernel_ns ? (double)used[i].ns / kernel_ns : 0.0);
    json_grids(f, &used[i]);
    fputc('}', f);
  }
  fprintf(f, "],\n \"memcpy\": {");
  int first = 1;
  for (unsigned k = 0; k < 16; k++) {
    if (!copy_count[k]) continue;
    fprintf(f, "%s\"%s\": {\"count\": %llu, \"mb\": %.3f, \"ms\": %.3f}", first ? "" : ", ", copy_name(k),
            (unsigned long long)copy_count[k], copy_bytes[k] / 1048576.0, copy_ns[k] / 1e6);
    first = 0;
  }
  fprintf(f, "}}\n");
  fclose(f);
  rename(tmp, path);
  fprintf(stderr, "kernel_trace: %llu kernels, %.1f ms of %.1f ms busy: %s\n", (unsigned long long)launches,
          total, span, path);
  pthread_mutex_unlock(&lock);
}
