"""Reading a cached version: which records (order, assignment), fetched how, handed out how.

``order`` and ``assignment`` are pure integer math (the epoch's global order,
a rank's span of it); ``reader`` gathers from a local store, ``remote``,
``remote_plan`` and ``diskcache`` from an object store (``read_options`` sets
them); ``stream`` and ``assemble`` turn gathered columns into elements and
batches.
"""
