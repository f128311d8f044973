"""Interop: export to timm, transformers, TF SavedModel and ONNX; import from timm and transformers."""
