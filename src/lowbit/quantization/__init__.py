"""lowbit.quantization."""
