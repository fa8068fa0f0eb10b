"""lowbit.data."""
