"""Benchmarks: step speed against timm and the machine's peak, memory, the input pipeline."""
