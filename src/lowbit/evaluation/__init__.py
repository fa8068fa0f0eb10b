"""lowbit.evaluation."""
