"""gpumem: a pooled CUDA allocator for PyTorch, plus the tools around it (placeholder, being built)."""
