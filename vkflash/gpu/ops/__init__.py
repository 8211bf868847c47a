"""Typed op builders, one module per kernel family; each declares its kernels in KERNELS."""
