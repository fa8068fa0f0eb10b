"""lowbit.report."""
