"""Configs: model architectures (`configs.models`), experiment defaults and the paper's recipes.

The experiment files users pass to `--config` live in the repository's
`configs/` folder; they call `recipes` and `common` here.
"""
