"""TensorFlow's side of reading: specs, the tf.data bridge, positions, launchers.

``tf_spec`` maps element specs to schemas, ``tf_read`` hands streams to
``tf.data``, ``tf_map`` maps elements, ``position`` and ``steps`` are the
TF-free step arithmetic behind ``yogastore.distributed``, ``agreement`` checks
that ranks agree, ``launchers`` reads Horovod and tf.distribute settings.
``position`` and ``steps`` import no TensorFlow; the others do.
"""
