"""Data: `config.dataset` -> global batches of images and labels.

`sources` is the one abstraction (a split as random-access examples); the
`readers` (the built-in digits, NumPy arrays, shards, image folders, TFDS; shards
and TFDS files through `records` and `example_proto`) map every kind of data to
it, and `datasets` opens a dataset's splits through the reader that claims it;
`images` and `randaug` are the paper's image preprocessing; `pipeline` turns a
source into the train and eval iterators, whose uint8 batches `on_device`
makes [-1, 1] floats (and mixes) inside the jitted steps.
The class-name files of the public checkpoints ship here too.
"""
