# SPDX-License-Identifier: Apache-2.0
"""NEXTN (MTP) speculative decoding: drafting, verification and acceptance."""
