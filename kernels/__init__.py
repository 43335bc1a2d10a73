"""Compute kernels: each Triton kernel beside its float32 torch reference. Imports nothing of ours."""
