// The sampler's fused passes (gpu_worker/sampler.py), per instruction-set class.
