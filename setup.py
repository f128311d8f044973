"""vit_jax: the Vision Transformer paper in JAX/Flax."""

import setuptools

setuptools.setup(
  name='vit_jax',
  version='0.1.0',
  description='Vision Transformer (An Image is Worth 16x16 Words) in JAX/Flax',
  long_description=open('README.md', encoding='utf-8').read(),
  long_description_content_type='text/markdown',
  license='Apache-2.0',
  packages=setuptools.find_packages(include=['vit_jax', 'vit_jax.*']),
  # ImageNet-1k / ImageNet-21k class names for `python -m vit_jax.predict`.
  package_data={'vit_jax': ['data/*.txt']},
  python_requires='>=3.10',
  install_requires=[
    'absl-py',
    'array-record',  # index-addressable shards for the input pipeline
    'flax>=0.10',
    'jax>=0.5',
    'matplotlib',  # analysis figures
    'ml-collections',
    'numpy',
    'optax',
    'orbax-checkpoint',
    'pillow',  # image folders, prediction
    'scikit-learn',  # the built-in digits dataset
    'tensorboard',
    'tensorflow-cpu',  # tf.data and gs:// file access
    'tensorflow-datasets',
  ],
  extras_require={
    # Export to PyTorch (timm, transformers), ONNX.
    'export': ['torch', 'timm', 'transformers', 'safetensors', 'onnx', 'onnxscript', 'onnxruntime'],
    # torch is pinned to the build CI has as a CPU wheel (any recent torch
    # works). timm is left out: on CPU-only machines PyPI's torchvision,
    # which timm imports, is a CUDA build; README "Set-up" installs it apart.
    'test': [
      'pytest',
      'ruff',
      # libtpu: the TPU compiler that `python -m vit_jax.compile` runs on any Linux
      # x86-64 machine (no TPU needed).
      'jax[tpu]',
      'torch==2.13.0',
      'transformers',
      'safetensors',
      'onnx',
      'onnxscript',
      'onnxruntime',
      'nbclient',
      'nbformat',
      'ipykernel',
    ],
    'gpu': ['jax[cuda12]'],
    'tpu': ['jax[tpu]'],
  },
)
