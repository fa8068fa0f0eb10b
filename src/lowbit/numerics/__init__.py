"""lowbit.numerics."""
