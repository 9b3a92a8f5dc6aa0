"""Device tooling, never imported by the library: the three-phase GPU check of the fused kernel
(`gpu_check`, run by scripts/gpu_check.sh) and its H200 compile report made without a GPU (`compile_report`,
run by scripts/gpu_compile_check.sh)."""
