# Sourced by tools/cuda/verify.sh and tools/cuda/smollm2.sh on the GPU machine: puts CUDA's
# libraries (cuBLAS, cuRAND, NVRTC, NCCL, CUPTI), which the machine's PyTorch ships as pip
# packages (nvidia/**/lib), on LD_LIBRARY_PATH, so that the rltune binary finds them.
NV_LIBS="$(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
dirs = set()
for r in roots:
    for so in glob.glob(os.path.join(r, "nvidia", "**", "lib", "*.so*"), recursive=True):
        dirs.add(os.path.dirname(so))
print(":".join(sorted(dirs)))
PY
)"
export LD_LIBRARY_PATH="${NV_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
