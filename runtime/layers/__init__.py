# SPDX-License-Identifier: Apache-2.0
"""Model building blocks. Nothing here knows about scheduling or requests."""
