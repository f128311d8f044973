"""Evaluation: accuracy, few-shot probes, the paper's analyses, a checkpoint applied to images."""
