"""The cost model of a decode step (the part needed so far: how many experts a pass touches).

A verify pass over n tokens in a top-k of E MoE layer reads the union of the experts its tokens chose.
If each token chose k distinct experts independently and uniformly, an expert is missed by all n tokens
with probability (1 - k/E)^n, so the expected union is E (1 - (1 - k/E)^n): 8 for one token, about 15.75
for two at E=256, k=8. Real routing is correlated between neighbouring tokens, so measured unions are
smaller; the benchmark sets the two side by side.
"""

from __future__ import annotations


def expected_union(n_experts: int, top_k: int, n_tokens: int) -> float:
    """Expected number of distinct experts n tokens touch under independent uniform top-k routing."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** n_tokens)
