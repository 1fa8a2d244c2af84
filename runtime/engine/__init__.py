# SPDX-License-Identifier: Apache-2.0
"""The in-process engine used by the server, the scripts and the tests."""
