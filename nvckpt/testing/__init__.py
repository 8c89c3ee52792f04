"""Test helpers that ship with nvckpt: the storage protocols' contract tests (``nvckpt.testing.io``), which
every source, target and directory implementation runs, nvckpt's own and a new backend's alike.
Importing this package needs pytest."""
