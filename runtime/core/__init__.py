# SPDX-License-Identifier: Apache-2.0
"""Plain types every package of the runtime may import: forward modes and the per-forward
context, sampling parameters, requests and their step inputs/outputs, errors; and the
named contracts between packages: `KVPool` (a cache pool), `PoolCommand`s (pool changes
outside a forward) and `Worker` (what the scheduler calls on a worker).

Nothing here imports another runtime package (tests/unit/test_import_layers.py checks).
"""
