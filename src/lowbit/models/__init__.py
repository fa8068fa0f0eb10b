"""lowbit.models."""
