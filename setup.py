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
    # Lower bounds: the oldest versions that pass (.ci/oldest.txt, tested by .ci/run).
    'flax>=0.10',
    'jax>=0.7.2',  # jax.set_mesh (0.7.1); 0.7.1 compiles tensor parallelism with 2x the all-reduces
    'jaxlib>=0.7.2',
    'matplotlib',  # analysis figures
    'ml-collections',
    'numpy>=2.0',
    'opencv-python-headless',  # training crops: SIMD bilinear resize (host pipeline)
    'optax>=0.1.8',  # optax.scale_by_learning_rate
    'orbax-checkpoint>=0.11.17',  # older ones name jax.experimental.layout members jax 0.7 lacks
    'pillow',  # image folders, prediction
    'scikit-learn',  # the built-in digits dataset
    'simplejpeg',  # libjpeg-turbo decoding with DCT scaling (host pipeline)
    'tensorboard',  # event files, written without TensorFlow
    # gs:// paths (workdirs, datasets, checkpoints) without TensorFlow, as orbax's epath does.
    'fsspec',
    'gcsfs',
    'google-crc32c',  # the checksums of TFRecord shards and TensorBoard event files
  ],
  extras_require={
    # Export to PyTorch (timm, transformers), ONNX. torch is unpinned: on a
    # machine without a GPU install its CPU build first (README: Set-up), which
    # this then keeps. timm itself is not needed (its file format is ours to
    # write; ONNX traces vit_jax.interop.torch_vit).
    'export': ['torch', 'transformers', 'safetensors', 'onnx', 'onnxscript', 'onnxruntime'],
    # The peers the tests compare against, except torch and timm: PyPI's Linux
    # torch is a multi-GB CUDA build, so torch (CPU build) and timm are
    # installed apart (README: Set-up; .ci/run); their tests skip without them.
    'test': [
      'pytest',
      'pytest-xdist',  # a worker per core: the suite in about half the time on 2 cores
      'ruff',
      # libtpu: the TPU compiler that `python -m vit_jax.compile` runs on any Linux
      # x86-64 machine (no TPU needed).
      'jax[tpu]',
      'transformers',
      'safetensors',
      'onnx',
      'onnxscript',
      'onnxruntime',
      'nbclient',
      # The oracles (our pipeline against the official TensorFlow ops), TFDS
      # datasets prepared by TFDS itself, the SavedModel export.
      'tensorflow-cpu',
      'tensorflow-datasets',
      'importlib_resources',
      'nbformat',
      'ipykernel',
    ],
    # TensorFlow where a job truly needs it: downloading and building a TFDS
    # dataset (python -m vit_jax.prepare; reading a prepared one needs neither).
    # The SavedModel export needs tensorflow-cpu alone.
    # (tensorflow-datasets' builders import importlib_resources on every Python
    # but declare it only for Python < 3.9.)
    'tfds': ['tensorflow-cpu', 'tensorflow-datasets', 'importlib_resources'],
    'gpu': ['jax[cuda12]'],
    'tpu': ['jax[tpu]'],
  },
)
