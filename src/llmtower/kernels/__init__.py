"""Small C kernels for the hot spots PyTorch has no op for, with PyTorch fallbacks."""
