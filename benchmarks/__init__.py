"""Benchmarks of yogastore against TensorFlow's own readers and YogaDL."""
