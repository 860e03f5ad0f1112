"""The dynamic work queue: slices of the epoch's order claimed by workers through the store.

``work_queue`` is the queue and its stream, ``claims`` the claims and leases,
``state`` the resume state and status, ``jobs`` and ``files`` a job's keys and
files, ``lockstep`` the helper for synchronous training, ``cli`` the
``yogastore queue`` commands.
"""
