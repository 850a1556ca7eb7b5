"""Triton kernels, one family per file, each op registered with torch.library (CPU = torch reference)."""
