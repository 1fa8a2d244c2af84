# SPDX-License-Identifier: Apache-2.0
"""Plain types every package of the runtime may import: forward modes and the per-forward
context, sampling parameters, requests and their step inputs/outputs, errors.

Nothing here imports another runtime package (tests/unit/test_import_layers.py checks).
"""
