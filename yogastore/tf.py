"""TensorFlow adapters, the public front of the modules that import TensorFlow.

* ``schema_from_element_spec`` / ``element_spec_from_schema``: tf.data specs
  <-> yogastore schemas (``yogastore.train.tf_spec``).
* ``dataset_items`` / ``numpy_records``: the first pass over a
  ``tf.data.Dataset``, batched when every component has a fixed shape
  (``yogastore.build.tf_build``).
* ``to_tf_dataset`` / ``record_dataset``: a stream as a ``tf.data.Dataset``
  (``yogastore.train.tf_read``); ``Batching``: how variable-length dense
  components are batched (``yogastore.train.tf_map``).

These modules, ``distributed``, ``launchers`` and ``keras_callback`` import TensorFlow at
import time; ``import yogastore`` imports none of them.
"""

from __future__ import annotations

from yogastore.build.tf_build import dataset_items, numpy_records
from yogastore.train.tf_map import Batching
from yogastore.train.tf_read import record_dataset, to_tf_dataset
from yogastore.train.tf_spec import element_spec_from_schema, schema_from_element_spec

__all__ = [
    "Batching",
    "dataset_items",
    "element_spec_from_schema",
    "numpy_records",
    "record_dataset",
    "schema_from_element_spec",
    "to_tf_dataset",
]
