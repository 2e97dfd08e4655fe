"""The state codec, pure: a nested training state to a tagged JSON tree plus its tensors, and back, with nothing
read from or written to storage here.

| module | owns |
|---|---|
| ``paths`` | key paths: the text messages name a value by, and the tensor names of the format |
| ``encode`` | :func:`flatten` a state (tensor leaves out, tagged containers), :class:`~lazyckpt.Deferred`, :class:`~lazyckpt.PerRank` |
| ``decode`` | :func:`unflatten` a tree back into the saved structure (plain data only, never code) and walks over encoded trees |
| ``values`` | typed encodings of OmegaConf configs, numpy string arrays, tuple keys and sparse tensors |
| ``preflight`` | :func:`~lazyckpt.check_storable`: the values a checkpoint cannot store, found before training starts |
"""
