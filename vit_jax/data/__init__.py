"""Data: `config.dataset` -> global batches of images and labels.

`sources` is the one abstraction (a split as random-access examples); `folder`,
`records`, `shards`, `arrays` (NumPy arrays) and `datasets` (TFDS, presets, the
built-in digits) map every kind of data to it; `images` and `randaug` are the
paper's image preprocessing; `pipeline` turns a source into the train and eval
iterators, whose uint8 batches `on_device` makes [-1, 1] floats (and mixes)
inside the jitted steps.
The class-name files of the public checkpoints ship here too.
"""
