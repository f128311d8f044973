"""vit_jax: the Vision Transformer (Dosovitskiy et al., ICLR 2021) in JAX/Flax."""

__version__ = '0.1.0'
