# SPDX-License-Identifier: Apache-2.0
"""One op per file: a public function, its pure-torch reference beside it, and a faster
path where the device has one. The reference defines correctness."""
