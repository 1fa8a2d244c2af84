# SPDX-License-Identifier: Apache-2.0
"""Linear-attention mixers with recurrent state."""
