"""Brine's own CPU kernels (`csrc/`), how they are built and bound (`build`), the fused elementwise calls on them
(`fused_ops`), and the batch-invariance probe for torch's matmuls (`invariance`). Nothing is imported here."""
