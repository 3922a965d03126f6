"""Tutel-compatible module path for the compiled routing kernels."""
