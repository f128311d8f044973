"""TF SavedModel through `jax2tf`, for TF Serving, TFLite converters and TF users.

The model is serialised as StableHLO (jax2tf's native serialisation, the only
mode in current JAX) for CPU, CUDA GPUs and TPUs, with a polymorphic batch
dimension; the parameters are TF variables beside it, not constants in it.

Signatures (both return {'logits': [B, classes]}, or {'features': ...} for a
checkpoint without a head):

- `serving_default`: float32 images [B, H, W, 3] with values in [-1, 1],
  exactly the model's input (`evaluation.classify.read_image` prepares them).
- `serving_uint8`: uint8 images [B, H, W, 3] (0..255, RGB), scaled to [-1, 1]
  inside the graph. Resizing to H x W stays with the caller.
"""

from vit_jax.evaluation import loader
from vit_jax.interop import torch_layout

PLATFORMS = ('cpu', 'cuda', 'tpu')


def save(loaded: loader.LoadedModel, output: str, platforms=PLATFORMS) -> str:
  """Writes the SavedModel directory `output`; returns it."""
  tf = torch_layout.require('tensorflow', 'tensorflow-cpu')
  from jax.experimental import jax2tf

  size = loaded.spec.image_size
  model = loaded.model
  apply = jax2tf.convert(
    lambda params, images: model.apply({'params': params}, images, train=False),
    polymorphic_shapes=[None, f'(b, {size}, {size}, 3)'],
    native_serialization_platforms=tuple(platforms),
    with_gradient=False,
  )

  module = tf.Module()
  # Variables, not captured constants: the graph stays small and TF can read them.
  module.params = tf.nest.map_structure(lambda x: tf.Variable(x, trainable=False), loaded.params)
  output_name = 'features' if model.num_classes is None else 'logits'

  @tf.function(
    autograph=False,
    input_signature=[tf.TensorSpec([None, size, size, 3], tf.float32, name='images')],
  )
  def serving_default(images):
    return {output_name: apply(module.params, images)}

  @tf.function(
    autograph=False, input_signature=[tf.TensorSpec([None, size, size, 3], tf.uint8, name='images')]
  )
  def serving_uint8(images):
    return serving_default(tf.cast(images, tf.float32) / 127.5 - 1.0)

  module.serving_default = serving_default
  module.serving_uint8 = serving_uint8
  tf.saved_model.save(
    module, output, signatures={'serving_default': serving_default, 'serving_uint8': serving_uint8}
  )
  return output
