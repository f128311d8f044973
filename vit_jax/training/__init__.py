"""Training: optimizers and schedules (`optim`), the step (`steps`) and the loop (`loop`)."""
