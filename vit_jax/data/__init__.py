"""Data: `config.dataset` -> global batches of images and labels.

`sources` is the one abstraction (a split as random-access examples); `folder`,
`records`, `shards` and `datasets` (TFDS, presets, the built-in digits) map
every kind of data to it; `preprocess` and `randaug` are the paper's image
preprocessing; `pipeline` turns a source into the train and eval iterators.
The class-name files of the public checkpoints ship here too.
"""
