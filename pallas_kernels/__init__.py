"""Pallas Mosaic-GPU kernels for the KIVI cache, and the rules they share with the library.

`layout` (the cache's bit layout), `merge` (the log-sum-exp merge of partial attentions) and
`rotation` (the Hadamard rotation of keys, values and queries) import only jax and numpy:
`kivi_jax` builds on them. The kernels themselves (`kivi_decode`, on
the fragments in `sm90`) load Mosaic GPU and are reached from `kivi_jax.attention`'s dispatch
only, lazily.
"""
