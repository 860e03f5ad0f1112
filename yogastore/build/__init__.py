"""The first pass: a source's elements checked, cast and written as chunks plus a manifest.

``tf_build`` turns a ``tf.data`` source into records, ``casts`` refuses lossy
casts, ``buildcheck`` guards a build (infinite sources, limits, fingerprints,
leftovers of failed builds), ``writer`` encodes chunks and commits the
manifest, ``progress`` reports it.
"""
