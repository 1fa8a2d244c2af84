# SPDX-License-Identifier: Apache-2.0
"""Gated delta rule (Gated DeltaNet linear attention), batched over padded sequences.

Per value head, with state `S [dk, dv]` (fp32) and per step t:
    S <- exp(g_t) S                       decay (g_t <= 0, log space)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   delta-rule write
    o_t = S^T q_t
Inputs `[B, L, H, d]` (q, k already L2-normalised and q scaled by 1/sqrt(dk)); a padded
position must carry `g = 0`, `beta = 0` so it leaves the state untouched.

`chunked_gated_delta_rule` is the torch reference used everywhere: chunks of C steps are
solved in closed form (a unit-triangular system, as in the DeltaNet paper) and only the
chunks are scanned. With `return_states` it also gives the state after every position
(speculative verify keeps one per draft position to roll back to).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Step-by-step statement of the rule (the test oracle). Returns (out, final state)."""
    state = state.clone()
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        memory = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - memory) * beta[:, t].unsqueeze(-1)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1), state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
    return_states: bool = False,
):
    """`q, k [B, L, H, dk]`, `v [B, L, H, dv]`, `g, beta [B, L, H]`, `state [B, H, dk, dv]`.

    Returns `(out [B, L, H, dv], final_state [B, H, dk, dv], states)` where `states` is
    `[B, L, H, dk, dv]` (state after each position) when asked, else None. All math in fp32.
    """
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    chunk = length if return_states else min(chunk_size, max(length, 1))
    pad = (-length) % chunk
    q, k, v = (
        F.pad(x.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v)
    )  # [B, H, L', d]
    g, beta = (F.pad(x.float(), (0, 0, 0, pad)).transpose(1, 2) for x in (g, beta))  # [B, H, L']
    n = q.shape[2] // chunk
    q, k, v = (x.reshape(batch, heads, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, n, chunk) for x in (g, beta))

    cum = g.cumsum(-1)  # log decay from the chunk start through each position
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (
        (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    )  # [.., i, j]
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # (I + strictly-lower(beta K K^T decay)) U = V_beta solves the within-chunk delta writes
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~lower.tril(-1), 0) + torch.eye(chunk, device=q.device)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)

    state = state.float()
    outs, all_states = [], None
    for c in range(n):
        new_v = values[:, :, c] - k_decayed[:, :, c] @ state  # what the old state does not predict
        outs.append(q_decayed[:, :, c] @ state + attn[:, :, c] @ new_v)
        if return_states:  # S_j = exp(cum_j) S_0 + sum_{i<=j} exp(cum_j - cum_i) k_i new_v_i^T
            all_states = cum[:, :, c].exp()[..., None, None] * state.unsqueeze(2) + torch.einsum(
                "bhji,bhik,bhiv->bhjkv", decay[:, :, c], k[:, :, c], new_v
            )
        state = (
            state * cum[:, :, c, -1].exp()[..., None, None]
            + k_to_end[:, :, c].transpose(-1, -2) @ new_v
        )
    out = torch.stack(outs, dim=2).reshape(batch, heads, -1, dv)[:, :, :length].transpose(1, 2)
    if all_states is not None:
        all_states = all_states[:, :, :length].transpose(1, 2)  # [B, L, H, dk, dv]
    return out, state, all_states
