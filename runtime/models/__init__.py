# SPDX-License-Identifier: Apache-2.0
"""One module per architecture; each exports `EntryClass` (a class or a list of classes)
named after the HF architecture it serves. `registry` finds them."""
