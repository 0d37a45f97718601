"""State quantization and update kernels: PyTorch reference paths, their compiled and Triton twins."""
