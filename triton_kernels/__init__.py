"""Triton chunked copy kernels with fused checksums."""
