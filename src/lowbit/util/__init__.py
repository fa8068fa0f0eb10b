"""lowbit.util."""
