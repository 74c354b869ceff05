"""What the tests share, not tests themselves: imported as ``support.helpers`` (say).

- ``helpers``: deterministic ways to drive concurrency (no real sleeps), ``PATIENCE``;
  ``virtual_time``: an event loop on a virtual clock; ``storm``: seeded storms and
  their invariants.
- ``servers``, ``pg_server`` (a pytest plugin: the PostgreSQL fixtures), ``pg_bouncer``:
  real servers the session starts; ``faults``: a TCP proxy that freezes, cuts and
  injects.
- ``worker`` and ``pg_worker``: worker processes, run as scripts
  (``python tests/support/worker.py ...``); ``processes`` drives them step by step.
- ``file_checks``, ``redis_checks``, ``pg_checks``: looking at what a backend left,
  from the side; ``decorated``: functions decorated at module level, for pickling.
"""
