"""Compute kernels. Each Triton kernel (GPU) sits beside the pure-torch reference it is tested against."""
